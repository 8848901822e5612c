"""Command line: ``pyggspec inspect | models | devices`` (thin; the work is in the library).

Every :class:`PyggspecError` becomes one line on stderr and exit code 1; click's usage errors
exit 2; anything else is reported as an internal error in one line (set ``PYGGSPEC_DEBUG=1``
for the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from pyggspec.errors import PyggspecError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _Group(click.Group):
    """A click group that turns pyggspec errors into one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PyggspecError as e:
            click.echo(_one_line(str(e)), err=True)
            ctx.exit(1)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("pyggspec: interrupted", err=True)
            ctx.exit(130)
        except Exception as e:
            if os.environ.get("PYGGSPEC_DEBUG"):
                raise
            click.echo(_one_line(f"pyggspec: internal error: {type(e).__name__}: {e} "
                                 "(PYGGSPEC_DEBUG=1 shows the traceback)"), err=True)
            ctx.exit(1)


def _one_line(msg: str) -> str:
    """``msg`` as one printable line: text from a damaged file can carry any bytes (newlines,
    terminal escapes) into a message; they are shown escaped."""
    if msg.isprintable():
        return msg
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


@click.group(cls=_Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="pyggspec", prog_name="pyggspec")
def main() -> None:
    """Qwen3.5/3.6 GGUF inference with MTP speculative decoding on ggml."""


# ---------------------------------------------------------------------------- formatting
def fmt_bytes(n: int) -> str:
    """Human byte count in binary units (llama.cpp prints MiB)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"  # pragma: no cover


def _rows(rows: Sequence[tuple[str, str]]) -> str:
    w = max(len(k) for k, _ in rows)
    lines = []
    for k, v in rows:
        parts = v.split("\n")
        lines.append(f"{k:<{w}}  {parts[0]}")
        lines.extend(f"{'':<{w}}  {p}" for p in parts[1:])
    return "\n".join(lines)


def _layer_map(kinds: Sequence[str]) -> str:
    """``RRRA RRRA ...`` in groups of 8 per line chunk; R = gated delta net, A = attention."""
    s = "".join("R" if k == "recurrent" else "A" for k in kinds)
    groups = [s[i:i + 8] for i in range(0, len(s), 8)]
    lines = [" ".join(groups[i:i + 8]) for i in range(0, len(groups), 8)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- devices
def _device_infos() -> tuple[list[Any] | None, str]:
    """The binding's device list, or (None, why) when the ggml binding is not usable here.

    ``inspect`` must work without a backend, so any failure of the binding only degrades the
    device list to the CPU.
    """
    try:
        try:
            from pyggspec.ggml.device import list_devices
        except ModuleNotFoundError:
            from pyggspec.ggml.devices import list_devices  # type: ignore[no-redef]
        return list(list_devices()), ""
    except PyggspecError as e:
        return None, e.message
    except Exception as e:  # noqa: BLE001 - a missing or half-built binding
        return None, f"{type(e).__name__}: {e}"


def _offload_candidates(infos: Sequence[Any]) -> list[str]:
    """llama.cpp's default model devices: GPUs (RPC included), else integrated GPUs."""
    gpus = [d.name for d in infos if str(d.type).lower() == "gpu"]
    if gpus:
        return gpus
    return [d.name for d in infos if str(d.type).lower() == "igpu"]


def _parse_overrides(values: Sequence[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for v in values:
        for item in v.split(","):
            if not item:
                continue
            pattern, sep, dev = item.rpartition("=")
            if not sep or not pattern or not dev:
                raise click.BadParameter(f"expected PATTERN=DEVICE, got '{item}'",
                                         param_hint="'-ot'")
            out.append((pattern, dev))
    return out


def _parse_ngl(value: str | None) -> int | str | None:
    if value is None or value in ("all", "auto"):
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"expected a number, 'all' or 'auto', got '{value}'",
                                 param_hint="'-ngl'") from None


# ---------------------------------------------------------------------------- inspect
@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--mtp", "mtp_path", type=click.Path(path_type=Path),
              help="Separate MTP-only GGUF (mtp-*.gguf) to pair with FILE.")
@click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=1), default=4096,
              show_default=True, help="Context length per sequence for the memory estimate.")
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(min=1), default=1,
              show_default=True, help="Number of parallel sequences.")
