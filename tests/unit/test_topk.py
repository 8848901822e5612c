"""topk_exact against the plain rule (partition the whole row; ties at the boundary to the
lowest ids) on rows that are random, all one value, mostly one value with a few others
(numpy's partition is slow there: a nearly flat head's logits), and coarsely rounded
(many ties), with and without candidate ids, for small and big k and rows."""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.sampling.stages import Cand, topk_exact


def reference(c: Cand, k: int) -> Cand:
    n = len(c.logits)
    if k >= n:
        return c if c.ids is not None else c.take(np.arange(n))
    t = np.partition(c.logits, n - k)[n - k]
    gt = np.flatnonzero(c.logits > t)
    eq = np.flatnonzero(c.logits == t)
    if c.ids is not None:
        eq = eq[np.argsort(c.ids[eq], kind="stable")]
    return c.take(np.concatenate([gt, eq[: k - len(gt)]]))


def rows(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32),
            np.where(rng.random(n) < 0.001, rng.standard_normal(n), 0).astype(np.float32),
            np.round(rng.standard_normal(n), 1).astype(np.float32),
            np.where(rng.random(n) < 0.5, -np.inf, rng.standard_normal(n)).astype(np.float32)]


@pytest.mark.parametrize("n", [7, 1000, 40_000, 248_320])
def test_topk_is_the_plain_rule(n):
    rng = np.random.default_rng(n)
    for x in rows(n, rng):
        for ids in (None, rng.permutation(n).astype(np.int32)):
            for k in (1, 2, 20, 40, 1000, n - 1, n):
                got, want = topk_exact(Cand(ids, x), k), reference(Cand(ids, x), k)
                assert np.array_equal(got.id_array(), want.id_array()), (k, ids is None)
                assert np.array_equal(got.logits, want.logits)
