"""The server's entry points, where callers have always found them.

The front end itself is the package :mod:`pyggspec.serving.http`; this module only
re-exports what the CLI, tests and users call: ``create_app`` (the ASGI app over an
engine), ``ServerConfig``, ``serve`` (uvicorn until SIGINT/SIGTERM) and ``url_of``.
(``pyggspec serve`` looks ``serve`` up here at call time, so a test can replace it on this
module.)
"""

from __future__ import annotations

from pyggspec.serving.http.app import create_app
from pyggspec.serving.http.run import serve, url_of
from pyggspec.serving.http.state import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve", "url_of"]
