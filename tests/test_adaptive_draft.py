"""The adaptive draft-length policy (pure: acceptance counts and costs in, a length out)."""

from __future__ import annotations

import random

import pytest

from pyggspec.speculative.adaptive import CostModel, DraftLengthPolicy
from pyggspec.speculative.loop import padded_rows


def costs(step: float, per_row: float, mtp: float, B: int = 1, T_max: int = 6) -> CostModel:
    """verify(B, T) = step + per_row * (B*T - 1); one MTP run = mtp."""
    c = CostModel()
    for b in range(1, B + 1):
        for t in range(1, T_max + 1):
            c.observe("verify", b, t, step + per_row * (b * t - 1))
        c.observe("mtp", b, 1, mtp)
    return c


def trained(policy: DraftLengthPolicy, slot: int, rate: float, steps: int = 400) -> None:
    """Feed ``steps`` verify outcomes where each draft is accepted with ``rate`` (seeded)."""
    rng = random.Random(slot)
    for _ in range(steps):
        n = 0
        while n < policy.n_max and rng.random() < rate:
            n += 1
        policy.record(slot, policy.n_max, n)


def test_expected_tokens():
    assert DraftLengthPolicy.expected([0.5, 0.5, 0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert DraftLengthPolicy.expected([1.0, 1.0], 2) == 2.0
    assert DraftLengthPolicy.expected([0.9], 0) == 0.0


def test_record_counts_only_positions_that_were_tried():
    p = DraftLengthPolicy(3, CostModel(), padded_rows)
    p.start(0)
    for _ in range(50):
        p.record(0, 3, 1)  # first accepted, second rejected, third never judged
    r = p.rates(0)
    assert r[0] > 0.9 and r[1] < 0.1
    assert r[2] == pytest.approx(0.5, abs=0.01)  # prior only: never observed


def test_high_acceptance_drafts_to_the_cap_low_drafts_nothing():
    c = costs(step=100, per_row=15, mtp=30)
    hi = DraftLengthPolicy(4, c, padded_rows, explore_every=0)
    trained(hi, 0, 0.95)
    assert hi.choose([0], [4]) >= 3  # 4 drafts = 5 rows, padded to 6: 3 pays more here
    lo = DraftLengthPolicy(4, c, padded_rows, explore_every=0)
    trained(lo, 0, 0.15)
    assert lo.choose([0], [4]) == 0
    mid = DraftLengthPolicy(4, c, padded_rows, explore_every=0)
    trained(mid, 0, 0.6)
    k = mid.choose([0], [4])
    assert 1 <= k <= 2


def test_caps_and_unmeasured_costs():
    p = DraftLengthPolicy(4, CostModel(), padded_rows)
    assert p.choose([0], [2]) == 2  # nothing measured yet: the cap
    assert p.choose([0], [0]) == 0
    assert p.choose([], []) == 0


def test_compute_bound_batches_draft_less():
    """When verify rows cost nearly a full step each (a big batch on a small CPU), the same
    acceptance drafts less than with cheap rows."""
    cheap = DraftLengthPolicy(3, costs(100, 5, 20, B=4), padded_rows, explore_every=0)
    dear = DraftLengthPolicy(3, costs(100, 90, 20, B=4), padded_rows, explore_every=0)
    for p in (cheap, dear):
        for s in range(4):
            trained(p, s, 0.7)
    assert dear.choose([0, 1, 2, 3], [3] * 4) < cheap.choose([0, 1, 2, 3], [3] * 4)
    assert dear.choose([0, 1, 2, 3], [3] * 4) == 0


def test_per_sequence_rates_and_exploration():
    c = costs(step=100, per_row=15, mtp=30)
    p = DraftLengthPolicy(3, c, padded_rows, explore_every=4)
    trained(p, 0, 0.1)
    trained(p, 1, 0.97)
    assert p.rates(1)[0] > 0.9 and p.rates(0)[0] < 0.2
    picks = [p.choose([0], [3]) for _ in range(8)]
    assert picks.count(1) == 2 and picks.count(0) == 6  # every 4th step tries one more
    assert sum(p.chosen) == 8 and p.to_dict()["chosen_lengths"][1] == 2


def test_cost_model_ema_and_nearest_estimate():
    c = CostModel()
    c.observe("verify", 1, 2, 100)
    c.observe("verify", 1, 2, 200)
    assert c.estimate("verify", 1, 2) == pytest.approx(120)
    assert c.estimate("verify", 1, 4) == pytest.approx(240)  # scaled from the nearest
    assert c.estimate("verify", 1, 1) == pytest.approx(120)  # fewer rows: not less
    assert c.estimate("mtp", 1, 1) is None
