"""A ggml tensor handle: shape, type, name, and host <-> backend copies.

The handle does not own memory: tensors live in a :class:`~pyggspec.ggml.context.Context`
(metadata) and, once allocated, in a :class:`~pyggspec.ggml.buffer.Buffer` or the
scheduler's compute buffers. The handle keeps its context alive.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pyggspec.ggml import _lib
from pyggspec.ggml.dtypes import GGMLType, numpy_dtype


class Tensor:
    __slots__ = ("__weakref__", "ctx", "ptr")

    def __init__(self, ptr: Any, ctx: Any) -> None:
        self.ptr = ptr
        self.ctx = ctx

    # --- metadata -------------------------------------------------------------
    @property
    def ne(self) -> tuple[int, int, int, int]:
        ne = self.ptr.ne
        return (ne[0], ne[1], ne[2], ne[3])

    @property
    def shape(self) -> tuple[int, ...]:
        """ggml order (ne0 first), trailing 1s dropped (at least one dim)."""
        ne = list(self.ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        return tuple(ne)

    @property
    def nb(self) -> tuple[int, int, int, int]:
        nb = self.ptr.nb
        return (nb[0], nb[1], nb[2], nb[3])

    @property
    def type(self) -> GGMLType:
        return GGMLType(int(self.ptr.type))

    @property
    def name(self) -> str:
        return _lib.ffi.string(self.ptr.name).decode()

    @name.setter
    def name(self, value: str) -> None:
        _lib.lib.ggml_set_name(self.ptr, value.encode()[:63])

    @property
    def nelements(self) -> int:
        ne = self.ne
        return ne[0] * ne[1] * ne[2] * ne[3]

    @property
    def nbytes(self) -> int:
        return int(_lib.lib.ggml_nbytes(self.ptr))

    @property
    def is_contiguous(self) -> bool:
        return bool(_lib.lib.ggml_is_contiguous(self.ptr))

    @property
    def is_allocated(self) -> bool:
        return self.ptr.buffer != _lib.ffi.NULL or self.ptr.data != _lib.ffi.NULL

    @property
    def op(self) -> str:
        return _lib.ffi.string(_lib.lib.ggml_op_desc(self.ptr)).decode()

    def set_input(self) -> Tensor:
        _lib.lib.ggml_set_input(self.ptr)
        return self

    def set_output(self) -> Tensor:
        _lib.lib.ggml_set_output(self.ptr)
        return self

    def named(self, name: str) -> Tensor:
        """Set the name and return self, for ``x = ctx.add(a, b).named("ffn_out-3")``."""
        self.name = name
        return self

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.type.name}, ne={self.shape})"

    # --- data -----------------------------------------------------------------
    def _check_data(self) -> None:
        if not self.is_allocated:
            raise ValueError(f"tensor {self.name!r} has no backend memory yet")

    def set(self, data: np.ndarray | bytes | memoryview, offset: int = 0) -> None:
        """Copy host bytes into the tensor (any backend). Size and bounds are checked."""
        self._check_data()
        if isinstance(data, np.ndarray):
            if not data.flags.c_contiguous:
                data = np.ascontiguousarray(data)
            want = numpy_dtype(self.type)
            if want is not None and data.dtype != want:
                raise TypeError(f"tensor {self.name!r} is {self.type.name}, got {data.dtype}")
        buf = _lib.ffi.from_buffer(data)
        size = len(buf)
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(
                f"write of {size} bytes at {offset} overflows tensor {self.name!r} "
                f"({self.nbytes} bytes)"
            )
        _lib.lib.ggml_backend_tensor_set(self.ptr, buf, offset, size)

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        """Copy the tensor to host. Shape is numpy order (reversed ne) for plain types."""
        self._check_data()
        if not self.is_contiguous:
            raise ValueError(f"tensor {self.name!r} is a strided view; copy it with ctx.cont()")
        dt = numpy_dtype(self.type)
        if out is None:
            if dt is None:
                out = np.empty(self.nbytes, dtype=np.uint8)
            else:
                out = np.empty(tuple(reversed(self.shape)), dtype=dt)
        if out.nbytes != self.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"output array of {out.nbytes} bytes for {self.nbytes}-byte tensor")
        _lib.lib.ggml_backend_tensor_get(self.ptr, _lib.ffi.from_buffer(out), 0, out.nbytes)
        return out

    def get_rows(self, first: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Copy ``count`` rows (ne1 index) starting at ``first`` of a 2-D tensor to host."""
        self._check_data()
        ne0, ne1 = self.ne[0], self.ne[1]
        if first < 0 or count < 0 or first + count > ne1 * self.ne[2] * self.ne[3]:
            raise ValueError(f"rows {first}..{first + count} out of range for {self!r}")
        dt = numpy_dtype(self.type)
        if dt is None:
            raise TypeError("get_rows needs a plain (non-block) type")
        row = self.nb[1]
        if out is None:
            out = np.empty((count, ne0), dtype=dt)
        _lib.lib.ggml_backend_tensor_get(
            self.ptr, _lib.ffi.from_buffer(out), first * row, count * row
        )
        return out

    def zero(self, offset: int = 0, size: int | None = None) -> None:
        """Zero ``size`` bytes from ``offset`` (default: the whole tensor)."""
        self._check_data()
        size = self.nbytes - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(f"zero of {size} bytes at {offset} overflows {self!r}")
        _lib.lib.ggml_backend_tensor_memset(self.ptr, 0, offset, size)

    def read_bytes(self, offset: int, size: int) -> bytearray:
        """Raw bytes [offset, offset+size) of the tensor (any type), e.g. one slot's rows."""
        self._check_data()
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise ValueError(f"read of {size} bytes at {offset} overflows {self!r}")
        out = bytearray(size)
        _lib.lib.ggml_backend_tensor_get(self.ptr, _lib.ffi.from_buffer(out), offset, size)
        return out


