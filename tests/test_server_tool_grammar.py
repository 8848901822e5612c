"""A forced tool call (``tool_choice`` ``required`` / a named function) is held by a grammar
(issue 21, item 3): the answer is a call of a declared tool with arguments of its schema,
whatever the model would have written, and the same with and without MTP speculation.

The grammar (``pyggspec.serving.http.tool_grammar``) is checked on its own first (texts in
and out of it, through llguidance with the test model's vocabulary), then end to end with a
random-weight model that writes whatever the mask leaves it.

``tool_choice: auto`` gets llama-server's lazy grammar (``pyggspec.sampling.lazy_grammar``):
free text (and thinking) that may end anywhere, then from ``<tool_call>`` the same grammar.
Checked the same ways, plus: free rows compute no mask, rows agree at a draft prefix and
after accepting, a token running past the trigger, a random model finishing a call its
prefilled answer started, host / in-graph / MTP runs token-identical.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.sampling.grammar import GrammarVocab, compile_grammar, grammar_vocab
from pyggspec.sampling.lazy_grammar import matcher_for
from pyggspec.serving.http.tool_grammar import auto_tool_grammar, tool_call_grammar
from pyggspec.serving.request import Request
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server import sse_data
from tests.test_server_chat_parse import QWENISH, tool

GREEDY = SamplingParams(temp=0.0)
# a finite language (booleans, string enums): a random model must end its call in time
SWITCH = tool("set_switch", on={"type": "boolean"}, room={"type": "string", "enum": ["hall", "den"]})
WEATHER = tool("get_weather", location={"type": "string"}, days={"type": "integer"})
ASK = [{"role": "user", "content": "Lights?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def model_path(models):
    return models.dense(dtype="f32", agreement=0.7, tied_embeddings=False)


@pytest.fixture(scope="module")
def vocab(model_path):
    with Engine(model_path, n_threads=1, n_ctx=128) as e:
        yield grammar_vocab(e.tokenizer, e.n_vocab), e.tokenizer


def takes(vocab, spec, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may end there."""
    v, tok = vocab
    m = matcher_for(compile_grammar(spec, v))
    ids = tok.tokenize(text, add_special=False, parse_special=False)  # the text's bytes
    if m.valid_prefix(ids) < len(ids):
        return False
    for t in ids:
        m.accept(t)
    allowed = m.allowed()
    return m.stopped or (allowed is not None and bool(allowed[list(v.eos)].any()))


def param(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


def call(fn: str, *params: str) -> str:
    return f"<function={fn}>\n{''.join(params)}</function>\n</tool_call>"


ARGS = param("location", "Paris") + param("days", "3")


@pytest.mark.parametrize("text,ok", [
    (call("get_weather", ARGS), True),
    # required arguments in either order (Qwen does not always keep the schema's)
    (call("get_weather", param("days", "3"), param("location", "Paris")), True),
    (call("get_wether", ARGS), False),  # no such tool
    (call("get_weather", param("location", "Paris")), False),  # a required one missing
    (call("get_weather", param("location", "Paris"), param("days", "three")), False),
    (call("set_switch", param("on", "true"), param("room", "den")), True),
    (call("set_switch", param("on", "true"), param("room", "attic")), False),  # not in enum
    (call("get_weather", ARGS) + "\nmore", False),
])
def test_the_grammar_takes_calls_of_declared_tools_only(vocab, text, ok):
    spec = tool_call_grammar([WEATHER, SWITCH], None, parallel=False)
    assert takes(vocab, spec, text) is ok


def test_named_and_parallel_forms(vocab):
    named = tool_call_grammar([WEATHER, SWITCH], "get_weather", parallel=False)
    assert takes(vocab, named, f"{ARGS}</function>\n</tool_call>")
    assert not takes(vocab, named, param("on", "true") + "</function>\n</tool_call>")
    par = tool_call_grammar([WEATHER], None, parallel=True)
    one = call("get_weather", ARGS)
    assert takes(vocab, par, one + "\n<tool_call>\n" + one)
    assert not takes(vocab, tool_call_grammar([WEATHER], None, parallel=False),
                     one + "\n<tool_call>\n" + one)


def test_functions_without_required_or_any_arguments(vocab):
    opt = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}
    bare = {"type": "function", "function": {"name": "now"}}
    spec = tool_call_grammar([opt, bare], None, parallel=False)
    for text in (call("ping"), call("ping", param("n", "2")), call("now")):
        assert takes(vocab, spec, text), text


