#!/usr/bin/env python3
"""What snapshot rollback adds to a verify step: the target's B x T verify graph keeping
the recurrent state after every row (and what makes the accepted one each sequence's
state) against the same graph writing only the final states. Not a comparison with
llama-server.

Why: a verify step must leave each sequence's state after its accepted rows. Until 6d1e393
the graph wrote the state after *every* row into planes of the slot's own (each snapshot
crossing memory three times: op output, read, row); until the state arena it kept them
in the compute buffer and copied one per sequence into its row; now the op writes them
into the state arena and the accepted one's row becomes the sequence's (no copy; the
"keep" part below is that bookkeeping). This prints both parts, median over ``--reps``
alternating runs in one process (the first two dropped: graph builds)::

    python3 scripts/probe_verify_states.py --agreement 0.7 --type Q4_K_M --parallel 4 --rows 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.add_model_args(ap, "Q4_K_M")
    ap.add_argument("--rows", type=int, default=4, help="verify rows per sequence (T)")
    ap.add_argument("--reps", type=int, default=14)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine
    from pyggspec.models.batch import UBatch

    path = benchlib.bench_model(args.agreement, args.type)
    B, T = args.parallel, args.rows
    e = Engine(str(path), n_ctx=2048 * B, n_parallel=B, n_threads=args.threads,
               load_tokenizer=False, progress=False, spec_type="draft-mtp",
               spec=SpecConfig(n_max=max(T - 1, 1), rollback="snapshot"))
    w, mem = e.worker, e.worker.memory
    for s in range(B):
        e.decode({s: benchlib.bench_prompt(32, path, seed=s)})
    rng = np.random.default_rng(0)

    def ubatch(keep: bool) -> UBatch:
        src = np.array([mem.state_row(s) for s in range(B)], np.int32)
        return UBatch(rng.integers(10, 1000, size=(B, T)).astype(np.int32),
                      np.array([mem.length(s) for s in range(B)], np.int64), tuple(range(B)),
                      np.arange(B * T, dtype=np.int32), hidden=True, state_src=src,
                      state_dst=src[None, :].copy(), snapshots=keep)

    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for rep in range(args.reps):
        for keep in (True, False) if rep % 2 else (False, True):
            ub = ubatch(keep)
            t0 = time.perf_counter()
            w.target.run(ub, copy=False)
            t1 = time.perf_counter()
            if keep:  # every sequence keeps a different row's state, as acceptance varies
                for b in range(B):
                    mem.commit(b, (), kept=mem.kept_row(b, (rep + b) % T, B))
            runs[keep].append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    e.close()
    final, kept = (runs[k][2:] for k in (False, True))
    med = statistics.median
    g_final, g_kept = med(r for r, _ in final), med(r for r, _ in kept)
    copy = med(c for _, c in kept)
    print(f"{args.type} ~{args.agreement} {B}x{T}: final states only {g_final:.1f} ms; "
          f"states kept {g_kept:.1f} ms (+{g_kept - g_final:.1f}) + keep {copy:.1f} ms "
          f"= +{g_kept + copy - g_final:.1f} ms ({(g_kept + copy) / g_final - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
