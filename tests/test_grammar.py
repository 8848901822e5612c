"""Constrained output (issue 21, item 3): ``grammar`` (GBNF), ``json_schema`` and OpenAI's
``response_format``, compiled by llguidance, as the sampler chain's first stage.

What must hold: the output parses per the grammar (a random-weight model writes whatever
the mask leaves it), it ends where the grammar is complete, and the tokens are the same
with and without MTP speculation (greedy, seeded sampling with coupled drafts; both
rollbacks; host and in-graph sampling), because each verify row is masked at the state
after the drafts before it and a draft the grammar forbids is rejected without touching
the matcher. Bad grammars are 400s naming the field (llama-server's own tests:
``test_chat_completion.py::test_completion_with_response_format`` / ``_invalid_grammar``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams, grammar
from pyggspec.sampling.chain import SamplerChain
from pyggspec.sampling.grammar import GrammarError, GrammarSpec, compile_grammar, grammar_vocab
from pyggspec.serving.request import Request
from pyggspec.serving.server import ServerConfig, create_app

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
GBNF = 'root ::= "yes" | "no" | ("maybe " [0-9]{1,3} "%")'
GBNF_RE = r"(yes|no|maybe [0-9]{1,3}%)"
GREEDY = SamplingParams(temp=0.0)
SAMPLED = SamplingParams(temp=1.5, seed=11, top_k=0, top_p=1.0, min_p=0.0)
PROMPTS = ["The quick brown fox", "Hello, world!"]


def check_schema(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "ok"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 99
    assert isinstance(obj["ok"], bool)
    return obj


@pytest.fixture(scope="module")
def model_path(models):
    return models.dense(dtype="f32", agreement=0.7, tied_embeddings=False)


def open_engine(path, **kw) -> Engine:
    return Engine(path, n_threads=2, n_ctx=512, n_parallel=2, **kw)


def spec_kw(rollback: str = "snapshot") -> dict:
    return {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=3, rollback=rollback,
                                                        adaptive=False)}


def run_all(e: Engine, sampling: SamplingParams):
    js = e.generate_batch(PROMPTS, max_tokens=80, sampling=sampling, json_schema=SCHEMA)
    gb = e.generate_batch(PROMPTS, max_tokens=20, sampling=sampling, grammar=GBNF)
    return js, gb


@pytest.fixture(scope="module")
def plain(model_path):
    """Plain decoding's outputs, per sampling: the reference every other run must equal."""
    out = {}
    with open_engine(model_path) as e:
        for name, sp in (("greedy", GREEDY), ("sampled", SAMPLED)):
            out[name] = run_all(e, sp)
    return out


# ---------------------------------------------------------------------------- engine
@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_output_follows_the_grammar(plain, name):
    js, gb = plain[name]
    for r in js:
        check_schema(r.text)
        assert r.stop_reason == "eos"  # ended where the object is complete
    for r in gb:
        assert re.fullmatch(GBNF_RE, r.text), r.text
        assert r.stop_reason == "eos"


@pytest.mark.parametrize("rollback,backend", [("snapshot", False), ("checkpoint", False),
                                              ("snapshot", True)])
@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_identical_with_and_without_speculation(model_path, plain, name, rollback, backend):
    sp = GREEDY if name == "greedy" else SAMPLED
    with open_engine(model_path, backend_sampling=backend, **spec_kw(rollback)) as e:
        js, gb = run_all(e, sp)
    drafted = accepted = 0
    for got, ref in zip([*js, *gb], [*plain[name][0], *plain[name][1]]):
        assert got.tokens == ref.tokens and got.text == ref.text
        assert got.stop_reason == ref.stop_reason
        drafted += got.spec.n_drafted
        accepted += got.spec.n_accepted
    assert 0 < accepted < drafted  # drafts were accepted and rejected


