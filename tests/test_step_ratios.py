"""Drafting steps priced in plain steps run beside them (pyggspec.speculative.step_ratios)."""

from __future__ import annotations

import pytest

from pyggspec.models.batch import padded_rows
from pyggspec.speculative.adaptive import CostModel, DraftBudget
from pyggspec.speculative.calibration import AcceptanceModel
from pyggspec.speculative.step_ratios import (
    PAIR_SECONDS,
    PAIR_STEPS,
    PROBE_EVERY,
    RATIO_MIN_RUNS,
    RATIO_RECENT,
    StepRatios,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_drafting_step_is_compared_with_plain_steps_beside_it():
    """Before it (the median of those near; of two, the faster), else the next plain step if it comes within
    a few steps and seconds; never one from another minute. A shape is priced once three
    comparisons agree by their median."""
    clock = Clock()
    r = StepRatios(clock)
    r.observe(4, 1, 100.0)
    r.observe(4, 1, 110.0)
    for ms in (315.0, 315.0):
        r.observe(4, 4, ms)
    assert r.ratio(4, 4) is None  # two comparisons: not yet
    r.observe(4, 4, 420.0)
    assert r.ratio(4, 4) == pytest.approx(3.15)  # against the faster of 100 and 110
    assert r.ratio(4, 3) is None and r.ratio(1, 4) is None
    clock.t += PAIR_SECONDS + 1  # another request ran meanwhile
    for _ in range(RATIO_MIN_RUNS):
        r.observe(4, 3, 240.0)
    assert r.ratio(4, 3) is None  # nothing near before them: they wait for the next one
    r.observe(4, 1, 120.0)
    assert r.ratio(4, 3) == pytest.approx(2.0)
    for _ in range(RATIO_MIN_RUNS):
        r.observe(2, 3, 100.0)  # another batch size's plain steps are not their reference
    assert r.ratio(2, 3) is None
    for _ in range(PAIR_STEPS + 1):
        r.observe(4, 1, 50.0)
    r.observe(2, 1, 50.0)  # too many steps later: the 2 x 3 steps never pair
    assert r.ratio(2, 3) is None
    assert r.to_dict() == {"4x3": 2.0, "4x4": 3.15}


def test_a_stalled_plain_step_cannot_make_a_drafting_step_cheap():
    """A comparison is at least one plain step (the drafting step does all a plain one
    does), and one stall is outvoted: priced from a single comparison with a plain step
    the VM stalled on, a 1 x 2 step once cost 0.16 plain steps and the budget dropped
    nearly every draft for a request."""
    r = StepRatios(Clock())
    r.observe(1, 1, 600.0)  # stalled
    r.observe(1, 2, 95.0)
    r.observe(1, 1, 64.0)
    r.observe(1, 2, 96.0)
    assert r.ratio(1, 2) is None
    r.observe(1, 2, 96.0)
    assert r.ratio(1, 2) == pytest.approx(1.5)
    r.observe(1, 1, 900.0)
    for _ in range(8):
        r.observe(1, 3, 120.0)
    assert r.ratio(1, 3) == 1.0  # never below a plain step


def test_plain_steps_are_asked_for_while_drafting():
    """Soon while no drafting shape of a batch size has a ratio, then every
    PROBE_EVERY drafting steps; a plain step resets the count."""
    r = StepRatios(Clock())
    for _ in range(PAIR_STEPS - 1):
        r.observe(4, 4, 300.0)
    assert not r.wants_plain(4)
    r.observe(4, 4, 300.0)
    assert r.wants_plain(4) and not r.wants_plain(1)
    r.observe(4, 1, 100.0)
    assert r.ratio(4, 4) == pytest.approx(3.0)  # the waiting ones paired with it
    for _ in range(PROBE_EVERY - 1):
        r.observe(4, 4, 300.0)
    assert not r.wants_plain(4)
    r.observe(4, 3, 250.0)
    assert r.wants_plain(4)


def test_settled_start_up_comparisons_are_outvoted_by_a_few_real_ones():
    r = StepRatios(Clock())
    r.observe(1, 1, 10.0)
    for ms in (40.0, 40.0, 40.0, 25.0):
        r.observe(1, 4, ms)
    r.settle()
    assert r.ratio(1, 4) == pytest.approx(4.0)
    r.observe(1, 4, 30.0)  # no plain step since the calibration: nothing to pair with
    r.observe(1, 1, 10.0)
    for _ in range(3):
        r.observe(1, 4, 30.0)
    assert r.ratio(1, 4) == pytest.approx(3.0)  # median of 4, 4, 4, 3, 3, 3, 3


def test_drafting_is_priced_against_plain_decoding_of_the_same_minutes():
    """Row 60's miss, made small: plain steps measured in a fast minute (100 ms), then the
    budget drafts 4 x 4 steps in a 30% slower one (390 ms; 300 at the fast speed). Priced
    from their own medians the step looked like 3.9 plain steps and drafting lost; from
    the plain steps the budget runs among its drafting steps it is 3.0, and drafting
    pays."""
    acc = AcceptanceModel()
    for i in range(400):  # nine in ten drafts accepted
        for pos in range(3):
            acc.record("greedy", pos, 0.99, i % 10 != 0)
    for _ in range(20):
        acc.offer("greedy", 0.99)
    c = CostModel()
    c.observe("mtp", 4, 1, 5.0)
    for rows, ms in ((1, 60.0), (4, 100.0), (8, 190.0), (12, 240.0), (16, 285.0)):
        c.observe("verify", 1, rows, ms)  # one sequence's graphs: the shapes between
    b = DraftBudget(3, c, padded_rows, acc, explore_every=0, idle_explore_every=0,
                    explore_share=0)
    b.use_ways = False  # the gate's own pricing (the ways: tests/test_draft_ways.py)
    clock = Clock()
    b.ratios = StepRatios(clock)
    for _ in range(3):
        b.observe_step(4, 1, 100.0, 4)
    clock.t += 60.0  # a minute later
    slots, caps, regimes = [0, 1, 2, 3], [3] * 4, ["greedy"] * 4
    probes = []
    for i in range(40):
        k = b.plan(slots, caps, regimes)
        if k == 0:
            probes.append(i)
            b.observe_step(4, 1, 130.0, 4)
        else:
            b.observe_step(4, 4, 390.0, 14, mtp_runs=3)
    assert probes == [PAIR_STEPS]  # asked for once no shape had a ratio
    assert b.step_cost(4, 4) / b.step_cost(4, 1) == pytest.approx(3.0)
    assert b._loss(4, 3, caps, regimes) == 0.0  # drafting pays
    assert b.to_dict()["step_ratios"] == {"4x4": 3.0}
    own = c.ms[("step", 4, 4)] / c.ms[("step", 4, 1)]  # each shape's own median
    assert own == pytest.approx(3.9, rel=0.03)
    ratios, b.ratios = b.ratios, StepRatios(clock)  # priced so, drafting looked as if it lost
    assert b._loss(4, 3, caps, regimes) > 0
    b.ratios = ratios
    b.costs.frozen = True  # pinned costs (tests) are the whole truth: no ratios, no
    before = b.plain_probes  # comparisons, no plain steps asked for
    assert b._loss(4, 3, caps, regimes) > 0
    b.observe_step(4, 1, 130.0, 4)
    for _ in range(RATIO_RECENT):  # beside it: 4.0 plain steps each, were they compared
        b.observe_step(4, 4, 520.0, 14, mtp_runs=3)
    assert b.ratios.to_dict() == {"4x4": 3.0}
    for _ in range(PROBE_EVERY):  # ratios that would ask for a plain step
        b.ratios.observe(4, 4, 390.0)
    assert b.ratios.wants_plain(4)
    for _ in range(4):
        b.plan(slots, caps, regimes)
    assert b.plain_probes == before


def test_metrics_show_the_ratios_the_budget_prices_by():
    from pyggspec.serving.http.metrics import budget_families, render

    text = render(budget_families({"declined_steps": 2, "step_ratios": {"4x4": 2.52,
                                                                         "1x2": 1.5}}))
    assert "# TYPE pyggspec:spec_draft_step_cost_ratio gauge" in text
    assert 'pyggspec:spec_draft_step_cost_ratio{batch="4",rows="4"} 2.52' in text
    assert 'pyggspec:spec_draft_step_cost_ratio{batch="1",rows="2"} 1.5' in text
