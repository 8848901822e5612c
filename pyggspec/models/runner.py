"""What every graph runner does per step: find or build the graph for a shape, allocate
it, write inputs, compute, read outputs, and account host vs device time."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

from pyggspec.ggml.sched import GraphCache, Scheduler


class GraphRunner:
    """Base of :class:`~pyggspec.models.qwen35.Target` and :class:`~pyggspec.models.mtp.Mtp`.

    Graphs are cached by shape. On several backends a cached graph is reused only while it
    stays the scheduler's allocated graph: ggml's scheduler rewrites a split graph's inputs
    to copies in a context it frees at the next split, so after a switch it is rebuilt.
    """

    def __init__(self, sched: Scheduler, cache_size: int) -> None:
        self.sched = sched
        self.graphs = GraphCache(cache_size)
        self.last_python_ms = 0.0  # host work of the last step: inputs and outputs
        self.last_build_ms = 0.0
        self.compute_ms_total = 0.0  # device time of all steps (graph compute)
        self.build_ms_total = 0.0  # graph builds and (re)allocations

    def execute(self, shape: Hashable, build: Callable[[Any], Any],
                feed: Callable[[Any], None], read: Callable[[Any], Any]) -> Any:
        """Run the graph for ``shape``: ``feed(g)`` writes inputs, ``read(g)`` returns outputs."""
        t0 = time.perf_counter()
        g = self.graphs.get(shape, build)
        if self.sched.multi_backend and not self.sched.is_current(g) and g.used:
            self.graphs.drop(shape)
            g = self.graphs.get(shape, build)
        g.used = True
        self.sched.alloc(g.graph)
        t_alloc = time.perf_counter()
        feed(g)
        t1 = time.perf_counter()
        self.sched.compute(g.graph)
        t2 = time.perf_counter()
        out = read(g)
        self.last_python_ms = ((t1 - t_alloc) + (time.perf_counter() - t2)) * 1000
        self.last_build_ms = (t_alloc - t0) * 1000
        self.compute_ms_total += (t2 - t1) * 1000
        self.build_ms_total += self.last_build_ms
        return out

    def close(self) -> None:
        self.graphs.clear()
