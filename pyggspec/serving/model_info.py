"""Moved to :mod:`pyggspec.serving.http.model_info`; this name stays importable for existing
callers (tests/test_server_*.py). Import from the new place."""

from __future__ import annotations

from pyggspec.serving.http.model_info import (
    FTYPE_GUESSED,
    FTYPE_NAMES,
    VOCAB_TYPES,
    ModelInfo,
    ftype_name,
)

__all__ = [
    "FTYPE_GUESSED",
    "FTYPE_NAMES",
    "VOCAB_TYPES",
    "ModelInfo",
    "ftype_name",
]
