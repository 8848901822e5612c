"""Gated-delta-net state per sequence slot: the conv window and the SSM matrix (f32).

Each GDN layer has ``conv [n_embd_r, n_rows]`` and ``ssm [n_embd_s, n_rows]``. Every slot
owns ``n_planes`` rows; one of them, ``current[slot]``, is the sequence's state. A graph
gathers the current rows of its ubatch with ``get_rows`` and writes new states with
``set_rows`` into rows the engine chooses, so graphs do not depend on which slots or
planes a batch uses.

Speculative rollback with snapshots keeps no planes: the rows after the slots' own are an
**arena** where the verify graph's ``gated_delta_net`` writes the state after each of its
tokens (its output tensor is placed there, :func:`arena_layout`), and the conv window
after each token goes next to it. Once acceptance is known the slot's current row simply
*becomes* the arena row of its accepted token (:meth:`RecurrentState.point`): nothing is
copied. Copying it into the slot's own row cost 10-14 ms of a ~280 ms 4 x 4 verify step on
the bench CPU (docs/benchmarks.md row 74); writing every snapshot into planes, three
times the bytes. A slot whose state sits in the arena is copied out to its own row only
when a verify graph runs without it (:meth:`RecurrentState.evacuate`): the next verify
graph overwrites the arena. Checkpoint rollback uses two planes: the verify step writes
its final state to the spare plane and the old state stays intact until the step is
accepted (else the accepted tokens are evaluated again).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

import numpy as np

from pyggspec.ggml.device import Device
from pyggspec.ggml.tensor import Tensor, copy_ranges, tensor_address
from pyggspec.memory._alloc import LayerMemory, LayerTensors


def arena_layout(n_slots: int, n_planes: int, arena_rows: int, d_inner: int,
                 n_embd_s: int) -> tuple[int, int]:
    """(rows of each state tensor, first arena row). The verify graph's ``gated_delta_net``
    output holds the attention output of its tokens (``d_inner`` floats each) and then the
    states after them; placed so that the states land on the arena rows, the outputs take
    the pad rows just before them (one for up to ``n_embd_s / d_inner`` = 128 tokens on
    Qwen3.5)."""
    own = n_slots * n_planes
    if arena_rows <= 0:
        return own, own
    pad = -(-arena_rows * d_inner // n_embd_s)
    return own + pad + arena_rows, own + pad


@dataclass(frozen=True)
class SlotSnapshot:
    """A host copy of one slot's current recurrent state (every GDN layer)."""

    slot: int
    data: dict[tuple[str, int], bytes]


