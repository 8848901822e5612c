"""Chat answers split into ``reasoning_content`` / ``content`` / ``tool_calls`` (issue 21):
the parser against llama.cpp b11549's Qwen3.5 cases, streaming that adds up to the same
message however the text is cut, and the request side (tools, tool_choice, reasoning
settings, the template's generation prompt). Pure: no model, no server.

The cases follow llama.cpp's ``tests/test-chat.cpp`` (Qwen3.5-4B section) where it has them;
llama.cpp compares with whitespace stripped, so its trailing newlines of reasoning are kept
here as its parser produces them.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pyggspec.serving.http.chat import ChatTemplate
from pyggspec.serving.http.chat_parse import (
    ChatMessage,
    ChatStream,
    ChatSyntax,
    ToolSpec,
    parse_chat,
    parse_final,
    schema_types,
)
from pyggspec.serving.http.chat_request import (
    parse_chat_request,
    parse_tool_choice,
    parse_tools,
    render_chat,
    template_messages,
)
from pyggspec.serving.http.protocol import ApiError, parse_messages
from pyggspec.serving.http.state import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
QWEN35_JINJA = (ROOT / ".cache/llama-cpp-python-0.3.36/vendor/llama.cpp/models/templates"
                / "Qwen3.5-4B.jinja")  # the real template, where install.sh keeps the sdist

THINK = "<|im_start|>assistant\n<think>\n"  # Qwen3.5's generation prompt
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # ... with enable_thinking false
PLAIN = "<|im_start|>assistant\n"


def tool(name: str, **props: Any) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} does things",
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}


TOOLS = [
    tool("special_function", arg1={"type": "integer"}),
    tool("special_function_with_opt", arg1={"type": "integer"}, arg2={"type": "integer"}),
    tool("python", code={"type": "string"}),
    tool("edit", filename={"type": "string"}, oldString={"type": "string"},
         newString={"type": "string"}),
    tool("get_weather", location={"type": "string"}, days={"type": "integer"},
         metric={"type": "boolean"}, where={"type": "object"}, tags={"type": "array"},
         either={"type": ["string", "integer"]}),
    tool("empty_args"),
    {"type": "function", "function": {"name": "no_schema"}},
]
SPECS = {t["function"]["name"]: ToolSpec.from_openai(t) for t in TOOLS}


def syn(gen: str = THINK, reasoning: bool = True, tools: bool = True,
        parallel: bool = True, pure: bool = False) -> ChatSyntax:
    return ChatSyntax(gen, reasoning, SPECS if tools else None, parallel, pure)


def call(fn: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={fn}>\n{body}</function>\n</tool_call>"


def msg(content: str = "", reasoning: str = "", *calls: tuple[str, Any]) -> ChatMessage:
    return ChatMessage(content, reasoning,
                       [_tc(n, a) for n, a in calls])


def _tc(name: str, args: Any) -> Any:
    from pyggspec.serving.http.chat_parse import ToolCall

    return ToolCall(name, args if isinstance(args, str) else json.dumps(args))


# (id, output, syntax, expected message)
CASES = [
    # reasoning (llama.cpp: message_assist_thoughts and its "none" twin)
    ("thoughts", "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", syn(tools=False),
     msg("Hello, world!\nWhat's up?", "I'm\nthinking\n")),
    ("thoughts-format-none", "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?",
     syn(reasoning=False, tools=False),
     msg("<think>\nI'm\nthinking\n</think>\n\nHello, world!\nWhat's up?")),
    ("thinking-cut-off", "still thinking about", syn(tools=False),
     msg("", "still thinking about")),
    ("thinking-off", "Hello", syn(NO_THINK, tools=False), msg("Hello")),
    ("thinking-off-format-none", "Hello", syn(NO_THINK, reasoning=False, tools=False),
     msg("<think>\n\n</think>\n\nHello")),
    ("model-opens-think", "<think>\nhmm\n</think>\n\nok", syn(PLAIN, tools=False),
     msg("ok", "hmm\n")),
    ("whitespace-reasoning", "\n\n</think>\n\nanswer", syn(tools=False), msg("answer")),
    ("think-tag-later-is-content", "a <think> b", syn(PLAIN, tools=False),
     msg("a <think> b")),
    ("plain-chatml", "  spaced out ", syn(PLAIN, reasoning=False, tools=False),
     msg("  spaced out ")),
    ("pure-content", "I'm\n</think>\n" + call("python", code="x"), syn(pure=True),
     msg("I'm\n</think>\n" + call("python", code="x"))),
    # tool calls, XML form (llama.cpp's Qwen3.5 cases)
    ("call", call("special_function", arg1="1"), syn(NO_THINK),
     msg("", "", ("special_function", {"arg1": 1}))),
    ("call-after-thoughts", "I'm\nthinking\n</think>\n\n" + call("special_function", arg1="1"),
     syn(), msg("", "I'm\nthinking\n", ("special_function", {"arg1": 1}))),
    ("call-ends-thinking", "Need to look.\n" + call("python", code="pwd"), syn(),
     msg("", "Need to look.\n", ("python", {"code": "pwd"}))),
    ("parallel", call("special_function", arg1="1") + "\n"
     + call("special_function_with_opt", arg1="1", arg2="2"), syn(NO_THINK),
     msg("", "", ("special_function", {"arg1": 1}),
         ("special_function_with_opt", {"arg1": 1, "arg2": 2}))),
    ("not-parallel", call("special_function", arg1="1") + "\n"
     + call("special_function_with_opt", arg1="1", arg2="2"), syn(NO_THINK, parallel=False),
     msg("", "", ("special_function", {"arg1": 1}))),
    ("code", call("python", code='def hello():\n    print("Hello, world!")\n\nhello()'),
     syn(NO_THINK), msg("", "", ("python", {"code": 'def hello():\n    print("Hello, world!")'
                                                    '\n\nhello()'}))),
    ("indented", call("python", code='    print("x")'), syn(NO_THINK),
     msg("", "", ("python", {"code": '    print("x")'}))),
    ("trailing-newline-kept", call("edit", filename="foo.c", oldString="#iclunde",
                                   newString="#include\n"), syn(NO_THINK),
     msg("", "", ("edit", {"filename": "foo.c", "oldString": "#iclunde",
                           "newString": "#include\n"}))),
    ("no-args", "<tool_call>\n<function=empty_args>\n</function>\n</tool_call>", syn(NO_THINK),
     msg("", "", ("empty_args", {}))),
    ("typed", call("get_weather", location="Paris", days="3", metric="true",
                   where='{"lat": 1.5}', tags='["a", "b"]', either="7"), syn(NO_THINK),
     msg("", "", ("get_weather", {"location": "Paris", "days": 3, "metric": True,
                                  "where": {"lat": 1.5}, "tags": ["a", "b"], "either": 7}))),
    ("typed-fallbacks", call("get_weather", location="123", days="three", either="seven",
                             extra="[1, 2]", other="x y"), syn(NO_THINK),
     msg("", "", ("get_weather", {"location": "123", "days": "three", "either": "seven",
                                  "extra": [1, 2], "other": "x y"}))),
    ("no-schema", call("no_schema", a="1", b="text"), syn(NO_THINK),
     msg("", "", ("no_schema", {"a": 1, "b": "text"}))),
    ("content-then-call", "Let me check.\n\n" + call("python", code="ls"), syn(NO_THINK),
     msg("Let me check.\n\n", "", ("python", {"code": "ls"}))),
    ("text-after-call", call("python", code="ls") + "\nDone.", syn(NO_THINK),
     msg("Done.", "", ("python", {"code": "ls"}))),
    ("forgotten-param-close", ("<tool_call>\n<function=python>\n<parameter=code>\nls\n"
     "</function>\n</tool_call>"), syn(NO_THINK), msg("", "", ("python", {"code": "ls"}))),
    ("cut-in-value", "<tool_call>\n<function=get_weather>\n<parameter=location>\nPar",
     syn(NO_THINK), msg("", "", ("get_weather", {"location": "Par"}))),
    ("cut-in-name", "Hi <tool_call>\n<function=get_wea", syn(NO_THINK),
     msg("Hi <tool_call>\n<function=get_wea")),
    ("cut-in-marker", "Hi <tool_", syn(NO_THINK), msg("Hi <tool_")),
    ("tools-not-parsed", call("python", code="ls"), syn(NO_THINK, tools=False),
     msg(call("python", code="ls"))),
    # malformed blocks stay text
    ("unknown-function", call("rm_rf", path="/"), syn(NO_THINK), msg(call("rm_rf", path="/"))),
    ("neither-form", "<tool_call>\nhello\n</tool_call> and on", syn(NO_THINK),
     msg("<tool_call>\nhello\n</tool_call> and on")),
    ("name-with-newline", "<tool_call>\n<function=py\nthon>\n</function>\n</tool_call>",
     syn(NO_THINK), msg("<tool_call>\n<function=py\nthon>\n</function>\n</tool_call>")),
    ("bad-then-good", "<tool_call>\n<function=nope>\n</function>\n</tool_call>\n"
     + call("python", code="ls"), syn(NO_THINK),
     msg("<tool_call>\n<function=nope>\n</function>\n</tool_call>\n", "",
         ("python", {"code": "ls"}))),
    # JSON form (Qwen3's)
    ("json", ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
     "</tool_call>"), syn(NO_THINK), msg("", "", ("get_weather", {"location": "Paris"}))),
    ("json-string-args", ('<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"ls\\"}"}'
     "\n</tool_call>"), syn(NO_THINK), msg("", "", ("python", {"code": "ls"}))),
    ("json-cut-off", ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", '
     '"days": 3, "metric": tr'), syn(NO_THINK),
     msg("", "", ("get_weather", {"location": "Paris", "days": 3}))),
    ("json-invalid", '<tool_call>\n{"name": get_weather}\n</tool_call>', syn(NO_THINK),
     msg('<tool_call>\n{"name": get_weather}\n</tool_call>')),
    ("json-unknown", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
     syn(NO_THINK), msg('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')),
    ("unicode", "Ünïcödé 思考\n</think>\n\n" + call("python", code="print('日本')"), syn(),
     msg("", "Ünïcödé 思考\n", ("python", {"code": "print('日本')"}))),
]


def canon(m: ChatMessage) -> tuple[str, str, list[tuple[str, Any]]]:
    """A message with arguments as parsed JSON (key order and spacing do not matter)."""
    return (m.content, m.reasoning_content,
            [(c.name, json.loads(c.arguments)) for c in m.tool_calls])


@pytest.mark.parametrize("name, out, syntax, want", CASES, ids=[c[0] for c in CASES])
def test_parse(name, out, syntax, want):
    got = parse_chat(out, syntax)
    assert canon(got) == canon(want)
    for c in got.tool_calls:  # compact JSON objects
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False,
                                         separators=(",", ":"))
        assert c.arguments.startswith("{")


def replay(deltas: list[dict[str, Any]]) -> ChatMessage:
    """The message a client builds from OpenAI deltas."""
    from pyggspec.serving.http.chat_parse import ToolCall

    m = ChatMessage()
    for d in deltas:
        assert len(d) == 1, d  # one kind of change per chunk, as llama-server sends them
        m.content += d.get("content", "")
        m.reasoning_content += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", ()):
            i = tc["index"]
            if i == len(m.tool_calls):  # a new call: id, type and name come first
                assert tc["type"] == "function" and len(tc["id"]) == 32
                m.tool_calls.append(ToolCall(tc["function"]["name"], "", tc["id"]))
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            m.tool_calls[i].arguments += tc["function"].get("arguments", "")
    return m


def stream(pieces: list[str], syntax: ChatSyntax) -> tuple[ChatMessage, ChatStream]:
    s = ChatStream(syntax)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    return replay(deltas), s


@pytest.mark.parametrize("name, out, syntax, want", CASES, ids=[c[0] for c in CASES])
def test_stream_cut_anywhere_adds_up_to_the_same_message(name, out, syntax, want, caplog):
    """Split in two at every character, char by char, and in random pieces: the deltas
    always rebuild the final parse, and no partial parse ever takes back what was sent."""
    caplog.set_level(logging.WARNING, "pyggspec.serve")
    full = parse_chat(out, syntax)
    rng = random.Random(name)
    cuts = [[out[:k], out[k:]] for k in range(len(out) + 1)] + [list(out)]
    for _ in range(5):
        idx = sorted(rng.sample(range(1, len(out)), min(len(out) - 1, rng.randint(1, 8))))
        cuts.append([out[a:b] for a, b in zip([0, *idx], [*idx, len(out)])])
    for pieces in cuts:
        got, s = stream(pieces, syntax)
        assert canon(got) == canon(full), pieces
        assert [c.id for c in got.tool_calls] == [c.id for c in s.message.tool_calls]
    assert not [r for r in caplog.records if "chat parser" in r.getMessage()]


def test_partial_parse_holds_back_what_may_be_a_marker():
    s = syn(NO_THINK)
    assert parse_chat("Hi <tool_", s, partial=True).content == "Hi "
    assert parse_chat("Hi <tool_call>\n<function=pyt", s, partial=True).content == "Hi "
    m = parse_chat("<tool_call>\n<function=python>\n<parameter=code>\nab\n</par", s, True)
    assert m.tool_calls[0].name == "python" and m.tool_calls[0].arguments == '{"code":"ab'
    m = parse_chat("<tool_call>\n<function=get_weather>\n<parameter=days>\n1", s, True)
    assert m.tool_calls[0].arguments == "{"  # a number is sent once complete
    assert parse_chat("<thi", syn(PLAIN, tools=False), True) == ChatMessage()
    assert parse_chat("x\n</thi", syn(tools=False), True).reasoning_content == "x\n"
    # the final parse keeps it all
    assert parse_chat("x\n</thi", syn(tools=False)).reasoning_content == "x\n</thi"


def test_stream_deltas_follow_llama_servers_shapes():
    s = ChatStream(syn())
    assert s.feed("Hmm") == [{"reasoning_content": "Hmm"}]
    assert s.feed("\n</think>\n\nLet me ") == [{"reasoning_content": "\n"},
                                               {"content": "Let me "}]
    assert s.feed("check.\n<tool_call>\n<function=get_weather>\n") == [{"content": "check.\n"}, {
        "tool_calls": [{"index": 0, "id": s.message.tool_calls[0].id, "type": "function",
                        "function": {"name": "get_weather", "arguments": "{"}}]}]
    assert s.feed("<parameter=location>\nPa") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"location":"Pa'}}]}]
    assert s.feed("ris\n</parameter>\n</function>\n</tool_call>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert s.finish() == []
    assert s.message.to_openai()["tool_calls"][0]["function"]["arguments"] == \
        '{"location":"Paris"}'


def test_plain_text_streams_piece_by_piece():
    s = ChatStream(syn(PLAIN, reasoning=False, tools=False))
    assert not s.syntax.parses
    assert s.feed(" a") == [{"content": " a"}] and s.feed("") == [] and s.finish() == []
    assert s.message.content == " a"


def test_final_message_shape():
    m = parse_final(call("python", code="ls"), syn(NO_THINK))
    out = m.to_openai()
    assert out["role"] == "assistant" and out["content"] == "" and "reasoning_content" not in out
    (tc,) = out["tool_calls"]
    assert tc["type"] == "function" and len(tc["id"]) == 32
    assert json.loads(tc["function"]["arguments"]) == {"code": "ls"}
    assert parse_final("x", syn(PLAIN, tools=False)).to_openai() == {"role": "assistant",
                                                                       "content": "x"}


@pytest.mark.parametrize("schema, want", [
    ({"type": "string"}, {"string"}), ({"type": ["integer", "null"]}, {"integer", "null"}),
    ({"anyOf": [{"type": "string"}, {"type": "number"}]}, {"string", "number"}),
    ({"anyOf": [{"type": "string"}, {}]}, set()), ({"enum": ["a", 1, True]},
                                                     {"string", "integer", "number", "boolean"}),
    ({"const": None}, {"null"}), ({}, set()), ("nonsense", set()),
])
def test_schema_types(schema, want):
    assert schema_types(schema) == want


# ---------------------------------------------------------------------------- requests
# a Qwen3.5-style template written for these tests: tools, tool calls (arguments iterated as
# an object), tool responses, reasoning and enable_thinking, as Qwen's template has them
QWENISH = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
    "{%- for k, v in tc.function.arguments | items %}"
    "{{- '<parameter=' + k + '>\\n' + (v | string) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")

TOK = SimpleNamespace(bos=None, eos=None, chat_template=None)


def templates() -> list[Any]:
    out = [pytest.param(QWENISH, id="qwenish")]
    if QWEN35_JINJA.exists():
        out.append(pytest.param(QWEN35_JINJA.read_text(), id="qwen3.5-4b"))
    return out


@pytest.fixture(params=templates())
def template(request) -> ChatTemplate:
    return ChatTemplate(TOK, request.param)


def chat(body: dict[str, Any], template: ChatTemplate, **cfg: Any):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    config = ServerConfig(model_id="t", **cfg)
    req = parse_chat_request(body, parse_messages(body), config, template)
    return req, render_chat(template, req, config.skip_chat_parsing)


def test_generation_prompt_and_thinking(template):
    _, p = chat({}, template)
    assert p.syntax.generation_prompt == THINK and p.thinking_open and p.syntax.reasoning
    assert p.text.endswith(THINK) and p.syntax.tools is None
    for body, cfg in (({"chat_template_kwargs": {"enable_thinking": False}}, {}),
                      ({}, {"reasoning": "off"}), ({"reasoning_effort": "none"}, {})):
        _, p = chat(body, template, **cfg)
        assert p.syntax.generation_prompt == NO_THINK and not p.thinking_open, (body, cfg)
    _, p = chat({"chat_template_kwargs": {"enable_thinking": True}}, template,
                reasoning="off")
    assert p.thinking_open  # the request wins over the server
    _, p = chat({"reasoning_format": "none"}, template)
    assert not p.syntax.reasoning and p.syntax.generation_prompt == THINK
    _, p = chat({}, template, reasoning_format="none")
    assert not p.syntax.reasoning
    _, p = chat({"reasoning_format": "deepseek"}, template, reasoning_format="none")
    assert p.syntax.reasoning
    _, p = chat({}, template, skip_chat_parsing=True)
    assert p.syntax.pure_content


def test_tools_reach_the_template_and_the_parser(template):
    weather = tool("get_weather", location={"type": "string"})
    req, p = chat({"tools": [weather]}, template)
    assert '"name": "get_weather"' in p.text and "<tools>" in p.text
    assert set(p.syntax.tools) == {"get_weather"} and p.tool_prefix == ""
    assert req.parallel_tool_calls is template.caps()["supports_parallel_tool_calls"]
    _, p = chat({"tools": [weather], "tool_choice": "none"}, template)
    assert "get_weather" in p.text and p.syntax.tools is None  # shown, not parsed
    _, p = chat({"tools": [weather], "parallel_tool_calls": False}, template)
    assert p.syntax.parallel_tool_calls is False
    # required / named: the answer is made to start the call, after the thinking
    _, p = chat({"tools": [weather], "tool_choice": "required"}, template)
    assert p.thinking_open and p.tool_prefix == "<tool_call>\n"
    _, p = chat({"tools": [weather], "tool_choice": {"type": "function",
                                                     "function": {"name": "get_weather"}}},
                template)
    assert p.tool_prefix == "<tool_call>\n<function=get_weather>\n"
    _, p = chat({"tools": [weather], "tool_choice": "required",
                 "chat_template_kwargs": {"enable_thinking": False}}, template)
    assert p.tool_prefix == "" and p.text.endswith(NO_THINK + "<tool_call>\n")
    assert p.syntax.generation_prompt == NO_THINK + "<tool_call>\n"
    out = "<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n" \
          "</tool_call>"
    assert canon(parse_chat(out, p.syntax)) == ("", "", [("get_weather",
                                                          {"location": "Paris"})])


def test_assistant_tool_calls_render_with_object_arguments(template):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"messages": msgs, "tools": [tool("get_weather", location={"type": "string"})]}
    req = parse_chat_request(body, parse_messages(body), ServerConfig(model_id="t"), template)
    text = template.render(template_messages(req.messages, template), True, req.kwargs,
                           req.tools)
    assert "<function=get_weather>\n<parameter=location>\nParis\n</parameter>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    bad = {"messages": [msgs[0], {**msgs[1], "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}
    with pytest.raises(ApiError) as e:  # checked before the trailing message is continued
        parse_chat_request(bad, parse_messages(bad), ServerConfig(model_id="t"), template)
    assert e.value.status == 400 and "arguments" in e.value.param


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["x"]}, "tools[0]"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a<b"}}]}, "tools[0].function.name"),
    ({"tools": [tool("f"), tool("f")]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
     "tools[0].function.description"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [tool("f")], "tool_choice": {"function": "f"}}, "tool_choice"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning_format": "deep"}, "reasoning_format"),
    ({"reasoning_format": 1}, "reasoning_format"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_message": 5}, "reasoning_budget_message"),
    ({"reasoning_effort": 1}, "reasoning_effort"),
])
def test_bad_requests_are_400_naming_the_field(body, param):
    t = ChatTemplate(TOK, QWENISH)
    full = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(ApiError) as e:
        parse_chat_request(full, parse_messages(full), ServerConfig(model_id="t"), t)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("messages, param", [
    ([{"role": "assistant", "content": None, "tool_calls": {"a": 1}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].type"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_bad_tool_call_messages_are_400(messages, param):
    with pytest.raises(ApiError) as e:
        parse_messages({"messages": messages})
    assert e.value.status == 400 and e.value.param == param


def test_tools_need_jinja():
    t = ChatTemplate(SimpleNamespace(bos=None, eos=None, chat_template=QWENISH), jinja=False)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool("f")]}
    with pytest.raises(ApiError) as e:
        parse_chat_request(body, parse_messages(body), ServerConfig(model_id="t"), t)
    assert e.value.param == "tools"


def test_parse_tool_choice_named():
    assert parse_tool_choice({}, []) == ("auto", None)
    assert parse_tool_choice({"tool_choice": "none"}, []) == ("none", None)
    assert parse_tool_choice({"tool_choice": {"type": "function", "function": {"name": "f"}}},
                             parse_tools({"tools": [tool("f")]})) == ("required", "f")


# ---------------------------------------------------------------------------- the command line
def test_serve_flags_reach_the_server_config(monkeypatch):
    """``--reasoning-format``, ``-rea``, ``--reasoning-budget(-message)``,
    ``--chat-template-kwargs``, ``--reasoning-effort`` and ``--skip-chat-parsing`` end up in
    the :class:`ServerConfig` (llama-server's spellings and values)."""
    from contextlib import nullcontext

    from click.testing import CliRunner

    from pyggspec.cli import main
    from pyggspec.cli import serve as serve_mod
    from pyggspec.serving import server

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def create_app(engine, config, **kw):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(serve_mod, "engine_from_config", lambda path, cfg: nullcontext(
        SimpleNamespace(n_ctx=1, spec_type=None)))
    monkeypatch.setattr(server, "create_app", create_app)

    def run(*flags: str):
        seen.clear()
        r = CliRunner().invoke(main, ["serve", "-m", "x.gguf", *flags])
        return r, seen.get("config")

    _, cfg = run()
    assert (cfg.reasoning_format, cfg.reasoning, cfg.reasoning_budget) == ("auto", "auto", -1)
    assert cfg.chat_template_kwargs == {} and not cfg.skip_chat_parsing
    _, cfg = run("--reasoning-format", "deepseek", "-rea", "off", "--reasoning-budget", "64",
                 "--reasoning-budget-message", "Time's up.", "--chat-template-kwargs",
                 '{"x": 1}', "--reasoning-effort", "high", "--skip-chat-parsing")
    assert (cfg.reasoning_format, cfg.reasoning, cfg.reasoning_budget) == ("deepseek", "off", 64)
    assert cfg.reasoning_budget_message == "Time's up." and cfg.skip_chat_parsing
    assert cfg.chat_template_kwargs == {"x": 1, "reasoning_effort": "high"}
    for value, want in (("enabled", "on"), ("1", "on"), ("disabled", "off"), ("-1", "auto")):
        assert run("--reasoning", value)[1].reasoning == want
    for flags in (("-rea", "maybe"), ("--reasoning-format", "xml"), ("--reasoning-budget", "-2"),
                  ("--chat-template-kwargs", "[1]"), ("--chat-template-kwargs", "{x"),
                  ("--chat-template-kwargs", '{"enable_thinking": "no"}')):
        r, cfg = run(*flags)
        assert r.exit_code == 2 and cfg is None, (flags, r.output)