# ---------------------------------------------------------------------------- served
def serve(path, spec: bool):
    # fixed lengths: every step drafts, so "with MTP" is speculation (the default budget may
    # decline every step on a loaded machine, and the comparison would be plain vs plain)
    kw = {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=3, adaptive=False)} if spec else {}
    e = Engine(path, n_threads=2, n_ctx=512, n_parallel=1, sampling=GREEDY, **kw)
    app = create_app(e, ServerConfig(model_id="t", model_path=str(path), sampling=GREEDY,
                                     chat_template=QWENISH))
    return e, app


def chat(c, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 400, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "set_switch"}}])
def test_a_random_model_makes_a_valid_call_the_same_with_and_without_mtp(model_path, choice):
    outs = []
    for spec in (False, True):
        e, app = serve(model_path, spec)
        with e, TestClient(app, raise_server_exceptions=False) as c:
            body = {"tools": [SWITCH], "tool_choice": choice, "parallel_tool_calls": False,
                    **NO_THINK}
            outs.append(chat(c, body))
    for out in outs:
        assert out["finish_reason"] == "tool_calls", out
        (call,) = out["message"]["tool_calls"]
        assert call["function"]["name"] == "set_switch"
        args = json.loads(call["function"]["arguments"])
        assert set(args) == {"on", "room"} and isinstance(args["on"], bool)
        assert args["room"] in ("hall", "den")
    # the same answer with and without MTP (call ids are random)
    assert outs[0]["message"].get("content") == outs[1]["message"].get("content")
    assert ([c["function"] for c in outs[0]["message"]["tool_calls"]]
            == [c["function"] for c in outs[1]["message"]["tool_calls"]])


def test_after_thinking_the_grammar_holds_the_second_request(model_path):
    """The thinking block is free text; the call after it (its start inserted) is held."""
    e, app = serve(model_path, False)
    state = app.state.pyggspec
    grammars = []
    submit = state.submit

    async def seen(ids, gen, rid, cache_prompt=True, **kw):
        grammars.append(gen.grammar)
        return await submit(ids, gen, rid, cache_prompt, **kw)

    state.submit = seen
    with e, TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [SWITCH], "tool_choice": "required",
            "max_tokens": 400, "reasoning_budget_tokens": 4, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
    assert grammars[0] is None and grammars[1] is not None
    assert grammars[1].kind == "lark" and grammars[1].field == "tool_choice"
    assert out["finish_reason"] == "tool_calls", out
    assert json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])["room"] in (
        "hall", "den")


def test_a_grammar_with_a_required_tool_call_is_400(model_path):
    e, app = serve(model_path, False)
    with e, TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [SWITCH], "tool_choice": "required",
            "grammar": 'root ::= "x"'})
    assert r.status_code == 400
    assert "grammar" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- tool_choice auto
AUTO = auto_tool_grammar([WEATHER, SWITCH], parallel=False, thinking=False)
AUTO_THINK = auto_tool_grammar([WEATHER, SWITCH], parallel=False, thinking=True)
OPEN = "<tool_call>\n"


def may_end(vocab, spec, text: str) -> bool:
    """Whether the lazy grammar takes ``text`` whole and may end there (a free row may)."""
    v, tok = vocab
    m = matcher_for(compile_grammar(spec, v))
    ids = tok.tokenize(text, add_special=False, parse_special=False)
    if m.valid_prefix(ids) < len(ids):
        return False
    for t in ids:
        m.accept(t)
    allowed = m.allowed()
    return m.stopped or allowed is None or bool(allowed[list(v.eos)].any())


def test_the_lazy_grammar_compiles_for_the_test_tools(vocab):
    for spec in (AUTO, AUTO_THINK, auto_tool_grammar([WEATHER], True, False)):
        assert spec.trigger == "<tool_call>" and spec.field == "tool_choice"
        assert matcher_for(compile_grammar(spec, vocab[0])).free()
    assert AUTO_THINK.after == "</think>" and not AUTO.after


