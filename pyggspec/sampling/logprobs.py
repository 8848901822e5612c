"""Log-probabilities of an emitted token and its top alternatives, from one target logits row.

Two distributions, as llama-server reports them (``n_probs``, ``post_sampling_probs``):

* **raw** (its default): the softmax of the model's logits over the whole vocabulary, before
  any sampler touches them (no logit bias, penalties or temperature); the top ``n`` ids by
  logit.
* **post-sampling**: the distribution the chain's terminal stage draws from
  (:func:`~pyggspec.sampling.host.chain_distribution`: every filter applied, softmax at the
  chain's temperature; a greedy chain gives its choice probability 1); the top ``n`` ids
  by probability, ids with probability 0 left out.

Both are computed on the host from a logits row and nothing else (the chain's state only
for post-sampling), so a token gets the same values whether it was emitted by a plain step
or confirmed in a verify row: speculation cannot change them. Ties are ordered by the
lowest id, as the greedy stage breaks them. Sums run in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyggspec.sampling import stages as S
from pyggspec.sampling.host import chain_distribution

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.sampling.chain import SamplerChain

# (token's logprob, top ids, their logprobs): what one emitted token reports
Logprobs = tuple[float, tuple[int, ...], tuple[float, ...]]


def raw_logprobs(logits: np.ndarray, token: int, n_top: int) -> Logprobs:
    """``token``'s log-softmax over the whole row and the ``n_top`` most likely ids (by
    logit, ties to the lowest id) with theirs. One float64 pass over the row."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    x = row.astype(np.float64)
    m = float(x.max())
    if m == -np.inf:  # nothing is possible (every logit -inf): no probabilities to report
        return -np.inf, (), ()
    lse = m + float(np.log(np.exp(x - m).sum()))
    lp = float(x[token]) - lse
    if n_top <= 0:
        return lp, (), ()
    top = S.topk_exact(S.Cand(None, row), min(n_top, len(row))).canonical()
    ids = top.id_array()
    return lp, tuple(int(i) for i in ids), tuple(float(v) for v in x[ids] - lse)


def chain_logprobs(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int],
                   token: int, n_top: int) -> Logprobs:
    """``token``'s log-probability under the chain's sampling distribution for this row
    (``prefix``: the tokens between the chain's accepted state and this row, the drafts
    before a verify row) and the ``n_top`` most likely ids with a probability above 0.
    A token the chain's filters removed has logprob -inf."""
    ids, probs = chain_distribution(chain, logits, prefix)
    hit = probs[ids == token]
    p = float(hit.sum()) if hit.size else 0.0
    lp = float(np.log(p)) if p > 0 else -np.inf
    if n_top <= 0 or ids.size == 0:
        return lp, (), ()
    order = np.lexsort((ids, -probs))[:n_top]
    order = order[probs[order] > 0]
    return (lp, tuple(int(i) for i in ids[order]),
            tuple(float(v) for v in np.log(probs[order])))
