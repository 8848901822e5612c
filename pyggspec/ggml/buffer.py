"""Backend buffers: the device memory that holds weights, caches and states."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from pyggspec.errors import DeviceError, OutOfMemory
from pyggspec.ggml import _lib, faults, hugepages
from pyggspec.ggml.context import Context
from pyggspec.ggml.device import Device
from pyggspec.ggml.tensor import Tensor

if TYPE_CHECKING:
    from pyggspec.ggml.repack import BufferType

USAGE_ANY = 0
USAGE_WEIGHTS = 1
USAGE_COMPUTE = 2


class Buffer:
    """Owns a ``ggml_backend_buffer``; ``close()`` frees the device memory."""

    def __init__(self, ptr, device: Device, label: str = "") -> None:
        self.ptr = ptr
        self.device = device
        self.label = label
        self.huge_bytes = 0  # bytes advised to be backed by huge pages (weights in host memory)
        self._finalizer = weakref.finalize(self, _lib.lib.ggml_backend_buffer_free, ptr)

    @classmethod
    def for_context(cls, ctx: Context, device: Device, label: str = "",
                    usage: int = USAGE_ANY) -> Buffer:
        """Allocate every tensor of ``ctx`` in one buffer on ``device``."""
        lib, ffi = _lib.lib, _lib.ffi
        buft = device.buffer_type()
        need = int(lib.ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.ptr, buft))
        what = label or "buffer"
        free, total = device.memory()
        if total and need > free and not device.is_cpu:
            raise OutOfMemory(device.name, f"{what} ({free / 2**20:.1f} MiB free)", need)
        if faults.should_fail(what):
            raise OutOfMemory(device.name, f"{what} (injected fault)", need)
        ptr = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, buft)
        if ptr == ffi.NULL:
            raise OutOfMemory(device.name, what, need)
        buf = cls(ptr, device, label)
        buf.set_usage(usage)
        buf._advise_huge_pages(ctx, usage)
        return buf

    @classmethod
    def placeholder(cls, device: Device, usage: int = USAGE_ANY, label: str = "") -> Buffer:
        """A zero-byte buffer on ``device`` (ggml's dummy buffer). A tensor attached to it
        (:meth:`attach`) counts as allocated on ``device`` for ggml's allocator and
        scheduler, which look at ``tensor->buffer``: graphs over such tensors can be split
        and their compute buffers sized without memory behind the tensors. Such a tensor
        has no data: never read, write or compute it."""
        ptr = _lib.lib.ggml_backend_buft_alloc_buffer(device.buffer_type(), 0)
        if ptr == _lib.ffi.NULL:
            raise DeviceError(device.name, "could not create a placeholder buffer")
        buf = cls(ptr, device, label or "placeholder")
        buf.set_usage(usage)
        return buf

    @classmethod
    def in_buffer_type(cls, ctx: Context, buft: BufferType, device: Device, label: str = "",
                       usage: int = USAGE_ANY) -> Buffer | None:
        """Allocate every tensor of ``ctx`` in one buffer of ``buft`` (e.g. a CPU extra buffer
        type, see :mod:`pyggspec.ggml.repack`) on ``device``; None when ggml could not."""
        ptr = _lib.lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, buft.ptr)
        if ptr == _lib.ffi.NULL:
            return None
        buf = cls(ptr, device, label)
        buf.set_usage(usage)
        buf._advise_huge_pages(ctx, usage)
        return buf

    @classmethod
    def from_host_memory(cls, device: Device, addr: int, size: int, max_tensor_size: int,
                         label: str = "", usage: int = USAGE_ANY) -> Buffer | None:
        """A buffer of ``device`` (the CPU) over ``size`` bytes of host memory at ``addr``
        that the caller keeps alive (e.g. a file mapping); nothing is copied. Tensors are
        placed in it with :meth:`place`. None when the device cannot wrap host memory."""
        lib, ffi = _lib.lib, _lib.ffi
        ptr = lib.ggml_backend_dev_buffer_from_host_ptr(device.ptr, ffi.cast("void *", addr),
                                                        size, max_tensor_size)
        if ptr == ffi.NULL:
            return None
        buf = cls(ptr, device, label)
        buf.set_usage(usage)
        return buf

    def _advise_huge_pages(self, ctx: Context, usage: int) -> None:
        """Weights in host memory, not written yet: ask for huge pages over them
        (:mod:`pyggspec.ggml.hugepages`; every step reads them all)."""
        if usage != USAGE_WEIGHTS or not self.device.is_cpu:
            return
        ffi = _lib.ffi
        spans = [(int(ffi.cast("uintptr_t", t.ptr.data)), t.nbytes) for t in ctx.tensors()
                 if t.ptr.data != ffi.NULL]
        if spans:
            lo = min(a for a, _ in spans)
            self.huge_bytes = hugepages.advise(lo, max(a + n for a, n in spans) - lo)

    def place(self, tensor: Tensor, addr: int) -> None:
        """Allocate the unallocated ``tensor`` at host address ``addr`` inside this buffer
        (one made by :meth:`from_host_memory`): its data is the bytes already there."""
        lib = _lib.lib
        st = lib.ggml_backend_tensor_alloc(self.ptr, tensor.ptr, _lib.ffi.cast("void *", addr))
        if st != lib.GGML_STATUS_SUCCESS:
            raise DeviceError(self.device.name, f"could not place '{tensor.name}' in "
                              f"{self.label or 'the buffer'} (ggml status {int(st)})")

    def set_usage(self, usage: int) -> None:
        """Tell ggml what the buffer holds (``USAGE_WEIGHTS`` steers the scheduler's choice of
        backend for ops reading it); ``USAGE_ANY`` (0) leaves it unset."""
        if usage:
            _lib.lib.ggml_backend_buffer_set_usage(self.ptr, usage)

    def attach(self, tensor: Tensor) -> None:
        """Mark an unallocated ``tensor`` as living in this (placeholder) buffer."""
        if tensor.is_allocated:
            raise DeviceError(self.device.name, f"tensor '{tensor.name}' is allocated already")
        tensor.ptr.buffer = self.ptr

    @property
    def size(self) -> int:
        return int(_lib.lib.ggml_backend_buffer_get_size(self.ptr))

    @property
    def is_host(self) -> bool:
        return bool(_lib.lib.ggml_backend_buffer_is_host(self.ptr))

    def clear(self, value: int = 0) -> None:
        _lib.lib.ggml_backend_buffer_clear(self.ptr, value)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        return f"Buffer({self.label!r} on {self.device.name}, {self.size} bytes)"
