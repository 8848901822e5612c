"""The Weights object: uploaded weight tensors by GGUF name, their devices and buffers.

Made by :func:`pyggspec.weights.load.load_weights`; the naming rules (``output.weight`` of a
tied head, ``mtp:`` keys of a separate MTP file) are in :mod:`pyggspec.weights.placement`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from pyggspec.errors import DeviceError, PyggspecError
from pyggspec.weights.placement import MTP_PREFIX
from pyggspec.weights.repack import _repack_choice

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self

    from pyggspec.ggml.buffer import Buffer
    from pyggspec.ggml.context import Context
    from pyggspec.ggml.device import Device
    from pyggspec.ggml.repack import BufferType
    from pyggspec.ggml.tensor import Tensor
    from pyggspec.modelfile import ModelFile, TensorInfo


class Weights:
    """Model weights in ggml backend buffers, by GGUF name (see the naming notes above).

    CPU tensors loaded with ``use_mmap`` point into the file's read-only mapping: never write
    to a weight (``Tensor.set``, ``zero``, graph ops writing in place), it would fault. The
    mapping stays alive as long as this object (until :meth:`close`).
    """

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}
        self._devices: dict[str, Device] = {}
        self._aliases: dict[str, str] = {}
        self._mapped: set[str] = set()
        self._repacked: dict[str, str] = {}  # key -> extra buffer type name
        self._sources: dict[str, tuple[ModelFile, TensorInfo]] = {}  # key -> file, tensor
        self._repack_types: list[BufferType] = []  # what loading could repack into
        self._plan_devices: set[str] = set()
        self._views: list[np.ndarray] = []  # keep the file mappings exported (alive)
        self._contexts: list[Context] = []
        self._subsets: dict[str, str] = {}  # row-subset key -> its source's key
        self.buffers: list[Buffer] = []
        self._closed = False

    # -- lookup ----------------------------------------------------------------------------
    def _resolve(self, name: str) -> str:
        if self._closed:
            raise PyggspecError(None, f"weights are closed (asked for '{name}')")
        return self._aliases.get(name, name)

    def get(self, name: str) -> Tensor:
        """The tensor ``name`` (GGUF name, ``output.weight`` also when tied, ``mtp:...``)."""
        key = self._resolve(name)
        t = self._tensors.get(key)
        if t is None:
            hint = ""
            if name.startswith(MTP_PREFIX):
                hint = " (no separate MTP file loaded, or it lacks this tensor)"
            elif name.startswith("blk."):
                hint = " (not in the file, or skipped by the placement)"
            raise KeyError(f"pyggspec: no weight '{name}' loaded{hint}; "
                           f"{len(self._tensors)} tensors are loaded")
        return t

    def get_mtp(self, name: str) -> Tensor:
        """The MTP head's copy of a shared tensor: ``mtp:<name>`` if loaded, else ``name``."""
        return self.get(MTP_PREFIX + name) if self.has(MTP_PREFIX + name) else self.get(name)

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._tensors

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def names(self) -> list[str]:
        """Keys of every uploaded tensor (aliases not included)."""
        return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._tensors)

    def device_of(self, name: str) -> Device:
        self.get(name)
        return self._devices[self._resolve(name)]

    def is_mapped(self, name: str) -> bool:
        """True if ``name`` lives in the file's (read-only) mapping rather than a copy."""
        return self._resolve(name) in self._mapped

    def bytes_by_device(self) -> dict[str, int]:
        """Bytes of weights per device name (every planned device listed, even at 0)."""
        out = {d: 0 for d in sorted(self._plan_devices)}
        for key, t in self._tensors.items():
            d = self._devices[key].name
            out[d] = out.get(d, 0) + t.nbytes
        return out

    @property
    def mapped_bytes(self) -> int:
        return sum(self._tensors[k].nbytes for k in self._mapped)

    def repacked(self) -> dict[str, str]:
        """Keys held in a CPU extra buffer type (repacked copies) -> that type's name."""
        return dict(self._repacked)

    @property
    def repacked_bytes(self) -> int:
        return sum(self._tensors[k].nbytes for k in self._repacked)

    # -- derived weights --------------------------------------------------------------------
    def _source(self, src: str) -> tuple[str, ModelFile, TensorInfo]:
        """(key, file, tensor info) of weight ``src`` as loaded from its file."""
        skey = self._resolve(src)
        if skey not in self._sources:
            raise PyggspecError(None, f"weight '{src}' is not loaded from a file")
        return (skey, *self._sources[skey])

    def _new_weight(self, key: str, dev: Device, info: TensorInfo) -> Tensor:
        """One derived weight shaped and typed as ``info``, under ``key`` on ``dev``, in its
        own buffer: a CPU repack buffer type when these weights were loaded with repacking
        and ggml takes ``info`` there. Registered; its data is the caller's to write."""
        from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
        from pyggspec.ggml.context import Context

        ctx = Context(1)
        self._contexts.append(ctx)
        t = ctx.new_tensor(info.type.id, info.shape, key)
        buft = None
        if self._repack_types and dev.is_cpu:
            buft = _repack_choice(dev, self._repack_types, key, info)
        if buft is not None:
            buf = Buffer.in_buffer_type(ctx, buft, dev, f"{key} ({buft.name})", USAGE_WEIGHTS)
        else:
            buf = Buffer.for_context(ctx, dev, key, USAGE_WEIGHTS)
        if buf is None:
            raise DeviceError(dev.name, f"could not allocate {key}"
                              + (f" in {buft.name}" if buft is not None else ""))
        if buft is not None:
            self._repacked[key] = buft.name
        self.buffers.append(buf)
        self._tensors[key] = t
        self._devices[key] = dev
        return t

    def add_requantized(self, key: str, src: str, type_name: str,
                        chunk_rows: int = 8192) -> Tensor:
        """A copy of weight ``src`` in another ggml type, under ``key``, on the same device
        (a CPU copy in a repack buffer type when these weights were loaded with repacking
        and ggml takes it there).

        For weights only an approximation needs (the draft LM head: a draft is a guess the
        target verifies). The rows are dequantized from the file and quantized again with
        ggml's quantizer a chunk at a time, so the host never holds them all in float32.
        """
        import numpy as np
        from gguf.quants import GGMLQuantizationType, dequantize

        from pyggspec.ggml.quantize import quantize_rows
        from pyggspec.modelfile import ggml_type

        skey, file, info = self._source(src)
        dst = ggml_type(type_name)
        ne0, n_rows = info.ne[0], int(np.prod(info.ne[1: info.n_dims]))
        if ne0 % dst.block_size:
            raise PyggspecError(None, f"'{src}' rows of {ne0} values do not fit "
                                f"{dst.name} blocks of {dst.block_size}")
        raw = np.asarray(file.tensor_data(info.name)).reshape(n_rows, -1)
        rb = dst.row_bytes(ne0)
        out = bytearray(rb * n_rows)
        for r0 in range(0, n_rows, chunk_rows):
            rows = dequantize(raw[r0:r0 + chunk_rows], GGMLQuantizationType(info.type.id))
            rows = rows.reshape(-1, ne0)
            out[r0 * rb:(r0 + len(rows)) * rb] = quantize_rows(dst.id, rows)
        t = self._new_weight(key, self._devices[skey], replace(info, type=dst))
        t.set(memoryview(out))
        return t

    def add_row_subset(self, key: str, src: str, n_rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """Room for ``n_rows`` rows of 2-D weight ``src`` (same type, same device; a repack
        buffer where ``src`` could be repacked) under ``key``, with two int32 tables: the
        rows' ids in ``src`` (``key.ids``, [1, n_rows]) and their inverse (``key.pos``, [1,
        src's rows]); all filled by :meth:`fill_row_subset`. For the draft head's hot
        vocabulary: a few percent of the LM head's rows, rewritten when the chosen rows
        change."""
        from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
        from pyggspec.ggml.context import Context
        from pyggspec.ggml.dtypes import GGMLType

        skey, _file, info = self._source(src)
        if info.n_dims != 2 or not 0 < n_rows <= info.ne[1]:
            raise PyggspecError(None, f"'{src}' {info.shape}: no subset of {n_rows} rows")
        dev = self._devices[skey]
        t = self._new_weight(key, dev, replace(info, ne=(info.ne[0], n_rows, 1, 1),
                                               nbytes=info.nbytes // info.ne[1] * n_rows))
        tctx = Context(2)
        self._contexts.append(tctx)
        ids = tctx.new_tensor(GGMLType.I32, (1, n_rows), key + ".ids")
        pos = tctx.new_tensor(GGMLType.I32, (1, info.ne[1]), key + ".pos")
        self.buffers.append(Buffer.for_context(tctx, dev, key + " tables", USAGE_WEIGHTS))
        for k, x in ((key + ".ids", ids), (key + ".pos", pos)):
            self._tensors[k] = x
            self._devices[k] = dev
        self._subsets[key] = skey
        return t, ids, pos

    def fill_row_subset(self, key: str, ids: np.ndarray) -> None:
        """Write rows ``ids`` (int32, ``len(ids)`` = the subset's rows) of the subset's
        source into ``key`` from the file (quantized rows are self-contained, so a row
        copy is exact), the ids into ``key.ids`` and their inverse into ``key.pos``:
        pos[id] = the id's row in the subset, ``len(ids)`` (one past the last) for ids
        outside it."""
        import numpy as np

        file, info = self._sources[self._subsets[key]]
        raw = np.asarray(file.tensor_data(info.name)).reshape(info.ne[1], -1)
        self._tensors[key].set(memoryview(np.ascontiguousarray(raw[ids])))  # raw bytes
        self._tensors[key + ".ids"].set(np.ascontiguousarray(ids, np.int32))
        pos = np.full(info.ne[1], len(ids), np.int32)
        pos[ids] = np.arange(len(ids), dtype=np.int32)
        self._tensors[key + ".pos"].set(pos)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the buffers, then the contexts, then release the file mappings (idempotent)."""
        for b in self.buffers:
            b.close()
        for c in self._contexts:
            c.close()
        self._tensors.clear()
        self._aliases.clear()
        self._mapped.clear()
        self._repacked.clear()
        self._views.clear()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        by = ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in self.bytes_by_device().items()) \
            if not self._closed else "closed"
        return f"Weights({len(self._tensors)} tensors; {by})"
