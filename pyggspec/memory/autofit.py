"""``--fit`` for an opened model: its parts priced by the memory plan, fitted, then checked.

:func:`fit_config` prices what a fit can move from the same functions the engine's memory
plan sums (:func:`pyggspec.weights.placement.layer_weights` for the weights per block,
:func:`pyggspec.memory.plan.layer_states` / :func:`~pyggspec.memory.plan.mtp_kv_bytes` for
caches and states, ggml's sizing of the worst-case graphs for the compute buffers), lets the
pure planner (:mod:`pyggspec.memory.fit`) choose, and then predicts the chosen config in full
with :func:`~pyggspec.memory.plan.plan_engine_memory` (what ``pyggspec inspect`` reports):
a device the full plan finds over its budget is priced again with what the plan found, and
fitted again, so the table's numbers are the plan's, not the planner's shortcut.

Nothing here runs without an offload device, or when the user set everything a fit could
change: then it returns None at once (CPU-only start-up pays nothing for ``--fit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyggspec.config import EngineConfig
from pyggspec.memory.fit import (
    FitDevice,
    FitError,
    FitNeeds,
    FitRequest,
    FitResult,
    block_ranges,
    fit,
    format_table,
    margins,
    place,
)
from pyggspec.memory.plan import (
    coupled_drafts,
    graph_options,
    layer_states,
    mtp_kv_bytes,
    plan_engine_memory,
    planned_n_ctx,
    planned_rollback,
)

ROUNDS = 3  # full-plan checks before giving up (each adds what the shortcut missed)
REFINE = 2  # steps back towards the devices tried when the full plan leaves room


@dataclass(frozen=True)
class Fitted:
    """A fitted config, the planner's choice and the full plan's bytes per device."""

    config: EngineConfig
    result: FitResult
    by_device: Mapping[str, int]  # plan_engine_memory's total per device, CPU included
    n_trunk: int

    def rows(self) -> list[dict[str, object]]:
        """The table's rows: each offload device, then the CPU."""
        r = self.result
        rows: list[dict[str, object]] = []
        for d in r.devices:
            rows.append({"device": d.name, "layers": block_ranges(r.layer_devices, d.name,
                                                                  self.n_trunk) or "-",
                         "output": "yes" if r.output_device == d.name else "",
                         "predicted MiB": _mib(self.by_device.get(d.name, 0)),
                         "free MiB": _mib(d.free), "target MiB": _mib(d.margin)})
        moe = f" (experts of 0-{r.n_cpu_moe - 1})" if r.n_cpu_moe else ""
        rows.append({"device": "CPU", "layers": (block_ranges(r.layer_devices, "CPU",
                                                              self.n_trunk) or "-") + moe,
                     "output": "yes" if r.output_device == "CPU" else "",
                     "predicted MiB": _mib(self.by_device.get("CPU", 0)), "free MiB": "-",
                     "target MiB": "-"})
        return rows

    def header(self) -> str:
        r = self.result
        what = f"-ngl {r.n_gpu_layers} -ncmoe {r.n_cpu_moe} -c {r.n_ctx}"
        if "--spec-rollback" in r.changed:
            what += " --spec-rollback checkpoint"
        how = (f"set by --fit: {', '.join(dict.fromkeys(r.changed))}" if r.changed
               else "fits as given")
        return f"fit: {what} ({how})"

    def table(self) -> str:
        return format_table(self.rows(), self.header())

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {"n_gpu_layers": r.n_gpu_layers, "n_cpu_moe": r.n_cpu_moe, "n_ctx": r.n_ctx,
                "spec_rollback": self.config.spec.rollback if self.config.speculative else None,
                "changed": list(dict.fromkeys(r.changed)), "rows": self.rows(),
                "layer_devices": list(r.layer_devices), "output_device": r.output_device,
                "by_device": dict(self.by_device)}


def free_parts(cfg: EngineConfig) -> tuple[bool, bool, bool]:
    """What the user left to the fit: the layer count (``-ngl`` unset or ``auto``), the
    experts (no ``-ot``/``-cmoe``/``-ncmoe``) and the context (``-c 0``)."""
    return (cfg.n_gpu_layers in (None, "auto"), not cfg.override_tensor and not cfg.cpu_moe,
            cfg.n_ctx == 0)


