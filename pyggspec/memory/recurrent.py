"""Gated-delta-net state per sequence slot: the conv window and the SSM matrix (f32).

Each GDN layer has ``conv [n_embd_r, n_slots]`` and ``ssm [n_embd_s, n_slots]``; a graph
gathers the rows of its ubatch's slots with ``get_rows`` and writes the new states back
with ``set_rows``, so graphs do not depend on which slots a batch uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyggspec.ggml.device import Device
from pyggspec.ggml.tensor import Tensor
from pyggspec.memory._alloc import LayerTensors


@dataclass(frozen=True)
class SlotSnapshot:
    """A host copy of one slot's recurrent state (every GDN layer), for checkpoints."""

    slot: int
    data: dict[tuple[str, int], bytes]


class RecurrentState:
    def __init__(self, layer_devices: dict[int, Device], n_embd_r: int, n_embd_s: int,
                 n_slots: int, label: str = "recurrent") -> None:
        self.n_embd_r = n_embd_r
        self.n_embd_s = n_embd_s
        self.n_slots = n_slots
        self.layers = sorted(layer_devices)

        def make(ctx, kind, il):
            n = n_embd_r if kind == "conv" else n_embd_s
            return ctx.new_tensor("f32", (n, n_slots), f"cache_{kind}_l{il}")

        self._mem = LayerTensors(label, layer_devices, ["conv", "ssm"], make)

    def conv(self, il: int) -> Tensor:
        return self._mem.get("conv", il)

    def ssm(self, il: int) -> Tensor:
        return self._mem.get("ssm", il)

    def bytes_by_device(self) -> dict[str, int]:
        return self._mem.bytes_by_device()

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_device().values())

    def bytes_per_seq(self) -> int:
        return self.nbytes // max(1, self.n_slots)

    def _rows(self):
        for il in self.layers:
            for kind, t in (("conv", self.conv(il)), ("ssm", self.ssm(il))):
                yield kind, il, t, t.nb[1]

    def clear(self, slot: int) -> None:
        """A fresh sequence starts from zero state."""
        for _, _, t, row in self._rows():
            t.zero(slot * row, row)

    def snapshot(self, slot: int) -> SlotSnapshot:
        return SlotSnapshot(slot, {(k, il): bytes(t.read_bytes(slot * row, row))
                                   for k, il, t, row in self._rows()})

    def restore(self, snap: SlotSnapshot, slot: int | None = None) -> None:
        slot = snap.slot if slot is None else slot
        for k, il, t, row in self._rows():
            t.set(snap.data[(k, il)], slot * row)

    def copy(self, src: int, dst: int) -> None:
        self.restore(self.snapshot(src), dst)

    def close(self) -> None:
        self._mem.close()