@pytest.mark.parametrize("text,ok", [
    ("", True),
    ("Paris is sunny, no tool needed.", True),  # free text ends where it likes
    ("Half a marker <tool_ca", True),
    ("Let me look. " + OPEN + call("get_weather", ARGS), True),
    (OPEN + call("set_switch", param("room", "den"), param("on", "false")), True),
    ("x " + OPEN + call("get_wether", ARGS), False),  # no such tool
    ("x " + OPEN + call("get_weather", param("location", "Paris")), False),  # days missing
    ("x " + OPEN + call("get_weather", param("location", "P"), param("days", "three")), False),
    ("x " + OPEN + call("get_weather", ARGS) + "\nmore", False),  # text after the last call
    ("x " + OPEN + call("get_weather", ARGS) + "\n" + OPEN + call("get_weather", ARGS), False),
    ("x <tool_call>", False),  # the call must follow its start
    ("x <tool_call> junk", False),
])
def test_auto_is_free_until_tool_call_then_holds_a_declared_call(vocab, text, ok):
    assert may_end(vocab, AUTO, text) is ok


def test_auto_with_thinking_holds_only_calls_after_the_block(vocab):
    think = "Maybe <tool_call> junk, maybe not.\n"
    assert may_end(vocab, AUTO_THINK, think)  # in the thinking block: free, may end
    assert may_end(vocab, AUTO_THINK, think + "</think>\n\nIt is sunny.")
    assert may_end(vocab, AUTO_THINK, think + "</think>\n\n" + OPEN + call("get_weather", ARGS))
    assert not may_end(vocab, AUTO_THINK, think + "</think>\n\n<tool_call> junk")
    assert not may_end(vocab, AUTO, think)  # without the gate the same text starts a call


def test_auto_parallel_calls(vocab):
    two = OPEN + call("get_weather", ARGS) + "\n" + OPEN + call("set_switch", param(
        "on", "true"), param("room", "hall"))
    assert may_end(vocab, auto_tool_grammar([WEATHER, SWITCH], True, False), "Both. " + two)
    assert not may_end(vocab, AUTO, "Both. " + two)


def test_auto_rows_are_free_before_the_call_and_the_same_at_a_draft_prefix(vocab):
    """Before the trigger a row computes nothing (no mask: the chain adds no bias, the held
    matcher is untouched) and takes every token; after it the mask is within what
    ``valid_prefix`` takes; a row is the same at a draft prefix as after accepting those
    tokens; restore rolls back across the trigger."""
    v, tok = vocab
    text = "Sure. " + OPEN + call("set_switch", param("on", "true"), param("room", "den"))
    ids = tok.tokenize(text, add_special=False, parse_special=False)
    trig = len(tok.tokenize("Sure. <tool_call>", add_special=False, parse_special=False))
    g = compile_grammar(AUTO, v)
    a, b = matcher_for(g), matcher_for(g)
    for i, t in enumerate(ids):
        row, at_prefix = a.allowed(), b.allowed(ids[:i])
        assert (row is None) == (i < trig) == a.free()
        assert (at_prefix is None and row is None) or np.array_equal(at_prefix, row)
        takes = np.array([a.valid_prefix([u]) == 1 for u in range(v.n_vocab)])
        if row is None:  # a free row takes every token
            assert takes.all(), i
        else:  # (llguidance's mask keeps a forced text's own tokens: a subset)
            assert takes[row].all() and takes.sum() >= row.sum() > 0, i
        if i < trig:
            assert a.held.n_consumed == 0
        a.accept(t)
    assert a.stopped and b.valid_prefix(ids) == len(ids) and b.n_consumed == 0
    a.restore(trig - 1)
    assert a.free() and a.n_consumed == trig - 1 and a.held.n_consumed == 0
    for t in ids[trig - 1:]:
        a.accept(t)
    assert a.stopped


