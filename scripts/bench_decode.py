#!/usr/bin/env python3
"""Decode benchmark: pyggspec vs llama.cpp (through llama_cpp) on the same GGUF.

Both run in this process, one at a time (two ggml CPU users at once slow each other
down), alternating A/B per repetition because these machines drift. Reports prefill and
decode tokens/s, their ratios, and pyggspec's host (Python) milliseconds per step.

    python3 scripts/bench_decode.py                    # 0.8B-shaped q8_0 model, generated once
    python3 scripts/bench_decode.py -m model.gguf -t 2 --prompt 512 --gen 128 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def default_model(dtype: str) -> Path:
    from pyggspec.testing import cached_model, qwen35_0_8b

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggspec" / "bench"
    spec = qwen35_0_8b(dtype=dtype, agreement=0.95)
    print(f"model: {spec.name} {dtype} (generated once into {cache})", file=sys.stderr)
    return cached_model(spec, cache)


def prompt_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(300, min(n_vocab, 5000), size=n)]


def run_llamacpp(path: Path, prompt: list[int], n_gen: int, threads: int) -> dict:
    from pyggspec.testing.oracle import OracleModel

    with OracleModel(path) as om, om.context(n_ctx=len(prompt) + n_gen + 8,
                                             n_batch=len(prompt), n_threads=threads) as oc:
        t0 = time.perf_counter()
        lg = oc.eval(prompt, logits_all=False)
        t1 = time.perf_counter()
        toks = []
        for _ in range(n_gen):
            t = int(lg[-1].argmax())
            toks.append(t)
            lg = oc.eval([t], logits_all=False)
        t2 = time.perf_counter()
    return {"prefill_tps": len(prompt) / (t1 - t0), "decode_tps": n_gen / (t2 - t1),
            "tokens": toks}


def run_pyggspec(path: Path, prompt: list[int], n_gen: int, threads: int) -> dict:
    from pyggspec.engine import Engine

    with Engine(path, n_ctx=len(prompt) + n_gen + 8, n_threads=threads,
                n_batch=len(prompt), n_ubatch=len(prompt), load_tokenizer=False) as e:
        t0 = time.perf_counter()
        lg = e.decode({0: prompt})[0].logits
        t1 = time.perf_counter()
        toks, py = [], []
        for _ in range(n_gen):
            t = int(lg[-1].argmax())
            toks.append(t)
            lg = e.decode({0: [t]})[0].logits
            py.append(e.target.last_python_ms)
        t2 = time.perf_counter()
    return {"prefill_tps": len(prompt) / (t1 - t0), "decode_tps": n_gen / (t2 - t1),
            "python_ms": statistics.median(py), "tokens": toks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = args.model or default_model(args.dtype)
    from pyggspec.modelfile import ModelFile

    with ModelFile.open(path) as mf:
        n_vocab = mf.n_vocab
    prompt = prompt_tokens(args.prompt, n_vocab)
    rows = {"llama.cpp": [], "pyggspec": []}
    for rep in range(args.reps):
        for name, fn in (("llama.cpp", run_llamacpp), ("pyggspec", run_pyggspec)):
            r = fn(path, prompt, args.gen, args.threads)
            rows[name].append(r)
            print(f"rep {rep} {name:9s} prefill {r['prefill_tps']:8.1f} t/s  "
                  f"decode {r['decode_tps']:7.2f} t/s", file=sys.stderr)
    same = rows["llama.cpp"][0]["tokens"] == rows["pyggspec"][0]["tokens"]

    def med(name, key):
        return statistics.median(r[key] for r in rows[name])

    pre_ratio = statistics.median(p["prefill_tps"] / q["prefill_tps"]
                                  for p, q in zip(rows["pyggspec"], rows["llama.cpp"]))
    dec_ratio = statistics.median(p["decode_tps"] / q["decode_tps"]
                                  for p, q in zip(rows["pyggspec"], rows["llama.cpp"]))
    print(f"\nmodel {path.name}, {args.threads} threads, prompt {args.prompt}, "
          f"gen {args.gen}, {args.reps} alternating reps (medians)")
    print(f"{'engine':10s} {'prefill t/s':>12s} {'decode t/s':>11s}")
    for name in rows:
        print(f"{name:10s} {med(name, 'prefill_tps'):12.1f} {med(name, 'decode_tps'):11.2f}")
    print(f"{'ratio':10s} {pre_ratio:12.3f} {dec_ratio:11.3f}   (pyggspec / llama.cpp, paired)")
    print(f"pyggspec python ms/step (median): {med('pyggspec', 'python_ms'):.3f}")
    print(f"greedy tokens identical: {same}")
    print(json.dumps({"bench": "decode", "model": path.name, "threads": args.threads,
                      "prompt": args.prompt, "gen": args.gen, "reps": args.reps,
                      "prefill_ratio": round(pre_ratio, 4), "decode_ratio": round(dec_ratio, 4),
                      "python_ms_per_step": round(med("pyggspec", "python_ms"), 4),
                      "tokens_identical": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
