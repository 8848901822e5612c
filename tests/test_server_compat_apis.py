"""OpenAI's Responses API, Anthropic's Messages API and llama-server's ``return_progress`` /
``timings_per_token`` stream fields, end to end through the HTTP app (issue 21).

The shape tests script the answer (:class:`~tests.test_server_chat_tools.Scripted`: the
server state's ``submit`` plays a given text back token by token) so reasoning, text and
tool calls appear in a known order; the real engine answers the tests of prompt progress,
live timings and equivalence with ``/v1/chat/completions``. The reference is llama-server
0.3.36 (``tools/server/server-chat.cpp``, ``server-task.cpp``) and the APIs' own documents.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server import sse_data
from tests.test_server_chat_parse import QWENISH
from tests.test_server_chat_tools import CALL, WEATHER, Scripted

SAMPLING = SamplingParams(temp=0.0, seed=42)
THOUGHT = "Let me look it up.\n</think>\n\n"
ANSWER = THOUGHT + "It is sunny. " + CALL
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "get_weather does things",
                     "input_schema": WEATHER["function"]["parameters"]}
UBATCH = 16


@pytest.fixture(scope="module")
def model_path(models) -> Path:
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=512, n_parallel=2, n_threads=1, n_batch=64,
                n_ubatch=UBATCH, sampling=SAMPLING) as e:
        yield e


@pytest.fixture(scope="module")
def app(engine, model_path):
    return create_app(engine, ServerConfig(model_id="compat", model_path=str(model_path),
                                           sampling=SAMPLING, chat_template=QWENISH))


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def script(app, monkeypatch):
    """``script(text)``: the next request answers ``text``."""
    state = app.state.pyggspec
    texts: list[str] = []

    async def submit(ids, gen, rid, cache_prompt=True, progress=None, media=None):
        return Scripted(rid, list(ids), gen, texts.pop(0), state.n_vocab)

    monkeypatch.setattr(state, "submit", submit)
    return texts.append


def named_events(text: str) -> list[dict[str, Any]]:
    """The events of a stream with ``event:`` lines, each checked against its data."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert lines[i - 1] == f"event: {data['type']}"
            out.append(data)
    return out


