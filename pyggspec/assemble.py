"""Putting an engine together: model file -> placement -> weights -> devices, caches and
graphs, each sized before anything large is allocated.

:func:`assemble` is the one place that knows the order: open the model, place and load the
weights, open the devices, plan memory (and degrade snapshot rollback to checkpoints when
the planned states do not fit), allocate caches and states, build the runners and the
drafter, reserve the worst-case compute buffers. What it returns (:class:`Parts`) is owned
by the engine; the worker runs on it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pyggspec.compute import reserve_compute
from pyggspec.config import EngineConfig
from pyggspec.errors import OutOfMemory, PyggspecError
from pyggspec.ggml.device import Backend, cpu_device, devices, get_device
from pyggspec.ggml.sched import BackendScheduler
from pyggspec.memory import KVCache, RecurrentState, SlotMemory
from pyggspec.memory.autofit import fit_config
from pyggspec.memory.plan import graph_options, planned_n_ctx
from pyggspec.memory.recurrent import arena_layout
from pyggspec.modelfile import open_model
from pyggspec.models.qwen35 import Target
from pyggspec.sampling import graph_sampling
from pyggspec.sampling.session import SequenceSamplers

log = logging.getLogger("pyggspec.engine")

# the flag to change when a start-up allocation fails, by what was being allocated
_HINTS = {
    "weights": "lower -ngl or move experts with -ncmoe (or leave them unset with --fit on; "
               "-fitt keeps more free)",
    "kv": "lower -c or -np",
    "recurrent": "lower -np or --spec-draft-n-max, or use --spec-rollback checkpoint",
    "mtp": "lower -c or -np, or run without --spec-type draft-mtp",
    "compute": "lower -ub / -b or -np",
    "sampling": "use --no-backend-sampling",
}


@contextlib.contextmanager
def _hint(part: str) -> Iterator[None]:
    """An out-of-memory error raised while allocating ``part`` names the flag to change
    (ggml's buffers do not know what they are for; assembly does)."""
    try:
        yield
    except OutOfMemory as e:
        raise e.with_hint(_HINTS[part]) from None


def _device_accepts(device: str, info) -> bool:
    """Placement's question to the binding: can ``device`` hold this weight at all."""
    return _accepts(device, info.type_name, tuple(info.ne[: info.n_dims]))


@functools.lru_cache(maxsize=1024)
def _accepts(device: str, type_name: str, ne: tuple[int, ...]) -> bool:
    """Asked once per (device, type, shape): every layer repeats the same few shapes, and
    an RPC device answers each question over the network."""
    return get_device(device).accepts(type_name, ne)


@dataclass
class Parts:
    """Everything one engine owns, closed in reverse order of creation."""

    cfg: EngineConfig
    model: Any = None
    hp: Any = None
    n_vocab: int = 0
    n_ctx: int = 0
    placement: Any = None
    weights: Any = None
    backend_sampling: bool = False
    rollback: str | None = None
    kv: KVCache | None = None
    rs: RecurrentState | None = None
    mtp_kv: KVCache | None = None
    backends: list[Backend] = field(default_factory=list)
    sched: BackendScheduler | None = None
    mtp_sched: BackendScheduler | None = None
    memory_plan: Any = None
    fit: Any = None  # memory.autofit.Fitted when --fit chose something
    compute: Any = None
    step_rows: int = 0
    target: Target | None = None
    mtp: Any = None
    drafter: Any = None  # speculative.drafter.Drafters
    lengths: Any = None  # speculative.lengths.DraftLengths (None: fixed draft lengths)
    memory: SlotMemory | None = None
    samplers: SequenceSamplers | None = None
    closers: list = field(default_factory=list)

    def close(self) -> None:
        while self.closers:
            self.closers.pop().close()


def assemble(model_path: str, cfg: EngineConfig) -> Parts:
    """Build every part of an engine for ``cfg`` (see the module docstring)."""
    from pyggspec.weights import load_weights, plan_placement

    p = Parts(cfg)
    try:
        p.model = open_model(model_path, cfg.mtp_path)
        p.closers.append(p.model)
        trunk = p.model.trunk
        if not trunk.has_trunk:
            raise PyggspecError(model_path, "this is an MTP-only file; pass the trunk model "
                                "with -m and this file with --spec-draft-model")
        p.hp = hp = trunk.hparams
        p.n_vocab = trunk.n_vocab
        cfg.sampling.check_vocab(p.n_vocab)
        spec = cfg.spec
        grafted = False
        if cfg.uses_mtp and p.model.mtp_file is None:
            if trunk.mtp.status != "grafted":
                raise PyggspecError(model_path, f"no MTP head (nextn_predict_layers = "
                                    f"{hp.n_layer_nextn}); pass --spec-draft-model "
                                    "mtp-….gguf")
            grafted = True
        # a registered RPC device whose server is gone cannot take layers
        names = [d.name for d in devices() if d.reachable()]
        p.fit = fit_config(p.model, cfg, names, device=cfg.device, include_mtp=grafted)
        if p.fit is not None:  # what the user left unset, chosen to fit (--fit)
            p.cfg = cfg = p.fit.config
            log.info("%s", p.fit.table())
        p.n_ctx = planned_n_ctx(cfg, hp)
        if p.n_ctx < cfg.n_ctx:
            log.warning("-c %d is more than the model's training context; using %d",
                        cfg.n_ctx, hp.n_ctx_train)
        p.placement = plan_placement(trunk, names, cfg.n_gpu_layers, cfg.device,
                                     cfg.override_tensor, cfg.cpu_moe, include_mtp=grafted,
                                     accepts=_device_accepts)
        for name, dev in p.placement.refused.items():
            t = trunk.tensors[name]
            log.warning("%s cannot hold %s (%s, %.0f MiB) as an operand: keeping it on "
                        "the CPU", dev, name, t.type_name, t.nbytes / 2**20)
        with _hint("weights"):
            p.weights = load_weights(p.model, p.placement, use_mmap=cfg.use_mmap,
                                     progress=cfg.progress, repack=cfg.repack)
        p.closers.append(p.weights)
        # None: chains in the graph unless the logits are on the CPU (graph_sampling)
        p.backend_sampling = graph_sampling(cfg.backend_sampling, p.placement.output_device)
        if cfg.uses_mtp and spec.draft_head:
            with _hint("weights"):
                _add_draft_head(p, spec.draft_head)
        # verify/draft batches may run n_max + 2 positions past the committed ones
        kv_cells = graph_options(cfg, hp, None).kv_cells
        layer_dev = {il: get_device(p.placement.layer_devices[il]) for il in range(hp.n_layer)}
        attn = {il: d for il, d in layer_dev.items() if not hp.is_recurrent(il)}
        recr = {il: d for il, d in layer_dev.items() if hp.is_recurrent(il)}
        with _hint("kv"):
            p.kv = KVCache(attn, hp.n_embd_k_gqa, hp.n_embd_v_gqa, kv_cells, cfg.n_parallel,
                           cfg.type_k, cfg.type_v)
        p.closers.append(p.kv)
        p.rollback = _choose_rollback(cfg, hp, recr) if cfg.speculative else None
        used = {p.placement.output_device, *p.placement.layer_devices[: hp.n_layer]}
        for name in sorted(used - {"CPU"}):
            p.backends.append(get_device(name).open())
        p.backends.append(cpu_device().open(cfg.threads))
        p.closers.extend(p.backends)
        p.sched = BackendScheduler(p.backends)
        p.closers.append(p.sched)
        # the MTP head runs on its own scheduler (target and draft graphs never evict
        # each other's allocation)
        if cfg.uses_mtp:
            p.mtp_sched = BackendScheduler(p.backends)
            p.closers.append(p.mtp_sched)
        p.memory_plan = plan_memory(p)
        _check_fit(p)
        # one plane per slot and the arena of a verify batch's states (snapshots), or two
        # planes (checkpoints)
        opts = graph_options(cfg, hp, p.rollback)
        with _hint("recurrent"):
            p.rs = RecurrentState(recr, hp.n_embd_r, hp.n_embd_s, cfg.n_parallel, opts.planes,
                                  arena_rows=opts.arena_rows, d_inner=hp.ssm_d_inner)
        p.closers.append(p.rs)
        p.target = Target(hp, p.weights, p.kv, p.rs, p.sched)
        p.target.step_rows = p.step_rows
        p.closers.append(p.target)
        if cfg.uses_mtp:
            with _hint("mtp"):
                _init_mtp(p, kv_cells)
        p.memory = SlotMemory(p.kv, p.rs, p.mtp_kv)
        if cfg.speculative:
            p.drafter = _make_drafters(p)
            if spec.calibrated:
                from pyggspec.speculative.lengths import DraftLengths

                p.lengths = DraftLengths(spec.n_max, p.drafter.names)
        # compute buffers at their worst case now, so they never grow while generating
        with _hint("compute"):
            reserve_compute(p.compute, p.target, p.mtp)
        out_dev = get_device(p.placement.output_device)
        with _hint("sampling"):
            p.samplers = SequenceSamplers(cfg.sampling, p.n_vocab, out_dev,
                                          p.backend_sampling, p.target.register_plan,
                                          output_split=p.placement.output_split)
        return p
    except BaseException:
        p.close()
        raise


def plan_memory(p: Parts):
    """Every component predicted before the states are allocated, by the planner
    ``pyggspec inspect`` uses too; compute buffers from ggml's sizing of the worst-case
    graphs on this engine's schedulers (reserved for real once the states exist, so the
    engine's ``memory()`` reports the same numbers)."""
    from pyggspec.compute import sampling_sizing, size_compute
    from pyggspec.memory.plan import coupled_drafts, plan_engine_memory

    cfg, hp = p.cfg, p.hp
    mtp_dev = mtp_hp = None
    if cfg.uses_mtp:
        mtp_dev = p.weights.device_of(f"blk.{hp.n_layer}.nextn.eh_proj.weight")
        mtp_hp = p.model.mtp_file.hparams if p.model.mtp_file is not None else None
    opts = graph_options(cfg, hp, p.rollback)
    layer_devs = {il: get_device(p.placement.layer_devices[il]) for il in range(hp.n_layer)}
    p.step_rows = opts.step_rows  # graphs up to this many rows keep their scheduler
    sizing = sampling_sizing(p.n_vocab, p.placement, p.weights, hp.n_layer,
                             backend_sampling=cfg.backend_sampling,
                             coupled_drafts=coupled_drafts(cfg), default=cfg.sampling)
    p.compute = size_compute(opts, hp, p.weights, layer_devs, p.sched, p.mtp_sched, mtp_hp,
                             mtp_dev, sizing)
    return plan_engine_memory(cfg, hp, p.n_vocab, p.placement, p.weights.bytes_by_device(),
                              rollback=p.rollback,
                              mtp_device=mtp_dev.name if mtp_dev is not None else None,
                              mtp_hp=mtp_hp, compute=p.compute)


def _check_fit(p: Parts) -> None:
    """Say so before allocating when states do not fit a device; snapshots degrade to
    checkpoints first (llama.cpp would run out of memory at allocation instead)."""
    for _ in range(2):
        too_big = []
        for dev_name, n in p.memory_plan.by_device().items():
            dev = get_device(dev_name)
            free, total = dev.memory()
            # weights are allocated (or mapped) already: count what is still to come
            need = n - p.memory_plan.components.get("weights", {}).get(dev_name, 0)
            if total and need > free:
                too_big.append((dev_name, need, free))
        if not too_big:
            return
        if p.rollback == "snapshot" and p.cfg.spec.rollback == "auto":
            p.rollback = "checkpoint"
            p.memory_plan = plan_memory(p)
            continue
        dev_name, need, free = too_big[0]
        raise PyggspecError(dev_name, f"needs {need / 2**20:.1f} MiB more for caches, "
                            f"states and compute but only {free / 2**20:.1f} MiB are free; "
                            "lower -c/--parallel/--spec-draft-n-max or use "
                            "--spec-rollback checkpoint")


def _choose_rollback(cfg: EngineConfig, hp, recr_devices: dict) -> str:
    """Snapshot planes when they fit on the devices holding the recurrent state, else
    checkpoints (two planes); an explicit choice is honoured."""
    want = cfg.spec.rollback
    if want in ("snapshot", "checkpoint"):
        return want
    opts = graph_options(cfg, hp, "snapshot")
    # the slots' rows and the arena of a verify batch's states after each of its rows
    rows, _ = arena_layout(cfg.n_parallel, opts.planes, opts.arena_rows, hp.ssm_d_inner,
                           hp.n_embd_s)
    need: dict[str, int] = {}
    for dev in recr_devices.values():
        need[dev.name] = need.get(dev.name, 0) + (hp.n_embd_r + hp.n_embd_s) * 4 * rows
    for name, n in need.items():
        dev = get_device(name)
        free, total = dev.memory()
        if not dev.is_cpu and total and n > free:
            return "checkpoint"
    return "snapshot"


def _add_draft_head(p: Parts, type_name: str) -> None:
    """A lower-bit copy of the MTP head's LM head for drafting (--spec-draft-head): a
    draft step reads the whole vocabulary's head, most of its cost."""
    from pyggspec.ggml.quantize import quantizable
    from pyggspec.models.mtp import MtpWeights

    ok, why = quantizable(type_name)
    if not ok:
        raise PyggspecError("--spec-draft-head", why)
    w = MtpWeights(p.weights, p.hp.n_layer)
    p.weights.add_requantized(w.DRAFT_HEAD, w.head_name, type_name)


def _init_mtp(p: Parts, kv_cells: int) -> None:
    from pyggspec.models.mtp import Mtp, MtpWeights

    cfg, hp = p.cfg, p.hp
    block = hp.n_layer
    mtp_hp = p.model.mtp_file.hparams if p.model.mtp_file is not None else hp
    if mtp_hp.n_embd_out != hp.n_embd_out:
        raise PyggspecError(None, "MTP head width differs from the target's")
    w = MtpWeights(p.weights, block)
    dev = p.weights.device_of(f"blk.{block}.nextn.eh_proj.weight")
    p.mtp_kv = KVCache({block: dev}, mtp_hp.n_embd_k_gqa, mtp_hp.n_embd_v_gqa, kv_cells,
                       cfg.n_parallel, cfg.mtp_type_k, cfg.mtp_type_v, label="mtp-kv")
    p.closers.append(p.mtp_kv)
    p.mtp = Mtp(mtp_hp, w, p.mtp_kv, p.mtp_sched, device_argmax=cfg.draft_backend_sampling,
                draft_vocab=cfg.spec.draft_vocab, hot_rows=_hot_rows(p, w))
    p.mtp.step_rows = p.step_rows
    p.closers.append(p.mtp)


def _hot_rows(p: Parts, w) -> int:
    """Rows of the draft head's hot vocabulary (speculative/hot_vocab.py), 0 for none:
    off when asked, or beside the options that need the whole head (p_min's full softmax,
    a trimmed or requantized draft head)."""
    from pyggspec.speculative.hot_vocab import hot_rows

    spec = p.cfg.spec
    if spec.hot_vocab == 0 or spec.p_min > 0 or spec.draft_vocab or spec.draft_head:
        return 0
    head = w.head
    return hot_rows(head.ne[1], head.nb[1], sum(p.weights.bytes_by_device().values()),
                    spec.hot_vocab)


def _make_drafters(p: Parts):
    """The drafter kinds ``--spec-type`` names, behind the one interface."""
    from pyggspec.speculative.drafter import Drafters

    spec, kinds = p.cfg.spec, []
    for name in p.cfg.spec_types:
        if name == "draft-mtp":
            kinds.append(_make_mtp_drafter(p))
        elif name == "ngram-simple":
            from pyggspec.speculative.ngram_simple import NgramSimple

            kinds.append(NgramSimple(spec.ngram_simple_size_n, spec.ngram_simple_size_m,
                                     spec.ngram_simple_min_hits))
        elif name == "ngram-mod":
            from pyggspec.speculative.ngram_mod import NgramMod

            kinds.append(NgramMod(spec.ngram_mod_n_match, spec.ngram_mod_n_min,
                                  spec.ngram_mod_n_max))
    return Drafters(kinds)


def _make_mtp_drafter(p: Parts):
    """The drafter over the MTP head, writing its cache lengths through the slots' memory."""
    from pyggspec.models.mtp import MtpWeights
    from pyggspec.speculative.mtp import MtpDrafter

    cfg = p.cfg
    head_dev = p.weights.device_of(MtpWeights(p.weights, p.hp.n_layer).head_name)
    chains_in_graph = cfg.draft_backend_sampling and graph_sampling(cfg.backend_sampling,
                                                                    head_dev.name)
    mode = cfg.spec.draft_sampling
    hot = None
    if p.mtp.hot is not None:
        from pyggspec.speculative.hot_vocab import HotVocab

        hot = HotVocab(p.mtp.hot.pos.ne[1], p.mtp.hot.rows.ne[1])
    return MtpDrafter(p.mtp, p.memory, p.hp.n_embd, cfg.spec.n_min, cfg.spec.p_min,
                      cfg.spec.n_max, coupled=mode == "coupled", device=head_dev,
                      backend_sampling=chains_in_graph, probabilistic=mode == "probabilistic",
                      hot=hot)
