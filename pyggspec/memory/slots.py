"""What each sequence slot's caches hold: the ONE writer of cache lengths, recurrent planes,
the record of cached tokens and the slot's prompt checkpoints.

Graphs never read a length (masks and cache rows come from positions), so a length is
bookkeeping: how many positions of the slot are committed, what a new request may reuse,
how far a context check counts. Every change goes through one method here:

* :meth:`commit` after the target evaluated tokens (a prompt chunk, a plain step, the
  accepted part of a verify): the tokens join the record, the KV length follows, and the
  recurrent state's current plane becomes the one holding the state after them;
* :meth:`commit_mtp` after the MTP head wrote pairs (its drafts past them are scratch);
* :meth:`truncate` to forget a tail (prompt reuse), :meth:`restore` to go back to a
  checkpoint, :meth:`clear`, :meth:`copy`.

Checkpoints (llama.cpp's ``--ctx-checkpoints``) are host copies of a slot's recurrent
state at a prompt position: the attention KV can lose any tail, the recurrent state cannot,
so a new prompt sharing a shorter prefix resumes from one. Each keeps the drafter's carry
at that position (opaque here), so the MTP head resumes from the same place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pyggspec.memory.kv import KVCache
from pyggspec.memory.recurrent import RecurrentState, SlotSnapshot


@dataclass
class Checkpoint:
    """The slot's recurrent state after ``pos`` tokens, and the drafter's carry there
    (None: the MTP cache was not kept up to date)."""

    pos: int
    state: SlotSnapshot
    carry: object | None
    nbytes: int


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)  # committed: KV cells + recurrent state
    checkpoints: list[Checkpoint] = field(default_factory=list)


class SlotMemory:
    """The target's KV cache and recurrent state and the MTP head's KV cache, per slot."""

    def __init__(self, kv: KVCache, rs: RecurrentState, mtp_kv: KVCache | None = None) -> None:
        self.kv = kv
        self.rs = rs
        self.mtp_kv = mtp_kv
        self.n_slots = kv.n_slots
        self._slots = [_Slot() for _ in range(self.n_slots)]
        self._mtp_len = np.zeros(self.n_slots, np.int64)

    # --- reading ------------------------------------------------------------------------
    def length(self, slot: int) -> int:
        """Committed target positions of ``slot`` (0..length-1)."""
        return len(self._slots[slot].tokens)

    def tokens(self, slot: int) -> list[int]:
        """The committed tokens (read-only view: do not modify)."""
        return self._slots[slot].tokens

    def mtp_length(self, slot: int) -> int:
        return int(self._mtp_len[slot])

    def checkpoints(self, slot: int) -> list[Checkpoint]:
        return self._slots[slot].checkpoints

    def checkpoint_bytes(self, slot: int | None = None) -> int:
        slots = range(self.n_slots) if slot is None else (slot,)
        return sum(c.nbytes for s in slots for c in self._slots[s].checkpoints)

    def state_row(self, slot: int, plane: int | None = None) -> int:
        """Recurrent-state row of ``slot``'s ``plane`` (default: its current one)."""
        return self.rs.row(slot, plane)

    def spare_planes(self, slot: int) -> list[int]:
        """Planes a verify may write the states after its tokens into."""
        return self.rs.spare_planes(slot)

    # --- writing -------------------------------------------------------------------------
    def commit(self, slot: int, tokens: Sequence[int], plane: int | None = None) -> None:
        """The target evaluated ``tokens`` after the committed ones; ``plane``: the plane
        now holding the state after them (None: written in place, the current one)."""
        toks = self._slots[slot].tokens
        if isinstance(tokens, (list, tuple)):  # the step paths: Python ints already
            toks.extend(tokens)
        else:  # an array row (prompt chunks, Engine.decode)
            toks.extend(int(t) for t in tokens)
        if plane is not None:
            self.rs.set_current(slot, plane)

    def commit_mtp(self, slot: int, end: int) -> None:
        """The MTP cache holds pairs ``0..end-1`` of ``slot``."""
        self._mtp_len[slot] = end

    def truncate(self, slot: int, pos: int) -> None:
        """Forget positions >= ``pos`` (attention KV and MTP cache; the recurrent state
        must be at ``pos`` already: a checkpoint restored, or nothing cut)."""
        s = self._slots[slot]
        del s.tokens[pos:]
        s.checkpoints = [c for c in s.checkpoints if c.pos <= pos]
        self._mtp_len[slot] = min(int(self._mtp_len[slot]), pos)

    def restore(self, slot: int, ck: Checkpoint) -> None:
        """Back to checkpoint ``ck``: its recurrent state, and positions up to its own."""
        self.rs.restore(ck.state, slot)
        self.truncate(slot, ck.pos)

    def save_checkpoint(self, slot: int, carry: object | None, keep: int) -> None:
        """Keep a host copy of the current recurrent state at the committed length (the
        newest ``keep`` of them)."""
        s = self._slots[slot]
        pos = len(s.tokens)
        if any(c.pos == pos for c in s.checkpoints):
            return
        snap = self.rs.snapshot(slot)
        s.checkpoints.append(Checkpoint(pos, snap, carry,
                                        sum(len(b) for b in snap.data.values())))
        del s.checkpoints[: max(0, len(s.checkpoints) - keep)]

    def clear(self, slot: int) -> None:
        """An empty slot: no tokens, zero recurrent state, no checkpoints."""
        self._slots[slot] = _Slot()
        self._mtp_len[slot] = 0
        self.rs.clear(slot)

    def copy(self, src: int, dst: int) -> None:
        """Make ``dst`` hold what ``src`` holds (caches, state and record)."""
        n = self.length(src)
        self.kv.copy(src, dst, n)
        self.rs.copy(src, dst)
        if self.mtp_kv is not None:
            self.mtp_kv.copy(src, dst, self.mtp_length(src))
        self._slots[dst] = _Slot(list(self._slots[src].tokens))
        self._mtp_len[dst] = self._mtp_len[src]