# ---------------------------------------------------------------------------- Responses
def test_responses_whole(http, script):
    script(ANSWER)
    r = http.post("/v1/responses", json={"input": "Weather in Paris?", "tools": [
        {"type": "function", **WEATHER["function"]}, {"type": "web_search"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("resp_") and out["object"] == "response"
    assert out["status"] == "completed" and out["incomplete_details"] is None
    rs, msg, fc = out["output"]
    assert rs["type"] == "reasoning" and rs["id"].startswith("rs_")
    assert rs["content"] == [{"type": "reasoning_text", "text": "Let me look it up.\n"}]
    assert msg["type"] == "message" and msg["id"].startswith("msg_")
    assert msg["role"] == "assistant" and msg["status"] == "completed"
    assert msg["content"][0]["type"] == "output_text"
    assert msg["content"][0]["text"] == "It is sunny. "
    assert fc["type"] == "function_call" and fc["id"].startswith("fc_")
    assert fc["name"] == "get_weather" and len(fc["call_id"]) == 32
    assert json.loads(fc["arguments"]) == {"location": "Paris", "days": 3}
    u = out["usage"]
    assert u["output_tokens"] == len(ANSWER)
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert "cached_tokens" in u["input_tokens_details"]


def test_responses_cut_off_says_so(http, script):
    script("It is sunny today.")
    out = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5}).json()
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["max_output_tokens"] == 5


def test_responses_streamed(http, script):
    script(ANSWER)
    r = http.post("/v1/responses", json={"input": "Weather in Paris?", "stream": True,
                                         "tools": [{"type": "function",
                                                    **WEATHER["function"]}]})
    assert r.status_code == 200, r.text
    assert "[DONE]" not in r.text
    events = named_events(r.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    rid = events[0]["response"]["id"]
    assert rid.startswith("resp_") and events[-1]["response"]["id"] == rid
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in added] == ["reasoning", "message", "function_call"]
    assert [i["id"] for i in added] == [i["id"] for i in done]
    final = events[-1]["response"]
    assert final["output"] == done and final["status"] == "completed"
    assert "timings" in events[-1] and final["usage"]["output_tokens"] == len(ANSWER)

    def joined(kind: str, item_id: str) -> str:
        return "".join(e["delta"] for e in events if e["type"] == kind
                       and e["item_id"] == item_id)

    rs, msg, fc = done
    assert joined("response.reasoning_text.delta", rs["id"]) == "Let me look it up.\n"
    assert joined("response.output_text.delta", msg["id"]) == "It is sunny. "
    assert msg["content"][0]["text"] == "It is sunny. "
    args = joined("response.function_call_arguments.delta", fc["id"])
    assert args == fc["arguments"] and json.loads(args) == {"location": "Paris", "days": 3}
    for kind in ("response.content_part.added", "response.output_text.done",
                 "response.content_part.done"):
        (e,) = [e for e in events if e["type"] == kind]
        assert e["item_id"] == msg["id"] and e["output_index"] == 1
    # an item is done before the next one is added
    assert kinds.index("response.output_item.done") < kinds.index(
        "response.output_item.added", kinds.index("response.output_item.added") + 1)


def _input_tokens(http, path: str, body: dict[str, Any]) -> int:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


CHAT_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": "{\"location\": \"Paris\", \"days\": 3}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]


def test_responses_input_items_render_as_chat(http):
    """Input items (instructions, messages, reasoning, function calls and their output)
    give the prompt of the same conversation sent as chat messages."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"location\": \"Paris\", \"days\": 3}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "user", "content": "And tomorrow?"},
    ]
    n = _input_tokens(http, "/v1/responses/input_tokens", {
        "instructions": "Be brief.", "input": items,
        "tools": [{"type": "function", **WEATHER["function"]}]})
    assert n == _input_tokens(http, "/v1/chat/completions/input_tokens",
                              {"messages": CHAT_HISTORY, "tools": [WEATHER]})
    r = http.post("/responses/input_tokens", json={"input": "hi"})
    assert r.json()["object"] == "response.input_tokens"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
])
def test_responses_client_mistakes_are_400(http, body, param):
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == 400 and err["message"]


# ---------------------------------------------------------------------------- Anthropic
def test_anthropic_whole(http, script):
    script(ANSWER)
    r = http.post("/v1/messages", json={"model": "claude", "max_tokens": 500,
                                        "tools": [ANTHROPIC_WEATHER],
                                        "messages": [{"role": "user", "content": "Weather?"}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["type"] == "message" and out["role"] == "assistant"
    assert out["id"].startswith("msg_") and out["model"] == "claude"
    assert out["content"] == [
        {"type": "thinking", "thinking": "Let me look it up.\n", "signature": ""},
        {"type": "text", "text": "It is sunny. "},
        {"type": "tool_use", "id": out["content"][2]["id"], "name": "get_weather",
         "input": {"location": "Paris", "days": 3}}]
    assert out["stop_reason"] == "tool_use" and out["stop_sequence"] is None
    u = out["usage"]
    assert u["output_tokens"] == len(ANSWER)
    assert u["input_tokens"] > 0 and u["cache_read_input_tokens"] == 0
    assert "timings" not in out


def test_anthropic_stop_reasons(http, script):
    script("It is sunny. END and more")
    out = http.post("/v1/messages", json={"max_tokens": 100, "stop_sequences": ["END"],
                                          "messages": [{"role": "user", "content": "hi"}]})
    out = out.json()
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "END"
    script("It is sunny today.")
    out = http.post("/v1/messages", json={"max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert out["stop_reason"] == "max_tokens"


def test_anthropic_streamed(http, script):
    script(ANSWER)
    r = http.post("/v1/messages", json={"max_tokens": 500, "stream": True,
                                        "tools": [ANTHROPIC_WEATHER],
                                        "messages": [{"role": "user", "content": "Weather?"}]})
    assert r.status_code == 200, r.text
    events = named_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] > 0
    starts = [e for e in events if e["type"] == "content_block_start"]
    stops = [e for e in events if e["type"] == "content_block_stop"]
    assert [e["index"] for e in starts] == [e["index"] for e in stops] == [0, 1, 2]
    assert [e["content_block"]["type"] for e in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["content_block"]["name"] == "get_weather"
    # blocks follow each other: each stops before the next starts
    for a, b in zip(stops, starts[1:]):
        assert events.index(a) < events.index(b)

    def joined(index: int, key: str) -> str:
        return "".join(e["delta"].get(key, "") for e in events
                       if e["type"] == "content_block_delta" and e["index"] == index)

    assert joined(0, "thinking") == "Let me look it up.\n"
    assert joined(1, "text") == "It is sunny. "
    assert json.loads(joined(2, "partial_json")) == {"location": "Paris", "days": 3}
    sig = events.index(stops[0]) - 1
    assert events[sig]["delta"] == {"type": "signature_delta", "signature": ""}
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] == len(ANSWER)
    assert not any("timings" in e for e in events)


def test_anthropic_conversation_renders_as_chat(http):
    """System blocks, thinking, tool_use and tool_result blocks give the prompt of the
    same conversation sent as chat messages; count_tokens needs no max_tokens."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather",
             "input": {"location": "Paris", "days": 3}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    n = _input_tokens(http, "/v1/messages/count_tokens", {
        "system": [{"type": "text", "text": "Be brief."}], "messages": messages,
        "tools": [ANTHROPIC_WEATHER]})
    assert n == _input_tokens(http, "/v1/chat/completions/input_tokens",
                              {"messages": CHAT_HISTORY, "tools": [WEATHER]})
    assert set(http.post("/v1/messages/count_tokens", json={
        "messages": [{"role": "user", "content": "hi"}]}).json()) == {"input_tokens"}


def test_anthropic_billing_header_is_made_constant(http):
    """Claude Code's per-request ``cch=`` stamp would end prompt reuse at the system
    prompt's first line: it is replaced by a constant (as llama-server does)."""
    from pyggspec.serving.http.anthropic_api import chat_messages

    def system(stamp: str) -> list[dict[str, Any]]:
        return chat_messages({"system": f"x-anthropic-billing-header: v=1; cch={stamp};You "
                                        "are", "messages": []})

    assert system("a5145") == system("9f0e1") == [
        {"role": "system", "content": "x-anthropic-billing-header: v=1; cch=fffff;You are"}]
    assert chat_messages({"system": "cch=a5145; plain", "messages": []})[0]["content"] == \
        "cch=a5145; plain"


@pytest.mark.parametrize("body", [
    {"max_tokens": 5},
    {"max_tokens": 5, "messages": "hi"},
    {"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    {"max_tokens": -2, "messages": [{"role": "user", "content": "hi"}]},
    {"max_tokens": 5, "tool_choice": "any", "messages": [{"role": "user", "content": "hi"}]},
    {"max_tokens": 5, "stop_sequences": "END", "messages": [{"role": "user", "content": "hi"}]},
])
def test_anthropic_client_mistakes_are_400_in_its_shape(http, body):
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert out["error"]["message"]
    if "image" in json.dumps(body):
        assert "image input is not supported" in out["error"]["message"]
    r = http.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------- real engine
LONG = "This is a test " * 12


def test_anthropic_and_responses_answer_as_chat(http):
    """The same conversation through the three APIs: the same tokens (greedy)."""
    msgs = [{"role": "user", "content": "Hello"}]
    chat = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6}).json()
    want = chat["choices"][0]["message"]
    ant = http.post("/v1/messages", json={"messages": msgs, "max_tokens": 6}).json()
    resp = http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 6}).json()
    blocks = {b["type"]: b for b in ant["content"]}
    items = {i["type"]: i for i in resp["output"]}
    assert blocks.get("thinking", {}).get("thinking", "") == want.get("reasoning_content", "")
    assert blocks.get("text", {}).get("text", "") == want["content"]
    rs = items.get("reasoning", {"content": [{"text": ""}]})["content"]
    assert (rs[0]["text"] if rs else "") == want.get("reasoning_content", "")
    msg = items.get("message", {"content": [{"text": ""}]})
    assert msg["content"][0]["text"] == want["content"]
    n = chat["usage"]["completion_tokens"]
    assert ant["usage"]["output_tokens"] == resp["usage"]["output_tokens"] == n
    assert chat["usage"]["prompt_tokens"] == resp["usage"]["input_tokens"] == \
        ant["usage"]["input_tokens"] + ant["usage"]["cache_read_input_tokens"]


