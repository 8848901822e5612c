"""A lazy, bounds-checked GGUF reader over ``mmap``.

Why our own parser instead of ``gguf.GGUFReader``: we must turn every malformed byte into a
one-line :class:`ModelFileError` (never an ``IndexError`` from deep inside numpy), apply the same
structural checks as ggml's ``gguf.cpp`` (tensor order, alignment, block sizes, data within the
file), and never build Python objects for the ~250k vocabulary strings unless asked. Tensor data
is never touched here: :meth:`GGUFFile.tensor_data` returns a zero-copy view of the mapping.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyggspec.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # ggml's tensor name buffer, NUL included


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: numeric id, ggml's lower-case name, block size and bytes per block."""

    id: int
    name: str
    block_size: int
    type_size: int

    def row_bytes(self, n: int) -> int:
        """Bytes of ``n`` consecutive elements (``n`` must be a multiple of the block size)."""
        return n // self.block_size * self.type_size


# ggml's type table (ggml/include/ggml.h enum and the traits in ggml/src/ggml.c). Ids 4, 5,
# 31-33 and 36-38 were removed from ggml and are invalid in GGUF files.
_TYPES = (
    (0, "f32", 1, 4), (1, "f16", 1, 2), (2, "q4_0", 32, 18), (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22), (7, "q5_1", 32, 24), (8, "q8_0", 32, 34), (9, "q8_1", 32, 40),
    (10, "q2_K", 256, 84), (11, "q3_K", 256, 110), (12, "q4_K", 256, 144),
    (13, "q5_K", 256, 176), (14, "q6_K", 256, 210), (15, "q8_K", 256, 292),
    (16, "iq2_xxs", 256, 66), (17, "iq2_xs", 256, 74), (18, "iq3_xxs", 256, 98),
    (19, "iq1_s", 256, 50), (20, "iq4_nl", 32, 18), (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82), (23, "iq4_xs", 256, 136), (24, "i8", 1, 1), (25, "i16", 1, 2),
    (26, "i32", 1, 4), (27, "i64", 1, 8), (28, "f64", 1, 8), (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2), (34, "tq1_0", 256, 54), (35, "tq2_0", 256, 66),
    (39, "mxfp4", 32, 17), (40, "nvfp4", 64, 36), (41, "q1_0", 128, 18), (42, "q2_0", 64, 18),
)
GGML_TYPES: Mapping[int, GGMLType] = {t[0]: GGMLType(*t) for t in _TYPES}
GGML_TYPES_BY_NAME: Mapping[str, GGMLType] = {t.name.lower(): t for t in GGML_TYPES.values()}
GGML_TYPE_COUNT = 43


def ggml_type(name_or_id: str | int) -> GGMLType:
    """Look up a ggml type by id or (case-insensitive) name; ``KeyError`` if unknown."""
    if isinstance(name_or_id, int):
        return GGML_TYPES[name_or_id]
    return GGML_TYPES_BY_NAME[name_or_id.lower()]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. ``ne`` is in ggml order (ne[0] = row length), 4 dims."""

    name: str
    type: GGMLType
    ne: tuple[int, int, int, int]
    n_dims: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.type.name

    @property
    def type_id(self) -> int:
        return self.type.id

    @property
    def shape(self) -> tuple[int, ...]:
        """``ne`` without trailing 1-dims beyond ``n_dims`` (llama.cpp's printed shape)."""
        return self.ne[: max(self.n_dims, 1)]

    @property
    def n_elements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]


class StringArray(Sequence[str]):
    """A GGUF array of strings decoded on access (the vocabulary has ~250k entries)."""

    def __init__(self, buf: mmap.mmap, offsets: array) -> None:
        self._buf = buf
        self._offsets = offsets  # start of each string's u64 length field

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        off = self._offsets[i]
        (n,) = struct.unpack_from("<Q", self._buf, off)
        return bytes(self._buf[off + 8 : off + 8 + n]).decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"StringArray(len={len(self)})"


