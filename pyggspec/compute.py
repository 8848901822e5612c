"""Compute buffers: the largest graphs an engine runs, sized by ggml itself.

ggml's scheduler allocates one compute buffer per device and grows it whenever a graph
needs more. The engine reserves the worst case of every graph kind it runs at startup
(as llama.cpp's context does), so the buffers never grow while it generates, and
``pyggspec inspect`` sizes the very same graphs without loading anything.

Sizing needs no data: weights and caches become *placeholder* tensors (the real shapes and
types, attached to a zero-byte buffer of their device). That is all ggml looks at: the
scheduler picks a leaf's backend from ``tensor->buffer``, and the allocator leaves any
tensor that has a buffer alone. ``ggml_backend_sched_reserve_size`` then lays out the
compute buffer of each graph without allocating it.

The graph kinds (what :class:`~pyggspec.worker.Worker` and the drafter run; their row counts
come from :mod:`pyggspec.models.batch`'s ``padded_rows`` / ``catch_up_rows``, the functions
those batches are built with):

* target prefill: ``n_ubatch`` tokens as B sequences x ``n_ubatch // B`` tokens, one logits
  row per sequence (hidden rows kept for MTP), for every B up to ``n_parallel``;
* target plain step: ``n_parallel`` x 1 (a prefill shape covers it unless ``n_ubatch`` is
  smaller than ``n_parallel``);
* target verify (draft-mtp): B x ``padded_rows(n_max + 1, B)`` rows, logits and hidden rows
  for all, the recurrent state after every row written to the state arena, outside the
  compute buffer (``--spec-rollback snapshot``);
* MTP: the prompt warm-up / catch-up batch of ``n_parallel`` x ``n_ubatch`` rows, which
  bounds the one-row draft steps;
* with backend sampling (:class:`SamplingSizing`): the plain steps and verify batches again
  with a device sampling prefix after their logits, and (coupled drafts) the MTP batch with
  the drafts' chains, for the default chain and the longest prefixes any chain can put in
  a graph (every graph stage, ending in a sampled token or in top-k candidates), so a
  request with its own chain builds a subset of a sized graph.

Every kind is sized at the largest attended window (all KV cells). Graphs outside the
generation loop (``Engine.eval``'s logits for every token) may still grow the buffers.

With weights on several devices the per-step graphs (plain steps, verify, MTP catch-up and
drafts: at most :attr:`GraphOptions.step_rows` rows per sequence) each keep a scheduler of
their own (:class:`~pyggspec.models.runner.GraphRunner`), allocated when first run. Their
bound, ``STEP_SCHEDS`` (the head: ``MTP_STEP_SCHEDS``) times the largest step graph of each
runner, is ``steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
from pyggspec.ggml.context import Context
from pyggspec.ggml.device import Backend, Device, cpu_device, get_device
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.ggml.sched import BackendScheduler
from pyggspec.ggml.tensor import Tensor
from pyggspec.memory.recurrent import arena_layout
from pyggspec.modelfile import HParams
from pyggspec.models.batch import catch_up_rows, most_verify_rows, padded_rows
from pyggspec.models.mtp import MtpGraph, MtpShape, MtpWeights
from pyggspec.models.qwen35 import TargetGraph, UBatchShape
from pyggspec.models.runner import MTP_STEP_SCHEDS, STEP_SCHEDS
from pyggspec.sampling.params import SamplingParams, graph_sampling
from pyggspec.sampling.plan import SamplingPlan, plan_chain

log = logging.getLogger("pyggspec.compute")



@dataclass(frozen=True)
class GraphOptions:
    """The engine options that decide the shapes of its graphs."""

    n_ctx: int
    n_parallel: int
    n_ubatch: int
    spec_n_max: int = 0  # > 0: speculative (verify graphs of n_max + 1 rows)
    rollback: str | None = None  # "snapshot" | "checkpoint" (speculative)
    type_k: str = "f16"
    type_v: str = "f16"
    mtp_type_k: str = "f16"
    mtp_type_v: str = "f16"
    device_argmax: bool = True  # MTP drafts: argmax in the graph
    draft_vocab: int = 0
    mtp: bool = True  # the MTP head drafts (with spec_n_max > 0)

    @property
    def spec(self) -> bool:
        return self.spec_n_max > 0

    @property
    def kv_cells(self) -> int:
        """KV cells per sequence: verify/draft rows may run n_max + 2 past the context."""
        return self.n_ctx + (self.spec_n_max + 2 if self.spec else 0)

    @property
    def step_rows(self) -> int:
        """Rows per sequence of the largest per-step graph: a verify batch (draft-mtp) or
        one token (plain decoding)."""
        if not self.spec:
            return 1
        return most_verify_rows(self.n_parallel, self.spec_n_max)

    @property
    def planes(self) -> int:
        """Recurrent state planes per sequence: one, and a spare for checkpoint rollback
        (a verify writes its final state there, the old one stays until accepted). With
        snapshot rollback the state after each verify row goes to the state arena
        (:attr:`arena_rows`) and the accepted one's row becomes the sequence's."""
        return 2 if self.spec and self.rollback != "snapshot" else 1

    @property
    def arena_rows(self) -> int:
        """Recurrent state rows of the arena (snapshot rollback): the most rows a verify
        batch has, ``n_parallel`` sequences x the longest padded verify."""
        if not self.spec or self.rollback != "snapshot":
            return 0
        return self.n_parallel * self.step_rows

    def target_shapes(self) -> list[UBatchShape]:
        n, cells, spec = self.n_parallel, self.kv_cells, self.spec
        ub = self.n_ubatch
        out: list[UBatchShape] = []
        # prefill chunks: at most n_ubatch tokens in all (chunk_group), each sequence's at
        # most its context -- B x min(n_ubatch // B, n_ctx), not min(n_ubatch, n_ctx) // B
        # (which missed 4 x 40 prompt chunks at -c 128 -ub 512 by 8% of the compute buffer)
        for B in range(1, min(n, ub) + 1):
            out.append(UBatchShape(min(ub // B, self.n_ctx), B, cells, B, spec))
        if n > ub:  # a plain step of every sequence is wider than any prefill chunk
            out.append(UBatchShape(1, n, cells, n, False))
        if spec:
            for B in range(1, n + 1):
                T = padded_rows(self.spec_n_max + 1, B)
                n_write = T if self.rollback == "snapshot" else 1
                out.append(UBatchShape(T, B, cells, B * T, True, n_write))
        return list(dict.fromkeys(out))

    def mtp_shapes(self) -> list[MtpShape]:
        if not (self.spec and self.mtp):
            return []
        n, cells = self.n_parallel, self.kv_cells
        # catch-up after a verify: the accepted drafts + the new token, padded
        catch_up = self.step_rows
        T = catch_up_rows(min(self.n_ubatch, self.n_ctx), n)  # prompt warm-up chunk
        shapes = [MtpShape(max(T, catch_up), n, cells, n, self.device_argmax, self.draft_vocab)]
        if self.device_argmax and self.spec_n_max > 1:  # argmax drafts chained in one graph
            shapes.append(MtpShape(catch_up, n, cells, n, True, self.draft_vocab,
                                   n_chain=self.spec_n_max))
        return shapes


def sizing_chains(default: SamplingParams | None = None) -> tuple[SamplingParams, ...]:
    """``default`` and the two longest device prefixes a chain can have: every stage with a
    graph version (logit bias, penalties, min-p, temperature), ending in a sampled token or
    in top-k candidates. Other chains build subsets of these graphs."""
    full = {"logit_bias": ((0, 1.0),), "repeat_penalty": 1.1, "presence_penalty": 0.5,
            "min_p": 0.05, "temp": 0.7, "top_p": 1.0, "typical_p": 1.0}
    out = [SamplingParams(**full, top_k=0), SamplingParams(**full, top_k=40)]
    return (default, *out) if default is not None else tuple(out)


@dataclass(frozen=True)
class SamplingSizing:
    """The device sampling the generation loop may append to its graphs: ``chains`` (see
    :func:`sizing_chains`) on the logits' device (None: sampled on the host) and, for
    coupled drafts, on the MTP head's device."""

    n_vocab: int
    chains: tuple[SamplingParams, ...]
    target_device: Device | None
    draft_device: Device | None = None

    def plans(self, device: Device | None, n_rows: int) -> list[SamplingPlan]:
        """One plan per distinct graph the chains build at ``n_rows`` rows (those with a
        device part only)."""
        if device is None:
            return []
        out: dict[tuple, SamplingPlan] = {}
        for p in self.chains:
            plan = plan_chain(p, device, self.n_vocab, n_rows, True)
            if plan.n_device:
                out.setdefault(plan.key, plan)
        return list(out.values())