@click.option("-ngl", "--n-gpu-layers", "ngl", metavar="N|all|auto",
              help="Layers to offload (the MTP block and the output layer count as layers).")
@click.option("-dev", "--device", "device", metavar="NAME[,NAME]",
              help="Offload device(s), e.g. CUDA0 or RPC0; 'none' keeps everything on the CPU.")
@click.option("-ot", "--override-tensor", "overrides", multiple=True,
              metavar="REGEX=DEVICE", help="Place tensors matching REGEX on DEVICE (first wins).")
@click.option("-cmoe", "--cpu-moe", is_flag=True, help="Keep all MoE expert weights on the CPU.")
@click.option("-ctk", "--cache-type-k", "type_k", default="f16", show_default=True,
              help="KV cache type for K.")
@click.option("-ctv", "--cache-type-v", "type_v", default="f16", show_default=True,
              help="KV cache type for V.")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512,
              show_default=True, help="Largest ubatch (sizes the compute buffers).")
@click.option("--spec-draft-n-max", "spec_n_max", type=click.IntRange(min=0), default=None,
              help="Plan draft-mtp with this n_max (default 3 when the model has an MTP head; "
                   "0: no speculation).")
@click.option("--spec-rollback", "spec_rollback", type=click.Choice(["auto", "snapshot",
              "checkpoint"]), default="auto", show_default=True)
@click.option("-ctkd", "--spec-draft-type-k", "mtp_type_k", default="f16", show_default=True)
@click.option("-ctvd", "--spec-draft-type-v", "mtp_type_v", default="f16", show_default=True)
@click.option("--tensors", "show_tensors", is_flag=True,
              help="Also list every tensor with type, shape and device.")
@click.option("--pair", "pair_path", type=click.Path(path_type=Path), metavar="TRUNK",
              help="FILE is an MTP-only GGUF: check that it pairs with this trunk GGUF "
                   "(every mismatch is listed; exit 1 if any).")
@click.option("-nr", "--no-repack", "no_repack", is_flag=True,
              help="Plan without CPU weight repacking (as run --no-repack).")
@click.option("-bs", "--backend-sampling/--no-backend-sampling", "backend_sampling",
              default=None,
              help="Plan the compute buffers for sampler chains in the graph (as run -bs; "
                   "default: when the logits are not on the CPU).")
