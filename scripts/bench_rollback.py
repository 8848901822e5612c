#!/usr/bin/env python3
"""Snapshot vs checkpoint rollback: tokens/s and target evaluations per emitted token.

Same constructed-agreement 0.8B-shaped q8_0 models as bench_mtp.py; the two strategies run
back to back (paired) for each agreement and n_max; outputs must be identical.

    python3 scripts/bench_rollback.py --agreement 0.95 0.7 --n-max 2 3 4 -n 128
"""

from __future__ import annotations

import argparse
import json
import sys

from bench_mtp import PROMPT, model_for


def run(path, n: int, threads: int, n_max: int, rollback: str) -> dict:
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine

    with Engine(path, n_ctx=1024, n_threads=threads, spec_type="draft-mtp",
                spec=SpecConfig(n_max=n_max, rollback=rollback)) as e:
        r = e.generate_batch([e.tokenize(PROMPT)], max_tokens=n, ignore_eos=True)[0]
        return {"tps": r.timings.to_dict()["predicted_per_second"], "tokens": r.tokens,
                "evals_per_token": e.stats.n_target_evals / len(r.tokens),
                "accept": e.stats.acceptance, "memory": e.memory()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("--n-max", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for agr in args.agreement:
        path = model_for(agr, "q8_0")
        for n_max in args.n_max:
            s = run(path, args.n, args.threads, n_max, "snapshot")
            c = run(path, args.n, args.threads, n_max, "checkpoint")
            rows.append({"agreement": agr, "n_max": n_max, "snapshot_tps": s["tps"],
                         "checkpoint_tps": c["tps"], "ratio": s["tps"] / c["tps"],
                         "snapshot_evals_per_token": s["evals_per_token"],
                         "checkpoint_evals_per_token": c["evals_per_token"],
                         "accept": s["accept"], "identical": s["tokens"] == c["tokens"],
                         "snapshot_state_bytes": s["memory"].get("snapshots", {}),
                         "checkpoint_state_bytes": c["memory"].get("checkpoints", {})})
            print(f"agreement {agr} n_max {n_max}: snapshot {s['tps']:.2f} t/s, checkpoint "
                  f"{c['tps']:.2f} t/s", file=sys.stderr)
    print(f"\n{args.n} greedy tokens, {args.threads} threads; evals = target graph evaluations "
          "per emitted token")
    print(f"{'agree':>5} {'n_max':>5} {'acc':>5} | {'snap t/s':>8} {'ckpt t/s':>8} {'ratio':>6} | "
          f"{'snap evals':>10} {'ckpt evals':>10} | identical")
    for r in rows:
        print(f"{r['agreement']:5.2f} {r['n_max']:5d} {r['accept']:5.2f} | "
              f"{r['snapshot_tps']:8.2f} {r['checkpoint_tps']:8.2f} {r['ratio']:6.3f} | "
              f"{r['snapshot_evals_per_token']:10.3f} {r['checkpoint_evals_per_token']:10.3f} | "
              f"{r['identical']}")
    print(json.dumps({"bench": "rollback", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
