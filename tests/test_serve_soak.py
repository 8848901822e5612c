"""Host memory stays flat under load (issue 53, item 5): a bounded loopback soak.

``pyggspec serve -np 4 --spec-type draft-mtp`` on the tiny MoE model, in its own process so
its resident size is its own; 32 concurrent clients for rounds of valid requests (four
endpoints, streams or not, greedy or seeded sampling), malformed bodies and streams cut
mid-way. Every valid answer equals the same request sent alone before the soak; every bad
body is a 4xx. After warm-up the server's RSS grows by less than ``RSS_BOUND`` however many
rounds follow (before ``pyggspec serve`` fixed glibc's mmap threshold it grew ~8 KB a
request without end: ~10 MiB over these rounds; see docs/serving.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pyggspec.memory.host_heap import rss_bytes

CLIENTS = 32
WARM_ROUNDS = 8
ROUNDS = 40  # 1,280 requests after warm-up
RSS_BOUND = 5 << 20  # bytes of growth allowed after warm-up
WORDS = ["alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps", "over",
         "lazy", "dog", "one", "two"]


@pytest.fixture(scope="module")
def server(models):
    path = models.moe(dtype="f32", agreement=0.9)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyggspec", "serve", "-m", str(path), "--port", "0", "-np", "4",
         "-c", "1024", "-t", "1", "--spec-type", "draft-mtp", "--log-level", "warning",
         "--max-queue", "256"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "listening on" in line:
                url = line.split("listening on ")[1].split()[0]
        assert url, "no startup line"
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _valid(i: int) -> tuple[str, dict]:
    """Valid request ``i`` of the pool: (path, body); streams carry ``stream``."""
    r = random.Random(i)
    words = " ".join(r.choice(WORDS) for _ in range(r.randrange(1, 30)))
    n = r.randrange(2, 14)
    sampling = {"temperature": 0.7, "seed": 100 + i} if i % 2 else {"temperature": 0.0}
    kind = i % 5
    if kind == 0:
        return "/completion", {"prompt": words, "n_predict": n, **sampling}
    if kind == 1:
        return "/completion", {"prompt": [260 + (i * 7 + k) % 700 for k in range(r.randrange(1, 40))],
                               "n_predict": n, "return_tokens": True, **sampling}
    if kind == 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                        "max_tokens": n, **sampling}
    if kind == 3:
        return "/completion", {"prompt": words, "n_predict": n, "stream": True, **sampling}
    return "/v1/completions", {"prompt": words, "max_tokens": n, "stream": True, **sampling}


def _text(path: str, data: dict | list) -> tuple:
    """What an answer says (a stream's chunks joined): text and tokens."""
    if isinstance(data, list):  # SSE chunks
        if path == "/completion":
            return "".join(d.get("content", "") for d in data), None
        return "".join(c["text"] for d in data for c in d.get("choices", [])), None
    if path == "/completion":
        return data["content"], data.get("tokens")
    if path == "/v1/chat/completions":
        return data["choices"][0]["message"]["content"], None
    return data["choices"][0]["text"], None


def _ask(http: httpx.Client, path: str, body: dict) -> tuple[int, tuple]:
    if not body.get("stream"):
        r = http.post(path, json=body)
        return r.status_code, _text(path, r.json()) if r.status_code == 200 else ()
    with http.stream("POST", path, json=body) as r:
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return r.status_code, _text(path, chunks)


BAD = [b"{", b'{"prompt": []}', b'{"prompt": "x", "top_k": "5"}', b'{"messages": 5}',
       json.dumps({"prompt": [3] * 5000}).encode()]
POOL = 40


def _job(http: httpx.Client, want: dict, i: int) -> str | None:
    """Client request ``i`` (malformed, a cut stream, or one from the pool); None when it
    was answered as it should."""
    r = random.Random(i)
    kind = r.random()
    if kind < 0.2:  # malformed
        path = r.choice(["/completion", "/v1/chat/completions", "/v1/completions"])
        x = http.post(path, content=r.choice(BAD), headers={"content-type": "application/json"})
        return None if 400 <= x.status_code < 500 else f"bad body: {x.status_code}"
    if kind < 0.35:  # a stream cut after a few lines
        with http.stream("POST", "/completion", json={
                "prompt": " ".join(r.choice(WORDS) for _ in range(8)), "n_predict": 200,
                "ignore_eos": True, "stream": True}) as x:
            lines = x.iter_lines()
            for _ in range(r.randrange(1, 4)):
                next(lines, None)
            return None if x.status_code == 200 else f"cut stream: {x.status_code}"
    k = r.randrange(POOL)
    status, got = _ask(http, *_valid(k))
    if status != 200 or got != want[k]:
        return f"request {k}: {status} {got!r} != alone {want[k]!r}"
    return None


@pytest.mark.slow
def test_rss_flat_and_answers_equal_alone_under_load(server):
    proc, url = server
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    with httpx.Client(base_url=url, timeout=120, limits=limits) as http:
        want = {}
        for k in range(POOL):  # each request alone first
            status, want[k] = _ask(http, *_valid(k))
            assert status == 200, (k, status)
        rss: list[int] = []
        with ThreadPoolExecutor(CLIENTS) as ex:
            for rd in range(WARM_ROUNDS + ROUNDS):
                ids = range(rd * CLIENTS, (rd + 1) * CLIENTS)
                errors = [e for e in ex.map(lambda i: _job(http, want, i), ids) if e]
                assert not errors, errors[:3]
                rss.append(rss_bytes(proc.pid))
        assert http.get("/health").status_code == 200
    warm = rss[WARM_ROUNDS - 1]
    growth = max(rss[WARM_ROUNDS:]) - warm
    mib = [round(x / 2**20, 1) for x in rss]
    assert growth < RSS_BOUND, f"RSS grew {growth / 2**20:.1f} MiB after warm-up: {mib}"
