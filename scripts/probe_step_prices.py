#!/usr/bin/env python3
"""Where the default's price of the 4x4 step comes from: its recent runs (factor units),
anchors, the drift, after each request; against the step's own wall times (Q4_K_M ~0.95 -np 4 bench
model, three 4 x 128-token requests). Run with PYTHONPATH at the repository root:

    python3 scripts/probe_step_prices.py
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from bench_inprocess import make_engine, time_steps

path = benchlib.bench_model(0.95, "Q4_K_M")
P = 4
prompts = [benchlib.bench_prompt(32, path, seed=i) for i in range(P)]
e = make_engine(path, "default", P, 2048, 2)
c = e.draft_policy.costs
print("after start-up", {k: round(v, 1) for k, v in c.ms.items() if k[0] == "step" and k[1] == 4}, "drift", round(c.drift, 3))
log = []
time_steps(e, log)
for rep in range(3):
    log.clear()
    e.generate_batch(prompts, max_tokens=128, ignore_eos=True)
    walls = {T: [ms for (B, t, ms, *_ ) in log if B == 4 and t == T] for T in (1, 2, 3, 4)}
    print(f"rep {rep}: drift {c.drift:.3f}",
          {T: (len(w), round(statistics.median(w), 1) if w else None, round(c.ms.get(("step", 4, T), 0), 1)) for T, w in walls.items()},
          "recent4x4", [round(x, 1) for x in c._recent.get(("step", 4, 4), [])],
          "recent4x1", [round(x, 1) for x in c._recent.get(("step", 4, 1), [])],
          "anchors", {k[2]: round(v, 1) for k, v in c._anchor.items() if k[1] == 4},
          "chosen", e.draft_policy.chosen, "declined", e.draft_policy.declined)
