"""Moved to :mod:`pyggspec.serving.http.template_caps`; this name stays importable for existing
callers (tests/test_server_*.py). Import from the new place."""

from __future__ import annotations

from pyggspec.serving.http.template_caps import (
    Render,
    probe_caps,
)

__all__ = [
    "Render",
    "probe_caps",
]
