"""``/v1/chat/completions`` with tools and reasoning, end to end through the HTTP app
(issue 21): llama-server's response shapes for ``reasoning_content`` and ``tool_calls``,
whole and streamed, ``tool_choice``, the reasoning budget, and 400s for bad tools.

A generated model writes random text, so the parsing tests script the answer: the server
state's ``submit`` (where a request goes to the scheduler) is replaced by one that plays a
given text back token by token, applying the request's ``max_tokens`` and stop strings as
the scheduler does. The real engine answers the tests that only check shapes and status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import Event, RequestTimings, Result
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server import sse_data
from tests.test_server_chat_parse import QWENISH, replay, tool

SAMPLING = SamplingParams(temp=0.0, seed=42)
WEATHER = tool("get_weather", location={"type": "string"}, days={"type": "integer"})
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def model_path(models) -> Path:
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=1024, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                spec=SpecConfig(n_max=3), sampling=SAMPLING) as e:
        yield e


@pytest.fixture(scope="module")
def app(engine, model_path):
    return create_app(engine, ServerConfig(model_id="tools", model_path=str(model_path),
                                           sampling=SAMPLING, chat_template=QWENISH))


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


class Scripted:
    """A request handle that plays ``text`` back one character (one token) at a time,
    ending as the scheduler would: at the first stop string (trimmed from the text, its
    tokens kept), at ``max_tokens`` (length), or at the end (eos)."""

    def __init__(self, rid: str, ids: list[int], gen: Any, text: str, n_vocab: int) -> None:
        cut, reason, word = len(text), "eos", None
        for s in gen.stop:
            i = text.find(s)
            if i >= 0 and i + len(s) <= cut:
                cut, reason, word = i + len(s), "stop", s
        if gen.max_tokens is not None and gen.max_tokens < cut:
            cut, reason, word = gen.max_tokens, "length", None
        shown = cut - len(word) if word else cut
        self.events = [Event((ord(c) % n_vocab,), c) for c in text[:shown]]
        self.events += [Event((ord(c) % n_vocab,), "") for c in text[shown:cut]]
        self._result = Result(id=rid, text=text[:shown],
                              tokens=[e.tokens[0] for e in self.events], prompt_tokens=ids,
                              stop_reason=reason, timings=RequestTimings(predicted_n=cut),
                              slot=0, stop_word=word)

    async def __aiter__(self):
        for ev in self.events:
            yield ev

    def result(self) -> Result:
        return self._result

    async def aresult(self) -> Result:
        return self._result

    def cancel(self) -> None:
        pass


@pytest.fixture
def script(app, monkeypatch):
    """``script(*texts)``: the next requests answer these texts, in order; returns the list
    of (prompt ids, GenParams) each request was submitted with."""
    state = app.state.pyggspec
    seen: list[tuple[list[int], Any]] = []
    texts: list[str] = []

    async def submit(ids, gen, rid, cache_prompt=True, progress=None, media=None):
        seen.append((list(ids), gen))
        return Scripted(rid, list(ids), gen, texts.pop(0), state.n_vocab)

    monkeypatch.setattr(state, "submit", submit)

    def play(*t: str) -> list[tuple[list[int], Any]]:
        texts.extend(t)
        return seen

    return play


def post(http, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()


def post_stream(http, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "stream": True, **body})
    assert r.status_code == 200, r.text
    chunks = sse_data(r.text.splitlines())
    assert chunks[-1] == "[DONE]"
    return chunks[:-1]


def deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content deltas of a chat stream (not the opening role chunk or the final one)."""
    out = []
    for c in chunks:
        if not c.get("choices"):
            continue
        d = c["choices"][0]["delta"]
        if d and "role" not in d:
            out.append(d)
    return out


# ---------------------------------------------------------------------------- scripted
def test_reasoning_and_tool_call_whole(http, script):
    script("Let me look it up.\n</think>\n\n" + CALL)
    out = post(http, {"tools": [WEATHER]})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    m = choice["message"]
    assert m["role"] == "assistant" and m["content"] == ""
    assert m["reasoning_content"] == "Let me look it up.\n"
    (tc,) = m["tool_calls"]
    assert tc["type"] == "function" and len(tc["id"]) == 32
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"location": "Paris", "days": 3}
    assert out["usage"]["completion_tokens"] == len("Let me look it up.\n</think>\n\n" + CALL)


