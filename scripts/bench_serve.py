#!/usr/bin/env python3
"""Serving benchmark: ``pyggspec serve`` vs ``llama-server``, same GGUF, same flags.

For each mode (plain, ``--spec-type draft-mtp``) and repetition, each engine in turn (the
order alternates per repetition; one server at a time, stopped before the other starts: two
ggml CPU users at once slow each other down) is started with the same flags, warmed up, and
loaded with 1, 4 and 8 concurrent clients. Every client sends ``--requests`` streamed
``/completion`` requests (the shape both servers share) with a distinct token-id prompt of
``--prompt`` tokens and ``--gen`` greedy tokens (``ignore_eos``, no prompt cache reuse).

Per engine, mode and client count: aggregate tokens/s (all generated tokens / wall time),
per-request tokens/s (the server's own ``predicted_per_second``, median), time to first
token (client side, median) and draft acceptance. Ratios pyggspec / llama-server are paired
per repetition, then the median is reported; a table and one JSON line are printed.

``-c`` is the context per slot: both servers get ``-c (ctx * np)``, the total, as
llama-server reads it (``n_ctx / np`` per slot with an explicit ``-np``), and pyggspec
serve reads it the same way.

    scripts/build_llamacpp_tools.sh llama-server           # once
    python3 scripts/bench_serve.py                         # 0.8B-shaped q8_0, agreement 0.95
    python3 scripts/bench_serve.py -m model.gguf --reps 3 -t 2 --clients 1 4 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from typing_extensions import Self

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib import add_offload_args, free_port, llama_offload_flags, set_offload


def default_model() -> Path:
    """The 0.8B-shaped constructed-agreement model the other benchmarks use (q8_0, 0.95)."""
    return benchlib.generated_model(0.95, "q8_0")


def server_cmd(engine: str, args: argparse.Namespace, spec: bool, port: int) -> list[str]:
    """The same flags for both servers, llama-server's names and meanings (-c is the total
    of all slots for both)."""
    flags = ["-m", str(args.model), "-t", str(args.threads), "-np", str(args.parallel),
             "--host", "127.0.0.1", "--port", str(port), "--temp", "0",
             "-c", str(args.ctx * args.parallel)]
    if args.no_repack:
        flags.append("--no-repack")
    if spec:
        flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(args.n_max)]
    flags += llama_offload_flags()  # -ngl / -dev: both servers take llama.cpp's flag names
    if engine == "llama-server":
        exe = benchlib.TOOLS / "llama-server"
        if not exe.exists():
            sys.exit(f"bench_serve: {exe} not found; run scripts/build_llamacpp_tools.sh "
                     "llama-server first")
        return [str(exe), *flags]
    return [sys.executable, "-m", "pyggspec", "serve", *flags, "--log-level", "warning"]


class Server:
    """One server process, up until ``/health`` says ok; stopped (SIGTERM) on exit."""

    def __init__(self, engine: str, args: argparse.Namespace, spec: bool) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_cmd(engine, args, spec, self.port)
        self.engine = engine
        self.server = benchlib.ServerProcess(self.cmd, self.url, engine, timeout=900)

    def __enter__(self) -> Self:
        try:
            self.server.start()
        except RuntimeError as e:
            sys.exit(f"bench_serve: {e}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=60)


def one_request(url: str, prompt: list[int], n_gen: int) -> dict:
    """One streamed /completion: client-side TTFT, the server's timings."""
    body = {"prompt": prompt, "n_predict": n_gen, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    last = None
    with httpx.stream("POST", url + "/completion", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            d = json.loads(line[6:])
            if ttft is None and (d.get("tokens") or d.get("content")):
                ttft = time.perf_counter() - t0
            if d.get("stop"):
                last = d
    if last is None:
        raise RuntimeError("stream ended without a final chunk")
    t = last.get("timings", {})
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "n": int(t.get("predicted_n", last.get("tokens_predicted", 0))),
            "tps": float(t.get("predicted_per_second", 0.0)),
            "draft_n": int(t.get("draft_n", 0)), "draft_acc": int(t.get("draft_n_accepted", 0))}


def n_vocab(url: str) -> int:
    """From ``/v1/models`` (both servers report ``meta.n_vocab``)."""
    return int(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]["n_vocab"])