def sampling_sizing(n_vocab: int, placement, weights, n_layer: int, *,
                    backend_sampling: bool | None, coupled_drafts: bool,
                    default: SamplingParams | None = None) -> SamplingSizing | None:
    """What :class:`SamplingSizing` an engine with this placement uses: the target's chains
    in the graph on the output device (``backend_sampling`` resolved by
    :func:`~pyggspec.sampling.graph_sampling`; never when the output layer is split), and
    coupled draws on the MTP head's device (``weights``: real or :class:`WeightShapes`)."""
    out = placement.output_device
    target = (None if placement.output_split or not graph_sampling(backend_sampling, out)
              else get_device(out))
    draft = None
    if coupled_drafts:
        head = weights.device_of(MtpWeights(weights, n_layer).head_name)
        draft = head if graph_sampling(backend_sampling, head.name) else None
    if target is None and draft is None:
        return None
    return SamplingSizing(n_vocab, sizing_chains(default), target, draft)


class Placeholders:
    """Tensors with real shapes and types that hold no memory: each is attached to a
    zero-byte buffer of its device (see the module docstring)."""

    def __init__(self, n_tensors: int) -> None:
        self.ctx = Context(max(1, n_tensors))
        self._bufs: dict[tuple[str, int], Buffer] = {}

    def new(self, type: GGMLType | str | int, shape: Iterable[int], name: str, device: Device,
            usage: int = 0) -> Tensor:
        t = self.ctx.new_tensor(type, tuple(shape), name)
        buf = self._bufs.get((device.name, usage))
        if buf is None:
            buf = self._bufs[(device.name, usage)] = Buffer.placeholder(device, usage)
        buf.attach(t)
        return t

    def close(self) -> None:
        self.ctx.close()
        for b in self._bufs.values():
            b.close()
        self._bufs.clear()


