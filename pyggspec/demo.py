"""The built-in demo model: synthetic, Qwen3.5-0.8B-shaped, with a constructed MTP head.

``pyggspec run --spec-type draft-mtp -p ...`` without ``-m`` uses it, so a new user sees
speculative decoding work on a fresh machine without downloading anything. Its weights
are random except for a constructed next-token map that the MTP head agrees with ~95% of
the time (DESIGN §5); its text is meaningless by design.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_AGREEMENT = 0.95
DEMO_DTYPE = "q8_0"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pyggspec" / "demo"


def demo_model(quiet: bool = False) -> Path:
    """Path of the demo GGUF, generating it once (about a minute, ~1 GiB) with progress: a
    bar on a terminal, else one line when generation starts and one when it ends."""
    from pyggspec.progress import Progress
    from pyggspec.testing import cached_model, qwen35_0_8b

    spec = qwen35_0_8b(dtype=DEMO_DTYPE, agreement=DEMO_AGREEMENT)
    bar: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if quiet:
            return
        if not bar:
            bar.append(Progress(total, _frame, header="pyggspec: generating the synthetic "
                                f"demo model (once) into {cache_dir()}"))
        bar[0].set(done)
        if done >= total:
            bar[0].finish()

    try:
        return cached_model(spec, cache_dir(), progress=progress)
    finally:
        if bar:
            bar[0].finish()


def _frame(done: int, total: int, seconds: float) -> str:
    width = 30
    fill = int(width * done / total) if total else width
    return f"  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tensors {seconds:5.1f}s"
