"""A chat answer's text -> ``reasoning_content``, ``content`` and ``tool_calls`` (Qwen3.5/3.6).

What llama-server b11549 does for these models (``common/parsers/qwen3-coder.cpp``, chosen for
any template that teaches ``<tool_call>`` / ``<function=`` / ``<parameter=``): the text the
model generates is parsed *with the generation prompt in front of it* (the template's
``<|im_start|>assistant\\n<think>\\n`` opens the thinking block before the first token), so

* a leading ``<think>`` block is reasoning up to ``</think>`` or up to a ``<tool_call>`` (a
  tool call also ends thinking); leading whitespace of the reasoning and whitespace between
  the blocks are dropped, whitespace-only reasoning is empty (the ``enable_thinking: false``
  prompt ``<think>\\n\\n</think>\\n\\n``);
* with ``reasoning_format`` ``none`` nothing is split: the content is the text after the
  assistant header, ``<think>`` of the prompt included, as llama-server returns it;
* with tools (and ``tool_choice`` not ``none``) each ``<tool_call>...</tool_call>`` block is
  a call, in Qwen3.5's XML form ``<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  </function>`` or Qwen3's JSON form ``{"name": ..., "arguments": {...}}``; a parameter's
  value is typed by the tool's JSON schema (a ``string`` parameter is always a string, others
  are read as JSON), and the arguments are one JSON object text, as OpenAI sends them.

Where we differ, and why: llama.cpp constrains the model with a grammar once ``<tool_call>``
appears, so its parser may fail on anything else (an HTTP 500). pyggspec holds calls with the
same kind of grammar (:mod:`.tool_grammar`), but not every text is held (a call inside the
thinking, a request with its own grammar), so nothing here ever raises: a block that is not
a call of a declared tool (an unknown name, neither form, a JSON body that does not parse)
stays in ``content`` as text; text after a call is content too (llama.cpp drops it); calls
after the first are dropped when ``parallel_tool_calls`` is false (as there). A final parse
keeps a trailing partial marker (``"</thi"``) as text rather than dropping it.

Streaming (:class:`ChatStream`) re-parses the whole text after each piece, as llama.cpp does,
and sends what changed. A partial parse holds back text that could still become a marker
(``"<tool_"``, ``"\\n</parameter"``) and a block whose fate is undecided, so every partial
result is a prefix of the final one: the deltas add up to the whole answer however the text
was split. Tool calls appear once ``<function=NAME>`` is complete, string parameters stream
character by character, other values (and JSON-form calls) when complete.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pyggspec.serve")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
ASSISTANT_HEADER = "<|im_start|>assistant"
_WS = " \t\n\r"

# what may end a parameter's value (the model may forget "</parameter>"), and the markers a
# partial value must not show the start of
_VALUE_ENDS = (PARAM_CLOSE, FUNC_CLOSE, PARAM_OPEN)
_VALUE_HOLD = tuple(p + d for d in (*_VALUE_ENDS, CALL_CLOSE) for p in ("\n", ""))
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


# ---------------------------------------------------------------------------- data
@dataclass(frozen=True)
class ToolSpec:
    """One declared function, as far as parsing needs it: each parameter's JSON types
    (empty: not known, the value is read as JSON when it parses and as a string if not)."""

    name: str
    params: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI ``tools[]`` entry (already validated)."""
        fn = tool["function"]
        schema = fn.get("parameters") or {}
        props = schema.get("properties") if isinstance(schema, dict) else None
        params = {k: schema_types(v) for k, v in props.items()} if isinstance(props, dict) else {}
        return cls(fn["name"], params)


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a schema admits (``type``, ``anyOf``/``oneOf``, ``enum``/``const``);
    empty when it does not say."""
    if not isinstance(schema, dict):
        return frozenset()
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(x for x in t if isinstance(x, str))
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = schema_types(sub)
            if not sub_types:
                return frozenset()  # one alternative of unknown type: anything goes
            out |= sub_types
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    for v in values:
        out.update(n for n, py in _JSON_TYPES.items()
                   if isinstance(v, py) and not (n != "boolean" and isinstance(v, bool)))
    return frozenset(out)


@dataclass(frozen=True)
class ChatSyntax:
    """How to read one request's answer.

    ``generation_prompt``: what the template appended for the answer (parsed in front of the
    model's text). ``reasoning``: split a leading ``<think>`` block into
    ``reasoning_content`` (the template thinks and ``reasoning_format`` is not ``none``).
    ``tools``: the declared functions by name, or None when tool calls are not parsed (no
    tools, ``tool_choice: none``). ``pure_content``: ``--skip-chat-parsing``, all of the
    model's text is content.
    """

    generation_prompt: str = ""
    reasoning: bool = False
    tools: Mapping[str, ToolSpec] | None = None
    parallel_tool_calls: bool = True
    pure_content: bool = False

    @property
    def parses(self) -> bool:
        """False when the answer is its text, unchanged (nothing to split out)."""
        return not self.pure_content and (self.reasoning or self.tools is not None
                                          or bool(self.generation_prompt.strip(_WS)
                                                  .removeprefix(ASSISTANT_HEADER)))


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text (a prefix of it while streaming)
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments},
                "id": self.id}


@dataclass
class ChatMessage:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """``choices[].message`` as llama-server sends it: ``content`` always a string,
        ``reasoning_content`` and ``tool_calls`` only when there are some."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        return msg


# ---------------------------------------------------------------------------- helpers
def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


def _find_first(text: str, markers: Iterable[str], start: int) -> tuple[int, str]:
    """The earliest of ``markers`` at or after ``start``: (index, marker), or (-1, "")."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


def held_len(text: str, markers: Iterable[str], start: int = 0) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper start of one of
    ``markers``: text a partial parse must not show yet."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - start), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _value_json(raw: str, types: frozenset[str]) -> str:
    """A parameter's text as JSON, typed by its schema: a ``string`` parameter as a string;
    otherwise the text read as JSON when that gives an admitted type, else as a string."""
    if types == {"string"}:
        return _json(raw)
    try:
        v = json.loads(raw.strip(_WS))
    except ValueError:
        return _json(raw)
    if types and not any(isinstance(v, _JSON_TYPES.get(t, ())) and
                         not (t in ("integer", "number") and isinstance(v, bool))
                         for t in types):
        return _json(raw)
    return _json(v)


# ---------------------------------------------------------------------------- parsing
class _Undecided(Exception):
    """A partial parse reached text whose meaning later text decides (held back)."""


def parse_chat(output: str, syntax: ChatSyntax, partial: bool = False) -> ChatMessage:
    """The message in ``output`` (the model's text so far). ``partial``: more text may come,
    so nothing that later text could change is shown. Never raises."""
    if not syntax.parses:
        return ChatMessage(content=output)
    text = syntax.generation_prompt + output
    pos = 0
    if text.startswith(ASSISTANT_HEADER):
        nl = text.find("\n")
        pos = nl + 1 if nl >= 0 else len(text)
    pos = _skip_ws(text, pos)
    msg = ChatMessage()
    if syntax.reasoning:
        if partial and THINK_OPEN.startswith(text[pos:]) and pos < len(text):
            return msg  # "<thi": thinking or content, not known yet
        if text.startswith(THINK_OPEN, pos):
            start = _skip_ws(text, pos + len(THINK_OPEN))
            end, which = _find_first(text, (THINK_CLOSE, CALL_OPEN), start)
            if end < 0:
                stop = len(text) - (held_len(text, (THINK_CLOSE, CALL_OPEN), start)
                                    if partial else 0)
                msg.reasoning_content = text[start:stop]
                pos = len(text)
            else:
                msg.reasoning_content = text[start:end]
                pos = end + len(THINK_CLOSE) if which == THINK_CLOSE else end
            if not msg.reasoning_content.strip(_WS):
                msg.reasoning_content = ""
            pos = _skip_ws(text, pos)
    if syntax.tools is None:
        msg.content = text[pos:]
        return msg
    _parse_calls(text, pos, syntax, partial, msg)
    return msg


def _parse_calls(text: str, pos: int, syntax: ChatSyntax, partial: bool,
                 msg: ChatMessage) -> None:
    """Content and ``<tool_call>`` blocks from ``pos`` on."""
    content: list[str] = []
    n = len(text)
    while pos < n:
        i = text.find(CALL_OPEN, pos)
        if i < 0:
            content.append(text[pos:n - (held_len(text, (CALL_OPEN,), pos) if partial else 0)])
            break
        content.append(text[pos:i])
        close = text.find(CALL_CLOSE, i + len(CALL_OPEN))
        end = close + len(CALL_CLOSE) if close >= 0 else n
        body = text[i + len(CALL_OPEN):close if close >= 0 else n]
        try:
            call = _parse_block(body, syntax.tools or {}, partial and close < 0)
        except _Undecided:
            break  # held back: this block (and all after it) waits for more text
        if call is None:  # not a call of a declared tool: it stays text
            content.append(text[i:end - (held_len(text, (CALL_CLOSE,), i) if partial and close < 0
                                         else 0)])
        elif syntax.parallel_tool_calls or not msg.tool_calls:
            msg.tool_calls.append(call)
        pos = _skip_ws(text, end) if call is not None else end
    msg.content = "".join(content)


def _parse_block(body: str, tools: Mapping[str, ToolSpec], open_: bool) -> ToolCall | None:
    """One block's body: a call, None when it is not a call (text), or :class:`_Undecided`
    while ``open_`` (partial, no ``</tool_call>`` yet) and the answer depends on what follows."""
    b = _skip_ws(body, 0)
    if body.startswith(FUNC_OPEN, b):
        return _parse_xml(body, b + len(FUNC_OPEN), tools, open_)
    if body.startswith("{", b):
        return _parse_json(body[b:], tools, open_)
    if open_ and FUNC_OPEN.startswith(body[b:]):
        raise _Undecided
    return None


def _parse_xml(body: str, pos: int, tools: Mapping[str, ToolSpec],
               open_: bool) -> ToolCall | None:
    """``<function=NAME>`` + ``<parameter=P>VALUE</parameter>``... + ``</function>``."""
    gt = body.find(">", pos)
    nl = body.find("\n", pos)
    if gt < 0 or (0 <= nl < gt):
        if open_ and nl < 0:
            raise _Undecided  # the name is still coming
        return None
    spec = tools.get(body[pos:gt].strip(_WS))
    if spec is None:
        return None  # not a declared function: llama.cpp's parser refuses it too
    parts: list[str] = []
    pos, n, closed = gt + 1, len(body), not open_
    while True:
        pos = _skip_ws(body, pos)
        if pos >= n:
            break
        if body.startswith(FUNC_CLOSE, pos):
            closed = True
            break
        if not body.startswith(PARAM_OPEN, pos):
            if open_ and (PARAM_OPEN.startswith(body[pos:]) or FUNC_CLOSE.startswith(body[pos:])):
                break  # a marker still arriving
            nxt, _ = _find_first(body, (PARAM_OPEN, FUNC_CLOSE), pos + 1)
            if nxt < 0:
                break  # stray text to the end: ignored
            pos = nxt
            continue
        gt = body.find(">", pos)
        if gt < 0:
            break  # the parameter's name is still coming (or cut off)
        name = body[pos + len(PARAM_OPEN):gt].strip(_WS)
        types = spec.params.get(name, frozenset())
        start = gt + 1
        if body.startswith("\n", start):
            start += 1
        end, which = _find_first(body, _VALUE_ENDS, start)
        if end < 0:  # the value runs to the end of the text so far
            if open_:
                if types == {"string"}:  # strings stream as they come
                    raw = body[start:n - held_len(body, _VALUE_HOLD, start)]
                    parts.append(_json(name) + ":" + _json(raw)[:-1])
                break
            raw = body[start:]
            parts.append(_json(name) + ":" + _value_json(raw.removesuffix("\n"), types))
            break
        parts.append(_json(name) + ":" + _value_json(body[start:end].removesuffix("\n"), types))
        pos = end + len(PARAM_CLOSE) if which == PARAM_CLOSE else end
    args = "{" + ",".join(parts) + ("}" if closed else "")
    return ToolCall(spec.name, args)


def _parse_json(obj_text: str, tools: Mapping[str, ToolSpec], open_: bool) -> ToolCall | None:
    """Qwen3's ``{"name": ..., "arguments": {...}}``: decided once the object is complete
    (or, cut off at the end of the answer, from what a partial-JSON read recovers)."""
    try:
        obj, _ = json.JSONDecoder().raw_decode(obj_text)
    except ValueError:
        if open_:
            raise _Undecided from None
        obj = _partial_json(obj_text)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    spec = tools.get(obj["name"])
    if spec is None:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return ToolCall(spec.name, args)
    return ToolCall(spec.name, _json(args if args is not None else {}))


def _partial_json(text: str) -> Any:
    """A truncated JSON text read as far as it goes (pydantic-core's partial mode; complete
    strings only), None when even that fails."""
    try:
        from pydantic_core import from_json
    except ImportError:  # pydantic v1 under FastAPI: no partial reading, the block is text
        return None
    try:
        return from_json(text.strip(_WS), allow_partial=True)
    except ValueError:
        return None


# ---------------------------------------------------------------------------- streaming
_ID_CHARS = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """A tool call id as llama-server makes them (32 random letters and digits)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def _suffix(old: str, new: str) -> str | None:
    """What ``new`` adds to ``old`` ("" when unchanged or shorter), None if it is not an
    extension (a parser bug: logged, never raised)."""
    if new.startswith(old):
        return new[len(old):]
    if old.startswith(new):
        return ""
    return None


class ChatStream:
    """The message of one streamed answer, piece by piece: :meth:`feed` each piece of text,
    :meth:`finish` at the end; both return OpenAI ``delta`` objects (one per change, as
    llama-server sends them), and :attr:`message` is the message so far (tool calls with
    their ids)."""

    def __init__(self, syntax: ChatSyntax) -> None:
        self.syntax = syntax
        self.text = ""
        self.message = ChatMessage()
        self._ids: list[str] = []

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        self.text += piece
        if not self.syntax.parses:  # plain text: the piece is the delta
            self.message.content = self.text
            return [{"content": piece}]
        return self._update(parse_chat(self.text, self.syntax, partial=True))

    def finish(self) -> list[dict[str, Any]]:
        """The last deltas, from a final parse of the whole text."""
        if not self.syntax.parses:
            return []
        return self._update(parse_chat(self.text, self.syntax, partial=False))

    def _update(self, new: ChatMessage) -> list[dict[str, Any]]:
        old, deltas = self.message, []
        for key in ("reasoning_content", "content"):
            d = _suffix(getattr(old, key), getattr(new, key))
            if d is None:
                log.warning("chat parser: %s is not an extension of what was sent", key)
                setattr(new, key, getattr(old, key))
            elif d:
                deltas.append({key: d})
        if len(new.tool_calls) < len(old.tool_calls):
            log.warning("chat parser: fewer tool calls than were sent")
            new.tool_calls.extend(old.tool_calls[len(new.tool_calls):])
        for i, call in enumerate(new.tool_calls):
            if i == len(self._ids):
                self._ids.append(new_tool_call_id())
            call.id = self._ids[i]
            if i >= len(old.tool_calls):
                fn = {"name": call.name}
                if call.arguments:
                    fn["arguments"] = call.arguments
                deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                               "function": fn}]})
                continue
            d = _suffix(old.tool_calls[i].arguments, call.arguments)
            if d is None:
                log.warning("chat parser: tool call %d's arguments changed", i)
                call.arguments = old.tool_calls[i].arguments
            elif d:
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": d}}]})
        self.message = new
        return deltas


def parse_final(text: str, syntax: ChatSyntax) -> ChatMessage:
    """The whole answer's message (non-streamed responses), tool calls with new ids."""
    msg = parse_chat(text, syntax, partial=False)
    for call in msg.tool_calls:
        call.id = new_tool_call_id()
    return msg
