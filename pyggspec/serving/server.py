"""``pyggspec serve``: the HTTP front end (OpenAI + llama-server shapes) over the scheduler.

One FastAPI app per model. Handlers parse and validate the request (HTTP 400 with an
OpenAI-style error body for anything wrong, never a 500), tokenize it, and submit it to the
engine's :class:`~pyggspec.serving.scheduler.Scheduler`, whose single background thread is
the only one touching ggml (mlx-lm's server pattern). Tokens come back as events through the
request's handle without blocking the event loop; a client that disconnects cancels its
request, which frees its slot at the next step.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(OpenAI, streamed as SSE ``data: {...}`` chunks ending with ``data: [DONE]``); llama-server's
``POST /completion`` (and ``/completions``, its alias there: OpenAI's shape is under ``/v1``
only), ``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /health``, ``/slots``,
``/props``, ``/metrics`` (Prometheus: llama-server's ``llamacpp:`` series, then pyggspec's
``pyggspec:`` ones). Field names and shapes follow llama.cpp's ``tools/server``. ``--api-key`` guards every endpoint but
``/health`` (``Authorization: Bearer KEY`` or ``X-Api-Key``). Any model name is accepted (one
model per server, as llama-server does without a router).

``create_app(engine_or_scheduler, ...)`` builds the app (tests run it in-process);
:func:`serve` runs it under uvicorn, which on SIGTERM/SIGINT stops accepting connections,
lets in-flight requests finish (streams included), then stops the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyggspec.sampling import SamplingParams
from pyggspec.serving import openai_api as oa
from pyggspec.serving.chat import ChatTemplate, parse_template_kwargs
from pyggspec.serving.metrics import Metric, ServeMetrics, render
from pyggspec.serving.model_info import ModelInfo
from pyggspec.serving.protocol import (
    ApiError,
    GenParams,
    context_error,
    get_bool,
    invalid,
    parse_body,
    parse_gen,
    parse_messages,
    parse_prompt,
    parse_token_list,
)
from pyggspec.serving.request import (
    QueueFull,
    RequestError,
    RequestFailed,
    RequestHandle,
    Result,
    SchedulerClosed,
)
from pyggspec.serving.request import Request as GenRequest
from pyggspec.serving.scheduler import Scheduler

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.engine import Engine

log = logging.getLogger("pyggspec.serve")

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


@dataclass
class ServerConfig:
    """What the server adds to the engine: names, defaults, access."""

    model_id: str  # what /v1/models reports and responses echo when a request names none
    model_path: str = ""
    api_key: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int | None = None  # default output limit (-n); None: until EOG/context
    synthetic: bool = False  # the built-in demo model
    jinja: bool = True
    chat_template: str | None = None  # override of the file's template


class ServerState:
    """Everything the handlers share: scheduler, engine, tokenizer, template, counters."""

    def __init__(self, scheduler: Any, config: ServerConfig) -> None:
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.config = config
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the engine has no tokenizer (load_tokenizer=False); the server "
                             "needs one")
        self.n_ctx: int = int(self.engine.n_ctx)
        self.n_vocab: int = int(self.engine.n_vocab)
        self.template = ChatTemplate(self.tokenizer, config.chat_template, config.jinja)
        spec = getattr(self.engine, "spec", None)
        self.speculative = bool(getattr(self.engine, "spec_type", None))
        self.n_max = int(spec.n_max) if spec is not None and self.speculative else 0
        self.metrics = ServeMetrics(self.n_max)
        self.model_info = ModelInfo.of(self.engine)
        self.created = oa.now()
        self.started = False
        self._pending: set[asyncio.Future] = set()

    # --- helpers used by handlers ---------------------------------------------------------
    def tokenize_prompt(self, parts: list[Any]) -> list[int]:
        """llama-server's rule: text is tokenized with special tokens parsed; BOS (where
        the vocabulary adds one) only when the prompt starts with text."""
        ids: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                ids.extend(self.tokenizer.tokenize(p, add_special=(i == 0),
                                                   parse_special=True))
            else:
                ids.append(int(p))
        return ids

    def check_context(self, ids: list[int], gen: GenParams) -> None:
        """The engine's emit rule: the prompt fits and leaves room for one token when any
        is asked for (llama-server's exceed_context_size_error otherwise)."""
        if not ids:
            raise invalid("the prompt is empty (no tokens)", "prompt")
        want = gen.max_tokens is None or gen.max_tokens > 0
        if len(ids) > self.n_ctx or (want and len(ids) >= self.n_ctx):
            raise context_error(len(ids), self.n_ctx, room=len(ids) <= self.n_ctx)

    def model_name(self, body: Mapping[str, Any]) -> str:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise invalid("'model' must be a string", "model")
        return m or self.config.model_id

    def settings(self, gen: GenParams) -> dict[str, Any]:
        """llama-server's ``generation_settings`` (the values this request runs with): its
        fields in its order. Samplers pyggspec does not implement (dynatemp, top-n-sigma,
        XTC, DRY, mirostat, adaptive-p) are reported in llama.cpp's disabled state, which
        is the state they run in here."""
        s = gen.sampling
        n_predict = -1 if gen.max_tokens is None else gen.max_tokens
        speculative = (self.speculative if gen.speculative is None
                       else gen.speculative and self.speculative)
        return {
            "seed": s.seed, "temperature": s.temp, "dynatemp_range": 0.0,
            "dynatemp_exponent": 1.0, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
            "typical_p": s.typical_p, "repeat_last_n": s.repeat_last_n,
            "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "dry_multiplier": 0.0, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_penalty_last_n": 64,
            "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
            "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
            "adaptive_decay": 0.9, "stop": list(gen.stop), "max_tokens": n_predict,
            "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
            "ignore_eos": gen.ignore_eos, "stream": gen.stream,
            # llama-server's {"bias", "token"} objects; a ban (-inf) as false, the value a
            # request bans a token with (JSON has no -inf)
            "logit_bias": [{"bias": b if math.isfinite(b) else False, "token": t}
                           for t, b in s.logit_bias],
            "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": False,
            "grammar_triggers": [], "preserved_tokens": [], "chat_format": "Content-only",
            "reasoning_format": "none", "reasoning_in_content": False,
            "generation_prompt": "", "samplers": list(s.samplers),
            "speculative.types": "draft-mtp" if speculative else "none",
            "timings_per_token": False, "post_sampling_probs": False,
            "backend_sampling": bool(getattr(self.engine, "backend_sampling", False)),
            "lora": [],
            # pyggspec's own
            "n_ctx": self.n_ctx, "model": self.config.model_id, "speculative": speculative,
            "speculative.n_max": self.n_max,
        }

    async def submit(self, ids: list[int], gen: GenParams, rid: str,
                     cache_prompt: bool = True) -> RequestHandle:
        """Queue the request (off the event loop: submit may wait for the scheduler's lock
        while a step runs); scheduler refusals become HTTP errors."""
        if gen.n_draft_max is not None and gen.n_draft_max > self.n_max:
            raise invalid(f"'speculative.n_max' must be at most the server's "
                          f"--spec-draft-n-max ({self.n_max}), got {gen.n_draft_max}",
                          "speculative.n_max")
        req = GenRequest(prompt=ids, max_tokens=gen.max_tokens, sampling=gen.sampling,
                         stop=gen.stop, ignore_eos=gen.ignore_eos, speculative=gen.speculative,
                         n_draft_max=gen.n_draft_max, cache_prompt=cache_prompt, id=rid)
        try:
            return await asyncio.to_thread(self.scheduler.submit, req)
        except RequestError as e:
            raise invalid(e.message) from None
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e.message}; retry later") from None
        except SchedulerClosed as e:
            raise ApiError(503, f"server is shutting down: {e.message}") from None

    def record_when_done(self, handle: RequestHandle) -> None:
        """Count a request whose client left (cancelled) once the scheduler has ended it."""

        async def wait() -> None:
            try:
                self.finished(await handle.aresult(), 0.0, None)
            except RequestFailed:
                pass

        self._pending.add(task := asyncio.ensure_future(wait()))
        task.add_done_callback(self._pending.discard)

    def finished(self, result: Result, t_start: float, t_first: float | None) -> None:
        self.metrics.record_result(result)
        if t_first is not None:
            self.metrics.record_ttft(t_first - t_start)
        t = result.timings
        spec = ""
        if result.spec is not None and result.spec.n_drafted:
            spec = (f", draft acceptance {result.spec.acceptance:.3f} "
                    f"({result.spec.n_accepted}/{result.spec.n_drafted})")
        log.info("%s: slot %d, prompt %d (+%d cached) tokens %.1f ms, %d tokens %.1f ms "
                 "(%.2f t/s), %s%s", result.id, result.slot, t.prompt_n, t.cache_n,
                 t.prompt_ms, t.predicted_n, t.predicted_ms,
                 t.predicted_n / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0,
                 result.stop_reason, spec)


