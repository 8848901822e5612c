"""The drafter interface: all the worker and the verify path know of how drafts are made.

A drafter guesses the next tokens of a sequence; the target verifies them, so a guess can
never change the output (speculative/verify.py). llama.cpp's ``common_speculative_impl``
(begin / process / draft / accept) is the model; here the calls are::

    begin(slot, prompt)            a new request in ``slot`` (its whole prompt)
    prompt(parts)                  prompt chunks the target evaluated, with its hidden rows
    draft(items, history, chains)  up to ``item.cap`` drafts for each sequence asked
    accepted(slot, draft, n, out)  how the target answered the draft this drafter made
    committed(slot, tokens, h)     tokens the target committed (every step, every drafter)
    forget(slot) / state / restore the slot's own state (checkpoints, slot copies)
    counters()                     its own counts, for ``--json`` and ``/metrics``

A new kind is one module with a :class:`Drafter` subclass, a line in :data:`KINDS` and a
branch in ``assemble._make_drafters`` (speculative/ngram_simple.py is the worked example).
:class:`Drafters` runs several kinds as llama.cpp's ``--spec-type a,b`` does: in a fixed
order of preference, the first kind that proposes a draft for a sequence wins its step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --spec-type names, in llama.cpp's order of preference (common_speculative_init): the
# cheap host-side n-gram lookups first, the MTP head for the sequences they leave
KINDS = ("ngram-simple", "ngram-mod", "draft-mtp")


@dataclass
class DraftItem:
    """One sequence asking for drafts: its pending (sampled, not yet verified) token, the
    most drafts it may verify this step, and its end-of-output test."""

    slot: int
    pending: int
    cap: int
    is_stop: Callable[[int], bool] | None = None


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    first: tuple[int, int] | None = None  # MTP: coupled draw and argmax of the first draft
    q: list = field(default_factory=list)  # probabilistic drafts: q (ids, probs) per draft
    kind: str = ""  # the drafter that made it


class Drafter:
    """One kind of drafter (see the module docstring). The defaults suit a kind that keeps
    nothing per slot beyond what it can rebuild from the history: subclass it and write
    ``draft`` (and ``accepted`` if it learns from outcomes)."""

    name: str = ""
    needs_hidden = False  # the target's hidden rows must come back with committed tokens

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        """A new request in ``slot``."""

    def prompt(self, parts: list[tuple[int, int, list[int], np.ndarray]]) -> None:
        """Prompt chunks (slot, first position, tokens, the target's hidden rows)."""

    def draft(self, items: list[DraftItem], history: Callable[[int], Sequence[int]],
              chains: Mapping | None = None) -> dict[int, Draft]:
        raise NotImplementedError

    def accepted(self, slot: int, draft: Draft, n: int, emitted: Sequence[int]) -> None:
        """The target accepted ``n`` of this kind's ``draft`` and emitted ``emitted``."""

    def committed(self, slot: int, tokens: list[int], hidden: np.ndarray | None) -> None:
        """Tokens the target committed in ``slot`` (with their hidden rows if needed)."""

    def forget(self, slot: int) -> None:
        """The slot's history is gone (cleared, or replaced)."""

    def state(self, slot: int) -> Any:
        return ()  # what a checkpoint keeps (None would mean "unknown")

    def restore(self, slot: int, state: Any) -> None:
        """A checkpoint's ``state`` comes back."""

    def counters(self) -> dict:
        return {}


class Drafters:
    """Several kinds behind the one interface, in :data:`KINDS` order: each step the first
    kind whose proposal for a sequence is not empty drafts it (llama.cpp's rule); the
    sequence's outcome goes back to that kind, committed tokens to all. ``caps`` per kind
    (the draft-length rule's lengths) bound each kind's drafts; a kind given 0 is not
    asked. The slots' saved states are the MTP head's carry-over (``mtp``): the n-gram
    kinds keep nothing a checkpoint needs."""

    def __init__(self, kinds: Sequence[Drafter]) -> None:
        order = {k: i for i, k in enumerate(KINDS)}
        self.kinds = sorted(kinds, key=lambda d: order.get(d.name, len(order)))
        self.names = tuple(d.name for d in self.kinds)
        self.by_name = {d.name: d for d in self.kinds}
        self.mtp = self.by_name.get("draft-mtp")
        self.needs_hidden = any(d.needs_hidden for d in self.kinds)
        self._wins: dict[str, int] = dict.fromkeys(self.names, 0)

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        for d in self.kinds:
            d.begin(slot, prompt)

    def prompt(self, parts: list[tuple[int, int, list[int], np.ndarray]]) -> None:
        for d in self.kinds:
            d.prompt(parts)

    def draft(self, items: list[DraftItem], history: Callable[[int], Sequence[int]],
              chains: Mapping | None, caps: Mapping[str, int]) -> dict[int, Draft]:
        out: dict[int, Draft] = {}
        left = items
        for d in self.kinds:
            k = caps.get(d.name, 0)
            ask = [DraftItem(it.slot, it.pending, min(it.cap, k), it.is_stop)
                   for it in left if min(it.cap, k) > 0]
            if not ask:
                continue
            for slot, dr in d.draft(ask, history, chains).items():
                if dr.tokens:
                    dr.kind = d.name
                    out[slot] = dr
                    self._wins[d.name] += 1
            left = [it for it in left if it.slot not in out]
        return out

    def accepted(self, slot: int, draft: Draft, n: int, emitted: Sequence[int]) -> None:
        d = self.by_name.get(draft.kind)
        if d is not None:
            d.accepted(slot, draft, n, emitted)

    def committed(self, slot: int, tokens: list[int], hidden: np.ndarray | None) -> None:
        for d in self.kinds:
            d.committed(slot, tokens, hidden)

    def forget(self, slot: int) -> None:
        for d in self.kinds:
            d.forget(slot)

    def counters(self) -> dict:
        return {d.name: {"drafts": self._wins[d.name], **d.counters()} for d in self.kinds}
