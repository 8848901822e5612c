"""Adaptive draft length: how many tokens to draft this step, from measured acceptance and
measured costs on this device at this batch size.

A verify step with ``T`` rows per sequence (the pending token and ``T - 1`` drafts) emits,
for sequence ``b``, ``1 + E_b(T - 1)`` tokens in expectation, where

    E_b(k) = sum_{j=1..k} prod_{i=1..j} a_b(i)

and ``a_b(i)`` is the probability that draft ``i`` is accepted given that the drafts before
it were (per sequence, estimated from its own counts, shrunk towards the counts of all
sequences). The step costs ``verify(B, T)`` plus the MTP runs that made the drafts: the
catch-up batch yields the first draft, each further draft is one more one-row run. With
``T = 1`` nothing is drafted and the MTP head is not run at all (its new pairs wait for
the next drafting step, whose catch-up batch takes them in one go). The policy picks the
``T`` with the most expected tokens per millisecond for the whole batch (every sequence
shares the verify shape, so lengths are chosen jointly).

Costs are milliseconds of graph compute, measured: :func:`calibrate` times the shapes at
warm-up, and every step feeds its own timings back (the median of the recent ones, so a
step slowed by another process does not swing the choice), so the model follows the
machine (thermal drift, a GPU vs the CPU).

Positions the policy stops drafting would never be measured again, so every
``explore_every`` steps it tries one row more than its choice.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

PRIOR_WEIGHT = 8.0  # pseudo-counts of the all-sequence rates in a sequence's estimate
PRIOR_RATE = 0.5  # acceptance assumed before anything is measured
RECENT = 9  # observations per shape whose median is its cost


@dataclass
class CostModel:
    """Milliseconds per graph run, by kind ("verify", "mtp"), batch size and rows.

    ``frozen``: observations are ignored (tests pin the costs to make choices
    deterministic)."""

    ms: dict[tuple[str, int, int], float] = field(default_factory=dict)
    frozen: bool = False
    _recent: dict[tuple[str, int, int], deque] = field(default_factory=dict, repr=False)

    def observe(self, kind: str, B: int, T: int, ms: float) -> None:
        if self.frozen:
            return
        key = (kind, B, T)
        q = self._recent.get(key)
        if q is None:
            q = self._recent[key] = deque(maxlen=RECENT)
            if key in self.ms:  # a calibrated value counts as one observation
                q.append(self.ms[key])
        q.append(ms)
        self.ms[key] = statistics.median(q)

    def estimate(self, kind: str, B: int, T: int) -> float | None:
        """The measured cost; else interpolated over rows (B * T) between one-sequence
        shapes of this kind (the weights dominate: B sequences of T rows cost about one
        sequence of B * T rows), scaled past the largest; else None."""
        got = self.ms.get((kind, B, T))
        if got is not None:
            return got
        pts = sorted((t, v) for (k, b, t), v in self.ms.items() if k == kind and b == 1)
        if not pts:
            near = [(abs(b - B) + abs(t - T), b * t, v) for (k, b, t), v in self.ms.items()
                    if k == kind]
            if not near:
                return None
            _, rows, v = min(near)
            return v * max(1.0, B * T / rows)
        rows = B * T
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, v0), (r1, v1) in itertools.pairwise(pts):
            if rows <= r1:
                return v0 + (v1 - v0) * (rows - r0) / (r1 - r0)
        r, v = pts[-1]
        if len(pts) > 1:  # extrapolate with the last segment's slope
            (r0, v0) = pts[-2]
            return v + (v - v0) / (r - r0) * (rows - r)
        return v * rows / r

    def to_dict(self) -> dict:
        return {f"{k}:{b}x{t}": round(v, 3) for (k, b, t), v in sorted(self.ms.items())}


@dataclass
class _Counts:
    drafted: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, n: int) -> _Counts:
        return cls([0.0] * n, [0.0] * n)


class DraftLengthPolicy:
    """Chooses the verify rows ``T`` (drafts = ``T - 1``) for a batch of sequences."""

    def __init__(self, n_max: int, costs: CostModel, pad: Callable[[int, int], int],
                 explore_every: int = 4) -> None:
        self.n_max = n_max
        self.costs = costs
        self.pad = pad  # rows the verify graph really runs for (T, B)
        self.explore_every = explore_every
        self._all = _Counts.zeros(n_max)
        self._seq: dict[int, _Counts] = {}
        self._owner: dict[int, object] = {}  # slot -> the sequence its counts belong to
        self._steps = 0
        self.chosen: list[int] = [0] * (n_max + 1)  # histogram of chosen draft lengths

    # -- acceptance --------------------------------------------------------------------------
    def start(self, slot: int) -> None:
        """A new request in ``slot``: its own counts start from nothing."""
        self._seq[slot] = _Counts.zeros(self.n_max)

    def bind(self, slot: int, owner: object) -> None:
        """``owner`` (a sequence object) is in ``slot``: a different one starts afresh."""
        if self._owner.get(slot) != owner:
            self._owner[slot] = owner
            self.start(slot)

    def record(self, slot: int, k: int, n: int) -> None:
        """``k`` drafts were verified for ``slot`` and the first ``n`` accepted."""
        c = self._seq.setdefault(slot, _Counts.zeros(self.n_max))
        for i in range(min(k, n + 1)):  # positions past the first rejection say nothing
            ok = 1.0 if i < n else 0.0
            c.drafted[i] += 1
            c.accepted[i] += ok
            self._all.drafted[i] += 1
            self._all.accepted[i] += ok

    def rates(self, slot: int) -> list[float]:
        """Estimated conditional acceptance per draft position for ``slot``: its own counts
        shrunk towards all sequences' counts, which are shrunk towards the position before
        (a position rarely drafted yet is assumed to go about as well as the one before)."""
        c = self._seq.get(slot) or _Counts.zeros(self.n_max)
        out = []
        before = PRIOR_RATE
        for i in range(self.n_max):
            d, a = self._all.drafted[i], self._all.accepted[i]
            prior = (a + 4 * before) / (d + 4)
            r = (c.accepted[i] + PRIOR_WEIGHT * prior) / (c.drafted[i] + PRIOR_WEIGHT)
            out.append(r)
            before = r
        return out

    @staticmethod
    def expected(rates: Sequence[float], k: int) -> float:
        """Expected accepted drafts out of ``k``."""
        total, p = 0.0, 1.0
        for i in range(k):
            p *= rates[i]
            total += p
        return total

    # -- choice ------------------------------------------------------------------------------
    def modeled_cost(self, B: int, T: int) -> float | None:
        """Graph compute of a step with ``T`` verify rows per sequence."""
        verify = self.costs.estimate("verify", B, self.pad(T, B))
        if verify is None:
            return None
        if T == 1:
            return verify
        mtp = self.costs.estimate("mtp", B, 1)
        if mtp is None:
            return None
        return verify + (T - 1) * mtp  # catch-up (first draft) + T - 2 one-row runs

    def step_cost(self, B: int, T: int) -> float | None:
        """What a whole step costs: its measured wall time when steps of this shape ran
        (host work, allocations and the MTP batches included), else the modeled compute
        scaled by how far measured steps of other lengths were above their model."""
        wall = self.costs.ms.get(("step", B, T))
        if wall is not None:
            return wall
        model = self.modeled_cost(B, T)
        if model is None:
            return None
        ratios = [v / m for (k, b, t), v in self.costs.ms.items()
                  if k == "step" and b == B and (m := self.modeled_cost(b, t))]
        return model * (statistics.median(ratios) if ratios else 1.0)

    def observe_step(self, B: int, T: int, wall_ms: float) -> None:
        """A whole step with ``T`` verify rows per sequence took ``wall_ms``."""
        self.costs.observe("step", B, T, wall_ms)

    def choose(self, slots: Sequence[int], caps: Sequence[int]) -> int:
        """Drafts per sequence for this step (every sequence drafts up to this many, each
        at most its ``cap``): the length with the most expected tokens per millisecond.
        Without measured costs yet, the cap (``n_max``)."""
        B = len(slots)
        limit = min(self.n_max, max(caps, default=0))
        if B == 0 or limit <= 0:
            return 0
        rates = [self.rates(s) for s in slots]
        best_k, best = limit, -1.0
        for k in range(limit + 1):
            cost = self.step_cost(B, k + 1)
            if cost is None:
                return self._count(limit)
            tokens = sum(1 + self.expected(r, min(k, c)) for r, c in zip(rates, caps))
            if tokens / cost > best * (1 + 1e-9):
                best_k, best = k, tokens / cost
        self._steps += 1
        if self.explore_every and self._steps % self.explore_every == 0:
            # now and then a neighbouring length, so its cost and acceptance stay measured:
            # mostly one more (a deeper position is learnt only by drafting it), sometimes
            # one less (its cost is what the choice compares against)
            down = (self._steps // self.explore_every) % 4 == 0 and best_k > 0
            best_k = best_k - 1 if down else min(limit, best_k + 1)
        return self._count(best_k)

    def _count(self, k: int) -> int:
        self.chosen[k] += 1
        return k

    def to_dict(self) -> dict:
        return {"chosen_lengths": list(self.chosen), "costs_ms": self.costs.to_dict(),
                "rates_all": [round(a / d, 4) if d else None for a, d in
                              zip(self._all.accepted, self._all.drafted)]}


def calibrate(engine, rows: Sequence[int], slot: int = 0, reps: int = 2) -> CostModel:
    """Time the target over ``rows`` tokens of one sequence (every row's logits, as a
    verify batch reads them) and one MTP draft step, on ``slot`` (which must be free; it is
    cleared afterwards). The faster of ``reps`` runs counts (the first also builds graphs,
    which are not compute time anyway)."""
    from pyggspec.speculative.drafter import DraftRequest

    costs = CostModel()
    target = engine.target
    ids = list(range(1, 1 + max(rows)))
    try:
        for T in sorted(set(rows)):
            best = None
            for _ in range(reps):
                engine.clear(slot)
                before = target.compute_ms_total
                engine.decode({slot: ids[:T]}, logits="all", hidden=True)
                ms = target.compute_ms_total - before
                best = ms if best is None else min(best, ms)
            costs.ms[("verify", 1, T)] = best
        mtp = engine.drafter.mtp
        best = None
        for _ in range(reps):
            engine.clear(slot)
            h = np.zeros((1, engine.drafter.n_embd), np.float32)
            engine.drafter.draft([DraftRequest(slot, 0, [ids[0]], h, 0)])  # catch-up only
            before = mtp.compute_ms_total
            engine.drafter.draft([DraftRequest(slot, 1, [ids[1]], h, 0)])  # a one-row run
            ms = mtp.compute_ms_total - before
            best = ms if best is None else min(best, ms)
        costs.ms[("mtp", 1, 1)] = best
    finally:
        engine.clear(slot)
    return costs