class HostBinding:
    """A tensor paired with a fixed host array, so a step's copy is one C call.

    Built once per graph for its inputs and outputs (after checking dtype and size);
    ``push`` writes the array into the tensor, ``pull`` reads the tensor into the array.
    Valid while the tensor's context lives and after the graph was allocated.
    """

    __slots__ = ("_buf", "_n", "_ptr", "array", "tensor")

    def __init__(self, tensor: Tensor, array: np.ndarray) -> None:
        want = numpy_dtype(tensor.type)
        if want is not None and array.dtype != want:
            raise TypeError(f"tensor {tensor.name!r} is {tensor.type.name}, array is {array.dtype}")
        if not array.flags.c_contiguous:
            raise ValueError("host array must be C-contiguous")
        if array.nbytes != tensor.nbytes or not tensor.is_contiguous:
            raise ValueError(f"array of {array.nbytes} bytes for tensor {tensor!r} "
                             f"({tensor.nbytes} bytes)")
        self.tensor = tensor
        self.array = array
        self._buf = _lib.ffi.from_buffer(array)
        self._ptr = tensor.ptr
        self._n = array.nbytes

    def push(self) -> None:
        _lib.lib.ggml_backend_tensor_set(self._ptr, self._buf, 0, self._n)

    def pull(self) -> np.ndarray:
        _lib.lib.ggml_backend_tensor_get(self._ptr, self._buf, 0, self._n)
        return self.array

    def peek(self) -> np.ndarray:
        """The tensor's current contents without a copy when its buffer is host memory (a
        view, valid until that memory is reused, e.g. by the next graph on the same
        scheduler); otherwise :meth:`pull`. Saves copying a vocabulary-wide logits row
        per step on the CPU."""
        t = self._ptr
        buf = t.buffer
        if buf == _lib.ffi.NULL or t.data == _lib.ffi.NULL or \
                not _lib.lib.ggml_backend_buffer_is_host(buf):
            return self.pull()
        return np.frombuffer(_lib.ffi.buffer(t.data, self._n),
                             dtype=self.array.dtype).reshape(self.array.shape)