def test_reasoning_and_tool_call_streamed(http, script):
    script("Let me look it up.\n</think>\n\n" + CALL)
    chunks = post_stream(http, {"tools": [WEATHER]})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "timings" in chunks[-1]
    m = replay(deltas(chunks))
    assert m.reasoning_content == "Let me look it up.\n" and m.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"location": "Paris", "days": 3})]
    firsts = [d["tool_calls"][0] for d in deltas(chunks) if "tool_calls" in d]
    assert firsts[0]["index"] == 0 and firsts[0]["type"] == "function"
    assert all(f["index"] == 0 and "id" not in f for f in firsts[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_format_none_and_no_tools(http, script, stream):
    text = "hmm\n</think>\n\nIt is sunny. " + CALL
    script(text)
    body = {"reasoning_format": "none", "stream": stream}
    if stream:
        m = replay(deltas(post_stream(http, body)))
        content, reasoning = m.content, m.reasoning_content
    else:
        msg = post(http, body)["choices"][0]["message"]
        content, reasoning = msg["content"], msg.get("reasoning_content", "")
    assert content == "<think>\n" + text and reasoning == ""  # no tools: no calls parsed


def test_plain_answer_and_thinking_off(http, script):
    script("Sunny.")
    out = post(http, {"chat_template_kwargs": {"enable_thinking": False}})
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert out["choices"][0]["finish_reason"] == "stop"


def test_cut_off_tool_call_is_length(http, script):
    seen = script(CALL)
    out = post(http, {"tools": [WEATHER], "max_tokens": 75,  # up to "</parameter>\n" of Paris
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert seen[-1][1].max_tokens == 75
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "location": "Paris"}


def test_parallel_tool_calls_false_keeps_the_first(http, script):
    script(CALL + "\n" + CALL.replace("Paris", "Rome"))
    m = post(http, {"tools": [WEATHER], "parallel_tool_calls": False})["choices"][0]["message"]
    assert len(m["tool_calls"]) == 1 and "Paris" in m["tool_calls"][0]["function"]["arguments"]


def test_required_tool_call_after_thinking(http, script, app):
    """tool_choice required: the thinking ends by itself, then the call is started for the
    model; one answer, one stream."""
    rest = CALL.removeprefix("<tool_call>\n")
    seen = script("Weather needs a tool.\n</think>\n\nI think it rains.", rest)
    chunks = post_stream(http, {"tools": [WEATHER], "tool_choice": "required"})
    assert len(seen) == 2
    assert "</think>" in seen[0][1].stop
    tok = app.state.pyggspec.tokenizer
    bridge = tok.tokenize("\n\n<tool_call>\n", add_special=False, parse_special=True)
    assert seen[1][0][-len(bridge):] == bridge
    assert seen[1][0][:len(seen[0][0])] == seen[0][0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    m = replay(deltas(chunks))
    assert m.reasoning_content == "Weather needs a tool.\n" and m.content == ""
    assert [c.name for c in m.tool_calls] == ["get_weather"]


def test_named_tool_choice_without_thinking(http, script):
    seen = script("<parameter=location>\nOslo\n</parameter>\n</function>\n</tool_call>")
    out = post(http, {"tools": [WEATHER, tool("other")],
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert len(seen) == 1
    m = out["choices"][0]["message"]
    assert m["tool_calls"][0]["function"] == {"name": "get_weather",
                                              "arguments": '{"location":"Oslo"}'}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_budget(http, script, stream):
    """The budget's tokens of thinking, then ``\\n</think>`` is put in and the answer goes
    on in a second request; usage counts every token once."""
    seen = script("abcdefghijklmnop", "\n\nThe answer.")
    body = {"reasoning_budget_tokens": 5, "max_tokens": 40, "stream": stream}
    if stream:
        chunks = post_stream(http, body)
        m = replay(deltas(chunks))
        final = chunks[-1]
        reasoning, content = m.reasoning_content, m.content
        usage = None
    else:
        out = post(http, body)
        final = out
        reasoning = out["choices"][0]["message"]["reasoning_content"]
        content = out["choices"][0]["message"]["content"]
        usage = out["usage"]
    assert reasoning == "abcde\n" and content == "The answer."
    assert seen[0][1].max_tokens == 5 and seen[1][1].max_tokens < 40 - 5
    assert final["choices"][0]["finish_reason"] == "stop"
    if usage is not None:
        assert usage["completion_tokens"] == 40 - seen[1][1].max_tokens + len("\n\nThe answer.")
        assert usage["prompt_tokens"] == len(seen[0][0])


def test_reasoning_budget_zero_and_natural_end(http, script, app):
    seen = script("Answer.")
    out = post(http, {"reasoning_budget_tokens": 0, "reasoning_budget_message": "Enough."})
    assert len(seen) == 1
    m = out["choices"][0]["message"]  # the message is part of the thinking, as there
    assert m == {"role": "assistant", "content": "Answer.", "reasoning_content": "Enough.\n"}
    tok = app.state.pyggspec.tokenizer
    forced = tok.tokenize("Enough.\n</think>", add_special=False, parse_special=True)
    assert seen[0][0][-len(forced):] == forced
    # an answer within the budget is one request
    seen = script("short\n</think>\n\nDone.")
    out = post(http, {"reasoning_budget_tokens": 100})
    m = out["choices"][0]["message"]
    assert m["reasoning_content"] == "short\n" and m["content"] == "Done."
    assert len(seen) == 2
    # thinking that ended within the budget goes on with nothing put in
    seen = script("short\n</think>\n\nDone and more", ", really.")  # cut after "Done"
    out = post(http, {"reasoning_budget_tokens": 20})
    m = out["choices"][0]["message"]
    assert m["reasoning_content"] == "short\n" and m["content"] == "Done, really."
    assert len(seen) == 4 and seen[3][0] == seen[2][0] + [
        ord(c) % app.state.pyggspec.n_vocab for c in "short\n</think>\n\nDone"]


def test_server_wide_reasoning_settings(engine, model_path, monkeypatch):
    app = create_app(engine, ServerConfig(model_id="x", model_path=str(model_path),
                                          sampling=SAMPLING, chat_template=QWENISH,
                                          reasoning_format="none", reasoning="off"),
                     manage_scheduler=False)
    state = app.state.pyggspec

    async def submit(ids, gen, rid, cache_prompt=True, progress=None, media=None):
        return Scripted(rid, ids, gen, "Hi.", state.n_vocab)

    monkeypatch.setattr(state, "submit", submit)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK})
        assert r.json()["choices"][0]["message"]["content"] == "<think>\n\n</think>\n\nHi."
        r = c.post("/apply-template", json={"messages": ASK})
        assert r.json()["prompt"].endswith("<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------- real engine
def test_real_generation_with_tools_and_reasoning(http):
    body = {"tools": [WEATHER], "tool_choice": "auto", "max_tokens": 8}
    out = post(http, body)
    m = out["choices"][0]["message"]
    assert m["role"] == "assistant" and isinstance(m["content"], str)
    assert out["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    chunks = post_stream(http, body)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    rebuilt = replay(deltas(chunks))  # the deltas are well-formed (random text: no content
    assert isinstance(rebuilt.content, str)  # check; a cached prefix may change the tokens)


def test_real_generation_required_tool_choice(http):
    out = post(http, {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 8,
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert out["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


def test_apply_template_shows_tools(http):
    r = http.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 200
    prompt = r.json()["prompt"]
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n")


@pytest.mark.parametrize("body, param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"reasoning_format": "fancy"}, "reasoning_format"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
    ({"messages": [{"role": "assistant", "tool_calls": 5}]}, "messages[0].tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template"])
def test_bad_tools_are_400(http, body, param, path):
    r = http.post(path, json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_real_generation_reasoning_budget(http, app, stream):
    """The budget through the real scheduler: two requests (the second continuing from the
    first's tokens and the forced end of thinking), one answer, counted once."""
    metrics = app.state.pyggspec.metrics
    before = sum(metrics.finished.values())
    body = {"reasoning_budget_tokens": 3, "max_tokens": 10, "stream": stream}
    if stream:
        chunks = post_stream(http, body)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        m = replay(deltas(chunks))
        reasoning, content = m.reasoning_content, m.content
    else:
        out = post(http, body)
        assert out["usage"]["completion_tokens"] <= 10
        assert out["timings"]["predicted_n"] <= 10
        reasoning = out["choices"][0]["message"].get("reasoning_content", "")
        content = out["choices"][0]["message"]["content"]
    assert "</think>" not in reasoning + content  # the forced end closed the thinking
    assert sum(metrics.finished.values()) == before + 1


def test_openai_client_reads_tool_calls_and_reasoning(http, script):
    """The ``openai`` package's models accept the answers as they are (whole and streamed)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    text = "Let me look it up.\n</think>\n\n" + CALL
    script(text, text)
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"location": "Paris", "days": 3}
    assert choice.message.model_extra["reasoning_content"] == "Let me look it up.\n"
    calls: dict[int, dict[str, str]] = {}
    reasoning = ""
    for chunk in client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for d in delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function and d.function.name) or ""
            c["arguments"] += (d.function and d.function.arguments) or ""
        last = chunk
    assert last.choices[0].finish_reason == "tool_calls"
    assert reasoning == "Let me look it up.\n"
    assert calls[0]["name"] == "get_weather" and len(calls[0]["id"]) == 32
    assert json.loads(calls[0]["arguments"]) == {"location": "Paris", "days": 3}


def test_real_qwen35_template_end_to_end(engine, model_path, monkeypatch):
    """Qwen3.5's own template (where the llama.cpp sdist is kept): its tool prompt, its
    generation prompt, the scripted answer parsed into a call."""
    from tests.test_server_chat_parse import QWEN35_JINJA

    if not QWEN35_JINJA.exists():
        pytest.skip(f"no Qwen3.5 template here ({QWEN35_JINJA})")
    app = create_app(engine, ServerConfig(model_id="q35", model_path=str(model_path),
                                          sampling=SAMPLING,
                                          chat_template=QWEN35_JINJA.read_text()),
                     manage_scheduler=False)
    state = app.state.pyggspec
    prompts: list[list[int]] = []

    async def submit(ids, gen, rid, cache_prompt=True, progress=None, media=None):
        prompts.append(list(ids))
        return Scripted(rid, ids, gen, "The user wants the weather.\n</think>\n\n" + CALL,
                        state.n_vocab)

    monkeypatch.setattr(state, "submit", submit)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/apply-template", json={"messages": ASK, "tools": [WEATHER]})
        prompt = r.json()["prompt"]
        assert "# Tools" in prompt and "<function=example_function_name>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n<think>\n")
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                     "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                chunks = sse_data(r.text.splitlines())[:-1]
                m = replay(deltas(chunks))
                calls = [(t.name, json.loads(t.arguments)) for t in m.tool_calls]
                reasoning, finish = m.reasoning_content, chunks[-1]["choices"][0]["finish_reason"]
            else:
                msg = r.json()["choices"][0]["message"]
                calls = [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                         for t in msg["tool_calls"]]
                reasoning = msg["reasoning_content"]
                finish = r.json()["choices"][0]["finish_reason"]
            assert calls == [("get_weather", {"location": "Paris", "days": 3})]
            assert reasoning == "The user wants the weather.\n" and finish == "tool_calls"
        # a follow-up turn with the call and its result renders in Qwen3.5's own form
        msgs = ASK + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"location": "Paris", "days": 3}'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
        prompt = c.post("/apply-template", json={"messages": msgs, "tools": [WEATHER]}
                        ).json()["prompt"]
        assert ("<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n"
                "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
                in prompt)
        assert "<tool_response>\nsunny\n</tool_response>" in prompt
