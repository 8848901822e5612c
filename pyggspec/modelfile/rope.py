"""RoPE scaling as llama.cpp applies it to ``qwen35`` / ``qwen35moe`` from the GGUF alone.

llama.cpp splits this in two: the model loader reads ``rope.scaling.type``, ``.factor``,
``.original_context_length`` and ``.attn_factor`` (``llama_model_base::load_hparams``), and the
context turns them into the numbers every ``ggml_rope_multi`` call takes (``llama_context``'s
constructor: ``ext_factor``, ``attn_factor``, ``beta_fast`` / ``beta_slow``, ``n_ctx_orig``).
:func:`resolve` is that second step with the user-facing context parameters left at their
defaults, in float32 like llama.cpp, so our rope nodes get bit-identical arguments.

The qwen35 loaders do not read the YaRN tuning keys (``yarn_ext_factor``, ``yarn_attn_factor``,
``yarn_beta_fast``, ``yarn_beta_slow``, ``yarn_log_multiplier``) nor use ``rope.scaling.alpha``:
llama.cpp runs its defaults whatever they say. :func:`unread_key_values` gives the value each
such key would need to mean what is run, so a file that asks for something else is refused
instead of being run differently from what it says.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's accepted names
SCALING_IMPLEMENTED = ("none", "linear", "yarn")
YARN_BETA_FAST = 32.0  # llama_hparams defaults (qwen35 reads no key for them)
YARN_BETA_SLOW = 1.0

_F = np.float32


@dataclass(frozen=True)
class RopeParams:
    """The scalar arguments of one ``ggml_rope_multi`` call (names as in ``Context.rope_multi``)."""

    n_ctx_orig: int
    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float

    def kwargs(self) -> dict[str, Any]:
        return asdict(self)


def _logf(x: np.float32) -> np.float32:
    return _F(math.log(float(x)))


def _yarn_mscale(factor: np.float32) -> np.float32:
    """HF/llama.cpp ``get_mscale(factor, 1)``: 1 + 0.1 ln(factor), 1 for factor <= 1."""
    return _F(1.0) if factor <= 1 else _F(_F(0.1) * _logf(factor)) + _F(1.0)


def resolve(scaling_type: str, freq_base: float, freq_scale_train: float, attn_factor: float,
            n_ctx_orig: int) -> RopeParams:
    """llama.cpp's context defaults for a GGUF-driven rope (no --rope-* / --yarn-* overrides).

    ``freq_scale_train`` is 1/factor; type ``none`` never scales. YaRN: ``ext_factor`` 1 and
    an ``attn_factor`` that cancels the ``1 + 0.1 ln(1/freq_scale)`` ggml multiplies in
    itself, so the net magnitude scale is ``get_mscale(factor) * rope.scaling.attn_factor``.
    The attention's KQ scale stays 1/sqrt(head_dim) (qwen35 reads no attention.scale).
    """
    fs = _F(1.0) if scaling_type == "none" else _F(freq_scale_train)
    ext = 1.0 if scaling_type == "yarn" else 0.0
    af = _F(1.0)
    if ext != 0.0:
        factor = _F(_F(1.0) / fs)
        af = _yarn_mscale(factor)
        af = _F(af * _F(_F(1.0) / _F(_F(1.0) + _F(_F(0.1) * _logf(factor)))))
    af = _F(af * _F(attn_factor))
    return RopeParams(n_ctx_orig=int(n_ctx_orig), freq_base=float(_F(freq_base)),
                      freq_scale=float(fs), ext_factor=ext, attn_factor=float(af),
                      beta_fast=YARN_BETA_FAST, beta_slow=YARN_BETA_SLOW)


def unread_key_values(scaling_type: str, freq_scale_train: float,
                      attn_factor: float) -> dict[str, float]:
    """Suffix (after ``<arch>.``) -> the value that key must have to mean what llama.cpp runs."""
    yarn = scaling_type == "yarn"
    total = float(_yarn_mscale(_F(_F(1.0) / _F(freq_scale_train)))) if yarn else 1.0
    return {
        "rope.scaling.yarn_ext_factor": 1.0 if yarn else 0.0,
        # HF ``attention_factor``: the whole magnitude scale of the rotated dims
        "rope.scaling.yarn_attn_factor": total * attn_factor,
        "rope.scaling.yarn_beta_fast": YARN_BETA_FAST,
        "rope.scaling.yarn_beta_slow": YARN_BETA_SLOW,
        "rope.scaling.yarn_log_multiplier": 0.0,
        "rope.scaling.alpha": 0.0,
    }
