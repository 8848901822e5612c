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
warm-up, and every step feeds its own timings back (exponential moving averages), so the
model follows the machine (other load, thermal drift, a GPU vs the CPU).

Positions the policy stops drafting would never be measured again, so every
``explore_every`` steps it tries one row more than its choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PRIOR_WEIGHT = 8.0  # pseudo-counts of the all-sequence rates in a sequence's estimate
PRIOR_RATE = 0.5  # acceptance assumed before anything is measured
EMA = 0.2  # weight of a new cost observation


@dataclass
class CostModel:
    """Milliseconds per graph run, by kind ("verify", "mtp"), batch size and rows."""

    ms: dict[tuple[str, int, int], float] = field(default_factory=dict)

    def observe(self, kind: str, B: int, T: int, ms: float) -> None:
        key = (kind, B, T)
        old = self.ms.get(key)
        self.ms[key] = ms if old is None else (1 - EMA) * old + EMA * ms

    def estimate(self, kind: str, B: int, T: int) -> float | None:
        """The measured cost, else one scaled from the nearest measured shape of this kind
        (linear in rows, which overestimates what padding to pairs costs), else None."""
        got = self.ms.get((kind, B, T))
        if got is not None:
            return got
        near = [(abs(b - B) + abs(t - T), b, t, v) for (k, b, t), v in self.ms.items()
                if k == kind]
        if not near:
            return None
        _, b, t, v = min(near)
        return v * (B * T) / (b * t) if B * T > b * t else v

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
                 explore_every: int = 8) -> None:
        self.n_max = n_max
        self.costs = costs
        self.pad = pad  # rows the verify graph really runs for (T, B)
        self.explore_every = explore_every
        self._all = _Counts.zeros(n_max)
        self._seq: dict[int, _Counts] = {}
        self._steps = 0
        self.chosen: list[int] = [0] * (n_max + 1)  # histogram of chosen draft lengths

    # -- acceptance --------------------------------------------------------------------------
    def start(self, slot: int) -> None:
        """A new request in ``slot``: its own counts start from nothing."""
        self._seq[slot] = _Counts.zeros(self.n_max)

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
        """Estimated conditional acceptance per draft position for ``slot``."""
        c = self._seq.get(slot) or _Counts.zeros(self.n_max)
        out = []
        for i in range(self.n_max):
            d, a = self._all.drafted[i], self._all.accepted[i]
            prior = (a + PRIOR_RATE * 2) / (d + 2)
            out.append((c.accepted[i] + PRIOR_WEIGHT * prior) / (c.drafted[i] + PRIOR_WEIGHT))
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
    def step_cost(self, B: int, T: int) -> float | None:
        verify = self.costs.estimate("verify", B, self.pad(T, B))
        if verify is None:
            return None
        if T == 1:
            return verify
        mtp = self.costs.estimate("mtp", B, 1)
        if mtp is None:
            return None
        return verify + (T - 1) * mtp  # catch-up (first draft) + T - 2 one-row runs

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
        if best_k < limit and self.explore_every and self._steps % self.explore_every == 0:
            best_k += 1
        return self._count(best_k)

    def _count(self, k: int) -> int:
        self.chosen[k] += 1
        return k

    def to_dict(self) -> dict:
        return {"chosen_lengths": list(self.chosen), "costs_ms": self.costs.to_dict(),
                "rates_all": [round((a + PRIOR_RATE * 2) / (d + 2), 4) for a, d in
                              zip(self._all.accepted, self._all.drafted)]}