def _vocab_with(tokenizer, n_vocab: int, pieces: list[bytes]) -> tuple[Any, list[int]]:
    """The test vocabulary with its last ids given ``pieces`` (tokens a real vocabulary
    has: ``>`` + more, text holding a whole ``<tool_call>``), and those ids."""
    import llguidance

    words = [b"\xff" + p if special else p for p, special in tokenizer.token_table()]
    words += [b""] * (n_vocab - len(words))
    ids = list(range(n_vocab - len(pieces), n_vocab))
    for i, p in zip(ids, pieces):
        words[i] = p
    vocab_ptr, fn = tokenizer.native_tokenizer()
    eos = tokenizer.eog_ids()
    lltok = llguidance.LLTokenizer.from_llamacpp(tokens=words, vocab_ptr=vocab_ptr,
                                                 tokenize_fptr=fn, eos_token=eos, slices=None)
    return GrammarVocab(lltok, n_vocab, eos, words), ids


def test_a_token_that_completes_the_trigger_and_runs_past_it(vocab):
    """Bytes past the trigger in the token that completes it go to the held grammar: taken
    when they start a call, refused when not; a token holding the gate and then the trigger
    (before the gate) is free text."""
    _, tok = vocab
    v, (nl, nl_lt, gt_x, inner_ok, inner_bad) = _vocab_with(
        tok, vocab[0].n_vocab,
        [b">\n", b">\n<", b">x", b" <tool_call>\n", b"</think><tool_call>x"])
    g = compile_grammar(AUTO, v)
    m = matcher_for(g)
    start = tok.tokenize("Hm <tool_call", add_special=False, parse_special=False)
    for t in start:
        m.accept(t)
    row = m.allowed()
    assert row is not None and row[nl] and row[nl_lt] and not row[gt_x]
    assert not row[inner_bad] and row[inner_ok] and m.valid_prefix([gt_x]) == 0
    rest = tok.tokenize("function=set_switch>\n" + param("on", "true") + param("room", "den")
                        + "</function>\n</tool_call>", add_special=False, parse_special=False)
    assert m.valid_prefix([nl_lt, *rest]) == 1 + len(rest)
    m.accept(nl_lt)
    assert not m.free() and m.held.n_consumed == 2  # "\n<" tokenized again for the grammar
    for t in rest:
        m.accept(t)
    assert m.stopped
    m.restore(len(start))
    assert m.held.n_consumed == 0 and m.allowed()[nl] and not m.allowed()[gt_x]
    # before the gate a whole "<tool_call>" is thinking; one after "</think>" is not
    gated = matcher_for(compile_grammar(AUTO_THINK, v)).allowed()
    assert gated is not None and gated[inner_ok] and gated[gt_x] and not gated[inner_bad]


