"""Moved to :mod:`pyggspec.serving.http.metrics`; this name stays importable for existing
callers (tests/test_server_*.py). Import from the new place."""

from __future__ import annotations

from pyggspec.serving.http.metrics import (
    PREFIX,
    Metric,
    ServeMetrics,
    prometheus_text,
    render,
)

__all__ = [
    "PREFIX",
    "Metric",
    "ServeMetrics",
    "prometheus_text",
    "render",
]