@click.option("--spec-draft-sampling", "draft_sampling", type=click.Choice(["coupled", "greedy"]),
              default="coupled", show_default=True,
              help="Plan for coupled drafts (sampler chains in the MTP graph) or greedy ones.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(file: Path, mtp_path: Path | None, n_ctx: int, n_parallel: int, ngl: str | None,
            device: str | None, overrides: tuple[str, ...], cpu_moe: bool, type_k: str,
            type_v: str, n_ubatch: int, spec_n_max: int | None, spec_rollback: str,
            mtp_type_k: str, mtp_type_v: str, show_tensors: bool, pair_path: Path | None,
            no_repack: bool, backend_sampling: bool | None, draft_sampling: str,
            as_json: bool) -> None:
    """Describe a Qwen3.5/3.6 GGUF: dims, layer kinds, MTP head, tensors, memory.

    FILE may also be an MTP-only GGUF (mtp-*.gguf): then the head, its tensors and what a
    trunk must match to pair with it are described (check one with --pair TRUNK).
    """
    from pyggspec.modelfile import MtpOnlyFileError, estimate_memory, ggml_type, open_model
    from pyggspec.weights import plan_placement, sum_bytes

    for opt, t in (("--cache-type-k", type_k), ("--cache-type-v", type_v)):
        try:
            ggml_type(t)
        except KeyError:
            raise click.BadParameter(f"unknown ggml type '{t}'", param_hint=f"'{opt}'") from None
    n_gpu_layers = _parse_ngl(ngl)
    ot = _parse_overrides(overrides)

    try:
        opened = open_model(file, mtp_path)
    except MtpOnlyFileError:
        if mtp_path is not None:
            raise click.UsageError(f"{file} is an MTP-only file: check it against a trunk "
                                   "with --pair TRUNK, or inspect TRUNK --mtp FILE") from None
        _inspect_mtp_only(file, pair_path, n_ctx, n_parallel, mtp_type_k, mtp_type_v,
                          show_tensors, as_json)
        return
    if pair_path is not None:
        opened.close()
        raise click.BadParameter("is for an MTP-only FILE; pair a trunk FILE with --mtp",
                                 param_hint="'--pair'")
    with opened as model:
        infos, why = _device_infos()
        binding = infos is not None
        devices = ["CPU"] + [d.name for d in infos or () if str(d.type).lower() != "cpu"]
        if device is None:
            candidates = _offload_candidates(infos or ())
            device = ",".join(candidates) if candidates else "none"
        elif not binding:  # no binding to ask: take the named devices on trust
            devices += [d for d in device.split(",") if d and d not in ("none", "CPU")]
        trunk = model.trunk
        kw = {"n_gpu_layers": n_gpu_layers, "device": device, "override_tensor": ot,
                  "cpu_moe": cpu_moe}
        p_trunk = plan_placement(trunk, devices, include_mtp=model.mtp_source == "grafted",
                                 **kw)  # type: ignore[arg-type]
        placements = [p_trunk]
        if model.mtp_file is not None:
            placements.append(plan_placement(model.mtp_file, devices, **kw))  # type: ignore
        weights = sum_bytes(*placements)
        repack = None  # CPU weight repacking as loading will do it (ggml asked per tensor)
        warn_repack = None
        if binding:
            try:
                from pyggspec.weights import plan_repack

                repack = plan_repack(model, p_trunk, placements[1] if len(placements) > 1
                                     else None, repack=not no_repack)
            except Exception as e:  # noqa: BLE001 - the CPU device cannot be asked here
                warn_repack = f"weight repacking not predicted ({type(e).__name__}: {e})"
            for d, n in (repack.extra_bytes if repack is not None else {}).items():
                weights[d] = weights.get(d, 0) + n
        owner = model.mtp_owner
        # the engine's context is capped at the training context: plan for that one
        n_ctx_run = min(n_ctx, trunk.hparams.n_ctx_train or n_ctx)
        mem = estimate_memory(trunk.hparams, weights, n_ctx_run, n_parallel,
                              mtp=owner.hparams if owner is not None else None, type_k=type_k,
                              type_v=type_v)
        report = _report(model, placements, mem, why if not binding else None)
        if warn_repack:
            report["warnings"].append(warn_repack)
        from pyggspec.memory.plan import plan_memory

        n_max = spec_n_max if spec_n_max is not None else (3 if owner is not None else 0)
        if n_max and owner is None:
            raise PyggspecError(file, "no MTP head (nextn_predict_layers = 0); pass --mtp "
                                "mtp-….gguf to plan speculation")
        mtp_dev = None
        if n_max:
            blk = trunk.hparams.n_layer
            src = placements[-1] if model.mtp_file is not None else p_trunk
            mtp_dev = src.tensor_devices.get(f"blk.{blk}.nextn.eh_proj.weight")
        if n_ctx_run < n_ctx:
            report["warnings"].append(f"-c {n_ctx} is more than the model's training "
                                      f"context; memory is planned for {n_ctx_run}")
        rollback = "checkpoint" if spec_rollback == "checkpoint" else "snapshot"
        compute = steps = None  # the engine's worst-case graphs, sized by ggml (nothing loaded)
        if binding:
            try:
                from pyggspec.compute import GraphOptions, predict_compute

                opts = GraphOptions(n_ctx_run, n_parallel, n_ubatch, n_max,
                                    rollback if n_max else None, type_k, type_v, mtp_type_k,
                                    mtp_type_v)
                sized = predict_compute(model, opts, p_trunk,
                                        placements[1] if model.mtp_file is not None else None,
                                        backend_sampling=backend_sampling,
                                        coupled_drafts=draft_sampling == "coupled")
                compute, steps = sized.by_device(), sized.steps
            except Exception as e:  # noqa: BLE001 - a device that cannot be opened here
                report["warnings"].append(f"compute buffers estimated, not sized by ggml "
                                          f"({type(e).__name__}: {e})")
        plan = plan_memory(trunk.hparams, trunk.n_vocab, weights, p_trunk.layer_devices,
                           p_trunk.output_device, n_ctx=n_ctx_run, n_parallel=n_parallel,
                           n_ubatch=n_ubatch, type_k=type_k, type_v=type_v, spec_n_max=n_max,
                           rollback=rollback, mtp_device=mtp_dev,
                           mtp_hp=model.mtp_file.hparams if model.mtp_file is not None else None,
                           mtp_type_k=mtp_type_k, mtp_type_v=mtp_type_v, compute=compute,
                           step_graphs=steps)
        report["memory"].update(plan.to_dict())
        report["memory"]["spec_draft_n_max"] = n_max
        if repack is not None:
            report["memory"]["repacked"] = {"bytes": repack.repacked_bytes,
                                            "tensors": repack.repacked_tensors,
                                            "tied_head_copy": repack.extra_bytes,
                                            "buffer_types": list(repack.buffer_types)}
        if n_gpu_layers not in (None, 0, "auto") and not p_trunk.offload_devices:
            report["warnings"].append(f"-ngl {ngl} ignored: no offload device, "
                                      "everything stays on the CPU")
        if show_tensors:
            report["tensor_list"] = _tensor_list(model, placements)
        if as_json:
            click.echo(json.dumps(report, indent=None))
        else:
            click.echo(_human(report, show_tensors))


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


