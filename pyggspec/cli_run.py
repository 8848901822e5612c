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
from pyggspec.sampling import SamplingOptions, sampling_options
from pyggspec.speculative.options import SpecOptions, spec_options


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
        (f"prompt eval: {t['prompt_n']:6d} tokens in {t['prompt_ms']:10.2f} ms "
        f"({t['prompt_per_second']:8.2f} tokens/s)"),
        (f"generation : {t['predicted_n']:6d} tokens in {t['predicted_ms']:10.2f} ms "
        f"({t['predicted_per_second']:8.2f} tokens/s, python {t['python_ms_per_step']:.3f} "
        "ms/step)"),
    ]
    parts = []
    for comp in ("weights", "kv", "recurrent", "compute"):
        for dev, n in memory.get(comp, {}).items():
            parts.append(f"{comp} {fmt_bytes(n)} ({dev})")
    lines.append("memory     : " + ", ".join(parts))
    lines.append(f"stop       : {res.stop_reason}")
    return lines


def _spec_lines(stats: dict) -> list[str]:
    pp = ", ".join(f"{p:.3f}" for p in stats["per_position"])
    return [
        (f"draft acceptance rate = {stats['acceptance']:.5f} ({stats['n_accepted']} accepted / "
        f"{stats['n_drafted']} generated)"),
        (f"mean accepted length = {stats['mean_accepted_length']:.3f} tokens per step, "
        f"per-position acceptance = [{pp}]"),
        f"target evals = {stats['n_target_evals']}, mtp evals = {stats['n_mtp_evals']}",
    ]


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("-m", "--model", "model", type=click.Path(path_type=Path), default=None,
              help="GGUF model (trunk, MTP grafted or not). Without it, --spec-type draft-mtp "
                   "runs the built-in synthetic demo model.")
@click.option("-p", "--prompt", "prompts", multiple=True,
              help="Prompt text (repeat for several sequences with --parallel).")
@click.option("-f", "--file", "prompt_file", type=click.Path(path_type=Path, exists=True,
              dir_okay=False), help="Read the prompt from a file.")
@click.option("--prompt-tokens", default=None, metavar="ID,ID,...",
              help="Prompt as token ids (skips tokenization).")
@click.option("-cnv", "--chat", "chat", is_flag=True,
              help="Wrap the prompt as a user message with the GGUF's chat template.")
@click.option("-sys", "--system-prompt", default=None, help="System message for --chat.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=0), default=128,
              show_default=True, help="Tokens to generate per sequence.")
@click.option("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=1), default=4096,
              show_default=True)
@click.option("-np", "--parallel", "n_parallel", type=click.IntRange(min=1), default=1,
              show_default=True, help="Sequences generated together (prompts are cycled).")
@click.option("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=2048,
              show_default=True, help="Logical batch: a prompt is evaluated in chunks of at "
              "most this many tokens per sequence.")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512,
              show_default=True, help="Physical batch: each chunk runs in graphs of at most "
              "this many tokens (capped at -b, as in llama.cpp).")
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
@click.option("-nr", "--no-repack", is_flag=True,
              help="Keep CPU weights as stored (no repacking into ggml's CPU extra buffer types).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation.")
@spec_options
@click.option("-ctxcp", "--ctx-checkpoints", "ctx_checkpoints", type=click.IntRange(min=0),
              default=4, show_default=True, help="Recurrent-state checkpoints kept per slot "
              "for prompt reuse (host memory).")
@click.option("--checkpoint-min-step", "checkpoint_min_step", type=click.IntRange(min=1),
              default=512, show_default=True, help="Least prompt tokens between two "
              "checkpoints (one is also saved at each prompt's end).")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
