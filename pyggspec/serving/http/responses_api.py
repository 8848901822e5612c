"""OpenAI's Responses API: ``POST /v1/responses`` (and ``/responses``) and
``/v1/responses/input_tokens``, as llama-server serves them.

A Responses body is converted to a chat body (``input`` items -> ``messages``,
``instructions`` -> a system message, function ``tools``, ``max_output_tokens``,
``reasoning.effort``, ``text.format``) and runs the chat path (:mod:`.chat_job`): the same
template, tools, reasoning split, sampling and limits as ``/v1/chat/completions``. The answer
becomes output items: ``reasoning``, ``message`` (``output_text``) and ``function_call``.
Streams send OpenAI's events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ..., ``response.completed``) as named server-sent events,
each with a ``sequence_number``; llama-server's ``timings_per_token`` and ``return_progress``
add ``timings`` / ``prompt_progress`` to them (progress on ``response.in_progress``).

As llama-server: nothing is stored, so ``previous_response_id`` (and ``conversation``,
``background``) is a 400; tools other than functions are skipped; the response's status is
``completed`` also when ``max_output_tokens`` cut it (``incomplete_details`` then says so).
Errors are OpenAI's error bodies.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
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

# Responses fields with no chat equivalent here: dropped from the chat body (read below
# where they mean something)
_RESPONSES_ONLY = ("input", "instructions", "tools", "tool_choice", "max_output_tokens",
                   "reasoning", "text", "previous_response_id", "store", "include",
                   "truncation", "metadata", "background", "conversation", "prompt",
                   "prompt_cache_key", "safety_identifier", "service_tier", "max_tool_calls",
                   "stream_options", "top_logprobs", "messages", "n")
_NOT_STORED = ("previous_response_id", "conversation", "background")


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's form for Responses objects: ``resp_``, ``msg_``, ``rs_``, ``fc_``."""
    return f"{prefix}_{secrets.token_hex(16)}"


