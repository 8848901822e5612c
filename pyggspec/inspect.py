"""What a GGUF is and what an engine built from it would use, without loading a weight.

:func:`inspect_model` describes a model (file, dims, layer kinds, MTP head, tokenizer), plans
its placement and CPU weight repacking as loading would, and predicts the memory an engine
with an :class:`~pyggspec.config.EngineConfig` allocates, with the engine's own planner
(:func:`pyggspec.memory.plan.plan_engine_memory`) and ggml's sizing of its worst-case graphs.
An MTP-only GGUF (``mtp-*.gguf``) is described as a head and what a trunk must match to pair
with it. ``pyggspec inspect`` prints these reports; nothing here needs a usable ggml binding
(without one the devices degrade to the CPU and compute buffers are estimated).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyggspec.config import EngineConfig
from pyggspec.errors import PyggspecError


class InspectUsageError(PyggspecError, ValueError):
    """Inputs that cannot be inspected together (on the command line, a usage error):
    ``flag`` names the option at fault, None the combination."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(None, message)
        self.flag = flag


def device_infos() -> tuple[list[Any] | None, str]:
    """The binding's device list, or (None, why) when the ggml binding is not usable here.

    Inspection must work without a backend, so any failure of the binding only degrades the
    device list to the CPU.
    """
    try:
        from pyggspec.ggml.device import list_devices

        return list(list_devices()), ""
    except PyggspecError as e:
        return None, e.message
    except Exception as e:  # noqa: BLE001 - a missing or half-built binding
        return None, f"{type(e).__name__}: {e}"


def offload_candidates(infos: Sequence[Any]) -> list[str]:
    """llama.cpp's default model devices: GPUs (RPC included), else integrated GPUs."""
    gpus = [d.name for d in infos if str(d.type).lower() == "gpu"]
    if gpus:
        return gpus
    return [d.name for d in infos if str(d.type).lower() == "igpu"]


def inspect_model(path: str | os.PathLike, cfg: EngineConfig | None = None, *,
                  pair: str | os.PathLike | None = None, auto_spec: bool = False,
                  tensors: bool = False, mmproj: str | os.PathLike | None = None,
                  mmproj_offload: bool = True) -> dict[str, Any]:
    """A JSON-ready report on the model at ``path`` as an engine built from ``cfg`` would use
    it (``cfg.mtp_path``: a separate MTP-only GGUF to pair with it).

    Speculation is planned when ``cfg`` asks for draft-mtp (an error without an MTP head)
    or, with ``auto_spec``, whenever the model has an MTP head (with ``cfg.spec``'s
    settings). ``tensors``: add ``tensor_list`` (every tensor with type, shape, device).

    ``path`` may be an MTP-only GGUF: then the report describes the head (see
    :func:`inspect_mtp_only`; ``pair`` names a trunk to check it against, and the
    report's ``mtp.pair.ok`` says whether they pair). ``pair`` with a trunk ``path``, or
    ``cfg.mtp_path`` with an MTP-only one, is an :class:`InspectUsageError`.

    ``mmproj``: a vision projector for the model; adds ``report["mmproj"]`` and its weights
    and compute buffer to ``report["memory"]`` (:mod:`pyggspec.vision.report`).
    """
    from pyggspec.modelfile import MtpOnlyFileError, open_model

    cfg = cfg if cfg is not None else EngineConfig()
    try:
        opened = open_model(path, cfg.mtp_path)
    except MtpOnlyFileError:
        if cfg.mtp_path is not None:
            raise InspectUsageError(f"{path} is an MTP-only file: check it against a trunk "
                                    "with --pair TRUNK, or inspect TRUNK --mtp FILE") from None
        if mmproj is not None:
            raise InspectUsageError("goes with the text model FILE, not an MTP-only one",
                                    flag="--mmproj")
        return inspect_mtp_only(path, pair, n_ctx=cfg.n_ctx, n_parallel=cfg.n_parallel,
                                type_k=cfg.mtp_type_k, type_v=cfg.mtp_type_v, tensors=tensors)
    if pair is not None:
        opened.close()
        raise InspectUsageError("is for an MTP-only FILE; pair a trunk FILE with --mtp",
                                flag="--pair")
    with opened as model:
        report = _inspect_opened(path, model, cfg, auto_spec, tensors)
    if mmproj is not None:
        from pyggspec.vision.report import add_projector

        add_projector(report, mmproj, path, offload=mmproj_offload)
    return report


