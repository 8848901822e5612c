"""Draft lengths chosen per step from the draft head's confidence and measured costs.

Speculation pays only when a draft's expected tokens are worth what it costs, and both
sides move: acceptance with the content, the head's confidence in *this* draft, the
temperature; costs with the device, the quantization and the batch size. So nothing here
is a fixed length (``--spec-draft-n-max`` is only the cap):

* **whether to draft** this step (:meth:`DraftBudget.plan`): when what the gate below
  would make of the head's usual first-draft confidences (:func:`gated_value`) is not
  predicted to beat a step that drafts nothing, the step drafts nothing and the MTP head
  rests (its owed pairs are written later in one batch); after ``idle_explore_every`` declined steps one drafts anyway, so
  a change in the content is noticed (verifying up to the cap when the last such step
  stopped short of it, so the longest step's price does not stay that of the first
  request) -- the wait doubling (to ``IDLE_EXPLORE_MAX``) each
  time it finds drafting still loses, and never shorter than what keeps such steps below
  ``explore_share`` of the time (each costs what drafting is predicted to lose); what it
  is compared with -- plain decoding at this batch size -- is measured, not estimated
  (timed at start-up for one sequence and for all slots; at another batch size its first
  steps draft nothing);
* **which drafts to verify** (:meth:`DraftBudget.decide`, the drafter's gate after every
  MTP run): each draft's acceptance is predicted from the head's confidence in it and its
  position by :class:`~pyggspec.speculative.calibration.AcceptanceModel` (calibrated
  online across requests and sequences); a sequence's expected tokens from draft ``j`` are
  the chance that it and every draft before it survive. Draft ``j`` goes into the verify
  batch when its expected tokens, summed over the batch (one verify shape for all: the
  budget goes where acceptance is predicted highest), beat the rate for the verify row it
  adds; one more is drafted when the next one's expected tokens beat the rate for an MTP
  run and a verify row.

The rate is plain decoding's at this batch size (:meth:`DraftBudget.rate`). Costs are milliseconds,
measured: :func:`calibrate` times the shapes at start-up, and every step feeds its own
timings back (the median of the recent ones, so a step slowed by another process does not
swing the choice), so the model follows the machine (thermal drift, a GPU vs the CPU);
a drafting step is priced in plain steps of its batch size run beside it
(:class:`~pyggspec.speculative.step_ratios.StepRatios`; a budget that drafts runs one
plain step now and then for that), so drafting and plain decoding are compared within
one minute, never across minutes of another speed.
Every ``explore_every`` drafting steps one draft past the budget's stop is verified, so
confidence bins and positions it would skip stay measured. Above all this, the way a step
drafts -- this gate, every draft to the cap, or not at all -- is the one whose recent steps
realized the most (:class:`~pyggspec.speculative.arms.DraftWays`): the gate's model errs
at the margins, one way per machine.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pyggspec.speculative.arms import WAYS, DraftWays
from pyggspec.speculative.calibration import AcceptanceModel
from pyggspec.speculative.step_ratios import StepRatios

IDLE_EXPLORE_MAX = 512  # most declined steps between two that draft anyway
RATE_DECAY = 0.95  # weight of the old average in the realized rate (the report's; ~20 steps)
RECENT = 9  # observations per shape whose median is its cost
PLAIN_PROBES = 2  # plain steps measured at a batch size before drafting there
EXPLORE_SHARE = 0.003  # most of the time exploring steps are predicted to lose while declining
LOSS_REFRESH = 16  # declined steps between two predictions that drafting still loses
DRIFT_GAIN = 0.5  # how far (in log) one step moves the speed factor towards its target
DRIFT_CLIP = 1.25  # one step counts as at most this much slower or faster
DRIFT_WINDOW = 9  # whole steps whose median speed ratio is the factor's target


@dataclass
class CostModel:
    """Milliseconds by kind (graph runs "verify", "mtp"; whole steps "step"; the head's
    wall time in a step whose drafts were dropped, "drop"), batch size and rows.

    Each shape's cost is the median of its recent runs, times the machine's current speed
    factor (``drift``). Why the factor: these VMs change speed by 10% within a request, and
    the budget compares shapes it runs every step with shapes it runs rarely (a four-row
    step where it mostly verifies three rows; a drafting step while it declines). Priced
    from runs minutes apart, the rarely-run shape looked cheaper or dearer than it was by
    as much as the choice between them was worth (at ``-np 4``, 4 x 3 against 4 x 4 rows
    differ ~40 ms in ~200). So every whole step (kind "step") of a shape with three runs
    or more gives a speed ratio against that shape's anchor (its median, in factor units,
    when it first had three runs; clipped at :data:`DRIFT_CLIP` of the factor), and the
    factor moves ``drift_gain`` of the way (in log) towards the median of the last
    :data:`DRIFT_WINDOW` ratios. Every shape's cost moves with the factor, and runs are
    kept divided by the factor of their moment, so a shape's median compares its runs as
    if they ran at one speed. Anchored and by a median, the factor neither walks nor
    creeps on a steady machine (moved by each step's own ratio it crept up x2.5 over a
    warm process's thousand steps: step times are skewed); the gain is high because a
    shape's median (nine runs) would otherwise absorb a change first. The factor's own
    noise scales every cost alike, which leaves the budget's choices (ratios of costs,
    and rates kept in the factor's units) as they were.

    ``frozen``: observations are ignored (tests pin the costs to make choices
    deterministic). ``drift_gain`` 0: no speed factor (each shape its own median)."""

    ms: dict[tuple[str, int, int], float] = field(default_factory=dict)
    frozen: bool = False
    drift_gain: float = DRIFT_GAIN
    drift: float = 1.0  # the machine's speed now, relative to when the runs began
    _recent: dict[tuple[str, int, int], deque] = field(default_factory=dict, repr=False)
    _runs: dict[tuple[str, int, int], int] = field(default_factory=dict, repr=False)
    _anchor: dict[tuple[str, int, int], float] = field(default_factory=dict, repr=False)
    _ratios: deque = field(default_factory=lambda: deque(maxlen=DRIFT_WINDOW), repr=False)

    def observe(self, kind: str, B: int, T: int, ms: float) -> None:
        if self.frozen:
            return
        key = (kind, B, T)
        q = self._recent.get(key)
        if q is None:
            q = self._recent[key] = deque(maxlen=RECENT)
            if key in self.ms:  # a calibrated value counts as one observation
                q.append(self.ms[key] / self.drift)
                self._runs[key] = 1
        if kind == "step" and self.drift_gain and len(q) >= 3 and ms > 0:
            # the speed now against the shape's anchor (its median when it first had
            # three runs, in factor units): the factor is the median of the last few such
            # ratios, not a product of per-step moves -- step times are skewed (a slow
            # step is slower by more than a fast one is faster), and the product crept up
            # on a steady machine, x2.5 over a warm process's thousand steps, taking every
            # rarely-run shape's price with it
            anchor = self._anchor.get(key)
            if anchor is None:  # set once: a median per step would be wasted work
                anchor = self._anchor[key] = statistics.median(q)
            r = min(max(ms / anchor, self.drift / DRIFT_CLIP), self.drift * DRIFT_CLIP)
            self._ratios.append(r)
            target = statistics.median(self._ratios)
            f = (target / self.drift) ** self.drift_gain
            self.drift *= f
            for k in self.ms:
                self.ms[k] *= f
        q.append(ms / self.drift)
        self._runs[key] = self._runs.get(key, 0) + 1
        # the median once there are three (one slow step, e.g. the first run of a new graph,
        # is then outvoted); before, the fastest (a mean of two would keep half the outlier)
        self.ms[key] = (statistics.median(q) if len(q) >= 3 else min(q)) * self.drift

    def seen(self, kind: str, B: int, T: int) -> int:
        """How many runs of this shape were observed (a calibrated value counts as one)."""
        key = (kind, B, T)
        return self._runs.get(key, int(key in self.ms))

    def history(self, kind: str, B: int, T: int) -> tuple[list[float], float | None]:
        """A shape's recent runs (in the speed factor's units) and its anchor (None before
        its third run): what its price is made of, for probes that explain a price."""
        key = (kind, B, T)
        return list(self._recent.get(key, ())), self._anchor.get(key)

    def settle(self) -> None:
        """Let each shape's observations so far weigh as one (the value they give: their
        median, or the faster of two): called after
        the start-up calibration, whose runs all come from the first seconds of the
        process. When those were slow, nine of them outvoted real steps for as long as a
        shape ran rarely -- a declining budget measures a drafting step only when it
        explores: in 3 of 20 fresh Q4_K_M ~0.70 ``-np 1`` engines a four-row step booked
        at 97-99 ms from start-up (71-81 in the others) kept drafting declined for the
        whole request. Now the first real run outvotes it when faster (the faster of two
        counts), and three make a median."""
        for key, q in self._recent.items():
            if len(q) > 1:
                self._recent[key] = deque([self.ms[key] / self.drift], maxlen=RECENT)

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


class DraftBudget:
    """Draft lengths from the head's confidence: decides, per step and per batch, whether
    to draft at all, and after every MTP run whether the drafts it made go into the verify
    batch and whether to draft one more.

    It is the drafter's gate (:meth:`decide`) and learns from every verify step
    (:meth:`record`, :meth:`observe_step`). Kept by the engine for its lifetime.
    """

    def __init__(self, n_max: int, costs: CostModel, pad: Callable[[int, int], int],
                 acceptance: AcceptanceModel | None = None, explore_every: int = 8,
                 idle_explore_every: int = 32, explore_share: float = EXPLORE_SHARE) -> None:
        self.n_max = n_max
        self.costs = costs
        self.pad = pad  # rows the verify graph really runs for (T, B)
        self.acceptance = acceptance if acceptance is not None else AcceptanceModel()
        # drafting steps in plain steps of their batch size, from steps run side by side
        self.ratios = StepRatios()
        # the way each step drafts (the gate, every draft to the cap, or none), by what
        # each realized (not with pinned costs: tests of the gate alone)
        self.ways = self._new_ways()
        self.use_ways = True  # False: the gate alone decides (as before the ways)
        self._way: str | None = None  # this step's way (None: calibration, probes)
        self.explore_every = explore_every  # drafting steps between two that go one deeper
        # declined steps before one drafts anyway; doubled after each such step that finds
        # drafting still does not pay (up to IDLE_EXPLORE_MAX), reset when it pays again
        self.idle_explore_every = idle_explore_every
        self._idle_next = idle_explore_every
        self.explore_share = explore_share  # 0: waits are idle_explore_every, doubled
        # drafts per sequence every step, all kept (the start-up calibration: the cap to
        # score the head and time drafting steps, 0 to time plain ones); None: the budget's
        self.forced: int | None = None
        # with ``forced`` drafts: a plain step after each drafting one (the calibration),
        # so every drafting step is priced against a plain step of its own moment
        self.forced_pairs = False
        self.chosen: list[int] = [0] * (n_max + 1)  # verify steps by drafts kept (the batch's)
        self.declined = 0  # steps that drafted nothing because drafting could not pay
        self.plain_probes = 0  # steps that drafted nothing to measure plain decoding
        # realized tokens/ms per batch size (EMA), in the costs' speed-factor units (times
        # ``costs.drift`` at each step): what the report shows beside plain decoding's
        self._rate: dict[int, float] = {}
        self._n_drafting = 0
        self._n_idle = 0
        # the current step: per slot its regime, the survival of its drafts so far and the
        # acceptance predicted for each
        self._B = 0
        self._regime: dict[int, str] = {}
        # per slot, for every draft kept, the chance that it and every one before it are
        # accepted (the last is the slot's survival so far: _survival)
        self._cum: dict[int, list[float]] = {}
        self._pred: dict[int, list[float]] = {}
        self._limit = n_max  # the most drafts per sequence this step (the plan's)
        self._caps: dict[int, int] = {}  # per slot, the most drafts it may make this step
        # an exploring step: False; True (drafting: one draft past the budget's stop),
        # "idle" (after declined steps: draft on while the gate would) or "full" (after
        # declined steps: every draft up to the cap verified)
        self._explore: bool | str = False
        # (batch, cap, the cap's step runs) when the last idle exploring step began
        self._cap_runs: tuple[int, int, int] | None = None
        self._floor = 0  # drafts an exploring step keeps, at least, once made (0: none)
        self._min_keep = 0  # drafts an idle exploring step verifies, at least
        # the last loss found while declining, for which batch, and for how many steps
        self._loss_key: tuple | None = None
        self._loss_val = 0.0
        self._loss_age = 0

    # -- costs -------------------------------------------------------------------------------
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
        """What a whole step costs: plain decoding's price at this batch size times the
        step's ratio to it, measured side by side (:class:`StepRatios`: prices of two
        shapes taken minutes apart differed by more than the choice between them was
        worth); before such a ratio, its measured wall time when steps of this shape ran
        (host work, allocations and the MTP batches included), else the modeled compute
        scaled by how far measured steps of other lengths were above their model."""
        if T > 1 and not self.costs.frozen:  # (pinned costs are the whole truth)
            r = self.ratios.ratio(B, T)
            plain = self.costs.ms.get(("step", B, 1))
            if r is not None and plain:
                return plain * r
        wall = self.costs.ms.get(("step", B, T))
        if wall is not None:
            return wall
        model = self.modeled_cost(B, T)
        if model is None:
            return None
        ratios = [v / m for (k, b, t), v in self.costs.ms.items()
                  if k == "step" and b == B and (m := self.modeled_cost(b, t))]
        return model * (statistics.median(ratios) if ratios else 1.0)

    def _verify_step(self, B: int, T: int) -> float | None:
        """The verify part of a step with ``T`` rows (its MTP runs taken out)."""
        whole = self.step_cost(B, T)
        mtp = self.costs.estimate("mtp", B, 1)
        if whole is None or (T > 1 and mtp is None):
            return None
        return whole - (T - 1) * (mtp or 0.0)

    def plain_rate(self, B: int) -> float | None:
        """Tokens per ms of a step that drafts nothing."""
        c = self.step_cost(B, 1)
        return B / c if c else None

    def rate(self, B: int) -> float:
        """The rate a draft must beat: plain decoding's at this batch size.

        Not what steps achieve lately (Dinkelbach's rule for the best ratio, used before
        row 66): that rule is right only where the predicted acceptance is, and the gate's
        errors there went one way -- it dropped drafts that paid. Measured with the engines
        taking turns step by step (docs/benchmarks.md row 66), at Q8_0 ~0.70 ``-np 1`` the
        default spent 14% of its time in steps whose drafts it dropped and was 3.5% slower
        than fixed n_max 3; priced against plain decoding's rate 1.1% faster, and within
        1% of the old rule in the other ~0.70 rows."""
        return self.plain_rate(B) or 0.0

    # -- per step ----------------------------------------------------------------------------
    def plan(self, slots: Sequence[int], caps: Sequence[int], regimes: Sequence[str]) -> int:
        """Most drafts per sequence this step: the cap, or 0 when drafting, gated by the
        confidences the head usually offers, is not predicted to beat plain decoding
        (:meth:`_loss`). Drafting now and then anyway keeps it measured."""
        B = len(slots)
        self._B = B
        self._way = None
        self._regime = dict(zip(slots, regimes))
        self._caps = dict(zip(slots, caps))
        self._cum = {s: [] for s in slots}
        self._pred = {s: [] for s in slots}
        limit = self._limit = min(self.n_max, max(caps, default=0))
        if B == 0 or limit <= 0:
            return 0
        self._explore = False
        self._floor = self._min_keep = 0
        if self.forced is not None:
            if self.forced and self.forced_pairs and self.ratios.drafted_since_plain(B):
                # Drafting steps timed in a row and priced against the plain steps timed
                # after them all shared one plain step's time: at start-up, where one
                # plain 4 x 1 step took 91-149 ms in fresh engines, that priced the 4 x 4
                # step at 2.85-2.88 plain steps on the Q4_K_M ~0.70 bench model where
                # steps side by side read ~2.4, and the budget drafted two where three paid
                # (rep 0 of row 66: 15% slower than fixed n_max 3)
                return 0
            return min(self.forced, limit)
        if self.costs.seen("step", B, 1) < PLAIN_PROBES and self.costs.ms and not self.costs.frozen:
            # what plain decoding costs at this batch size is measured, not estimated: the
            # estimate from one sequence's verify rows (-np 4: 131 ms against 116 for a
            # real 4-sequence step) made drafting that lost 10% look as if it paid. Twice:
            # the first such step also builds its graph, and alone it set the plain cost
            # so high that the budget drafted on where every fixed length lost
            self.plain_probes += 1
            return 0
        if not self.costs.frozen and self.ratios.wants_plain(B):
            # a plain step among drafting ones, so drafting is priced against plain
            # decoding of the same minutes (StepRatios)
            self.plain_probes += 1
            return 0
        if self.use_ways and not self.costs.frozen:
            plain, f = self.plain_rate(B), self.costs.drift  # (tokens per ms: B / cost)
            way = self._way = self.ways.choose(B, plain * f if plain else 0.0,
                                               B / plain / f if plain else 0.0)
            if way == "plain":  # neither drafting way realized plain decoding's rate
                self.declined += 1
                return 0
            if way in ("full", "short"):  # every draft up to the cap (or one below it),
                self._explore = "full"      # as fixed n_max drafts
                return limit if way == "full" else max(1, limit - 1)
        loss = self._declining_loss(B, limit, caps, regimes)
        if loss > 0:
            self._n_idle += 1
            if not self.idle_explore_every or self._n_idle < self._explore_wait(B, loss):
                self.declined += 1
                return 0
            self._n_idle = 0  # explore this step; if drafting still loses, wait longer
            self._idle_next = min(2 * self._idle_next, IDLE_EXPLORE_MAX)
            cap = (B, limit, self.costs.seen("step", B, limit + 1))
            stale, self._cap_runs = cap == self._cap_runs, cap
            if stale and not self.costs.frozen:
                # the last idle exploring step stopped short of the cap, so the cap's step
                # is still priced from before the budget declined -- from the first
                # request's few steps: at Q4_K_M ~0.70 -np 4 (row 57) 2.88 plain steps
                # where processes that drafted measured 2.50-2.64, and the budget declined
                # for the whole process where gated drafting gained 1-4%. This one
                # verifies every draft up to the cap, so that price is measured again
                self._explore = "full"
                return limit
            # drafting on while the gate would, and verifying at least one draft: a step
            # whose drafts the gate drops after the MTP runs pays for them and measures
            # nothing. Verifying exactly one (row 56) measured only the one-draft step,
            # which loses where three drafts pay: at Q4_K_M ~0.95 -np 1 a default that
            # declined at start-up priced the 4-row step from start-up for good
            self._explore, self._min_keep = "idle", 1
            return limit
        self._idle_next = self.idle_explore_every
        self._cap_runs = None
        self._n_drafting += 1
        self._explore = bool(self.explore_every) and self._n_drafting % self.explore_every == 0
        return limit

    def _declining_loss(self, B: int, limit: int, caps: Sequence[int],
                        regimes: Sequence[str]) -> float:
        """:meth:`_loss`, computed again only every :data:`LOSS_REFRESH` steps of the same
        batch (sooner after a verified draft while declining: an exploring step may have
        found that drafting pays again). Nothing it reads moves fast -- the acceptance
        table and the costs' medians -- and the per-step host time is what the default
        costs beyond plain decoding where speculation cannot pay."""
        key = (B, limit, tuple(caps), tuple(regimes))
        if key == self._loss_key and self._loss_age < LOSS_REFRESH:
            self._loss_age += 1
            return self._loss_val
        loss = self._loss(B, limit, caps, regimes)
        if loss is None:  # a cost or the confidences unknown: draft, and measure
            self._loss_key = None
            return 0.0
        self._loss_key, self._loss_val, self._loss_age = key, loss, 1
        return loss

    def _loss(self, B: int, limit: int, caps: Sequence[int], regimes: Sequence[str],
              ) -> float | None:
        """Milliseconds a drafting step is predicted to lose against plain decoding of the
        tokens it yields, 0 when it gains; None when a cost or the head's confidences are
        not known yet.

        A drafting step runs the head once for every sequence, and the gate
        (:meth:`decide`) then verifies drafts only where their confidence makes them pay
        -- so drafting is worth what the gate makes of the confidences the head offers,
        not what every draft would yield: :func:`gated_value` over the spread of
        first-draft confidences seen lately. Judged by the mean acceptance per position
        instead, the Q8_0 ~0.70 bench model declined every step at ``-np 1`` where fixed
        n_max 3 gained 5-7%: a sixth of its first drafts are accepted 99% of the time
        (three drafts then pay), the rest 70% (none pays)."""
        plain = self.step_cost(B, 1)
        mtp = self.costs.estimate("mtp", B, 1)
        if not plain or mtp is None:
            return None
        rate = B / plain
        extra = []
        for L in range(1, limit + 1):
            cost = self.step_cost(B, L + 1)
            if cost is None:
                return None
            extra.append((cost - plain) * rate)  # in tokens plain decoding makes meanwhile
        acc = self.acceptance
        tables = []
        for r, c in zip(regimes, caps):
            spread = acc.offered(r)
            if not spread:
                return None
            gains = np.zeros((len(spread), limit))
            for i, (conf, _) in enumerate(spread):
                p, total = 1.0, 0.0
                for L in range(min(limit, c)):
                    p *= acc.predict(r, 0, conf) if L == 0 else acc.ahead(r, L, conf)
                    total += p
                    gains[i, L] = total
                gains[i, min(limit, c):] = total
            tables.append((np.array([w for _, w in spread]), gains))
        # what a drafting step whose drafts the gate all drops costs: the measured wall
        # time of the head in such steps (the gate may drop after more than one run, and
        # a run's wall time is above its compute), before any, one run's compute. A step
        # the gate drafts in pays its runs inside its measured whole-step cost (extra)
        drop = self.costs.ms.get(("drop", B, 1), mtp)
        value = gated_value(tables, np.array(extra), mtp * rate, drop * rate)
        return 0.0 if value > 0 else -value / rate

    def _explore_wait(self, B: int, loss: float) -> float:
        """Declined steps before one drafts anyway: the backed-off wait, and at least as
        many as keep exploring below ``explore_share`` of the time (on the benchmark CPU a
        losing three-draft step costs ~16 ms more than plain steps for its tokens: at
        32-step waits that was ~2% of a 128-token request)."""
        wait = float(self._idle_next)
        plain = self.step_cost(B, 1)
        if self.explore_share > 0 and plain:
            wait = max(wait, min(loss / (self.explore_share * plain), IDLE_EXPLORE_MAX))
        return wait

    def decide(self, j: int, slots: Sequence[int], confs: Sequence[float],
               ) -> list[tuple[int, bool]]:
        """The drafter's gate after an MTP run: draft ``j`` (0-based) of each of ``slots``
        with the head's confidence in it. Per slot (how many of its drafts to keep -- ``j +
        1`` keeps them all, fewer drops this one and some made before it --, draft one more).

        The choice is the whole length, not the next draft alone: for every total ``L``
        from 0 to the cap, the batch's expected tokens from the first ``L`` drafts (each
        sequence's chance that a draft and every one before it survive; drafts past ``j``
        by :meth:`~pyggspec.speculative.calibration.AcceptanceModel.ahead`, from what
        followed drafts of this one's confidence) less the rate times what ``L``
        costs (its verify step, and the MTP runs still to make; the runs already made are
        paid whatever is kept). Verify cost is not convex in rows (on a 2-core AVX-512 CPU
        one row 32 ms, two 72 ms, four 85 ms): judged one draft at a time, the first row's
        jump hid that three drafts pay where one does not. And a length chosen after the
        first draft is chosen again after each later one, down to none: kept once chosen,
        the first draft of a step whose second came out unsure was verified alone -- a
        two-row step that on the Q4_K_M ~0.70 bench model yielded a token per 35 ms where
        plain decoding yields one per 28."""
        B = self._B or len(slots)
        acc = self.acceptance
        regimes = [self._regime.get(s, "greedy") for s in slots]
        if j == 0:  # what the gate is offered: the spread plan() values drafting by
            for r, c in zip(regimes, confs):
                acc.offer(r, c)
        surv = []
        for s, r, c in zip(slots, regimes, confs):
            a = acc.predict(r, j, c)
            self._pred.setdefault(s, []).append(a)
            surv.append(self._survival(s) * a)
        if self.forced is not None or self._explore == "full":  # every draft, to the cap
            for s, p in zip(slots, surv):
                self._keep(s, p)
            return [(j + 1, True)] * len(slots)
        best = self._best_length(B, j, surv, regimes, confs, slots)
        keep, more = (j + 1, True) if best is None else (min(best, j + 1), best > j + 1)
        if self._min_keep and keep < min(self._min_keep, j + 1):
            keep, more = min(self._min_keep, j + 1), False
        if self._explore == "idle":  # after declined steps: draft on, the gate choosing
            self._explore = False
            if keep <= j or not more:
                keep, more = j + 1, True
        elif self._floor:  # an exploring step: the draft past the budget's stop is verified
            if keep < min(self._floor, j + 1):
                keep, more = min(self._floor, j + 1), False
            if j + 1 >= self._floor:
                self._floor = 0
        elif self._explore and (keep <= j or not more):  # one past where the budget stops
            self._explore = False
            if keep <= j:  # among the drafts made: verify one more of them
                keep, more = keep + 1, False
            else:  # this draft: make the next one, and keep it when it comes (_floor).
                # Only drafting it, the next call chose again and dropped it, so a longer
                # step was never measured: in one warm process at Q8_0 ~0.70 -np 4 the
                # budget verified one draft in 510 of 542 steps and two in one, pricing
                # the 4 x 3 step at 213 ms from start-up where it ran in ~170
                self._floor, more = j + 2, True
        if keep <= j:
            for s in slots:
                del self._pred[s][keep:]
                del self._cum.setdefault(s, [])[keep:]
            return [(keep, False)] * len(slots)
        for s, p in zip(slots, surv):
            self._keep(s, p)
        return [(keep, more)] * len(slots)

    def _keep(self, slot: int, surv: float) -> None:
        """``slot``'s next draft is kept, with ``surv`` the chance it and every one before
        it are accepted."""
        self._cum.setdefault(slot, []).append(surv)

    def _survival(self, slot: int) -> float:
        """The chance that every draft ``slot`` kept this step is accepted (1: none)."""
        c = self._cum.get(slot)
        return c[-1] if c else 1.0

    def _best_length(self, B: int, j: int, surv: Sequence[float], regimes: Sequence[str],
                     confs: Sequence[float], slots: Sequence[int]) -> int | None:
        """The total drafts (0 .. the cap) with the most expected tokens less their cost
        at the batch's rate; None when a cost is not known yet (then draft: it gets
        measured). Lengths up to ``j`` keep drafts already made (``slots``' kept ones)."""
        mtp = self.costs.estimate("mtp", B, 1)
        if mtp is None:
            return None
        R = self.rate(B)
        acc = self.acceptance
        made = [sum(c[i] for s in slots if len(c := self._cum.get(s, ())) > i)
                for i in range(j)]
        # the verify batch is padded to its longest sequence, and sequences that stopped
        # drafting (their cap, a stop token) keep their drafts: fewer drafts here than
        # theirs save no row. Priced as if they did, the last steps of a request dropped
        # good drafts -- three sequences' first drafts for one that could draft one more
        # (4 x 2 rows either way) -- and took steps more to finish (Q8_0 ~0.95 -np 4, in
        # one process: 1.030 of fixed n_max 3's ms per token before, 1.001-1.031 after)
        live = set(slots)
        rows = max((len(c) for s, c in self._cum.items() if s not in live), default=0)
        caps = [self._caps.get(s, self._limit) for s in slots]
        best, best_net, gain = 0, -float("inf"), 0.0
        for L in range(j + 1):  # the first L drafts made: their runs are paid
            v = self._verify_step(B, max(L, rows) + 1)
            if v is None:
                return None
            if gain - R * v > best_net:
                best, best_net = L, gain - R * v
            if L < j:
                gain += made[L]
        cur = list(surv)
        for L in range(j + 1, max(self._limit, j + 1) + 1):
            if L > j + 1:  # a draft not made yet, predicted from this one's confidence
                # (none past a sequence's cap: it stops drafting there)
                cur = [p * acc.ahead(r, L - 1, c) if L <= k else 0.0
                       for p, r, c, k in zip(cur, regimes, confs, caps)]
            gain += sum(cur)
            v = self._verify_step(B, max(L, rows) + 1)
            if v is None:
                return None
            net = gain - R * (v + (L - j - 1) * mtp)
            if net > best_net:
                best, best_net = L, net
        return best

    def record(self, slot: int, confs: Sequence[float], n: int) -> None:
        """``slot``'s drafts (their confidences) were verified; the first ``n`` accepted.
        Positions past the first rejection were never judged and teach nothing."""
        if self._loss_val > 0:  # declining: an exploring step may find drafting pays again
            self._loss_key = None
        pred = self._pred.get(slot, [])
        regime = self._regime.get(slot, "greedy")
        for i in range(min(len(confs), n + 1)):
            self.acceptance.record(regime, i, confs[i], i < n,
                                   pred[i] if i < len(pred) else None,
                                   confs[i - 1] if i else None)

    def observe(self, kind: str, B: int, T: int, ms: float) -> None:
        """A graph run of ``kind`` ("verify", "mtp") took ``ms`` of compute."""
        self.costs.observe(kind, B, T, ms)

    def observe_step(self, B: int, T: int, wall_ms: float, tokens: int, mtp_runs: int = 0,
                     head_ms: float | None = None) -> None:
        """A whole step with ``T`` verify rows per sequence took ``wall_ms``, ran the MTP
        head ``mtp_runs`` times (``head_ms`` of its wall time) and emitted ``tokens`` over
        the batch.

        A one-row step that ran the head (its drafts all dropped, or owed pairs written)
        is not a plain step: counted as one, it made plain decoding look a third slower
        than it is on the benchmark CPU (47 ms against 34 ms), so drafting that loses to
        plain decoding looked as if it paid. Without its head runs it is one, though, and
        counts as one: where the budget drafts nearly every step, plain decoding was
        otherwise known only from its first probe steps (right after the prompt, and
        slow: 82 ms for a 4 x 1 step that takes 68-73, which made drafting look as if it
        paid at ``-np 4`` on the Q4_K_M ~0.70 bench model, where it lost 9%). The head's
        wall time in such a step is what a dropped draft costs (``drop``)."""
        self.chosen[min(T - 1, self.n_max)] += 1
        if T > 1 or not mtp_runs:
            self.costs.observe("step", B, T, wall_ms)
            if not self.costs.frozen:
                self.ratios.observe(B, T, wall_ms)
            cost = self.step_cost(B, T)  # this shape's typical time: one slow step is noise
        elif head_ms is not None and 0.0 < head_ms < wall_ms:
            self.costs.observe("step", B, 1, wall_ms - head_ms)
            self.costs.observe("drop", B, 1, head_ms)  # (frozen costs keep neither)
            if not self.costs.frozen:
                self.ratios.observe(B, 1, wall_ms - head_ms)
            cost = ((self.step_cost(B, 1) or wall_ms - head_ms)
                    + self.costs.ms.get(("drop", B, 1), head_ms))
        else:
            plain, mtp = self.step_cost(B, 1), self.costs.estimate("mtp", B, 1)
            cost = plain + mtp_runs * mtp if plain and mtp else wall_ms
        if cost:
            r = tokens / cost * self.costs.drift
            old = self._rate.get(B)
            self._rate[B] = r if old is None else RATE_DECAY * old + (1 - RATE_DECAY) * r
        # every step, the ways' too (in the speed factor's units, as the rate): a way's
        # first step after another's is not counted (arms.DraftWays.observe)
        self.ways.observe(B, self._way, tokens, cost / self.costs.drift if cost else 0.0)
        self._way = None

    def _new_ways(self) -> DraftWays:
        """The drafting ways to choose among: one below the cap too where that drafts."""
        return DraftWays(WAYS if self.n_max >= 2 else tuple(w for w in WAYS if w != "short"))

    def end_calibration(self) -> None:
        """After the start-up calibration (forced lengths): forget the lengths chosen and
        the rates seen; costs (each shape's start-up runs weighing as one:
        :meth:`CostModel.settle`) and the acceptance model stay."""
        self.forced = None
        self.forced_pairs = False
        self.costs.settle()
        self.ratios.settle()
        self.ways = self._new_ways()
        self.chosen = [0] * (self.n_max + 1)
        self.declined = self.plain_probes = 0
        self._loss_key = None
        self._rate.clear()
        self._n_drafting = self._n_idle = 0
        self._idle_next = self.idle_explore_every
        self._cap_runs = None

    def to_dict(self) -> dict:
        return {"chosen_lengths": list(self.chosen), "declined_steps": self.declined,
                "plain_probe_steps": self.plain_probes,
                "costs_ms": self.costs.to_dict(),
                "cost_drift": round(self.costs.drift, 4),
                "step_ratios": self.ratios.to_dict(),
                "ways": self.ways.to_dict(),
                "rate_tokens_per_ms": {str(b): round(r / self.costs.drift, 5)
                                       for b, r in sorted(self._rate.items())},
                "calibration": self.acceptance.report()}


GATED_EXACT = 4096  # confidence combinations over a batch enumerated; beyond, sampled


def gated_value(tables: Sequence[tuple[np.ndarray, np.ndarray]], extra: np.ndarray,
                first: float, drop: float | None = None) -> float:
    """Expected tokens a drafting step yields beyond plain decoding's, for a gate that
    sees each sequence's first-draft confidence and then chooses the batch's length.

    ``tables``: per sequence, the shares of its confidence bins and, per bin, the expected
    accepted drafts of lengths 1..L (``[bins, L]``); ``extra[L-1]``: what a step with ``L``
    drafts costs beyond a plain one (its head runs included), in tokens plain decoding
    makes in that time; ``first``: the head's first run, which the gate has paid when it
    chooses; ``drop`` (default ``first``): what the head's runs cost when it then drops
    every draft. The gate takes the best length for the confidences it sees when that
    beats decoding plainly after the paid run, and drops them otherwise, so the value is
    the expectation of what it then gains or pays over the batch's confidences:
    enumerated when there are at most
    :data:`GATED_EXACT` combinations, else sampled (a fixed seed: the same tables give the
    same value)."""
    n_comb = 1
    for shares, _ in tables:
        n_comb *= len(shares)
    if n_comb <= GATED_EXACT:
        prob, total = np.ones(1), np.zeros((1, extra.size))
        for shares, gains in tables:
            prob = (prob[:, None] * shares[None, :]).reshape(-1)
            total = (total[:, None, :] + gains[None, :, :]).reshape(-1, extra.size)
    else:
        rng = np.random.default_rng(0)
        n = GATED_EXACT
        prob, total = np.full(n, 1.0 / n), np.zeros((n, extra.size))
        for shares, gains in tables:
            total += gains[rng.choice(len(shares), size=n, p=shares / shares.sum())]
    best = (total - extra[None, :]).max(axis=1)
    return float(prob @ np.where(best + first > 0, best, -(first if drop is None else drop)))


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
