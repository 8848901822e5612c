"""Logprobs (issue 21, item 4): ``Engine.generate(logprobs=k)``, llama-server's ``n_probs``
/ ``post_sampling_probs`` on ``/completion`` and OpenAI's ``logprobs`` / ``top_logprobs``
on ``/v1/chat/completions`` and ``/v1/completions``.

The values are the target's for the token it emitted: the same with and without MTP
speculation (a verified draft gets its verify row's), equal to a log-softmax of the
target's logits, computed only for the requests that ask.
"""

from __future__ import annotations

import json
import math

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.errors import PyggspecError
from pyggspec.sampling import SamplingParams
from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.request import Request
from pyggspec.serving.sequence import TokenLogprob
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server import sse_data

PROMPTS = [[300, 301, 302], [400, 401]]
N = 24
SAMPLED = SamplingParams(temp=2.2, top_k=40, top_p=1.0, min_p=0.0, seed=7, repeat_penalty=1.1)
# ggml's noise between a verify batch and one-token steps (or a whole-prompt eval) on f32
# weights is ~1e-7 relative on the logits; log-probabilities of a few units keep it
TOL = 1e-4


def agreement_model(models, agreement):
    return models.path(models.spec("dense", dtype="f32", agreement=agreement,
                                   tied_embeddings=False))


def assert_same_logprobs(a, b):
    """Two runs' per-token logprobs: same tokens, same top ids, values within ggml's noise."""
    assert [t.id for t in a] == [t.id for t in b]
    np.testing.assert_allclose([t.logprob for t in a], [t.logprob for t in b], rtol=TOL,
                               atol=TOL)
    for x, y in zip(a, b):
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], rtol=TOL,
                                   atol=TOL)


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


# ---------------------------------------------------------------------------- engine
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
def test_greedy_logprobs_equal_with_and_without_speculation(models, make_engine, rollback):
    path = agreement_model(models, 0.7)
    with make_engine(path, n_ctx=256, n_parallel=2) as e:
        ref = e.generate_batch(PROMPTS, max_tokens=N, ignore_eos=True, logprobs=5)
    spec = SpecConfig(n_max=3, rollback=rollback, adaptive=False)
    with make_engine(path, n_ctx=256, n_parallel=2, spec_type="draft-mtp", spec=spec) as e:
        out = e.generate_batch(PROMPTS, max_tokens=N, ignore_eos=True, logprobs=5)
    assert 0 < out.stats.n_accepted < out.stats.n_drafted  # drafts accepted and rejected
    for r, s in zip(ref, out):
        assert s.tokens == r.tokens and len(s.logprobs) == len(s.tokens) == N
        assert [t.id for t in s.logprobs] == s.tokens
        assert_same_logprobs(s.logprobs, r.logprobs)
        for t in s.logprobs:  # greedy: the emitted token is the most likely one
            assert len(t.top) == 5 and t.top[0][0] == t.id
            assert t.top[0][1] == t.logprob <= 0.0
            assert [v for _, v in t.top] == sorted((v for _, v in t.top), reverse=True)


@pytest.mark.parametrize("post", [False, True])
def test_seeded_sampling_logprobs_equal_with_and_without_speculation(models, make_engine,
                                                                     post):
    """Sampled decoding (coupled drafts keep the tokens identical): raw and post-sampling
    values per emitted token, several verify rows per step used."""
    path = agreement_model(models, 0.95)
    outs = []
    for spec_type in (None, "draft-mtp"):
        with make_engine(path, n_ctx=256, n_parallel=2, spec_type=spec_type,
                         sampling=SAMPLED) as e:
            g = e.generate_batch(PROMPTS, max_tokens=N, ignore_eos=True, logprobs=3,
                                 post_sampling_probs=post)
            if spec_type:
                assert len(g.stats.accepted_at) >= 2 and g.stats.accepted_at[1] > 0
            outs.append(g)
    for r, s in zip(*outs):
        assert s.tokens == r.tokens
        assert_same_logprobs(s.logprobs, r.logprobs)
    lps = [t for r in outs[0] for t in r.logprobs]
    if post:  # the chain's distribution: top_k 40 at temp 2.2, probabilities sum to <= 1
        assert all(t.logprob > -math.inf for t in lps)
        assert all(sum(math.exp(v) for _, v in t.top) <= 1 + 1e-9 for t in lps)
    assert any(t.top[0][0] != t.id for t in lps)  # it sampled, not always the argmax


