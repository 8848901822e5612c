"""Vertex AI prediction mode (``AIP_MODE=PREDICTION``), as llama-server has it.

Google's custom-container contract: the platform sets ``AIP_MODE=PREDICTION``, the port
(``AIP_HTTP_PORT``, which wins over ``--port``), the prediction route (``AIP_PREDICT_ROUTE``,
default ``/predict``) and optionally a health route (``AIP_HEALTH_ROUTE``). A prediction is
``{"instances": [...]}``; each instance names the endpoint it is for in ``@requestFormat``
(a camelCase alias of a path, ``chatCompletions`` for ``/v1/chat/completions``, or the path
itself) and carries that endpoint's body. The answer is ``{"predictions": [...]}`` in the
same order: each endpoint's JSON answer, or its error body; one bad instance never fails
the others.

Why through the ASGI app and not by calling handlers: every instance then gets exactly what
a direct request gets (validation, API key, metrics, error bodies, the client leaving
cancels its generation), with no second copy of any endpoint's code. Instances run
concurrently, so several chat instances share the scheduler's batch as parallel requests do.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route

from pyggspec.serving.http.protocol import ApiError, invalid, read_body

log = logging.getLogger("pyggspec.serve")

MAX_INSTANCES = 128  # llama-server's limit per prediction


@dataclass(frozen=True)
class VertexAI:
    """The ``AIP_*`` settings of prediction mode."""

    port: int = 8080
    predict_route: str = "/predict"
    health_route: str | None = None  # an extra GET route answering as /health

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> VertexAI | None:
        """The settings when ``env`` asks for prediction mode, else None. A bad
        ``AIP_HTTP_PORT`` raises ValueError naming it."""
        if env.get("AIP_MODE", "") != "PREDICTION":
            return None
        port_text = env.get("AIP_HTTP_PORT") or "8080"
        try:
            port = int(port_text)
        except ValueError:
            port = -1
        if not 0 <= port <= 65535:
            raise ValueError(f"AIP_HTTP_PORT={port_text!r}: not a port number")
        return cls(port=port, predict_route=_route(env.get("AIP_PREDICT_ROUTE")) or "/predict",
                   health_route=_route(env.get("AIP_HEALTH_ROUTE")))


def _route(value: str | None) -> str | None:
    if not value:
        return None
    return value if value.startswith("/") else "/" + value


def request_format(path: str) -> str:
    """The camelCase alias of ``path``: ``/v1/chat/completions`` -> ``chatCompletions``,
    ``/apply-template`` -> ``applyTemplate`` (llama-server's spelling rule)."""
    s = path.removeprefix("/v1") if path.startswith("/v1/") else path
    words = [w for w in s.replace("-", "/").replace("_", "/").split("/") if w]
    return "".join(w if i == 0 else w[:1].upper() + w[1:] for i, w in enumerate(words))


def _static_routes(app: FastAPI) -> dict[str, str]:
    """Every fixed path of ``app`` -> the method an instance is sent with (POST where the
    path takes it, else its first method)."""
    out: dict[str, str] = {}
    for r in app.routes:
        if isinstance(r, Route) and "{" not in r.path and r.methods:
            methods = sorted(r.methods - {"HEAD"})
            if methods:
                out.setdefault(r.path, "POST" if "POST" in methods else methods[0])
    return out


def install(app: FastAPI, vertex: VertexAI) -> None:
    """Add the prediction route (and the health alias) to ``app``, after all other routes.
    A prediction route that is already an endpoint raises ValueError."""
    paths = _static_routes(app)
    if vertex.predict_route in paths:
        raise ValueError(f"AIP_PREDICT_ROUTE={vertex.predict_route} conflicts with an "
                         "existing endpoint")
    aliases: dict[str, str] = {}
    for path in paths:  # the first path wins an alias, as in llama-server
        aliases.setdefault(request_format(path), path)
    if vertex.health_route and vertex.health_route not in paths:
        health = next(r for r in app.routes if isinstance(r, Route) and r.path == "/health")
        app.add_api_route(vertex.health_route, health.endpoint, methods=["GET"])

    @app.post(vertex.predict_route)
    async def predict(request: Request) -> JSONResponse:
        body = await read_body(request)
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise invalid("request body must include an array field named instances",
                          "instances")
        if len(instances) > MAX_INSTANCES:
            raise invalid(f"instances array exceeds maximum size of {MAX_INSTANCES}",
                          "instances")
        jobs = [_predict_one(app, request, inst, aliases, paths) for inst in instances]
        return JSONResponse({"predictions": list(await asyncio.gather(*jobs))})


async def _predict_one(app: FastAPI, request: Request, instance: Any,
                       aliases: Mapping[str, str], paths: Mapping[str, str]) -> Any:
    """One instance's answer: the endpoint's JSON body (its text if not JSON), or an error
    body."""
    if not isinstance(instance, dict):
        return ApiError(400, "each instance must be a JSON object").body()
    fmt = instance.get("@requestFormat")
    if not isinstance(fmt, str):
        return ApiError(400, "each instance must include a string @requestFormat").body()
    path = aliases.get(fmt) or (fmt if fmt in paths else None)
    if path is None:
        return ApiError(400, f"no handler registered for @requestFormat: {fmt}").body()
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:  # one JSON answer per instance: streaming has no place here
        log.warning("/predict: ignoring an instance's stream field")
        payload["stream"] = False
    data = await _call(app, request, paths[path], path, json.dumps(payload).encode())
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


async def _call(app: FastAPI, outer: Request, method: str, path: str, body: bytes) -> bytes:
    """Send ``body`` to ``path`` through the whole app, as a request of the same client
    (its headers, so its API key; its disconnect, so leaving cancels the work); its answer's
    body (an error's too: the status is in it)."""
    headers = [(k, v) for k, v in outer.scope["headers"]
               if k not in (b"content-length", b"content-type", b"transfer-encoding")]
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]
    scope = {k: v for k, v in outer.scope.items()
             if k in ("type", "asgi", "http_version", "scheme", "server", "client",
                      "root_path", "state", "extensions")}
    scope.update(method=method, path=path, raw_path=path.encode(), query_string=b"",
                 headers=headers)
    sent = [False]

    async def receive() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await outer.receive()  # the real client's disconnect

    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return b"".join(chunks)
