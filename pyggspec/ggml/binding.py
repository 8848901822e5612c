"""Loading the binding on purpose, for code outside this package that shares ggml with
another user of it (``llama_cpp`` in the test oracle, :mod:`pyggspec.testing.oracle`): once
:func:`load` has run, ggml's switches for known-broken devices (:mod:`pyggspec.ggml.quirks`)
are set, before that other user can initialise a device. Everything else loads the binding
on first use and never needs this."""

from __future__ import annotations


def load() -> None:
    """Build (if needed) and load the compiled extension; idempotent."""
    from pyggspec.ggml import _lib

    _lib.native()
