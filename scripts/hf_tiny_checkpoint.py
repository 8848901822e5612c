#!/usr/bin/env python3
"""Write a tiny Hugging Face-format Qwen3.5 / Qwen3.5-MoE checkpoint (numpy only).

Why: llama.cpp's ``convert_hf_to_gguf.py`` needs a real HF checkpoint to prove our fixtures'
layout. Examples::

    python scripts/hf_tiny_checkpoint.py out/dense                 # fresh weights, seed 0
    python scripts/hf_tiny_checkpoint.py out/moe --moe --seed 3
    python scripts/hf_tiny_checkpoint.py out/tiny --preset tiny_moe  # dims of a ModelSpec preset
    python scripts/hf_tiny_checkpoint.py out/inv --from-gguf ours.gguf  # invert a GGUF
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyggspec.testing.hf_checkpoint import (
    HFSpec,
    hf_from_gguf,
    hf_spec_from_model_spec,
    write_hf_checkpoint,
)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and write one checkpoint directory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output directory")
    ap.add_argument("--moe", action="store_true", help="Qwen3.5-MoE (8 experts, 2 used)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("vlm", "causal"), default="vlm",
                    help="vlm: released Qwen3_5*ForConditionalGeneration layout (default); "
                         "causal: flat Qwen3_5*ForCausalLM config and model.layers.* names")
    ap.add_argument("--tied", action="store_true", help="tie_word_embeddings (no lm_head)")
    ap.add_argument("--preset", choices=("tiny_dense", "tiny_moe", "qwen35_0_8b"),
                    help="take the dimensions of a pyggspec.testing ModelSpec preset")
    ap.add_argument("--from-gguf", type=Path,
                    help="invert this GGUF (grafted or trunk-only) instead of sampling weights")
    args = ap.parse_args(argv)
    if args.from_gguf:
        out = hf_from_gguf(args.from_gguf, args.out, layout=args.layout)
    else:
        if args.preset:
            import pyggspec.testing as t

            spec = hf_spec_from_model_spec(getattr(t, args.preset)(), layout=args.layout)
        else:
            spec = HFSpec(moe=args.moe, layout=args.layout, tie_word_embeddings=args.tied)
        out = write_hf_checkpoint(args.out, spec, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
