"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, as
llama-server serves them (Claude Code and Anthropic's SDKs talk to it).

A Messages body is converted to a chat body (``system`` -> a system message, content blocks
-> chat messages: ``thinking`` -> ``reasoning_content``, ``tool_use`` -> ``tool_calls``,
``tool_result`` -> tool messages; ``tools`` with their ``input_schema``, ``tool_choice``,
``stop_sequences``, ``thinking``) and runs the chat path (:mod:`.chat_job`), so templates,
tool-call parsing, the reasoning split and sampling are the chat endpoint's. The answer comes
back as Anthropic content blocks (``thinking`` with an empty ``signature``, ``text``,
``tool_use``), streamed as ``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta`` and ``message_stop`` events, without llama-server's
``timings`` (Anthropic's shapes have none).

Errors, client mistakes included, are Anthropic's: ``{"type": "error", "error": {"type":
"invalid_request_error", "message": ...}}`` with the HTTP status. Where we differ from
llama-server: image blocks become chat image_url parts as there, but a server without
--mmproj answers 400 (llama-server 500); document blocks are a 400; the tool results of a
user message come before its text (they answer the previous turn's calls); and a client stop sequence ends with ``stop_reason`` ``stop_sequence`` as
Anthropic's API says (llama-server says ``end_turn``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pyggspec.serving.http.answer_blocks import AnswerSteps, Block, Step, final_blocks
from pyggspec.serving.http.chat_job import count_prompt_tokens, prepare_chat
from pyggspec.serving.http.live_timings import LiveTimings
from pyggspec.serving.http.protocol import (
    ApiError,
    _kind,
    field_str,
    get_int,
    invalid,
    object_array,
    parse_messages,
    read_body,
    unsupported,
)
from pyggspec.serving.http.state import ServerState
from pyggspec.serving.http.streaming import named_sse, run_to_end, stream
from pyggspec.serving.request import Result

log = logging.getLogger("pyggspec.serve")

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 501: "invalid_request_error", 503: "overloaded_error"}
DEFAULT_MAX_TOKENS = 4096  # llama-server's when a request has no max_tokens
# llama-server passes these through unchanged (the rest of the body is Anthropic's own)
_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


class AnthropicError(ApiError):
    """An :class:`ApiError` answered in Anthropic's error shape."""

    @classmethod
    def of(cls, e: ApiError) -> AnthropicError:
        return e if isinstance(e, AnthropicError) else cls(e.status, e.message, param=e.param,
                                                            type=e.type, extra=e.extra)

    def body(self) -> dict[str, Any]:
        return {"type": "error",
                "error": {"type": ERROR_TYPES.get(self.status, "api_error"),
                          "message": self.message}}


def anthropic_errors(handler: Callable[..., Awaitable[Response]]
                     ) -> Callable[..., Awaitable[Response]]:
    """Any :class:`ApiError` the handler raises is answered in Anthropic's shape."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            raise AnthropicError.of(e) from None

    return wrapped


# ---------------------------------------------------------------------------- request
_BILLING = re.compile(r"^(x-anthropic-billing-header:.*?cch=)[0-9a-zA-Z]{5};")


def _system_text(text: str) -> str:
    """Claude Code's system prompt opens with a billing header whose ``cch=XXXXX`` changes
    every request, which would end prompt reuse at the first line: it is replaced by a
    constant, as llama-server does (it means nothing to the model)."""
    return _BILLING.sub(r"\1fffff;", text, count=1)


def _image_part(b: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``image`` block as a chat ``image_url`` part (llama-server's conversion: a base64
    source as a data URI, a url source as its URL)."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        url = f"data:{src.get('media_type', 'image/jpeg')};base64,{src.get('data', '')}"
    elif kind == "url":
        url = src.get("url", "")
    else:
        raise invalid(f"'{where}.source.type' must be base64 or url, got {kind!r}", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _text_or_parts(texts: list[str], parts: list[dict[str, Any]]) -> Any:
    """Text blocks joined by newlines, or chat content parts when an image is among them."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(texts)