def fit_config(model: Any, cfg: EngineConfig, devices: Sequence[str], *,
               device: str | None = None, include_mtp: bool = True,
               free: Mapping[str, int] | None = None) -> Fitted | None:
    """``cfg`` fitted to the free memory of the offload devices (``devices``: the names
    ggml lists, "CPU" among them; ``device``: ``-dev``, None for every non-CPU one), or None
    when there is nothing to fit. ``free``: bytes free per device (None: as each reports).
    A :class:`~pyggspec.memory.fit.FitError` when nothing left unset makes it fit."""
    from pyggspec.weights.placement import resolve_n_gpu_layers, select_offload_devices

    if not cfg.fit:
        return None
    offload = select_offload_devices(devices, device)
    hp = model.trunk.hparams
    ngl_free, moe_free, ctx_free = free_parts(cfg)
    moe_free = moe_free and hp.is_moe
    ngl = None if ngl_free else resolve_n_gpu_layers(cfg.n_gpu_layers, hp.n_layer_all)
    if not offload or ngl == 0 or not (ngl_free or moe_free or ctx_free):
        return None
    if free is None:
        from pyggspec.ggml.device import get_device

        free = {name: get_device(name).memory()[0] for name in offload}
    fit_devices = [FitDevice(name, int(free[name]), m)
                   for name, m in zip(offload, margins(cfg.fit_target, len(offload)))]
    price = _Pricer(model, devices, device, include_mtp)
    parts = (ngl_free, moe_free, ctx_free)
    rollback_free = (cfg.speculative and cfg.spec.rollback == "auto"
                     and any(hp.is_recurrent(il) for il in range(hp.n_layer)))
    best: Fitted | None = None
    failed: FitError | None = None
    try:
        best = _fit_for(model, cfg, devices, device, include_mtp, fit_devices, price, ngl,
                        parts)
    except FitError as e:
        if not rollback_free:
            raise
        failed = e
    if rollback_free and (best is None or {"-ngl", "-ncmoe"} & set(best.result.changed)):
        # snapshot planes (a verify's n_max + 1 states per slot) made weights move, or
        # nothing fit: checkpoint rollback (two planes) where that keeps more weights on
        # the devices -- a replay after a rejection costs less than weights read from host
        # memory every step
        ck_cfg = cfg.replace(spec=replace(cfg.spec, rollback="checkpoint"))
        try:
            ck = _fit_for(model, ck_cfg, devices, device, include_mtp, fit_devices, price,
                          ngl, parts)
        except FitError:
            ck = None
        if ck is not None and (best is None or _kept(ck.result) > _kept(best.result)):
            r = replace(ck.result, changed=(*ck.result.changed, "--spec-rollback"))
            best = Fitted(ck.config, r, ck.by_device, ck.n_trunk)
    if best is None:
        assert failed is not None
        raise failed
    return best


def _kept(r: FitResult) -> tuple[int, int]:
    """The weights a fit keeps on the devices (larger is better): layers, then experts.
    A context cut is not counted: as in llama.cpp's order it is the cheap give, and a few
    hundred more tokens of an unset -c are not worth the snapshots' speed."""
    return (r.n_gpu_layers, -r.n_cpu_moe)


def _fit_for(model: Any, cfg: EngineConfig, devices: Sequence[str], device: str | None,
             include_mtp: bool, fit_devices: Sequence[FitDevice], price: _Pricer,
             ngl: int | None, parts: tuple[bool, bool, bool]) -> Fitted:
    """The fit of ``cfg`` (its rollback as planned) to ``fit_devices``: planner, then the
    full plan's check, then the refinement (see the module docstring)."""
    hp = model.trunk.hparams
    ngl_free, moe_free, ctx_free = parts
    n_max = planned_n_ctx(cfg, hp)
    base = cfg.replace(n_gpu_layers=cfg.n_gpu_layers if ngl is not None else "all")
    weights = _layer_weights(model, base, devices, device, include_mtp)
    rollback = planned_rollback(cfg)
    low = min(cfg.fit_ctx, n_max)
    extra: dict[str, int] = {}

    def compute_at(n_ctx: int) -> dict[str, int]:
        """ggml's sizing at the all-on-device placement: at the asked context, and, once a
        cut context is priced, at -fitc too (linear in the cells between the two)."""
        points = {n_max} if n_ctx == n_max or not ctx_free else {n_max, low}
        return _interpolate({c: price.compute(base.replace(n_ctx=c)) for c in points}, n_ctx)

    def needs_at(n_ctx: int) -> FitNeeds:
        states = [sum(per.values()) for per in layer_states(
            hp, n_ctx=n_ctx, n_parallel=cfg.n_parallel, type_k=cfg.type_k, type_v=cfg.type_v,
            spec_n_max=cfg.spec.n_max if cfg.speculative else 0, rollback=rollback)]
        states += [0] * (hp.n_layer_all - hp.n_layer)
        if cfg.uses_mtp and hp.n_layer_all > hp.n_layer:
            owner = model.mtp_owner
            states[hp.n_layer] += mtp_kv_bytes(owner.hparams if owner is not None else hp,
                                               n_ctx=n_ctx, n_parallel=cfg.n_parallel,
                                               spec_n_max=cfg.spec.n_max, type_k=cfg.mtp_type_k,
                                               type_v=cfg.mtp_type_v)
        compute = compute_at(n_ctx)
        for d, n in extra.items():
            compute[d] = compute.get(d, 0) + n
        return FitNeeds(weights[0], weights[1], tuple(states), weights[2], weights[3],
                        compute)

    req = FitRequest(n_max, ctx_free, cfg.fit_ctx, ngl, None if moe_free else 0,
                     hp.n_layer if hp.is_moe else 0)
    for _ in range(ROUNDS):
        result = fit(needs_at, fit_devices, req)
        fitted = _apply(cfg, result, ngl_free, moe_free, ctx_free)
        by_device = price.by_device(fitted)
        over = {d.name: by_device.get(d.name, 0) - result.used.get(d.name, 0)
                for d in fit_devices
                if result.used.get(d.name) and by_device.get(d.name, 0) > d.budget}
        if not over:
            best = Fitted(fitted, result, by_device, hp.n_layer)
            return _refine(best, price, cfg, needs_at, fit_devices, parts)
        for d, n in over.items():  # what the planner's shortcut missed, priced in again
            extra[d] = extra.get(d, 0) + max(n, 1 << 20)
    worst = max(over, key=lambda d: over[d])
    raise FitError("--fit", f"{worst}: the full memory plan stays over the budget after "
                   f"{ROUNDS} fits; set -ngl / -c by hand or --fit off")


