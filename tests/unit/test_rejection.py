"""p/q rejection (speculative/rejection.py) on constructed distributions: one draft is
accepted with probability 1 - TV(p, q) (the analytic optimum), and the token it emits is
distributed exactly as p (chi-square), whatever q is."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pyggspec.speculative.rejection import (
    accept_rejection,
    draft_distribution,
    draw,
    residual,
    uniform,
)

IDS = np.arange(6, dtype=np.int32)


def never(t: int) -> bool:
    return False


def run_one(p, q, n_runs, bonus_p=None):
    """Draft from q, verify against p, n_runs times with different chain keys."""
    accepted, first = 0, np.zeros(len(IDS), int)
    pd, qd = (IDS, np.asarray(p, float)), (IDS, np.asarray(q, float))
    for key in range(n_runs):
        d = draw(qd, uniform(key * 7919 + 13, 0, 9))
        bonus = (lambda i, key=key: draw((IDS, np.asarray(bonus_p or p, float)),
                                         uniform(key, 5, 5)))
        out, n, stopped = accept_rejection([d], [qd], lambda i: pd, bonus, key, 0, never)
        assert not stopped and len(out) == 1 + n
        accepted += n
        first[out[0]] += 1
    return accepted / n_runs, first


@pytest.mark.parametrize("p,q", [
    ([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.2, 0.3, 0.2, 0.1]),
    ([0.9, 0.1, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
    ([0.3, 0.3, 0.2, 0.1, 0.1, 0.0], [0.3, 0.3, 0.2, 0.1, 0.1, 0.0]),  # q == p: always
])
def test_acceptance_is_one_minus_tv_and_output_is_p(p, q):
    n = 20000
    rate, counts = run_one(p, q, n)
    tv = 0.5 * np.abs(np.subtract(p, q)).sum()
    sigma = np.sqrt((1 - tv) * tv / n) + 1e-9
    assert abs(rate - (1 - tv)) <= 5 * sigma + 1e-12, (rate, 1 - tv)
    support = np.asarray(p) > 0
    assert counts[~support].sum() == 0  # nothing outside p's support, ever
    chi = stats.chisquare(counts[support], n * np.asarray(p)[support])
    assert chi.pvalue > 1e-3, (counts, chi)


def test_residual_and_draft_distribution():
    r = residual((IDS, np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])),
                 (np.array([0, 3], np.int32), np.array([0.7, 0.3])))
    assert r[0].tolist() == [1, 2, 4, 5] and np.allclose(r[1], [0.2, 0.1, 0.05, 0.05])
    logits = np.array([0.0, 3.0, 1.0, 3.0, -1.0] + [-5.0] * 20)
    ids, probs = draft_distribution(logits, temp=1.0, top_k=3)
    assert ids.tolist() == [1, 3, 2]  # top 3, ties by lowest id
    assert np.isclose(probs.sum(), 1.0) and probs[0] == probs[1] > probs[2]


def test_counter_based_draws_repeat_and_are_uniform():
    u = [uniform(12345, i, s) for i in range(2000) for s in (0, 1)]
    assert u == [uniform(12345, i, s) for i in range(2000) for s in (0, 1)]
    assert stats.kstest(u, "uniform").pvalue > 1e-3
