#!/usr/bin/env python3
"""Run llama.cpp's real converter on tiny Qwen3.5 checkpoints and compare with our fixtures.

Needs torch (CPU wheel: ``pip install torch==2.13.0``), transformers and the llama.cpp source
(``$PYGGSPEC_LLAMACPP_SRC`` or ``.cache/llama-cpp-python-0.3.36/vendor/llama.cpp``). The one
patch applied to the converter (BPE pre-tokenizer lookup -> "qwen35") is documented in
``pyggspec/testing/hf_checkpoint.py``.

    # our writer vs the converter, same weights, every outtype x MTP mode; exit 1 on differences
    python scripts/convert_with_llamacpp.py check [--arch qwen35|qwen35moe] [--workdir DIR]
    # converter-made GGUFs (fresh tiny checkpoints) for `pyggspec inspect` checks
    python scripts/convert_with_llamacpp.py make DIR [--outtypes f32,q8_0]
    # one conversion of an HF directory
    python scripts/convert_with_llamacpp.py convert HF_DIR OUT.gguf [--outtype q8_0] [--mode mtp]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyggspec.testing.hf_checkpoint import (
    ConvertJob,
    HFSpec,
    run_llamacpp_converter_jobs,
    write_hf_checkpoint,
)
from pyggspec.testing.layout import converter_vs_writer, format_differences

MODES = ("grafted", "no-mtp", "mtp")


def cmd_check(args: argparse.Namespace) -> int:
    """Writer vs converter for the tiny presets; prints one line per case, then differences."""
    import pyggspec.testing as t

    specs = {"qwen35": t.tiny_dense(), "qwen35moe": t.tiny_moe()}
    archs = [args.arch] if args.arch else list(specs)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pyggspec-conv-"))
    n_bad = 0
    for arch in archs:
        cases = converter_vs_writer(specs[arch], workdir / arch, src=args.src,
                                    outtypes=args.outtypes.split(","))
        for c in cases:
            status = "identical" if not c.diffs else f"{len(c.diffs)} difference(s)"
            print(f"{c.label:28s} {status}")
            if c.diffs:
                n_bad += 1
                print("    " + format_differences(c.diffs).replace("\n", "\n    "))
    print(f"files in {workdir}")
    return 1 if n_bad else 0


def cmd_make(args: argparse.Namespace) -> int:
    """Fresh tiny checkpoints (dense + MoE) converted in every MTP mode and outtype."""
    out = Path(args.out)
    jobs = []
    for moe in (False, True):
        name = "qwen35moe" if moe else "qwen35"
        hf = write_hf_checkpoint(out / f"hf-{name}", HFSpec(moe=moe), seed=args.seed)
        for outtype in args.outtypes.split(","):
            for mode in MODES:
                prefix = "mtp-" if mode == "mtp" else ""
                suffix = "-nomtp" if mode == "no-mtp" else ""
                jobs.append(ConvertJob(hf, out / f"{prefix}tiny-{name}{suffix}-{outtype}.gguf",
                                       outtype, mode))
    for p in run_llamacpp_converter_jobs(jobs, args.src):
        print(p)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """A single conversion."""
    job = ConvertJob(Path(args.hf_dir), Path(args.outfile), args.outtype, args.mode)
    print(run_llamacpp_converter_jobs([job], args.src)[0])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand and run it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="llama.cpp source dir (default: PYGGSPEC_LLAMACPP_SRC/.cache)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="our writer vs the converter on the same weights")
    c.add_argument("--arch", choices=("qwen35", "qwen35moe"))
    c.add_argument("--outtypes", default="f32,f16,q8_0")
    c.add_argument("--workdir")
    c.set_defaults(fn=cmd_check)
    m = sub.add_parser("make", help="converter-made tiny GGUFs")
    m.add_argument("out")
    m.add_argument("--outtypes", default="f32,q8_0")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_make)
    v = sub.add_parser("convert", help="convert one HF directory")
    v.add_argument("hf_dir")
    v.add_argument("outfile")
    v.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"))
    v.add_argument("--mode", default="grafted", choices=MODES)
    v.set_defaults(fn=cmd_convert)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
