"""Transparent huge pages for host buffers that hold weights.

Decoding on a CPU streams every weight once per step, and with 4 KiB pages a 0.5-1 GB model
is a quarter of a million pages: the TLB misses are part of every matrix product. Linux
backs anonymous memory with 2 MiB pages only where it is asked to (``madvise`` is the usual
``/sys/kernel/mm/transparent_hugepage/enabled`` setting, and ggml allocates its CPU buffers
with ``posix_memalign``, which never asks). Asked before the weights are written, the
kernel faults them in as huge pages. Measured on the 2-core AVX-512 bench host (Q4_K_M
~0.95 bench model, plain decoding, engines in one process taking turns step by step, 5
reps; docs/benchmarks.md, row 67's section): 0.35% less time per token for the repacked
weights (0.990-0.998); the whole process on huge pages (the system setting ``always``)
2% (0.978-0.986) -- the rest is in buffers ggml allocates itself, out of reach here.

Only the advice: where the kernel has no huge pages (setting ``never``, another OS, no
2 MiB page inside the range) nothing changes and nothing fails. ``PYGGSPEC_HUGE_PAGES=0``
in the environment when a buffer is allocated leaves it with the system's pages (the
benchmark's "before"; ``bench_inprocess.py`` engine option ``+huge=0``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger("pyggspec.ggml")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h

@functools.cache
def _libc_madvise():
    """libc's ``madvise`` (None where it cannot be loaded), looked up once."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise(addr: int, size: int) -> int:
    """Ask for huge pages over the 2 MiB pages wholly inside ``[addr, addr + size)``.
    Returns the bytes advised (0: nothing was, e.g. not Linux or a range under 2 MiB)."""
    if (not sys.platform.startswith("linux") or size <= 0
            or os.environ.get("PYGGSPEC_HUGE_PAGES", "1") == "0"):
        return 0
    lo = -(-addr // HUGE_PAGE) * HUGE_PAGE
    hi = (addr + size) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    fn = _libc_madvise()
    if fn is None:
        return 0
    if fn(lo, hi - lo, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    return hi - lo