def load(url: str, clients: int, n_requests: int, n_prompt: int, n_gen: int,
         salt: int, vocab: int) -> dict:
    """``clients`` threads, each sending ``n_requests`` requests one after another; every
    prompt is different (no prompt reuse) and the same for both engines."""
    results: list[dict] = []
    lock = threading.Lock()
    span = max(1, min(vocab, 5000) - 300)

    def client(c: int) -> None:
        for i in range(n_requests):
            base = salt * 7919 + c * 104729 + i * 1009
            prompt = [300 + (base + k * 37) % span for k in range(n_prompt)]
            r = one_request(url, prompt, n_gen)
            with lock:
                results.append(r)

    try:
        wall = benchlib.concurrently(client, clients)
    except Exception as e:
        raise RuntimeError(f"a client failed: {e!r}") from e
    n = sum(r["n"] for r in results)
    drafted = sum(r["draft_n"] for r in results)
    return {"agg_tps": n / wall, "req_tps": statistics.median(r["tps"] for r in results),
            "ttft_ms": 1000 * statistics.median(r["ttft"] for r in results),
            "accept": sum(r["draft_acc"] for r in results) / drafted if drafted else None,
            "n_requests": len(results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (default: the 0.8B-shaped bench "
                                                     "model with its constructed MTP head)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-np", "--parallel", type=int, default=4, help="server slots")
    ap.add_argument("-c", "--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--n-max", type=int, default=3, help="--spec-draft-n-max")
    ap.add_argument("--modes", nargs="+", default=["plain", "draft-mtp"],
                    choices=["plain", "draft-mtp"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-repack", action="store_true", help="pass --no-repack to both")
    add_offload_args(ap)
    args = ap.parse_args()
    set_offload(args)
    if args.model is None:
        args.model = default_model()
    if args.prompt + args.gen > args.ctx:
        sys.exit("bench_serve: --prompt + --gen must fit -c")
    engines = ["pyggspec", "llama-server"]
    # rows[(engine, mode, clients)] -> one measurement per repetition
    rows: dict[tuple[str, str, int], list[dict]] = {}
    for mode in args.modes:
        for rep in range(args.reps):
            order = engines if rep % 2 == 0 else engines[::-1]
            for engine in order:
                with Server(engine, args, mode == "draft-mtp") as srv:
                    one_request(srv.url, [301, 302, 303, 304], 8)  # warm-up
                    vocab = n_vocab(srv.url)
                    for c in args.clients:
                        r = load(srv.url, c, args.requests, args.prompt, args.gen,
                                 salt=rep * 31 + c, vocab=vocab)
                        rows.setdefault((engine, mode, c), []).append(r)
                        acc = f" accept {r['accept']:.3f}" if r["accept"] is not None else ""
                        print(f"{mode:9s} rep {rep} {engine:12s} clients {c}: "
                              f"{r['agg_tps']:7.2f} t/s aggregate, {r['req_tps']:7.2f} t/s "
                              f"per request, TTFT {r['ttft_ms']:8.1f} ms{acc}",
                              file=sys.stderr, flush=True)
                time.sleep(1)

    def med(engine: str, mode: str, c: int, key: str) -> float | None:
        vals = [r[key] for r in rows[(engine, mode, c)] if r[key] is not None]
        return statistics.median(vals) if vals else None

    def ratio(mode: str, c: int, key: str) -> float:
        pairs = zip(rows[("pyggspec", mode, c)], rows[("llama-server", mode, c)])
        return statistics.median(a[key] / b[key] for a, b in pairs if b[key])

    print(f"\n{args.model.name}: {args.threads} threads, -np {args.parallel}, ctx {args.ctx}/slot, "
          f"prompt {args.prompt}, gen {args.gen}, {args.requests} requests/client, "
          f"{args.reps} paired reps (medians)")
    head = (f"{'mode':9s} {'clients':>7s} {'engine':12s} {'agg t/s':>8s} {'req t/s':>8s} "
            f"{'TTFT ms':>8s} {'accept':>7s}")
    print(head)
    summary = []
    for mode in args.modes:
        for c in args.clients:
            for engine in engines:
                acc = med(engine, mode, c, "accept")
                print(f"{mode:9s} {c:7d} {engine:12s} {med(engine, mode, c, 'agg_tps'):8.2f} "
                      f"{med(engine, mode, c, 'req_tps'):8.2f} "
                      f"{med(engine, mode, c, 'ttft_ms'):8.1f} "
                      f"{acc if acc is None else round(acc, 3)!s:>7s}")
            s = {"mode": mode, "clients": c,
                 "agg_tps_ratio": ratio(mode, c, "agg_tps"),
                 "req_tps_ratio": ratio(mode, c, "req_tps"),
                 "ttft_ratio": ratio(mode, c, "ttft_ms")}
            print(f"{'':9s} {'':7s} {'ratio':12s} {s['agg_tps_ratio']:8.3f} "
                  f"{s['req_tps_ratio']:8.3f} {s['ttft_ratio']:8.3f}   (pyggspec / llama-server;"
                  " TTFT: lower is better)")
            summary.append({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    print(json.dumps({"bench": "serve", "model": args.model.name, "threads": args.threads,
                      "parallel": args.parallel, "prompt": args.prompt, "gen": args.gen,
                      "reps": args.reps, "ratios": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
