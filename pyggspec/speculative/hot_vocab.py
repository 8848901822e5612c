"""The draft head's hot vocabulary: which token ids a draft is scored over.

A draft step is mostly the LM head (248k rows on Qwen3.5) and a draft is only a guess, so
scoring it over the ids text actually uses loses only drafts whose token lies outside (as
FR-Spec, Zhao et al. 2025). The set is learnt from the prompts and outputs this engine sees,
seeded with the lowest ids, and used only while it holds the emitted text (measured
coverage: docs/speculation.md, "Cheap drafts"). Pure state (numpy);
:class:`pyggspec.models.mtp.Mtp` owns the device copy of the chosen rows.
"""

from __future__ import annotations

import numpy as np

MIN_COVERAGE = 0.97  # below: draft over the whole vocabulary
COVERAGE_WINDOW = 256  # emitted tokens the coverage average spans (about)
REFRESH_MISSES = 64  # tokens outside the set seen before the set is chosen again
REFRESH_MIN_TOKENS = 1024  # and at least this many tokens since the last choice
MAX_SHARE = 0.02  # the subset's rows may cost at most this share of the weights' bytes
MIN_ROWS = 4096  # a smaller set would miss too much text to pay
MAX_ROWS = 32768
SHORT = 8  # token lists up to this long are counted in plain Python


def hot_rows(n_vocab: int, row_bytes: int, weight_bytes: int, asked: int | None) -> int:
    """Rows of the hot set: ``asked`` (rounded down to a multiple of 256), or by default the
    most that cost at most :data:`MAX_SHARE` of the weights with their tables, capped at :data:`MAX_ROWS`;
    0 (no hot set) when that is under :data:`MIN_ROWS` or not under half the vocabulary."""
    if asked is not None:
        k = asked // 256 * 256
        return k if 0 < k < n_vocab else 0
    room = int(MAX_SHARE * weight_bytes) - 4 * n_vocab  # less the ids' inverse table
    k = min(MAX_ROWS, room // max(row_bytes, 1)) // 256 * 256
    return k if MIN_ROWS <= k <= n_vocab // 2 else 0


class HotVocab:
    """Token counts, the chosen set, and how much of the emitted text it holds."""

    def __init__(self, n_vocab: int, size: int) -> None:
        self.n_vocab = n_vocab
        self.size = size
        self.counts = np.zeros(n_vocab, np.int64)
        self.ids = np.arange(size, dtype=np.int32)  # sorted
        self.member = np.zeros(n_vocab, bool)
        self.member[:size] = True
        self.coverage = 1.0  # running share of emitted tokens inside the set
        self.misses = 0  # tokens seen outside the set since the last choice
        self.seen = 0  # tokens seen since the last choice
        self.n_choices = 0  # sets chosen after the seed
        self.n_emitted = 0
        self.n_emitted_in = 0

    @property
    def active(self) -> bool:
        """Drafts use the set (else the whole head)."""
        return self.coverage >= MIN_COVERAGE

    def observe(self, tokens, emitted: bool) -> bool:
        """Count ``tokens`` (a prompt's, or ``emitted`` by the target); True when the set
        should be chosen again (:meth:`choose`)."""
        if len(tokens) <= SHORT:
            # a decode step's few tokens in plain Python: numpy's per-call overhead (array,
            # mask, ``add.at``) was most of a declined step's host time beyond plain decoding's
            hits = []
            for t in tokens:
                t = int(t)
                if 0 <= t < self.n_vocab:
                    self.counts[t] += 1
                    hits.append(bool(self.member[t]))
            return self._tally(hits, sum(hits), emitted)
        t = np.asarray(tokens, np.int64).reshape(-1)
        t = t[(t >= 0) & (t < self.n_vocab)]
        np.add.at(self.counts, t, 1)
        hits = self.member[t]
        return self._tally(hits, int(hits.sum()), emitted)

    def _tally(self, hits, n_in: int, emitted: bool) -> bool:
        """The coverage average, misses and counts after tokens whose membership is
        ``hits`` (``n_in`` of them inside the set)."""
        n = len(hits)
        if emitted:
            a = 1.0 / COVERAGE_WINDOW
            for h in hits:
                self.coverage += a * (float(h) - self.coverage)
            self.n_emitted += n
            self.n_emitted_in += n_in
        self.misses += n - n_in
        self.seen += n
        return self.misses >= REFRESH_MISSES and self.seen >= REFRESH_MIN_TOKENS

    def choose(self) -> np.ndarray:
        """The ``size`` most counted ids (ties: the current members, then the lower id),
        sorted; becomes the set."""
        score = self.counts * 2 + self.member
        top = np.argpartition(-score, self.size - 1)[:self.size]
        # argpartition splits ties at the boundary arbitrarily: settle them by id
        cut = score[top].min()
        keep = top[score[top] > cut]
        tied = np.flatnonzero(score == cut)[:self.size - len(keep)]
        ids = np.sort(np.concatenate([keep, tied])).astype(np.int32)
        self.ids = ids
        self.member[:] = False
        self.member[ids] = True
        self.misses = self.seen = 0
        self.coverage = 1.0  # the new set is judged afresh (a few misses put it off again)
        self.n_choices += 1
        return ids

    def to_dict(self) -> dict:
        return {"size": self.size, "active": self.active, "coverage": round(self.coverage, 4),
                "emitted_in_set": (round(self.n_emitted_in / self.n_emitted, 4)
                                   if self.n_emitted else None),
                "choices": self.n_choices}
