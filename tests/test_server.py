"""``pyggspec serve`` end to end: real clients (openai, httpx) against a live server on loopback.

One small constructed-agreement model with an MTP head, one engine (-np 4, draft-mtp), one
uvicorn server in a background thread for the whole module. Requests are short so the
module stays well under a minute on two busy cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from typing_extensions import Self

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.server import ServerConfig, create_app

N_PARALLEL = 4
N_CTX = 512


class LiveServer:
    """uvicorn running an app in a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def state(self):
        return self.app.state.pyggspec


@pytest.fixture(scope="module")
def model_path(models) -> Path:
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    # one ggml thread: worker threads busy-wait, and next to the HTTP threads on two shared
    # cores a second one made steps several times slower
    with Engine(model_path, n_ctx=N_CTX, n_parallel=N_PARALLEL, n_threads=1,
                spec_type="draft-mtp", spec=SpecConfig(n_max=3),
                sampling=SamplingParams(temp=0.0)) as e:
        yield e


@pytest.fixture(scope="module")
def live(engine):
    app = create_app(engine, ServerConfig(model_id="tiny-mtp", sampling=SamplingParams(temp=0.0)))
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture()
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        slots = http.get("/slots").json()
        if all(s["state"] == "idle" for s in slots) or time.monotonic() > deadline:
            return slots
        time.sleep(0.05)


def on_devices(mem: dict) -> dict:
    """Memory by component on the ggml devices (without host-side prompt checkpoints)."""
    return {c: {d: n for d, n in v.items() if d != "host"} for c, v in mem.items()
            if isinstance(v, dict)}