SAMPLED = SamplingParams(temp=1.0, seed=5, top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize("backend", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_auto_engine_the_same_with_and_without_mtp_on_the_host_and_in_the_graph(
        model_path, sampling, backend):
    """Two lazy-grammar requests in one batch -- one whose prompt started the call (held
    from its first token), one free -- give plain decoding's tokens with MTP (snapshot and
    checkpoint rollback) and with the grammar's bias row in the graph."""
    held = auto_tool_grammar([SWITCH], False, False, lead="Switching.\n<tool_call>")
    free = auto_tool_grammar([SWITCH, WEATHER], False, False)

    def run(e):
        hs = [e.submit(Request(e.tokenize("Switching.\n<tool_call>"), max_tokens=120,
                               sampling=sampling, grammar=held)),
              e.submit(Request(e.tokenize("The quick brown fox"), max_tokens=40,
                               sampling=sampling, grammar=free, ignore_eos=True))]
        return [h.result() for h in hs]

    kw = {"n_threads": 2, "n_ctx": 512, "n_parallel": 2}
    with Engine(model_path, **kw) as e:
        ref = run(e)
    assert ref[0].stop_reason == "eos" and ref[0].text.startswith("\n<function=set_switch>")
    assert ref[0].text.endswith("</function>\n</tool_call>") and len(ref[1].tokens) == 40
    for rollback in ("snapshot", "checkpoint"):
        spec = SpecConfig(n_max=3, rollback=rollback, adaptive=False)
        with Engine(model_path, spec_type="draft-mtp", spec=spec, backend_sampling=backend,
                    **kw) as e:
            got = run(e)
        assert [g.tokens for g in got] == [r.tokens for r in ref], rollback
        assert sum(g.spec.n_accepted for g in got) > 0
    with Engine(model_path, backend_sampling=backend, **kw) as e:
        assert [g.tokens for g in run(e)] == [r.tokens for r in ref]
        if backend:
            assert "grammar" in e.worker.samplers.stats.device_stages


def _watch(app) -> list:
    """The (grammar, stop) of each request the chat layer submits."""
    state = app.state.pyggspec
    seen = []
    submit = state.submit

    async def watched(ids, gen, rid, cache_prompt=True, **kw):
        seen.append((gen.grammar, tuple(gen.stop)))
        return await submit(ids, gen, rid, cache_prompt, **kw)

    state.submit = watched
    return seen


PREFILL = [*ASK, {"role": "assistant", "content": "I will switch it.\n<tool_call>"}]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}])
def test_auto_a_random_model_finishes_a_started_call_the_same_with_and_without_mtp(
        model_path, sampling):
    """The prompt ends with the trigger (a prefilled answer): the lazy grammar holds the
    rest to a call of a declared tool, whole and streamed, greedy and seeded, with and
    without MTP."""
    outs = []
    for spec in (False, True):
        e, app = serve(model_path, spec)
        seen = _watch(app)
        with e, TestClient(app, raise_server_exceptions=False) as c:
            body = {"messages": PREFILL, "tools": [SWITCH], "parallel_tool_calls": False,
                    **sampling}
            outs.append(chat(c, body))
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 400, "stream": True})
            chunks = [d for d in sse_data(r.iter_lines()) if d != "[DONE]"]
        assert seen[0][0].trigger == "<tool_call>" and "I will switch it." in seen[0][0].lead
        deltas = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert "".join(d["function"].get("arguments", "") for d in deltas) == \
            outs[-1]["message"]["tool_calls"][0]["function"]["arguments"]
    for out in outs:
        assert out["finish_reason"] == "tool_calls", out
        (tc,) = out["message"]["tool_calls"]
        args = json.loads(tc["function"]["arguments"])
        assert tc["function"]["name"] == "set_switch" and set(args) == {"on", "room"}
        assert isinstance(args["on"], bool) and args["room"] in ("hall", "den")
    assert outs[0]["message"]["tool_calls"][0]["function"] == \
        outs[1]["message"]["tool_calls"][0]["function"]
    assert outs[0]["message"].get("content") == outs[1]["message"].get("content")


def test_auto_free_answers_are_the_same_with_and_without_mtp(model_path):
    """No call started: the answer is free text (a row computes no mask), parsed, and the
    same with and without MTP; with thinking the lazy grammar waits for ``</think>``."""
    outs = []
    for spec in (False, True):
        e, app = serve(model_path, spec)
        seen = _watch(app)
        with e, TestClient(app, raise_server_exceptions=False) as c:
            for extra in (NO_THINK, {}):
                outs.append(chat(c, {"tools": [SWITCH, WEATHER], "max_tokens": 48, **extra}))
        assert [g.after for g, _ in seen] == ["", "</think>"]
    assert outs[:2] == outs[2:]
    assert all(o["finish_reason"] in ("stop", "length", "tool_calls") for o in outs)


def test_auto_with_a_reasoning_budget_holds_what_follows_the_thinking(model_path):
    """With a budget the thinking is a first request that stops at ``</think>`` (or the
    budget), and the second holds everything after it with the lazy grammar alone."""
    e, app = serve(model_path, False)
    seen = _watch(app)
    with e, TestClient(app, raise_server_exceptions=False) as c:
        out = chat(c, {"tools": [SWITCH], "reasoning_budget_tokens": 6})
    (g1, stop1), (g2, stop2) = seen
    assert g1.after == "</think>" and "</think>" in stop1
    assert g2.trigger == "<tool_call>" and g2.after == "" and g2.lead == ""
    assert "</think>" not in stop2 and out["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("own", [{"grammar": 'root ::= "yes" | "no"'},
                                 {"response_format": {"type": "json_object"}}])
def test_auto_a_grammar_of_the_request_replaces_the_lazy_one(model_path, own):
    e, app = serve(model_path, False)
    seen = _watch(app)
    with e, TestClient(app, raise_server_exceptions=False) as c:
        out = chat(c, {"tools": [SWITCH], "tool_choice": "auto", **NO_THINK, **own})
    assert not seen[0][0].trigger
    text = out["message"]["content"]
    if "grammar" in own:
        assert text in ("yes", "no")
    else:
        assert isinstance(json.loads(text), dict)
