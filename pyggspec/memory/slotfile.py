"""The slot state file (``--slot-save-path``, ``POST /slots/{id}?action=save|restore``).

llama-server writes ``llama_state_seq_save_file``'s format; ours holds more (the recurrent
state, prompt checkpoints, the MTP head's cache and carry-over) and has to refuse a file from
another model or cache configuration with a message instead of loading garbage rows, so it
is our own, documented here. Version 1, all integers little-endian::

    offset  size  field
    0       8     magic  b"PYGGSLOT"
    8       4     version (u32) = 1
    12      4     H: length of the header (u32)
    16      H     header: one UTF-8 JSON object (below)
    16+H    ...   the sections' bytes, back to back in the header's order

Header fields: ``identity`` (the model: arch, widths, layer count, vocabulary size and a
fingerprint of the GGUF file(s): :func:`pyggspec.modelfile.identity.model_identity`),
``layout`` (the caches: per part its layers, row widths and ggml types, see
:meth:`pyggspec.memory.slots.SlotMemory.layout`), ``n_tokens``, ``n_mtp`` (MTP cache
pairs), ``carry`` (the drafter's carry-over: its JSON part, or null), ``checkpoints`` (per
checkpoint its position and carry), and ``sections``: ``[{"name", "dtype", "shape",
"crc32"}]``, every array the state is made of (token ids, one block of cache rows per
layer, recurrent rows, carry arrays). A section's size is ``prod(shape) * itemsize``; the
file's size must be exactly the header's plus the sections', and every section's CRC-32
must match, so a truncated or damaged file is refused before any cache is written.

Files are written to a temporary name next to the target and renamed, so an interrupted
save never leaves a partial file under the requested name.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyggspec.errors import PyggspecError

MAGIC = b"PYGGSLOT"
VERSION = 1
_PREFIX = struct.Struct("<8sII")
MAX_HEADER = 64 << 20  # a header is a few KB; refuse absurd lengths before reading them


class SlotFileError(PyggspecError):
    """A slot state file that cannot be restored here (unreadable, damaged, or saved from
    another model or cache configuration)."""


@dataclass
class SlotFile:
    """A slot state as it is written: the JSON header fields and the named arrays."""

    header: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, name: str, a: np.ndarray) -> None:
        if name in self.arrays:
            raise ValueError(f"section {name!r} added twice")
        self.arrays[name] = np.ascontiguousarray(a)

    def get(self, name: str) -> np.ndarray:
        a = self.arrays.get(name)
        if a is None:
            raise SlotFileError(None, f"the slot file has no section {name!r}")
        return a


def write(path: str | os.PathLike, sf: SlotFile) -> int:
    """Write ``sf`` to ``path`` (atomically: a temporary file, then a rename). Returns the
    bytes written."""
    path = Path(path)
    flat = {n: a.reshape(-1).view(np.uint8) for n, a in sf.arrays.items()}  # (0-size too)
    sections = [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape),
                 "crc32": zlib.crc32(flat[n])} for n, a in sf.arrays.items()]
    head = json.dumps({**sf.header, "sections": sections}, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(head)))
            f.write(head)
            for a in flat.values():
                f.write(a)
            n = f.tell()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return n


def read(path: str | os.PathLike) -> tuple[SlotFile, int]:
    """Read and check a slot file (magic, version, sizes, CRCs). Returns it and the bytes
    read; :class:`SlotFileError` says what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SlotFileError(None, f"no slot file {path.name!r}") from None
    except OSError as e:
        raise SlotFileError(None, f"cannot read {path.name!r}: {e.strerror or e}") from None
    if len(data) < _PREFIX.size:
        raise SlotFileError(None, f"{path.name!r} is not a pyggspec slot file (too short)")
    magic, version, n_head = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SlotFileError(None, f"{path.name!r} is not a pyggspec slot file (magic "
                            f"{magic!r}, expected {MAGIC!r}; llama-server's slot files "
                            "cannot be restored here)")
    if version != VERSION:
        raise SlotFileError(None, f"{path.name!r} is slot file version {version}; this "
                            f"pyggspec reads version {VERSION}")
    end = _PREFIX.size + n_head
    if n_head > MAX_HEADER or end > len(data):
        raise SlotFileError(None, f"{path.name!r} is truncated or damaged (header of "
                            f"{n_head} bytes, file of {len(data)})")
    try:
        header = json.loads(data[_PREFIX.size:end].decode("utf-8"))
        sections = header.pop("sections")
        specs = [(str(s["name"]), np.dtype(s["dtype"]), tuple(int(d) for d in s["shape"]),
                  int(s["crc32"])) for s in sections]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SlotFileError(None, f"{path.name!r} has a damaged header ({e})") from None
    sf = SlotFile(header)
    pos = end
    for name, dt, shape, crc in specs:
        if any(d < 0 for d in shape) or dt.hasobject:
            raise SlotFileError(None, f"{path.name!r}: section {name!r} is malformed")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if pos + nbytes > len(data):
            raise SlotFileError(None, f"{path.name!r} is truncated (section {name!r} ends "
                                f"at byte {pos + nbytes}, file of {len(data)})")
        raw = memoryview(data)[pos:pos + nbytes]
        if zlib.crc32(raw) != crc:
            raise SlotFileError(None, f"{path.name!r} is damaged (section {name!r} fails "
                                "its CRC-32)")
        sf.arrays[name] = (np.frombuffer(raw, dt).reshape(shape) if nbytes
                           else np.empty(shape, dt))
        pos += nbytes
    if pos != len(data):
        raise SlotFileError(None, f"{path.name!r} has {len(data) - pos} bytes past its last "
                            "section")
    return sf, len(data)