def test_logprobs_equal_log_softmax_of_the_logits(models, make_engine):
    """Each token's value and top ids are the log-softmax of the target's logits at its
    position (the same prefix evaluated again in one batch, on a cleared slot)."""
    path = agreement_model(models, 0.7)
    with make_engine(path, n_ctx=256, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3, adaptive=False)) as e:
        r = e.generate(PROMPTS[0], max_tokens=N, ignore_eos=True, logprobs=8)
        e.clear(0)
        logits = e.eval(PROMPTS[0] + r.tokens[:-1], seq_id=0)
    rows = logits[len(PROMPTS[0]) - 1:]
    assert len(rows) == len(r.logprobs)
    for row, t in zip(rows, r.logprobs):
        ls = log_softmax(row)
        assert t.logprob == pytest.approx(ls[t.id], abs=TOL)
        order = np.lexsort((np.arange(len(ls)), -ls))[:8]  # by value, ties to the lowest id
        assert [i for i, _ in t.top] == order.tolist()
        np.testing.assert_allclose([v for _, v in t.top], ls[order], atol=TOL)


def test_only_requests_that_ask_get_logprobs_and_device_sampling_keeps_tokens(models,
                                                                               make_engine):
    """With the chain in the graph, a request asking for logprobs makes its batch sample
    on the host (logits needed): the tokens of every request stay those of a run without
    logprobs; the ones that did not ask get none."""
    path = agreement_model(models, 0.95)
    with make_engine(path, n_ctx=256, n_parallel=2, spec_type="draft-mtp", sampling=SAMPLED,
                     backend_sampling=True, spec=SpecConfig(n_max=3, adaptive=False)) as e:
        ref = [r.tokens for r in e.generate_batch(PROMPTS, max_tokens=N, ignore_eos=True)]
        assert e.samplers.stats.device == "CPU"
        h1 = e.submit(Request(PROMPTS[0], max_tokens=N, ignore_eos=True, logprobs=2, slot=0))
        h2 = e.submit(Request(PROMPTS[1], max_tokens=N, ignore_eos=True, slot=1))
        r1, r2 = h1.result(), h2.result()
    assert [r1.tokens, r2.tokens] == ref
    assert r2.logprobs is None and len(r1.logprobs) == N
    assert all(len(t.top) == 2 for t in r1.logprobs)


def test_stream_pieces_carry_logprobs(models, shared_engine):
    e = shared_engine(agreement_model(models, 0.7), n_ctx=256, load_tokenizer=True)
    whole = e.generate(PROMPTS[0], max_tokens=8, ignore_eos=True, logprobs=2)
    st = e.stream(PROMPTS[0], max_tokens=8, ignore_eos=True, logprobs=2)
    pieces = [p for p in st if p.token >= 0]
    assert [p.token for p in pieces] == whole.tokens
    assert_same_logprobs([p.logprob for p in pieces], whole.logprobs)
    assert st.result.logprobs is not None
    plain = e.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    assert plain.logprobs is None and "logprobs" not in plain.to_dict()
    assert len(whole.to_dict()["logprobs"]) == 8


@pytest.mark.parametrize("bad", [-1, True, 1.5, 10**9])
def test_engine_refuses_bad_logprobs(models, shared_engine, bad):
    e = shared_engine(agreement_model(models, 0.7), n_ctx=256, load_tokenizer=True)
    with pytest.raises(PyggspecError, match="logprobs"):
        e.generate(PROMPTS[0], max_tokens=2, logprobs=bad)


# ---------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def model_path(models):
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=256, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                spec=SpecConfig(n_max=3, adaptive=False),
                sampling=SamplingParams(temp=0.0)) as e:
        yield e


@pytest.fixture(scope="module")
def http(engine, model_path):
    app = create_app(engine, ServerConfig(model_id="lp", model_path=str(model_path),
                                          sampling=SamplingParams(temp=0.0), n_predict=6))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


