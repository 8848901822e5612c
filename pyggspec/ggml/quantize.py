"""Quantize float32 rows to any ggml type with ggml's own quantizer (for test fixtures and
inspection scripts: the bytes are exactly what llama-quantize would write for that type)."""

from __future__ import annotations

import numpy as np

from pyggspec.ggml import _lib
from pyggspec.ggml.dtypes import GGMLType


def quantize_rows(type_: GGMLType | int, rows: np.ndarray) -> bytes:
    """``rows``: float32 [n_rows, n_per_row] (n_per_row a multiple of the type's block)."""
    lib, ffi = _lib.lib, _lib.ffi
    t = int(type_)
    a = np.ascontiguousarray(rows, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"quantize_rows wants a 2-D array, got shape {a.shape}")
    n_rows, n_per_row = a.shape
    blck = int(lib.ggml_blck_size(t))
    if n_per_row % blck:
        raise ValueError(f"rows of {n_per_row} values do not split into blocks of {blck}")
    if lib.ggml_quantize_requires_imatrix(t):
        raise ValueError(f"{GGMLType(t).name} needs an importance matrix")
    out = bytearray(int(lib.ggml_row_size(t, n_per_row)) * n_rows)
    dst = ffi.from_buffer(out)
    n = lib.ggml_quantize_chunk(t, ffi.cast("const float *", a.ctypes.data), dst, 0, n_rows,
                                n_per_row, ffi.NULL)
    if n != len(out):
        raise RuntimeError(f"ggml wrote {n} bytes, expected {len(out)}")
    return bytes(out)


def quantizable(type_name: str) -> tuple[bool, str]:
    """Whether ggml can quantize float rows to ``type_name`` without an importance matrix;
    the reason when not."""
    from pyggspec.modelfile import ggml_type

    try:
        t = ggml_type(type_name)
    except Exception:  # noqa: BLE001 - an unknown name
        return False, f"unknown ggml type {type_name!r}"
    lib = _lib.lib
    if lib.ggml_quantize_requires_imatrix(t.id):
        return False, f"{t.name} needs an importance matrix"
    if not lib.ggml_is_quantized(t.id) and t.name.lower() not in ("f16", "bf16", "f32"):
        return False, f"{t.name} is not a weight type"
    return True, ""