class RecurrentState(LayerMemory):
    def __init__(self, layer_devices: dict[int, Device], n_embd_r: int, n_embd_s: int,
                 n_slots: int, n_planes: int = 1, label: str = "recurrent",
                 arena_rows: int = 0, d_inner: int = 0) -> None:
        """``arena_rows``: states after verify tokens kept in place (snapshot rollback: the
        most rows of a verify batch), ``d_inner`` the op's output floats per token."""
        if n_planes < 1:
            raise ValueError("n_planes must be >= 1")
        if arena_rows and d_inner <= 0:
            raise ValueError("an arena needs the op's output width (d_inner)")
        self.n_embd_r = n_embd_r
        self.n_embd_s = n_embd_s
        self.n_slots = n_slots
        self.n_planes = n_planes
        self.layers = sorted(layer_devices)
        self.current = np.zeros(n_slots, dtype=np.int64)
        self.n_rows, self.arena_base = arena_layout(n_slots, n_planes, arena_rows, d_inner,
                                                    n_embd_s)
        self.arena_rows = arena_rows
        # per slot: the arena row holding its state (-1: its own current plane)
        self.arena = np.full(n_slots, -1, dtype=np.int64)
        n_rows = self.n_rows

        def make(ctx, kind, il):
            n = n_embd_r if kind == "conv" else n_embd_s
            return ctx.new_tensor("f32", (n, n_rows), f"cache_{kind}_l{il}")

        self._mem = LayerTensors(label, layer_devices, ["conv", "ssm"], make)
        self._addr: tuple[np.ndarray, np.ndarray] | None = None  # (tensors, row bytes)

    def conv(self, il: int) -> Tensor:
        return self._mem.get("conv", il)

    def ssm(self, il: int) -> Tensor:
        return self._mem.get("ssm", il)

    # --- row bookkeeping ---------------------------------------------------------------
    def row(self, slot: int, plane: int | None = None) -> int:
        """Row index of ``slot``'s ``plane`` (default: its current state, which may be an
        arena row)."""
        if plane is None:
            a = int(self.arena[slot])
            if a >= 0:
                return a
            plane = int(self.current[slot])
        return slot * self.n_planes + plane

    # --- the arena (snapshot rollback) ---------------------------------------------------
    def point(self, slot: int, row: int) -> None:
        """``slot``'s state is now arena row ``row`` (a verify graph wrote it there)."""
        if not self.arena_base <= row < self.arena_base + self.arena_rows:
            raise ValueError(f"row {row} is not an arena row")
        self.arena[slot] = row

    def in_arena(self, slot: int) -> bool:
        return bool(self.arena[slot] >= 0)

    def evacuate(self, slots: Iterable[int]) -> None:
        """Copy the arena-held states of ``slots`` into their own rows (one C call for all
        layers and slots): before a verify graph that does not read them overwrites the
        arena."""
        slots = [s for s in slots if self.arena[s] >= 0]
        if not slots:
            return
        if self._addr is None:
            t = [self.conv(il) for il in self.layers] + [self.ssm(il) for il in self.layers]
            self._addr = (np.array([tensor_address(x) for x in t], np.int64),
                          np.array([x.nb[1] for x in t], np.int64))
        addr, nb = self._addr
        src = np.array([self.arena[s] for s in slots], np.int64)
        dst = np.array([s * self.n_planes + self.current[s] for s in slots], np.int64)
        P = len(slots)
        copy_ranges(np.repeat(addr, P), (nb[:, None] * src[None, :]).ravel(),
                    np.repeat(addr, P), (nb[:, None] * dst[None, :]).ravel(), np.repeat(nb, P))
        self.arena[slots] = -1

    def evacuate_except(self, slots: Container[int]) -> None:
        """:meth:`evacuate` every arena-held slot not in ``slots`` (a verify batch's)."""
        held = np.flatnonzero(self.arena >= 0)
        if held.size:
            self.evacuate([int(s) for s in held if int(s) not in slots])

    def spare_planes(self, slot: int) -> list[int]:
        """The planes of ``slot`` that do not hold its current state."""
        cur = int(self.current[slot])
        return [p for p in range(self.n_planes) if p != cur]

    def set_current(self, slot: int, plane: int) -> None:
        if not 0 <= plane < self.n_planes:
            raise ValueError(f"plane {plane} outside 0..{self.n_planes - 1}")
        self.current[slot] = plane
        self.arena[slot] = -1

    def layout(self) -> dict[str, object]:
        """What a saved slot's state must match to be written here (layers and widths)."""
        return {"layers": list(self.layers), "n_embd_r": self.n_embd_r,
                "n_embd_s": self.n_embd_s}

    def row_sizes(self) -> dict[tuple[str, int], int]:
        """Bytes of one slot's row per ("conv" | "ssm", layer): a snapshot's entry sizes."""
        return {(k, il): nb for k, il, _, nb, _ in self._rows(0)}

    # --- sequence operations ------------------------------------------------------------
    def _rows(self, slot: int):
        r = self.row(slot)
        for il in self.layers:
            for kind, t in (("conv", self.conv(il)), ("ssm", self.ssm(il))):
                yield kind, il, t, t.nb[1], r

    def clear(self, slot: int) -> None:
        """A fresh sequence starts from zero state (in plane 0)."""
        self.current[slot] = 0
        self.arena[slot] = -1
        for _, _, t, nb, r in self._rows(slot):
            t.zero(r * nb, nb)

    def snapshot(self, slot: int) -> SlotSnapshot:
        """Host copy of the current state of ``slot`` (for save/restore across requests)."""
        return SlotSnapshot(slot, {(k, il): bytes(t.read_bytes(r * nb, nb))
                                   for k, il, t, nb, r in self._rows(slot)})

    def restore(self, snap: SlotSnapshot, slot: int | None = None) -> None:
        slot = snap.slot if slot is None else slot
        self.arena[slot] = -1  # written into its own row
        for k, il, t, nb, r in self._rows(slot):
            t.set(snap.data[(k, il)], r * nb)

    def copy(self, src: int, dst: int) -> None:
        self.restore(self.snapshot(src), dst)
