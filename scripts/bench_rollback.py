#!/usr/bin/env python3
"""Snapshot vs checkpoint rollback: tokens/s and target evaluations per emitted token.

pyggspec against itself (llama.cpp has no such choice): on the constructed-agreement
0.8B-shaped models as generated (q8_0, the same file as bench_serve's default), for each
agreement and n_max, ``--spec-rollback snapshot`` and ``checkpoint`` each run as a fresh
process, one at a time and in alternating order per repetition, the same greedy request (a
seeded 32-token prompt, as bench_mtp's). Ratios are snapshot / checkpoint, paired per
repetition, then the median; outputs must be identical (checked in every row).

    python3 scripts/bench_rollback.py --agreement 0.95 0.7 --n-max 2 3 4 -n 128
    python3 scripts/bench_rollback.py -m model.gguf --n-max 3 -n 16 --reps 1   # one given file
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

N_PROMPT = 32
MODES = ("snapshot", "checkpoint")


def run(path: Path, args: argparse.Namespace, n_max: int, rollback: str) -> dict:
    """One greedy request with ``--spec-rollback rollback`` in a fresh process."""
    body = f"""
prompt = {benchlib.bench_prompt(N_PROMPT, path)!r}
e.generate(prompt[:8], max_tokens=4, ignore_eos=True)  # warm-up
r = e.generate(prompt, max_tokens={args.n}, ignore_eos=True)
mem = e.memory()
out = {{"tps": r.timings.to_dict()["predicted_per_second"], "tokens": r.tokens,
       "evals_per_token": r.spec.n_target_evals / len(r.tokens),
       "state_bytes": sum(mem.get({rollback + "s"!r}, {{}}).values())}}
"""
    return benchlib.run_engine(
        path, f"n_ctx={args.ctx}, n_threads={args.threads}, spec_type='draft-mtp', "
              f"spec=SpecConfig(n_max={n_max}, rollback={rollback!r})", body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="benchmark this GGUF instead")
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("--n-max", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    benchlib.add_offload_args(ap)
    args = ap.parse_args()
    benchlib.set_offload(args)
    models = ([(0.0, args.model)] if args.model else
              [(a, benchlib.generated_model(a, "q8_0")) for a in args.agreement])
    rows = []
    for agr, path in models:
        for n_max in args.n_max:
            reps = []
            for rep in range(args.reps):
                got = {}
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    got[mode] = run(path, args, n_max, mode)
                    print(f"{path.name} n_max {n_max} rep {rep} {mode:10s} "
                          f"{got[mode]['tps']:7.2f} t/s", file=sys.stderr)
                reps.append(got)
            rows.append(summarize(agr, n_max, reps))
    print(f"\n{args.n} greedy tokens, {args.threads} threads, {args.reps} paired rep(s); "
          "evals = target graph evaluations per emitted token; state = the extra recurrent "
          "state rows (MB)")
    print(f"{'agree':>5} {'n_max':>5} {'acc':>5} | {'snap t/s':>8} {'ckpt t/s':>8} {'ratio':>6} | "
          f"{'snap evals':>10} {'ckpt evals':>10} | {'snap MB':>7} {'ckpt MB':>7} | identical")
    for r in rows:
        print(f"{r['agreement']:5.2f} {r['n_max']:5d} {r['accept']:5.2f} | "
              f"{r['snapshot_tps']:8.2f} {r['checkpoint_tps']:8.2f} {r['ratio']:6.3f} | "
              f"{r['snapshot_evals_per_token']:10.3f} {r['checkpoint_evals_per_token']:10.3f} | "
              f"{r['snapshot_state_bytes'] / 1e6:7.2f} {r['checkpoint_state_bytes'] / 1e6:7.2f} | "
              f"{r['identical']}")
    print(json.dumps({"bench": "rollback", "n": args.n, "threads": args.threads,
                      "reps": args.reps, "rows": rows}))
    return 0


def summarize(agr: float, n_max: int, reps: list[dict[str, dict]]) -> dict:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in reps)

    return {"agreement": agr, "n_max": n_max, "accept": reps[0]["snapshot"]["accept"],
            "snapshot_tps": med("snapshot", "tps"), "checkpoint_tps": med("checkpoint", "tps"),
            "ratio": statistics.median(r["snapshot"]["tps"] / r["checkpoint"]["tps"]
                                       for r in reps),
            "ratio_range": [min(r["snapshot"]["tps"] / r["checkpoint"]["tps"] for r in reps),
                            max(r["snapshot"]["tps"] / r["checkpoint"]["tps"] for r in reps)],
            "snapshot_evals_per_token": med("snapshot", "evals_per_token"),
            "checkpoint_evals_per_token": med("checkpoint", "evals_per_token"),
            "snapshot_state_bytes": reps[0]["snapshot"]["state_bytes"],
            "checkpoint_state_bytes": reps[0]["checkpoint"]["state_bytes"],
            "identical": all(r["snapshot"]["tokens"] == r["checkpoint"]["tokens"] for r in reps)}


if __name__ == "__main__":
    sys.exit(main())
