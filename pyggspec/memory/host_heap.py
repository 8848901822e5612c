"""The server process's C heap (glibc malloc): keep its resident size flat under load.

Measured (``docs/serving.md``, "Host memory under load"): under thousands of requests the
Python heap stays flat (tracemalloc) and so does the memory malloc hands out (mallinfo2's
in-use bytes), yet the resident size grew by ~8 KB a request without end. The growth is
free memory glibc keeps inside its heaps: large blocks (ggml graph contexts, numpy and
tokenizer buffers) freed and allocated again with other sizes. glibc's *dynamic* mmap
threshold is why: each freed mmap'ed block raises the threshold to its size (up to 32
MiB), after which blocks that big come from the heaps, where a freed one is seldom given
back to the kernel.

:func:`tune` fixes the threshold once at server start (``mallopt(M_MMAP_THRESHOLD)``; it
also turns the dynamic adjustment off, as the ``MALLOC_MMAP_THRESHOLD_`` environment
variable does): blocks at least that big are mmap'ed and go back to the kernel when freed.
A no-op off glibc. (Measured alternatives: ``MALLOC_ARENA_MAX=2`` slowed the growth by a
third, not more; ``malloc_trim(0)`` every ~300 requests held RSS flat too, but it is
repeated work that the fixed threshold makes unnecessary.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("pyggspec.memory")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
# 1 MiB: every size that grew the heaps in the measurement is mmap'ed (256 KiB, glibc's
# own starting value, held it as flat), while a float32 logits row of a 248,320-token
# vocabulary (~970 KiB), which the host sampler's numpy temporaries have, stays on the
# heap (an mmap'ed block costs page faults at every allocation)
DEFAULT_MMAP_THRESHOLD = 1 << 20
ENV_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # glibc's tunable: the user's choice wins

def _glibc() -> ctypes.CDLL | None:
    """glibc with mallopt typed; None elsewhere (musl, macOS, Windows: no
    ``gnu_get_libc_version``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.gnu_get_libc_version  # noqa: B018 -- glibc only
    except (OSError, AttributeError):
        return None
    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.mallopt.restype = ctypes.c_int
    return lib


def tune(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> str:
    """Fix malloc's mmap threshold at ``mmap_threshold`` bytes (once, at server start).
    Returns what was done, for the log: nothing when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc applied it already) or off glibc."""
    if os.environ.get(ENV_THRESHOLD):
        return f"malloc: {ENV_THRESHOLD}={os.environ[ENV_THRESHOLD]} from the environment"
    lib = _glibc()
    if lib is None:
        return "malloc: not glibc, left as it is"
    if not lib.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)):
        return "malloc: mallopt(M_MMAP_THRESHOLD) refused, left as it is"
    return f"malloc: mmap threshold fixed at {mmap_threshold // 1024} KiB"


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size (Linux ``/proc``; 0 where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