# ---------------------------------------------------------------------------- request
def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body of a Responses body (HTTP 400 naming the Responses field
    for anything wrong)."""
    for key in _NOT_STORED:
        if body.get(key) not in (None, False, ""):
            raise unsupported(f"'{key}' is not supported: pyggspec serve stores no "
                              "responses or conversations (send the whole input)", key)
    if body.get("n") not in (None, 1):
        raise invalid("'n' is not a Responses field; one answer per request", "n")
    out = {k: v for k, v in body.items() if k not in _RESPONSES_ONLY}
    out["messages"] = input_messages(body)
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    limit = get_int(body, "max_output_tokens", None, lo=-1)
    if limit is not None:
        out["max_tokens"] = limit
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid(f"'reasoning' must be an object, got {_kind(reasoning)}", "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    return out


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` (a string, or input items) as chat messages."""
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid(f"'instructions' must be a string, got {_kind(instructions)}",
                          "instructions")
        msgs.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if inp is None:
        raise invalid("'input' is required", "input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            _add_item(msgs, item, f"input[{i}]")
    else:
        raise invalid(f"'input' must be a string or an array of input items, got {_kind(inp)}",
                      "input")
    if not msgs:
        raise invalid("'input' is empty", "input")
    return msgs


def _text_parts(content: Any, where: str, kinds: tuple[str, ...],
                images: bool = False) -> Any:
    """A string, or content parts of the given text ``kinds`` (joined by newlines, as chat
    content parts are); ``images``: ``input_image`` parts are taken too, and then the
    content is chat content parts (llama-server's conversion); files are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content parts, got "
                      f"{_kind(content)}", where)
    texts, parts = [], []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise invalid(f"'{w}.image_url' is required (a URL or data URI)", w)
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"'{w}': {kind.removeprefix('input_')} input is not supported "
                              "here", w)
        if kind not in kinds:
            raise invalid(f"'{w}.type' must be one of {', '.join(kinds)}, got {kind!r}",
                          f"{w}.type")
        texts.append(field_str(part, "refusal" if kind == "refusal" else "text", w))
        parts.append({"type": "text", "text": texts[-1]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(texts)


def _assistant(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message an output item joins: the last message when it is one (a
    reasoning item, a message and its function calls are one turn), else a new one."""
    if msgs and msgs[-1]["role"] == "assistant":
        return msgs[-1]
    msgs.append({"role": "assistant", "content": ""})
    return msgs[-1]


def _add_item(msgs: list[dict[str, Any]], item: Any, where: str) -> None:
    """One input item as chat messages: a message (user, system, developer, assistant),
    a function call, its output, or a reasoning item."""
    if not isinstance(item, dict):
        raise invalid(f"'{where}' must be an object, got {_kind(item)}", where)
    kind, role = item.get("type"), item.get("role")
    if kind in (None, "message") and role in ("user", "system", "developer"):
        text = _text_parts(item.get("content"), f"{where}.content", ("input_text",), True)
        msgs.append({"role": role, "content": text})
    elif kind in (None, "message") and role == "assistant":
        text = _text_parts(item.get("content"), f"{where}.content",
                           ("output_text", "input_text", "refusal"))
        msg = _assistant(msgs)
        if msg.get("tool_calls"):  # text after the calls: a turn of its own
            msgs.append({"role": "assistant", "content": text})
        else:
            msg["content"] = msg["content"] + ("\n" if msg["content"] and text else "") + text
    elif kind == "function_call":
        call = {"id": field_str(item, "call_id", where), "type": "function",
                "function": {"name": field_str(item, "name", where),
                             "arguments": field_str(item, "arguments", where)}}
        _assistant(msgs).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        out = item.get("output")
        text = _text_parts(out, f"{where}.output", ("input_text", "output_text"), True)
        msgs.append({"role": "tool", "tool_call_id": field_str(item, "call_id", where),
                     "content": text})
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        text = _text_parts(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        msg = _assistant(msgs)
        if msg["content"] or msg.get("tool_calls"):  # a new turn starts with its reasoning
            msgs.append({"role": "assistant", "content": ""})
            msg = msgs[-1]
        msg["reasoning_content"] = msg.get("reasoning_content", "") + text
    elif role is not None and kind in (None, "message"):
        raise invalid(f"'{where}.role' must be one of user, system, developer, assistant, "
                      f"got {role!r}", f"{where}.role")
    else:
        raise invalid(f"'{where}' is not an input item this server reads (a message, "
                      "function_call, function_call_output or reasoning item); its type is "
                      f"{kind!r}", f"{where}.type")


def _tools(v: Any) -> list[dict[str, Any]]:
    """Function tools as chat tools; other tools (web search, file search, ...) have no
    chat equivalent and are skipped, as llama-server skips them."""
    out = []
    for i, t in enumerate(object_array(v, "tools", "tools")):
        if t.get("type") != "function":
            log.warning("responses: tools[%d] of type %r skipped (function tools only)", i,
                        t.get("type"))
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    """``auto`` / ``none`` / ``required``, or ``{"type": "function", "name": N}`` as chat's
    named function."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"name\": NAME}", "tool_choice")


def _text_format(v: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (json_object, json_schema)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"'text' must be an object, got {_kind(v)}", "text")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid(f"'text.format' must be an object, got {_kind(fmt)}", "text.format")
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {})}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise invalid(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}",
                  "text.format.type")


# ---------------------------------------------------------------------------- response
def usage(result: Result) -> dict[str, Any]:
    n_in, n_out = len(result.prompt_tokens), len(result.tokens)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": result.cache_n},
            "output_tokens": n_out, "total_tokens": n_in + n_out}


def item(block: Block, status: str = "completed") -> dict[str, Any]:
    """The output item of a block (its ``ident`` set)."""
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": block.text}] if block.text else []
        return {"id": block.ident, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": "", "status": status}
    if block.kind == "text":
        content = ([{"type": "output_text", "text": block.text, "annotations": [],
                     "logprobs": []}] if status == "completed" else [])
        return {"id": block.ident, "type": "message", "role": "assistant", "status": status,
                "content": content}
    return {"id": block.ident, "type": "function_call", "call_id": block.call_id,
            "name": block.name, "arguments": block.text if status == "completed" else "",
            "status": status}


def set_ident(block: Block) -> Block:
    block.ident = new_item_id({"reasoning": "rs", "text": "msg", "tool": "fc"}[block.kind])
    return block


class ResponseShape:
    """One response's fixed fields: its id, model, creation time and the request's
    settings it echoes (OpenAI's response object)."""

    def __init__(self, body: Mapping[str, Any], model: str) -> None:
        self.id = new_item_id("resp")
        self.model = model
        self.created = int(time.time())
        self.echo = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "store": False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "metadata": body.get("metadata") or {},
        }

    def response(self, status: str, output: list[dict[str, Any]],
                 result: Result | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created,
                               "status": status, "model": self.model, "output": output,
                               "error": None, "incomplete_details": None}
        if result is not None:
            out["completed_at"] = int(time.time())
            out["usage"] = usage(result)
            if result.stop_reason in ("length", "context"):
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        out.update(self.echo)
        return out


class ResponseEvents:
    """A streamed response's events, numbered: opening ones, each step of the answer's
    blocks, and the closing ones with the whole response."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.started = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def opening(self, progress: bool) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` once; after that a progress
        event is one more ``response.in_progress`` (llama-server's)."""
        if self.started:
            return [self.event("response.in_progress",
                               response=self.shape.response("in_progress", []))] if progress else []
        self.started = True
        return [self.event(kind, response=self.shape.response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def steps(self, steps: list[Step]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for st in steps:
            b = st.block
            at = {"output_index": b.index, "item_id": b.ident}
            if st.op == "open":
                set_ident(b)
                out.append(self.event("response.output_item.added", output_index=b.index,
                                      item=item(b, "in_progress")))
                if b.kind == "text":
                    out.append(self.event("response.content_part.added", item_id=b.ident,
                                          output_index=b.index, content_index=0,
                                          part={"type": "output_text", "text": "",
                                                "annotations": []}))
            elif st.op == "delta":
                kind = {"reasoning": "response.reasoning_text.delta",
                        "text": "response.output_text.delta",
                        "tool": "response.function_call_arguments.delta"}[b.kind]
                extra = {} if b.kind == "tool" else {"content_index": 0}
                out.append(self.event(kind, **at, **extra, delta=st.delta))
            else:
                out += self._close(b)
        return out

    def _close(self, b: Block) -> list[dict[str, Any]]:
        at = {"item_id": b.ident, "output_index": b.index}
        out = []
        if b.kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", **at, content_index=0,
                                  text=b.text))
        elif b.kind == "text":
            done = item(b)
            out.append(self.event("response.output_text.done", **at, content_index=0,
                                  text=b.text))
            out.append(self.event("response.content_part.done", **at, content_index=0,
                                  part=done["content"][0]))
        else:
            out.append(self.event("response.function_call_arguments.done", **at,
                                  name=b.name, arguments=b.text))
        out.append(self.event("response.output_item.done", output_index=b.index, item=item(b)))
        return out

    def completed(self, blocks: list[Block], result: Result) -> dict[str, Any]:
        return self.event("response.completed", response=self.shape.response(
            "completed", [item(b) for b in blocks], result))

    def error(self, e: ApiError) -> dict[str, Any]:
        return self.event("error", code=e.type, message=e.message, param=e.param)


# ---------------------------------------------------------------------------- endpoints
def install(app: FastAPI, state: ServerState) -> None:
    """Add ``/v1/responses``, ``/responses`` and their ``input_tokens`` endpoints."""

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        chat = chat_body(body)
        images: list[tuple[str, str]] = []
        job = await prepare_chat(state, chat, parse_messages(chat, images), images)
        shape = ResponseShape(body, model)
        handle = await job.start(state, shape.id)
        if not job.gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            blocks = [set_ident(b) for b in final_blocks(result.text, job.prompt.syntax)]
            return JSONResponse(shape.response("completed", [item(b) for b in blocks], result))

        events = ResponseEvents(shape)
        answer = AnswerSteps(job.prompt.syntax)

        def chunk(ev: Any) -> list[Any]:
            out = events.opening(ev.progress is not None)
            if ev.progress is None:
                out += events.steps(answer.feed(ev.text))
            return out

        def final(result: Result) -> list[Any]:
            out = events.opening(False)
            out += events.steps(answer.finish())
            done = events.completed(answer.blocks, result)
            done["timings"] = result.timings.to_dict()  # llama-server's, on the last event
            return out + [done]

        return stream(state, handle, t_start, chunk, final, done_marker=False,
                      live=LiveTimings.of(job.gen), encode=named_sse, error=events.error)

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def input_tokens(request: Request) -> JSONResponse:
        """The prompt's token count of a Responses body (nothing is generated)."""
        body = await read_body(request)
        chat = chat_body(body)
        images: list[tuple[str, str]] = []
        n = await count_prompt_tokens(state, chat, parse_messages(chat, images), images)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})
