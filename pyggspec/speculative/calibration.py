"""How likely the target is to accept a draft, predicted from the draft head's confidence.

The head's confidence in a draft -- its softmax probability of its own top token (the
argmax's, at temperature 1) -- predicts acceptance far better than a per-position average:
a draft drawn where the head hesitates is rejected much more often, whatever the position
(``scripts/calibration_features.py`` measures top probability against the top-1 / top-2
margin; the top probability predicted as well or better and is what the graph gives for
free). :class:`AcceptanceModel` turns (confidence, draft position, regime) into a
probability and learns online from every verified draft, across requests and sequences:
it is the engine's, never reset per request.

A regime is one way of drafting against one target chain (``"greedy"``, ``"coupled@0.8"``,
``"argmax@1"``, ``"q@1.5"``...): the same confidence means different acceptance under a
different temperature or draft rule, so each regime has its own table.

The table: confidence bins by draft position (the first three, then "later"). The bins are
finer near 1, where most drafts of a trained head fall, and logarithmic below 0.05: a head
that is nearly flat over a 248k vocabulary (the constructed benchmark models' tops are
1e-5..3e-4) still ranks its drafts by how far above uniform their top is, and that ranking
predicts acceptance as well as a trained head's does (AUC 0.95 / 0.79 at ~0.95 / ~0.70
agreement, ``docs/benchmarks.md``). A cell's estimate is its own counts shrunk towards the
bin's counts over all positions, which are shrunk towards the regime's overall rate (itself
shrunk towards the bin's midpoint, what a perfectly calibrated head would give) -- so a
cell seen rarely borrows from its neighbours, a bin seen rarely from the regime's record
(not from a midpoint that an uncalibrated head would make absurd), and a new regime starts
from the head's own word.

The report (:meth:`AcceptanceModel.report`) sets, per bin, the mean *predicted*
acceptance of the drafts that were verified against the *observed* rate: it shows whether
the predictions the draft-length budget acted on were right.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# bin edges over the confidence [0, 1]: logarithmic below 0.05 (eight to a decade: over a
# trimmed vocabulary the bench models' first drafts fall in 2.5e-4..2.5e-3, and acceptance
# climbs from 0.3 to 1.0 across that decade), finer towards 1
LOG_EDGES = tuple(round(10 ** (k / 8), 12) for k in range(-40, -10))  # 1e-5 .. 0.042
EDGES = (0.0, *LOG_EDGES, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98,
         0.995, 1.0)
N_BINS = len(EDGES) - 1
N_POS = 4  # positions 1, 2, 3 and "4 or later"
CELL_PRIOR = 4.0  # pseudo-counts of the bin's all-position estimate in a cell
BIN_PRIOR = 4.0  # pseudo-counts of the regime's overall rate in a bin's estimate
REGIME_PRIOR = 4.0  # pseudo-counts of the bin's midpoint in the regime's overall rate
REBUILD_EVERY = 8  # records between two rebuilds of a regime's estimates (once seeded)
# ... or this share of the regime's records, when more: a rebuild (~0.5 ms on the bench
# CPU) came every step at -np 4 (twelve drafts a step), and a record moves a table that
# holds thousands by a fraction of a point
REBUILD_SHARE = 1 / 32
OFFERED_WINDOW = 1024  # first drafts whose confidences make the spread (older weigh less)
AHEAD_PRIOR = 16.0  # pseudo-counts of the spread's expectation in a look-ahead estimate


def conf_bin(conf: float) -> int:
    """The bin of a confidence (values outside [0, 1] are clipped into it)."""
    return min(max(bisect.bisect_right(EDGES, conf) - 1, 0), N_BINS - 1)


def _midpoint(b: int) -> float:
    return (EDGES[b] + EDGES[b + 1]) / 2


@dataclass
class _Table:
    """Counts of one regime: drafts verified and accepted per (position, bin), and the
    sum of the acceptance predicted for them (for the report)."""

    n: list[list[float]] = field(default_factory=lambda: [[0.0] * N_BINS for _ in range(N_POS)])
    acc: list[list[float]] = field(
        default_factory=lambda: [[0.0] * N_BINS for _ in range(N_POS)])
    pred: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    n_pred: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    n_all: float = 0.0  # over every position and bin
    acc_all: float = 0.0
    # estimates [position][bin], rebuilt after REBUILD_EVERY records (None: build it)
    table: list[list[float]] | None = None
    stale: int = 0
    # first drafts *offered* per bin (verified or dropped by the gate), halved now and then
    offered: list[float] = field(default_factory=lambda: [0.0] * N_BINS)
    n_offered: float = 0.0
    # drafts verified per (position, bin of the draft before it's confidence), for
    # predicting a draft not made yet from the last one made (:meth:`AcceptanceModel.ahead`)
    an: list[list[float]] = field(default_factory=lambda: [[0.0] * N_BINS for _ in range(N_POS)])
    aa: list[list[float]] = field(default_factory=lambda: [[0.0] * N_BINS for _ in range(N_POS)])
    ahead: list[list[float]] | None = None  # estimates [position][bin], built with ``table``


def _monotone(values: list[float], weights: list[float], use: list[bool]) -> list[float]:
    """``values`` made non-decreasing over the entries where ``use`` (pool adjacent
    violators, weighted); the others stay as they are. A more confident draft is not less
    likely to be accepted: where a bin's few drafts say otherwise, that is noise, and a
    gate that takes the best of noisy bins is fooled by it."""
    idx = [i for i, u in enumerate(use) if u]
    blocks: list[list[float]] = []  # [mean, weight, count]
    for i in idx:
        blocks.append([values[i], weights[i], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks[-1]
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    out = list(values)
    k = 0
    for m, _, c in blocks:
        for i in idx[k:k + c]:
            out[i] = m
        k += c
    return out


def _estimates(t: _Table) -> list[list[float]]:
    """Every (position, bin) estimate of a regime (see the module docstring), each
    position's made monotone in the confidence over the bins it has drafts in."""
    n_bin = [sum(t.n[i][b] for i in range(N_POS)) for b in range(N_BINS)]
    a_bin = [sum(t.acc[i][b] for i in range(N_POS)) for b in range(N_BINS)]
    est = []
    for b in range(N_BINS):
        base = (t.acc_all + REGIME_PRIOR * _midpoint(b)) / (t.n_all + REGIME_PRIOR)
        est.append((a_bin[b] + BIN_PRIOR * base) / (n_bin[b] + BIN_PRIOR))
    est = _monotone(est, [n + BIN_PRIOR for n in n_bin], [n > 0 for n in n_bin])
    table = []
    for p in range(N_POS):
        row = [(t.acc[p][b] + CELL_PRIOR * est[b]) / (t.n[p][b] + CELL_PRIOR)
               for b in range(N_BINS)]
        table.append(_monotone(row, [n + CELL_PRIOR for n in t.n[p]], [n > 0 for n in t.n[p]]))
    return table