def tensor_address(t: Tensor) -> int:
    """The address of ``t``'s ggml struct: what :func:`copy_ranges` takes (as int64 array
    entries, so a step's copies are gathered with numpy and made in one C call)."""
    return int(_lib.ffi.cast("intptr_t", t.ptr))


def copy_ranges(src: np.ndarray, src_off: np.ndarray, dst: np.ndarray, dst_off: np.ndarray,
                size: np.ndarray) -> None:
    """Copy byte ranges between tensors' data in one C call: range ``i`` is ``size[i]``
    bytes of the tensor at address ``src[i]`` (:func:`tensor_address`) from byte
    ``src_off[i]`` to the tensor at ``dst[i]`` at ``dst_off[i]``; int64 arrays, any
    backends. The tensors must be allocated and stay so; every range is bounds-checked
    before anything is copied."""
    arrs = [np.ascontiguousarray(a, dtype=np.int64) for a in (src, src_off, dst, dst_off, size)]
    n = len(arrs[0])
    if any(len(a) != n for a in arrs):
        raise ValueError("copy_ranges: arrays of different lengths")
    if n == 0:
        return
    ffi = _lib.ffi
    rc = _lib.lib.pyggspec_copy_ranges(
        n, ffi.cast("intptr_t *", ffi.from_buffer(arrs[0])),
        ffi.cast("int64_t *", ffi.from_buffer(arrs[1])),
        ffi.cast("intptr_t *", ffi.from_buffer(arrs[2])),
        ffi.cast("int64_t *", ffi.from_buffer(arrs[3])),
        ffi.cast("int64_t *", ffi.from_buffer(arrs[4])))
    if rc != 0:
        raise ValueError(f"copy_ranges: range {-1 - rc} is outside its tensors or one is "
                         "not allocated")


def place(t: Tensor, base: Tensor, offset: int) -> tuple:
    """Make the node ``t`` live at byte ``offset`` of ``base``'s memory (a state tensor),
    so that the op computing it writes there and ggml's allocator leaves it out of the
    compute buffer. ``base`` on a placeholder buffer (graph sizing): ``t`` is attached to
    that buffer, which counts as allocated there for the allocator too. Returns what
    :func:`place_again` needs to redo it without the checks, after every re-allocation
    of ``t``'s graph (which forgets where its tensors were)."""
    if not t.is_contiguous or offset < 0 or offset + t.nbytes > base.nbytes:
        raise ValueError(f"cannot place {t.name} ({t.nbytes} bytes) at byte {offset} of "
                         f"{base.name} ({base.nbytes} bytes)")
    ffi = _lib.ffi
    b = base.ptr
    if b.buffer == ffi.NULL:
        raise ValueError(f"cannot place {t.name}: {base.name} is not allocated")
    # a placeholder has no data: the node is only attached to its buffer
    addr = ffi.NULL if b.data == ffi.NULL else ffi.cast("char *", b.data) + offset
    entry = (t.ptr, b.buffer, addr)
    place_again([entry])
    return entry


def place_again(entries: list[tuple]) -> None:
    """Redo :func:`place` for its returned entries: a graph re-allocated after another
    ran places its pinned nodes again (90 of them in a 4 x 4 verify graph: 0.065 ms,
    where placing them with the checks took 0.41 ms on the AVX2 bench host)."""
    ffi, lib = _lib.ffi, _lib.lib
    null, ok, alloc = ffi.NULL, lib.GGML_STATUS_SUCCESS, lib.ggml_backend_tensor_alloc
    for p, buf, addr in entries:
        p.data = null
        p.buffer = null
        if addr == null:
            p.buffer = buf
        elif alloc(buf, p, addr) != ok:
            raise ValueError(f"cannot place {ffi.string(p.name).decode()} in its state tensor")