# GGUF value types: id -> (name, struct format or None)
_SCALARS = {
    0: ("u8", "<B", np.uint8), 1: ("i8", "<b", np.int8), 2: ("u16", "<H", np.uint16),
    3: ("i16", "<h", np.int16), 4: ("u32", "<I", np.uint32), 5: ("i32", "<i", np.int32),
    6: ("f32", "<f", np.float32), 7: ("bool", "<?", np.bool_), 10: ("u64", "<Q", np.uint64),
    11: ("i64", "<q", np.int64), 12: ("f64", "<d", np.float64),
}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_TYPE_NAMES = {k: v[0] for k, v in _SCALARS.items()} | {8: "string", 9: "array"}


@dataclass(frozen=True)
class KV:
    """One metadata entry: its GGUF type name (``"array[u32]"`` for arrays) and value."""

    type: str
    value: Any  # int | float | bool | str | tuple | np.ndarray | StringArray


class _Truncated(Exception):
    pass


class _Reader:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(what)
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        start = self.take(n, what)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        n = self.unpack("<Q", what)
        self.take(n, what)


class GGUFFile:
    """An open, memory-mapped GGUF file: metadata, tensor index, zero-copy data views."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._buf = _map(self.path)
        try:
            self._parse()
        except _Truncated as e:
            raise ModelFileError(
                self.path, f"truncated or corrupt GGUF header (ran out of data reading {e}; "
                f"file is {len(self._buf)} bytes)"
            ) from None
        except (struct.error, OverflowError, MemoryError, ValueError) as e:
            raise ModelFileError(self.path, f"corrupt GGUF header ({e})") from None

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        r = _Reader(self._buf)
        p = self.path
        magic = bytes(self._buf[0:4]) if len(self._buf) >= 4 else bytes(self._buf[:])
        if magic != GGUF_MAGIC:
            raise ModelFileError(p, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        r.pos = 4
        version = r.unpack("<I", "version")
        if version == 1:
            raise ModelFileError(p, "GGUF version 1 is no longer supported (need 2 or 3)")
        if version & 0xFFFF == 0 and version >> 16:
            raise ModelFileError(p, "big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise ModelFileError(p, f"unsupported GGUF version {version} (need 2 or 3)")
        self.version = version
        n_tensors = r.unpack("<q", "tensor count")
        n_kv = r.unpack("<q", "metadata count")
        # every tensor info takes >= 24 bytes and every kv >= 12: reject absurd counts early
        if n_tensors < 0 or n_tensors * 24 > r.size:
            raise ModelFileError(p, f"truncated or corrupt GGUF header ({n_tensors} tensors "
                                 f"declared, file is {r.size} bytes)")
        if n_kv < 0 or n_kv * 12 > r.size:
            raise ModelFileError(p, f"truncated or corrupt GGUF header ({n_kv} metadata "
                                 f"entries declared, file is {r.size} bytes)")

        kv: dict[str, KV] = {}
        spans: dict[str, tuple[int, int]] = {}
        self._string_offsets: dict[str, array] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key #{i}")
            if not key:
                raise ModelFileError(p, f"metadata key #{i} is empty")
            if key in kv:
                raise ModelFileError(p, f"duplicate metadata key {_q(key)}")
            vtype = r.unpack("<I", f"type of {_q(key)}")
            start = r.pos
            kv[key] = self._read_value(r, vtype, key)
            spans[key] = (start, r.pos)
        self.metadata: Mapping[str, KV] = kv
        self._spans = spans

        align = kv.get("general.alignment")
        if align is not None and align.type != "u32":
            raise ModelFileError(p, f"general.alignment must be u32, is {align.type}")
        self.alignment = int(align.value) if align is not None else GGUF_DEFAULT_ALIGNMENT
        if self.alignment == 0 or self.alignment & (self.alignment - 1):
            raise ModelFileError(p, f"general.alignment {self.alignment} is not a power of 2")

        infos: list[tuple[str, int, tuple[int, ...], GGMLType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = r.string(f"tensor name #{i}")
            qn = _q(name)
            if len(name.encode()) >= GGML_MAX_NAME:
                raise ModelFileError(p, f"tensor name {qn} is too long")
            if name in seen:
                raise ModelFileError(p, f"duplicate tensor {qn}")
            seen.add(name)
            n_dims = r.unpack("<I", f"dims of {qn}")
            if n_dims > GGML_MAX_DIMS:
                raise ModelFileError(p, f"tensor {qn} has {n_dims} dimensions (max 4)")
            ne = [r.unpack("<q", f"shape of {qn}") for _ in range(n_dims)]
            if any(d < 0 for d in ne):
                raise ModelFileError(p, f"tensor {qn} has a negative dimension {ne}")
            ne4 = tuple(ne) + (1,) * (GGML_MAX_DIMS - n_dims)
            type_id = r.unpack("<I", f"type of {qn}")
            t = GGML_TYPES.get(type_id)
            if t is None:
                raise ModelFileError(
                    p, f"tensor {qn} has invalid ggml type {type_id} "
                    f"(not a type this ggml knows)"
                )
            if ne4[0] % t.block_size:
                raise ModelFileError(
                    p, f"tensor {qn} of type {t.name} has {ne4[0]} elements per row, "
                    f"not a multiple of the block size {t.block_size}"
                )
            nbytes = t.row_bytes(ne4[0]) * ne4[1] * ne4[2] * ne4[3]
            offset = r.unpack("<Q", f"offset of {qn}")
            infos.append((name, n_dims, ne4, t, offset, nbytes))

        data_start = _pad(r.pos, self.alignment) if n_tensors else r.pos
        self.data_offset = data_start
        tensors: dict[str, TensorInfo] = {}
        expected = 0
        for name, n_dims, ne4, t, offset, nbytes in infos:
            if offset != expected:
                raise ModelFileError(
                    p, f"tensor {_q(name)} has data offset {offset}, expected {expected} "
                    "(tensor data must be laid out in order)"
                )
            expected += _pad(nbytes, self.alignment)
            abs_off = data_start + offset
            if abs_off + nbytes > len(self._buf):
                raise ModelFileError(
                    p, f"truncated: data of tensor {_q(name)} ends at byte {abs_off + nbytes}, "
                    f"file is {len(self._buf)} bytes"
                )
            tensors[name] = TensorInfo(name, t, ne4, n_dims, abs_off, nbytes)  # type: ignore[arg-type]
        self.tensors: Mapping[str, TensorInfo] = tensors

    def _read_value(self, r: _Reader, vtype: int, key: str) -> KV:
        qk = _q(key)
        if vtype in _SCALARS:
            name, fmt, _ = _SCALARS[vtype]
            v = r.unpack(fmt, f"value of {qk}")
            if name == "f32":  # shortest decimal that is the same f32: 1e-06, not 9.99e-07
                v = float(str(np.float32(v)))
            return KV(name, v)
        if vtype == GGUF_STRING:
            return KV("string", r.string(f"value of {qk}"))
        if vtype == GGUF_ARRAY:
            etype = r.unpack("<I", f"array type of {qk}")
            n = r.unpack("<q", f"array length of {qk}")
            if n < 0:
                raise ModelFileError(self.path, f"metadata {qk} has negative length {n}")
            if etype in _SCALARS:
                name, fmt, dt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                start = r.take(n * size, f"array {qk}")
                arr = np.frombuffer(self._buf, dtype=np.dtype(dt).newbyteorder("<"), count=n,
                                    offset=start).copy()
                value: Any = arr if n > 64 else tuple(arr.tolist())
                return KV(f"array[{name}]", value)
            if etype == GGUF_STRING:
                offsets = array("Q")
                for i in range(n):
                    offsets.append(r.pos)
                    r.skip_string(f"string #{i} of {qk}")
                self._string_offsets[key] = offsets
                sa = StringArray(self._buf, offsets)
                return KV("array[string]", sa if n > 64 else tuple(sa))
            if etype == GGUF_ARRAY:
                raise ModelFileError(self.path, f"metadata {qk} is a nested array (unsupported)")
            raise ModelFileError(self.path, f"metadata {qk} has invalid array type {etype}")
        raise ModelFileError(self.path, f"metadata {qk} has invalid GGUF type {vtype}")

    # -- access ----------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        kv = self.metadata.get(key)
        return default if kv is None else kv.value

    def raw_value(self, key: str) -> bytes:
        """The encoded bytes of one metadata value as stored (for content hashes)."""
        start, end = self._spans[key]
        return bytes(self._buf[start:end])

    def first_duplicate_string(self, key: str) -> tuple[int, int] | None:
        """Indices ``(i, j)``, ``i < j``, of two byte-identical entries of the string array
        ``key`` (the first such ``j``), or None. Vectorised: a 250k-token vocabulary takes
        tens of milliseconds (hash every string, compare the bytes of colliding ones)."""
        offsets = self._string_offsets.get(key)
        if offsets is None or len(offsets) < 2:
            return None
        raw = np.frombuffer(self._buf, dtype=np.uint8)
        offs = np.frombuffer(offsets, dtype=np.uint64).astype(np.int64)
        lens = np.ascontiguousarray(raw[offs[:, None] + np.arange(8)]).view("<u8").ravel()
        lens = lens.astype(np.int64)
        ends = np.cumsum(lens)
        firsts = ends - lens  # index of each string's first byte in the concatenation
        total = int(ends[-1])
        h = np.zeros(len(offs), dtype=np.uint64)
        if total:
            owner = np.repeat(np.arange(len(offs)), lens)
            pos = np.arange(total, dtype=np.int64) - firsts[owner]  # position in its string
            data = raw[offs[owner] + 8 + pos].astype(np.uint64)
            mult = _powers(int(lens.max()))[pos]
            nonempty = lens > 0
            h[nonempty] = np.add.reduceat(data * mult, firsts[nonempty])
        h ^= lens.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        order = np.argsort(h, kind="stable")
        hs = h[order]
        best: tuple[int, int] | None = None
        for k in np.nonzero(hs[1:] == hs[:-1])[0]:
            i, j = sorted((int(order[k]), int(order[k + 1])))
            a, b = int(offs[i]) + 8, int(offs[j]) + 8
            same = lens[i] == lens[j] and self._buf[a:a + lens[i]] == self._buf[b:b + lens[j]]
            if same and (best is None or j < best[1]):
                best = (i, j)
        return best

    def tensor_data(self, name: str) -> np.ndarray:
        """Zero-copy ``uint8`` view of one tensor's raw bytes in the mapping."""
        t = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    @property
    def file_size(self) -> int:
        return len(self._buf)

    def fingerprint(self) -> str:
        """A short hash that tells this file from another: SHA-256 of the header (metadata
        and tensor index), the file size and 16 samples of 4 KiB spread over the tensor
        data. A full hash would read a 27B model from disk; this reads ~70 KB past the
        header and still separates two fine-tunes with the same shapes. Cached."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            import hashlib

            h = hashlib.sha256(self._buf[: self.data_offset])
            size = len(self._buf)
            h.update(size.to_bytes(8, "little"))
            span, chunk = size - self.data_offset, 4096
            for i in range(16):
                at = self.data_offset + (span - chunk) * i // 15 if span > chunk else \
                    self.data_offset
                h.update(self._buf[at: at + chunk])
            fp = self._fingerprint = h.hexdigest()[:32]
        return fp

    def close(self) -> None:
        """Unmap the file; if numpy views are still alive the mapping stays until they die."""
        try:
            self._buf.close()
        except BufferError:
            pass


def _powers(n: int) -> np.ndarray:
    """``P**i mod 2**64`` for ``i < n`` (polynomial string hash)."""
    out = np.empty(max(n, 1), dtype=np.uint64)
    x = 1
    for i in range(len(out)):
        out[i] = x
        x = x * 1099511628211 % (1 << 64)
    return out


def _q(name: str, limit: int = 80) -> str:
    """A key or tensor name from the file as it may appear in a one-line message: quoted,
    control characters escaped, at most ``limit`` characters (a corrupt file holds any
    bytes there)."""
    short = name if len(name) <= limit else name[:limit] + "..."
    return f"'{short}'" if short.isprintable() else repr(short)


quote_name = _q


def _pad(x: int, align: int) -> int:
    return (x + align - 1) // align * align


def _map(path: Path) -> mmap.mmap:
    """Open and map ``path`` read-only, turning every OS failure into a ModelFileError."""
    try:
        if path.is_dir():
            raise ModelFileError(path, "is a directory, not a GGUF file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelFileError(path, "file is empty (0 bytes), not a GGUF file")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelFileError(path, "no such file") from None
    except PermissionError:
        raise ModelFileError(path, "permission denied") from None
    except IsADirectoryError:
        raise ModelFileError(path, "is a directory, not a GGUF file") from None
    except (OSError, ValueError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ModelFileError(path, f"cannot open: {msg}") from None