def _refine(best: Fitted, price: _Pricer, cfg: EngineConfig, needs_at: Any,
            fit_devices: Sequence[FitDevice], free: tuple[bool, bool, bool]) -> Fitted:
    """Where the full plan leaves room (the planner prices compute buffers at the all-on-
    device placement, which moved weights shrink), give back one block's experts or one
    layer at a time while the full plan still fits."""
    ngl_free, moe_free, _ = free
    n_all = price.model.trunk.hparams.n_layer_all
    for _ in range(REFINE):
        r = best.result
        if moe_free and r.n_cpu_moe > max(0, n_all + 1 - r.n_gpu_layers):
            ngl, moe = r.n_gpu_layers, r.n_cpu_moe - 1
        elif ngl_free and "-ngl" in r.changed and r.n_gpu_layers <= n_all:
            ngl, moe = r.n_gpu_layers + 1, r.n_cpu_moe
        else:
            break
        changed = tuple(c for c in r.changed if not (c == "-ncmoe" and moe == 0
                                                      or c == "-ngl" and ngl > n_all))
        cand = place(needs_at(r.n_ctx), fit_devices, ngl, moe, r.n_ctx, changed)
        fitted = _apply(cfg, cand, *free)
        by_device = price.by_device(fitted)
        if any(by_device.get(d.name, 0) > d.budget for d in fit_devices
               if by_device.get(d.name)):
            break
        best = Fitted(fitted, cand, by_device, best.n_trunk)
    return best


def _apply(cfg: EngineConfig, r: FitResult, ngl_free: bool, moe_free: bool,
           ctx_free: bool) -> EngineConfig:
    """``cfg`` with the fit's choices for what was left to it (only those)."""
    from pyggspec.weights.placement import n_cpu_moe_patterns

    changes: dict[str, Any] = {}
    if ngl_free:
        changes["n_gpu_layers"] = r.n_gpu_layers
    if moe_free and r.n_cpu_moe:
        changes["override_tensor"] = tuple(n_cpu_moe_patterns(r.n_cpu_moe))
    if ctx_free:
        changes["n_ctx"] = r.n_ctx
    return cfg.replace(**changes)


def _placements(model: Any, cfg: EngineConfig, devices: Sequence[str], device: str | None,
                include_mtp: bool) -> list[Any]:
    """The trunk's placement and the MTP file's (as :func:`pyggspec.inspect.inspect_model`
    plans them) for ``cfg``."""
    from pyggspec.weights import plan_placement

    kw: dict[str, Any] = {"n_gpu_layers": cfg.n_gpu_layers, "device": device,
                          "override_tensor": list(cfg.override_tensor), "cpu_moe": cfg.cpu_moe}
    out = [plan_placement(model.trunk, devices, include_mtp=include_mtp, **kw)]
    if model.mtp_file is not None and cfg.uses_mtp:
        out.append(plan_placement(model.mtp_file, devices, **kw))
    return out


