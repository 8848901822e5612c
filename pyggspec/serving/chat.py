"""Moved to :mod:`pyggspec.serving.http.chat`; this name stays importable for existing
callers (tests/test_server_*.py). Import from the new place."""

from __future__ import annotations

from pyggspec.serving.http.chat import (
    CHATML,
    ChatTemplate,
    parse_template_kwargs,
)

__all__ = [
    "CHATML",
    "ChatTemplate",
    "parse_template_kwargs",
]
