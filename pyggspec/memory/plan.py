"""Memory per component and device: predicted before allocating, reported after.

``plan_engine_memory`` predicts, from an :class:`~pyggspec.config.EngineConfig`, hparams and
a placement, what an engine with that config will allocate (``pyggspec inspect`` and the
engine both call it; :func:`plan_memory` is its arithmetic); ``Engine.memory()`` reports the
same components from the real buffers, so ``pyggspec inspect`` and ``pyggspec run --json``
can be compared line by line. Weights, caches and states are exact arithmetic. Compute
buffers are what ggml's allocator lays out for the engine's worst-case graphs
(:mod:`pyggspec.compute` sizes them, the engine reserves them at startup); they are passed in
as ``compute``. Only without a usable ggml binding does a rough estimate from the largest
ubatch stand in (marked as such).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyggspec.config import EngineConfig
from pyggspec.memory.recurrent import arena_layout
from pyggspec.modelfile import HParams, ggml_type
from pyggspec.models.batch import most_verify_rows, padded_rows

if TYPE_CHECKING:
    from pyggspec.compute import ComputePlan, GraphOptions
    from pyggspec.weights import Placement

COMPONENTS = ("weights", "kv", "mtp_kv", "recurrent", "snapshots", "checkpoints", "sampling",
              "compute", "step_graphs", "prompt_checkpoints")


@dataclass
class MemoryPlan:
    """Bytes by component, then by device name."""

    components: dict[str, dict[str, int]] = field(default_factory=dict)
    estimated: bool = False  # compute buffers estimated, not sized by ggml

    def add(self, component: str, device: str, nbytes: int) -> None:
        if nbytes:
            per = self.components.setdefault(component, {})
            per[device] = per.get(device, 0) + int(nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(sum(d.values()) for d in self.components.values())

    def by_device(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for per in self.components.values():
            for dev, n in per.items():
                out[dev] = out.get(dev, 0) + n
        return out

    def to_dict(self) -> dict:
        d: dict = {"total_bytes": self.total_bytes}
        for c in COMPONENTS:
            if c in self.components:
                d[c] = dict(self.components[c])
        d["by_device"] = self.by_device()
        if self.estimated:
            d["compute_estimated"] = True
        return d


def kv_cells(n_ctx: int, spec_n_max: int) -> int:
    """KV cells per slot: the context, and with speculation the n_max + 2 positions a
    verify or draft batch may run past the committed ones."""
    return n_ctx + (spec_n_max + 2 if spec_n_max > 0 else 0)


def layer_states(hp: HParams, *, n_ctx: int, n_parallel: int, type_k: str = "f16",
                 type_v: str = "f16", spec_n_max: int = 0,
                 rollback: str | None = None) -> list[dict[str, int]]:
    """Bytes of caches and states each trunk block puts on its own device, by component:
    the arithmetic :func:`plan_memory` sums per device, and that the fit
    (:mod:`pyggspec.memory.fit`) moves layer by layer, so both price a layer alike."""
    spec = spec_n_max > 0
    cells = kv_cells(n_ctx, spec_n_max)
    tk, tv = ggml_type(type_k), ggml_type(type_v)
    kv_row = tk.row_bytes(hp.n_embd_k_gqa) + tv.row_bytes(hp.n_embd_v_gqa)
    row = (hp.n_embd_r + hp.n_embd_s) * 4
    state = row * n_parallel
    # a spare plane for checkpoint rollback; with snapshots the arena where the verify
    # graph writes the state after each of its rows (RecurrentState)
    planes = 2 if spec and rollback != "snapshot" else 1
    arena = 0
    if spec and rollback == "snapshot":
        arena = n_parallel * most_verify_rows(n_parallel, spec_n_max)
    rows, _ = arena_layout(n_parallel, planes, arena, hp.ssm_d_inner, hp.n_embd_s)
    out: list[dict[str, int]] = []
    for il in range(hp.n_layer):
        if hp.is_recurrent(il):
            out.append({"recurrent": state, "checkpoints": state * (planes - 1),
                        "snapshots": row * (rows - n_parallel * planes)})
        else:
            out.append({"kv": kv_row * cells * n_parallel})
    return out


def mtp_kv_bytes(mtp_hp: HParams, *, n_ctx: int, n_parallel: int, spec_n_max: int,
                 type_k: str = "f16", type_v: str = "f16") -> int:
    """The MTP head's KV cache (on the head's device), all slots."""
    mk, mv = ggml_type(type_k), ggml_type(type_v)
    row = mk.row_bytes(mtp_hp.n_embd_k_gqa) + mv.row_bytes(mtp_hp.n_embd_v_gqa)
    return row * kv_cells(n_ctx, spec_n_max) * n_parallel


def _ffn_width(hp: HParams) -> int:
    """Widest FFN activation per token (MoE: the routed experts; the shared expert's
    buffers are reused after them)."""
    if hp.is_moe:
        return hp.n_ff_exp * hp.n_expert_used
    return hp.n_ff


def plan_memory(hp: HParams, n_vocab: int, weights_by_device: dict[str, int],
                layer_devices: list[str] | tuple[str, ...], output_device: str, *, n_ctx: int,
                n_parallel: int, n_ubatch: int = 512,
                type_k: str = "f16", type_v: str = "f16", spec_n_max: int = 0,
                rollback: str | None = None, mtp_device: str | None = None,
                mtp_hp: HParams | None = None, mtp_type_k: str = "f16",
                mtp_type_v: str = "f16", mtp: bool = True,
                compute: dict[str, int] | None = None,
                step_graphs: dict[str, int] | None = None) -> MemoryPlan:
    """What an engine with these options allocates (``spec_n_max`` > 0: speculative;
    ``mtp``: the MTP head drafts, with its cache).

    ``compute``: compute buffer bytes per device as ggml sizes the worst-case graphs
    (:func:`pyggspec.compute.size_compute`); None: a rough estimate (``compute_estimated``).
    ``step_graphs``: with several devices, the bound on the per-step graphs' own buffers
    (``ComputePlan.steps``; allocated when first run, never more).
    """
    plan = MemoryPlan()
    for dev, n in weights_by_device.items():
        plan.add("weights", dev, n)
    spec = spec_n_max > 0
    for il, per in enumerate(layer_states(hp, n_ctx=n_ctx, n_parallel=n_parallel,
                                          type_k=type_k, type_v=type_v,
                                          spec_n_max=spec_n_max, rollback=rollback)):
        for component, n in per.items():
            plan.add(component, layer_devices[il], n)
    if spec and mtp:
        plan.add("mtp_kv", mtp_device or output_device,
                 mtp_kv_bytes(mtp_hp or hp, n_ctx=n_ctx, n_parallel=n_parallel,
                              spec_n_max=spec_n_max, type_k=mtp_type_k, type_v=mtp_type_v))
    for dev, n in (step_graphs or {}).items():
        plan.add("step_graphs", dev, n)
    if compute is not None:
        for dev, n in compute.items():
            plan.add("compute", dev, n)
        return plan
    plan.estimated = True
    # no binding to size the graphs with: a rough estimate. Per token of the largest
    # ubatch the attention mask row plus the live activations of the widest layer (the
    # gated-delta-net's conv channels, or the FFN), and the logits rows of a step
    vocab_row = 4 * n_vocab
    rows = n_parallel * (_padded(spec_n_max + 1) if spec else 1)
    ub = min(n_ubatch, n_ctx)
    mask = 2 * min(n_ctx, 2 * max(ub, 256))
    act = 4 * max(2.5 * hp.conv_dim, 3 * _ffn_width(hp))
    plan.add("compute", output_device, int(ub * (mask + act)) + rows * vocab_row)
    if spec and mtp:
        mh = mtp_hp or hp
        plan.add("compute", mtp_device or output_device,
                 int(ub * (mask + 2048 + 4 * 7 * _ffn_width(mh))) + n_parallel * vocab_row)
    return plan


def planned_n_ctx(cfg: EngineConfig, hp: HParams) -> int:
    """The context an engine with ``cfg`` runs: ``-c``, capped at the training context;
    ``-c 0`` is the training context (llama.cpp's meaning; 4096 where the file has none)."""
    if cfg.n_ctx == 0:
        return hp.n_ctx_train or 4096
    return min(cfg.n_ctx, hp.n_ctx_train or cfg.n_ctx)


def planned_rollback(cfg: EngineConfig) -> str | None:
    """The recurrent-state rollback planned for ``cfg`` before anything is measured: snapshots
    unless checkpoints are asked for (the engine may still fall back to checkpoints when
    snapshots do not fit); None without speculation."""
    if not cfg.speculative:
        return None
    return "checkpoint" if cfg.spec.rollback == "checkpoint" else "snapshot"


def coupled_drafts(cfg: EngineConfig) -> bool:
    """Whether drafts of sampling chains are drawn through the chains in the MTP graph (the
    compute sizing then includes those chains)."""
    return bool(cfg.uses_mtp and cfg.spec.draft_sampling == "coupled"
                and cfg.draft_backend_sampling and cfg.spec.p_min == 0)


def graph_options(cfg: EngineConfig, hp: HParams, rollback: str | None) -> GraphOptions:
    """The shapes of the graphs an engine with ``cfg`` builds (what its compute buffers are
    sized for), with ``rollback`` as decided (:func:`planned_rollback` or the engine's)."""
    from pyggspec.compute import GraphOptions

    spec_n_max = cfg.spec.n_max if cfg.speculative else 0
    return GraphOptions(planned_n_ctx(cfg, hp), cfg.n_parallel, cfg.n_ubatch, spec_n_max,
                        rollback if spec_n_max else None, cfg.type_k, cfg.type_v,
                        cfg.mtp_type_k, cfg.mtp_type_v, device_argmax=cfg.draft_backend_sampling,
                        draft_vocab=cfg.spec.draft_vocab if spec_n_max else 0,
                        mtp=cfg.uses_mtp)


def plan_engine_memory(cfg: EngineConfig, hp: HParams, n_vocab: int, placement: Placement,
                       weights_by_device: Mapping[str, int], *, rollback: str | None,
                       mtp_device: str | None = None, mtp_hp: HParams | None = None,
                       compute: ComputePlan | None = None) -> MemoryPlan:
    """What an engine built from ``cfg`` allocates, by component and device: the one planner
    ``pyggspec inspect`` (:func:`pyggspec.inspect.inspect_model`) and the engine share.

    ``placement``: the trunk's (layer and output devices); ``weights_by_device``: the weight
    bytes (planned, or loaded); ``rollback``: :func:`planned_rollback` or the engine's choice;
    ``mtp_device``/``mtp_hp``: the MTP head's device and, for a separate MTP file, its hparams;
    ``compute``: ggml's sizing of the worst-case graphs (:func:`graph_options`), None for a
    rough estimate (``compute_estimated``).
    """
    plan = plan_memory(hp, n_vocab, dict(weights_by_device), placement.layer_devices,
                       placement.output_device, n_ctx=planned_n_ctx(cfg, hp),
                       n_parallel=cfg.n_parallel, n_ubatch=cfg.n_ubatch, type_k=cfg.type_k,
                       type_v=cfg.type_v, spec_n_max=cfg.spec.n_max if cfg.speculative else 0,
                       rollback=rollback, mtp_device=mtp_device, mtp_hp=mtp_hp,
                       mtp_type_k=cfg.mtp_type_k, mtp_type_v=cfg.mtp_type_v,
                       mtp=cfg.uses_mtp, compute=compute.by_device() if compute is not None else None,
                       step_graphs=compute.steps if compute is not None else None)
    for dev, n in (compute.sampling if compute is not None else {}).items():
        plan.add("sampling", dev, n)
    return plan


def _padded(t: int) -> int:
    return padded_rows(t, 1)