def _blocks_text(v: Any, where: str) -> Any:
    """A string, or text blocks joined by newlines (as chat content parts are), or chat
    content parts when they hold images; document blocks are refused."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if not isinstance(v, list):
        raise invalid(f"'{where}' must be a string or an array of content blocks, got "
                      f"{_kind(v)}", where)
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(v):
        w = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "image":
            parts.append(_image_part(b, w))
            continue
        if kind == "document":
            raise unsupported(f"'{w}': document input is not supported", w)
        if kind != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"'{w}' must be a text block ({{\"type\": \"text\", \"text\": ...}}), "
                          f"got type {kind!r}", w)
        texts.append(b["text"])
        parts.append({"type": "text", "text": b["text"]})
    return _text_or_parts(texts, parts)


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its tool results (tool messages) first, then
    the message itself with its text, reasoning and tool calls."""
    if not isinstance(m, dict):
        raise invalid(f"'{where}' must be an object, got {_kind(m)}", where)
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise invalid(f"'{where}.role' must be user or assistant, got {role!r}", f"{where}.role")
    content = m.get("content")
    if content is None or isinstance(content, str):
        if content is None and role != "assistant":
            raise invalid(f"'{where}.content' is required", f"{where}.content")
        return [{"role": role, "content": content or ""}]
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or an array of content blocks, got "
                      f"{_kind(content)}", f"{where}.content")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(field_str(b, "text", w))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image":
            parts.append(_image_part(b, w))
        elif kind == "thinking":
            reasoning.append(field_str(b, "thinking", w))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise invalid(f"'{w}.input' must be an object, got {_kind(args)}", f"{w}.input")
            calls.append({"id": field_str(b, "id", w), "type": "function",
                          "function": {"name": field_str(b, "name", w),
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": field_str(b, "tool_use_id", w),
                            "content": _blocks_text(b.get("content"), f"{w}.content")})
        elif kind == "document":
            raise unsupported(f"'{w}': document input is not supported", w)
        else:
            raise invalid(f"'{w}.type' must be text, thinking, tool_use or tool_result, got "
                          f"{kind!r}", f"{w}.type")
    out = list(results)
    if parts or calls or reasoning or not results:
        msg: dict[str, Any] = {"role": role, "content": _text_or_parts(texts, parts)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as chat messages (an empty ``messages`` is accepted, as
    llama-server accepts it)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _blocks_text(system, "system")
        if not isinstance(text, str):
            raise unsupported("'system': image blocks are not supported in the system prompt",
                              "system")
        out.append({"role": "system", "content": _system_text(text)})
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise invalid(f"'messages' must be an array of messages, got {_kind(msgs)}", "messages")
    for i, m in enumerate(msgs):
        out += _message(m, f"messages[{i}]")
    return out


def _tools(v: Any) -> list[dict[str, Any]]:
    """Client tools (``name``, ``description``, ``input_schema``) as chat function tools;
    Anthropic's server tools (web search, code execution, ...) run at Anthropic and are
    skipped."""
    out = []
    for i, t in enumerate(object_array(v, "tools", "tools")):
        if t.get("type") not in (None, "custom"):
            log.warning("messages: tools[%d] of type %r skipped (client tools only)", i,
                        t.get("type"))
            continue
        fn: dict[str, Any] = {"name": t.get("name")}  # OpenAI's key order: templates
        if t.get("description") is not None:          # print the tools as JSON
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema", {"type": "object"})
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any, out: dict[str, Any]) -> None:
    """``{"type": auto | any | tool | none}`` as chat's ``tool_choice``;
    ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    if v is None:
        return
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": v.get("name")}}
    elif kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise invalid("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                      "{\"type\": \"tool\", \"name\": NAME}", "tool_choice")
    if v.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def chat_body(body: Mapping[str, Any], generating: bool = True) -> dict[str, Any]:
    """The chat completions body of a Messages body (HTTP 400 for anything wrong);
    ``generating``: for /v1/messages (count_tokens reads the prompt's fields only)."""
    out: dict[str, Any] = {"messages": chat_messages(body)}
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    _tool_choice(body.get("tool_choice"), out)
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict):
            raise invalid(f"'thinking' must be an object, got {_kind(thinking)}", "thinking")
        if thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
            out["thinking_budget_tokens"] = thinking["budget_tokens"]
        elif thinking.get("type") == "disabled":
            out["reasoning_effort"] = "none"
    for key in _PASSED:
        if key in body:
            out[key] = body[key]
    if not generating:
        return out
    out["max_tokens"] = get_int(body, "max_tokens", DEFAULT_MAX_TOKENS, lo=-1)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise invalid("'stop_sequences' must be an array of strings", "stop_sequences")
        out["stop"] = stops
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise invalid(f"'metadata' must be an object, got {_kind(md)}", "metadata")
    return out


def parsed_messages(chat: Mapping[str, Any], images: list[tuple[str, str]]
                    ) -> list[dict[str, Any]]:
    """The chat messages, validated (none at all is allowed here); image parts collected in
    ``images``."""
    return parse_messages(chat, images) if chat["messages"] else []


# ---------------------------------------------------------------------------- response
def stop_reason(result: Result, tool_calls: bool) -> str:
    if tool_calls and result.stop_reason in ("eos", "stop"):
        return "tool_use"
    return {"eos": "end_turn", "stop": "stop_sequence", "cancelled": "end_turn"}.get(
        result.stop_reason, "max_tokens")


def usage(result: Result) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache."""
    return {"input_tokens": len(result.prompt_tokens) - result.cache_n,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": result.cache_n,
            "output_tokens": len(result.tokens)}


def content_block(b: Block) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    try:
        args = json.loads(b.text) if b.text.strip() else {}
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": b.call_id, "name": b.name,
            "input": args if isinstance(args, dict) else {}}


def message(mid: str, model: str, result: Result, blocks: list[Block]) -> dict[str, Any]:
    """The whole answer (at least one block: an empty text one when nothing was said)."""
    content = [content_block(b) for b in blocks] or [{"type": "text", "text": ""}]
    tools = any(b.kind == "tool" for b in blocks)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(result, tools),
            "stop_sequence": result.stop_word if result.stop_reason == "stop" else None,
            "usage": usage(result)}


class MessageEvents:
    """A streamed message's events: ``message_start`` (once the prompt's cached part is
    known), the blocks' steps, and the closing ones."""

    def __init__(self, mid: str, model: str, live: LiveTimings, n_prompt: int) -> None:
        self.mid = mid
        self.model = model
        self.live = live
        self.n_prompt = n_prompt
        self.started = False

    def start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        cache = self.live.cache_n
        return [{"type": "message_start", "message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.n_prompt - cache, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": cache, "output_tokens": 0}}}]

    @staticmethod
    def steps(steps: list[Step]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for st in steps:
            b = st.block
            if st.op == "open":
                start = content_block(b)
                if b.kind == "tool":
                    start["input"] = {}
                else:
                    start[{"reasoning": "thinking", "text": "text"}[b.kind]] = ""
                out.append({"type": "content_block_start", "index": b.index,
                            "content_block": start})
            elif st.op == "delta":
                delta = ({"type": "thinking_delta", "thinking": st.delta}
                         if b.kind == "reasoning" else
                         {"type": "text_delta", "text": st.delta} if b.kind == "text" else
                         {"type": "input_json_delta", "partial_json": st.delta})
                out.append({"type": "content_block_delta", "index": b.index, "delta": delta})
            else:
                if b.kind == "reasoning":  # Anthropic's clients expect a signature first
                    out.append({"type": "content_block_delta", "index": b.index,
                                "delta": {"type": "signature_delta", "signature": ""}})
                out.append({"type": "content_block_stop", "index": b.index})
        return out


# ---------------------------------------------------------------------------- endpoints
def install(app: FastAPI, state: ServerState) -> None:
    """Add ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    @app.post("/v1/messages")
    @anthropic_errors
    async def messages(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        chat = chat_body(body)
        images: list[tuple[str, str]] = []
        job = await prepare_chat(state, chat, parsed_messages(chat, images), images)
        mid = f"msg_{secrets.token_hex(12)}"
        handle = await job.start(state, mid)
        if not job.gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            blocks = final_blocks(result.text, job.prompt.syntax)
            return JSONResponse(message(mid, model, result, blocks))

        # prompt progress tells message_start the cached tokens; nothing else is shown
        live = LiveTimings(progress=True, tag=False)
        events = MessageEvents(mid, model, live, len(job.ids))
        answer = AnswerSteps(job.prompt.syntax)

        def chunk(ev: Any) -> list[Any]:
            out = events.start()
            if ev.progress is None:
                out += events.steps(answer.feed(ev.text))
            return out

        def final(result: Result) -> list[Any]:
            out = events.start()
            steps = answer.finish()
            if not answer.blocks:  # nothing said: one empty text block, as the whole answer
                empty = Block("text", 0)
                steps = [Step("open", empty), Step("close", empty)]
            out += events.steps(steps)
            tools = any(b.kind == "tool" for b in answer.blocks)
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(result, tools),
                                  "stop_sequence": (result.stop_word
                                                    if result.stop_reason == "stop" else None)},
                        "usage": {"output_tokens": len(result.tokens)}})
            out.append({"type": "message_stop"})
            return out

        return stream(state, handle, t_start, chunk, final, done_marker=False, live=live,
                      encode=named_sse, error=lambda e: AnthropicError.of(e).body())

    @app.post("/v1/messages/count_tokens")
    @anthropic_errors
    async def count_tokens(request: Request) -> JSONResponse:
        """The prompt's token count of a Messages body (``max_tokens`` not needed)."""
        body = await read_body(request)
        chat = chat_body(body, generating=False)
        images: list[tuple[str, str]] = []
        n = await count_prompt_tokens(state, chat, parsed_messages(chat, images), images)
        return JSONResponse({"input_tokens": n})
