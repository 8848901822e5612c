"""``pyggspec run``: generate text from a GGUF, llama.cpp-style flags and timings.

Thin: parses flags, builds an :class:`~pyggspec.engine.Engine`, streams pieces to stdout
and prints timings (or one JSON object with ``--json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pyggspec.cli import CONTEXT_SETTINGS, _parse_ngl, _parse_overrides, fmt_bytes, main
from pyggspec.errors import PyggspecError


def _parse_prompt_tokens(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter("expected comma-separated token ids",
                                 param_hint="'--prompt-tokens'") from None
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="'--prompt-tokens'")
    return ids


def _timings_lines(res, memory: dict) -> list[str]:
    t = res.timings.to_dict()
    lines = [
        f"prompt eval: {t['prompt_n']:6d} tokens in {t['prompt_ms']:10.2f} ms "
        f"({t['prompt_per_second']:8.2f} tokens/s)",
        f"generation : {t['predicted_n']:6d} tokens in {t['predicted_ms']:10.2f} ms "
        f"({t['predicted_per_second']:8.2f} tokens/s, python {t['python_ms_per_step']:.3f} "
        "ms/step)",
    ]
    parts = []
    for comp in ("weights", "kv", "recurrent", "compute"):
        for dev, n in memory.get(comp, {}).items():
            parts.append(f"{comp} {fmt_bytes(n)} ({dev})")
    lines.append("memory     : " + ", ".join(parts))
    lines.append(f"stop       : {res.stop_reason}")
    return lines


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("-m", "--model", "model", type=click.Path(path_type=Path), required=True,
              help="GGUF model (trunk, MTP grafted or not).")
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(path_type=Path, exists=True,
              dir_okay=False), help="Read the prompt from a file.")
@click.option("--prompt-tokens", default=None, metavar="ID,ID,...",
              help="Prompt as token ids (skips tokenization).")
@click.option("-cnv", "--chat", "chat", is_flag=True,
              help="Wrap the prompt as a user message with the GGUF's chat template.")
@click.option("-sys", "--system-prompt", default=None, help="System message for --chat.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=128,
              show_default=True, help="Tokens to generate.")
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=1), default=4096,
              show_default=True)
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=2048,
              show_default=True)
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512,
              show_default=True)
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: cores, at most 8).")
@click.option("-ngl", "--n-gpu-layers", "ngl", metavar="N|all|auto", default=None,
              help="Layers on the offload device (default: all, when one exists).")
@click.option("-dev", "--device", "device", metavar="NAME", default=None,
              help="Offload device (see `pyggspec devices`).")
@click.option("-ot", "--override-tensor", "overrides", multiple=True, metavar="REGEX=DEVICE")
@click.option("-cmoe", "--cpu-moe", is_flag=True, help="Keep MoE expert weights on the CPU.")
@click.option("-ctk", "--cache-type-k", "type_k", default="f16", show_default=True)
@click.option("-ctv", "--cache-type-v", "type_v", default="f16", show_default=True)
@click.option("--rpc", "rpc", default=None, metavar="HOST:PORT[,...]",
              help="Add remote ggml RPC servers as devices (llama.cpp's rpc-server).")
@click.option("--no-mmap", is_flag=True, help="Copy CPU weights instead of mapping the file.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
def run(model: Path, prompt: str | None, prompt_file: Path | None, prompt_tokens: str | None,
        chat: bool, system_prompt: str | None, n_predict: int, n_ctx: int, n_batch: int,
        n_ubatch: int, n_threads: int | None, ngl: str | None, device: str | None,
        overrides: tuple[str, ...], cpu_moe: bool, type_k: str, type_v: str, rpc: str | None,
        no_mmap: bool, ignore_eos: bool, as_json: bool) -> None:
    """Generate text (greedy) from MODEL."""
    from pyggspec.engine import Engine

    ids = _parse_prompt_tokens(prompt_tokens)
    if prompt_file is not None:
        prompt = prompt_file.read_text()
    if ids is None and prompt is None:
        raise click.UsageError("give a prompt with -p, -f or --prompt-tokens")
    if n_batch < n_ubatch:
        n_ubatch = n_batch
    if rpc:
        from pyggspec.ggml.device import add_rpc_server

        for ep in rpc.split(","):
            if ep:
                add_rpc_server(ep.strip())
    with Engine(model, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, n_ubatch=n_ubatch,
                n_gpu_layers=_parse_ngl(ngl), device=device,
                override_tensor=_parse_overrides(overrides), cpu_moe=cpu_moe, type_k=type_k,
                type_v=type_v, use_mmap=not no_mmap, progress=None if not as_json else False,
                ) as engine:
        if ids is None:
            text = prompt or ""
            if chat:
                msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
                msgs.append({"role": "user", "content": text})
                text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            ids = engine.tokenize(text)
        for piece in engine.stream(ids, max_tokens=n_predict, ignore_eos=ignore_eos):
            if not as_json and piece.text:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
        res = engine.last_result
        memory = engine.memory()
    if as_json:
        out = res.to_dict()
        out["memory"] = memory
        click.echo(json.dumps(out))
    else:
        sys.stdout.write("\n")
        for line in _timings_lines(res, memory):
            click.echo(line, err=True)


__all__ = ["run", "PyggspecError"]
