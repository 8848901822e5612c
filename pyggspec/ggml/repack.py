"""The CPU device's extra buffer types (weight repacking) and the question "may this weight
live in one?".

ggml's CPU backend can keep matrix weights in a re-laid-out form (``CPU_REPACK``: interleaved
rows for its GEMV/GEMM kernels; ``AMX``: tiles for Intel AMX). A tensor is moved there at
load: writing it into such a buffer repacks it, so it must be written whole, once. Whether
ggml can run a given weight from a given buffer type is asked of ggml itself, the way
llama.cpp's loader asks: the op that will use the weight is built with the weight sitting in
an empty buffer of that type, and the CPU device says whether it supports that op.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggspec.ggml import _lib
from pyggspec.ggml.context import Context
from pyggspec.ggml.device import Device
from pyggspec.ggml.dtypes import GGMLType

_GET_EXTRA = "ggml_backend_dev_get_extra_bufts"
_FN_TYPE = "ggml_backend_buffer_type_t * (*)(ggml_backend_dev_t)"


@dataclass(frozen=True)
class BufferType:
    """One extra buffer type of a device (raw ggml pointer + its name)."""

    name: str
    ptr: object

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BufferType) and other.name == self.name


def extra_buffer_types(dev: Device) -> list[BufferType]:
    """The extra buffer types ``dev``'s backend offers (CPU: e.g. AMX, CPU_REPACK), in
    ggml's order of preference; empty where the backend has none."""
    lib, ffi = _lib.lib, _lib.ffi
    reg = lib.ggml_backend_dev_backend_reg(dev.ptr)
    if reg == ffi.NULL:
        return []
    fn = lib.ggml_backend_reg_get_proc_address(reg, _GET_EXTRA.encode())
    if fn == ffi.NULL:
        return []
    arr = ffi.cast(_FN_TYPE, fn)(dev.ptr)
    out: list[BufferType] = []
    i = 0
    while arr != ffi.NULL and arr[i] != ffi.NULL:
        out.append(BufferType(ffi.string(lib.ggml_backend_buft_name(arr[i])).decode(), arr[i]))
        i += 1
    return out


_supported: dict[tuple[str, int, tuple[int, ...]], bool] = {}


def supports_weight(dev: Device, buft: BufferType, type_: GGMLType | int,
                    shape: tuple[int, ...], n_tokens: int = 512) -> bool:
    """Can ``dev`` multiply by a weight of ``type_``/``shape`` (ggml order: ne) held in
    ``buft``? 2-D weights are asked with MUL_MAT, 3-D (experts) with MUL_MAT_ID.

    Cached per (buffer type, type, shape): ggml's answer depends on nothing else.
    """
    key = (buft.name, int(type_), tuple(shape))
    hit = _supported.get(key)
    if hit is not None:
        return hit
    lib, ffi = _lib.lib, _lib.ffi
    ok = False
    if len(shape) in (2, 3):
        with Context(8) as ctx:
            w = ctx.new_tensor(type_, shape, "probe.weight")
            if len(shape) == 2:
                x = ctx.new_tensor(GGMLType.F32, (shape[0], n_tokens), "probe.x")
                op = ctx.mul_mat(w, x)
            else:
                n_used = min(2, shape[2])
                x = ctx.new_tensor(GGMLType.F32, (shape[0], n_used, n_tokens), "probe.x")
                ids = ctx.new_tensor(GGMLType.I32, (n_used, n_tokens), "probe.ids")
                op = ctx.mul_mat_id(w, x, ids)
            dummy = lib.ggml_backend_buft_alloc_buffer(buft.ptr, 0)
            if dummy != ffi.NULL:
                try:
                    w.ptr.buffer = dummy
                    ok = bool(lib.ggml_backend_dev_supports_op(dev.ptr, op.ptr))
                finally:
                    w.ptr.buffer = ffi.NULL
                    lib.ggml_backend_buffer_free(dummy)
    _supported[key] = ok
    return ok

