"""Gated-delta-net state per sequence slot: the conv window and the SSM matrix (f32).

Each GDN layer has ``conv [n_embd_r, n_slots * n_planes]`` and
``ssm [n_embd_s, n_slots * n_planes]``. Every slot owns ``n_planes`` rows; one of them,
``current[slot]``, is the sequence's state. A graph gathers the current rows of its
ubatch with ``get_rows`` and writes new states with ``set_rows`` into rows the engine
chooses, so graphs do not depend on which slots or planes a batch uses.

Speculative rollback needs no planes with snapshots: the verify graph keeps the state
after each of its tokens (``gated_delta_net``'s snapshots, in the compute buffer) and the
one after the accepted tokens is copied into the slot's row
(:meth:`~pyggspec.models.qwen35.Target.keep_states`) -- one copy per layer, where writing
every snapshot into planes of its own moved T times the bytes. Checkpoint rollback uses
two planes: the verify step writes its final state to the spare plane and the old state
stays intact until the step is accepted (else the accepted tokens are evaluated again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyggspec.ggml.device import Device
from pyggspec.ggml.tensor import Tensor
from pyggspec.memory._alloc import LayerMemory, LayerTensors


@dataclass(frozen=True)
class SlotSnapshot:
    """A host copy of one slot's current recurrent state (every GDN layer)."""

    slot: int
    data: dict[tuple[str, int], bytes]


class RecurrentState(LayerMemory):
    def __init__(self, layer_devices: dict[int, Device], n_embd_r: int, n_embd_s: int,
                 n_slots: int, n_planes: int = 1, label: str = "recurrent") -> None:
        if n_planes < 1:
            raise ValueError("n_planes must be >= 1")
        self.n_embd_r = n_embd_r
        self.n_embd_s = n_embd_s
        self.n_slots = n_slots
        self.n_planes = n_planes
        self.layers = sorted(layer_devices)
        self.current = np.zeros(n_slots, dtype=np.int64)

        def make(ctx, kind, il):
            n = n_embd_r if kind == "conv" else n_embd_s
            return ctx.new_tensor("f32", (n, n_slots * n_planes), f"cache_{kind}_l{il}")

        self._mem = LayerTensors(label, layer_devices, ["conv", "ssm"], make)

    def conv(self, il: int) -> Tensor:
        return self._mem.get("conv", il)

    def ssm(self, il: int) -> Tensor:
        return self._mem.get("ssm", il)

    # --- row bookkeeping ---------------------------------------------------------------
    def row(self, slot: int, plane: int | None = None) -> int:
        """Row index of ``slot``'s ``plane`` (default: its current plane)."""
        p = int(self.current[slot]) if plane is None else plane
        return slot * self.n_planes + p

    def spare_planes(self, slot: int) -> list[int]:
        """The planes of ``slot`` that do not hold its current state."""
        cur = int(self.current[slot])
        return [p for p in range(self.n_planes) if p != cur]

    def set_current(self, slot: int, plane: int) -> None:
        if not 0 <= plane < self.n_planes:
            raise ValueError(f"plane {plane} outside 0..{self.n_planes - 1}")
        self.current[slot] = plane

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
        for _, _, t, nb, r in self._rows(slot):
            t.zero(r * nb, nb)

    def snapshot(self, slot: int) -> SlotSnapshot:
        """Host copy of the current state of ``slot`` (for save/restore across requests)."""
        return SlotSnapshot(slot, {(k, il): bytes(t.read_bytes(r * nb, nb))
                                   for k, il, t, nb, r in self._rows(slot)})

    def restore(self, snap: SlotSnapshot, slot: int | None = None) -> None:
        slot = snap.slot if slot is None else slot
        for k, il, t, nb, r in self._rows(slot):
            t.set(snap.data[(k, il)], r * nb)

    def copy(self, src: int, dst: int) -> None:
        self.restore(self.snapshot(src), dst)
