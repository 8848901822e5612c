"""pyggspec: Qwen3.5/3.6 GGUF inference and MTP speculative decoding on ggml, driven from Python.

The public API is what this package exports (``__all__``); everything else is an
implementation module that may change. A first generation::

    from pyggspec import Engine, SamplingParams, SpecConfig

    with Engine("model.gguf", spec_type="draft-mtp") as engine:
        result = engine.generate("The capital of France is", max_tokens=32)
        print(result.text, result.timings.to_dict(), result.spec.to_dict())

Main names:

- :class:`Engine` -- a loaded model: ``generate`` / ``stream`` / ``generate_batch`` /
  ``submit`` / ``eval``; its keyword arguments are the fields of :class:`EngineConfig`.
- :class:`SpecConfig` -- speculation settings (draft cap, rollback, drafting mode);
  :class:`SamplingParams` -- the sampler chain (llama.cpp's names and defaults).
- :class:`Result`, :class:`Generation`, :class:`Piece`, :class:`Stream` -- what
  generation returns; :class:`Request` / :class:`RequestHandle` -- the queued form.
- :func:`run_bench` -- plain decoding against speculation on your model and device
  (``pyggspec bench``); :func:`demo_model` -- the built-in synthetic demo GGUF.
- :func:`inspect_model` -- what a GGUF is and what an engine would allocate for it;
  :func:`create_app` -- the OpenAI-compatible ASGI app of ``pyggspec serve``.
- :class:`PyggspecError` (one-line errors), :class:`ConfigError`, :class:`GrammarError`.

Names are imported on first use, so ``import pyggspec`` stays cheap (the CLI starts fast
and nothing loads ggml until an engine is built). Docs: ``docs/python.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyggspec.errors import PyggspecError

__version__ = "0.1.0"

# public name -> the module that defines it (imported lazily by __getattr__)
_EXPORTS: dict[str, str] = {
    "Engine": "pyggspec.engine",
    "Stream": "pyggspec.engine",
    "Piece": "pyggspec.engine",
    "SlotFileResult": "pyggspec.engine",
    "EngineConfig": "pyggspec.config",
    "SpecConfig": "pyggspec.config",
    "ConfigError": "pyggspec.config",
    "SamplingParams": "pyggspec.sampling.params",
    "GrammarError": "pyggspec.sampling.grammar",
    "Request": "pyggspec.serving.request",
    "RequestHandle": "pyggspec.serving.request",
    "Result": "pyggspec.serving.request",
    "Generation": "pyggspec.serving.request",
    "RequestTimings": "pyggspec.serving.request",
    "TokenLogprob": "pyggspec.serving.sequence",
    "SpecStats": "pyggspec.speculative.stats",
    "inspect_model": "pyggspec.inspect",
    "demo_model": "pyggspec.demo",
    "run_bench": "pyggspec.benchmark",
    "BenchReport": "pyggspec.benchmark",
    "create_app": "pyggspec.serving.server",
}

__all__ = [
    "BenchReport", "ConfigError", "Engine", "EngineConfig", "Generation", "GrammarError",
    "Piece", "PyggspecError", "Request", "RequestHandle", "RequestTimings", "Result",
    "SamplingParams", "SlotFileResult", "SpecConfig", "SpecStats", "Stream", "TokenLogprob",
    "__version__", "create_app", "demo_model", "inspect_model", "run_bench",
]

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time __getattr__ imports
    from pyggspec.benchmark import BenchReport, run_bench
    from pyggspec.config import ConfigError, EngineConfig, SpecConfig
    from pyggspec.demo import demo_model
    from pyggspec.engine import Engine, Piece, SlotFileResult, Stream
    from pyggspec.inspect import inspect_model
    from pyggspec.sampling.grammar import GrammarError
    from pyggspec.sampling.params import SamplingParams
    from pyggspec.serving.request import (
        Generation,
        Request,
        RequestHandle,
        RequestTimings,
        Result,
    )
    from pyggspec.serving.sequence import TokenLogprob
    from pyggspec.serving.server import create_app
    from pyggspec.speculative.stats import SpecStats


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it in the module."""
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyggspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