def run(model: Path | None, prompts: tuple[str, ...], prompt_file: Path | None,
        prompt_tokens: str | None, chat: bool, system_prompt: str | None, n_predict: int,
        n_ctx: int, n_parallel: int, n_batch: int, n_ubatch: int, n_threads: int | None,
        ngl: str | None, device: str | None, overrides: tuple[str, ...], cpu_moe: bool,
        type_k: str, type_v: str, rpc: str | None, no_mmap: bool, no_repack: bool, ignore_eos: bool,
        spec: SpecOptions, ctx_checkpoints: int, checkpoint_min_step: int, sampling: SamplingOptions,
        as_json: bool) -> None:
    """Generate text from MODEL, optionally with MTP speculative decoding.

    Sampling follows llama.cpp's flags and defaults (--temp 0.8 ...; --temp 0 is greedy).
    """
    from pyggspec.engine import Engine

    ids = _parse_prompt_tokens(prompt_tokens)
    texts = list(prompts)
    if prompt_file is not None:
        texts.append(prompt_file.read_text())
    if ids is None and not texts:
        raise click.UsageError("give a prompt with -p, -f or --prompt-tokens")
    demo = False
    if model is None:
        if spec.spec_type != "draft-mtp":
            raise click.UsageError("missing -m/--model (only --spec-type draft-mtp has a "
                                   "built-in demo model)")
        from pyggspec.demo import demo_model

        model = demo_model(quiet=as_json)
        demo = True
        if not as_json:
            click.echo("pyggspec: running the built-in SYNTHETIC demo model (random weights, "
                       "constructed MTP agreement ~95%): the text is meaningless, the "
                       "speed-up is real.", err=True)
    if rpc:
        from pyggspec.ggml.device import add_rpc_server

        for ep in rpc.split(","):
            if ep:
                add_rpc_server(ep.strip())
    with Engine(model, n_ctx=n_ctx, n_parallel=n_parallel,
                n_threads=n_threads, n_batch=n_batch, n_ubatch=n_ubatch,
                n_gpu_layers=_parse_ngl(ngl), device=device,
                override_tensor=_parse_overrides(overrides), cpu_moe=cpu_moe, type_k=type_k,
                type_v=type_v, use_mmap=not no_mmap, repack=not no_repack, progress=None if not as_json else False,
                **spec.engine_kwargs, draft_backend_sampling=sampling.draft_backend_sampling,
                sampling=sampling.params, backend_sampling=sampling.backend_sampling,
                ctx_checkpoints=ctx_checkpoints,
                checkpoint_min_step=checkpoint_min_step) as engine:
        if ids is not None:
            inputs: list = [ids]
        else:
            inputs = []
            for text in texts:
                if chat:
                    msgs = ([{"role": "system", "content": system_prompt}]
                            if system_prompt else [])
                    msgs.append({"role": "user", "content": text})
                    text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                inputs.append(engine.tokenize(text))
        inputs = [inputs[i % len(inputs)] for i in range(n_parallel)]
        stream = None
        if not as_json and n_parallel == 1 and engine.tokenizer is not None:
            detok = engine.tokenizer.detokenizer()

            def stream(index: int, tokens: list[int]) -> None:
                for t in tokens:
                    piece = detok.add(t)
                    if piece:
                        sys.stdout.write(piece)
                sys.stdout.flush()

        results = engine.generate_batch(inputs, max_tokens=n_predict, ignore_eos=ignore_eos,
                                        on_tokens=stream)
        if stream is not None:
            sys.stdout.write(detok.flush())
        memory = engine.memory()
        stats = engine.stats.to_dict() if engine.spec_type else None
        if stats is not None:  # how the drafts of sampling chains were made
            d = engine.drafter
            stats["draft_sampling"] = {"mode": engine.spec.draft_sampling,
                                       "coupled_drafts": d.n_coupled,
                                       "argmax_drafts": d.n_argmax}
        rollback_used = engine.rollback
        sampling_stats = engine.samplers.stats.to_dict() if engine.samplers else {}
    res = results[0]
    if as_json:
        out = res.to_dict() if n_parallel == 1 else {
            "results": [r.to_dict() for r in results],
            "timings": res.timings.to_dict()}
        out["memory"] = memory
        out["sampling"] = sampling_stats
        out["model"] = str(model)
        out["demo"] = demo
        if stats is not None:
            stats["rollback"] = rollback_used
            out["spec"] = stats
            out["timings"]["draft_n"] = stats["n_drafted"]
            out["timings"]["draft_n_accepted"] = stats["n_accepted"]
        click.echo(json.dumps(out))
        return
    if stream is None:
        for i, r in enumerate(results):
            label = f"[seq {i}] " if n_parallel > 1 else ""
            sys.stdout.write(f"{label}{r.text}\n")
    else:
        sys.stdout.write("\n")
    for line in _timings_lines(res, memory):
        click.echo(line, err=True)
    if sampling_stats:
        dev = sampling_stats.get("device") or "host"
        click.echo(f"sampling   : device {dev} {sampling_stats['device_stages']}, host "
                   f"{sampling_stats['host_stages']}, "
                   f"{sampling_stats['bytes_d2h_per_token']:.0f} B/token to host"
                   + (f", fallbacks {sampling_stats['fallbacks']}"
                      if sampling_stats["fallbacks"] else ""), err=True)
    if stats is not None:
        for line in _spec_lines(stats):
            click.echo(line, err=True)
        click.echo(f"rollback   : {rollback_used}", err=True)


__all__ = ["PyggspecError", "run"]