CHAT = {"messages": [{"role": "user", "content": "What is the best book"}], "max_tokens": 5}
TEXT = {"prompt": "I believe the meaning of life is"}


def check_entry(tok, key="logprob", top="top_logprobs", n_top=None):
    """llama-server's per-token object, as its own tests check it."""
    assert isinstance(tok["id"], int) and isinstance(tok["token"], str)
    assert isinstance(tok["bytes"], list) and all(0 <= b < 256 for b in tok["bytes"])
    assert bytes(tok["bytes"]).decode("utf-8", "replace").startswith(tok["token"])
    if key == "logprob":
        assert tok[key] <= 0.0
    else:
        assert 0.0 <= tok[key] <= 1.0
    if n_top is not None:
        assert len(tok[top]) == n_top
    for p in tok[top]:
        assert set(p) == {"id", "token", "bytes", key}


def test_completion_n_probs(http):
    """llama.cpp's test_n_probs / test_n_probs_stream, and the stream's per-token objects
    are the whole response's."""
    r = http.post("/completion", json={**TEXT, "n_probs": 10, "n_predict": 5})
    assert r.status_code == 200, r.text
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 5 == r.json()["tokens_predicted"]
    for tok in probs:
        check_entry(tok, n_top=10)
        assert tok["top_logprobs"][0]["id"] == tok["id"]  # greedy
    assert r.json()["generation_settings"]["n_probs"] == 10
    s = http.post("/completion", json={**TEXT, "n_probs": 10, "n_predict": 5, "stream": True})
    chunks = sse_data(s.iter_lines())
    streamed = []
    for c in chunks:
        if not c["stop"]:
            assert len(c["completion_probabilities"]) == 1
            streamed += c["completion_probabilities"]
        else:
            assert "completion_probabilities" not in c
    assert [t["id"] for t in streamed] == [t["id"] for t in probs]
    for a, b in zip(streamed, probs):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=TOL)
    r = http.post("/completion", json={**TEXT, "n_predict": 2})
    assert "completion_probabilities" not in r.json()


def test_completion_logprobs_alias_and_whole_vocabulary(http, engine):
    r = http.post("/completion", json={**TEXT, "logprobs": 3, "n_predict": 2}).json()
    assert [len(t["top_logprobs"]) for t in r["completion_probabilities"]] == [3, 3]
    r = http.post("/completion", json={**TEXT, "n_probs": 10**6, "n_predict": 1}).json()
    top = r["completion_probabilities"][0]["top_logprobs"]
    assert len(top) == engine.n_vocab  # more than the vocabulary: all of it, as llama-server
    assert sum(math.exp(p["logprob"]) for p in top) == pytest.approx(1.0, abs=1e-6)


