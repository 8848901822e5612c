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
  checkpoint, :meth:`clear`, :meth:`copy`;
* :meth:`import_state` to take a slot's whole state from a slot file
  (:meth:`export_state` writes one; format in :mod:`pyggspec.memory.slotfile`).

Checkpoints (llama.cpp's ``--ctx-checkpoints``) are host copies of a slot's recurrent
state at a prompt position: the attention KV can lose any tail, the recurrent state cannot,
so a new prompt sharing a shorter prefix resumes from one. Each keeps the drafter's carry
at that position (opaque here), so the MTP head resumes from the same place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pyggspec.memory.kv import KVCache
from pyggspec.memory.recurrent import RecurrentState, SlotSnapshot
from pyggspec.memory.slotfile import SlotFile, SlotFileError


@dataclass
class Checkpoint:
    """The slot's recurrent state after ``pos`` tokens, and the drafter's carry there
    (None: the MTP cache was not kept up to date)."""

    pos: int
    state: SlotSnapshot
    carry: object | None
    nbytes: int


class CarryCodec(Protocol):
    """How the owner of the checkpoints' opaque carries (the drafter) writes one into a
    slot file and reads it back: arrays under ``prefix``, a small JSON-able part returned."""

    def encode_carry(self, carry: Any, sf: SlotFile, prefix: str) -> dict[str, Any]: ...

    def decode_carry(self, meta: Mapping[str, Any], sf: SlotFile, prefix: str) -> Any: ...


# identity fields a restore compares, in the order a mismatch is reported
IDENTITY_KEYS = ("arch", "n_vocab", "n_embd", "n_layer", "fingerprint")


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

    def kept_row(self, b: int, j: int, B: int) -> int:
        """The arena row where a verify graph of ``B`` sequences kept sequence ``b``'s
        state after its token ``T - 1 - j`` (snapshot rollback)."""
        return self.rs.arena_base + j * B + b

    def evacuate_except(self, slots: Sequence[int]) -> None:
        """Before a verify graph of ``slots``: every other arena-held state is copied to
        its own row (the graph overwrites the arena; its own sequences' states are read
        before that)."""
        self.rs.evacuate_except(slots)

    # --- writing -------------------------------------------------------------------------
    def commit(self, slot: int, tokens: Sequence[int], plane: int | None = None,
               kept: int | None = None) -> None:
        """The target evaluated ``tokens`` after the committed ones; ``plane``: the plane
        now holding the state after them (None: written in place, the current one);
        ``kept``: the arena row holding it (snapshot rollback, :meth:`kept_row`)."""
        toks = self._slots[slot].tokens
        if isinstance(tokens, (list, tuple)):  # the step paths: Python ints already
            toks.extend(tokens)
        else:  # an array row (prompt chunks, Engine.decode)
            toks.extend(int(t) for t in tokens)
        if plane is not None:
            self.rs.set_current(slot, plane)
        if kept is not None:
            self.rs.point(slot, kept)

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

    # --- slot files ------------------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """The caches a saved state must fit: per part its layers, row widths and types."""
        return {"kv": self.kv.layout(), "recurrent": self.rs.layout(),
                "mtp_kv": self.mtp_kv.layout() if self.mtp_kv is not None else None}

    def export_state(self, slot: int, identity: Mapping[str, Any], carry: Any = None,
                     codec: CarryCodec | None = None) -> SlotFile:
        """Everything ``slot`` holds, as a slot file: its tokens, the KV rows of every
        attention layer, the current recurrent state, the checkpoints, and (with an MTP
        cache) the head's rows and ``carry`` (the drafter's, written by ``codec``).
        ``identity``: the model's (``{"trunk": {...}, "mtp": {...} | None}``), checked by
        :meth:`import_state`."""
        s = self._slots[slot]
        n = len(s.tokens)
        n_mtp = int(self._mtp_len[slot]) if self.mtp_kv is not None else 0
        mtp = self.mtp_kv is not None
        sf = SlotFile({"identity": dict(identity), "layout": self.layout(), "n_tokens": n,
                       "n_mtp": n_mtp})
        sf.add("tokens", np.asarray(s.tokens, np.int32))
        for kind, il, t in self.kv.tensors():
            sf.add(f"kv.{kind}.{il}", self.kv.cells(t, slot, n))
        self._add_state(sf, "rs.", self.rs.snapshot(slot))
        if mtp:
            for kind, il, t in self.mtp_kv.tensors():
                sf.add(f"mtp.{kind}.{il}", self.mtp_kv.cells(t, slot, n_mtp))
        use = mtp and codec is not None
        sf.header["carry"] = (codec.encode_carry(carry, sf, "carry.")
                              if use and carry is not None else None)
        cks = []
        for i, ck in enumerate(s.checkpoints):
            self._add_state(sf, f"ckpt{i}.", ck.state)
            cks.append({"pos": ck.pos, "carry": codec.encode_carry(ck.carry, sf,
                                                                   f"ckpt{i}.carry.")
                        if use and ck.carry is not None else None})
        sf.header["checkpoints"] = cks
        return sf

    @staticmethod
    def _add_state(sf: SlotFile, prefix: str, snap: SlotSnapshot) -> None:
        for (kind, il), b in snap.data.items():
            sf.add(f"{prefix}{kind}.{il}", np.frombuffer(b, np.uint8))

    def import_state(self, slot: int, sf: SlotFile, identity: Mapping[str, Any],
                     codec: CarryCodec | None = None, n_ctx: int | None = None,
                     n_vocab: int | None = None, image_rows: bool = False) -> Any:
        """Make ``slot`` hold the state ``sf`` was saved from; returns the carry the
        drafter resumes with (None: none saved, or this engine does not speculate).

        Everything is checked before the first write: the model (``identity``), the cache
        layout, the token count (at most ``n_ctx``) and ids (below ``n_vocab``), every
        section's shape (``image_rows``: the file's image rows, checked by the caller, are
        ids -1, llama.cpp's LLAMA_TOKEN_NULL). A mismatch raises :class:`SlotFileError` and leaves the slot as it
        was. The MTP part is taken when both the file and this memory have one; a file
        without it leaves the head's cache empty here (a speculative request then
        re-evaluates the prompt)."""
        h = sf.header
        try:
            n, n_mtp = int(h["n_tokens"]), int(h["n_mtp"])
            f_id, f_layout = dict(h["identity"]), dict(h["layout"])
            cks = [(int(c["pos"]), c.get("carry")) for c in h.get("checkpoints", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SlotFileError(None, f"the slot file's header is damaged ({e!r})") from None
        _same("model", f_id.get("trunk") or {}, identity["trunk"], IDENTITY_KEYS)
        for part in ("kv", "recurrent"):
            _same(f"{part} cache", f_layout.get(part) or {}, self.layout()[part])
        mtp = self.mtp_kv is not None and f_layout.get("mtp_kv") is not None
        if mtp:
            _same("MTP head", f_id.get("mtp") or {}, identity.get("mtp") or {}, IDENTITY_KEYS)
            _same("MTP cache", f_layout["mtp_kv"], self.mtp_kv.layout())
        if n_ctx is not None and n > n_ctx:
            raise SlotFileError(None, f"the saved slot holds {n} tokens, more than this "
                                f"server's context of {n_ctx} per slot (-c)")
        tokens = sf.get("tokens")
        if tokens.shape != (n,) or (n and (tokens.min() < -int(image_rows) or (
                n_vocab is not None and tokens.max() >= n_vocab))):
            raise SlotFileError(None, "invalid tokens in the slot file")
        if not 0 <= n_mtp <= n or any(not 0 < p <= n for p, _ in cks):
            raise SlotFileError(None, "the slot file's MTP length or checkpoint positions "
                                "are outside its tokens")
        kv = [(t, _rows(sf, f"kv.{k}.{il}", n, t)) for k, il, t in self.kv.tensors()]
        mkv = ([(t, _rows(sf, f"mtp.{k}.{il}", n_mtp, t)) for k, il, t in self.mtp_kv.tensors()]
               if mtp else [])
        state = self._state(sf, "rs.", slot)
        ck_states = [self._state(sf, f"ckpt{i}.", slot) for i in range(len(cks))]
        use = mtp and codec is not None
        try:
            carry = (codec.decode_carry(h["carry"], sf, "carry.")
                     if use and h.get("carry") is not None else None)
            ck_carries = [codec.decode_carry(c, sf, f"ckpt{i}.carry.")
                          if use and c is not None else None for i, (_, c) in enumerate(cks)]
        except (KeyError, TypeError, ValueError) as e:
            raise SlotFileError(None, f"the slot file's MTP carry-over is damaged "
                                f"({e!r})") from None
        # checked: write
        self.clear(slot)
        for t, rows in kv:
            self.kv.set_cells(t, slot, rows)
        for t, rows in mkv:
            self.mtp_kv.set_cells(t, slot, rows)
        self.rs.restore(state, slot)
        s = self._slots[slot]
        s.tokens = [int(t) for t in tokens]
        s.checkpoints = [Checkpoint(p, st, c, sum(len(b) for b in st.data.values()))
                         for (p, _), st, c in zip(cks, ck_states, ck_carries)]
        self._mtp_len[slot] = n_mtp if mtp else 0
        return carry

    def _state(self, sf: SlotFile, prefix: str, slot: int) -> SlotSnapshot:
        """The recurrent rows under ``prefix``, checked against this state's widths."""
        data = {}
        for (kind, il), nb in self.rs.row_sizes().items():
            a = sf.get(f"{prefix}{kind}.{il}")
            if a.dtype != np.uint8 or a.shape != (nb,):
                raise SlotFileError(None, f"section {prefix}{kind}.{il} has shape {a.shape}, "
                                    f"expected ({nb},)")
            data[(kind, il)] = a.tobytes()
        return SlotSnapshot(slot, data)


def _rows(sf: SlotFile, name: str, n: int, t: Any) -> np.ndarray:
    a = sf.get(name)
    if a.dtype != np.uint8 or a.shape != (n, t.nb[1]):
        raise SlotFileError(None, f"section {name} has shape {a.shape}, expected "
                            f"({n}, {t.nb[1]})")
    return a


def _same(what: str, saved: Mapping[str, Any], here: Mapping[str, Any],
          keys: Sequence[str] | None = None) -> None:
    """Refuse a state saved for another ``what``: the first field that differs, named."""
    for k in keys if keys is not None else sorted(set(saved) | set(here)):
        if saved.get(k) != here.get(k):
            src = f" ({saved['file']})" if saved.get("file") else ""
            raise SlotFileError(None, f"the slot was saved for another {what}{src}: {k} is "
                                f"{saved.get(k)!r} there, {here.get(k)!r} here")