def test_in_graph_mask_equals_the_host(model_path, plain):
    """The grammar's bias row in the graph picks what the host's mask picks."""
    for sp, name in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
        with open_engine(model_path, backend_sampling=True) as e:
            js, gb = run_all(e, sp)
            assert "grammar" in e.worker.samplers.stats.device_stages
        for got, ref in zip([*js, *gb], [*plain[name][0], *plain[name][1]]):
            assert got.tokens == ref.tokens


def test_moe_identical_with_and_without_speculation(models):
    path = models.moe(dtype="f32", agreement=0.7)
    with open_engine(path) as e:
        ref = e.generate(PROMPTS[0], max_tokens=60, sampling=SAMPLED, json_schema=SCHEMA)
    with open_engine(path, **spec_kw()) as e:
        got = e.generate(PROMPTS[0], max_tokens=60, sampling=SAMPLED, json_schema=SCHEMA)
    check_schema(ref.text)
    assert got.tokens == ref.tokens and got.spec.n_drafted > 0


def test_probabilistic_drafts_keep_the_grammar(model_path):
    """p/q rejection sees the grammar in p (a forbidden draft has p = 0): valid output,
    reproducible for a seed (not token-identical to plain: that mode never is)."""
    kw = spec_kw()
    kw["spec"] = SpecConfig(n_max=3, adaptive=False, draft_sampling="probabilistic")
    with open_engine(model_path, **kw) as e:
        a = e.generate_batch(PROMPTS, max_tokens=80, sampling=SAMPLED, json_schema=SCHEMA)
        b = e.generate_batch(PROMPTS, max_tokens=80, sampling=SAMPLED, json_schema=SCHEMA)
    for x, y in zip(a, b):
        check_schema(x.text)
        assert x.tokens == y.tokens


def test_stream_and_ignore_eos(model_path, plain):
    """Streaming gives the same text; with ignore_eos the output still ends where the
    grammar is complete (nothing but EOS could follow)."""
    with open_engine(model_path) as e:
        pieces = list(e.stream(PROMPTS[0], max_tokens=80, sampling=GREEDY, json_schema=SCHEMA))
        r = e.generate(PROMPTS[0], max_tokens=80, sampling=GREEDY, json_schema=SCHEMA,
                       ignore_eos=True)
    assert "".join(p.text for p in pieces) == plain["greedy"][0][0].text
    assert r.tokens == plain["greedy"][0][0].tokens


def test_bad_grammars_raise(model_path):
    with open_engine(model_path) as e:
        for kw, field in (({"grammar": "root ::= this is (not valid GBNF"}, "grammar"),
                          ({"json_schema": {"type": "hiccup"}}, "json_schema"),
                          ({"grammar": GBNF, "json_schema": SCHEMA}, "grammar")):
            with pytest.raises(GrammarError) as ei:
                e.generate("x", max_tokens=4, **kw)
            assert ei.value.where == field


# ---------------------------------------------------------------------------- the matcher
def test_matcher_masks_at_prefixes_and_rolls_back(model_path):
    """A mask at a draft prefix leaves the matcher where it was; forbidden prefixes are
    unconstrained rows (never read); snapshot/restore roll consumed tokens back."""
    with open_engine(model_path) as e:
        tok = e.tokenizer
        g = compile_grammar(GrammarSpec.gbnf('root ::= "yes" | "no"'),
                            grammar_vocab(tok, e.n_vocab))
        chain = SamplerChain(SamplingParams(temp=0.0, grammar=g), e.n_vocab)
        m = chain.grammar
        start = m.allowed(()).copy()
        yes = tok.tokenize("yes", add_special=False)
        assert start[yes[0]] and start.sum() >= 2
        after = m.allowed(yes[:1])
        assert m.n_consumed == 0 and np.array_equal(m.allowed(()), start)
        if len(yes) > 1:
            assert after[yes[1]]
        assert m.allowed([tok.tokenize("zzz", add_special=False)[0]]) is None
        assert m.valid_prefix(yes) == len(yes) and not m.stopped
        snap = chain.snapshot()
        for t in yes:
            chain.accept(t)
        assert m.stopped and chain.grammar_done
        eos = m.allowed(())
        assert eos.sum() == len(m.vocab.eos) and all(eos[t] for t in m.vocab.eos)
        chain.restore(snap)
        assert m.n_consumed == 0 and np.array_equal(m.allowed(()), start)
        row = np.zeros(e.n_vocab, np.float32)
        row[tok.tokenize("no", add_special=False)[0]] = 5.0
        assert chain.sample(row) == tok.tokenize("no", add_special=False)[0]
        row[:] = 0.0
        row[int(np.flatnonzero(~start)[0])] = 9.0  # the largest is forbidden: not chosen
        assert start[chain.sample(row)]


