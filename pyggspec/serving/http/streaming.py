"""Waiting for a submitted request: whole (:func:`run_to_end`) or as SSE (:func:`stream`).

Tokens come back as events through the request's handle without blocking the event loop.
However the wait ends early (the client disconnects, the handler is cancelled, the server
fails mid-stream), the request is cancelled, which frees its slot at the scheduler's next
step, and its result is still counted once the scheduler has ended it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from pyggspec.errors import OutOfMemory
from pyggspec.serving.http.live_timings import LiveTimings
from pyggspec.serving.http.protocol import ApiError
from pyggspec.serving.request import RequestFailed, Result

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.http.state import ServerState


class Handle(Protocol):
    """What the waiting helpers need of a submitted request: a scheduler's
    :class:`RequestHandle`, or a chat answer of two requests (``chat_run.ChatRun``)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def result(self) -> Result: ...

    async def aresult(self) -> Result: ...

    def cancel(self) -> None: ...


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next ASGI
    message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def run_to_end(state: ServerState, request: Request, handle: Handle,
                     t_start: float) -> Result:
    """Wait for the whole result; a client that goes away cancels its request."""
    t_first: list[float] = []

    async def consume() -> Result:
        async for ev in handle:
            if ev.tokens and not t_first:
                t_first.append(time.perf_counter())
        return handle.result()

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            handle.cancel()  # disconnected (or this handler was cancelled)
        gone.cancel()
    if not work.done():
        work.cancel()
        state.record_when_done(handle)
        raise ApiError(499, "client disconnected")
    try:
        result = work.result()
    except RequestFailed as e:
        raise failed(e) from None
    state.finished(result, t_start, t_first[0] if t_first else None)
    return result


def failed(e: RequestFailed) -> ApiError:
    """A request whose step failed: 503 when the device had no memory for it (the server
    goes on; a later request may get it, as llama-server's 503 says), else 500."""
    if isinstance(e.__cause__, OutOfMemory):
        return ApiError(503, e.message)
    return ApiError(500, f"generation failed: {e.message}")


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class CancellingStream(StreamingResponse):
    """A streaming response that cancels its request however the stream ends (done,
    client gone, server error): a disconnected client frees its slot."""

    def __init__(self, content: AsyncIterator[bytes], handle: Handle,
                 state: ServerState) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle
        self.state = state
        self.completed = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:
                self.handle.cancel()
                self.state.record_when_done(self.handle)


def named_sse(obj: Any) -> bytes:
    """One server-sent event named by ``obj["type"]`` (``event: TYPE``), as OpenAI's
    Responses and Anthropic's Messages streams send them."""
    return f"event: {obj['type']}\n".encode() + sse(obj)


def stream(state: ServerState, handle: Handle, t_start: float,
           chunk: Callable[[Any], list[Any]], final: Callable[[Result], list[Any]],
           done_marker: bool, live: LiveTimings | None = None,
           encode: Callable[[Any], bytes] = sse,
           error: Callable[[ApiError], Any] = ApiError.body) -> StreamingResponse:
    """SSE: ``chunk(event)`` bodies per event, ``final(result)`` bodies at the end, then
    ``data: [DONE]`` (OpenAI endpoints). ``live`` sees every event first: prompt progress
    events reach ``chunk`` only when the request asked for them (``return_progress``), and
    the last body of each event gets its ``timings`` / ``prompt_progress``. ``encode``
    writes one body; a failure mid-stream is sent as ``error(ApiError)``."""
    live = live or LiveTimings()

    async def body() -> AsyncIterator[bytes]:
        t_first = None
        try:
            async for ev in handle:
                live.observe(ev)
                if not live.shown(ev):
                    continue
                if ev.tokens and t_first is None:
                    t_first = time.perf_counter()
                out = chunk(ev)
                if out:
                    live.decorate(out[-1], ev)
                for c in out:
                    yield encode(c)
            result = handle.result()
        except RequestFailed as e:
            response.completed = True
            yield encode(error(failed(e)))
            return
        response.completed = True
        state.finished(result, t_start, t_first)
        for c in final(result):
            yield encode(c)
        if done_marker:
            yield b"data: [DONE]\n\n"

    response = CancellingStream(body(), handle, state)
    return response


class _NoEvent:
    """An event with nothing in it: lets ``final`` reuse ``chunk`` for the opening bodies
    a stream that produced no tokens still owes."""

    tokens: tuple[int, ...] = ()
    text = ""
    logprobs: tuple = ()
    progress = None


NO_EVENT = _NoEvent()
