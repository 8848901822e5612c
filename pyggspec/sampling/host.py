"""The host side of a sampler chain: running stages on float32 logits in numpy (the whole
chain, or the suffix after a graph prefix), and a token's probability under the chain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyggspec.sampling import stages as S

if TYPE_CHECKING:
    from pyggspec.sampling.chain import SamplerChain


def run_host(stages: Sequence[S.Stage], cand: S.Cand, row: S.RowCtx) -> int:
    """Run stages on the host until the terminal one picks the token."""
    for st in stages:
        out = st.host(cand, row)
        if isinstance(out, int):
            return out
        cand = out
    raise AssertionError("chain without a terminal stage")  # pragma: no cover


def sample_host(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int] = ()) -> int:
    """The whole chain on the host for one row of float32 logits (does not accept)."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    if row.shape[0] != chain.n_vocab:
        raise ValueError(f"logits row has {row.shape[0]} entries, vocabulary is {chain.n_vocab}")
    return run_host(chain.stages, S.Cand(None, row), chain.row(prefix))


def chain_probability(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int],
                      token: int) -> float:
    """The probability of ``token`` under the chain's distribution for this row
    (:func:`chain_distribution`). Host only (used for draft ``p_min``)."""
    ids, probs = chain_distribution(chain, logits, prefix)
    hit = probs[ids == token]
    return float(hit.sum()) if hit.size else 0.0


def chain_distribution(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int] = (),
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The chain's distribution for this row, what ``dist`` samples from: (ids, float64
    probabilities) of the candidates left by every filter, softmax at the chain's
    temperature (a greedy chain: its choice with probability 1)."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    cand = S.Cand(None, row)
    rc = chain.row(prefix)
    for st in chain.stages[:-1]:
        cand = st.host(cand, rc)
    c = cand.finite()
    if len(c.logits) == 0:  # every candidate filtered out: nothing has probability
        return np.zeros(0, np.int32), np.zeros(0)
    if chain.stages[-1].name == "greedy":
        return np.array([S.argmax_lowest(c)], np.int32), np.ones(1)
    w = np.exp(c.logits.astype(np.float64) - float(c.logits.max()))
    return c.id_array().astype(np.int32), w / w.sum()