# ---------------------------------------------------------------------------- running a request
async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next ASGI
    message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _run_to_end(state: ServerState, request: Request, handle: RequestHandle,
                      t_start: float) -> Result:
    """Wait for the whole result; a client that goes away cancels its request."""
    t_first: list[float] = []

    async def consume() -> Result:
        async for ev in handle:
            if ev.tokens and not t_first:
                t_first.append(time.perf_counter())
        return handle.result()

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_wait_disconnect(request))
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
        raise ApiError(500, f"generation failed: {e.message}") from None
    state.finished(result, t_start, t_first[0] if t_first else None)
    return result


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _CancellingStream(StreamingResponse):
    """A streaming response that cancels its request however the stream ends (done,
    client gone, server error): a disconnected client frees its slot."""

    def __init__(self, content: AsyncIterator[bytes], handle: RequestHandle,
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


def _stream(state: ServerState, handle: RequestHandle, t_start: float,
            chunk: Callable[[Any], list[Any]], final: Callable[[Result], list[Any]],
            done_marker: bool) -> StreamingResponse:
    """SSE: ``chunk(event)`` bodies per event, ``final(result)`` bodies at the end, then
    ``data: [DONE]`` (OpenAI endpoints). A failure mid-stream is sent as an error event."""

    async def body() -> AsyncIterator[bytes]:
        t_first = None
        try:
            async for ev in handle:
                if ev.tokens and t_first is None:
                    t_first = time.perf_counter()
                for c in chunk(ev):
                    yield _sse(c)
            result = handle.result()
        except RequestFailed as e:
            response.completed = True
            yield _sse(ApiError(500, f"generation failed: {e.message}").body())
            return
        response.completed = True
        state.finished(result, t_start, t_first)
        for c in final(result):
            yield _sse(c)
        if done_marker:
            yield b"data: [DONE]\n\n"

    response = _CancellingStream(body(), handle, state)
    return response


# ---------------------------------------------------------------------------- the app
def create_app(target: Engine | Scheduler, config: ServerConfig | None = None, *,
               max_queue: int | None = None, manage_scheduler: bool = True) -> FastAPI:
    """The ASGI app over an :class:`~pyggspec.engine.Engine` or its
    :class:`~pyggspec.serving.scheduler.Scheduler`.

    ``manage_scheduler``: start the scheduler's thread when the app starts and stop it
    (draining) when the app shuts down. ``max_queue`` sets the scheduler's waiting-queue
    limit (``--max-queue``; more requests get HTTP 503).
    """
    scheduler = _scheduler_of(target)
    if max_queue is not None:
        scheduler.max_queue = max_queue
    if config is None:
        path = Path(scheduler.engine.model.trunk.path)
        config = ServerConfig(model_id=path.name, model_path=str(path),
                              sampling=scheduler.engine.sampling)
    state = ServerState(scheduler, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_scheduler:
            scheduler.start()
        state.started = True
        try:
            yield
        finally:
            state.started = False
            if manage_scheduler:
                # uvicorn has let in-flight requests finish; anything still queued drains
                await asyncio.to_thread(scheduler.stop, True)

    app = FastAPI(title="pyggspec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.pyggspec = state
    _install_errors(app, state)
    app.add_middleware(_Gate, state=state)
    _routes(app, state)
    return app


def _scheduler_of(target: Any) -> Scheduler:
    """The scheduler to serve: the one given, or the engine's own (one per engine)."""
    return target if isinstance(target, Scheduler) else target.scheduler


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status if e.status != 499 else 400)


def _install_errors(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, e.message)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = ("no such endpoint: " + request.url.path if e.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}"
               if e.status_code == 405 else str(e.detail))
        return _error_response(ApiError(e.status_code, msg))



class _Gate:
    """Pure ASGI middleware: the API key check (every path but /health) and the per-route
    request counts for /metrics. Not Starlette's BaseHTTPMiddleware, which would relay
    every streamed chunk through an extra task and memory stream."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
            given = given.removeprefix(b"Bearer ").strip()
            if given != self.key:
                self.state.metrics.count_request("unauthorized", 401)
                await _error_response(ApiError(401, "Invalid API Key"))(scope, receive, send)
                return
        status = [0]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as e:
            # a bug in pyggspec: logged, answered with an error body while the response has
            # not started, and the connection stays usable (never re-raised to uvicorn)
            log.exception("internal error on %s %s", scope.get("method"), scope["path"])
            if status[0]:
                return  # mid-stream: the client sees the stream end early
            status[0] = 500
            err = ApiError(500, f"internal error: {type(e).__name__}: {e}")
            await _error_response(err)(scope, receive, send)
        finally:
            route = scope.get("route")
            self.state.metrics.count_request(getattr(route, "path", "unmatched"), status[0])


def _routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.config

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_body(await request.body())

    # --- health, models, props, slots, metrics --------------------------------------------
    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        if not state.started or not state.scheduler.running:
            raise ApiError(503, "Loading model" if not state.started else "scheduler stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> JSONResponse:
        # llama-server's meta first, then pyggspec's
        meta = state.model_info.meta(state.n_ctx)
        meta.update({"n_parallel": int(state.engine.n_parallel), "synthetic": cfg.synthetic,
                     "speculative": "draft-mtp" if state.speculative else None,
                     "spec_draft_n_max": state.n_max})
        if cfg.synthetic:
            meta["note"] = ("built-in SYNTHETIC demo model: random weights, constructed MTP "
                            "agreement; its text is meaningless")
        card = oa.model_card(cfg.model_id, state.created, meta)
        return JSONResponse({"models": [oa.ollama_model_entry(cfg.model_id)],
                             "object": "list", "data": [card]})

    @app.get("/props")
    async def props() -> JSONResponse:
        from pyggspec import __version__

        gen = GenParams(sampling=cfg.sampling, max_tokens=cfg.n_predict)
        caps = await asyncio.to_thread(state.template.caps)  # probed once, then cached
        # llama-server's fields in its order, then pyggspec's
        return JSONResponse({
            "default_generation_settings": {"params": state.settings(gen),
                                            "n_ctx": state.n_ctx,
                                            "speculative": state.speculative},
            "total_slots": int(state.engine.n_parallel), "model_alias": cfg.model_id,
            "model_ftype": state.model_info.ftype, "model_path": cfg.model_path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "ui": False, "chat_template": state.template.source,
            "chat_template_caps": caps, "bos_token": state.template.bos_token,
            "eos_token": state.template.eos_token, "build_info": f"pyggspec {__version__}",
            "is_sleeping": False, "synthetic": cfg.synthetic,
            "chat_template_renderer": state.template.name})

    @app.get("/slots")
    async def slots(request: Request) -> JSONResponse:
        info = await asyncio.to_thread(state.scheduler.slots)
        for s in info:  # llama-server's flag next to the scheduler's state name
            s.setdefault("is_processing", s.get("state") != "idle")
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(
                s.get("state") != "idle" for s in info):
            raise ApiError(503, "no slot available")
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await asyncio.to_thread(_metrics_text, state)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4",
                                 headers={"Process-Start-Time-Unix": str(state.created)})

    # --- tokens ------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise invalid("'content' (a string) is required", "content")
        ids = state.tokenizer.tokenize(content, add_special=get_bool(body, "add_special", False),
                                       parse_special=get_bool(body, "parse_special", True))
        if not get_bool(body, "with_pieces", False):
            return JSONResponse({"tokens": ids})
        out = []
        for t in ids:
            raw = state.tokenizer.token_to_piece(t)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await body_of(request)
        ids = parse_token_list(body, "tokens", state.n_vocab)
        return JSONResponse({"content": state.tokenizer.detokenize(ids)})

    @app.post("/apply-template")
    async def apply_template(request: Request) -> JSONResponse:
        body = await body_of(request)
        text = state.template.render(parse_messages(body), True, parse_template_kwargs(body))
        return JSONResponse({"prompt": text})

    # --- generation ---------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await body_of(request)
        model = state.model_name(body)
        messages = parse_messages(body)
        kwargs = parse_template_kwargs(body)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        # template and tokenizer off the event loop: a long conversation must not stall
        # the other streams
        ids = await asyncio.to_thread(
            lambda: state.tokenize_prompt([state.template.render(messages, True, kwargs)]))
        state.check_context(ids, gen)
        rid, created = oa.new_id("chatcmpl"), oa.now()
        handle = await state.submit(ids, gen, rid, get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await _run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.chat_response(rid, created, model, result))

        first = [True]

        def chunk(ev: Any) -> list[Any]:
            out = []
            if first[0]:
                first[0] = False
                out.append(oa.chat_chunk(rid, created, model,
                                         {"role": "assistant", "content": None}))
            if ev.text:
                out.append(oa.chat_chunk(rid, created, model, {"content": ev.text}))
            return out

        def final(result: Result) -> list[Any]:
            out = chunk(_NO_EVENT) if first[0] else []
            out.append(oa.chat_final_chunk(rid, created, model, result))
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result,
                                          "chat.completion.chunk"))
            return out

        return _stream(state, handle, t_start, chunk, final, done_marker=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await body_of(request)
        model = state.model_name(body)
        parts = parse_prompt(body, state.n_vocab)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        if body.get("suffix") is not None:
            raise ApiError(400, "'suffix' (infill) is not supported by pyggspec serve",
                           param="suffix", type="not_supported_error")
        ids = await asyncio.to_thread(state.tokenize_prompt, parts)
        state.check_context(ids, gen)
        prefix = state.tokenizer.detokenize(ids) if gen.echo else ""
        rid, created = oa.new_id("cmpl"), oa.now()
        handle = await state.submit(ids, gen, rid, get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await _run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.completion_response(rid, created, model, result, prefix))

        echoed = [not prefix]

        def chunk(ev: Any) -> list[Any]:
            text = ev.text
            if not echoed[0]:
                echoed[0] = True
                text = prefix + text
            return [oa.completion_chunk(rid, created, model, text)] if text else []

        def final(result: Result) -> list[Any]:
            out = chunk(_NO_EVENT) if not echoed[0] else []
            out.append(oa.completion_final_chunk(rid, created, model, result))
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result, "text_completion"))
            return out

        return _stream(state, handle, t_start, chunk, final, done_marker=True)

    @app.post("/completion")
    @app.post("/completions")  # llama-server: its own shape here, OpenAI's under /v1 only
    async def completion(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await body_of(request)
        model = state.model_name(body)
        parts = parse_prompt(body, state.n_vocab)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        ids = await asyncio.to_thread(state.tokenize_prompt, parts)
        state.check_context(ids, gen)
        settings = state.settings(gen)
        prompt_echo = body.get("prompt")
        handle = await state.submit(ids, gen, oa.new_id("cmpl"),
                                    get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await _run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.llama_completion(model, result, settings, prompt_echo,
                                                    gen.return_tokens, state.n_ctx))

        def chunk(ev: Any) -> list[Any]:
            return [oa.llama_chunk(ev.text, list(ev.tokens), -1)]

        def final(result: Result) -> list[Any]:
            last = oa.llama_completion(model, result, settings, prompt_echo, gen.return_tokens,
                                       state.n_ctx)
            last["content"] = ""
            last["tokens"] = []
            return [last]

        return _stream(state, handle, t_start, chunk, final, done_marker=False)

    @app.get("/completion")
    @app.get("/v1/chat/completions")
    @app.get("/v1/completions")
    async def wrong_method(request: Request) -> Response:
        raise ApiError(405, f"use POST for {request.url.path}")



class _NoEvent:
    tokens: tuple[int, ...] = ()
    text = ""


_NO_EVENT = _NoEvent()


def _metrics_text(state: ServerState) -> str:
    """llama-server's ``llamacpp:`` series, then pyggspec's ``pyggspec:`` ones: counters
    kept here, plus the scheduler's view now (queue, slots, recent throughput, failed
    requests, decode steps) and memory by component."""
    sched = state.scheduler
    m = sched.metrics()
    extra = [
        Metric("tokens_per_second", "gauge",
               "Generation throughput of the whole server over the last seconds.").add(
            float(m["tokens_per_second"])),
        Metric("requests_failed_total", "counter",
               "Requests whose step failed (the others carried on).").add(
            int(m["requests_failed"])),
        Metric("n_decode_total", "counter", "Decode / verify batches run.").add(
            int(m["decode_steps"])),
    ]
    ours = state.metrics.families(busy_slots=int(m["busy_slots"]), n_slots=int(m["n_slots"]),
                                  queued=int(m["queue_depth"]), memory=sched.memory(),
                                  extra=extra)
    llama = state.metrics.llamacpp_families(
        busy_slots=int(m["busy_slots"]), queued=int(m["queue_depth"]),
        # llama-server counts every llama_decode() but speculative drafts: prompt batches too
        n_decode=int(m["decode_steps"]) + int(m.get("prompt_chunks", 0)),
        n_busy_slots_decoded=int(m.get("decode_busy_slots", 0)))
    return render(llama, prefix="llamacpp:") + render(ours)


# ---------------------------------------------------------------------------- running
def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", on_listen: Callable[[str], None] | None = None) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM; in-flight requests finish first."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    if on_listen is not None:
        original = server.startup

        async def startup(sockets: Any = None) -> None:
            await original(sockets=sockets)
            if server.started:
                on_listen(url_of(host, server))

        server.startup = startup  # type: ignore[method-assign]
    # uvicorn handles SIGINT/SIGTERM (stop listening, finish in-flight requests, lifespan
    # shutdown) and then re-raises the signal; with these no-op handlers underneath, that
    # re-raise returns here, so the caller closes the engine and the process exits 0
    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (see the log above)")


def _ignore(signum: int, frame: Any) -> None:
    """Placeholder handler while uvicorn owns the signals (see :func:`serve`)."""


def url_of(host: str, server: Any) -> str:
    """The URL a uvicorn server listens on (port 0 resolved to the real one)."""
    port = None
    for s in getattr(server, "servers", []) or []:
        for sock in getattr(s, "sockets", []) or []:
            port = sock.getsockname()[1]
            break
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port if port is not None else server.config.port}"
