"""A forced tool call (``tool_choice`` ``required`` / a named function) is held by a grammar
(issue 21, item 3): the answer is a call of a declared tool with arguments of its schema,
whatever the model would have written, and the same with and without MTP speculation.

The grammar (``pyggspec.serving.http.tool_grammar``) is checked on its own first (texts in
and out of it, through llguidance with the test model's vocabulary), then end to end with a
random-weight model that writes whatever the mask leaves it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.sampling.grammar import compile_grammar, grammar_vocab
from pyggspec.serving.http.tool_grammar import tool_call_grammar
from pyggspec.serving.server import ServerConfig, create_app
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
    m = compile_grammar(spec, v).matcher()
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