def sse_data(lines) -> list:
    """The JSON bodies of an SSE stream (``[DONE]`` kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------------------- OpenAI client
def test_chat_completion_with_openai_client(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model="any-name-works", messages=msgs, max_tokens=12,
                                       temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "any-name-works"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]  # what llama.cpp's speed-bench client reads
    for key in ("prompt_ms", "predicted_ms", "prompt_per_second", "predicted_per_second"):
        assert isinstance(t[key], float) and t[key] >= 0, key
    assert t["predicted_n"] == r.usage.completion_tokens
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    # draft counts come only with drafts (as llama-server's): the default draft budget may
    # decline every step of a request when the machine is loaded and measured steps are
    # dear (this assertion failed 1 run in 4 as a KeyError while other tests shared the CPU)
    if "draft_n" in t:
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]


def test_chat_stream_equals_whole_response(client):
    msgs = [{"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(model="m", messages=msgs, max_tokens=16,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="m", messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


def test_completions_with_openai_client(client):
    r = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="The quick brown fox", max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text
    echo = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=8,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "The quick brown fox" + r.choices[0].text


def test_models_lists_the_one_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-mtp"]
    assert models[0].model_extra["meta"]["speculative"] == "draft-mtp"


def test_openai_client_sees_400_for_bad_values(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"min_p": 2.0})
    assert e.value.status_code == 400 and e.value.body["param"] == "min_p"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       top_p=3)


# ---------------------------------------------------------------------------- llama-server shapes
def test_completion_token_prompt_and_return_tokens(http):
    r = http.post("/completion", json={"prompt": [300, 301, 302], "n_predict": 6,
                                       "return_tokens": True, "temperature": 0})
    assert r.status_code == 200
    d = r.json()
    assert d["stop"] is True and len(d["tokens"]) == d["tokens_predicted"] <= 6
    assert d["tokens_evaluated"] == 3 and d["stop_type"] in ("eos", "limit")
    assert http.post("/detokenize", json={"tokens": d["tokens"]}).json()["content"] == \
        d["content"]
    assert d["timings"]["predicted_n"] == len(d["tokens"])
    assert d["generation_settings"]["n_predict"] == 6


def test_completion_stream_chunks(http):
    body = {"prompt": "Hello", "n_predict": 8, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/completion", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r.iter_lines())
    assert "[DONE]" not in data  # llama-server's /completion stream has no [DONE]
    *pieces, last = data
    assert all(p["stop"] is False for p in pieces) and last["stop"] is True
    assert sum(len(p["tokens"]) for p in pieces) == last["tokens_predicted"] == 8
    whole = http.post("/completion", json={**body, "stream": False}).json()
    assert "".join(p["content"] for p in pieces) == whole["content"]


def test_stop_strings_and_speculation_off(http):
    body = {"prompt": "The quick brown fox", "n_predict": 24, "ignore_eos": True,
            "temperature": 0}
    full = http.post("/completion", json=body).json()
    text = full["content"]
    # the server speculates by default (whether a step drafts is the calibrated budget's
    # call from measured costs, so the draft count depends on the machine's load)
    assert full["generation_settings"]["speculative.types"] == "draft-mtp"
    cut = next(i for i in range(len(text) // 2, len(text)) if not text[i].isspace())
    stop = text[cut:cut + 2]
    cut = text.index(stop)
    r = http.post("/completion", json={**body, "stop": [stop]}).json()
    assert r["content"] == text[:cut]
    assert r["stop_type"] == "word" and r["stopping_word"] == stop
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
        "speculative": False}).json()
    assert "draft_n" not in chat["timings"]  # llama-server omits it when nothing was drafted
    spec = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
        "temperature": 0}).json()
    assert chat["choices"][0]["message"] == spec["choices"][0]["message"]  # lossless
    one = http.post("/completion", json={**body, "speculative.n_max": 1}).json()
    # the calibrated lengths may decline every draft at n_max 1 (then draft_n is omitted)
    assert one["content"] == text
    assert one["timings"].get("draft_n", 0) <= one["tokens_predicted"]
    r = http.post("/completion", json={**body, "speculative.n_max": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.n_max"


def test_tokenize_detokenize_health_props_slots(http):
    toks = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    pieces = http.post("/tokenize", json={"content": "Hello world",
                                          "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == toks
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert http.post("/detokenize", json={"tokens": toks}).json() == {"content": "Hello world"}
    assert http.get("/health").json() == {"status": "ok"}
    props = http.get("/props").json()
    assert props["total_slots"] == N_PARALLEL and "im_start" in props["chat_template"]
    slots = http.get("/slots").json()
    assert len(slots) == N_PARALLEL and {s["id"] for s in slots} == set(range(N_PARALLEL))
    prompt = http.post("/apply-template", json={"messages": [
        {"role": "user", "content": "hi"}]}).json()["prompt"]
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_metrics_prometheus_text(http):
    http.post("/completion", json={"prompt": "metrics", "n_predict": 6, "ignore_eos": True})
    text = http.get("/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    for n in ("requests_total", "prompt_tokens_total", "tokens_predicted_total",
              "predicted_tokens_seconds", "spec_decode_num_draft_tokens_total",
              "spec_decode_num_accepted_tokens_total", "spec_decode_acceptance_rate",
              "spec_decode_num_accepted_tokens_per_pos_total",
              "spec_decode_draft_length_bucket", "requests_deferred", "requests_processing",
              "memory_bytes", "time_to_first_token_seconds_bucket"):
        assert "pyggspec:" + n in names, n
    drafted = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pyggspec:spec_decode_num_draft_tokens_total ")]
    assert drafted and drafted[0] > 0


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("path, content, param", [
    ("/v1/chat/completions", b"{not json", None),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"max_tokens": "ten"}'), "max_tokens"),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"min_p": 1.5}'), "min_p"),
    ("/v1/completions", b'{"prompt": "x", "n": 3}', "n"),
    ("/v1/completions", b'{"prompt": [1, 99999]}', "prompt"),
    ("/completion", b'{"prompt": "x", "logit_bias": {"5000000": 1}}', "logit_bias"),
    ("/completion", b'{"prompt": "x", "samplers": ["top_k", "nope"]}', "samplers"),
    ("/completion", b'{"prompt": "x", "stop": 5}', "stop"),
    ("/completion", b"[]", None),
    ("/tokenize", b'{"content": 5}', "content"),
    ("/detokenize", b'{"tokens": [-1]}', "tokens"),
    ("/completion", b'{"prompt": "a\\ud800"}', None),
])
def test_bad_requests_are_400_with_openai_error_body(http, path, content, param):
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == param and err["message"]


def test_banned_tokens_echo_as_false(http):
    r = http.post("/completion", json={"prompt": "x", "n_predict": 2,
                                       "logit_bias": [[300, False], [301, -1.5]]})
    assert r.status_code == 200
    # llama-server's {"bias", "token"} objects; a ban echoes as false (JSON has no -inf)
    assert r.json()["generation_settings"]["logit_bias"] == [
        {"bias": False, "token": 300}, {"bias": -1.5, "token": 301}]


def test_prompt_longer_than_context(http):
    r = http.post("/completion", json={"prompt": [300] * (N_CTX + 5)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["n_prompt_tokens"] == N_CTX + 5 and err["n_ctx"] == N_CTX
    # llama-server's words (llama.cpp's test_ctx_shift matches them)
    assert "exceeds the available context size" in err["message"]
    # a prompt filling the context leaves no room for a token unless none is asked for
    assert http.post("/completion", json={"prompt": [300] * N_CTX}).status_code == 400


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/chat/completions").status_code == 405


def test_api_key_guards_everything_but_health(live):
    app = create_app(live.state.engine, ServerConfig(model_id="k", api_key="sekret"),
                     manage_scheduler=False)
    with LiveServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as h:
        assert h.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/slots"),
                             ("POST", "/completion"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("GET", "/props")):
            r = h.request(method, path, json={})
            assert r.status_code == 401, path
            assert r.json()["error"]["type"] == "authentication_error"
        assert h.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert h.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert h.get("/v1/models", headers={"X-Api-Key": "sekret"}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="k", prompt="a", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope",
                          max_retries=0).models.list()


# ---------------------------------------------------------------------------- concurrency
def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(260, 700) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 0.9, "top_k": 20, "seed": 1234}])
def test_eight_clients_on_four_slots_equal_solo_runs(http, sampling):
    prompts = _prompts(8, seed=len(sampling))
    bodies = [{"prompt": p, "n_predict": 10 + 3 * i, "return_tokens": True, **sampling}
              for i, p in enumerate(prompts)]
    solo = [http.post("/completion", json=b).json()["tokens"] for b in bodies]
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda b: http.post("/completion", json=b).json()["tokens"],
                               bodies))
    assert together == solo
    assert all(solo)


def test_a_failing_request_never_changes_the_others(http):
    """Malformed requests and cancelled streams interleaved with valid ones."""
    bodies = [{"prompt": p, "n_predict": 12, "return_tokens": True} for p in _prompts(6, 7)]
    solo = [http.post("/completion", json=b).json()["tokens"] for b in bodies]

    def bad(i: int) -> int:
        if i % 2:
            return http.post("/completion", content=b'{"prompt": [1, 2,',
                             headers={"content-type": "application/json"}).status_code
        with http.stream("POST", "/completion", json={"prompt": [400 + i], "n_predict": 200,
                                                      "stream": True, "ignore_eos": True}) as r:
            next(r.iter_lines())
        return 200

    with ThreadPoolExecutor(8) as ex:
        goods = [ex.submit(lambda b=b: http.post("/completion", json=b).json()["tokens"])
                 for b in bodies]
        bads = [ex.submit(bad, i) for i in range(6)]
        assert [g.result() for g in goods] == solo
        assert sorted(b.result() for b in bads) == [200, 200, 200, 400, 400, 400]
    assert all(s["state"] == "idle" for s in wait_idle(http))


def test_client_disconnect_cancels_and_frees_the_slot(live, http):
    def cancelled() -> int:
        return live.state.metrics.finished.get("cancelled", 0)

    before = cancelled()
    with http.stream("POST", "/v1/completions", json={
            "prompt": "a long story", "max_tokens": 480, "stream": True, "ignore_eos": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert all(s["state"] == "idle" for s in wait_idle(http))
    deadline = time.monotonic() + 10  # the request ended as cancelled, not after 400 tokens
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1


def test_full_queue_is_503(live, http):
    sched = live.state.scheduler
    old = sched.max_queue
    sched.max_queue = 1
    try:
        body = {"prompt": [300, 301], "n_predict": 150, "ignore_eos": True}
        with ThreadPoolExecutor(12) as ex:
            codes = list(ex.map(lambda _: http.post("/completion", json=body), range(12)))
    finally:
        sched.max_queue = old
    statuses = sorted(r.status_code for r in codes)
    assert 503 in statuses and set(statuses) <= {200, 503}
    busy = next(r for r in codes if r.status_code == 503).json()["error"]
    assert busy["type"] == "unavailable_error" and busy["code"] == 503
    assert all(s["state"] == "idle" for s in wait_idle(http))


def test_multi_turn_chat_prompt_reuse_equals_cold_start(client):
    msgs = [{"role": "user", "content": "The dog was not amused"}]
    first = client.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                           temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and the fox ran away"}]
    warm = client.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                          temperature=0)
    cold = client.chat.completions.create(model="m", messages=msgs, max_tokens=10,
                                          temperature=0, extra_body={"cache_prompt": False})
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.model_extra["timings"]["cache_n"] > 0
    assert cold.model_extra["timings"]["cache_n"] == 0


def test_load_mixed_requests_end_clean(live, http, engine):
    """>= 200 requests of mixed lengths and endpoints, some cancelled mid-stream, some
    malformed: no valid request gets an error, every slot ends idle, memory back to idle."""
    idle_mem = live.state.scheduler.memory()
    rng = random.Random(11)
    jobs = []
    for i in range(220):
        kind = rng.choice(["completion", "completion", "chat", "chat_stream", "oai_stream",
                           "cancel", "bad"])
        jobs.append((kind, rng.randrange(1, 80), rng.randrange(1, 14), i))

    def run(job) -> tuple[str, int, bool]:
        kind, n_prompt, n_gen, i = job
        prompt = [260 + (i * 7 + k) % 400 for k in range(n_prompt)]
        if kind == "completion":
            r = http.post("/completion", json={"prompt": prompt, "n_predict": n_gen,
                                               "temperature": 0.7, "seed": i})
            return kind, r.status_code, r.status_code == 200 and "content" in r.json()
        if kind == "chat":
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "word " * n_prompt}],
                "max_tokens": n_gen})
            return kind, r.status_code, r.status_code == 200 and r.json()["choices"]
        if kind in ("chat_stream", "oai_stream", "cancel"):
            body = ({"messages": [{"role": "user", "content": "x" * n_prompt}]}
                    if kind == "chat_stream" else {"prompt": prompt})
            path = "/v1/chat/completions" if kind == "chat_stream" else "/v1/completions"
            body.update(stream=True, max_tokens=n_gen if kind != "cancel" else 300,
                        ignore_eos=kind == "cancel")
            with http.stream("POST", path, json=body) as r:
                if kind == "cancel":
                    next(r.iter_lines())
                    return kind, r.status_code, True
                data = sse_data(r.iter_lines())
            return kind, r.status_code, data[-1] == "[DONE]"
        bad = rng.choice([b"{", b'{"prompt": []}', b'{"prompt": "x", "top_k": "5"}',
                          json.dumps({"prompt": [300] * (N_CTX + 1)}).encode()])
        r = http.post("/completion", content=bad, headers={"content-type": "application/json"})
        return kind, r.status_code, r.json()["error"]["code"] == 400

    with ThreadPoolExecutor(12) as ex:
        results = list(ex.map(run, jobs))
    for kind, status, ok in results:
        assert status == (400 if kind == "bad" else 200), (kind, status)
        assert ok, kind
    assert len(results) >= 200
    slots = wait_idle(http)
    assert all(s["state"] == "idle" for s in slots)
    # device memory is back to its idle figure; the host keeps only the slots' prompt
    # checkpoints (bounded, for prompt reuse), and /slots accounts for every byte of them
    after = live.state.scheduler.memory()
    assert on_devices(after) == on_devices(idle_mem)
    assert after["by_device"].get("host", 0) == sum(s["checkpoint_bytes"] for s in slots)
    m = http.get("/metrics").text
    assert "pyggspec:requests_processing 0" in m.splitlines()


# ---------------------------------------------------------------------------- the command
def test_serve_sigterm_drains_in_flight_requests(model_path, tmp_path):
    """``pyggspec serve``: startup line with the URL; SIGTERM lets a running stream finish
    and the process exit 0."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyggspec", "serve", "-m", str(model_path), "--port", "0",
         "-np", "2", "-c", "256", "-t", "1", "--spec-type", "draft-mtp", "--temp", "0",
         "--log-level", "warning"],
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
                assert "draft-mtp" in line and "2 slots" in line
        assert url, "no startup line"
        got: dict = {}

        def stream() -> None:
            with httpx.stream("POST", url + "/completion", timeout=60, json={
                    "prompt": [300, 301], "n_predict": 120, "ignore_eos": True,
                    "stream": True}) as r:
                got["data"] = sse_data(r.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                s["state"] != "idle" for s in httpx.get(url + "/slots").json()):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        assert got["data"][-1]["stop"] is True
        assert got["data"][-1]["tokens_predicted"] == 120
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_without_model_needs_draft_mtp():
    from click.testing import CliRunner

    from pyggspec.cli import main

    r = CliRunner().invoke(main, ["serve"])
    assert r.exit_code == 2 and "--spec-type draft-mtp" in r.output


