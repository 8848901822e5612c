"""Test-only allocation faults: make the n-th allocation of a kind fail as if the device
had run out of memory, so that the error paths (a one-line error at start-up, one failed
request at run time) can be tested without exhausting a real device.

Off unless asked for. Set once in the environment, read at import:
``PYGGSPEC_TEST_ALLOC_FAIL=KIND[:N]`` fails the N-th (default 1st) allocation whose
description starts with KIND: ``weights``, ``kv``, ``mtp-kv``, ``recurrent``,
``sampling`` (buffer labels, e.g. ``kv on CPU``), ``compute`` (the compute buffers
reserved at start-up) or ``graph`` (a graph allocated at run time).
In-process tests call :func:`inject` / :func:`reset` instead. Never set it in production:
it exists only to exercise failure handling.
"""

from __future__ import annotations

import os
import threading

ENV = "PYGGSPEC_TEST_ALLOC_FAIL"

_lock = threading.Lock()
_kind: str | None = None
_left = 0
hits: list[str] = []  # what was made to fail, for the tests to check


def inject(kind: str, nth: int = 1) -> None:
    """Fail the ``nth`` allocation from now whose description starts with ``kind``."""
    global _kind, _left
    if nth < 1:
        raise ValueError(f"nth must be >= 1, got {nth}")
    with _lock:
        _kind, _left = kind, nth


def reset() -> None:
    """No injected fault any more."""
    global _kind, _left
    with _lock:
        _kind, _left = None, 0
        hits.clear()


def should_fail(what: str) -> bool:
    """Called at each allocation with its description: True when this one is to fail
    (once; the fault is spent). One attribute test when no fault is armed."""
    global _kind, _left
    if _kind is None:
        return False
    with _lock:
        if _kind is None or not what.startswith(_kind):
            return False
        _left -= 1
        if _left > 0:
            return False
        _kind = None
        hits.append(what)
        return True


def _from_env(value: str) -> None:
    kind, _, n = value.partition(":")
    try:
        inject(kind, int(n) if n else 1)
    except ValueError:
        raise SystemExit(f"pyggspec: {ENV}={value!r}: expected KIND[:N] with N >= 1") from None


if os.environ.get(ENV):
    _from_env(os.environ[ENV])
