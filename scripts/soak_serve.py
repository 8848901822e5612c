#!/usr/bin/env python3
"""Host-memory soak of ``pyggspec serve``: its resident size (RSS) under sustained load.

Starts ``pyggspec serve -np 4 -c 1024 -t 1 --spec-type draft-mtp`` (plus ``--extra`` flags)
on ``-m`` (default: the tiny generated f32 MoE, written to a temp dir) and runs ``--rounds``
rounds of ``--clients`` concurrent requests: valid ones on four endpoints (streams or not,
greedy or seeded), malformed bodies (must be 4xx) and streams cut after a few lines. Prints
the server's RSS every 10 rounds, then one JSON line: RSS after ``--warm`` rounds, at the
end, the largest growth after warm-up, and the answers by kind and status.

    python3 scripts/soak_serve.py --rounds 300          # docs/serving.md, "Host memory"
    python3 scripts/soak_serve.py -m model.gguf --extra "-c 16384" --rounds 60

The bounded version with assertions is ``tests/test_serve_soak.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pyggspec.memory.host_heap import rss_bytes

WORDS = ["alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps", "over",
         "lazy", "dog", "one", "two", "three"]
BAD = [b"{", b'{"prompt": []}', b'{"prompt": "x", "top_k": "5"}', b'{"messages": 5}',
       json.dumps({"prompt": [3] * 5000}).encode()]


def request(http: httpx.Client, i: int) -> tuple[str, int | str]:
    """Request ``i`` (its kind and body drawn from ``i``): (kind, status or error)."""
    r = random.Random(i)
    kind = r.choice(["completion", "completion", "chat", "stream", "oai_stream", "cut",
                     "bad", "chat_stream"])
    n = r.randrange(2, 16)
    words = " ".join(r.choice(WORDS) for _ in range(r.randrange(1, 40)))
    sampling = {"temperature": r.choice([0.0, 0.7]), "seed": i}
    try:
        if kind == "bad":
            path = r.choice(["/completion", "/v1/chat/completions", "/v1/completions"])
            x = http.post(path, content=r.choice(BAD),
                          headers={"content-type": "application/json"})
            return kind, x.status_code
        if kind == "completion":
            return kind, http.post("/completion", json={"prompt": words, "n_predict": n,
                                                        **sampling}).status_code
        if kind == "chat":
            return kind, http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": words}], "max_tokens": n,
                **sampling}).status_code
        if kind == "chat_stream":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": words}]}
        elif kind == "oai_stream":
            path, body = "/v1/completions", {"prompt": words}
        else:
            path, body = "/completion", {"prompt": words}
        cut = kind == "cut"
        body.update(stream=True, max_tokens=200 if cut else n, n_predict=200 if cut else n,
                    ignore_eos=cut, **sampling)
        with http.stream("POST", path, json=body) as x:
            lines = x.iter_lines()
            if cut:
                for _ in range(r.randrange(1, 4)):
                    next(lines, None)
            else:
                for _ in lines:
                    pass
            return kind, x.status_code
    except httpx.HTTPError as e:
        return kind, type(e).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--warm", type=int, default=10, help="rounds before the baseline RSS")
    ap.add_argument("--extra", default="", help="more flags for pyggspec serve")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = a.model
    if model is None:
        from pyggspec.testing import cached_model, tiny_moe
        model = cached_model(tiny_moe(dtype="f32", agreement=0.9), Path(tmp.name))
    cmd = [sys.executable, "-m", "pyggspec", "serve", "-m", str(model), "--port", "0",
           "-np", "4", "-c", "1024", "-t", "1", "--spec-type", "draft-mtp",
           "--log-level", "warning", "--max-queue", "256", *a.extra.split()]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        while url is None:
            line = proc.stderr.readline()
            if not line:
                print("the server did not start", file=sys.stderr)
                return 1
            if "listening on" in line:
                url = line.split("listening on ")[1].split()[0]
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        counts: dict[str, int] = {}
        rss: list[int] = []
        t0 = time.monotonic()
        limits = httpx.Limits(max_connections=a.clients + 4)
        with httpx.Client(base_url=url, timeout=120, limits=limits) as http, \
                ThreadPoolExecutor(a.clients) as ex:
            for rd in range(a.rounds):
                ids = range(rd * a.clients, (rd + 1) * a.clients)
                for kind, status in ex.map(lambda i: request(http, i), ids):
                    key = f"{kind}:{status}"
                    counts[key] = counts.get(key, 0) + 1
                rss.append(rss_bytes(proc.pid))
                if rd % 10 == 9:
                    print(f"round {rd + 1}: {(rd + 1) * a.clients} requests, "
                          f"{time.monotonic() - t0:.0f} s, RSS {rss[-1] / 2**20:.1f} MiB",
                          flush=True)
        warm = rss[min(a.warm, len(rss)) - 1]
        after = rss[a.warm:] or [warm]
        print(json.dumps({"requests": a.rounds * a.clients, "rss_warm_mib": round(warm / 2**20, 1),
                          "rss_end_mib": round(rss[-1] / 2**20, 1),
                          "growth_after_warm_mib": round((max(after) - warm) / 2**20, 1),
                          "answers": dict(sorted(counts.items()))}))
        bad = [k for k in counts if not (k.endswith(":200") or k.startswith("bad:4"))]
        return 1 if bad else 0
    finally:
        proc.terminate()
        proc.wait(60)
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
