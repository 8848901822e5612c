"""Compute graphs and the multi-device scheduler.

A :class:`Graph` is built once per shape and kept (see :class:`GraphCache`); running it
again only needs its inputs written. The :class:`BackendScheduler` wraps ``ggml_backend_sched``,
which splits a graph over devices and copies tensors between them.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from pyggspec.errors import DeviceError, OutOfMemory
from pyggspec.ggml import _lib, faults
from pyggspec.ggml.context import Context, GraphError
from pyggspec.ggml.device import Backend
from pyggspec.ggml.tensor import Tensor, place, place_again

log = logging.getLogger("pyggspec.devices")
_PROBE_CAP = 64
_reported: set[tuple[str, str]] = set()  # (device, op) fallbacks logged in this process


@dataclass(frozen=True)
class Fallback:
    """A node that a device holding its weights cannot run, run on another device."""

    device: str
    op: str
    node: str
    shape: tuple[int, ...]

    def line(self) -> str:
        return (f"{self.device} lacks {self.op} for {self.node} {list(self.shape)}: "
                "running it on the CPU (its weights are copied each step)")


class Graph:
    """A forward graph over the tensors reachable from ``outputs``."""

    def __init__(self, ctx: Context, outputs: Iterable[Tensor], size: int) -> None:
        self.ctx = ctx
        self.probed = False  # op support checked against the devices (BackendScheduler._probe)
        ptr = _lib.lib.ggml_new_graph_custom(ctx.ptr, size, False)
        if ptr == _lib.ffi.NULL:
            raise GraphError("could not create graph (context too small)")
        self.ptr = ptr
        self.size = size
        self.outputs = list(outputs)
        # nodes that live in memory outside the compute buffer (:meth:`pin`), placed
        # again whenever the graph is allocated
        self.pins: list[tuple] = []
        for t in self.outputs:
            self.expand(t)

    def pin(self, t: Tensor, base: Tensor, offset: int) -> None:
        """Let node ``t`` be computed straight into ``base`` at byte ``offset`` (see
        :func:`~pyggspec.ggml.tensor.place`), now and after every allocation."""
        self.pins.append(place(t, base, offset))

    def place_pins(self) -> None:
        place_again(self.pins)

    def expand(self, t: Tensor) -> None:
        # ggml aborts when the graph is full: check with margin for the new subgraph.
        if self.n_nodes >= self.size:
            raise GraphError(f"graph full ({self.size} nodes)")
        _lib.lib.ggml_build_forward_expand(self.ptr, t.ptr)

    @property
    def n_nodes(self) -> int:
        return int(_lib.lib.ggml_graph_n_nodes(self.ptr))

    def nodes(self) -> list[Tensor]:
        return [Tensor(_lib.lib.ggml_graph_node(self.ptr, i), self.ctx)
                for i in range(self.n_nodes)]


class BackendScheduler:
    """Owns a ``ggml_backend_sched`` over backends (CPU must be last, ggml requires it)."""

    def __init__(self, backends: list[Backend], graph_size: int = 8192,
                 op_offload: bool = True) -> None:
        if not backends or not backends[-1].device.is_cpu:
            raise DeviceError(None, "the scheduler needs the CPU backend last")
        ffi, lib = _lib.ffi, _lib.lib
        self.backends = list(backends)
        arr = ffi.new("ggml_backend_t[]", [b.ptr for b in self.backends])
        self._arr = arr
        ptr = lib.ggml_backend_sched_new(arr, ffi.NULL, len(arr), graph_size, False, op_offload)
        if ptr == ffi.NULL:
            raise DeviceError(None, "ggml_backend_sched_new failed")
        self.ptr = ptr
        self.graph_size = graph_size
        self.op_offload = op_offload
        self._allocated: Graph | None = None
        self._children: weakref.WeakSet[BackendScheduler] = weakref.WeakSet()
        # (device, op) -> first node seen; shared with spawned schedulers
        self.fallbacks: dict[tuple[str, str], Fallback] = {}
        self._finalizer = weakref.finalize(self, lib.ggml_backend_sched_free, ptr)

    def close(self) -> None:
        for child in list(self._children):
            child.close()
        self._allocated = None
        self._finalizer()

    def spawn(self) -> BackendScheduler:
        """A scheduler over the same backends with buffers of its own (for a graph that
        must stay allocated), counted in :meth:`spawned_buffer_sizes`."""
        child = BackendScheduler(self.backends, self.graph_size, self.op_offload)
        child.fallbacks = self.fallbacks
        self._children.add(child)
        return child

    def _probe(self, graph: Graph) -> None:
        """Check every node against the devices that hold its data, once per graph and
        before ggml splits it. A node whose weights sit on a device lacking the op is run
        on the CPU by ggml's scheduler: recorded in :attr:`fallbacks` and logged once per
        (device, op). A node writing into memory of such a device (a cache or state view)
        would make ggml abort: that is a :class:`DeviceError` naming the op instead."""
        if graph.probed or not self.multi_backend:
            graph.probed = True
            return
        ffi, lib = _lib.ffi, _lib.lib
        hits = ffi.new("struct pyggspec_probe_hit[]", _PROBE_CAP)
        n = lib.pyggspec_graph_probe(graph.ptr, hits, _PROBE_CAP)
        for h in hits[0:min(n, _PROBE_CAP)]:
            node = Tensor(lib.ggml_graph_node(graph.ptr, h.node), graph.ctx)
            dev = ffi.string(lib.ggml_backend_dev_name(h.dev)).decode()
            if h.kind == 2:
                w = Tensor(h.tensor, graph.ctx)
                raise DeviceError(dev, f"cannot use {w.name} {list(w.shape)} "
                                  f"({w.nbytes / 2**20:.0f} MiB) as an operand of {node.op} "
                                  "(ggml would abort); keep it on the CPU (-ot)")
            if h.kind == 1:
                raise DeviceError(dev, f"cannot run {node.op} on {node.name} {list(node.shape)}, "
                                  "which writes into this device's memory (ggml would abort); "
                                  "keep that layer on the CPU (-ngl / -ot)")
            fb = Fallback(dev, node.op, node.name, node.shape)
            self.fallbacks.setdefault((dev, node.op), fb)
            if (dev, node.op) not in _reported:
                _reported.add((dev, node.op))
                log.warning("%s", fb.line())
        graph.probed = True

    def reserve(self, graph: Graph) -> None:
        """Grow the compute buffers to what ``graph`` needs (they never shrink): after
        reserving every worst-case graph, no later graph reallocates them."""
        self._probe(graph)
        self._allocated = None
        if faults.should_fail("compute"):
            raise OutOfMemory(self.device_names, "compute buffers (injected fault)")
        if not _lib.lib.ggml_backend_sched_reserve(self.ptr, graph.ptr):
            raise OutOfMemory(self.device_names, "compute buffers")

    def reserve_size(self, graph: Graph) -> dict[str, int]:
        """Compute buffer bytes per device that ``graph`` alone needs, as ggml's allocator
        lays it out, without allocating anything. Frees whatever this scheduler had
        reserved, so it is for sizing before :meth:`reserve`, not on a running scheduler."""
        ffi, lib = _lib.ffi, _lib.lib
        self._probe(graph)
        self._allocated = None
        sizes = ffi.new("size_t[]", len(self.backends))
        lib.ggml_backend_sched_reserve_size(self.ptr, graph.ptr, sizes)
        lib.ggml_backend_sched_reset(self.ptr)
        out: dict[str, int] = {}
        for b, n in zip(self.backends, sizes, strict=True):
            out[b.device.name] = out.get(b.device.name, 0) + int(n)
        return out

    @property
    def device_names(self) -> str:
        """The devices this scheduler allocates on (ggml does not say which one failed)."""
        return ",".join(dict.fromkeys(b.device.name for b in self.backends))

    @property
    def multi_backend(self) -> bool:
        return len(self.backends) > 1

    def is_current(self, graph: Graph) -> bool:
        return self._allocated is graph

    def alloc(self, graph: Graph) -> None:
        """Split and allocate ``graph`` unless it is the one already allocated."""
        if self._allocated is graph:
            return
        if not graph.probed:
            self._probe(graph)
        lib = _lib.lib
        lib.ggml_backend_sched_reset(self.ptr)
        self._allocated = None  # even if the allocation below fails
        # a graph allocated before holds addresses in buffers that may be gone now
        lib.pyggspec_ctx_forget_alloc(graph.ctx.ptr)
        graph.place_pins()
        if faults.should_fail("graph"):
            raise OutOfMemory(self.device_names, f"a graph of {graph.n_nodes} nodes "
                              "(injected fault)")
        if not lib.ggml_backend_sched_alloc_graph(self.ptr, graph.ptr):
            raise OutOfMemory(self.device_names, f"a graph of {graph.n_nodes} nodes")
        self._allocated = graph

    def compute(self, graph: Graph) -> None:
        self.alloc(graph)
        status = _lib.lib.ggml_backend_sched_graph_compute(self.ptr, graph.ptr)
        if status == _lib.lib.GGML_STATUS_ALLOC_FAILED:
            raise OutOfMemory(self.device_names, "a graph's compute buffers")
        if status != _lib.lib.GGML_STATUS_SUCCESS:
            msg = _lib.ffi.string(_lib.lib.ggml_status_to_string(status)).decode()
            raise DeviceError(None, f"graph compute failed: {msg}")

    def set_tensor_backend(self, t: Tensor, backend: Backend) -> None:
        _lib.lib.ggml_backend_sched_set_tensor_backend(self.ptr, t.ptr, backend.ptr)

    def tensor_backend(self, t: Tensor) -> str | None:
        b = _lib.lib.ggml_backend_sched_get_tensor_backend(self.ptr, t.ptr)
        return None if b == _lib.ffi.NULL else _lib.ffi.string(_lib.lib.ggml_backend_name(b)).decode()

    @property
    def n_splits(self) -> int:
        return int(_lib.lib.ggml_backend_sched_get_n_splits(self.ptr))

    def buffer_size(self, backend: Backend) -> int:
        return int(_lib.lib.ggml_backend_sched_get_buffer_size(self.ptr, backend.ptr))

    def buffer_sizes(self) -> dict[str, int]:
        return {b.device.name: self.buffer_size(b) for b in self.backends}

    def spawned_buffer_sizes(self) -> dict[str, int]:
        """Compute buffer bytes per device of the live schedulers :meth:`spawn` made."""
        out = dict.fromkeys((b.device.name for b in self.backends), 0)
        for child in list(self._children):
            if child._finalizer.alive:
                for name, n in child.buffer_sizes().items():
                    out[name] += n
        return out


class GraphCache:
    """Built graphs keyed by shape, so a step whose shape is unchanged rebuilds nothing.

    ``build(key)`` returns any object with a ``close()`` (typically holding a Context and
    a Graph plus named inputs/outputs); the least recently used entry is closed when the
    cache is full.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, build: Callable[[Hashable], Any]) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry
        self.misses += 1
        entry = build(key)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            _, old = self._entries.popitem(last=False)
            old.close()
        return entry

    def drop(self, key: Hashable) -> None:
        """Forget one entry (closing it)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.close()

    def clear(self) -> None:
        while self._entries:
            _, old = self._entries.popitem()
            old.close()

    def __len__(self) -> int:
        return len(self._entries)
