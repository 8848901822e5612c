#!/usr/bin/env python3
"""Start-up of speculation: a fresh ``pyggspec run --spec-type draft-mtp`` over a plain one (issue 51).

Each repetition runs, one fresh process at a time in alternating order, ``pyggspec run`` on
the bench model with the same prompt and ``-n 1`` (one token: loading, warming the graphs
and the prompt's prefill are all there is), plain and with ``--spec-type draft-mtp`` (the
default draft-length rule). Reported: the process's wall time with speculation less the
plain one's, paired per repetition (median [min-max] seconds), and both walls. A second
table does the same with ``-n N`` (default 128) and gives tokens/s speculative over plain
from the same fresh processes, the figure a user starting ``pyggspec run`` sees.

    python3 scripts/bench_startup.py --reps 7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import benchlib


def run(model: Path, prompt: list[int], n: int, spec: bool, threads: int) -> tuple[float, dict]:
    """One fresh CLI process: its wall time (s) and its ``--json`` output."""
    cmd = [sys.executable, "-m", "pyggspec", "run", "-m", str(model), "-t", str(threads),
           "--prompt-tokens", ",".join(map(str, prompt)), "-n", str(n), "--ignore-eos",
           "--temp", "0", "--json"]
    if spec:
        cmd += ["--spec-type", "draft-mtp"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"pyggspec run: {p.stderr.strip()[-800:]}")
    return wall, json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agreement", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("-n", type=int, default=128, help="tokens of the tokens/s table (0: none)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    model = benchlib.generated_model(args.agreement, "q8_0")
    prompt = benchlib.bench_prompt(32, model)
    rows: list[dict] = []
    for rep in range(args.reps):
        row: dict = {}
        order = (False, True) if rep % 2 == 0 else (True, False)
        for n in (1, args.n) if args.n else (1,):
            for spec in order:
                wall, out = run(model, prompt, n, spec, args.threads)
                name = f"{'spec' if spec else 'plain'}_{n}"
                row[name] = {"wall_s": wall, "tps": out["timings"]["predicted_per_second"],
                             "tokens": out.get("tokens")}
        row["startup_s"] = row["spec_1"]["wall_s"] - row["plain_1"]["wall_s"]
        if args.n:
            row["tps_ratio"] = row[f"spec_{args.n}"]["tps"] / row[f"plain_{args.n}"]["tps"]
            row["wall_ratio"] = row[f"plain_{args.n}"]["wall_s"] / row[f"spec_{args.n}"]["wall_s"]
            row["same_tokens"] = row[f"spec_{args.n}"]["tokens"] == row[f"plain_{args.n}"]["tokens"]
        rows.append(row)
        print(f"rep {rep}: start-up {row['startup_s']:+.3f} s (plain {row['plain_1']['wall_s']:.2f} s)"
              + (f", tokens/s spec/plain {row['tps_ratio']:.3f}, wall plain/spec "
                 f"{row['wall_ratio']:.3f}, same tokens {row['same_tokens']}" if args.n else ""),
              flush=True)
    print(f"start-up of draft-mtp over plain (s): {benchlib.median_range([r['startup_s'] for r in rows])}")
    print(f"plain -n 1 wall (s): {benchlib.median_range([r['plain_1']['wall_s'] for r in rows], '{:.2f}')}")
    if args.n:
        print(f"-n {args.n} tokens/s spec/plain: {benchlib.median_range([r['tps_ratio'] for r in rows])}; "
              f"whole-process wall plain/spec: {benchlib.median_range([r['wall_ratio'] for r in rows])}")
    benchlib.write_results(args, rows=rows)


if __name__ == "__main__":
    main()