def _inspect_opened(path: str | os.PathLike, model: Any, cfg: EngineConfig, auto_spec: bool,
                    tensors: bool) -> dict[str, Any]:
    from pyggspec.memory.plan import (
        coupled_drafts,
        graph_options,
        plan_engine_memory,
        planned_n_ctx,
        planned_rollback,
    )
    from pyggspec.modelfile import estimate_memory
    from pyggspec.weights import plan_placement, sum_bytes

    infos, why = device_infos()
    binding = infos is not None
    devices = ["CPU"] + [d.name for d in infos or () if str(d.type).lower() != "cpu"]
    device = cfg.device
    if device is None:
        candidates = offload_candidates(infos or ())
        device = ",".join(candidates) if candidates else "none"
    elif not binding:  # no binding to ask: take the named devices on trust
        devices += [d for d in device.split(",") if d and d not in ("none", "CPU")]
    trunk = model.trunk
    owner = model.mtp_owner
    if auto_spec and not cfg.speculative and owner is not None:
        cfg = cfg.replace(spec_type="draft-mtp")
    fitted = None  # --fit, as the engine would fit (nothing to do without a device)
    fit_warning = None
    if binding:
        from pyggspec.memory.autofit import fit_config
        from pyggspec.memory.fit import FitError

        free = {d.name: d.memory_free for d in infos or ()}
        try:
            fitted = fit_config(model, cfg, devices, device=device,
                                include_mtp=model.mtp_source == "grafted", free=free)
        except FitError:
            raise
        except Exception as e:  # noqa: BLE001 - a device that cannot be opened here
            fit_warning = f"--fit not planned ({type(e).__name__}: {e})"
        if fitted is not None:
            cfg = fitted.config
    kw = {"n_gpu_layers": cfg.n_gpu_layers, "device": device,
          "override_tensor": list(cfg.override_tensor), "cpu_moe": cfg.cpu_moe}
    p_trunk = plan_placement(trunk, devices, include_mtp=model.mtp_source == "grafted",
                             **kw)  # type: ignore[arg-type]
    placements = [p_trunk]
    if model.mtp_file is not None:
        placements.append(plan_placement(model.mtp_file, devices, **kw))  # type: ignore
    p_mtp = placements[1] if len(placements) > 1 else None
    weights = sum_bytes(*placements)
    repack = None  # CPU weight repacking as loading will do it (ggml asked per tensor)
    warn_repack = None
    if binding:
        try:
            from pyggspec.weights import plan_repack

            repack = plan_repack(model, p_trunk, p_mtp, repack=cfg.repack)
        except Exception as e:  # noqa: BLE001 - the CPU device cannot be asked here
            warn_repack = f"weight repacking not predicted ({type(e).__name__}: {e})"
        for d, n in (repack.extra_bytes if repack is not None else {}).items():
            weights[d] = weights.get(d, 0) + n
    # the engine's context is capped at the training context: plan for that one
    n_ctx_run = planned_n_ctx(cfg, trunk.hparams)
    mem = estimate_memory(trunk.hparams, weights, n_ctx_run, cfg.n_parallel,
                          mtp=owner.hparams if owner is not None else None, type_k=cfg.type_k,
                          type_v=cfg.type_v)
    report = _report(model, placements, mem, why if not binding else None)
    if warn_repack:
        report["warnings"].append(warn_repack)
    if fit_warning:
        report["warnings"].append(fit_warning)
    if fitted is not None:
        report["fit"] = fitted.to_dict()
        report["fit"]["table"] = fitted.table()
    if cfg.uses_mtp and owner is None:
        raise PyggspecError(path, "no MTP head (nextn_predict_layers = 0); pass --mtp "
                            "mtp-….gguf to plan speculation")
    n_max = cfg.spec.n_max if cfg.speculative else 0
    mtp_dev = None
    if cfg.uses_mtp:
        blk = trunk.hparams.n_layer
        mtp_dev = (p_mtp or p_trunk).tensor_devices.get(f"blk.{blk}.nextn.eh_proj.weight")
    if n_ctx_run < cfg.n_ctx:
        report["warnings"].append(f"-c {cfg.n_ctx} is more than the model's training "
                                  f"context; memory is planned for {n_ctx_run}")
    rollback = planned_rollback(cfg)
    sized = None  # the engine's worst-case graphs, sized by ggml (nothing loaded)
    if binding:
        try:
            from pyggspec.compute import predict_compute

            sized = predict_compute(model, graph_options(cfg, trunk.hparams, rollback), p_trunk,
                                    p_mtp, backend_sampling=cfg.backend_sampling,
                                    coupled_drafts=coupled_drafts(cfg))
        except Exception as e:  # noqa: BLE001 - a device that cannot be opened here
            report["warnings"].append(f"compute buffers estimated, not sized by ggml "
                                      f"({type(e).__name__}: {e})")
    plan = plan_engine_memory(cfg, trunk.hparams, trunk.n_vocab, p_trunk, weights,
                              rollback=rollback, mtp_device=mtp_dev,
                              mtp_hp=model.mtp_file.hparams if model.mtp_file is not None
                              else None, compute=sized)
    report["memory"].update(plan.to_dict())
    report["memory"]["spec_draft_n_max"] = n_max
    if repack is not None:
        report["memory"]["repacked"] = {"bytes": repack.repacked_bytes,
                                        "tensors": repack.repacked_tensors,
                                        "tied_head_copy": repack.extra_bytes,
                                        "buffer_types": list(repack.buffer_types)}
    if cfg.n_gpu_layers not in (None, 0, "auto") and not p_trunk.offload_devices:
        report["warnings"].append(f"-ngl {cfg.n_gpu_layers} ignored: no offload device, "
                                  "everything stays on the CPU")
    if tensors:
        report["tensor_list"] = _tensor_list(model, placements)
    return report


