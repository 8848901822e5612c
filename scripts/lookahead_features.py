#!/usr/bin/env python3
"""How to predict a draft the head has not made yet: from the confidence of the last draft
made, or from the spread of the head's usual confidences?

The draft-length budget decides after every MTP run whether to draft one more, before
that draft (and its confidence) exists. This script drafts to the cap with every draft
verified (the default engine, its budget forced to the cap), records each step's
confidences and how many drafts were accepted, builds an
:class:`~pyggspec.speculative.calibration.AcceptanceModel` from the first half of the steps
and scores, on the second half, three predictors of draft ``k`` (``k`` >= 1, judged only
when every draft before it was accepted):

  last    the model's prediction at position ``k`` for draft ``k - 1``'s confidence, as if
          it were draft ``k``'s own (the budget's rule before f36470c);
  ahead   ``AcceptanceModel.ahead``: what followed drafts of that confidence, shrunk
          towards the spread of usual confidences (the rule since);
  own     the prediction from draft ``k``'s own confidence (known only once it is made:
          the bound neither can beat).

Prints Brier score and log-loss (lower is better) per position, and the correlation of
neighbouring drafts' log confidences. Greedy decoding, seeded prompts.

    python3 scripts/lookahead_features.py                      # the ~0.95 and ~0.70 Q8_0 bench models
    python3 scripts/lookahead_features.py -m model.gguf --requests 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib


def record_steps(path: Path, requests: int, n: int) -> list[tuple[list[float], int]]:
    """(confidences of the step's drafts, drafts accepted) for every verified step."""
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine

    steps: list[tuple[list[float], int]] = []
    with Engine(str(path), n_ctx=4096, n_parallel=1, n_threads=2, load_tokenizer=False,
                progress=False, spec_type="draft-mtp", spec=SpecConfig()) as e:
        policy = e.draft_policy
        record = policy.record
        policy.record = lambda slot, confs, k: (steps.append((list(confs), k)),
                                                record(slot, confs, k))[1]
        policy.forced = policy.n_max
        for i in range(requests):
            e.generate(benchlib.bench_prompt(32, path, seed=100 + i), max_tokens=n,
                       ignore_eos=True)
    return steps


def score(steps: list[tuple[list[float], int]]) -> dict:
    from pyggspec.speculative.calibration import AcceptanceModel

    half = len(steps) // 2
    model = AcceptanceModel()
    for confs, k in steps[:half]:
        model.offer("greedy", confs[0])
        for i in range(min(len(confs), k + 1)):
            model.record("greedy", i, confs[i], i < k, before=confs[i - 1] if i else None)
    out = {}
    for pos in range(1, max(len(c) for c, _ in steps)):
        y, preds = [], {"last": [], "ahead": [], "own": []}
        before, own = [], []
        for confs, k in steps[half:]:
            if len(confs) > pos and k >= pos:
                y.append(1.0 if k > pos else 0.0)
                preds["last"].append(model.predict("greedy", pos, confs[pos - 1]))
                preds["ahead"].append(model.ahead("greedy", pos, confs[pos - 1]))
                preds["own"].append(model.predict("greedy", pos, confs[pos]))
                before.append(math.log(max(confs[pos - 1], 1e-12)))
                own.append(math.log(max(confs[pos], 1e-12)))
        if len(y) < 10:
            continue
        ya = np.array(y)
        row = {"n": len(y), "observed": round(float(ya.mean()), 4),
               "corr_log_conf": round(float(np.corrcoef(before, own)[0, 1]), 3)}
        for name, p in preds.items():
            pa = np.clip(np.array(p), 1e-6, 1 - 1e-6)
            row[name] = {"brier": round(float(np.mean((pa - ya) ** 2)), 4),
                         "log_loss": round(float(-np.mean(ya * np.log(pa)
                                                          + (1 - ya) * np.log(1 - pa))), 4),
                         "mean": round(float(pa.mean()), 4)}
        out[f"position {pos + 1}"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="this GGUF instead of the bench models")
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("-n", type=int, default=200, help="tokens per request")
    ap.add_argument("--json", type=Path, help="also write the scores here")
    args = ap.parse_args()
    paths = ([args.model] if args.model else
             [benchlib.bench_model(a, args.type) for a in args.agreement])
    report = {}
    for path in paths:
        steps = record_steps(path, args.requests, args.n)
        report[path.name] = {"steps": len(steps), "scores": score(steps)}
        print(f"{path.name}: {len(steps)} steps")
        for pos, row in report[path.name]["scores"].items():
            print(f"  {pos}: n={row['n']} observed {row['observed']:.3f} "
                  f"r(log conf) {row['corr_log_conf']:+.3f} | "
                  + " | ".join(f"{k} brier {row[k]['brier']:.4f} ll {row[k]['log_loss']:.4f}"
                               for k in ("last", "ahead", "own")))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