def _human(r: dict[str, Any], show_tensors: bool) -> str:
    mtp, tok, mem = r["mtp"], r["tokenizer"], r["memory"]
    files = ", ".join(f"{f['path']} ({fmt_bytes(f['bytes'])}, {f['n_tensors']} tensors, "
                      f"GGUF v{f['gguf_version']})" for f in r["files"])
    kind = "MoE" if r["moe"] else "dense"
    g = r["gdn"]
    rows: list[tuple[str, str]] = [
        ("file", files),
        ("model", f"{r['name'] or '-'}: {r['arch']} ({kind}), size class {r['model_type']}"),
        ("dims", f"n_embd {r['n_embd']}"
                 + (f" (out {r['n_embd_out']})" if r["n_embd_out"] != r["n_embd"] else "")
                 + f", n_vocab {r['n_vocab']}, ctx_train {r['n_ctx_train']}"),
        ("layers", f"{r['n_layer']} trunk + {r['n_layer_nextn']} MTP "
                   f"(block_count {r['n_layer_all']})"
                   + (" + 1 MTP in the sidecar" if mtp["source"] == "separate" else "")),
        ("attention", (f"{r['n_head']} heads, {r['n_head_kv']} KV heads, head_dim "
                      f"{r['head_dim']}, n_rot {r['n_rot']}, rope base "
                      f"{r['rope']['freq_base']:g}, sections {r['rope']['sections']}")),
        ("gdn", (f"d_conv {g['d_conv']}, d_state {g['d_state']}, K heads {g['n_k_heads']}, "
                f"V heads {g['n_v_heads']} (key_dim {g['key_dim']}, value_dim "
                f"{g['value_dim']}, conv_dim {g['conv_dim']})")),
    ]
    if r["moe"]:
        m = r["moe"]
        rows.append(("ffn", (f"{m['n_expert']} experts, {m['n_expert_used']} used, n_ff_exp "
                            f"{m['n_ff_exp']}, shared expert {m['n_ff_shexp']}")))
    else:
        rows.append(("ffn", f"n_ff {r['n_ff']}"))
    kinds = r["layer_kinds"]
    n_attn = sum(1 for k in kinds if k == "attention")
    rows.append(("layer kinds", f"{len(kinds) - n_attn} gated delta net (R), {n_attn} full "
                                f"attention (A), from {r['layer_kinds_from']}\n"
                                + _layer_map(kinds)))
    if mtp["status"] == "none":
        rows.append(("mtp", "none (nextn_predict_layers = 0)"))
    elif mtp["status"] == "missing":
        rows.append(("mtp", f"missing: block {mtp['block']} declared but absent"))
    else:
        names = ", ".join(n.split("nextn.", 1)[1].removesuffix(".weight")
                          for n in mtp["tensors"])
        emb = "shared with token_embd" if mtp["shared_embedding"] else "own (nextn.embed_tokens)"
        head = ("shared with " + ("token_embd (tied)" if r["tied_output"] else "output")
                if mtp["shared_head"] else "own (nextn.shared_head_head)")
        where = ("in the model file" if mtp["source"] == "grafted"
                 else f"sidecar {mtp['file']}")
        rows.append(("mtp", (f"{mtp['status']}, {where}, block {mtp['block']} "
                            f"({mtp['n_block_tensors']} tensors)\n"
                            f"nextn: {names}\nembedding {emb}; LM head {head}")))
    rows.append(("lm head", "tied to token_embd" if r["tied_output"] else "output.weight"))
    rows.append(("tensor types", ", ".join(f"{t} {fmt_bytes(b)}"
                                           for t, b in r["tensor_types"].items())
                 + f"; total {fmt_bytes(r['total_bytes'])} in {r['n_tensors']} tensors"))

    def sid(x: dict[str, Any]) -> str:
        return f"{x['id']} {x['token']!r}" if x["id"] is not None and x["token"] is not None \
            else (str(x["id"]) if x["id"] is not None else "-")

    rows.append(("tokenizer", (f"{tok['model']} (pre {tok['pre'] or '-'}), {tok['n_tokens']} "
                              f"tokens, {tok['n_merges']} merges\nbos {sid(tok['bos'])}, eos "
                              f"{sid(tok['eos'])}, pad {sid(tok['pad'])}, chat template "
                              f"{'yes' if tok['chat_template'] else 'no'}")))
    for p in r["placement"]:
        where = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in p["bytes_by_device"].items()
                          if b or d == "CPU")
        first_off = p["i_gpu_start"] if p["offload_devices"] else None
        desc = (f"-ngl {p['n_gpu_layers']} over {', '.join(p['offload_devices'])}: blocks "
                f">= {first_off} and output offloaded" if p["offload_devices"] and
                p["n_gpu_layers"] else "all on CPU (no offload)")
        if p["output_copy_device"]:
            where += f" (incl. a copy of token_embd as the tied LM head on " \
                     f"{p['output_copy_device']})"
        rows.append(("placement", f"{Path(p['file']).name}: {desc}\n{where}"))
    rows.append(("memory", (f"ctx {mem['n_ctx']} x {mem['n_parallel']} seq; per seq: KV "
                           f"{fmt_bytes(mem['kv_per_seq'])} ({mem['type_k']}/{mem['type_v']}), "
                           f"MTP KV {fmt_bytes(mem['mtp_kv_per_seq'])}, recurrent state "
                           f"{fmt_bytes(mem['recurrent_per_seq'])}\n"
                           f"state total {fmt_bytes(mem['state_total'])} + weights "
                           f"{fmt_bytes(mem['weights_total'])} = {fmt_bytes(mem['total'])}\n"
                           "engine plan" + (f" (draft-mtp, n_max {mem['spec_draft_n_max']})"
                                            if mem.get("spec_draft_n_max") else "") + ": "
                           + ", ".join(f"{c} {fmt_bytes(sum(mem[c].values()))}"
                                       + (" (estimated)" if c == "compute"
                                          and mem.get("compute_estimated") else "")
                                       for c in ("weights", "kv", "mtp_kv", "recurrent",
                                                 "snapshots", "checkpoints", "compute",
                                                 "step_graphs")
                                       if c in mem)
                           + f" = {fmt_bytes(mem['total_bytes'])}")))
    rp = mem.get("repacked")
    if rp is not None:
        copy = sum(rp["tied_head_copy"].values())
        rows.append(("repacked", (f"{rp['tensors']} tensors, {fmt_bytes(rp['bytes'])} in "
                                  f"{', '.join(rp['buffer_types'])}" if rp["tensors"] else
                                  "none (plain buffers)")
                     + (f"; the tied LM head gets its own copy (+{fmt_bytes(copy)})"
                        if copy else "")))
    for w in r["warnings"]:
        rows.append(("warning", w))
    out = _rows(rows)
    if show_tensors:
        tl = r["tensor_list"]
        wn = max(len(t["name"]) for t in tl)
        out += "\n\n" + "\n".join(
            f"{t['name']:<{wn}}  {t['type']:<7} {t['ne']!s:<22} {fmt_bytes(t['bytes']):>12}"
            f"  {t['device']}" for t in tl)
    return out


