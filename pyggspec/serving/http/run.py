"""Running the app: :func:`serve` (uvicorn, graceful shutdown) and :func:`url_of`.

On SIGTERM/SIGINT uvicorn stops accepting connections, lets in-flight requests finish
(streams included), then runs the app's lifespan shutdown, which stops the scheduler.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from typing import Any


def serve(app: Any, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", on_listen: Callable[[str], None] | None = None) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM; in-flight requests finish first.
    ``host`` may list several addresses, comma-separated (llama-server's ``--host``), all
    on ``port``. ``on_listen(url)`` is called once the sockets listen (port 0 resolved)."""
    import uvicorn

    hosts = [h.strip() for h in host.split(",") if h.strip()] or ["127.0.0.1"]
    host = hosts[0]
    sockets = _bind(hosts, port) if len(hosts) > 1 else None
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
        server.run(sockets=sockets)
    finally:
        for sock in sockets or ():
            sock.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if not server.started:
        raise OSError(f"could not listen on {host}:{port} (see the log above)")


def _bind(hosts: list[str], port: int) -> list[socket.socket]:
    """Listening sockets on every address (IPv6 ones in brackets or not), one port: the
    first socket's when ``port`` is 0. Fails before anything is served if one cannot bind."""
    out: list[socket.socket] = []
    try:
        for h in hosts:
            h = h.strip("[]")
            family = socket.AF_INET6 if ":" in h else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((h, port))
            except OSError as e:
                raise OSError(f"could not listen on {h}:{port} ({e.strerror or e})") from None
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


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
