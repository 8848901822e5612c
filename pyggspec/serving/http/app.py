"""``create_app``: the FastAPI app over an engine's scheduler, its error answers and its gate.

One app per model. Handlers parse and validate the request (HTTP 400 with an OpenAI-style
error body for anything wrong, never a 500), tokenize it, and submit it to the engine's
:class:`~pyggspec.serving.scheduler.Scheduler`, whose single background thread is the only
one touching ggml (mlx-lm's server pattern). ``--api-key`` guards every endpoint but
``/health`` (``Authorization: Bearer KEY`` or ``X-Api-Key``). An unknown path or method,
and a bug in pyggspec, are answered with the same error body; the connection stays usable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyggspec.serving.http import (
    anthropic_api,
    completions,
    infill,
    responses_api,
    routes,
    slot_actions,
    vertex,
)
from pyggspec.serving.http.protocol import ApiError
from pyggspec.serving.http.state import ServerConfig, ServerState

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.engine import Engine

log = logging.getLogger("pyggspec.serve")

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


def create_app(engine: Engine, config: ServerConfig | None = None, *,
               max_queue: int | None = None, manage_scheduler: bool = True) -> FastAPI:
    """The ASGI app over an :class:`~pyggspec.engine.Engine` (requests go through its
    :class:`~pyggspec.serving.scheduler.Scheduler`, whose thread owns the engine).

    ``manage_scheduler``: start the scheduler's thread when the app starts and stop it
    (draining) when the app shuts down. ``max_queue`` sets the scheduler's waiting-queue
    limit (``--max-queue``; more requests get HTTP 503).
    """
    scheduler = engine.scheduler
    if max_queue is not None:
        scheduler.max_queue = max_queue
    if config is None:
        path = Path(engine.model_path)
        config = ServerConfig(model_id=path.name, model_path=str(path),
                              sampling=engine.sampling)
    state = ServerState(engine, config)

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
    _install_errors(app)
    app.add_middleware(Gate, state=state)
    routes.install(app, state)
    completions.install(app, state)
    responses_api.install(app, state)
    anthropic_api.install(app, state)
    infill.install(app, state)
    slot_actions.install(app, state)
    if config.vertex is not None:  # last: /predict dispatches to every route above
        vertex.install(app, config.vertex)
    return app


def error_response(e: ApiError) -> JSONResponse:
    """The JSON answer for ``e`` (499, a client that left, is sent as 400)."""
    return JSONResponse(e.body(), status_code=e.status if e.status != 499 else 400)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        if e.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, e.message)
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = ("no such endpoint: " + request.url.path if e.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}"
               if e.status_code == 405 else str(e.detail))
        return error_response(ApiError(e.status_code, msg))


class Gate:
    """Pure ASGI middleware: the API key check (every path but /health) and the per-route
    request counts for /metrics. Not Starlette's BaseHTTPMiddleware, which would relay
    every streamed chunk through an extra task and memory stream."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self.key = key.encode() if key else None
        health = state.config.vertex and state.config.vertex.health_route
        self.public = PUBLIC_PATHS | {health} if health else PUBLIC_PATHS

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and scope["path"] not in self.public:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
            given = given.removeprefix(b"Bearer ").strip()
            if given != self.key:
                self.state.metrics.count_request("unauthorized", 401)
                await error_response(ApiError(401, "Invalid API Key"))(scope, receive, send)
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
            await error_response(err)(scope, receive, send)
        finally:
            route = scope.get("route")
            self.state.metrics.count_request(getattr(route, "path", "unmatched"), status[0])
