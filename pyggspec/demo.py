"""The built-in demo model: synthetic, Qwen3.5-0.8B-shaped, with a constructed MTP head.

``pyggspec run --spec-type draft-mtp -p ...`` without ``-m`` uses it, so a new user sees
speculative decoding work on a fresh machine without downloading anything. Its weights
are random except for a constructed next-token map that the MTP head agrees with ~95% of
the time (DESIGN §5); its text is meaningless by design.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEMO_AGREEMENT = 0.95
DEMO_DTYPE = "q8_0"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pyggspec" / "demo"


def demo_model(quiet: bool = False) -> Path:
    """Path of the demo GGUF, generating it once (about a minute, ~1 GiB) with progress."""
    from pyggspec.testing import cached_model, qwen35_0_8b

    spec = qwen35_0_8b(dtype=DEMO_DTYPE, agreement=DEMO_AGREEMENT)
    t0 = time.monotonic()
    shown = [False]

    def progress(done: int, total: int) -> None:
        if quiet:
            return
        if not shown[0]:
            print("pyggspec: generating the synthetic demo model (once) into "
                  f"{cache_dir()}", file=sys.stderr)
            shown[0] = True
        width = 30
        fill = int(width * done / total)
        print(f"\r  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tensors "
              f"{time.monotonic() - t0:5.1f}s", end="" if done < total else "\n",
              file=sys.stderr, flush=True)

    return cached_model(spec, cache_dir(), progress=progress)
