"""CORS as llama-server does it (``tools/server/server-http.cpp``, its pre-routing handler),
so a browser UI that talks to llama-server talks to ``pyggspec serve`` the same way.

llama-server sends CORS headers by default (``--cors-origins '*'`` with credentials): the
request's ``Origin`` is echoed back. ``localhost`` reflects only a localhost origin; a list
of origins allows those (llama-server writes the list itself into the header, which a
browser accepts only for a single origin; reflecting the matching one is what it means).
Every ``OPTIONS`` request is a preflight: answered 200 with an empty body and the allowed
credentials, methods and headers, before the API key is checked (browsers send no
``Authorization`` on a preflight). A pure ASGI middleware, outermost, so that error answers
(401s included) carry the headers too. Header names are sent in llama-server's casing
(HTTP does not care; clients that read a plain dict of headers, as llama.cpp's tests do,
do).
"""

from __future__ import annotations

import re
from typing import Any

METHODS = "GET, POST, DELETE, OPTIONS"  # llama-server's --cors-methods default
_LOCALHOST = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?$")


class Cors:
    """``Access-Control-*`` headers on every response; OPTIONS answered here."""

    def __init__(self, app: Any, origins: str = "*", methods: str = METHODS,
                 headers: str = "*", credentials: bool = True) -> None:
        self.app = app
        self.origins = origins.strip()
        self.allowed = {o.strip() for o in origins.split(",") if o.strip()}
        self.methods = methods
        self.headers = headers
        self.credentials = credentials

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request's Origin (None: none)."""
        if self.origins == "*":
            return (origin or "") if self.credentials else "*"
        if self.origins == "localhost":
            return origin if origin and _LOCALHOST.match(origin) else None
        return origin if origin is not None and origin in self.allowed else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = None
        for k, v in scope["headers"]:
            if k == b"origin":
                origin = v.decode("latin-1")
        allow = self.allow_origin(origin)
        extra = [] if allow is None else [(b"Access-Control-Allow-Origin",
                                           allow.encode("latin-1"))]
        if scope["method"] == "OPTIONS":
            extra += [(b"Access-Control-Allow-Credentials",
                       b"true" if self.credentials else b"false"),
                      (b"Access-Control-Allow-Methods", self.methods.encode("latin-1")),
                      (b"Access-Control-Allow-Headers", self.headers.encode("latin-1")),
                      (b"content-type", b"text/html"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
