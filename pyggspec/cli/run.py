"""``pyggspec run``: generate text from a GGUF, llama.cpp-style flags and timings.

Thin: parses flags, builds an :class:`~pyggspec.engine.Engine`, streams pieces to stdout
and prints timings (or one JSON object with ``--json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pyggspec.cli.common import (
    CHECKPOINT_MIN_STEP,
    CONTEXT_SETTINGS,
    CTX_CHECKPOINTS,
    IMAGE_MAX_TOKENS,
    IMAGE_MIN_TOKENS,
    MODEL,
    N_BATCH,
    N_CTX,
    N_PARALLEL,
    N_UBATCH,
    add_rpc_servers,
    engine_config,
    engine_from_config,
    fmt_bytes,
    placement_options,
    print_fit,
    sampling_options,
    spec_options,
    with_projector,
)
from pyggspec.cli.llama_flags import LlamaCommand, llama_flags
from pyggspec.config import EngineConfig
from pyggspec.errors import PyggspecError
from pyggspec.sampling.grammar import GrammarSpec


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


def _timings_lines(results, memory: dict) -> list[str]:
    """The generate call's timings (all prompts), memory and the first result's stop."""
    t = results.timings.to_dict(host=True)
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
    lines.append(f"stop       : {results[0].stop_reason}")
    return lines


def _spec_lines(stats: dict) -> list[str]:
    pp = ", ".join(f"{p:.3f}" for p in stats["per_position"])
    return [
        (f"draft acceptance rate = {stats['acceptance']:.5f} ({stats['n_accepted']} accepted / "
        f"{stats['n_drafted']} generated)"),
        (f"mean accepted length = {stats['mean_accepted_length']:.3f} tokens per step, "
        f"per-position acceptance = [{pp}]"),
        f"target evals = {stats['n_target_evals']}, mtp evals = {stats['n_mtp_evals']}",
        *_lengths_lines(stats.get("draft_lengths")),
        *_hot_lines(stats.get("hot_vocab")),
    ]


def _hot_lines(hot: dict | None) -> list[str]:
    if not hot:
        return []
    held = hot["emitted_in_set"]
    return [f"draft vocabulary = {hot['size']} hot ids ({'in use' if hot['active'] else 'not in use'}"
            f", holding {held * 100:.1f}% of the emitted tokens)" if held is not None else
            f"draft vocabulary = {hot['size']} hot ids"]


def _lengths_lines(lengths: dict | None) -> list[str]:
    """The draft-length rule, per drafter kind: lengths chosen, survival, step costs."""
    out = []
    for kind, d in (lengths or {}).items():
        chosen = ", ".join(f"{k}: {n}" for k, n in enumerate(d["lengths"]) if n)
        surv = ", ".join(f"{v:.2f}" for v in d["survival"])
        ratios = ", ".join(f"{s}: {r:.2f}" for s, r in d["ratios"].items())
        out.append(f"draft lengths [{kind}] = {{{chosen}}}, survival = [{surv}], "
                   f"step cost (plain steps) = {{{ratios}}}")
    return out


def _grammar_option(grammar: str | None, grammar_file: Path | None, json_schema: str | None,
                    json_schema_file: Path | None) -> GrammarSpec | None:
    """llama.cpp's --grammar / --grammar-file / -j / -jf as one constraint (at most one
    given). Errors name the flag, or the file for the *-file forms; the grammar itself is
    compiled once the engine (its vocabulary) is loaded."""
    given = [(f, v) for f, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                 ("--json-schema", json_schema),
                                 ("--json-schema-file", json_schema_file)) if v is not None]
    if len(given) > 1:
        raise PyggspecError(given[1][0], f"give one of {', '.join(f for f, _ in given)}")
    if not given:
        return None
    flag, value = given[0]
    where, text = flag, value
    if isinstance(value, Path):
        where = str(value)
        try:
            text = value.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PyggspecError(where, "no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PyggspecError(where, f"cannot read it: {e}") from None
    kind = "json_schema" if flag.startswith("--json") else "gbnf"
    return GrammarSpec(kind, str(text), where)


@click.command(cls=LlamaCommand, context_settings=CONTEXT_SETTINGS)
@MODEL(help="GGUF model (trunk, MTP grafted or not). Without it, --spec-type draft-mtp runs "
            "the built-in synthetic demo model.")
@click.option("-p", "--prompt", "prompts", multiple=True,
              help="Prompt text (repeat for several sequences with --parallel).")
@click.option("-f", "--file", "prompt_file", type=click.Path(path_type=Path, exists=True,
              dir_okay=False), help="Read the prompt from a file.")
@click.option("--prompt-tokens", default=None, metavar="ID,ID,...",
              help="Prompt as token ids (skips tokenization).")
@click.option("-cnv", "--chat", "--conversation", "chat", is_flag=True,
              help="Wrap the prompt as a user message with the GGUF's chat template.")
@click.option("-sys", "--system-prompt", default=None, help="System message for --chat.")
@click.option("-n", "--predict", "--n-predict", "n_predict", type=click.IntRange(min=-2),
              default=128, show_default=True, help="Tokens to generate per sequence (-1: until "
              "end of generation or the context is full; -2: until the context is full, the "
              "same here: there is no context shift).")
@N_CTX()
@N_PARALLEL()
@N_BATCH()
@N_UBATCH()
@placement_options()
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation.")
@spec_options
@CTX_CHECKPOINTS()
@CHECKPOINT_MIN_STEP()
@sampling_options
@click.option("--grammar", default=None, metavar="GBNF",
              help="Constrain the output with a GBNF grammar (llama.cpp's syntax).")
@click.option("--grammar-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Read the GBNF grammar from a file.")
@click.option("-j", "--json-schema", "json_schema", default=None, metavar="SCHEMA",
              help="Constrain the output to JSON matching this JSON schema.")
@click.option("-jf", "--json-schema-file", type=click.Path(path_type=Path, dir_okay=False),
              default=None, help="Read the JSON schema from a file.")
@click.option("-mm", "--mmproj", "mmproj_path", type=click.Path(path_type=Path), default=None,
              help="Vision projector GGUF (convert_hf_to_gguf.py --mmproj) for --image.")
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path),
              help="Image file for the prompt (repeat for several); each <__media__> in the "
              "prompt places the next one, without a marker they go first. Needs --mmproj.")
@click.option("--no-mmproj-offload", "no_mmproj_offload", is_flag=True,
              help="Encode images on the CPU (default: the projector's GPU device, if any).")
@IMAGE_MAX_TOKENS()
@IMAGE_MIN_TOKENS()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
@llama_flags("run")
@engine_config
def run(model: Path | None, config: EngineConfig, prompts: tuple[str, ...],
        prompt_file: Path | None, prompt_tokens: str | None, chat: bool,
        system_prompt: str | None, n_predict: int, rpc: str | None, ignore_eos: bool,
        grammar: str | None, grammar_file: Path | None, json_schema: str | None,
        json_schema_file: Path | None, as_json: bool, mmproj_path: Path | None = None,
        images: tuple[Path, ...] = (), no_mmproj_offload: bool = False,
        fit_print: bool = False) -> None:
    """Generate text from MODEL, optionally with MTP speculative decoding.

    Sampling follows llama.cpp's flags and defaults (--temp 0.8 ...; --temp 0 is greedy).
    """
    if fit_print:  # -fitp: the fit's table, then exit (no prompt needed)
        add_rpc_servers(rpc)
        print_fit(model, config)
        return
    constraint = _grammar_option(grammar, grammar_file, json_schema, json_schema_file)
    ids = _parse_prompt_tokens(prompt_tokens)
    texts = list(prompts)
    if prompt_file is not None:
        texts.append(prompt_file.read_text())
    if ids is None and not texts:
        raise click.UsageError("give a prompt with -p, -f or --prompt-tokens")
    if images and mmproj_path is None:
        raise PyggspecError("--image", "an image needs the model's vision projector: give "
                            "it with --mmproj FILE")
    if images and ids is not None:
        raise PyggspecError("--image", "needs a text prompt (-p or -f), not --prompt-tokens")
    for img in images:
        if not img.is_file():
            raise PyggspecError(img, "no such file" if not img.exists() else "not a file")
    config = with_projector(config, mmproj_path, not no_mmproj_offload)
    demo = False
    if model is None:
        if not config.speculative:
            raise click.UsageError("missing -m/--model (only --spec-type draft-mtp has a "
                                   "built-in demo model)")
        from pyggspec.demo import demo_model

        model = demo_model(quiet=as_json)
        demo = True
        if not as_json:
            click.echo("pyggspec: running the built-in SYNTHETIC demo model (random weights, "
                       "constructed MTP agreement ~95%): the text is meaningless; plain "
                       "decoding is timed beside speculation afterwards.", err=True)
    add_rpc_servers(rpc)
    if as_json:
        config = config.replace(progress=False)
    n_parallel = config.n_parallel
    with engine_from_config(model, config) as engine:
        if engine.fit is not None and engine.fit.result.changed and not as_json:
            click.echo(engine.fit.table(), err=True)  # what --fit changed, once
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
                inputs.append(text if images else engine.tokenize(text))
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

        if n_predict < 0:  # -1/-2: the context bounds the output
            n_predict = engine.n_ctx
        results = engine.generate_batch(inputs, max_tokens=n_predict, ignore_eos=ignore_eos,
                                        on_tokens=stream, grammar=constraint,
                                        images=[list(images)] * len(inputs) if images
                                        else None)
        if stream is not None:
            sys.stdout.write(detok.flush())
        memory = engine.memory()
        fit = engine.fit.to_dict() if engine.fit is not None else None
        stats = results.stats.to_dict(engine.spec_type) if engine.spec_type else None
        if stats is not None:  # how the drafts of sampling chains were made
            d = engine.drafter
            stats["drafters"] = d.counters()  # each kind's own counts
            if d.mtp is not None:
                stats["draft_sampling"] = {"mode": engine.spec.draft_sampling,
                                           "coupled_drafts": d.mtp.n_coupled,
                                           "argmax_drafts": d.mtp.n_argmax}
                if d.mtp.hot is not None:  # the draft head's hot vocabulary
                    stats["hot_vocab"] = d.mtp.hot.to_dict()
            if engine.draft_lengths is not None:  # survival, step costs, lengths chosen
                stats["draft_lengths"] = engine.draft_lengths.to_dict()
        rollback_used = engine.rollback
        sampling_stats = engine.samplers.stats.to_dict() if engine.samplers else {}
        compared = None
        if demo and not as_json:  # which is faster here, plain or speculative (demo.py)
            from pyggspec.demo import side_by_side

            click.echo("pyggspec demo: timing plain decoding beside speculation on this "
                       "machine ...", err=True)
            compared = side_by_side(engine, inputs, n_predict=min(max(n_predict, 16), 64))
    res = results[0]
    if as_json:
        out = res.to_dict() if n_parallel == 1 else {
            "results": [r.to_dict() for r in results],
            "timings": results.timings.to_dict(host=True)}
        out["memory"] = memory
        out["fit"] = fit  # what --fit chose (None: --fit off)
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
    for line in _timings_lines(results, memory):
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
    if compared is not None:
        from pyggspec.demo import verdict_lines

        for line in verdict_lines(compared):
            click.echo(line, err=True)


__all__ = ["run"]
