"""``--spec-type ngram-simple``: draft what followed the last occurrence of the current n-gram.

llama.cpp's ``common_ngram_simple_draft`` (common/ngram-map.cpp of the llama.cpp we build
on), token for token: the pattern is the last ``size_n - 1`` committed tokens and the
pending one; it is searched backwards through the history (the current position skipped,
position 0 never a match), and the draft is up to ``size_m`` tokens that followed the match
-- none when fewer than ``size_n`` could be copied, or the history is not longer than
``size_n + size_m + 1``. ``min_hits`` is accepted and unused, as in llama.cpp.

The drafter keeps nothing but a numpy copy of each slot's history (extended as it grows),
so a lookup is one vectorised comparison, not a Python loop over the context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pyggspec.speculative.drafter import Draft, Drafter, DraftItem


def simple_draft(tokens: np.ndarray, pending: int, size_n: int, size_m: int) -> list[int]:
    """llama.cpp's ngram-simple proposal after history ``tokens`` (int32) and ``pending``."""
    cur = len(tokens)
    if cur <= size_n + size_m + 1:
        return []
    pattern = np.append(tokens[cur - size_n + 1:], np.int32(pending))
    # starts j = 1 .. cur - size_n - 1 (llama.cpp's backward loop, j > 0) where the
    # pattern's first token is, then their whole windows (~15x less work on long texts)
    cand = np.flatnonzero(tokens[1: cur - size_n] == pattern[0]) + 1
    if not len(cand):
        return []
    windows = sliding_window_view(tokens[: cur - 1], size_n)[cand]
    hits = cand[(windows == pattern).all(axis=1)]
    if not len(hits):
        return []
    match = int(hits[-1])  # the last one: the first the backward search meets
    n = min(size_m, cur - (match + size_n))
    if n < size_n:
        return []
    return tokens[match + size_n: match + size_n + n].tolist()


class NgramSimple(Drafter):
    """The ngram-simple drafter (see the module docstring)."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1) -> None:
        self.size_n, self.size_m, self.min_hits = size_n, size_m, min_hits
        self._hist: dict[int, np.ndarray] = {}  # per slot: the history as int32, grown
        self._len: dict[int, int] = {}
        self.n_lookups = 0
        self.n_proposals = 0

    def _history(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """``tokens`` as int32, appending to the cached copy when the history grew with its
        last cached tokens unchanged (a request's steps); rebuilt otherwise. A new request
        in the slot clears the copy (:meth:`begin`)."""
        have, n = self._hist.get(slot), self._len.get(slot, 0)
        if (have is None or n > len(tokens)
                or any(have[i] != tokens[i] for i in range(max(0, n - 4), n))):
            have, n = np.zeros(max(256, 2 * len(tokens)), np.int32), 0
        if len(tokens) > len(have):
            have = np.concatenate([have[:n], np.zeros(len(tokens), np.int32)])
        have[n: len(tokens)] = tokens[n:]
        self._hist[slot], self._len[slot] = have, len(tokens)
        return have[: len(tokens)]

    def draft(self, items: list[DraftItem], history: Callable[[int], Sequence[int]],
              chains: Mapping | None = None) -> dict[int, Draft]:
        out = {}
        for it in items:
            self.n_lookups += 1
            toks = simple_draft(self._history(it.slot, history(it.slot)), it.pending,
                                self.size_n, self.size_m)[: it.cap]
            if it.is_stop is not None:
                for i, t in enumerate(toks):
                    if it.is_stop(t):
                        del toks[i + 1:]
                        break
            if toks:
                self.n_proposals += 1
                out[it.slot] = Draft(toks, [1.0] * len(toks))
        return out

    def forget(self, slot: int) -> None:
        self._hist.pop(slot, None)
        self._len.pop(slot, None)

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        self.forget(slot)  # a new request: its history is not the cached one

    def counters(self) -> dict:
        return {"lookups": self.n_lookups, "proposals": self.n_proposals}
