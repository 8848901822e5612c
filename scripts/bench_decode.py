#!/usr/bin/env python3
"""Prefill and decode: pyggspec vs llama-server (built without AMX) on the same GGUFs.

The 0.8B-shaped constructed-agreement model is generated once in F16 and quantized with
llama.cpp's own ``llama-quantize`` to each type asked for. For every type and repetition,
one engine at a time (two ggml CPU users at once slow each other down), in alternating
order: llama-server with its default repacking, llama-server ``--no-repack``, pyggspec (its
default, repacking on); each does one 512-token prompt + 128 greedy tokens. Ratios are paired per repetition, then the median is reported.

    scripts/build_llamacpp_tools.sh llama-server llama-quantize   # once
    python3 scripts/bench_decode.py                               # Q8_0 Q4_0 Q4_K_M IQ4_XS
    python3 scripts/bench_decode.py --types Q4_K_M --reps 5 -t 2
    python3 scripts/bench_decode.py -m model.gguf                 # one given file as is
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib


def quantized_models(types: list[str]) -> dict[str, Path]:
    """The F16 0.8B-shaped model (~0.95 agreement) quantized by llama-quantize per type."""
    return {t: benchlib.bench_model(0.95, t) for t in types}


def run_llama_server(path: Path, n_prompt: int, n_gen: int, threads: int, repack: bool) -> dict:
    """One request to a fresh llama-server (the speed reference, DESIGN §6): the prompt's
    and the generation's tokens/s from its ``timings``."""
    flags = ["-t", str(threads), "-c", str(n_prompt + n_gen + 16), "-np", "1"]
    if not repack:
        flags.append("--no-repack")
    prompt = benchlib.bench_prompt(n_prompt, path)
    with benchlib.LlamaServer(path, flags) as srv:
        t = srv.complete(prompt, n_gen)["timings"]
    return {"prefill_tps": float(t["prompt_per_second"]),
            "decode_tps": float(t["predicted_per_second"])}


def run_pyggspec(path: Path, n_prompt: int, n_gen: int, threads: int, repack: bool) -> dict:
    """In a child process, like llama-bench (its memory and threads gone afterwards)."""
    body = f"""
prompt = {benchlib.bench_prompt(n_prompt, path)!r}
e.decode({{0: prompt[:8]}}); e.clear(0)                       # warm-up, like llama-bench
t0 = time.perf_counter(); lg = e.decode({{0: prompt}})[0].logits; t1 = time.perf_counter()
py = []
t2 = time.perf_counter()
t = int(lg[-1].argmax())  # decode after the prompt, as the server's request does
for _ in range({n_gen}):
    t = int(e.decode_token(0, t).argmax())
    py.append(e.target.last_python_ms)
t3 = time.perf_counter()
out = {{"prefill_tps": {n_prompt} / (t1 - t0), "decode_tps": {n_gen} / (t3 - t2),
       "python_ms": statistics.median(py), "repacked": len(e.weights.repacked())}}
"""
    return benchlib.run_engine(path, f"n_ctx={n_prompt + n_gen + 8}, n_threads={threads}, "
                               f"n_batch={n_prompt}, n_ubatch={n_prompt}, repack={repack}", body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="benchmark this file instead")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_K_M,IQ4_XS")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-pyggspec-norepack", action="store_true",
                    help="skip pyggspec's own --no-repack run")
    benchlib.add_offload_args(ap)
    args = ap.parse_args()
    benchlib.set_offload(args)
    models = ({args.model.name: args.model} if args.model
              else quantized_models(args.types.split(",")))
    runs = [("llama.cpp", True), ("llama.cpp -nr", False), ("pyggspec", True)]
    if not args.no_pyggspec_norepack:
        runs.append(("pyggspec -nr", False))
    summary = []
    for qt, path in models.items():
        rows: dict[str, list[dict]] = {name: [] for name, _ in runs}
        for rep in range(args.reps):
            order = runs if rep % 2 == 0 else runs[::-1]
            for name, repack in order:
                fn = run_llama_server if name.startswith("llama") else run_pyggspec
                r = fn(path, args.prompt, args.gen, args.threads, repack)
                rows[name].append(r)
                print(f"{qt} rep {rep} {name:14s} prefill {r['prefill_tps']:8.1f} t/s  "
                      f"decode {r['decode_tps']:7.2f} t/s", file=sys.stderr)
                time.sleep(1)

        def ratio(key: str, ref: str, who: str = "pyggspec", rows=rows) -> float:
            return statistics.median(a[key] / b[key] for a, b in zip(rows[who], rows[ref]))

        def med(name: str, key: str, rows=rows) -> float:
            return statistics.median(r[key] for r in rows[name])

        s = {"type": qt, "model": path.name,
             "prefill_vs_default": ratio("prefill_tps", "llama.cpp"),
             "decode_vs_default": ratio("decode_tps", "llama.cpp"),
             "prefill_vs_norepack": ratio("prefill_tps", "llama.cpp -nr"),
             "decode_vs_norepack": ratio("decode_tps", "llama.cpp -nr"),
             "python_ms_per_step": med("pyggspec", "python_ms"),
             "repacked_tensors": rows["pyggspec"][0]["repacked"],
             "tps": {n: {"prefill": med(n, "prefill_tps"), "decode": med(n, "decode_tps")}
                     for n in rows}}
        summary.append(s)

    print(f"\n{args.threads} threads, prompt {args.prompt}, gen {args.gen}, {args.reps} paired "
          "reps; ratios = pyggspec / llama.cpp (medians of per-rep ratios)")
    print(f"{'type':8s} {'pp/default':>10s} {'tg/default':>10s} {'pp/-nr':>8s} {'tg/-nr':>8s} "
          f"{'py ms':>6s} {'repacked':>8s}")
    for s in summary:
        print(f"{s['type']:8s} {s['prefill_vs_default']:10.3f} {s['decode_vs_default']:10.3f} "
              f"{s['prefill_vs_norepack']:8.3f} {s['decode_vs_norepack']:8.3f} "
              f"{s['python_ms_per_step']:6.3f} {s['repacked_tensors']:8d}")
    print(json.dumps({"bench": "decode", "threads": args.threads, "prompt": args.prompt,
                      "gen": args.gen, "reps": args.reps,
                      "results": [{k: (round(v, 4) if isinstance(v, float) else v)
                                   for k, v in s.items()} for s in summary]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