def _layer_weights(model: Any, cfg: EngineConfig, devices: Sequence[str], device: str | None,
                   include_mtp: bool) -> tuple[tuple[int, ...], tuple[int, ...], int,
                                               dict[str, int]]:
    """Per-block dense and expert bytes, output bytes and pinned bytes, both files."""
    from pyggspec.weights.placement import layer_weights

    n = model.trunk.hparams.n_layer_all
    dense, experts, output, pinned = [0] * n, [0] * n, 0, {}
    files = [model.trunk] + ([model.mtp_file] if model.mtp_file is not None else [])
    for f, p in zip(files, _placements(model, cfg, devices, device, include_mtp)):
        lw = layer_weights(f, p)
        for il in range(min(n, len(lw.dense))):
            dense[il] += lw.dense[il]
            experts[il] += lw.experts[il]
        output += lw.output
        for d, b in lw.pinned.items():
            pinned[d] = pinned.get(d, 0) + b
    return tuple(dense), tuple(experts), output, pinned


def _interpolate(sized: Mapping[int, Mapping[str, int]], n_ctx: int) -> dict[str, int]:
    """Compute bytes at ``n_ctx`` from sizings at one or two contexts (linear in the
    attended cells between them, as the masks and attention scores are)."""
    (c0, lo), *rest = sorted(sized.items())
    if not rest:
        return dict(lo)
    c1, hi = rest[-1]
    t = (n_ctx - c0) / (c1 - c0) if c1 != c0 else 0.0
    return {d: round(lo.get(d, 0) + t * (hi.get(d, 0) - lo.get(d, 0)))
            for d in set(lo) | set(hi)}


class _Pricer:
    """ggml's compute sizing and the full memory plan of candidate configs, each sized
    once (a sizing builds every worst-case graph: the costly part of a fit)."""

    def __init__(self, model: Any, devices: Sequence[str], device: str | None,
                 include_mtp: bool) -> None:
        self.model, self.devices, self.device = model, devices, device
        self.include_mtp = include_mtp
        self._sized: dict[tuple, Any] = {}

    def placements(self, cfg: EngineConfig) -> list[Any]:
        return _placements(self.model, cfg, self.devices, self.device, self.include_mtp)

    def sizing(self, cfg: EngineConfig) -> Any:
        """The :class:`~pyggspec.compute.ComputePlan` of ``cfg``, memoised on what decides
        it here (the layer count, the overrides, the context, the rollback)."""
        from pyggspec.compute import predict_compute
        from pyggspec.weights.placement import resolve_n_gpu_layers

        hp = self.model.trunk.hparams
        key = (resolve_n_gpu_layers(cfg.n_gpu_layers, hp.n_layer_all), cfg.override_tensor,
               planned_n_ctx(cfg, hp), planned_rollback(cfg))
        if key not in self._sized:
            ps = self.placements(cfg)
            self._sized[key] = predict_compute(
                self.model, graph_options(cfg, hp, planned_rollback(cfg)), ps[0],
                ps[1] if len(ps) > 1 else None, backend_sampling=cfg.backend_sampling,
                coupled_drafts=coupled_drafts(cfg), sampling=cfg.sampling)
        return self._sized[key]

    def compute(self, cfg: EngineConfig) -> dict[str, int]:
        """Compute buffers per device: the reserved ones and the step schedulers'."""
        plan = self.sizing(cfg)
        out = plan.by_device()
        for d, n in plan.steps.items():
            out[d] = out.get(d, 0) + n
        return out

    def by_device(self, cfg: EngineConfig) -> dict[str, int]:
        """The full memory plan of ``cfg`` per device (weights, caches, states, compute),
        as ``pyggspec inspect`` predicts it (CPU weight repacking aside: host memory)."""
        from pyggspec.weights import sum_bytes

        hp = self.model.trunk.hparams
        ps = self.placements(cfg)
        mtp_dev = None
        if cfg.uses_mtp:
            mtp_dev = ps[-1].tensor_devices.get(f"blk.{hp.n_layer}.nextn.eh_proj.weight")
        mf = self.model.mtp_file
        plan = plan_engine_memory(cfg, hp, self.model.trunk.n_vocab, ps[0], sum_bytes(*ps),
                                  rollback=planned_rollback(cfg), mtp_device=mtp_dev,
                                  mtp_hp=mf.hparams if mf is not None else None,
                                  compute=self.sizing(cfg))
        return plan.by_device()


def predict_by_device(model: Any, cfg: EngineConfig, devices: Sequence[str],
                      device: str | None = None, include_mtp: bool = True) -> dict[str, int]:
    """The full memory plan of ``cfg`` per device, as the fit checks its choice."""
    return _Pricer(model, devices, device, include_mtp).by_device(cfg)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


__all__ = ["FitError", "Fitted", "fit_config", "free_parts", "predict_by_device"]
