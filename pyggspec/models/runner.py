"""What every graph runner does per step: find or build the graph for a shape, allocate
it, write inputs, compute, read outputs, and account host vs device time."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from pyggspec.ggml.sched import BackendScheduler, GraphCache

STEP_SCHEDS = 6  # per runner: step shapes that keep their own scheduler at once
# the MTP head's loop alternates more shapes (catch-up rows x chained draft lengths), and
# its graphs are one layer's: their schedulers cost little memory
MTP_STEP_SCHEDS = 10
PROMPT_GRAPHS = 6  # per runner: cached graphs of prompt-chunk shapes (> step_rows rows)


class StepPromptCache:
    """Graphs by shape in two LRU caches: per-step shapes (at most ``runner.step_rows``
    rows per sequence: decode, verify, replay, MTP catch-up and drafts) and prompt chunks,
    whose lengths vary with every prompt. Prompts of new lengths then never evict the
    graphs of the decode loop."""

    def __init__(self, runner: GraphRunner, step_capacity: int, prompt_capacity: int) -> None:
        self.runner = runner
        self.steps = GraphCache(step_capacity)
        self.prompts = GraphCache(prompt_capacity)

    def _cache(self, key: Hashable) -> GraphCache:
        rows = getattr(key, "n_seq_tokens", 1)
        return self.steps if rows <= self.runner.step_rows else self.prompts

    def get(self, key: Hashable, build: Callable[[Hashable], Any]) -> Any:
        return self._cache(key).get(key, build)

    def drop(self, key: Hashable) -> None:
        self._cache(key).drop(key)

    def clear(self) -> None:
        self.steps.clear()
        self.prompts.clear()

    @property
    def hits(self) -> int:
        return self.steps.hits + self.prompts.hits

    @property
    def misses(self) -> int:
        return self.steps.misses + self.prompts.misses

    def __len__(self) -> int:
        return len(self.steps) + len(self.prompts)


class GraphRunner:
    """Base of :class:`~pyggspec.models.qwen35.Target` and :class:`~pyggspec.models.mtp.Mtp`.

    Graphs are cached by shape. On one backend every cached graph stays valid. On several,
    ggml's scheduler rewrites a split graph's inputs to copies in a context it frees when it
    splits the next graph, so a graph is reusable only while it is its scheduler's allocated
    graph. The graphs of the generation loop alternate every step (verify, MTP catch-up,
    MTP one-row drafts), so each *step* shape (at most ``step_rows`` rows per sequence, set
    by the engine from its draft length) gets a scheduler of its own, keyed by the shape
    without its attended window: it is split and allocated once, and stays allocated while
    the window is unchanged. At most ``step_scheds`` live at once (least recently used
    closed first); :func:`pyggspec.compute.size_compute` bounds their memory. Prefill-sized
    graphs share the main scheduler, whose buffers are reserved at startup.
    """

    def __init__(self, sched: BackendScheduler, cache_size: int,
                 step_scheds: int = STEP_SCHEDS) -> None:
        self.sched = sched
        self.step_scheds = step_scheds
        self.graphs = StepPromptCache(self, cache_size, PROMPT_GRAPHS)
        self._step_scheds: OrderedDict[Hashable, BackendScheduler] = OrderedDict()
        self._sched_keys: dict[Hashable, Hashable] = {}  # shape -> shape without its window
        self.step_rows = 1  # rows per sequence of the largest step graph (engine sets it)
        self.plans: dict[int, object] = {}  # sampling plans by id (id 0 = none)
        self._plan_ids: dict[object, int] = {}  # plan.key -> id
        self.n_builds = 0  # graphs built, first builds and rebuilds alike
        self.n_rebuilds = 0  # builds of a shape built before (a cache eviction or a switch)
        self._built: set[Hashable] = set()
        self.last_python_ms = 0.0  # host work of the last step: inputs and outputs
        self.last_build_ms = 0.0
        self.compute_ms_total = 0.0  # device time of all steps (graph compute)
        self.build_ms_total = 0.0  # graph builds and (re)allocations
        # the part of build_ms_total spent building graphs (not allocating a built one):
        # once per shape, so a step's cost as the draft-length rule learns it leaves it out
        self.new_graph_ms_total = 0.0

    def register_plan(self, plan) -> int:
        """An id for a sampling plan whose device part graphs of this runner append (a
        ``UBatch.sampling`` / ``MtpBatch.sampling`` value). Plans with equal ``plan.key``
        (chain structure, device, rows) share one id, so graphs are built once, not per
        generation."""
        pid = self._plan_ids.get(plan.key)
        if pid is None:
            pid = self._plan_ids[plan.key] = len(self.plans) + 1
            self.plans[pid] = plan
        return pid

    def sched_for(self, shape: Hashable) -> BackendScheduler:
        """The scheduler that runs ``shape``'s graph (see the class docstring)."""
        if not self.sched.multi_backend or shape.n_seq_tokens > self.step_rows:  # type: ignore[attr-defined]
            return self.sched
        key = self._sched_keys.get(shape)
        if key is None:  # once per shape, not per step
            key = self._sched_keys[shape] = dataclasses.replace(shape, n_kv=0)  # type: ignore[type-var]
        s = self._step_scheds.get(key)
        if s is None:
            s = self._step_scheds[key] = self.sched.spawn()
            while len(self._step_scheds) > self.step_scheds:
                self._step_scheds.popitem(last=False)[1].close()
        else:
            self._step_scheds.move_to_end(key)
        return s

    def execute(self, shape: Hashable, build: Callable[[Any], Any],
                feed: Callable[[Any], None], read: Callable[[Any], Any]) -> Any:
        """Run the graph for ``shape``: ``feed(g)`` writes inputs, ``read(g)`` returns outputs."""
        t0 = time.perf_counter()
        sched = self.sched_for(shape)
        built = False

        def counted(s: Hashable) -> Any:
            nonlocal built
            built = True
            self.n_builds += 1
            if s in self._built:
                self.n_rebuilds += 1
            self._built.add(s)
            return build(s)

        g = self.graphs.get(shape, counted)
        if sched.multi_backend and not sched.is_current(g.graph) and g.used:
            self.graphs.drop(shape)
            g = self.graphs.get(shape, counted)
        g.used = True
        sched.alloc(g.graph)
        t_alloc = time.perf_counter()
        feed(g)
        t1 = time.perf_counter()
        sched.compute(g.graph)
        t2 = time.perf_counter()
        out = read(g)
        self.last_python_ms = ((t1 - t_alloc) + (time.perf_counter() - t2)) * 1000
        self.last_build_ms = (t_alloc - t0) * 1000
        self.compute_ms_total += (t2 - t1) * 1000
        self.build_ms_total += self.last_build_ms
        if built:
            self.new_graph_ms_total += self.last_build_ms
        return out

    def close(self) -> None:
        self.graphs.clear()
        while self._step_scheds:
            self._step_scheds.popitem()[1].close()