class StateShapes:
    """Stands in for the KV caches and the recurrent state (``k/v/conv/ssm(il)``, ``n_ctx``)
    while graphs are sized: the same tensor shapes and types, on the same devices."""

    def __init__(self, ph: Placeholders, n_ctx: int) -> None:
        self.ph = ph
        self.n_ctx = n_ctx
        self._t: dict[tuple[str, int], Tensor] = {}
        self.arena_base = self.arena_rows = 0

    def add_kv(self, il: int, device: Device, n_embd_k: int, n_embd_v: int, n_slots: int,
               type_k: str, type_v: str) -> None:
        self.n_slots = n_slots
        for kind, typ, width in (("k", type_k, n_embd_k), ("v", type_v, n_embd_v)):
            self._t[(kind, il)] = self.ph.new(typ, (width, self.n_ctx, n_slots),
                                              f"cache_{kind}_l{il}", device)

    def add_recurrent(self, il: int, device: Device, n_embd_r: int, n_embd_s: int,
                      n_slots: int, n_planes: int = 1, arena_rows: int = 0,
                      d_inner: int = 0) -> None:
        """A GDN layer's state rows, laid out as the engine's
        (:func:`~pyggspec.memory.recurrent.arena_layout`)."""
        rows, self.arena_base = arena_layout(n_slots, n_planes, arena_rows, d_inner, n_embd_s)
        self.arena_rows = arena_rows
        for kind, width in (("conv", n_embd_r), ("ssm", n_embd_s)):
            self._t[(kind, il)] = self.ph.new("f32", (width, rows), f"cache_{kind}_l{il}", device)

    def k(self, il: int) -> Tensor:
        return self._t[("k", il)]

    def v(self, il: int) -> Tensor:
        return self._t[("v", il)]

    def conv(self, il: int) -> Tensor:
        return self._t[("conv", il)]

    def ssm(self, il: int) -> Tensor:
        return self._t[("ssm", il)]


