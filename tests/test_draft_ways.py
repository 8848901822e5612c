"""DraftWays: the drafting way (the gate, every draft to the cap, or none) by realized
tokens per millisecond, the way not in use tried now and then."""

from __future__ import annotations

import numpy as np

from pyggspec.speculative import arms
from pyggspec.speculative.arms import DraftWays


def _run(ways: DraftWays, n: int, yields: dict, plain_rate: float, rng, B: int = 1,
         plain_cost: float = 0.0) -> list:
    """``n`` steps; a drafting way's step yields tokens drawn from ``yields[way]`` (a list
    to choose from) at a cost of 100 ms. Returns the ways chosen."""
    chosen = []
    for _ in range(n):
        w = ways.choose(B, plain_rate, plain_cost)
        chosen.append(w)
        if w != "plain":
            ways.observe(B, w, int(rng.choice(yields[w])), 100.0)
    return chosen


def test_both_drafting_ways_are_measured_first():
    ways = DraftWays()
    seq = _run(ways, 2 * arms.MIN_STEPS, {"gate": [2], "full": [2]}, 0.01,
               np.random.default_rng(0))
    assert seq.count("gate") == arms.MIN_STEPS and seq.count("full") == arms.MIN_STEPS
    assert seq[:4] == ["gate", "full", "gate", "full"]  # in turn


def test_the_way_that_yields_more_is_used_and_the_other_tried():
    rng = np.random.default_rng(1)
    ways = DraftWays()
    # full: ~3 tokens per 100 ms step; the gate ~2.2; plain 1 per 50 ms (0.02)
    chosen = _run(ways, 400, {"gate": [2, 2, 2, 3, 2], "full": [3, 3, 2, 4, 3]}, 0.02, rng)
    late = chosen[100:]
    assert late.count("full") > 0.9 * len(late)
    assert 0 < late.count("gate")  # still tried now and then
    assert "plain" not in late


def test_plain_when_no_drafting_way_pays():
    rng = np.random.default_rng(2)
    ways = DraftWays()
    # 1.5 tokens per 100 ms against plain decoding's 1 per 50 ms
    chosen = _run(ways, 1000, {"gate": [1, 2], "full": [1, 2]}, 0.02, rng, plain_cost=50.0)
    late = chosen[100:]
    assert late.count("plain") > 0.98 * len(late)
    # both drafting ways lose clearly: tried in turn, so rarely that the tries lose about
    # EXPLORE_SHARE of the time (a try: 100 ms yielding 1.5 tokens where plain decoding
    # yields 2, a quarter of it lost; priced at the way's rate one standard error up, a
    # little less, so somewhat more often)
    tried = [w for w in late if w != "plain"]
    assert {"gate", "full"} <= set(tried)
    lost = len(tried) * 100.0 * 0.25
    assert lost <= 2 * arms.EXPLORE_SHARE * 50.0 * len(late)


def test_close_ways_are_tried_more_often_than_clear_ones():
    rng = np.random.default_rng(3)
    close, clear = DraftWays(), DraftWays()
    a = _run(close, 300, {"gate": [2, 3], "full": [2, 3]}, 0.001, rng)[100:]
    b = _run(clear, 300, {"gate": [1], "full": [4]}, 0.001, rng)[100:]
    minority = lambda c: min(c.count("gate"), c.count("full"))
    assert minority(a) >= len(a) // arms.EXPLORE - 3  # close: every EXPLORE steps
    # the gate yields a quarter of the cap's rate: a try loses 75 of its 100 ms, so one
    # per 75 / (EXPLORE_SHARE * 100) = 250 steps
    assert minority(b) <= 2


def test_batch_sizes_are_kept_apart():
    ways = DraftWays()
    for _ in range(50):
        ways.observe(4, "full", 4, 100.0)
        ways.observe(4, "gate", 1, 100.0)
    assert ways.to_dict()["4"]["full"]["steps"] == arms.WINDOW
    assert ways.choose(1, 0.0) in ("gate", "full")  # batch size 1: measured first
    assert "1" in ways.to_dict()


def test_with_plain_in_use_each_drafting_way_waits_its_own_time():
    rng = np.random.default_rng(4)
    ways = DraftWays()
    # plain decoding: 1 token per 50 ms (0.02). The gate within noise of it (2 tokens per
    # 100 ms on average), the cap's way clearly behind (1 per 100 ms): the gate is tried
    # often, the cap's way as rarely as its loss allows -- not in turn with the gate
    chosen = _run(ways, 1200, {"gate": [1, 2, 3], "full": [1]}, 0.02, rng, plain_cost=50.0)
    late = chosen[200:]
    assert late.count("gate") >= len(late) // (arms.EXPLORE_CLOSE * 4)
    # a try of the cap's way loses half of its 100 ms: one per 50 / (EXPLORE_SHARE / 2 * 50)
    # steps (the two ways share the budget), capped at EXPLORE_MAX
    assert late.count("full") <= len(late) // arms.EXPLORE_MAX + 1
    assert late.count("gate") > 3 * late.count("full")
