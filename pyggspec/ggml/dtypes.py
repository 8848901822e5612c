"""ggml tensor types as a Python enum, usable without loading the binding.

The numeric values are ggml's ``enum ggml_type`` (also the GGUF on-disk type ids); the
binding checks at load time that the names agree with the compiled library.
"""

from __future__ import annotations

import enum

import numpy as np


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42

    @classmethod
    def parse(cls, value: str | int | GGMLType) -> GGMLType:
        """Accept ``"q8_0"``, ``"Q8_0"``, ``8`` or a member; raise ValueError otherwise."""
        if isinstance(value, GGMLType):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(f"unknown ggml type {value!r}") from None

    @property
    def lower(self) -> str:
        return self.name.lower()


_NUMPY = {
    GGMLType.F32: np.float32,
    GGMLType.F16: np.float16,
    GGMLType.I8: np.int8,
    GGMLType.I16: np.int16,
    GGMLType.I32: np.int32,
    GGMLType.I64: np.int64,
    GGMLType.F64: np.float64,
}


def numpy_dtype(t: GGMLType) -> np.dtype | None:
    """The numpy dtype holding one element of ``t``, or None for block/quantized types."""
    dt = _NUMPY.get(t)
    return np.dtype(dt) if dt is not None else None


def from_numpy(dtype: np.dtype) -> GGMLType:
    for t, dt in _NUMPY.items():
        if np.dtype(dt) == dtype:
            return t
    raise ValueError(f"no ggml type for numpy dtype {dtype}")
