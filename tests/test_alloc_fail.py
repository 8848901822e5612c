"""Never an abort on memory (issue 53, item 3): an allocation that fails is one line naming
the device, what was being allocated and the flag to change at start-up; at run time the
request that could not get memory fails alone (PyggspecError in the Engine, 503 in the
server) while the others go on with the tokens they get alone.

Failures are injected with the test-only hook :mod:`pyggspec.ggml.faults` (the 0.3.36
rpc-server has no memory limit, so a real shortage cannot be made reliably on CPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from pyggspec import SamplingParams, SpecConfig
from pyggspec.cli import main
from pyggspec.errors import OutOfMemory, PyggspecError
from pyggspec.ggml import faults
from pyggspec.serving.request import Request, RequestFailed

N_CTX = 256
PROMPT_A = [5, 9, 13, 17, 21]
PROMPT_B = [7, 3, 11, 2, 19, 23, 29]  # another length than any verify shape: a new graph


@pytest.fixture(scope="module")
def model(models):
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(autouse=True)
def _no_fault():
    faults.reset()
    yield
    faults.reset()


def _run_cli(model, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["run", "-m", str(model), "-p", "hello", "-n", "2",
                                  "-c", str(N_CTX), "--spec-type", "draft-mtp", *args])
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("kind,flag", [("kv", "-c"), ("recurrent", "--spec-rollback"),
                                       ("mtp-kv", "--spec-type"), ("compute", "-ub")])
def test_startup_failure_is_one_line(model, kind, flag):
    faults.inject(kind)
    code, _, err = _run_cli(model)
    assert faults.hits and faults.hits[0].startswith(kind)
    line = err.strip()
    assert code == 1 and "\n" not in line and "Traceback" not in line, err
    assert line.startswith("pyggspec: CPU") and "out of memory allocating" in line
    assert flag in line


def test_startup_weights_on_a_device(model, rpc_device):
    """Weights copied to a device (the CPU's are mapped from the file): the device named,
    -ngl / -ncmoe / --fit as the flags."""
    faults.inject("weights")
    code, _, err = _run_cli(model, "-dev", rpc_device.name, "-ngl", "99")
    line = err.strip()
    assert code == 1 and "\n" not in line, err
    assert line.startswith(f"pyggspec: {rpc_device.name}: out of memory allocating")
    assert "weights on" in line and "-ngl" in line and "--fit" in line


def test_startup_env_hook_in_a_fresh_process(model):
    """The environment form, as a user would see it: exit code 1, one line, no traceback."""
    env = {**os.environ, faults.ENV: "kv"}
    r = subprocess.run([sys.executable, "-m", "pyggspec", "run", "-m", str(model), "-p", "hi",
                        "-n", "2", "-c", str(N_CTX)], env=env, capture_output=True, text=True, check=False,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyggspec: CPU: out of memory allocating")
    assert "kv on CPU" in lines[0] and "-c" in lines[0]


def _alone(engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate(prompt, max_tokens=n, ignore_eos=True).tokens


def test_runtime_failure_fails_one_request(model, make_engine):
    """B's prompt graph cannot be allocated: B fails with the device's error, A (decoding in
    the same steps, with speculation) ends with the tokens it gets alone; the engine goes
    on serving (B again, alone, succeeds)."""
    e = make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=3), sampling=SamplingParams(temp=0.0))
    want_a, want_b = _alone(e, PROMPT_A, 24), _alone(e, PROMPT_B, 8)
    a = e.submit(Request(PROMPT_A, max_tokens=24, ignore_eos=True))
    seen: list[int] = []
    a.add_callback(lambda it: seen.extend(getattr(it, "tokens", None) or ())
                   if not a.done else None)
    while len(seen) < 4:
        assert e.step()
    b = e.submit(Request(PROMPT_B, max_tokens=8, ignore_eos=True))
    faults.inject("graph")  # the next graph allocated is B's prompt chunk (run first)
    while e.step():
        pass
    assert faults.hits
    with pytest.raises(RequestFailed) as info:
        b.result()
    assert isinstance(info.value.__cause__, OutOfMemory)
    assert "out of memory allocating" in str(info.value)
    assert a.result().tokens == want_a
    assert _alone(e, PROMPT_B, 8) == want_b
    # generate() raises the device's error itself (a PyggspecError), in one line
    faults.inject("graph")
    with pytest.raises(PyggspecError, match="out of memory allocating") as info2:
        e.generate(PROMPT_B, max_tokens=4, ignore_eos=True)
    assert "\n" not in str(info2.value)
    assert _alone(e, PROMPT_A, 24) == want_a


def _seen(handle) -> list[int]:
    """The tokens ``handle`` has emitted so far (filled from the scheduler's callbacks)."""
    seen: list[int] = []
    handle.add_callback(lambda it: seen.extend(getattr(it, "tokens", None) or ())
                        if not handle.done else None)
    return seen


@pytest.mark.parametrize("spec,nth", [(True, 1), (True, 2), (False, 1)],
                         ids=["draft-graph", "verify-graph", "plain-step"])
def test_runtime_failure_in_a_shared_decode_step(model, make_engine, spec, nth, caplog):
    """A and B decode in the same batch when a graph of that step cannot be allocated
    (with speculation: the 1st allocation is the MTP head's draft graph, the 2nd the
    target's verify graph; without: the plain step's): B, the newest, fails with the
    device's error; A goes on in the same step without it, and ends with the tokens it
    gets alone."""
    kw = {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=3)} if spec else {}
    e = make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1,
                    sampling=SamplingParams(temp=0.0), **kw)
    want_a, want_b = _alone(e, PROMPT_A, 40), _alone(e, PROMPT_B, 30)
    a = e.submit(Request(PROMPT_A, max_tokens=40, ignore_eos=True))
    seen_a = _seen(a)
    while len(seen_a) < 3:
        assert e.step()
    b = e.submit(Request(PROMPT_B, max_tokens=30, ignore_eos=True))
    seen_b = _seen(b)
    while not seen_b:  # B's prompt is done: both decode in every later step
        assert e.step()
    assert not a.done and len(seen_a) < 40
    faults.inject("graph", nth)
    n_a = len(seen_a)
    with caplog.at_level(logging.WARNING, "pyggspec.worker"):
        assert e.step()
    assert faults.hits, "the fault was not hit"
    assert "decode step" in caplog.text and "the newest of its 2 sequences" in caplog.text
    assert len(seen_a) > n_a  # A went on in the very step B failed in
    while e.step():
        pass
    with pytest.raises(RequestFailed) as info:
        b.result()
    assert isinstance(info.value.__cause__, OutOfMemory)
    assert "out of memory allocating" in str(info.value)
    assert a.result().tokens == want_a
    # the engine serves on: B again, alone and beside A, gets its own tokens
    assert _alone(e, PROMPT_B, 30) == want_b
    a2 = e.submit(Request(PROMPT_A, max_tokens=40, ignore_eos=True))
    b2 = e.submit(Request(PROMPT_B, max_tokens=30, ignore_eos=True))
    while e.step():
        pass
    assert a2.result().tokens == want_a and b2.result().tokens == want_b


