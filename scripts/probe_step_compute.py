#!/usr/bin/env python3
"""Where a decode step's wall time goes, per step shape, for engines in one process: the
target's compute, the MTP head's compute and the host's rest (``bench_inprocess``'s
``time_steps``: the graphs' ``compute_ms_total`` read around each step). Not a comparison
with llama-server.

Why: ``bench_inprocess.py --steps`` says which step shapes an engine ran and what they
cost as a whole; when two engines run the same shape at different speeds (row 57: the
default's 4 x 4 steps 6 ms slower than fixed n=3's), this says which part differs.

    python3 scripts/probe_step_compute.py --agreement 0.95 --type Q8_0 --parallel 4 \\
        --engines default fixed=3 --reps 6

Engines as in ``bench_inprocess.py`` (``plain``, ``default``, ``forced=N``, ``fixed=N``,
...); its ``time_steps`` logs the steps. Repetitions alternate the order of the engines.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from bench_inprocess import make_engine, time_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_model_args(ap, "Q8_0")
    ap.add_argument("--engines", nargs="+", default=["default", "fixed=3"])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("-c", "--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=3, help="step shapes shown per engine")
    args = ap.parse_args()
    path = benchlib.bench_model(args.agreement, args.type)
    P = args.parallel
    prompts = [benchlib.bench_prompt(32, path, seed=i) for i in range(P)]
    engines = {n: make_engine(path, n, P, args.ctx, args.threads) for n in args.engines}
    logs: dict[str, list] = {n: [] for n in engines}
    for n, e in engines.items():  # warm-up before the wrap: graphs built, not timed
        e.generate_batch([prompts[0][:8]], max_tokens=4, ignore_eos=True)
        time_steps(e, logs[n])
    names = list(engines)
    for rep in range(args.reps):
        for n in names if rep % 2 == 0 else names[::-1]:
            engines[n].generate_batch(prompts, max_tokens=args.n, ignore_eos=True)
            print(f"rep {rep} {n}", file=sys.stderr)
    print("engine shape steps | medians ms: wall target head host | head runs")
    for n in names:
        by = collections.defaultdict(list)
        for B, T, wall, _tokens, target, head, runs in logs[n]:
            if B != "prompt":
                by[f"{B}x{T}"].append((wall, target, head, runs))
        for shape in sorted(by, key=lambda k: -len(by[k]))[:args.top]:
            v = by[shape]
            med = [statistics.median(x[i] for x in v) for i in range(4)]
            host = statistics.median(x[0] - x[1] - x[2] for x in v)
            print(f"{n} {shape} {len(v)} | {med[0]:.2f} {med[1]:.2f} {med[2]:.2f} "
                  f"{host:.2f} | {med[3]:.0f}")
        engines[n].close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
