"""The adaptive draft-length policy (pure: acceptance counts and costs in, a length out)."""

from __future__ import annotations

import random

import pytest

from pyggspec.models.batch import padded_rows
from pyggspec.speculative.adaptive import CostModel, DraftLengthPolicy


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
    assert r[2] == pytest.approx(r[1], abs=0.01)  # never judged: like the position before


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
    q = DraftLengthPolicy(3, c, padded_rows, explore_every=1)
    trained(q, 0, 0.97)
    assert sorted({q.choose([0], [3]) for _ in range(8)}) == [2, 3]  # and sometimes one less
    assert sum(p.chosen) == 8 and p.to_dict()["chosen_lengths"][1] == 2


def test_cost_model_median_and_row_estimates():
    c = CostModel()
    for ms in (100, 900, 110, 120, 105):  # one step slowed by another process
        c.observe("verify", 1, 2, ms)
    assert c.estimate("verify", 1, 2) == pytest.approx(110)
    c.ms[("verify", 1, 2)] = 120
    assert c.estimate("verify", 1, 4) == pytest.approx(240)  # scaled from the nearest
    assert c.estimate("verify", 1, 1) == pytest.approx(120)  # fewer rows: not less
    assert c.estimate("mtp", 1, 1) is None
    c.ms[("verify", 1, 8)] = 400  # rows between calibrated one-sequence shapes: linear
    assert c.estimate("verify", 1, 5) == pytest.approx(120 + (400 - 120) * 3 / 6)
    assert c.estimate("verify", 2, 4) == pytest.approx(400)  # 2 x 4 rows ~ 1 x 8
    c.frozen = True
    c.observe("verify", 1, 8, 1)
    assert c.estimate("verify", 1, 8) == 400


# --- in the engine ---------------------------------------------------------------------------
PROMPTS = [[300, 301, 302], [400, 401], [500, 501, 502, 503, 504], [310]]


@pytest.fixture(scope="module")
def paths(models):
    return {(arch, agr): models.get(arch, dtype="f32", agreement=agr, tied_embeddings=False)
            for arch in ("dense", "moe") for agr in (0.95, None)}


def _gen(make_engine, path, prompts, n, sampling=None, pinned=None, **spec):
    """``pinned``: costs the policy sees instead of measured ones (choices then depend on
    acceptance only, not on how busy the machine is)."""
    from pyggspec.config import SpecConfig

    spec.setdefault("adaptive", True)
    kw = {"spec_type": "draft-mtp", "spec": SpecConfig(**spec)} if len(spec) > 1 else {}
    with make_engine(path, n_ctx=256, n_parallel=len(prompts), **kw) as e:
        if pinned is not None:
            pinned.frozen = True
            e.draft_policy.costs = pinned
        g = e.generate_batch(prompts, max_tokens=n, ignore_eos=True, sampling=sampling)
        return [r.tokens for r in g], g.stats, e.draft_policy


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("seeded", [False, True])
def test_adaptive_is_lossless_and_reports_lengths(paths, make_engine, arch, seeded):
    from pyggspec.sampling import SamplingParams

    sp = SamplingParams(temp=0.8, seed=7) if seeded else SamplingParams(temp=0.0)
    for agr in (0.95, None):
        path = paths[(arch, agr)]
        ref, _, _ = _gen(make_engine, path, PROMPTS, 24, sp)
        out, stats, policy = _gen(make_engine, path, PROMPTS, 24, sp, n_max=4)
        assert out == ref
        assert policy is not None and sum(stats.draft_lengths) == stats.n_steps
        d = policy.to_dict()
        assert d["costs_ms"] and sum(d["chosen_lengths"]) > 0


def test_adaptive_stops_drafting_when_nothing_is_accepted(paths, make_engine):
    """A head that never agrees: after the first steps the policy drafts (almost) nothing
    and the MTP head mostly rests; a head that always agrees drafts to the cap."""
    pinned = costs(step=100, per_row=15, mtp=30)
    _, stats, policy = _gen(make_engine, paths[("dense", None)], PROMPTS[:1], 120, pinned=pinned,
                            n_max=3)
    steps = stats.n_steps
    assert policy.chosen[0] > 0.6 * sum(policy.chosen)
    assert stats.n_mtp_evals < 0.5 * steps  # pairs wait and are written in batches
    _, stats, policy = _gen(make_engine, paths[("dense", 0.95)], PROMPTS[:1], 120, pinned=pinned,
                            n_max=3)
    assert stats.acceptance > 0.8
    assert max(range(4), key=lambda k: policy.chosen[k]) >= 2


def test_fixed_length_flag(paths, make_engine):
    _, stats, policy = _gen(make_engine, paths[("dense", None)], PROMPTS[:1], 30, n_max=3,
                            adaptive=False)
    assert policy is None
    # every step drafts n_max, but the last ones (the budget's room is shorter)
    assert stats.draft_lengths[3] >= stats.n_steps - 3