def test_completion_post_sampling_probs(http):
    """llama.cpp's test_n_probs_post_sampling: probabilities after the chain (greedy here:
    the choice with probability 1, zero-probability tokens left out)."""
    r = http.post("/completion", json={**TEXT, "n_probs": 10, "n_predict": 3,
                                       "post_sampling_probs": True})
    body = r.json()
    assert body["generation_settings"]["post_sampling_probs"] is True
    for tok in body["completion_probabilities"]:
        check_entry(tok, "prob", "top_probs")
        assert "logprob" not in tok and tok["prob"] == 1.0
        assert [p["id"] for p in tok["top_probs"]] == [tok["id"]]
    r = http.post("/completion", json={**TEXT, "n_probs": 10, "n_predict": 3, "seed": 4,
                                       "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                       "min_p": 0.0, "post_sampling_probs": True}).json()
    for tok in r["completion_probabilities"]:
        assert len(tok["top_probs"]) == 10 and 0 < tok["prob"] <= 1
        assert all(p["prob"] > 0 for p in tok["top_probs"])


def test_chat_logprobs_with_openai_client(http):
    """llama.cpp's test_logprobs and test_logprobs_stream, through the openai package."""
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    msgs = CHAT["messages"]
    res = client.chat.completions.create(model="m", temperature=0.0, messages=msgs,
                                         max_tokens=5, logprobs=True, top_logprobs=10)
    content = res.choices[0].logprobs.content
    assert "".join(t.token for t in content) == res.choices[0].message.content
    for t in content:
        assert t.logprob <= 0.0 and t.bytes is not None and len(t.top_logprobs) == 10
    out, agg, ids = "", "", []
    for i, chunk in enumerate(client.chat.completions.create(
            model="m", temperature=0.0, messages=msgs, max_tokens=5, logprobs=True,
            top_logprobs=10, stream=True)):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        if i == 0:
            assert ch.delta.role == "assistant" and ch.delta.content is None
        elif ch.finish_reason is None:
            out += ch.delta.content or ""
            assert ch.logprobs is not None and ch.logprobs.content is not None
            for t in ch.logprobs.content:
                agg += t.token
                ids.append(t.id)
                assert t.logprob <= 0.0 and len(t.top_logprobs) == 10
    assert agg == out and ids == [t.id for t in content]


def test_chat_logprobs_defaults_and_zero_alternatives(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).json()
    assert all(len(t["top_logprobs"]) == 20 for t in r["choices"][0]["logprobs"]["content"])
    r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True,
                                                "top_logprobs": 0}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert all(t["top_logprobs"] == [] and t["logprob"] <= 0 for t in content)
    r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": False}).json()
    assert r["choices"][0]["logprobs"] is None


def test_v1_completions_logprobs(http):
    body = {**TEXT, "max_tokens": 4, "logprobs": 3}
    r = http.post("/v1/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for t in content:
        check_entry(t, n_top=3)
    assert "".join(t["token"] for t in content) == r["choices"][0]["text"]
    s = http.post("/v1/completions", json={**body, "stream": True})
    chunks = [c for c in sse_data(s.iter_lines()) if c != "[DONE]"]
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["id"] for t in streamed] == [t["id"] for t in content]
    for c in chunks:
        if c["choices"] and c["choices"][0]["text"]:
            assert c["choices"][0]["logprobs"] is not None
    r = http.post("/v1/completions", json={**TEXT, "max_tokens": 2}).json()
    assert r["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "5"}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 5}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"n_probs": -2}, "n_probs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": [1]}, "logprobs"),
    ("/completion", {"n_probs": -1}, "n_probs"),
    ("/completion", {"n_probs": 1.5}, "n_probs"),
    ("/completion", {"n_probs": "10"}, "n_probs"),
    ("/completion", {"n_probs": 2**40}, "n_probs"),
    ("/completion", {"logprobs": -3}, "logprobs"),
    ("/completion", {"n_probs": 2, "post_sampling_probs": "yes"}, "post_sampling_probs"),
])
def test_bad_logprob_fields_are_400_naming_the_field(http, path, body, param):
    base = CHAT if path == "/v1/chat/completions" else {**TEXT, "max_tokens": 2}
    r = http.post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"]


def test_entries_shape_utf8_and_log_zero():
    """Per-token objects: a token ending inside a UTF-8 character keeps its bytes but not
    the partial character in ``token`` (llama-server's validate_utf8); log(0) is float32
    lowest (JSON has no -inf), probability 0 is 0.0."""
    pieces = {1: "é".encode()[:1], 2: b"ab", 3: "€".encode()}
    lp = TokenLogprob(1, -math.inf, ((2, -0.5), (3, -1.0)))
    (e,) = oa.logprob_entries([lp], pieces.__getitem__, False)
    assert e == {"id": 1, "token": "", "bytes": [0xC3], "logprob": oa.LOG_ZERO,
                 "top_logprobs": [{"id": 2, "token": "ab", "bytes": [97, 98], "logprob": -0.5},
                                  {"id": 3, "token": "€", "bytes": [0xE2, 0x82, 0xAC],
                                   "logprob": -1.0}]}
    json.dumps(e, allow_nan=False)
    (p,) = oa.logprob_entries([lp], pieces.__getitem__, True)
    assert p["prob"] == 0.0 and p["top_probs"][0]["prob"] == pytest.approx(math.exp(-0.5))
    assert oa.utf8_complete(b"x\xe2\x82") == b"x" and oa.utf8_complete(b"\xe2\x82\xac") == \
        "€".encode()
