#!/usr/bin/env python3
"""What the default's price of each step shape is made of, against what those steps took.

Row 60's Q4_K_M ~0.95 -np 4 default declined where fixed n_max 3 gained 18%: it priced the
4 x 4 step at 4.0 plain steps. This runs one default engine for a few requests and prints,
after start-up and after each request, per verify-row count at the batch size: the steps
run, their median wall time and the budget's price, then the 4 x 4 and 4 x 1 shapes' recent
runs (speed-factor units) and anchors, and the speed factor:

    PYTHONPATH=. python3 scripts/probe_step_prices.py
    PYTHONPATH=. python3 scripts/probe_step_prices.py --agreement 0.7 --type Q8_0 --parallel 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from bench_inprocess import make_engine, time_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_model_args(ap, "Q4_K_M")
    ap.add_argument("--requests", type=int, default=3)
    args = ap.parse_args()
    path = benchlib.bench_model(args.agreement, args.type)
    P = args.parallel
    prompts = [benchlib.bench_prompt(32, path, seed=i) for i in range(P)]
    e = make_engine(path, "default", P, 2048, 2)
    budget, costs = e.draft_policy, e.draft_policy.costs
    rows = range(1, budget.n_max + 2)
    print("after start-up: prices", {T: round(budget.step_cost(P, T) or 0.0, 1) for T in rows},
          f"speed factor {costs.drift:.3f}")
    log: list = []
    time_steps(e, log)
    for req in range(args.requests):
        log.clear()
        e.generate_batch(prompts, max_tokens=args.n, ignore_eos=True)
        walls = {T: [ms for B, t, ms, *_ in log if B == P and t == T] for T in rows}
        print(f"request {req}: speed factor {costs.drift:.3f}; per rows (steps, median wall, "
              "price):", {T: (len(w), round(statistics.median(w), 1) if w else None,
                              round(budget.step_cost(P, T) or 0.0, 1))
                          for T, w in walls.items()})
        for T in (rows[-1], 1):
            runs, anchor = costs.history("step", P, T)
            print(f"  {P}x{T}: recent runs {[round(x, 1) for x in runs]}, anchor "
                  f"{anchor and round(anchor, 1)}")
        print(f"  drafts kept per step {budget.chosen}, declined {budget.declined}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
