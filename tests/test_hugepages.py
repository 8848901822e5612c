"""Huge pages for weights in host memory (pyggspec.ggml.hugepages)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pyggspec.ggml import hugepages


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


def test_only_whole_huge_pages_inside_the_range_are_advised():
    assert hugepages.advise(4096, 1 << 20) == 0  # no 2 MiB page inside
    assert hugepages.advise(0, 0) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in ("none", "never"),
                    reason="no transparent huge pages on this kernel")
def test_a_weight_sized_range_is_advised_unless_turned_off(monkeypatch):
    buf = np.empty(8 << 20, np.uint8)  # untouched: malloc maps it
    addr = buf.__array_interface__["data"][0]
    got = hugepages.advise(addr, buf.nbytes)
    assert got >= (4 << 20) and got % hugepages.HUGE_PAGE == 0
    monkeypatch.setenv("PYGGSPEC_HUGE_PAGES", "0")
    assert hugepages.advise(addr, buf.nbytes) == 0


def test_repacked_weights_ask_for_huge_pages(models):
    """The repacked buffer of a model big enough to hold a 2 MiB page is advised."""
    from pyggspec.engine import Engine
    from pyggspec.ggml.device import cpu_device
    from pyggspec.ggml.repack import extra_buffer_types

    if not sys.platform.startswith("linux") or thp_mode() in ("none", "never"):
        pytest.skip("no transparent huge pages on this kernel")
    path = models.get("dense", dtype="q4_0", n_embd=512, n_ff=2048)
    with Engine(str(path), n_ctx=64, load_tokenizer=False, progress=False) as e:
        bufs = e._parts.weights.buffers
        repacked = [b for b in bufs if "repacked" in b.label]
        if not [b for b in extra_buffer_types(cpu_device()) if b.name != "AMX"]:
            assert not repacked
            return
        assert repacked and repacked[0].size >= 4 << 20  # (the fixture is big enough)
        assert all(b.huge_bytes > 0 for b in repacked)
