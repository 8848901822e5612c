"""Allocate per-layer state tensors grouped by device (one context + buffer per device)."""

from __future__ import annotations

from collections.abc import Callable

from pyggspec.ggml.buffer import Buffer
from pyggspec.ggml.context import Context
from pyggspec.ggml.device import Device
from pyggspec.ggml.tensor import Tensor


class LayerTensors:
    """Tensors named ``{prefix}{kind}-{il}`` for each layer, each on its layer's device."""

    def __init__(self, label: str, layer_devices: dict[int, Device], kinds: list[str],
                 make: Callable[[Context, str, int], Tensor]) -> None:
        self.label = label
        self.tensors: dict[tuple[str, int], Tensor] = {}
        self._ctxs: list[Context] = []
        self._bufs: list[Buffer] = []
        by_dev: dict[str, list[int]] = {}
        devs: dict[str, Device] = {}
        for il, dev in layer_devices.items():
            by_dev.setdefault(dev.name, []).append(il)
            devs[dev.name] = dev
        try:
            for name, layers in by_dev.items():
                ctx = Context(len(layers) * len(kinds) + 1)
                self._ctxs.append(ctx)
                for il in layers:
                    for kind in kinds:
                        self.tensors[(kind, il)] = make(ctx, kind, il)
                buf = Buffer.for_context(ctx, devs[name], label=f"{label} on {name}")
                buf.clear(0)  # masked cells must hold finite values (0 * NaN = NaN in attention)
                self._bufs.append(buf)
        except BaseException:
            self.close()
            raise

    def get(self, kind: str, il: int) -> Tensor:
        return self.tensors[(kind, il)]

    def bytes_by_device(self) -> dict[str, int]:
        return {b.device.name: b.size for b in self._bufs}

    def close(self) -> None:
        for b in self._bufs:
            b.close()
        for c in self._ctxs:
            c.close()
        self._bufs.clear()
        self._ctxs.clear()


class LayerMemory:
    """Base of the caches built on :class:`LayerTensors`: byte accounting and closing."""

    _mem: LayerTensors

    def bytes_by_device(self) -> dict[str, int]:
        return self._mem.bytes_by_device()

    def close(self) -> None:
        self._mem.close()