class WeightShapes:
    """Stands in for :class:`~pyggspec.weights.Weights` (``get/has``, the same keys and
    aliases) without reading the file: placeholders on each tensor's planned device."""

    def __init__(self, model, placement, mtp_placement=None) -> None:
        from pyggspec.weights.placement import _jobs_for, default_mtp_placement

        jobs, self._aliases = _jobs_for(model.trunk, placement, prefix_shared=False)
        if model.mtp_file is not None:
            mp = mtp_placement or default_mtp_placement(model, placement)
            mjobs, maliases = _jobs_for(model.mtp_file, mp, prefix_shared=True)
            jobs += mjobs
            self._aliases.update(maliases)
        self.ph = Placeholders(len(jobs))
        self._tensors: dict[str, Tensor] = {}
        self._devices: dict[str, Device] = {}
        try:
            for j in jobs:
                dev = get_device(j.device)
                self._tensors[j.key] = self.ph.new(j.info.type.id, j.info.shape, j.key, dev,
                                                   USAGE_WEIGHTS)
                self._devices[j.key] = dev
        except BaseException:
            self.ph.close()
            raise

    def get(self, name: str) -> Tensor:
        return self._tensors[self._aliases.get(name, name)]

    def has(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._tensors

    def device_of(self, name: str) -> Device:
        return self._devices[self._aliases.get(name, name)]

    def close(self) -> None:
        self.ph.close()


@dataclass
class ComputePlan:
    """Compute buffer bytes per device of the target and MTP schedulers (each the maximum
    over its worst-case graphs), and the graphs that reach those maxima (shape, and the
    sampling plan appended to it or None)."""

    target: dict[str, int] = field(default_factory=dict)
    mtp: dict[str, int] = field(default_factory=dict)
    target_peaks: list[tuple[UBatchShape, SamplingPlan | None]] = field(default_factory=list)
    mtp_peaks: list[tuple[MtpShape, SamplingPlan | None]] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # several devices: step schedulers
    # the sampler graphs' shared constant per device (sampling.graph.SharedRevid)
    sampling: dict[str, int] = field(default_factory=dict)

    def by_device(self) -> dict[str, int]:
        """The reserved buffers (``steps`` apart)."""
        out = dict(self.target)
        for d, n in self.mtp.items():
            out[d] = out.get(d, 0) + n
        return out


def _peaks(sized: list[tuple[object, dict[str, int]]]) -> tuple[dict[str, int], list]:
    """Per device the largest size, and the graphs that have one of them."""
    best: dict[str, tuple[int, object]] = {}
    for graph, sizes in sized:
        for dev, n in sizes.items():
            if dev not in best or n > best[dev][0]:
                best[dev] = (n, graph)
    peaks = list({id(g): g for n, g in best.values() if n > 0}.values())
    return {d: n for d, (n, _) in best.items()}, peaks


def _add(into: dict[str, int], sizes: Mapping[str, int], times: int) -> None:
    for dev, n in sizes.items():
        if n:
            into[dev] = into.get(dev, 0) + n * times


def _sampled(shapes: list, plans_for) -> list[tuple[object, SamplingPlan | None]]:
    """Each shape bare and with every sampling plan for its output rows (the plan's id in
    the shape is local to the sizing: graphs are built with the plan object)."""
    out: list[tuple[object, SamplingPlan | None]] = []
    for shape in shapes:
        out.append((replace(shape, sampling=0), None))
        for k, plan in enumerate(plans_for(shape.n_outputs), 1):
            out.append((replace(shape, sampling=k), plan))
    return out


def _unique(graphs: list[tuple[object, SamplingPlan | None]]) -> list:
    seen: dict[tuple, tuple] = {}
    for shape, plan in graphs:
        seen.setdefault((shape, plan.key if plan is not None else None), (shape, plan))
    return list(seen.values())


def _size_all(graphs: list, sched: BackendScheduler, build) -> list:
    """ggml's size of each (shape, sampling plan) graph. A sampled graph that cannot be
    built or sized is left out: the step that would use it falls back to host sampling
    (logged there), so the engine still starts."""
    sized = []
    for shape, splan in graphs:
        try:
            g = build(shape, splan)
        except Exception as e:
            if splan is None:
                raise
            log.debug("sampling graph %s not sized: %s", shape, e)
            continue
        try:
            sized.append(((shape, splan), sched.reserve_size(g.graph)))
        except Exception as e:
            if splan is None:
                raise
            log.debug("sampling graph %s not sized: %s", shape, e)
        finally:
            g.close()
    return sized


def size_compute(opts: GraphOptions, hp: HParams, weights, layer_devices: Mapping[int, Device],
                 target_sched: BackendScheduler, mtp_sched: BackendScheduler | None = None,
                 mtp_hp: HParams | None = None, mtp_device: Device | None = None,
                 sampling: SamplingSizing | None = None) -> ComputePlan:
    """Build every worst-case graph over ``weights`` (real or :class:`WeightShapes`) and
    placeholder states, and let ggml size each on its scheduler (nothing is allocated;
    the schedulers' earlier reservations are dropped)."""
    block = hp.n_layer
    mh = mtp_hp or hp
    spec = opts.spec and mtp_sched is not None
    n, rows, cells = opts.n_parallel, opts.step_rows, opts.kv_cells
    ph = Placeholders(2 * hp.n_layer + 2)
    try:
        states = StateShapes(ph, cells)
        for il in range(hp.n_layer):
            dev = layer_devices[il]
            if hp.is_recurrent(il):
                states.add_recurrent(il, dev, hp.n_embd_r, hp.n_embd_s, n, opts.planes,
                                     opts.arena_rows, hp.ssm_d_inner)
            else:
                states.add_kv(il, dev, hp.n_embd_k_gqa, hp.n_embd_v_gqa, n,
                              opts.type_k, opts.type_v)
        plan = ComputePlan()
        graphs = [(s, None) for s in opts.target_shapes()]
        if sampling is not None and sampling.target_device is not None:
            # the generation loop's sampled steps: B x 1 plain steps and the verify batches
            stepped = [UBatchShape(1, n, cells, n, False)]
            stepped += [s for s in opts.target_shapes()
                        if spec and s.hidden and s.n_outputs == s.n_seqs * s.n_seq_tokens]
            graphs += _sampled(stepped, lambda r: sampling.plans(sampling.target_device, r))
            _add_revid(plan, sampling, sampling.target_device, [p for _, p in graphs])
        sized = _size_all(_unique(graphs), target_sched,
                          lambda s, p: TargetGraph(hp, weights, states, states, s, p))
        plan.target, plan.target_peaks = _peaks(sized)
        if target_sched.multi_backend:
            step = (UBatchShape(rows, n, cells, n * rows, True,
                                rows if opts.rollback == "snapshot" else 1) if spec else
                    UBatchShape(1, n, cells, n, False))
            g = TargetGraph(hp, weights, states, states, step)
            try:
                _add(plan.steps, target_sched.reserve_size(g.graph), STEP_SCHEDS)
            finally:
                g.close()
        if spec:
            assert mtp_sched is not None and mtp_device is not None
            mkv = StateShapes(ph, cells)
            mkv.add_kv(block, mtp_device, mh.n_embd_k_gqa,
                       mh.n_embd_v_gqa, n, opts.mtp_type_k, opts.mtp_type_v)
            w = MtpWeights(weights, block)
            mgraphs = [(s, None) for s in opts.mtp_shapes()]
            if sampling is not None and sampling.draft_device is not None:
                # coupled drafts: the first draft comes from the catch-up batch's rows
                mgraphs += _sampled([replace(s, device_argmax=True) for s in opts.mtp_shapes()
                                     if s.n_chain == 1],
                                    lambda r: sampling.plans(sampling.draft_device, r))
                _add_revid(plan, sampling, sampling.draft_device, [p for _, p in mgraphs])
            sized = _size_all(_unique(mgraphs), mtp_sched,
                              lambda s, p: MtpGraph(mh, w, mkv, s, p))
            plan.mtp, plan.mtp_peaks = _peaks(sized)
            if mtp_sched.multi_backend:
                one = MtpShape(rows, n, cells, n, opts.device_argmax, opts.draft_vocab)
                most: dict[str, int] = {}  # a step scheduler holds one of these graphs
                for s in [one] + [s for s in opts.mtp_shapes() if s.n_chain > 1]:
                    g = MtpGraph(mh, w, mkv, s)
                    try:
                        for dev, size in mtp_sched.reserve_size(g.graph).items():
                            most[dev] = max(most.get(dev, 0), size)
                    finally:
                        g.close()
                _add(plan.steps, most, MTP_STEP_SCHEDS)
        return plan
    finally:
        ph.close()


def _add_revid(plan: ComputePlan, sampling: SamplingSizing, device: Device,
               plans: list[SamplingPlan | None]) -> None:
    """The shared V - id constant on ``device`` when a sampled graph picks its token there
    (greedy or dist in the graph's part of the chain): one per device, target and MTP
    graphs alike."""
    if any(p is not None and p.device_stages and p.device_stages[-1].name in ("greedy", "dist")
           for p in plans):
        plan.sampling[device.name] = 4 * sampling.n_vocab


def reserve_compute(plan: ComputePlan, target, mtp=None) -> None:
    """Allocate the compute buffers of the engine's schedulers at their planned sizes: the
    peak graphs are rebuilt over the real caches and reserved (graphs are not kept: on
    several backends ggml's split rewrites a graph's inputs)."""
    for shape, splan in plan.target_peaks:
        g = TargetGraph(target.hp, target.weights, target.kv, target.rs, shape, splan)
        try:
            target.sched.reserve(g.graph)
        finally:
            g.close()
    if mtp is not None:
        for shape, splan in plan.mtp_peaks:
            g = MtpGraph(mtp.hp, mtp.weights, mtp.kv, shape, splan)
            try:
                mtp.sched.reserve(g.graph)
            finally:
                g.close()


def predict_compute(model, opts: GraphOptions, placement, mtp_placement=None,
                    n_threads: int = 1, backend_sampling: bool | None = None,
                    coupled_drafts: bool = True,
                    sampling: SamplingParams | None = None) -> ComputePlan:
    """What an engine with these options will reserve, per device, without loading a byte
    of weights (``pyggspec inspect``): placeholder weights on the planned devices.
    ``sampling`` is the engine's default chain (None: :class:`SamplingParams`' defaults)."""
    hp = model.trunk.hparams
    weights = WeightShapes(model, placement, mtp_placement)
    backends: list[Backend] = []
    scheds: list[BackendScheduler] = []
    try:
        used = {placement.output_device, *placement.layer_devices[: hp.n_layer]}
        for name in sorted(used - {"CPU"}):
            backends.append(get_device(name).open())
        backends.append(cpu_device().open(n_threads))
        scheds.append(BackendScheduler(backends))
        mtp_sched = mtp_dev = mtp_hp = None
        if opts.spec and opts.mtp:
            scheds.append(BackendScheduler(backends))
            mtp_sched = scheds[-1]
            mtp_dev = weights.device_of(f"blk.{hp.n_layer}.nextn.eh_proj.weight")
            mtp_hp = model.mtp_file.hparams if model.mtp_file is not None else None
        layer_devs = {il: get_device(placement.layer_devices[il]) for il in range(hp.n_layer)}
        smp = sampling_sizing(model.trunk.n_vocab, placement, weights, hp.n_layer,
                              backend_sampling=backend_sampling,
                              coupled_drafts=coupled_drafts and opts.spec and opts.mtp,
                              default=sampling or SamplingParams())
        return size_compute(opts, hp, weights, layer_devs, scheds[0], mtp_sched, mtp_hp,
                            mtp_dev, smp)
    finally:
        for s in scheds:
            s.close()
        for b in backends:
            b.close()
        weights.close()