def test_empty_anthropic_messages_are_accepted(http):
    r = http.post("/v1/messages", json={"max_tokens": 2, "messages": []})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["content"]


def _progress(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def _check_progress(progress: list[dict[str, Any]], n_prompt: int) -> None:
    """llama-server's: one report at admission (nothing new processed yet), then one per
    prompt chunk, each at most a ubatch further, the last one complete."""
    assert len(progress) >= 1 + -(-(n_prompt - progress[0]["cache"]) // UBATCH)
    assert progress[0]["cache"] == progress[0]["processed"]
    assert all(p["total"] == n_prompt and p["cache"] == progress[0]["cache"]
               for p in progress)
    for a, b in itertools.pairwise(progress):
        assert 0 < b["processed"] - a["processed"] <= UBATCH
        assert b["time_ms"] >= a["time_ms"] >= 0
    assert progress[-1]["processed"] == n_prompt


def test_return_progress_in_chat_stream(http):
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 3,
            "stream": True, "return_progress": True, "cache_prompt": False}
    r = http.post("/v1/chat/completions", json=body)
    chunks = sse_data(r.text.splitlines())[:-1]
    n_prompt = http.post("/v1/chat/completions/input_tokens", json=body).json()["input_tokens"]
    assert n_prompt > 2 * UBATCH
    progress = _progress(chunks)
    _check_progress(progress, n_prompt)
    assert progress[0]["cache"] == 0
    for c in chunks:  # llama-server: each report rides on an opening role delta
        if "prompt_progress" in c:
            assert c["choices"][0]["delta"] == {"role": "assistant", "content": None}
    first_token = next(i for i, c in enumerate(chunks) if c["choices"]
                       and "role" not in c["choices"][0]["delta"])
    assert all("prompt_progress" not in c for c in chunks[first_token:])
    # not asked: none sent, and no timings before the end
    plain = sse_data(http.post("/v1/chat/completions",
                               json={**body, "return_progress": False}).text.splitlines())
    assert not _progress(plain[:-1]) and not any("timings" in c for c in plain[:-2])


def test_timings_per_token_and_progress_in_completion_stream(http):
    r = http.post("/completion", json={"prompt": LONG, "n_predict": 4, "stream": True,
                                       "timings_per_token": True, "return_progress": True,
                                       "cache_prompt": False})
    chunks = sse_data(r.text.splitlines())
    final = chunks[-1]
    assert final["stop"] is True
    progress = [c for c in chunks if "prompt_progress" in c]
    _check_progress([c["prompt_progress"] for c in progress], final["tokens_evaluated"])
    first = progress[0]["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0
    assert first["predicted_n"] == 0 and first["predicted_ms"] == 0.0
    last = progress[-1]["timings"]
    assert last["prompt_n"] == final["tokens_evaluated"] and last["prompt_ms"] > 0
    tokens = [c for c in chunks[:-1] if c["tokens"]]
    assert [c["timings"]["predicted_n"] for c in tokens] == list(range(1, len(tokens) + 1))
    ms = [c["timings"]["prompt_ms"] for c in chunks[:-1]]
    assert ms == sorted(ms) and all(v >= 0 for c in chunks for v in c["timings"].values())
    assert all(c["content"] == "" and c["tokens"] == [] for c in progress)


def test_responses_stream_telemetry(http):
    """llama-server's extensions on the Responses stream: progress on
    ``response.in_progress``, timings on the deltas and on ``response.completed``."""
    r = http.post("/v1/responses", json={"input": LONG, "max_output_tokens": 4,
                                         "stream": True, "timings_per_token": True,
                                         "return_progress": True, "cache_prompt": False,
                                         "chat_template_kwargs": {"enable_thinking": False}})
    events = named_events(r.text)
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    _check_progress([e["prompt_progress"] for e in progress],
                    events[-1]["response"]["usage"]["input_tokens"])
    assert any("timings" in e for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["type"] == "response.completed" and "timings" in events[-1]


def test_anthropic_stream_counts_cached_prompt(http):
    """``message_start`` splits the prompt into fresh and cached tokens (prompt progress
    tells them before the first token); the same prompt again reads from the cache."""
    body = {"max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": LONG}]}
    starts = []
    for _ in range(2):
        events = named_events(http.post("/v1/messages", json=body).text)
        assert not any("prompt_progress" in e or "timings" in e for e in events)
        starts.append(events[0]["message"]["usage"])
    n = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    for u in starts:
        assert u["input_tokens"] + u["cache_read_input_tokens"] == n
        assert u["input_tokens"] > 0


def test_prompt_progress_events_need_asking(engine):
    """The scheduler's handle sends progress events only to requests that ask."""
    from pyggspec.serving.request import Request

    ids = list(range(1, 3 * UBATCH + 5))
    for asked in (False, True):
        h = engine.scheduler.submit(Request(ids, max_tokens=2, progress=asked,
                                            cache_prompt=False))
        evs = list(h)
        progress = [e.progress for e in evs if e.progress is not None]
        if not asked:
            assert not progress
            continue
        assert all(not e.tokens and not e.text for e in evs if e.progress is not None)
        assert evs.index(next(e for e in evs if e.tokens)) == len(progress)
        _check_progress([p.to_dict() for p in progress], len(ids))


def test_generation_settings_echo_timings_per_token(http):
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 1,
                                       "timings_per_token": True}).json()
    assert r["generation_settings"]["timings_per_token"] is True

