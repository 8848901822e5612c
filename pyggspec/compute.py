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

The graph kinds (what :mod:`pyggspec.engine` and :mod:`pyggspec.speculative.loop` run):

* target prefill: ``n_ubatch`` tokens as B sequences x ``n_ubatch // B`` tokens, one logits
  row per sequence (hidden rows kept for MTP), for every B up to ``n_parallel``;
* target plain step: ``n_parallel`` x 1 (a prefill shape covers it unless ``n_ubatch`` is
  smaller than ``n_parallel``);
* target verify (draft-mtp): B x ``padded_rows(n_max + 1, B)`` rows, logits and hidden rows
  for all, snapshots written per row (``--spec-rollback snapshot``);
* MTP: the prompt warm-up / catch-up batch of ``n_parallel`` x ``n_ubatch`` rows, which
  bounds the one-row draft steps.

Every kind is sized at the largest attended window (all KV cells). Graphs outside the
generation loop (``Engine.eval``'s logits for every token, a device sampling prefix) may
still grow the buffers.

With weights on several devices the per-step graphs (plain steps, verify, MTP catch-up and
drafts: at most :attr:`GraphOptions.step_rows` rows per sequence) each keep a scheduler of
their own (:class:`~pyggspec.models.runner.GraphRunner`), allocated when first run. Their
bound, ``STEP_SCHEDS`` times the largest step graph of each runner, is ``steps``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
from pyggspec.ggml.context import Context
from pyggspec.ggml.device import Backend, Device, cpu_device, get_device
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.ggml.sched import Scheduler
from pyggspec.ggml.tensor import Tensor
from pyggspec.modelfile import HParams
from pyggspec.models.mtp import MtpGraph, MtpShape, MtpWeights
from pyggspec.models.qwen35 import TargetGraph, UBatchShape
from pyggspec.models.runner import STEP_SCHEDS
from pyggspec.speculative.loop import padded_rows

MTP_NO_PAD_ROWS = 64  # the drafter pads catch-up batches shorter than this (draft_mtp.py)


@dataclass(frozen=True)
class GraphOptions:
    """The engine options that decide the shapes of its graphs."""

    n_ctx: int
    n_parallel: int
    n_ubatch: int
    spec_n_max: int = 0  # > 0: draft-mtp
    rollback: str | None = None  # "snapshot" | "checkpoint" (draft-mtp)
    type_k: str = "f16"
    type_v: str = "f16"
    mtp_type_k: str = "f16"
    mtp_type_v: str = "f16"
    device_argmax: bool = True  # MTP drafts: argmax in the graph
    draft_vocab: int = 0

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
        return max(padded_rows(self.spec_n_max + 1, B) for B in range(1, self.n_parallel + 1))

    @property
    def planes(self) -> int:
        """Recurrent state planes per sequence (current + snapshots or one checkpoint)."""
        if not self.spec:
            return 1
        return self.spec_n_max + 3 if self.rollback == "snapshot" else 2

    def target_shapes(self) -> list[UBatchShape]:
        n, cells, spec = self.n_parallel, self.kv_cells, self.spec
        ub = min(self.n_ubatch, self.n_ctx)
        out: list[UBatchShape] = []
        for B in range(1, min(n, ub) + 1):  # prefill chunks of n_ubatch tokens
            out.append(UBatchShape(ub // B, B, cells, B, spec))
        if n > ub:  # a plain step of every sequence is wider than any prefill chunk
            out.append(UBatchShape(1, n, cells, n, False))
        if spec:
            for B in range(1, n + 1):
                T = padded_rows(self.spec_n_max + 1, B)
                n_write = T if self.rollback == "snapshot" else 1
                out.append(UBatchShape(T, B, cells, B * T, True, n_write))
        return list(dict.fromkeys(out))

    def mtp_shapes(self) -> list[MtpShape]:
        if not self.spec:
            return []
        n, cells = self.n_parallel, self.kv_cells
        # catch-up after a verify: the accepted drafts + the new token, padded
        catch_up = max(padded_rows(self.spec_n_max + 1, B) for B in range(1, n + 1))
        T = min(self.n_ubatch, self.n_ctx)  # prompt warm-up chunk per sequence
        if T < MTP_NO_PAD_ROWS:
            T = padded_rows(T, n)
        return [MtpShape(max(T, catch_up), n, cells, n, self.device_argmax, self.draft_vocab)]


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

    def add_kv(self, il: int, device: Device, n_embd_k: int, n_embd_v: int, n_slots: int,
               type_k: str, type_v: str) -> None:
        self.n_slots = n_slots
        for kind, typ, width in (("k", type_k, n_embd_k), ("v", type_v, n_embd_v)):
            self._t[(kind, il)] = self.ph.new(typ, (width, self.n_ctx, n_slots),
                                              f"cache_{kind}_l{il}", device)

    def add_recurrent(self, il: int, device: Device, n_embd_r: int, n_embd_s: int,
                      rows: int) -> None:
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
        from pyggspec.weights import _jobs_for, default_mtp_placement

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
    over its worst-case graphs), and the shapes that reach those maxima."""

    target: dict[str, int] = field(default_factory=dict)
    mtp: dict[str, int] = field(default_factory=dict)
    target_peaks: list[UBatchShape] = field(default_factory=list)
    mtp_peaks: list[MtpShape] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # several devices: step schedulers

    def by_device(self) -> dict[str, int]:
        """The reserved buffers (``steps`` apart)."""
        out = dict(self.target)
        for d, n in self.mtp.items():
            out[d] = out.get(d, 0) + n
        return out


def _peaks(sized: list[tuple[object, dict[str, int]]]) -> tuple[dict[str, int], list]:
    """Per device the largest size, and the shapes that have one of them."""
    best: dict[str, tuple[int, object]] = {}
    for shape, sizes in sized:
        for dev, n in sizes.items():
            if dev not in best or n > best[dev][0]:
                best[dev] = (n, shape)
    peaks = list(dict.fromkeys(s for n, s in best.values() if n > 0))
    return {d: n for d, (n, _) in best.items()}, peaks


def _add(into: dict[str, int], sizes: Mapping[str, int], times: int) -> None:
    for dev, n in sizes.items():
        if n:
            into[dev] = into.get(dev, 0) + n * times


def size_compute(opts: GraphOptions, hp: HParams, weights, layer_devices: Mapping[int, Device],
                 target_sched: Scheduler, mtp_sched: Scheduler | None = None,
                 mtp_hp: HParams | None = None, mtp_device: Device | None = None) -> ComputePlan:
    """Build every worst-case graph over ``weights`` (real or :class:`WeightShapes`) and
    placeholder states, and let ggml size each on its scheduler (nothing is allocated;
    the schedulers' earlier reservations are dropped)."""
    block = hp.n_layer
    mh = mtp_hp or hp
    spec = opts.spec and mtp_sched is not None
    ph = Placeholders(2 * hp.n_layer + 2)
    try:
        states = StateShapes(ph, opts.kv_cells)
        for il in range(hp.n_layer):
            dev = layer_devices[il]
            if hp.is_recurrent(il):
                states.add_recurrent(il, dev, hp.n_embd_r, hp.n_embd_s,
                                     opts.n_parallel * opts.planes)
            else:
                states.add_kv(il, dev, hp.n_embd_k_gqa, hp.n_embd_v_gqa, opts.n_parallel,
                              opts.type_k, opts.type_v)
        plan = ComputePlan()
        sized = []
        for shape in opts.target_shapes():
            g = TargetGraph(hp, weights, states, states, shape)
            try:
                sized.append((shape, target_sched.reserve_size(g.graph)))
            finally:
                g.close()
        plan.target, plan.target_peaks = _peaks(sized)
        n, rows = opts.n_parallel, opts.step_rows
        if target_sched.multi_backend:
            step = (UBatchShape(rows, n, opts.kv_cells, n * rows, True,
                                rows if opts.rollback == "snapshot" else 1) if spec else
                    UBatchShape(1, n, opts.kv_cells, n, False))
            g = TargetGraph(hp, weights, states, states, step)
            try:
                _add(plan.steps, target_sched.reserve_size(g.graph), STEP_SCHEDS)
            finally:
                g.close()
        if spec:
            assert mtp_sched is not None and mtp_device is not None
            mkv = StateShapes(ph, opts.kv_cells)
            mkv.add_kv(block, mtp_device, mh.n_embd_k_gqa,
                       mh.n_embd_v_gqa, opts.n_parallel, opts.mtp_type_k, opts.mtp_type_v)
            w = MtpWeights(weights, block)
            sized = []
            for shape in opts.mtp_shapes():
                g = MtpGraph(mh, w, mkv, shape)
                try:
                    sized.append((shape, mtp_sched.reserve_size(g.graph)))
                finally:
                    g.close()
            plan.mtp, plan.mtp_peaks = _peaks(sized)
            if mtp_sched.multi_backend:
                g = MtpGraph(mh, w, mkv, MtpShape(rows, n, opts.kv_cells, n,
                                                  opts.device_argmax, opts.draft_vocab))
                try:
                    _add(plan.steps, mtp_sched.reserve_size(g.graph), STEP_SCHEDS)
                finally:
                    g.close()
        return plan
    finally:
        ph.close()


def reserve_compute(plan: ComputePlan, target, mtp=None) -> None:
    """Allocate the compute buffers of the engine's schedulers at their planned sizes: the
    peak graphs are rebuilt over the real caches and reserved (graphs are not kept: on
    several backends ggml's split rewrites a graph's inputs)."""
    for shape in plan.target_peaks:
        g = TargetGraph(target.hp, target.weights, target.kv, target.rs, shape)
        try:
            target.sched.reserve(g.graph)
        finally:
            g.close()
    if mtp is not None:
        for shape in plan.mtp_peaks:
            g = MtpGraph(mtp.hp, mtp.weights, mtp.kv, shape)
            try:
                mtp.sched.reserve(g.graph)
            finally:
                g.close()


def predict_compute(model, opts: GraphOptions, placement, mtp_placement=None,
                    n_threads: int = 1) -> ComputePlan:
    """What an engine with these options will reserve, per device, without loading a byte
    of weights (``pyggspec inspect``): placeholder weights on the planned devices."""
    hp = model.trunk.hparams
    weights = WeightShapes(model, placement, mtp_placement)
    backends: list[Backend] = []
    scheds: list[Scheduler] = []
    try:
        used = {placement.output_device, *placement.layer_devices[: hp.n_layer]}
        for name in sorted(used - {"CPU"}):
            backends.append(get_device(name).open())
        backends.append(cpu_device().open(n_threads))
        scheds.append(Scheduler(backends))
        mtp_sched = mtp_dev = mtp_hp = None
        if opts.spec:
            scheds.append(Scheduler(backends))
            mtp_sched = scheds[-1]
            mtp_dev = weights.device_of(f"blk.{hp.n_layer}.nextn.eh_proj.weight")
            mtp_hp = model.mtp_file.hparams if model.mtp_file is not None else None
        layer_devs = {il: get_device(placement.layer_devices[il]) for il in range(hp.n_layer)}
        return size_compute(opts, hp, weights, layer_devs, scheds[0], mtp_sched, mtp_hp,
                            mtp_dev)
    finally:
        for s in scheds:
            s.close()
        for b in backends:
            b.close()
        weights.close()
