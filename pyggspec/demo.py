"""The built-in demo model: synthetic, Qwen3.5-0.8B-shaped, with a constructed MTP head.

``pyggspec run --spec-type draft-mtp -p ...`` without ``-m`` uses it, so a new user sees
speculative decoding work on a fresh machine without downloading anything. Its weights
are random except for a constructed next-token map that the MTP head agrees with ~95% of
the time (DESIGN §5); its text is meaningless by design.

Whether speculation is faster depends on the machine (on a 2-core CPU a verify step can
cost nearly as much as the tokens it saves), so the demo never claims a speed-up: after
the run it times plain decoding of the same prompt beside speculation on this machine
(:func:`side_by_side`) and says which won.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

DEMO_AGREEMENT = 0.95
DEMO_DTYPE = "q8_0"
# what the first run costs, said before it starts (measured: 39 s to generate on an idle
# 2-core AVX-512 VM, minutes on a loaded one; the file is ~1.1 GiB)
FIRST_RUN = ("first run only: generating the synthetic demo model (0.8B-shaped, ~1.1 GiB "
             "on disk) takes about a minute on an idle machine, a few on a busy one; "
             "later runs load it in seconds")


def cache_dir() -> Path:
    """Where the demo model is kept (``$XDG_CACHE_HOME/pyggspec/demo``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pyggspec" / "demo"


def demo_model(quiet: bool = False) -> Path:
    """Path of the demo GGUF, generating it once (about a minute, ~1.1 GiB) with progress:
    a bar on a terminal, else one line when generation starts and one when it ends.
    ``quiet``: no progress output."""
    from pyggspec.progress import Progress
    from pyggspec.testing import cached_model, qwen35_0_8b

    spec = qwen35_0_8b(dtype=DEMO_DTYPE, agreement=DEMO_AGREEMENT)
    bar: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if quiet:
            return
        if not bar:
            bar.append(Progress(total, _frame, header="pyggspec: generating the synthetic "
                                f"demo model (once) into {cache_dir()}\npyggspec: "
                                f"{FIRST_RUN}"))
        bar[0].set(done)
        if done >= total:
            bar[0].finish()

    try:
        return cached_model(spec, cache_dir(), progress=progress)
    finally:
        if bar:
            bar[0].finish()


def _frame(done: int, total: int, seconds: float) -> str:
    width = 30
    fill = int(width * done / total) if total else width
    return f"  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tensors {seconds:5.1f}s"


def side_by_side(engine: Any, prompts: list[list[int]], n_predict: int = 64,
                 reps: int = 3) -> dict[str, Any]:
    """Decode tokens/s of plain decoding and of ``engine``'s speculation on this machine,
    paired: a plain engine with ``engine``'s settings but no drafter is loaded beside it,
    warmed up, and the two take turns on the same greedy requests (``prompts``, one per
    slot) ``reps`` times, the order swapped every other time. Returns the medians, the
    median of the per-pair ratios and its range, and the draft acceptance."""
    from pyggspec.benchmark import timed_run
    from pyggspec.engine import Engine

    cfg = engine.config.replace(spec_type=None, progress=False)
    plain_tps: list[float] = []
    spec_tps: list[float] = []
    ratios: list[float] = []
    acc: list[float] = []
    with Engine(engine.model_path, config=cfg) as plain:
        timed_run(plain, prompts, n_predict, None, False)  # untimed: graphs built first
        for rep in range(reps):
            order = [(plain, False), (engine, True)]
            got = {}
            for e, spec in (order if rep % 2 == 0 else order[::-1]):
                tps, _, stats, _ = timed_run(e, prompts, n_predict, None, spec)
                got[spec] = tps
                if stats is not None:
                    acc.append(stats.acceptance)
            plain_tps.append(got[False])
            spec_tps.append(got[True])
            ratios.append(got[True] / got[False])
    return {"plain_tps": statistics.median(plain_tps), "spec_tps": statistics.median(spec_tps),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "acceptance": statistics.median(acc) if acc else 0.0, "reps": reps,
            "n_predict": n_predict}


def verdict_lines(cmp: dict[str, Any]) -> list[str]:
    """:func:`side_by_side`'s result as the two lines the demo prints: both speeds side by
    side, then in plain words which won (within 2%: neither)."""
    from pyggspec.benchmark import NOISE

    r = cmp["ratio"]
    lo, hi = cmp["ratio_range"]
    lines = [(f"pyggspec demo: on this machine plain decoding {cmp['plain_tps']:.2f} "
              f"tokens/s, MTP speculation {cmp['spec_tps']:.2f} tokens/s ({r:.2f}x, range "
              f"{lo:.2f}-{hi:.2f}; draft acceptance {cmp['acceptance']:.2f}; {cmp['reps']} "
              f"paired runs of {cmp['n_predict']} tokens)")]
    if r >= 1 + NOISE:
        verdict = f"speculation wins here ({r:.2f}x plain decoding's speed)."
    elif r <= 1 - NOISE:
        verdict = ("plain decoding wins here: speculation does NOT pay on this machine for "
                   "this model (verifying drafts costs more than it saves).")
    else:
        verdict = "a draw here: the difference is within the noise of the measurement."
    lines.append(f"pyggspec demo: -> {verdict} Measure your own model: "
                 "pyggspec bench -m YOUR.gguf")
    return lines


__all__ = ["DEMO_AGREEMENT", "DEMO_DTYPE", "FIRST_RUN", "cache_dir", "demo_model",
           "side_by_side", "verdict_lines"]
