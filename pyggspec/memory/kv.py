"""Attention KV cache: per layer, one contiguous region of ``n_ctx`` cells per sequence slot.

Cell ``p`` of a slot holds the key/value of the token at position ``p``; a sequence's
positions are always ``0..length-1`` with no holes, so removing a tail is just lowering
``length`` (the attention mask hides everything at or beyond it).
"""

from __future__ import annotations

import numpy as np

from pyggspec.errors import PyggspecError
from pyggspec.ggml.device import Device
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.ggml.tensor import Tensor
from pyggspec.memory._alloc import LayerMemory, LayerTensors

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")


class KVCache(LayerMemory):
    """K and V tensors ``[n_embd_kv, n_ctx, n_slots]`` for each attention layer."""

    def __init__(self, layer_devices: dict[int, Device], n_embd_k: int, n_embd_v: int,
                 n_ctx: int, n_slots: int, type_k: str = "f16", type_v: str = "f16",
                 label: str = "kv") -> None:
        for t, flag in ((type_k, "-ctk"), (type_v, "-ctv")):
            if t.lower() not in KV_TYPES:
                raise PyggspecError(flag, f"unsupported KV cache type {t!r} ({', '.join(KV_TYPES)})")
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self.type_k = GGMLType.parse(type_k)
        self.type_v = GGMLType.parse(type_v)
        self.n_embd_k = n_embd_k
        self.n_embd_v = n_embd_v
        self.layers = sorted(layer_devices)
        self.lengths = np.zeros(n_slots, dtype=np.int64)

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
    def clear(self, slot: int) -> None:
        self.lengths[slot] = 0

    def remove_tail(self, slot: int, from_pos: int) -> None:
        """Forget positions >= from_pos of ``slot``."""
        self.lengths[slot] = min(int(self.lengths[slot]), max(0, from_pos))

    def copy(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (the cells in use)."""
        n = int(self.lengths[src])
        for il in self.layers:
            for t in (self.k(il), self.v(il)):
                row = t.nb[1]
                data = t.read_bytes(src * self.n_ctx * row, n * row)
                t.set(memoryview(data), dst * self.n_ctx * row)
        self.lengths[dst] = n