def _spread(t: _Table) -> list[float]:
    """First drafts per bin: those offered, or before any was offered, those verified."""
    return t.offered if t.n_offered else t.n[0]


def _ahead_estimates(t: _Table, table: list[list[float]]) -> list[list[float]]:
    """Per (position, bin of the draft before it): the acceptance of a draft not made yet.
    Each is the drafts seen after such a draft, shrunk towards what the head's usual
    confidences give at that position (:func:`_spread`)."""
    counts = _spread(t)
    total = sum(counts)
    out = []
    for p in range(N_POS):
        if total:
            usual = sum(c * table[p][b] for b, c in enumerate(counts)) / total
        else:
            usual = sum(table[p]) / N_BINS
        out.append([(t.aa[p][b] + AHEAD_PRIOR * usual) / (t.an[p][b] + AHEAD_PRIOR)
                    for b in range(N_BINS)])
    return out


class AcceptanceModel:
    """Predicts P(draft accepted | the drafts before it were) from its confidence and
    position, per regime; learns from every verified draft."""

    def __init__(self) -> None:
        self._tables: dict[str, _Table] = {}

    def _table(self, regime: str) -> _Table:
        t = self._tables.get(regime)
        if t is None:
            t = self._tables[regime] = _Table()
        return t

    def predict(self, regime: str, pos: int, conf: float) -> float:
        """Acceptance of a draft at 0-based position ``pos`` with confidence ``conf``."""
        b = conf_bin(conf)
        t = self._tables.get(regime)
        if t is None:
            return _midpoint(b)
        if t.table is None:
            t.table, t.ahead = _estimates(t), None
        return t.table[min(pos, N_POS - 1)][b]

    def ahead(self, regime: str, pos: int, last: float) -> float:
        """Acceptance of a draft not made yet at 0-based position ``pos`` (>= 1), given
        the confidence ``last`` of the last draft made. Predicted from ``last`` as if it
        were this draft's own, a confident draft promised confident ones after it and an
        unsure one unsure ones; on the bench models the confidences of neighbouring
        drafts are uncorrelated (r = -0.10..+0.16), and on held-out steps this predicts the
        second draft better (Brier 0.180 against 0.217 at ~0.70 agreement, 0.030 against
        0.035 at ~0.95: ``scripts/lookahead_features.py``).
        So it is learnt: what followed drafts of that confidence, shrunk towards the
        spread's expectation -- which it stays where nothing follows."""
        t = self._tables.get(regime)
        if t is None:
            return _midpoint(conf_bin(last))
        if t.table is None:
            t.table, t.ahead = _estimates(t), None
        if t.ahead is None:
            t.ahead = _ahead_estimates(t, t.table)
        return t.ahead[min(pos, N_POS - 1)][conf_bin(last)]

    def offer(self, regime: str, conf: float) -> None:
        """A first draft with ``conf`` was made (whether the gate then keeps it or not)."""
        t = self._table(regime)
        t.offered[conf_bin(conf)] += 1.0
        t.n_offered += 1.0
        if t.n_offered >= 2 * OFFERED_WINDOW:  # old content weighs half: follow a change
            t.offered = [x / 2 for x in t.offered]
            t.n_offered /= 2

    def offered(self, regime: str) -> list[tuple[float, float]]:
        """How the head's confidence in its first draft is spread: (a confidence in the
        bin, share) per bin with any, from the first drafts offered; before any was, from
        the first drafts verified. Empty: nothing known."""
        t = self._tables.get(regime)
        if t is None:
            return []
        counts = _spread(t)
        total = sum(counts)
        return [(_midpoint(b), c / total) for b, c in enumerate(counts) if c] if total else []

    def mean(self, regime: str, pos: int) -> float | None:
        """The observed acceptance at ``pos`` over all confidences (None: never seen)."""
        t = self._tables.get(regime)
        if t is None:
            return None
        p = min(pos, N_POS - 1)
        n = sum(t.n[p])
        return sum(t.acc[p]) / n if n else None

    def record(self, regime: str, pos: int, conf: float, accepted: bool,
               predicted: float | None = None, before: float | None = None) -> None:
        """A draft at ``pos`` with ``conf`` was verified (``predicted``: what was predicted
        for it when the length was chosen, for the report; ``before``: the confidence of
        the draft before it)."""
        t = self._table(regime)
        b = conf_bin(conf)
        p = min(pos, N_POS - 1)
        t.n[p][b] += 1
        t.acc[p][b] += 1.0 if accepted else 0.0
        if before is not None:
            bb = conf_bin(before)
            t.an[p][bb] += 1
            t.aa[p][bb] += 1.0 if accepted else 0.0
        t.n_all += 1
        t.acc_all += 1.0 if accepted else 0.0
        if predicted is not None:
            t.pred[b] += predicted
            t.n_pred[b] += 1
        t.stale += 1
        due = max(REBUILD_EVERY, REBUILD_SHARE * t.n_all)
        if t.stale >= due or t.n_all <= REBUILD_EVERY:
            t.table, t.stale = None, 0  # the estimates moved: built again when next asked

    def report(self) -> dict:
        """Per regime, per confidence bin with drafts: drafts verified, mean predicted
        acceptance (of those predicted), observed acceptance."""
        out = {}
        for regime, t in sorted(self._tables.items()):
            rows = []
            for b in range(N_BINS):
                n = sum(t.n[i][b] for i in range(N_POS))
                if not n:
                    continue
                rows.append({"conf": [EDGES[b], EDGES[b + 1]], "n": int(n),
                             "predicted": (round(t.pred[b] / t.n_pred[b], 4)
                                           if t.n_pred[b] else None),
                             "observed": round(sum(t.acc[i][b] for i in range(N_POS)) / n, 4)})
            out[regime] = rows
        return out
