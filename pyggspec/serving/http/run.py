"""Running the app: :func:`serve` (uvicorn, graceful shutdown) and :func:`url_of`.

On SIGTERM/SIGINT uvicorn stops accepting connections, lets in-flight requests finish
(streams included), then runs the app's lifespan shutdown, which stops the scheduler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def serve(app: Any, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", on_listen: Callable[[str], None] | None = None) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM; in-flight requests finish first.
    ``on_listen(url)`` is called once the socket listens (port 0 resolved)."""
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
