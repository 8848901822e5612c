"""``--spec-type ngram-mod``: a table of every n-gram seen -> the token after it, shared by
all slots; a draft is the chain of look-ups from the current n-gram.

llama.cpp's ``common_speculative_impl_ngram_mod`` (common/speculative.cpp, ngram-mod.cpp of
the llama.cpp we build on): ``begin`` adds the prompt's n-grams, a draft adds the history's
new ones in chunks of more than 32 tokens, looks up to ``n_max`` tokens ahead and proposes
nothing with fewer than ``n_min`` hits; the table is reset when it holds a quarter of its
4M entries, and after 5 rounds in a row in which under a quarter of a draft was accepted.
Two differences: the table is a dict keyed by the n-gram (exact, where llama.cpp's hashed
array lets n-grams overwrite each other), and "a quarter of a draft" counts the drafts that
were verified (llama.cpp divides by the untruncated proposal, which with a cap shorter than
``n_min`` would reset on every fifth step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pyggspec.speculative.drafter import Draft, Drafter, DraftItem

TABLE_MAX = 4 * 1024 * 1024 // 4  # llama.cpp's 4M entries at its 0.25 occupancy threshold
LOW_ACCEPT = 0.25  # a round below this share accepted is a low one
LOW_ROUNDS = 5  # low rounds in a row that reset the table


class NgramMod(Drafter):
    """The ngram-mod drafter (see the module docstring)."""

    name = "ngram-mod"

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64) -> None:
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.table: dict[tuple[int, ...], int] = {}
        self._last: dict[int, int] = {}  # per slot: history added up to here (i_last)
        self._low: dict[int, int] = {}  # per slot: low rounds in a row
        self.n_resets = 0
        self.n_proposals = 0

    def _add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """The n-grams starting at ``start .. stop - 1`` (each with the token after it)."""
        n, table = self.n, self.table
        for i in range(start, stop):
            table[tuple(tokens[i: i + n])] = tokens[i + n]

    def _reset(self) -> None:
        """The table emptied (the slots' ``i_last`` stay, as in llama.cpp)."""
        self.table.clear()
        self.n_resets += 1

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        self._last[slot] = 0
        if len(prompt) < self.n:
            return
        self._add(prompt, 0, len(prompt) - self.n)
        self._last[slot] = len(prompt) - self.n
        if len(self.table) > TABLE_MAX:
            self._reset()

    def draft(self, items: list[DraftItem], history: Callable[[int], Sequence[int]],
              chains: Mapping | None = None) -> dict[int, Draft]:
        out, n = {}, self.n
        for it in items:
            toks = history(it.slot)
            cur = len(toks)
            if cur < n:
                continue
            last = self._last.get(it.slot, 0)
            if last > cur - n:  # the slot holds a shorter history now (a new request)
                last = 0
            if last + 32 < cur:
                self._add(toks, last, cur - n)
                self._last[it.slot] = last = cur - n
            key = [*toks[cur - n + 1:], it.pending]
            drafted: list[int] = []
            for _ in range(self.n_max):
                t = self.table.get(tuple(key[len(key) - n:]))
                if t is None:
                    break
                drafted.append(t)
                key.append(t)
            if len(drafted) < self.n_min or not drafted:
                continue
            drafted = drafted[: it.cap]
            if it.is_stop is not None:
                for i, t in enumerate(drafted):
                    if it.is_stop(t):
                        del drafted[i + 1:]
                        break
            self.n_proposals += 1
            out[it.slot] = Draft(drafted, [1.0] * len(drafted))
        return out

    def accepted(self, slot: int, draft: Draft, n: int, emitted: Sequence[int]) -> None:
        """llama.cpp's low-acceptance reset (over the drafts that were verified)."""
        if not draft.tokens:
            return
        if n / len(draft.tokens) < LOW_ACCEPT:
            self._low[slot] = self._low.get(slot, 0) + 1
            if self._low[slot] >= LOW_ROUNDS:
                self._reset()
                self._low[slot] = self._last[slot] = 0
        else:
            self._low[slot] = 0

    def forget(self, slot: int) -> None:
        self._last.pop(slot, None)
        self._low.pop(slot, None)

    def counters(self) -> dict:
        return {"proposals": self.n_proposals, "table": len(self.table),
                "resets": self.n_resets}
