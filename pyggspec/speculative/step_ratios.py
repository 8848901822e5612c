"""What a drafting step costs in plain steps of the same batch size, measured side by side.

Whether drafting pays is a ratio: a step that verifies ``T`` rows per sequence against one
that decodes plainly, at the same batch size. The budget priced the two from medians of
their own runs, which a budget that mostly drafts (or mostly declines) takes minutes
apart -- and these VMs change speed by 10-25% within minutes. A speed factor
(:class:`~pyggspec.speculative.adaptive.CostModel`) scales every price by the speed of the
shape run lately, but it cannot tell a shape measured in a slow minute from a dear shape:
on the AVX2 bench host (row 60) the default's 4 x 4 step at Q4_K_M ~0.95 ``-np 4`` was
priced at 4.0 plain steps, where steps run side by side were 2.7-3.1 apart, and it
declined where fixed n_max 3 gained 18%.

So each drafting step is compared with plain steps of its batch size run within a few
steps and seconds of it (:data:`PAIR_STEPS`, :data:`PAIR_SECONDS`): before it, or after
it when none came before. The ratio of a shape is the median of its recent such
comparisons. A budget that declines runs plain steps all the time, so its exploring steps
pair at once; one that drafts runs a plain step now and then to pair with
(:meth:`StepRatios.wants_plain`): every :data:`PROBE_EVERY` drafting steps of a batch
size, sooner while no shape there has a ratio yet.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

PAIR_STEPS = 8  # steps apart (of any batch size) that still count as one moment
PAIR_SECONDS = 10.0  # nor further apart than this (another request may run between)
RATIO_RECENT = 15  # comparisons per shape whose median is its ratio
PROBE_EVERY = 64  # drafting steps of a batch size between two plain ones run to pair with
PLAIN_RECENT = 3  # plain steps of a batch size kept; those near a drafting step: its reference
RATIO_MIN_RUNS = 3  # comparisons a shape needs before its ratio prices it (one can be a stall)


class StepRatios:
    """Per (batch size, rows per sequence): the cost of a whole step in plain steps of the
    same batch size, from steps run side by side. Owned by the draft budget; fed every
    whole step it observes (``T`` 1: a plain step, its head's time taken out)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._n = 0  # steps observed
        # per batch size: its last plain steps (step index, time, ms)
        self._plain: dict[int, deque[tuple[int, float, float]]] = {}
        # per batch size: drafting steps with no plain step near before them (index, time,
        # rows, ms), paired with the next plain step when it comes near enough
        self._pending: dict[int, list[tuple[int, float, int, float]]] = {}
        self._since: dict[int, int] = {}  # drafting steps per batch size since its last plain
        self._ratios: dict[tuple[int, int], deque[float]] = {}
        # the price of each shape with RATIO_MIN_RUNS comparisons (their median), and the
        # batch sizes with one: kept as comparisons come, since the budget reads them many
        # times a step (every length it weighs, after every draft)
        self._priced: dict[tuple[int, int], float] = {}
        self._priced_batches: set[int] = set()

    def observe(self, B: int, T: int, ms: float) -> None:
        """A whole step of ``B`` sequences with ``T`` rows each took ``ms``."""
        if ms <= 0:
            return
        self._n += 1
        now = self._clock()
        if T <= 1:
            self._plain.setdefault(B, deque(maxlen=PLAIN_RECENT)).append((self._n, now, ms))
            self._since[B] = 0
            for i, t, rows, w in self._pending.pop(B, ()):
                if self._near(i, t, self._n, now):
                    self._add(B, rows, w / ms)
            return
        self._since[B] = self._since.get(B, 0) + 1
        near = [p for i, t, p in self._plain.get(B, ()) if self._near(i, t, self._n, now)]
        if near:  # their median; of two, the faster (a stall only ever slows a step)
            self._add(B, T, ms / (statistics.median(near) if len(near) > 2 else min(near)))
            return
        waiting = [e for e in self._pending.get(B, ()) if self._near(e[0], e[1], self._n, now)]
        waiting.append((self._n, now, T, ms))
        self._pending[B] = waiting

    def ratio(self, B: int, T: int) -> float | None:
        """A ``T``-row step's cost in plain steps at batch size ``B``; None before
        :data:`RATIO_MIN_RUNS` were compared with plain steps near them (a settled start-up
        median counts as that many). One comparison alone priced a shape: on a VM that
        stalled for a plain step, a 1 x 2 step came out at 0.16 plain steps, its price
        made the realized rate look six times plain decoding's, and the budget dropped
        nearly every draft for a request."""
        return self._priced.get((B, T))

    def drafted_since_plain(self, B: int) -> bool:
        """Whether a drafting step at ``B`` ran since the last plain one there."""
        return self._since.get(B, 0) > 0

    def wants_plain(self, B: int) -> bool:
        """Whether the next step at ``B`` should decode plainly to keep the ratios paired:
        after :data:`PROBE_EVERY` drafting steps without a plain one, or
        :data:`PAIR_STEPS` while no drafting shape at ``B`` has a ratio."""
        since = self._since.get(B, 0)
        if since >= PROBE_EVERY:
            return True
        return since >= PAIR_STEPS and B not in self._priced_batches

    def settle(self) -> None:
        """The comparisons so far weigh as at most :data:`RATIO_MIN_RUNS` per shape (their
        median, so real steps outvote them within a probe or two), and no step before now
        pairs with a later one: called after the start-up calibration, whose steps come
        from the process's first seconds."""
        for key, q in self._ratios.items():
            m = statistics.median(q)
            self._ratios[key] = deque([m] * min(len(q), RATIO_MIN_RUNS), maxlen=RATIO_RECENT)
            self._reprice(key)
        self._plain.clear()
        self._pending.clear()
        self._since.clear()

    def to_dict(self) -> dict:
        return {f"{b}x{t}": round(r, 4) for (b, t), r in sorted(self._priced.items())}

    def _add(self, B: int, T: int, r: float) -> None:
        # at least one plain step: a drafting step does all a plain step does (the same
        # batch's first row, sampling, the commit) and more; below it, the plain step stalled
        self._ratios.setdefault((B, T), deque(maxlen=RATIO_RECENT)).append(max(r, 1.0))
        self._reprice((B, T))

    def _reprice(self, key: tuple[int, int]) -> None:
        q = self._ratios[key]
        if len(q) >= RATIO_MIN_RUNS:
            self._priced[key] = statistics.median(q)
            self._priced_batches.add(key[0])

    def _near(self, i: int, t: float, j: int, now: float) -> bool:
        return j - i <= PAIR_STEPS and now - t <= PAIR_SECONDS