# ---------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def http(model_path):
    with Engine(model_path, n_ctx=512, n_parallel=2, n_threads=2, sampling=GREEDY,
                **spec_kw()) as e:
        app = create_app(e, ServerConfig(model_id="g", model_path=str(model_path),
                                         sampling=GREEDY))
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c


CHAT = {"messages": [{"role": "user", "content": "Write an example"}], "max_tokens": 80}


def test_http_completion_grammar_and_schema(http):
    r = http.post("/completion", json={"prompt": "Hi", "n_predict": 20, "grammar": GBNF})
    assert r.status_code == 200, r.text
    assert re.fullmatch(GBNF_RE, r.json()["content"])
    assert r.json()["generation_settings"]["grammar"] == GBNF
    r = http.post("/completion", json={"prompt": "Hi", "n_predict": 80, "json_schema": SCHEMA})
    assert r.status_code == 200, r.text
    check_schema(r.json()["content"])
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 80,
                                           "json_schema": SCHEMA})
    check_schema(r.json()["choices"][0]["text"])
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("rf,check", [
    ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
    ({"type": "json_object", "schema": {"const": "42"}}, lambda t: t == '"42"'),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}},
     lambda t: t == '"foooooo"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, check_schema),
    ({"type": "text"}, lambda t: isinstance(t, str)),
])
def test_http_chat_response_format(http, rf, check):
    r = http.post("/v1/chat/completions", json={**CHAT, "response_format": rf})
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["message"]["content"])


def test_http_chat_grammar_streamed(http):
    body = {**CHAT, "grammar": 'root ::= "a"{5,5}'}
    r = http.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == "aaaaa"
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        from tests.test_server import sse_data

        chunks = sse_data(s.iter_lines())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]
                   if c["choices"])
    assert text == "aaaaa"


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"grammar": "root ::= this is (not valid GBNF"}, "grammar"),
    ("/v1/chat/completions", {"response_format": {"type": "sound"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "schema": 123}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object",
                                                  "schema": {"type": 123}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object",
                                                  "schema": {"type": "hiccup"}}},
     "response_format"),
    ("/completion", {"grammar": GBNF, "json_schema": SCHEMA}, "json_schema"),
    ("/completion", {"grammar": 5}, "grammar"),
    ("/completion", {"json_schema": "not json"}, "json_schema"),
    ("/v1/completions", {"json_schema": {"type": "object", "required": 7}}, "json_schema"),
    ("/v1/chat/completions", {"grammar": GBNF, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_http_bad_grammar_is_a_400_naming_the_field(http, path, extra, param):
    base = CHAT if path.endswith("chat/completions") else {"prompt": "x", "max_tokens": 4}
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_json_after_thinking(model_path):
    """A chat answer whose prompt opened a thinking block: any text up to ``</think>``,
    then the JSON (as llama-server's chat parser allows reasoning first)."""
    with open_engine(model_path) as e:
        tok = e.tokenizer
        g = compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format",
                                        after="</think>"), grammar_vocab(tok, e.n_vocab))
        m = g.matcher()
        answer = 'Let me think {"no": 1}.\n</think>\n\n{"name": "x", "age": 3, "ok": true}'
        ids = tok.tokenize(answer, add_special=False)
        assert m.valid_prefix(ids) == len(ids)
        for t in ids:
            m.accept(t)
        assert m.stopped
        m2 = g.matcher()
        bad = tok.tokenize('</think>{"name": 5', add_special=False)
        assert m2.valid_prefix(bad) < len(bad)


