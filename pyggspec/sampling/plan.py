"""Planning a sampler chain: the longest stage prefix the output device runs exactly (each
stage's ops probed with ``ggml_backend_dev_supports_op`` at the real shape), the rest on the
host; one plan per structure, shared by every chain of that structure."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyggspec.ggml.context import Context, GraphError
from pyggspec.ggml.device import Device
from pyggspec.ggml.sched import Graph
from pyggspec.ggml.tensor import Tensor
from pyggspec.sampling import stages as S
from pyggspec.sampling.graph import DeviceSampling, build_stage
from pyggspec.sampling.params import SamplingParams
from pyggspec.sampling.stats import SamplingStats

_VIEW_OPS = frozenset({"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"})
_forced_unsupported: set[str] = set()


@contextlib.contextmanager
def force_unsupported(*ops: str) -> Iterator[None]:
    """Test hook: make the support probe treat these ggml ops (``"TOP_K"``, ``"SET_ROWS"``,
    ...) as unsupported on every device, so planning exercises partial offload."""
    added = {o.upper() for o in ops} - _forced_unsupported
    _forced_unsupported.update(added)
    try:
        yield
    finally:
        _forced_unsupported.difference_update(added)


@dataclass(frozen=True)
class SamplingPlan:
    """``stages[:n_device]`` run in the graph on ``device``; the rest on the host."""

    stages: tuple[S.Stage, ...]
    n_device: int
    device: Device | None
    n_vocab: int
    n_rows: int
    reasons: tuple[str, ...] = ()

    @property
    def device_stages(self) -> tuple[S.Stage, ...]:
        return self.stages[:self.n_device]

    @property
    def host_stages(self) -> tuple[S.Stage, ...]:
        return self.stages[self.n_device:]

    @property
    def key(self) -> tuple:
        """What a graph built for this plan depends on. Values that only feed inputs
        (temperature, seed, top_p, ...) are left out, so every chain of one structure on
        one device and shape shares one registered plan and one cached graph."""
        dev = self.device.name if self.device is not None and self.n_device else None
        return (tuple(s.signature() for s in self.stages), self.n_device, dev, self.n_vocab,
                self.n_rows)

    @property
    def output(self) -> str:
        """What the graph hands back: 'none', 'logits', 'candidates' or 'token'."""
        if self.n_device == 0:
            return "none"
        last = self.stages[self.n_device - 1]
        return "token" if last.terminal else "candidates" if last.name == "top_k" else "logits"

    def describe(self) -> dict[str, Any]:
        return {"device": self.device.name if self.device and self.n_device else None,
                "device_stages": [s.name for s in self.device_stages],
                "host_stages": [s.name for s in self.host_stages],
                "output": self.output, "reasons": list(self.reasons)}

    def build(self, ctx: Context, graph: Graph, logits: Tensor, rows_per_seq: int = 1,
              stats: SamplingStats | None = None) -> DeviceSampling:
        """Append this plan's device prefix to ``graph`` after ``logits`` [n_vocab, n_rows]
        (see :meth:`DeviceSampling.build`): what a model graph calls with the plan it was
        given, so model code needs nothing from this package."""
        return DeviceSampling.build(ctx, graph, logits, self, rows_per_seq, stats)


class _ProbeRevid:
    def __init__(self, ctx: Context, n_vocab: int) -> None:
        self.ctx, self.V, self.t = ctx, n_vocab, None

    def __call__(self) -> Tensor:
        if self.t is None:
            self.t = self.ctx.new_tensor("f32", (self.V,), "smpl_revid")
        return self.t


def plan_chain(params: SamplingParams, device: Device | None, n_vocab: int, n_rows: int,
               backend_sampling: bool, *, output_split: bool = False,
               stats: SamplingStats | None = None) -> SamplingPlan:
    """The longest prefix of the chain whose ops ``device`` supports at the real shapes
    ([n_vocab, n_rows] logits), probed with ``ggml_backend_dev_supports_op``. A top_k or a
    token-choosing stage ends the prefix (only candidates or ids come back)."""
    stages = S.resolve_stages(params, n_vocab)
    reasons: list[str] = []
    n_dev = 0
    if not backend_sampling:
        reasons.append("backend sampling is off")
    elif device is None:
        reasons.append("no output device")
    elif output_split:
        reasons.append("output layer is split across devices")
    else:
        ctx = Context(512)
        try:
            x = ctx.new_tensor("f32", (n_vocab, n_rows), "probe_logits")
            b = S.GraphBuilder(ctx, n_vocab, n_rows, _ProbeRevid(ctx, n_vocab))
            for st in stages:
                if not st.device:
                    reasons.append(f"{st.name} has no exact graph version")
                    break
                start = len(b.ops)
                try:
                    out = build_stage(b, x, st)
                except GraphError as e:
                    reasons.append(f"{st.name}: {e}")
                    break
                bad = sorted({t.op for t in b.ops[start:]
                              if t.op not in _VIEW_OPS and (t.op in _forced_unsupported
                                                            or not device.supports_op(t))})
                if bad:
                    reasons.append(f"{st.name}: {device.name} does not support "
                                   f"{', '.join(bad)} at [{n_vocab}, {n_rows}]")
                    break
                n_dev += 1
                if isinstance(out, dict):
                    break
                x = out
        finally:
            ctx.close()
    plan = SamplingPlan(stages, n_dev, device, n_vocab, n_rows, tuple(reasons))
    if stats is not None:
        stats.device = device.name if device is not None and n_dev else None
        stats.device_stages = [s.name for s in plan.device_stages]
        stats.host_stages = [s.name for s in plan.host_stages]
        if backend_sampling and n_dev < len(stages):
            for r in reasons:
                stats.fallback(r)
    return plan


def plan_chains(params: Sequence[SamplingParams], device: Device | None, n_vocab: int,
                n_rows: int, backend_sampling: bool, *, output_split: bool = False,
                stats: SamplingStats | None = None) -> SamplingPlan:
    """One plan for a graph shared by several sequences. Their values (temperature, seed,
    penalties, ...) may differ; their stage structure may not (the graph has one shape), so
    differing structures send every sequence to the host (logged, counted)."""
    if not params:
        raise ValueError("no sequences")
    sigs = {tuple(st.signature() for st in S.resolve_stages(p, n_vocab)) for p in params}
    if len(sigs) > 1 and backend_sampling:
        plan = plan_chain(params[0], device, n_vocab, n_rows, False, stats=stats)
        reason = "sequences have sampler chains of different structure"
        if stats is not None:
            stats.fallback(reason)
        return SamplingPlan(plan.stages, 0, device, n_vocab, n_rows, (reason,))
    return plan_chain(params[0], device, n_vocab, n_rows, backend_sampling,
                      output_split=output_split, stats=stats)
