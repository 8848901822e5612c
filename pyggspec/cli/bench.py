"""``pyggspec bench``: does speculation pay on this machine with this file, and at which
draft length?

Thin: the measurement is :func:`pyggspec.benchmark.run_bench` (the engines ``pyggspec run``
builds, paired request by request); this renders it, draws a bar while it runs, and prints
JSON (``--json``) or a plot (``--plot``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pyggspec.cli.common import (
    CONTEXT_SETTINGS,
    MODEL,
    N_CTX,
    N_PARALLEL,
    add_rpc_servers,
    engine_config,
    placement_options,
    print_fit,
    spec_options,
)
from pyggspec.config import EngineConfig


def _lengths(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in value.replace(" ", "").split(",") if x}))
    except ValueError:
        raise click.BadParameter("expected draft lengths like 1,2,3,4") from None
    if any(n < 1 or n > 16 for n in out):
        raise click.BadParameter("draft lengths must be between 1 and 16")
    return out


@click.command(context_settings=CONTEXT_SETTINGS)
@MODEL(required=True, help="Your GGUF (MTP head grafted, or give the head with -md).")
@N_PARALLEL(help="Sequences decoded together in each request batch (as run -np).")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Paired repetitions: each runs every setting once.")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(min=2), default=128,
              show_default=True, help="Tokens generated per request.")
@click.option("-p", "--prompt", "prompts", multiple=True,
              help="Prompt text (repeat for several; default: four built-in prompts, cycled "
                   "over the sequences).")
@click.option("--n-prompt", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompts are cut to this many tokens.")
@click.option("--fixed", "fixed", default="1,2,3,4", show_default=True, callback=_lengths,
              help="Fixed draft lengths to compare with the default rule.")
@N_CTX(default=1024, help="Context of each sequence (prompt + output must fit).")
@placement_options()
@spec_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--plot", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="FILE.png", help="Draw tokens/s against draft length (needs "
              "matplotlib: pip install 'pyggspec[plot]').")
@engine_config
def bench(model: Path, config: EngineConfig, reps: int, n_predict: int,
          prompts: tuple[str, ...], n_prompt: int, fixed: tuple[int, ...], rpc: str | None,
          as_json: bool, plot: Path | None, fit_print: bool = False) -> None:
    """Measure plain decoding against speculation on MODEL, on this machine.

    Runs, paired request by request in one process: plain decoding, the default
    (the draft-length rule up to --spec-draft-n-max) and each fixed draft length.
    Prints decode and prefill tokens/s with their range, acceptance per draft position,
    the best setting, what the default chose, whether speculation pays here, and memory.
    It takes minutes; it says how many after its warm-up. It holds three engines at once
    (plain, default, fixed lengths): up to three times the memory of `pyggspec run`.
    """
    from pyggspec.benchmark import plot as draw
    from pyggspec.benchmark import render, run_bench
    from pyggspec.progress import Progress

    if fit_print:  # -fitp: the fit's table (as each engine would be fitted), then exit
        add_rpc_servers(rpc)
        print_fit(model, config)
        return

    if plot is not None:  # fail before minutes of measuring, not after them
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib (pip install 'pyggspec[plot]' "
                                   "or pip install matplotlib)") from None
    add_rpc_servers(rpc)
    config = config.replace(progress=False if as_json else config.progress)
    bar: list[Progress] = []
    err = sys.stderr

    def log(line: str) -> None:
        click.echo(f"pyggspec bench: {line}", err=True)

    def progress(done: int, total: int, label: str) -> None:
        if not bar:
            bar.append(Progress(total, _frame(label_box), start="  measuring ...",
                                stream=err))
        label_box[0] = label
        bar[0].set(done)
        if done >= total:
            bar[0].finish()

    label_box = [""]
    log(f"{model}: plain decoding against speculation, {reps} paired repetitions; this "
        "takes minutes (the estimate follows the warm-up)")
    try:
        report = run_bench(model, config, reps=reps, n_predict=n_predict, n_prompt=n_prompt,
                           fixed=fixed, prompts=prompts or None, progress=progress, log=log)
    finally:
        if bar:
            bar[0].finish()
    if as_json:
        click.echo(report.json())
    else:
        for line in render(report):
            click.echo(line)
    if plot is not None:  # after the report: a failing plot never loses the measurement
        draw(report, plot)
        log(f"plot written to {plot}")


def _frame(label_box: list[str]):
    def frame(done: int, total: int, seconds: float) -> str:
        width = 30
        fill = int(width * done / total) if total else width
        return (f"  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} runs "
                f"{seconds:5.0f}s  {label_box[0]:<16s}")
    return frame


__all__ = ["bench"]
