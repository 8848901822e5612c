#!/usr/bin/env python3
"""pyggspec engines against each other inside one process: the same greedy requests
alternating between them, paired per repetition.

Why beside ``bench_mtp.py``: that one starts a fresh process per run, as a user would, and on
these VMs processes differ by up to ±15% in decode speed among themselves; a 2% question (does
the default draft budget cost anything where it declines?) drowns in that. Here every engine
lives in the same process for the whole run, so the paired ratios show what the engines
themselves cost (docs/benchmarks.md row 38). Not a comparison with llama-server.

    python3 scripts/bench_inprocess.py --agreement 0.7 --type Q4_K_M --reps 6
    python3 scripts/bench_inprocess.py --agreement 0.95 --type Q8_0 --parallel 4 \\
        --engines default fixed=2 --reps 6

Engines: ``plain`` (no speculation), ``default`` (draft lengths by the draft-length rule),
``fixed=N`` (``--spec-draft-fixed --spec-draft-n-max N``); ``+dv=N`` / ``+head=TYPE`` /
``+cap=N`` / ``+type=KINDS`` after a speculative one add ``--spec-draft-vocab N`` /
``--spec-draft-head TYPE`` / ``--spec-draft-n-max N`` (the default's cap) / ``--spec-type
KINDS`` (e.g. ``default+type=ngram-mod,draft-mtp``; commas inside, no spaces);
``+huge=0`` after any loads its weights without huge pages
(:mod:`pyggspec.ggml.hugepages`); ``#label`` after any names one engine twice (``fixed=3
fixed=3#b``: what two identical engines read apart). The first engine is the reference of the
ratios. ``--turns step``: the engines take turns step by step instead of request by request
(``benchlib.step_turns``; ~1% between identical engines in 5 reps, docs/benchmarks.md row 66). Each repetition runs every engine once (order reversed every other repetition);
``--parallel`` requests of ``-n`` tokens each, 32-token seeded prompts, ``ignore_eos``.

``--steps`` adds where each engine's time went: per step shape (sequences x verify rows),
the steps, their median wall time, their share of the decode time, the tokens a step
yielded and the milliseconds per token (e.g. a default losing to fixed n_max 3 in the
two-draft steps it chose: docs/benchmarks.md, row 51's section).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib


def make_engine(path: Path, spec: str, P: int, ctx: int, threads: int):
    """An engine by name (see the module docstring), optionally with ``+dv=N``
    (--spec-draft-vocab), ``+head=TYPE`` (--spec-draft-head), ``+cap=N`` (the cap),
    ``+type=KINDS`` (--spec-type) or ``+huge=0`` (weights on the system's pages:
    ``PYGGSPEC_HUGE_PAGES=0`` while it loads) after it."""
    kw = {"n_ctx": ctx * P, "n_parallel": P, "n_threads": threads, "load_tokenizer": False,
          "progress": False}
    base, *extra = spec.split("#", 1)[0].split("+")  # "#label": one engine twice
    skw: dict = {}
    huge = None
    for x in extra:
        key, _, val = x.partition("=")
        if key == "dv":
            skw["draft_vocab"] = int(val)
        elif key == "head":
            skw["draft_head"] = val
        elif key == "cap":
            skw["n_max"] = int(val)
        elif key == "type":
            kw["spec_type"] = val
        elif key == "huge":  # weights without (0) or with (1) huge pages
            huge = val
        else:
            raise SystemExit(f"bench_inprocess: unknown option {x!r} "
                             "(dv=N, head=TYPE, cap=N, type=KINDS, huge=0|1)")
    if huge is None:
        return _engine(path, base, skw, kw)
    before = os.environ.get("PYGGSPEC_HUGE_PAGES")  # the caller's setting comes back
    os.environ["PYGGSPEC_HUGE_PAGES"] = huge
    try:
        return _engine(path, base, skw, kw)
    finally:
        if before is None:
            del os.environ["PYGGSPEC_HUGE_PAGES"]
        else:
            os.environ["PYGGSPEC_HUGE_PAGES"] = before


def _engine(path: Path, base: str, skw: dict, kw: dict):
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine

    if base == "plain" and not skw and "spec_type" not in kw:
        return Engine(str(path), **kw)
    kw.setdefault("spec_type", "draft-mtp")
    if base == "default":
        return Engine(str(path), spec=SpecConfig(**skw), **kw)
    if base.startswith("fixed="):
        n = int(base.split("=", 1)[1])
        return Engine(str(path), spec=SpecConfig(n_max=n, adaptive=False, **skw), **kw)
    raise SystemExit(f"bench_inprocess: unknown engine {base!r} (plain, default, fixed=N; "
                     "options of speculative ones: +dv=N, +head=TYPE, +cap=N, +type=KINDS; "
                     "of any: +huge=0)")


def time_steps(engine, log: list) -> None:
    """Append (sequences, verify rows, wall ms, tokens, target compute ms, head compute ms,
    head runs) for every decode step ``engine`` runs ("prompt" for a step with prompt
    chunks) to ``log``: its worker's ``run`` wrapped, the graphs' ``compute_ms_total`` read
    around it. With ``--turns step`` that includes the untimed turns an engine takes after
    its requests are done (:func:`benchlib.step_turns`)."""
    worker = engine.worker
    run = worker.run
    tgt, mtp = worker.target, worker.mtp

    def timed(batch):
        t0, tc = time.perf_counter(), tgt.compute_ms_total
        mc, me = (mtp.compute_ms_total, mtp.n_evals) if mtp else (0.0, 0)
        out = run(batch)
        ms = (time.perf_counter() - t0) * 1000
        if batch.decode and not batch.prompt:
            T = 1 + max((so.n_drafted for so in out.seqs.values()), default=0)
            log.append((len(batch.decode), T, ms, sum(len(so.tokens) for so in out.seqs.values()),
                        tgt.compute_ms_total - tc,
                        (mtp.compute_ms_total - mc) if mtp else 0.0,
                        (mtp.n_evals - me) if mtp else 0))
        else:
            log.append(("prompt", 0, ms, 0, 0.0, 0.0, 0))
        return out

    worker.run = timed


def step_table(log: list) -> dict:
    """Per step shape: steps, median ms, share of all step time, tokens per step, ms per
    token."""
    by = collections.defaultdict(list)
    for B, T, ms, tok, *_ in log:
        by[f"{B}x{T}" if B != "prompt" else "prompt"].append((ms, tok))
    total = sum(ms for v in by.values() for ms, _ in v) or 1.0
    return {k: {"steps": len(v), "median_ms": round(statistics.median(m for m, _ in v), 2),
                "share": round(sum(m for m, _ in v) / total, 4),
                "tokens_per_step": round(sum(t for _, t in v) / len(v), 2),
                "ms_per_token": (round(sum(m for m, _ in v) / sum(t for _, t in v), 2)
                                 if any(t for _, t in v) else None)}
            for k, v in sorted(by.items(), key=lambda kv: (kv[0] != "prompt", kv[0]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="this GGUF instead of a bench model")
    ap.add_argument("--agreement", type=float, default=0.7)
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--engines", nargs="+", default=["plain", "default"])
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", action="store_true",
                    help="prompts whose greedy continuation is text they already hold: a "
                         "prompt, the model's own greedy chain S after it (n + 48 tokens), "
                         "other tokens, then the first 16 tokens of S (for the n-gram kinds)")
    ap.add_argument("--steps", action="store_true",
                    help="also report each engine's time per step shape (sequences x rows)")
    ap.add_argument("--turns", choices=["request", "step"], default="request",
                    help="request: the engines take turns request by request; step: "
                         "step by step (benchlib.step_turns), each engine's time the sum "
                         "of its own decode steps")
    args = ap.parse_args()
    path = args.model or benchlib.bench_model(args.agreement, args.type)
    P = args.parallel
    prompts = [benchlib.bench_prompt(32, path, seed=i) for i in range(P)]
    engines = {name: make_engine(path, name, P, args.ctx, args.threads)
               for name in args.engines}
    if args.repeat:  # prompt + S + other tokens + S[:16]: the continuation is S[16:]
        first = next(iter(engines.values()))
        chains = [first.generate(p, max_tokens=args.n + 48, ignore_eos=True).tokens
                  for p in prompts]
        other = benchlib.bench_prompt(8, path, seed=99)
        prompts = [p + c + other + c[:16] for p, c in zip(prompts, chains)]
    for e in engines.values():  # warm-up: graphs built before anything is timed
        e.generate_batch([prompts[0][:8]], max_tokens=4, ignore_eos=True)
    steps: dict[str, list] = {name: [] for name in engines}
    if args.steps:
        for name, e in engines.items():
            time_steps(e, steps[name])
    ms: dict[str, list[float]] = {name: [] for name in engines}
    host: dict[str, list[float]] = {name: [] for name in engines}
    outs: dict[str, list[list[int]]] = {}
    names = list(engines)
    for rep in range(args.reps):
        if args.turns == "step":
            order = names if rep % 2 == 0 else names[::-1]
            got = benchlib.step_turns({n: engines[n] for n in order}, prompts, args.n)
            for name, g in got.items():
                ms[name].append(g["ms_per_token"])
                host[name].append(g["python_ms"])
                outs[name] = [r.tokens for r in g["results"]]
                print(f"rep {rep} {name:10s} {ms[name][-1]:7.2f} ms/token", file=sys.stderr)
            continue
        for name in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            res = engines[name].generate_batch(prompts, max_tokens=args.n, ignore_eos=True)
            wall = time.perf_counter() - t0
            n_tok = sum(len(r.tokens) for r in res)
            # ms per generated token: llama-server's per-token time for one sequence, the
            # aggregate wall time per token for several
            t = res.timings.to_dict(host=True)
            ms[name].append(t["predicted_per_token_ms"] if P == 1 else wall * 1000 / n_tok)
            host[name].append(t["python_ms_per_step"])
            outs[name] = [r.tokens for r in res]
            print(f"rep {rep} {name:10s} {ms[name][-1]:7.2f} ms/token", file=sys.stderr)
    ref = names[0]
    report = {"model": path.name, "parallel": P, "n": args.n, "reps": args.reps,
              "ms_per_token": {k: [round(x, 3) for x in v] for k, v in ms.items()},
              "host_ms_per_step": {k: round(statistics.median(v), 3) for k, v in host.items()},
              "ratios_ms_vs_" + ref: {}, "same_outputs_as_" + ref: {}, "budgets": {}}
    if args.steps:
        report["steps"] = {name: step_table(log) for name, log in steps.items()}
    for name in names[1:]:
        r = sorted(b / a for a, b in zip(ms[ref], ms[name]))
        q = len(r) // 4
        report["ratios_ms_vs_" + ref][name] = {"median": round(statistics.median(r), 4),
                                               "iqr": [round(r[q], 3), round(r[-q - 1], 3)],
                                               "spread": [round(r[0], 3), round(r[-1], 3)]}
        report["same_outputs_as_" + ref][name] = outs[name] == outs[ref]
    for name, e in engines.items():
        if e.draft_lengths is not None:  # survival, step costs, lengths chosen
            report["budgets"][name] = e.draft_lengths.to_dict()
        e.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
