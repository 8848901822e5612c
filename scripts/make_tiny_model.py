#!/usr/bin/env python
"""Write a generated Qwen3.5 GGUF (converter layout) for tests and benchmarks.

Examples::

    python scripts/make_tiny_model.py --arch dense --dtype q8_0 -o /tmp/tiny.gguf
    python scripts/make_tiny_model.py --preset 0.8b --dtype q8_0 --agreement 0.95 -o /tmp/m.gguf
    python scripts/make_tiny_model.py --arch moe --mtp split -o /tmp/split/   # two files
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import pyggspec  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyggspec.testing import (
    ModelSpec,
    agreement_plan,
    plan_tensors,
    qwen35_0_8b,
    tiny_dense,
    tiny_moe,
    write_model,
    write_split,
)


def _describe(path: Path, spec: ModelSpec, part: str) -> str:
    n = len(plan_tensors(spec, part))  # type: ignore[arg-type]
    return f"{path}  {path.stat().st_size / 2**20:.2f} MiB  {n} tensors"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=["dense", "moe"], default="dense")
    ap.add_argument("--dtype", choices=["f32", "f16", "q8_0"], default="f32")
    ap.add_argument("--mtp", choices=["grafted", "none", "split"], default="grafted")
    ap.add_argument("--agreement", type=float, default=None,
                    help="constructed-agreement model with this MTP/target agreement rate")
    ap.add_argument("--preset", choices=["tiny", "0.8b"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", type=Path, required=True,
                    help="file path (directory for --mtp split)")
    a = ap.parse_args(argv)

    overrides: dict[str, object] = {
        "dtype": a.dtype, "seed": a.seed, "agreement": a.agreement,
        "mtp": "none" if a.mtp == "none" else "grafted",
    }
    if a.preset == "0.8b":
        if a.arch == "moe":
            ap.error("--preset 0.8b is dense (qwen35)")
        spec = qwen35_0_8b(**overrides)
    else:
        spec = (tiny_dense if a.arch == "dense" else tiny_moe)(**overrides)

    t0 = time.perf_counter()
    if a.mtp == "split":
        trunk, mtp = write_split(a.output, spec)
        written = [(trunk, "trunk"), (mtp, "mtp")]
    else:
        out = a.output / f"{spec.model_name}-{spec.dtype.upper()}.gguf" if a.output.is_dir() \
            else a.output
        written = [(write_model(out, spec), "full" if spec.n_mtp else "trunk")]
    dt = time.perf_counter() - t0
    for path, part in written:
        print(_describe(path, spec, part))
    print(f"arch={spec.arch} layers={spec.n_layer}+{spec.n_mtp} n_embd={spec.n_embd} "
          f"n_vocab={spec.n_vocab} dtype={spec.dtype} seed={spec.seed} in {dt:.1f}s")
    if spec.agreement is not None:
        plan = agreement_plan(spec)
        print(f"agreement: requested {plan.target_rate:.3f}, calibrated {plan.achieved_rate:.4f} "
              f"(sigma={plan.sigma:.4f}, cycle of {len(plan.cycle)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
