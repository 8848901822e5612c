"""Attention KV cache: per layer, ``n_ctx`` cells per sequence slot, slots interleaved.

The key/value of position ``p`` of slot ``s`` is cache row ``p * n_slots + s``, so the first
``n`` positions of every slot are one contiguous block: a decode step attends over that
block as a view whatever slots its sequences use (the mask hides the other slots' cells),
and graphs never depend on which slots are live. A sequence's positions are always
``0..length-1`` with no holes, so removing a tail is just lowering its length -- which
:class:`~pyggspec.memory.slots.SlotMemory` owns (graphs never read it).
"""

from __future__ import annotations

import numpy as np

from pyggspec.config import check_kv_type
from pyggspec.ggml.device import Device
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.ggml.tensor import Tensor
from pyggspec.memory._alloc import LayerMemory, LayerTensors


class KVCache(LayerMemory):
    """K and V tensors of ``n_ctx * n_slots`` rows for each attention layer (declared
    ``[n_embd_kv, n_ctx, n_slots]``; row ``p * n_slots + s``, see the module docstring)."""

    def __init__(self, layer_devices: dict[int, Device], n_embd_k: int, n_embd_v: int,
                 n_ctx: int, n_slots: int, type_k: str = "f16", type_v: str = "f16",
                 label: str = "kv") -> None:
        for t, flag in ((type_k, "-ctk"), (type_v, "-ctv")):
            check_kv_type(flag, t)
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self.type_k = GGMLType.parse(type_k)
        self.type_v = GGMLType.parse(type_v)
        self.n_embd_k = n_embd_k
        self.n_embd_v = n_embd_v
        self.layers = sorted(layer_devices)

        def make(ctx, kind, il):
            t = self.type_k if kind == "k" else self.type_v
            n = n_embd_k if kind == "k" else n_embd_v
            return ctx.new_tensor(t, (n, n_ctx, n_slots), f"cache_{kind}_l{il}")

        self._mem = LayerTensors(label, layer_devices, ["k", "v"], make)

    def k(self, il: int) -> Tensor:
        return self._mem.get("k", il)

    def v(self, il: int) -> Tensor:
        return self._mem.get("v", il)

    # --- sequence operations --------------------------------------------------------
    def row(self, slot: int, pos: int) -> int:
        """Cache row of position ``pos`` of ``slot``."""
        return pos * self.n_slots + slot

    def cells(self, t: Tensor, slot: int, n: int) -> np.ndarray:
        """Bytes of positions ``0..n-1`` of ``slot`` in cache tensor ``t`` (k or v of a
        layer), one row each: [n, row_bytes] uint8."""
        row = t.nb[1]
        block = np.frombuffer(t.read_bytes(0, n * self.n_slots * row), np.uint8)
        return block.reshape(n, self.n_slots, row)[:, slot].copy()

    def layout(self) -> dict[str, object]:
        """What a saved slot's rows must match to be written here (layers, widths, types)."""
        return {"layers": list(self.layers), "n_embd_k": self.n_embd_k,
                "n_embd_v": self.n_embd_v, "type_k": self.type_k.lower,
                "type_v": self.type_v.lower}

    def tensors(self):
        """``(kind, il, tensor)`` for every cache tensor ("k"/"v" of each layer)."""
        for il in self.layers:
            yield "k", il, self.k(il)
            yield "v", il, self.v(il)

    def set_cells(self, t: Tensor, slot: int, rows: np.ndarray) -> None:
        """Write ``rows`` ([n, row_bytes] uint8, as :meth:`cells` reads them) into positions
        ``0..n-1`` of ``slot`` in cache tensor ``t``. The slots' rows interleave, so this
        reads the block of the first n positions, patches one slot's column and writes the
        block back (two transfers instead of one per row)."""
        n, row, S = rows.shape[0], t.nb[1], self.n_slots
        if rows.shape != (n, row) or n > self.n_ctx:
            raise ValueError(f"rows of shape {rows.shape} for {n} cells of {row} bytes")
        if n == 0:
            return
        block = np.frombuffer(t.read_bytes(0, n * S * row), np.uint8).copy()
        block.reshape(n, S, row)[:, slot] = rows
        t.set(memoryview(block), 0)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make positions ``0..n-1`` of ``dst`` a copy of ``src``'s."""
        for il in self.layers:
            for t in (self.k(il), self.v(il)):
                row, S = t.nb[1], self.n_slots
                block = np.frombuffer(t.read_bytes(0, n * S * row), np.uint8).copy()
                b3 = block.reshape(n, S, row)
                b3[:, dst] = b3[:, src]
                t.set(memoryview(block), 0)