def _inspect_mtp_only(file: Path, pair_path: Path | None, n_ctx: int, n_parallel: int,
                      type_k: str, type_v: str, show_tensors: bool, as_json: bool) -> None:
    """``inspect`` of an MTP-only file: describe it; with ``--pair``, exit 1 on a mismatch."""
    from pyggspec.modelfile import ModelFile
    from pyggspec.modelfile.describe import describe_mtp_only
    from pyggspec.modelfile.model import fmt_fact

    with ModelFile.open(file) as mf:
        trunk = ModelFile.open(pair_path) if pair_path is not None else None
        try:
            r = describe_mtp_only(mf, trunk, n_ctx=n_ctx, n_parallel=n_parallel,
                                  type_k=type_k, type_v=type_v)
        finally:
            if trunk is not None:
                trunk.close()
    if show_tensors:
        r["tensor_list"] = [dict(t, file=Path(file).name, device="-")
                            for t in r["mtp"]["shared_tensors"] + r["mtp"]["head_tensors"]]
    click.echo(json.dumps(r) if as_json else _human_mtp_only(r))
    pair = r["mtp"]["pair"]
    if pair is not None and not pair["ok"]:
        m = pair["mismatches"]
        more = f" (and {len(m) - 1} more)" if len(m) > 1 else ""
        raise PyggspecError(file, f"does not pair with {Path(pair['trunk']).name}: "
                            f"{m[0]['key']} {fmt_fact(m[0]['here'])} here vs "
                            f"{fmt_fact(m[0]['trunk'])} in the trunk{more}")


