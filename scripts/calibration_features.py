#!/usr/bin/env python3
"""Which confidence of the draft head predicts acceptance better: its top probability or
the margin between its two most probable tokens?

Generates with fixed-length drafting (every draft verified) while recording, for each
draft, the head's top-1 probability, its top-1 minus top-2 probability, the draft position
and whether the target accepted it (positions after the first rejection are not judged
and not counted). Each feature (and the position alone, the old per-position rates) is
turned into a predictor by binning it by quantiles on the first half of the drafts; the
second half scores it: log-loss and Brier score (lower is better) and AUC (higher is
better). Greedy decoding, the head's logits read back to the host.

    python3 scripts/calibration_features.py                       # the bench models
    python3 scripts/calibration_features.py -m model.gguf -n 512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Recorder:
    """Stands in for the draft-length budget: drafts every position to the cap and keeps
    every draft, recording (position, top probability, margin) from the head's logits of
    the MTP run just made; ``record`` adds the verdicts."""

    def __init__(self, engine, n_max: int) -> None:
        self.n_max = n_max
        self.rows: list[tuple[int, float, float, bool]] = []
        self._pending: dict[int, list[tuple[int, float, float]]] = {}
        self._last = None
        run = engine.mtp.run

        def spy(mb):
            res = run(mb)
            self._last = res
            return res

        engine.mtp.run = spy

    def plan(self, slots, caps, regimes) -> int:
        for s in slots:
            self._pending[s] = []
        return min(self.n_max, max(caps, default=0))

    def decide(self, j, slots, confs):
        lg = self._last.logits
        for i, s in enumerate(slots):
            row = lg[i].astype(np.float64)
            p = np.exp(row - row.max())
            p /= p.sum()
            top2 = np.partition(p, -2)[-2:]
            self._pending[s].append((j, float(top2[1]), float(top2[1] - top2[0])))
        return [(True, True)] * len(slots)

    def record(self, slot, confs, n) -> None:
        for i, (j, top, margin) in enumerate(self._pending.get(slot, [])[: n + 1]):
            self.rows.append((j, top, margin, i < n))

    def observe_step(self, *a) -> None:
        pass

    def observe(self, *a) -> None:
        pass


def binned(train_x, train_y, test_x, n_bins: int = 12) -> np.ndarray:
    """Predict with the acceptance rate of the training quantile bin each test value falls in
    (add-one smoothed)."""
    edges = np.unique(np.quantile(train_x, np.linspace(0, 1, n_bins + 1)))
    tb = np.clip(np.searchsorted(edges, train_x, side="right") - 1, 0, len(edges) - 1)
    rates = {b: (train_y[tb == b].sum() + 1) / ((tb == b).sum() + 2) for b in np.unique(tb)}
    qb = np.clip(np.searchsorted(edges, test_x, side="right") - 1, 0, len(edges) - 1)
    prior = (train_y.sum() + 1) / (len(train_y) + 2)
    return np.array([rates.get(b, prior) for b in qb])


def auc(score: np.ndarray, y: np.ndarray) -> float:
    pos, neg = score[y], score[~y]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def score(rows: list[tuple[int, float, float, bool]]) -> dict:
    """Each predictor fitted on the first half of the drafts, scored on the second (AUC of
    its predictions, so a coarse predictor is not credited with its feature's ranking)."""
    a = np.array(rows, dtype=np.float64)
    pos, top, margin, y = np.minimum(a[:, 0], 3), a[:, 1], a[:, 2], a[:, 3].astype(bool)
    half = len(a) // 2
    tr, te = slice(0, half), slice(half, None)
    preds = {"position": binned(pos[tr], y[tr], pos[te]),
             "top_prob": binned(top[tr], y[tr], top[te]),
             "margin": binned(margin[tr], y[tr], margin[te])}
    by_pos = np.zeros(len(a) - half)  # top probability binned within each position
    for j in np.unique(pos):
        m_tr, m_te = pos[tr] == j, pos[te] == j
        if m_te.any():
            by_pos[m_te] = (binned(top[tr][m_tr], y[tr][m_tr], top[te][m_te]) if m_tr.sum() > 8
                            else preds["top_prob"][m_te])
    preds["top_prob+position"] = by_pos
    out = {"drafts": len(a), "acceptance": round(float(y.mean()), 4)}
    t = y[te]
    for name, p in preds.items():
        p = np.clip(p, 1e-4, 1 - 1e-4)
        out[name] = {"log_loss": round(float(-np.mean(t * np.log(p) + (~t) * np.log(1 - p))), 4),
                     "brier": round(float(np.mean((p - t) ** 2)), 4),
                     "auc": round(auc(p, t), 4)}
    return out


def measure(path: Path, n_tokens: int, n_max: int, threads: int) -> dict:
    import benchlib

    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine

    with Engine(path, n_ctx=n_tokens + 256, n_threads=threads, load_tokenizer=False,
                spec_type="draft-mtp", draft_backend_sampling=False,
                spec=SpecConfig(n_max=n_max, adaptive=False)) as e:
        rec = Recorder(e, n_max)
        e.worker.policy = rec
        e.drafter.confidence = True
        for seed in range(4):
            e.generate(benchlib.bench_prompt(32, path, seed=seed), max_tokens=n_tokens // 4,
                       ignore_eos=True)
        return score(rec.rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", help="GGUF(s) to measure instead")
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("-n", type=int, default=512, help="tokens generated per model")
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    import benchlib

    models = ([(Path(m).name, Path(m)) for m in args.model] if args.model else
              [(f"agreement {a}", benchlib.generated_model(a, "q8_0")) for a in args.agreement])
    results = {}
    for name, path in models:
        r = results[name] = measure(path, args.n, args.n_max, args.threads)
        print(f"{name}: {r['drafts']} drafts judged, acceptance {r['acceptance']}")
        print(f"  {'feature':18} {'log-loss':>9} {'brier':>7} {'auc':>7}")
        for f in ("position", "top_prob", "margin", "top_prob+position"):
            s = r[f]
            print(f"  {f:18} {s['log_loss']:9.4f} {s['brier']:7.4f} {s['auc']:7.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