def test_http_chat_schema_with_thinking_template(model_path):
    from tests.test_server_chat_parse import QWENISH

    with Engine(model_path, n_ctx=512, n_parallel=1, n_threads=2, sampling=GREEDY) as e:
        app = create_app(e, ServerConfig(model_id="g", model_path=str(model_path),
                                         sampling=GREEDY, chat_template=QWENISH))
        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.post("/v1/chat/completions", json={
                **CHAT, "max_tokens": 24,
                "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    gs = r.json()
    assert gs["choices"][0]["message"]["content"] is not None or \
        gs["choices"][0]["message"].get("reasoning_content")


@pytest.mark.parametrize("backend", [False, True])
def test_mixed_batch_with_and_without_grammar(model_path, backend):
    """A constrained and a free sequence share verify batches (their chains differ in
    structure, so the batch samples on the host): each gets what it gets alone."""
    with open_engine(model_path) as e:
        ref = [e.generate(PROMPTS[0], max_tokens=60, sampling=SAMPLED, json_schema=SCHEMA),
               e.generate(PROMPTS[1], max_tokens=30, sampling=SAMPLED, ignore_eos=True)]
    with open_engine(model_path, backend_sampling=backend, **spec_kw()) as e:
        hs = [e.submit(Request(e.tokenize(PROMPTS[0]), max_tokens=60, sampling=SAMPLED,
                               grammar=GrammarSpec.json_schema(SCHEMA))),
              e.submit(Request(e.tokenize(PROMPTS[1]), max_tokens=30, sampling=SAMPLED,
                               ignore_eos=True))]
        got = [h.result() for h in hs]
    check_schema(got[0].text)
    assert [g.tokens for g in got] == [r.tokens for r in ref]


def test_grammar_tables_are_built_as_the_server_starts(model_path, monkeypatch, caplog):
    """llguidance's tables for the vocabulary (~1.3 s at 152k tokens) are built when the
    server starts, in the background: /health answers meanwhile, a constrained request
    arriving early waits for them and does not build them itself, and they are built once
    (another app over the same engine, or another start, does not build them again)."""
    real = grammar.GrammarVocab.from_tokenizer
    entered, gate, built = threading.Event(), threading.Event(), []

    def held(cls, tok, n_vocab):
        entered.set()
        gate.wait(30)
        gv = real(tok, n_vocab)
        built.append(threading.current_thread().name)
        return gv

    monkeypatch.setattr(grammar.GrammarVocab, "from_tokenizer", classmethod(held))
    caplog.set_level(logging.INFO, logger="pyggspec.grammar")
    body = {"prompt": "Hi", "n_predict": 20, "grammar": GBNF}
    with Engine(model_path, n_ctx=256, n_parallel=1, n_threads=2, sampling=GREEDY) as e:
        cfg = ServerConfig(model_id="g", model_path=str(model_path), sampling=GREEDY)
        with TestClient(create_app(e, cfg), raise_server_exceptions=False) as c, \
                ThreadPoolExecutor(1) as pool:
            assert entered.wait(30)  # started with the server, not by a request
            pending = pool.submit(c.post, "/completion", json=body)
            assert c.get("/health").status_code == 200  # while the tables are built
            time.sleep(0.2)
            assert not pending.done() and not built  # the request waits for them
            gate.set()
            r = pending.result(60)
            assert r.status_code == 200, r.text
            assert re.fullmatch(GBNF_RE, r.json()["content"])
        assert built == ["pyggspec-grammar-vocab"]
        with TestClient(create_app(e, cfg), raise_server_exceptions=False) as c:
            assert c.post("/completion", json=body).status_code == 200
        assert grammar.warm_grammar_vocab(e.tokenizer, e.n_vocab) is None
    assert built == ["pyggspec-grammar-vocab"]
    assert sum("llguidance's tables" in r.getMessage() for r in caplog.records) == 1
