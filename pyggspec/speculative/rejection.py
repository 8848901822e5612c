"""p/q rejection verification (``--spec-draft-sampling probabilistic``, as llama.cpp b11368+).

Drafts are drawn from q (the head's top 10 at the target's temperature); row i accepts
draft d with probability min(1, p(d)/q(d)), else draws from the residual max(0, p - q).
The target distribution is kept exactly, but not plain seeded sampling's tokens. Pure
functions; the randomness is counter-based (:func:`uniform`: chain key, position, stream),
so a seeded run repeats exactly whatever batch it ran in.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pyggspec.sampling.noise import splitmix64

DRAFT_TOP_K = 10  # llama.cpp's draft sampler for rejection: top-k 10 at the target temp
_DRAFT_SALT = 0x5D7A_F3C1_0B9E_2467  # the draft's stream: independent of the target's
_ACCEPT_SALT = 0xA3B1_9C4D_7E2F_6015
Dist = tuple[np.ndarray, np.ndarray]  # (ids int32, probabilities float64)


def uniform(key: int, position: int, stream: int) -> float:
    """A uniform number in [0, 1) for (chain key, position, stream), 53 bits."""
    x = splitmix64((key ^ splitmix64(position * 4 + stream)) & 0xFFFF_FFFF_FFFF_FFFF)
    return (x >> 11) * 2.0**-53


def draft_distribution(logits: np.ndarray, temp: float, top_k: int = DRAFT_TOP_K) -> Dist:
    """q: the head's ``top_k`` most likely ids (ties: lowest id) at temperature ``temp``."""
    row = np.asarray(logits, np.float64).reshape(-1)
    k = min(top_k, row.size)
    top = np.argpartition(-row, k - 1)[:k]
    top = top[np.lexsort((top, -row[top]))]
    z = row[top] / max(temp, 1e-6)
    w = np.exp(z - z.max())
    return top.astype(np.int32), w / w.sum()


def draw(dist: Dist, u: float) -> int:
    """The id at cumulative probability ``u`` (inverse CDF, in the distribution's order)."""
    ids, probs = dist
    i = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
    return int(ids[min(i, len(ids) - 1)])


def draw_draft(logits: np.ndarray, temp: float, key: int, position: int) -> tuple[int, Dist]:
    """One draft drawn from q at ``position`` (the draft's own random stream)."""
    q = draft_distribution(logits, temp)
    return draw(q, uniform(key ^ _DRAFT_SALT, position, 0)), q


def prob_of(dist: Dist, token: int) -> float:
    ids, probs = dist
    hit = probs[ids == token]
    return float(hit.sum()) if hit.size else 0.0


def residual(p: Dist, q: Dist) -> Dist:
    """max(0, p - q) over p's support (unnormalised)."""
    ids, pp = p
    qq = np.zeros_like(pp)
    pos = {int(t): j for j, t in enumerate(ids)}
    for t, w in zip(*q, strict=True):
        j = pos.get(int(t))
        if j is not None:
            qq[j] = w
    r = np.maximum(pp - qq, 0.0)
    keep = r > 0
    return ids[keep], r[keep]


def accept_rejection(drafts: list[int], q: list[Dist], p_of: Callable[[int], Dist],
                     bonus: Callable[[int], int], key: int, position: int,
                     is_stop: Callable[[int], bool]) -> tuple[list[int], int, bool]:
    """Verify ``drafts`` (drawn from ``q``) against the target's distributions ``p_of(i)``.

    Returns (the tokens in order, accepted draft count n, whether the last is a stop token)
    like :func:`~pyggspec.speculative.verify.accept`. ``bonus(i)`` is the chain's own
    sample at row i (after all drafts, or when the residual is empty); ``position`` is the
    chain's counter at row 0.
    """
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = p_of(i)
        q_x, p_x = prob_of(q[i], d), prob_of(p, d)
        if q_x > 0 and (p_x >= q_x
                        or uniform(key ^ _ACCEPT_SALT, position + i, 0) < p_x / q_x):
            out.append(d)
            if is_stop(d):
                return out, i, True
            continue
        r = residual(p, q[i])
        t = (draw(r, uniform(key ^ _ACCEPT_SALT, position + i, 1)) if r[1].sum() > 0
             else bonus(i))
        out.append(t)
        return out, i, is_stop(t)
    t = bonus(len(drafts))
    out.append(t)
    return out, len(drafts), is_stop(t)
