"""Moved to :mod:`pyggspec.serving.http.protocol`; this name stays importable for existing
callers (tests/test_server_*.py). Import from the new place."""

from __future__ import annotations

from pyggspec.serving.http.protocol import (
    ERROR_TYPES,
    FLOAT32_MAX,
    MAX_STOP,
    ROLES,
    ApiError,
    GenParams,
    check_known_fields,
    context_error,
    get_bool,
    get_float,
    get_int,
    get_str,
    invalid,
    parse_body,
    parse_gen,
    parse_max_tokens,
    parse_messages,
    parse_prompt,
    parse_sampling,
    parse_stop,
    parse_token_list,
    read_body,
)

__all__ = [
    "ERROR_TYPES",
    "FLOAT32_MAX",
    "MAX_STOP",
    "ROLES",
    "ApiError",
    "GenParams",
    "check_known_fields",
    "context_error",
    "get_bool",
    "get_float",
    "get_int",
    "get_str",
    "invalid",
    "parse_body",
    "parse_gen",
    "parse_max_tokens",
    "parse_messages",
    "parse_prompt",
    "parse_sampling",
    "parse_stop",
    "parse_token_list",
    "read_body",
]