def fit_table(report: dict[str, Any]) -> str:
    """``--fit-print``'s one table: the fitted placement and the predicted memory per
    device, or, where nothing was fitted, the placement as given."""
    if "fit" in report:
        return report["fit"]["table"]
    from pyggspec.memory.fit import block_ranges, format_table

    p = report["placement"][0]
    n_trunk = report["n_layer"] if "n_layer" in report else len(report["layer_kinds"])
    rows = []
    for dev, n in sorted(report["memory"]["by_device"].items(), key=lambda d: d[0] == "CPU"):
        rows.append({"device": dev, "layers": block_ranges(p["layer_devices"], dev, n_trunk)
                     or "-", "output": "yes" if p["output_device"] == dev else "",
                     "predicted MiB": f"{n / 2**20:.1f}", "free MiB": "-", "target MiB": "-"})
    return format_table(rows, "fit: nothing fitted (--fit off, no offload device, or -ngl, "
                        "the experts' device and -c all set); the placement as given")


def inspect_mtp_only(path: str | os.PathLike, pair: str | os.PathLike | None = None, *,
                     n_ctx: int = 4096, n_parallel: int = 1, type_k: str = "f16",
                     type_v: str = "f16", tensors: bool = False) -> dict[str, Any]:
    """A JSON-ready description of the MTP-only GGUF at ``path``: the head, its tensors, the
    MTP KV cache per sequence (``type_k``/``type_v``: the head's cache types) and what a trunk
    must match; with ``pair``, whether that trunk pairs with it (``mtp.pair``)."""
    from pyggspec.modelfile import ModelFile
    from pyggspec.modelfile.describe import describe_mtp_only

    with ModelFile.open(path) as mf:
        trunk = ModelFile.open(pair) if pair is not None else None
        if n_ctx == 0:  # llama.cpp's -c 0: the training context
            n_ctx = (trunk or mf).hparams.n_ctx_train or 4096
        try:
            r = describe_mtp_only(mf, trunk, n_ctx=n_ctx, n_parallel=n_parallel,
                                  type_k=type_k, type_v=type_v)
        finally:
            if trunk is not None:
                trunk.close()
    if tensors:
        r["tensor_list"] = [dict(t, file=Path(path).name, device="-")
                            for t in r["mtp"]["shared_tensors"] + r["mtp"]["head_tensors"]]
    return r


def is_mtp_only(report: dict[str, Any]) -> bool:
    """Whether ``report`` (from :func:`inspect_model`) describes an MTP-only file (it has no
    placement: such a file never runs on its own)."""
    return "placement" not in report


