"""``pyggspec inspect``: the report of :func:`pyggspec.inspect.inspect_model`, as aligned
rows or one JSON object (the work is in the library; this only renders it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from pyggspec.cli.common import (
    BACKEND_SAMPLING,
    CONTEXT_SETTINGS,
    CPU_MOE,
    DEVICE,
    DRAFT_SAMPLING,
    FIT,
    FIT_CTX,
    FIT_PRINT,
    FIT_TARGET,
    N_PARALLEL,
    N_UBATCH,
    NGL,
    NO_REPACK,
    OVERRIDES,
    ROLLBACK,
    RPC,
    TYPE_K,
    TYPE_V,
    add_rpc_servers,
    engine_config,
    fmt_bytes,
)
from pyggspec.config import EngineConfig, SpecConfig


def _ggml_type(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A cache type ggml does not know is a usage error (one it knows but the KV cache cannot
    hold is the config's one-line error, as for ``run``)."""
    from pyggspec.modelfile import ggml_type

    try:
        ggml_type(value)
    except KeyError:
        raise click.BadParameter(f"unknown ggml type '{value}'",
                                 param_hint=f"'{param.opts[-1]}'") from None
    return value


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--mtp", "mtp_path", type=click.Path(path_type=Path),
              help="Separate MTP-only GGUF (mtp-*.gguf) to pair with FILE.")
@click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=0), default=4096,
              show_default=True, help="Context length per sequence for the memory estimate "
                                      "(0: the model's training context, as llama.cpp).")
@N_PARALLEL(help="Number of parallel sequences.")
@NGL(help="Layers to offload (the MTP block and the output layer count as layers).")
@DEVICE(metavar="NAME[,NAME]",
        help="Offload device(s), e.g. CUDA0 or RPC0; 'none' keeps everything on the CPU.")
@OVERRIDES(help="Place tensors matching REGEX on DEVICE (first wins).")
@CPU_MOE(help="Keep all MoE expert weights on the CPU.")
@TYPE_K(help="KV cache type for K.", callback=_ggml_type)
@TYPE_V(help="KV cache type for V.", callback=_ggml_type)
@N_UBATCH(help="Largest ubatch (sizes the compute buffers).")
@click.option("--spec-draft-n-max", "spec_n_max", type=click.IntRange(min=0), default=None,
              help="Plan draft-mtp with this n_max (default 3 when the model has an MTP head; "
                   "0: no speculation).")
@ROLLBACK(help=None)
@click.option("-ctkd", "--spec-draft-type-k", "mtp_type_k", default="f16", show_default=True)
@click.option("-ctvd", "--spec-draft-type-v", "mtp_type_v", default="f16", show_default=True)
@click.option("--tensors", "show_tensors", is_flag=True,
              help="Also list every tensor with type, shape and device.")
@click.option("--pair", "pair_path", type=click.Path(path_type=Path), metavar="TRUNK",
              help="FILE is an MTP-only GGUF: check that it pairs with this trunk GGUF "
                   "(every mismatch is listed; exit 1 if any).")
@NO_REPACK(help="Plan without CPU weight repacking (as run --no-repack).")
@BACKEND_SAMPLING(help="Plan the compute buffers for sampler chains in the graph (as run -bs; "
                       "default: when the logits are not on the CPU).")
@DRAFT_SAMPLING(help="Plan for coupled drafts (sampler chains in the MTP graph) or greedy "
                     "ones.")
@RPC()
@FIT(help="Plan what is left unset (-ngl, the MoE experts' device, -c 0) to fit the offload "
          "devices' free memory less -fitt, as run and serve do.")
@FIT_TARGET()
@FIT_CTX()
@FIT_PRINT()
@click.option("-mm", "--mmproj", "mmproj_path", type=click.Path(path_type=Path),
              help="Vision projector GGUF (convert_hf_to_gguf.py --mmproj) for FILE: describe "
                   "it and add it to the memory plan.")
@click.option("--no-mmproj-offload", "no_mmproj_offload", is_flag=True,
              help="Plan the projector on the CPU (libmtmd otherwise uses a GPU device).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@engine_config
def inspect(file: Path, config: EngineConfig, spec_n_max: int | None, rollback: str,
            draft_sampling: str, show_tensors: bool, pair_path: Path | None,
            as_json: bool, rpc: str | None = None, fit_print: bool = False,
            mmproj_path: Path | None = None, no_mmproj_offload: bool = False) -> None:
    """Describe a Qwen3.5/3.6 GGUF: dims, layer kinds, MTP head, tensors, memory.

    FILE may also be an MTP-only GGUF (mtp-*.gguf): then the head, its tensors and what a
    trunk must match to pair with it are described (check one with --pair TRUNK).
    """
    from pyggspec.inspect import (
        InspectUsageError,
        fit_table,
        inspect_model,
        is_mtp_only,
        pair_error,
    )

    add_rpc_servers(rpc)

    spec = SpecConfig(n_max=spec_n_max or SpecConfig.n_max, rollback=rollback,
                      draft_sampling=draft_sampling)
    config = config.replace(spec=spec, spec_type="draft-mtp" if spec_n_max else None)
    try:
        report = inspect_model(file, config, pair=pair_path, auto_spec=spec_n_max is None,
                               tensors=show_tensors, mmproj=mmproj_path,
                               mmproj_offload=not no_mmproj_offload)
    except InspectUsageError as e:
        if e.flag is not None:
            raise click.BadParameter(e.message, param_hint=f"'{e.flag}'") from None
        raise click.UsageError(e.message) from None
    if is_mtp_only(report):
        click.echo(json.dumps(report) if as_json else _human_mtp_only(report))
        err = pair_error(file, report)
        if err is not None:
            raise err
        return
    if fit_print:  # llama.cpp's --fit-print: the one table (or its JSON), nothing else
        click.echo(json.dumps(report.get("fit")) if as_json else fit_table(report))
    elif as_json:
        click.echo(json.dumps(report, indent=None))
    else:
        click.echo(_human(report, show_tensors))


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
    if "fit" in r:
        rows.append(("fit", r["fit"]["table"]))
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
                                                 "step_graphs", "mmproj", "mmproj_compute")
                                       if c in mem)
                           + f" = {fmt_bytes(mem['total_bytes'])}")))
    mm = r.get("mmproj")
    if mm is not None:
        rows.append(("projector", _projector_line(mm)))
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


def _projector_line(mm: dict[str, Any]) -> str:
    v = mm["vision"]
    types = ", ".join(f"{n} {t}" for t, n in mm["tensor_types"].items())
    return (f"{Path(mm['file']).name}: {mm['projector_type']}, rows of {mm['n_embd']} "
            f"(matches the model); ViT {v['n_layer']} layers x {v['n_embd']}, patch "
            f"{v['patch_size']}, merge {v['n_merge']}x{v['n_merge']}\n"
            f"image budget {mm['image_min_tokens']}..{mm['image_max_tokens']} tokens; "
            f"{mm['n_tensors']} tensors ({types}); weights "
            + ", ".join(f"{d} {fmt_bytes(n)}" for d, n in mm["weights"].items())
            + "; compute "
            + (", ".join(f"{d} {fmt_bytes(n)}" for d, n in mm["compute"].items())
               or "not reported by libmtmd")
            + " (libmtmd's warmup)")


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