def test_runtime_failure_in_a_shared_prompt_chunk(model, make_engine, caplog):
    """Two prompts of one length go in one ubatch; its graph cannot be allocated: the
    newer request fails, the other's chunk runs again alone and it ends as it does alone."""
    e = make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=3), sampling=SamplingParams(temp=0.0))
    other = [4, 8, 15, 16, 23]  # PROMPT_A's length
    want_a, want_o = _alone(e, PROMPT_A, 12), _alone(e, other, 12)
    # no prompt reuse: admission runs no graph (reuse may write owed MTP pairs first)
    a = e.submit(Request(PROMPT_A, max_tokens=12, ignore_eos=True, cache_prompt=False))
    o = e.submit(Request(other, max_tokens=12, ignore_eos=True, cache_prompt=False))
    faults.inject("graph")  # the first graph of the next step: both prompts' chunk
    with caplog.at_level(logging.WARNING, "pyggspec.worker"):
        while e.step():
            pass
    assert faults.hits
    assert "prompt chunk" in caplog.text and "the newest of its 2 sequences" in caplog.text
    with pytest.raises(RequestFailed) as info:
        o.result()
    assert isinstance(info.value.__cause__, OutOfMemory)
    assert a.result().tokens == want_a
    assert _alone(e, other, 12) == want_o