def pair_error(path: str | os.PathLike, report: dict[str, Any]) -> PyggspecError | None:
    """For the report on the MTP-only file ``path`` checked against a trunk: the error naming
    the first mismatch (and how many more), or None when they pair (or no trunk was given)."""
    from pyggspec.modelfile.model import fmt_fact

    pair = report.get("mtp", {}).get("pair")
    if pair is None or pair["ok"]:
        return None
    m = pair["mismatches"]
    more = f" (and {len(m) - 1} more)" if len(m) > 1 else ""
    return PyggspecError(path, f"does not pair with {Path(pair['trunk']).name}: "
                         f"{m[0]['key']} {fmt_fact(m[0]['here'])} here vs "
                         f"{fmt_fact(m[0]['trunk'])} in the trunk{more}")


def _report(model: Any, placements: list[Any], mem: Any, no_binding: str | None
            ) -> dict[str, Any]:
    from pyggspec.modelfile.describe import hparams_summary

    trunk = model.trunk
    hp = trunk.hparams
    mtp_file = model.mtp_owner
    mtp = (mtp_file.mtp if mtp_file is not None else trunk.mtp).to_dict()
    mtp["source"] = model.mtp_source
    mtp["file"] = str(mtp_file.path) if mtp_file is not None else None
    if mtp["status"] == "none":
        for k in ("shared_embedding", "shared_head", "shared_head_norm"):
            mtp[k] = None
    types: dict[str, int] = {}
    for f in model.files:
        for t, b in f.bytes_by_type().items():
            types[t] = types.get(t, 0) + b
    warnings = [f"{f.path.name}: {w}" for f in model.files for w in f.report.warnings]
    if model.mtp_file is not None and trunk.mtp.status == "grafted":
        warnings.append(f"{trunk.path.name}: its own grafted MTP block is ignored "
                        f"(using {model.mtp_file.path.name})")
    if no_binding is not None:
        assumed = ", ".join(placements[0].offload_devices) or "CPU only"
        warnings.append(f"ggml binding not usable ({no_binding}); devices assumed: {assumed}")
    return {
        "file": str(trunk.path),
        "files": [{"path": str(f.path), "bytes": f.total_bytes, "n_tensors": len(f.tensors),
                   "gguf_version": f.gguf.version} for f in model.files],
        "name": trunk.name,
        **hparams_summary(hp, trunk.n_vocab),
        "gdn": {"d_conv": hp.ssm_d_conv, "d_state": hp.ssm_d_state, "d_inner": hp.ssm_d_inner,
                "n_k_heads": hp.ssm_n_group, "n_v_heads": hp.ssm_dt_rank,
                "key_dim": hp.key_dim, "value_dim": hp.value_dim, "conv_dim": hp.conv_dim,
                "n_embd_r": hp.n_embd_r, "n_embd_s": hp.n_embd_s},
        "moe": ({"n_expert": hp.n_expert, "n_expert_used": hp.n_expert_used,
                 "n_ff_exp": hp.n_ff_exp, "n_ff_shexp": hp.n_ff_shexp} if hp.is_moe else None),
        "layer_kinds": list(hp.layer_kinds),
        "layer_kinds_from": hp.recurrent_from,
        "mtp": mtp,
        "tied_output": trunk.tied_output,
        "tensor_types": types,
        "n_tensors": sum(len(f.tensors) for f in model.files),
        "total_bytes": sum(f.total_bytes for f in model.files),
        "tokenizer": trunk.tokenizer.to_dict(),
        "placement": [dict(p.to_dict(), file=str(f.path))
                      for p, f in zip(placements, model.files)],
        "memory": mem.to_dict(),
        "warnings": warnings,
    }


def _tensor_list(model: Any, placements: list[Any]) -> list[dict[str, Any]]:
    out = []
    for f, p in zip(model.files, placements):
        for name, t in f.tensors.items():
            out.append({"file": f.path.name, "name": name, "type": t.type_name,
                        "ne": list(t.shape), "bytes": t.nbytes,
                        "device": p.tensor_devices.get(name, "-")})
    return out


__all__ = ["InspectUsageError", "device_infos", "fit_table", "inspect_model", "inspect_mtp_only",
           "is_mtp_only", "offload_candidates", "pair_error"]
