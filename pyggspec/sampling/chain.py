"""Sampler chains: one sequence's sampler (:class:`SamplerChain`: stages, noise key, penalty
window, grammar state, snapshot/restore) and :class:`RowInput`, a chain at one output row.

The other parts live beside it: :mod:`~pyggspec.sampling.host` (host sampling),
:mod:`~pyggspec.sampling.plan` (graph prefix | host suffix), :mod:`~pyggspec.sampling.graph`
(the device part), :mod:`~pyggspec.sampling.stats`; :mod:`pyggspec.sampling` exports them
all.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyggspec.sampling import noise as N
from pyggspec.sampling import stages as S
from pyggspec.sampling.host import sample_host
from pyggspec.sampling.lazy_grammar import matcher_for
from pyggspec.sampling.params import DEFAULT_SEED, SamplingParams

__all__ = ["ChainState", "RowInput", "SamplerChain"]


@dataclass(frozen=True)
class ChainState:
    """A chain's mutable state, for speculative rollback."""

    n_sampled: int
    history: tuple[int, ...]
    n_grammar: int = 0  # tokens the grammar matcher consumed (0 without a grammar)


class SamplerChain:
    """One sequence's sampler: its stages, noise key and penalty window.

    Randomness is counter-based: the noise for the token sampled after ``n_sampled`` earlier
    samples is a function of (seed, n_sampled, token id), so exactly one draw is used per
    emitted token whichever path runs and however many verify rows were evaluated, and
    :meth:`snapshot` / :meth:`restore` are two integers and a short tuple.
    """

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.stages = S.resolve_stages(params, n_vocab)
        self._sig: tuple = ()
        self._sig_of: tuple | None = None
        seed = params.seed
        if seed == DEFAULT_SEED:
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = seed
        self.key = N.splitmix64(seed)
        self.n_sampled = 0
        self.history: deque[int] = deque(maxlen=max(params.repeat_last_n, 1))
        # the grammar's parser state (llguidance), compiled once per request; it consumes
        # emitted tokens only (a verify row's mask is taken at its draft prefix)
        self.grammar = matcher_for(params.grammar) if params.grammar is not None else None

    def accept(self, token: int) -> None:
        """Record an emitted (sampled and kept) token: advances the noise counter."""
        self.history.append(int(token))
        self.n_sampled += 1
        if self.grammar is not None:
            self.grammar.accept(token)

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """Prompt tokens count for penalties but were not sampled."""
        self.history.extend(int(t) for t in tokens)

    def snapshot(self) -> ChainState:
        g = self.grammar
        return ChainState(self.n_sampled, tuple(self.history),
                          g.n_consumed if g is not None else 0)

    def restore(self, state: ChainState) -> None:
        self.n_sampled = state.n_sampled
        self.history.clear()
        self.history.extend(state.history)
        if self.grammar is not None:
            self.grammar.restore(state.n_grammar)

    @property
    def grammar_done(self) -> bool:
        """The grammar allows nothing but end of generation now (the output ends here)."""
        return self.grammar is not None and self.grammar.stopped

    def reset(self) -> None:
        self.restore(ChainState(0, ()))

    def row(self, prefix: Sequence[int] = ()) -> S.RowCtx:
        """The context of the token after ``prefix`` (e.g. drafts before a verify row)."""
        pre = tuple(int(t) for t in prefix)
        hist = tuple(self.history) + pre
        n = self.params.repeat_last_n
        return S.RowCtx(hist[-n:] if n > 0 else (), self.key, self.n_sampled + len(pre),
                        self.n_vocab, self.grammar, pre)

    @property
    def sig(self) -> tuple:
        """The chain's structure (what a graph depends on), cached per ``stages`` tuple."""
        if self._sig_of is not self.stages:
            self._sig = tuple(s.signature() for s in self.stages)
            self._sig_of = self.stages
        return self._sig

    def signature(self) -> tuple:
        return self.sig

    def sample(self, logits: np.ndarray, prefix: Sequence[int] = ()) -> int:
        return sample_host(self, logits, prefix)


@dataclass(frozen=True)
class RowInput:
    """One output row of the graph: its sequence's chain and the tokens between the chain's
    accepted state and this row's token (the drafts before it in a verify batch)."""

    chain: SamplerChain
    prefix: tuple[int, ...] = ()
