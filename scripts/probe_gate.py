#!/usr/bin/env python3
"""The default against a fixed length request by request, with what the budget believed.

Row 61's ~0.70 misses (default / fixed n_max 3 0.93) did not say whether the budget chose
worse lengths or priced steps wrongly. This runs one default and one fixed-length engine in
one process, taking turns request by request (the same prompts), and prints after each
request: default / fixed wall time, the lengths the default chose in it (steps by drafts
kept), its step ratios and prices per verify-row count, and its Dinkelbach rate against
plain decoding's; then each engine's steps per row count with their median wall time:

    PYTHONPATH=. python3 scripts/probe_gate.py --agreement 0.7 --type Q4_K_M --parallel 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from bench_inprocess import make_engine, time_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_model_args(ap, "Q4_K_M")
    ap.add_argument("--fixed", type=int, default=3, help="the fixed n_max compared with")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    path = benchlib.bench_model(args.agreement, args.type)
    P = args.parallel
    prompts = [benchlib.bench_prompt(32, path, seed=i) for i in range(P)]
    engines = {"default": make_engine(path, "default", P, 2048, 2),
               "fixed": make_engine(path, f"fixed={args.fixed}", P, 2048, 2)}
    budget = engines["default"].draft_policy
    logs = {name: [] for name in engines}
    for name, e in engines.items():
        time_steps(e, logs[name])
    rows = range(1, budget.n_max + 2)
    before = list(budget.chosen)
    for req in range(args.requests):
        wall, by_rows = {}, {}
        for name, e in engines.items():
            logs[name].clear()
            t = time.perf_counter()
            e.generate_batch(prompts, max_tokens=args.n, ignore_eos=True)
            wall[name] = time.perf_counter() - t
            by_rows[name] = {T: (len(w), round(statistics.median(w), 1)) for T in rows
                             if (w := [ms for B, r, ms, *_ in logs[name] if B == P and r == T])}
        chosen = [a - b for a, b in zip(budget.chosen, before)]
        before = list(budget.chosen)
        plain = budget.plain_rate(P)  # None while plain steps at P are not measured yet
        rel = f"{budget.rate(P) / plain:.3f}" if plain else "n/a"
        print(f"request {req}: default / fixed {wall['default'] / wall['fixed']:.3f}; "
              f"drafts kept per step {chosen}; ratios {budget.ratios.to_dict()}; prices "
              f"{[round(budget.step_cost(P, T) or 0.0, 1) for T in rows]}; "
              f"rate / plain {rel}")
        print(f"  steps per rows (count, median ms): default {by_rows['default']}, "
              f"fixed {by_rows['fixed']}")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