def _human_mtp_only(r: dict[str, Any]) -> str:
    from pyggspec.modelfile.model import fmt_fact

    mtp, tok, mem = r["mtp"], r["tokenizer"], r["memory"]
    f = r["files"][0]
    kind = "MoE" if r["moe"] else "dense"

    def tensor_lines(ts: list[dict[str, Any]]) -> str:
        w = max(len(t["name"]) for t in ts)
        return "\n".join(f"{t['name']:<{w}}  {t['type']:<7} {fmt_shape(t['ne']):<16} "
                         f"{fmt_bytes(t['bytes'])}" for t in ts)

    emb = "shared with token_embd" if mtp["shared_embedding"] else "own (nextn.embed_tokens)"
    head = ("shared with " + ("token_embd (tied)" if r["tied_output"] else "output")
            if mtp["shared_head"] else "own (nextn.shared_head_head)")
    ffn = (f"{r['moe']['n_expert']} experts, {r['moe']['n_expert_used']} used, n_ff_exp "
           f"{r['moe']['n_ff_exp']}, shared expert {r['moe']['n_ff_shexp']}" if r["moe"]
           else f"n_ff {r['n_ff']}")
    req = ", ".join(f"{k} {fmt_fact(v)}" for k, v in mtp["pairs_with"].items())
    rows: list[tuple[str, str]] = [
        ("file", (f"{f['path']} ({fmt_bytes(f['bytes'])}, {f['n_tensors']} tensors, GGUF "
                 f"v{f['gguf_version']})")),
        ("model", f"{r['name'] or '-'}: {r['arch']} ({kind}), size class {r['model_type']}"),
        ("mtp", (f"mtp-only: the MTP head of a {r['n_layer']}-layer trunk, as block "
                f"{mtp['block']}; no trunk layers in this file (it runs only next to its "
                "trunk)")),
        ("dims", (f"n_embd {r['n_embd']}, n_vocab {r['n_vocab']}, ctx_train "
                 f"{r['n_ctx_train']}")),
        ("attention", (f"{r['n_head']} heads, {r['n_head_kv']} KV heads, head_dim "
                      f"{r['head_dim']}, n_rot {r['n_rot']}, rope base "
                      f"{r['rope']['freq_base']:g}, sections {r['rope']['sections']}")),
        ("ffn", ffn),
        ("head", f"block {mtp['block']}: {len(mtp['head_tensors'])} tensors, "
                 f"{fmt_bytes(mtp['head_bytes'])}\n" + tensor_lines(mtp["head_tensors"])),
        ("shared", tensor_lines(mtp["shared_tensors"]) if mtp["shared_tensors"] else "-"),
        ("", f"embedding {emb}; LM head {head}"),
        ("tensor types", ", ".join(f"{t} {fmt_bytes(b)}" for t, b in r["tensor_types"].items())
         + f"; total {fmt_bytes(r['total_bytes'])} in {r['n_tensors']} tensors"),
        ("tokenizer", (f"{tok['model']} (pre {tok['pre'] or '-'}), {tok['n_tokens']} tokens, "
                      f"{tok['n_merges']} merges, tokens sha256 {tok['tokens_sha256'][:12]}")),
        ("memory", (f"MTP KV {fmt_bytes(mem['mtp_kv_per_seq'])} per seq (ctx {mem['n_ctx']}, "
                   f"{mem['type_k']}/{mem['type_v']}) x {mem['n_parallel']} + weights "
                   f"{fmt_bytes(mem['weights_total'])}; plan the whole model with "
                   "inspect TRUNK --mtp FILE")),
        ("pairs with", (f"a trunk GGUF with {req}\n(pyggspec run -m TRUNK --spec-type draft-mtp "
                       f"-md {Path(f['path']).name})")),
    ]
    pair = mtp["pair"]
    if pair is not None:
        name = Path(pair["trunk"]).name
        if pair["ok"]:
            rows.append(("pair", f"{name}: ok, pairs with this file"))
        else:
            rows.append(("pair", f"{name}: does NOT pair\n" + "\n".join(
                f"{m['key']} {fmt_fact(m['here'])} here vs {fmt_fact(m['trunk'])} in the trunk"
                for m in pair["mismatches"])))
    for w in r["warnings"]:
        rows.append(("warning", w))
    out = _rows(rows)
    if "tensor_list" in r:
        out += "\n\n" + tensor_lines(r["tensor_list"])
    return out