def test_serve_command_demo_model_is_labelled_synthetic(monkeypatch, model_path):
    """``serve --spec-type draft-mtp`` without -m: the demo model (here the tiny one in its
    place), labelled synthetic in the startup line and in /v1/models."""
    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    import pyggspec.demo
    import pyggspec.serving.server as server_mod
    from pyggspec.cli import main

    monkeypatch.setattr(pyggspec.demo, "demo_model", lambda quiet=False: model_path)
    seen: dict = {}

    def fake_serve(app, host, port, log_level="info", on_listen=None) -> None:
        with TestClient(app) as c:
            seen["models"] = c.get("/v1/models").json()
            seen["chat"] = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        on_listen(f"http://{host}:{port}")

    monkeypatch.setattr(server_mod, "serve", fake_serve)
    r = CliRunner().invoke(main, ["serve", "--spec-type", "draft-mtp", "-np", "1", "-c", "128",
                                  "-t", "1", "--port", "9999"])
    assert r.exit_code == 0, r.output
    assert "SYNTHETIC" in r.output and "listening on http://127.0.0.1:9999" in r.output
    assert "draft-mtp n_max 3" in r.output
    card = seen["models"]["data"][0]
    assert card["meta"]["synthetic"] is True and "synthetic" in card["id"]
    assert seen["chat"].status_code == 200
