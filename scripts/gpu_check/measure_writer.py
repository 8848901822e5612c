#!/usr/bin/env python3
"""The model writer's throughput for one of gpu_check's shapes (plan.py's ``WRITER``): writes
the whole file once into a scratch folder, prints wall and CPU seconds and its size as one
JSON line, and deletes it.

    PYGGSPEC_WRITER_THREADS=2 nice -n 19 python3 scripts/gpu_check/measure_writer.py 27b q4_k
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import shapes


def main() -> int:
    from pyggspec.testing import write_model

    shape, quant = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "q4_k"
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "pyggspec-writer-measure"
    out.mkdir(exist_ok=True)
    spec = shapes.model_spec(shape, 0.95, quant)
    t0 = time.monotonic()
    p = write_model(out / f"{shape}.gguf", spec)
    dt = time.monotonic() - t0
    size = p.stat().st_size
    ru = os.times()
    print(json.dumps({"shape": shape, "quant": quant, "seconds": round(dt, 1), "bytes": size,
                      "GiB": round(size / 2**30, 2), "cpu_user_s": round(ru.user, 1),
                      "cpu_sys_s": round(ru.system, 1),
                      "threads": os.environ.get("PYGGSPEC_WRITER_THREADS")}))
    p.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