class _Live:
    """uvicorn on a free loopback port in a thread (as tests/test_server.py runs it)."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_server_answers_503_and_goes_on(model, make_engine):
    """A request the device has no memory for is a 503 with the device's one-line error
    (stream or not); a stream running beside it ends whole and equal to itself alone."""
    from pyggspec.serving.server import ServerConfig, create_app

    e = make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=3), sampling=SamplingParams(temp=0.0),
                    load_tokenizer=True)
    app = create_app(e, ServerConfig(model_id="tiny", sampling=SamplingParams(temp=0.0)))
    body_a = {"prompt": PROMPT_A, "n_predict": 240, "ignore_eos": True, "temperature": 0,
              "return_tokens": True, "speculative": False}
    body_b = {"prompt": PROMPT_B, "n_predict": 8, "ignore_eos": True, "temperature": 0,
              "return_tokens": True}
    with _Live(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        want_a = http.post("/completion", json=body_a).json()["tokens"]
        want_b = http.post("/completion", json=body_b).json()["tokens"]
        faults.inject("graph")
        r = http.post("/completion", json=body_b)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "unavailable_error" and "out of memory allocating" in err["message"]
        # the same request next is served whole
        assert http.post("/completion", json=body_b).json()["tokens"] == want_b
        # beside a stream: A (plain decoding: one graph, allocated once) is running when B's
        # prompt graph fails to allocate; A's stream ends with its own tokens
        got_a: list[int] = []
        with http.stream("POST", "/completion", json={**body_a, "stream": True}) as s:
            lines = s.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    got_a += json.loads(line[6:]).get("tokens", [])
                if len(got_a) >= 2:
                    break
            faults.inject("graph")
            r = http.post("/completion", json=body_b)
            running = [x for x in http.get("/slots").json() if x.get("is_processing")]
            for line in lines:
                if line.startswith("data: "):
                    got_a += json.loads(line[6:]).get("tokens", [])
        assert r.status_code == 503, r.text
        assert len(running) == 1  # A was still generating when B failed
        assert got_a == want_a
        h = http.get("/health")
        assert h.status_code == 200


def test_server_503_beside_a_stream_in_the_same_batch(model, make_engine):
    """Over HTTP: a stream A and a request B decode in the same batch when its graph cannot
    be allocated: B (the newer) is a 503 naming the device, A's stream ends whole and equal
    to itself alone."""
    from pyggspec.serving.server import ServerConfig, create_app

    e = make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=3), sampling=SamplingParams(temp=0.0),
                    load_tokenizer=True)
    app = create_app(e, ServerConfig(model_id="tiny", sampling=SamplingParams(temp=0.0)))
    body_a = {"prompt": PROMPT_A, "n_predict": 200, "ignore_eos": True, "temperature": 0,
              "return_tokens": True}
    body_b = {"prompt": PROMPT_B, "n_predict": 200, "ignore_eos": True, "temperature": 0,
              "return_tokens": True}
    with _Live(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        want_a = http.post("/completion", json=body_a).json()["tokens"]
        got_a: list[int] = []
        res: dict = {}
        with http.stream("POST", "/completion", json={**body_a, "stream": True}) as s:
            lines = s.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    got_a += json.loads(line[6:]).get("tokens", [])
                if len(got_a) >= 2:
                    break
            t = threading.Thread(target=lambda: res.update(
                r=http.post("/completion", json=body_b)))
            t.start()
            deadline, shared = time.monotonic() + 30, False
            while not shared and time.monotonic() < deadline:  # until B decodes beside A
                busy = [x for x in http.get("/slots").json() if x["state"] == "processing"]
                shared = len(busy) == 2 and all(x["n_decoded"] > 0 for x in busy)
            faults.inject("graph")
            t.join(60)
            for line in lines:
                if line.startswith("data: "):
                    got_a += json.loads(line[6:]).get("tokens", [])
        r = res["r"]
        assert shared and faults.hits
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "unavailable_error" and "out of memory allocating" in err["message"]
        assert got_a == want_a
        assert http.get("/health").status_code == 200