def fmt_shape(ne: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in ne) + "]"


# ---------------------------------------------------------------------------- models
def models_toml_path() -> Path:
    """The model list: ``models.toml`` at the repository root (source / editable installs),
    else a copy shipped as package data at ``pyggspec/data/models.toml``."""
    here = Path(__file__).resolve().parent
    for p in (here.parent / "models.toml", here / "data" / "models.toml"):
        if p.is_file():
            return p
    raise PyggspecError("models.toml", "not found next to the package (reinstall pyggspec)")


def load_models(path: Path | None = None) -> list[dict[str, Any]]:
    """Entries of models.toml as dicts (``[[model]]`` tables)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    path = path or models_toml_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise PyggspecError(path, f"cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise PyggspecError(path, f"invalid TOML: {e}") from None
    models = data.get("model", [])
    if not isinstance(models, list):
        raise PyggspecError(path, "expected [[model]] tables")
    return models


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def models(as_json: bool) -> None:
    """List the Qwen3.5/3.6 models pyggspec targets (from models.toml)."""
    entries = load_models()
    if as_json:
        click.echo(json.dumps(entries))
        return
    cols = ("id", "arch", "n_layer", "hf_repo", "gguf_repo", "quant", "mtp")
    table = [[str(e.get(c, "") or "-") for c in cols] for e in entries]
    for e, row in zip(entries, table):
        if e.get("mtp_file"):
            row[-1] += f" ({e['mtp_file']})"
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(cols, widths)).rstrip())
    for row in table:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


# ---------------------------------------------------------------------------- devices
@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def devices(as_json: bool) -> None:
    """List the ggml devices the installed llama-cpp-python libraries provide."""
    from pyggspec.ggml import quirks
    from pyggspec.ggml.device import backends_available, list_devices

    infos = list(list_devices())
    notes = [line for d in infos for line in quirks.lines(d.name)]
    if "Vulkan" in backends_available() and not any(d.backend == "Vulkan" for d in infos):
        notes.append("Vulkan backend built, no device listed: ggml hides CPU-type Vulkan "
                     "devices (Mesa's lavapipe); GGML_VK_VISIBLE_DEVICES=0 shows one")
    fields = ("name", "type", "backend", "memory_free", "memory_total", "description")
    if as_json:
        out = [{f: getattr(d, f) for f in fields} | {"notes": quirks.lines(d.name)}
               for d in infos]
        click.echo(json.dumps(out))
        return
    rows = [[d.name, str(d.type), d.backend,
             f"{fmt_bytes(d.memory_free)} / {fmt_bytes(d.memory_total)}", d.description]
            for d in infos]
    head = ["NAME", "TYPE", "BACKEND", "FREE / TOTAL", "DESCRIPTION"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for line in notes:
        click.echo(f"note: {line}")


# ---------------------------------------------------------------------------- run
from pyggspec import cli_run as _cli_run  # noqa: F401  (registers `run` on `main`)
from pyggspec.serving import http_cli as _http_cli  # noqa: F401  (registers `serve`)
