#!/usr/bin/env python3
"""MTP speculative decoding benchmark: pyggspec vs llama.cpp on the same GGUF.

For each constructed-agreement model (0.8B-shaped, q8_0, generated once) and each
--spec-draft-n-max, every speculative run is paired with a plain run just before it (these
VMs drift), for both engines:

  pyggspec   plain  = Engine.generate, spec = Engine(spec_type="draft-mtp")
  llama.cpp  plain  = llama-completion, spec = llama-speculative-simple --spec-type draft-mtp
             (built from the same llama.cpp source by scripts/build_llamacpp_tools.sh;
              weight repacking off, as DESIGN §10 requires)

Prints a table of tokens/s, speed-ups (spec / plain of the same engine), acceptance, and
pyggspec spec vs llama.cpp spec; then one JSON line.

    python3 scripts/bench_mtp.py --agreement 0.95 0.7 --n-max 1 2 3 4 -n 128 -t 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Speculative decoding drafts several tokens and verifies them in one batch."


def model_for(agreement: float, dtype: str) -> Path:
    from pyggspec.testing import cached_model, qwen35_0_8b

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggspec" / "bench"
    return cached_model(qwen35_0_8b(dtype=dtype, agreement=agreement), cache)


def llamacpp_bin(name: str) -> Path | None:
    build = Path(os.environ.get("PYGGSPEC_LLAMACPP_BUILD", ROOT / ".cache" / "llama.cpp-build"))
    p = build / "bin" / name
    return p if p.exists() else None


def run_ours(path: Path, n: int, threads: int, n_max: int | None, draft_vocab: int = 0) -> dict:
    from pyggspec.engine import Engine
    from pyggspec.speculative.loop import SpecConfig

    kw = {}
    if n_max:
        kw = {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=n_max, rollback="snapshot",
                                                            draft_vocab=draft_vocab)}
    with Engine(path, n_ctx=1024, n_threads=threads, **kw) as e:
        ids = e.tokenize(PROMPT)
        r = e.generate_batch([ids], max_tokens=n, ignore_eos=True)[0]
        t = r.timings.to_dict()
        out = {"tps": t["predicted_per_second"], "tokens": r.tokens,
               "python_ms": t["python_ms_per_step"]}
        if n_max:
            out["accept"] = e.stats.acceptance
            out["target_evals"] = e.stats.n_target_evals
    return out


def run_llamacpp(path: Path, n: int, threads: int, n_max: int | None) -> dict | None:
    common = ["-m", str(path), "-p", PROMPT, "-n", str(n), "-t", str(threads), "-tb",
              str(threads), "--temp", "0", "--top-k", "1", "--seed", "1", "-c", "1024",
              "--no-repack", "--ignore-eos", "-no-cnv"]
    if n_max:
        exe = llamacpp_bin("llama-speculative-simple")
        if exe is None:
            return None
        cmd = [str(exe), *common, "--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
        cmd.remove("-no-cnv")
    else:
        exe = llamacpp_bin("llama-completion")
        if exe is None:
            return None
        cmd = [str(exe), *common]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"{exe.name} failed ({p.returncode}):\n{log[-2000:]}")
    if n_max:
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        acc = re.search(r"accept\s+=\s+([\d.]+)%", log)
        return {"tps": int(m.group(1)) / float(m.group(2)),
                "accept": float(acc.group(1)) / 100 if acc else None}
    m = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs", log)
    return {"tps": int(m.group(2)) / (float(m.group(1)) / 1000)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("--n-max", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="also measure pyggspec with --spec-draft-vocab N (0: skip)")
    args = ap.parse_args()
    if llamacpp_bin("llama-speculative-simple") is None:
        print("note: llama.cpp tools not built (scripts/build_llamacpp_tools.sh); only "
              "pyggspec is measured", file=sys.stderr)
    rows = []
    for agr in args.agreement:
        path = model_for(agr, args.dtype)
        for n_max in args.n_max:
            rec: dict = {"agreement": agr, "n_max": n_max}
            samples: dict[str, list] = {"ours_plain": [], "ours_spec": [], "ours_spec_dv": [],
                                        "lc_plain": [], "lc_spec": []}
            dv = args.draft_vocab

            def ours_dv(p, n, t, nm, dv=dv):
                return run_ours(p, n, t, nm, dv) if dv else None

            for _ in range(args.reps):
                for key, fn, nm in (("ours_plain", run_ours, None), ("ours_spec", run_ours, n_max),
                                    ("ours_spec_dv", ours_dv, n_max),
                                    ("lc_plain", run_llamacpp, None),
                                    ("lc_spec", run_llamacpp, n_max)):
                    t0 = time.monotonic()
                    r = fn(path, args.n, args.threads, nm)
                    if r is not None:
                        samples[key].append(r)
                        print(f"agreement {agr} n_max {n_max} {key:10s} {r['tps']:7.2f} t/s "
                              f"({time.monotonic() - t0:.0f}s)", file=sys.stderr)
            for key, vals in samples.items():
                if vals:
                    rec[key] = statistics.median(v["tps"] for v in vals)
            if samples["ours_spec"]:
                rec["ours_accept"] = samples["ours_spec"][0]["accept"]
                rec["lossless"] = samples["ours_spec"][0]["tokens"] == \
                    samples["ours_plain"][0]["tokens"]
                rec["ours_speedup"] = statistics.median(
                    s["tps"] / p["tps"] for s, p in zip(samples["ours_spec"],
                                                        samples["ours_plain"]))
            if samples["ours_spec_dv"]:
                rec["ours_dv_accept"] = samples["ours_spec_dv"][0]["accept"]
                rec["lossless_dv"] = samples["ours_spec_dv"][0]["tokens"] == \
                    samples["ours_plain"][0]["tokens"]
                rec["ours_dv_speedup"] = statistics.median(
                    s["tps"] / p["tps"] for s, p in zip(samples["ours_spec_dv"],
                                                        samples["ours_plain"]))
            if samples["lc_spec"] and samples["lc_plain"]:
                rec["lc_accept"] = samples["lc_spec"][0]["accept"]
                rec["lc_speedup"] = statistics.median(
                    s["tps"] / p["tps"] for s, p in zip(samples["lc_spec"], samples["lc_plain"]))
                rec["spec_vs_llamacpp"] = rec["ours_spec"] / rec["lc_spec"]
                if "ours_spec_dv" in rec:
                    rec["spec_dv_vs_llamacpp"] = rec["ours_spec_dv"] / rec["lc_spec"]
                rec["plain_vs_llamacpp"] = rec["ours_plain"] / rec["lc_plain"]
            rows.append(rec)
    print(f"\n{args.n} greedy tokens, {args.threads} threads, {args.dtype}, medians of "
          f"{args.reps} paired rep(s); speed-up = spec / plain of the same engine")
    hdr = (f"{'agree':>5} {'n_max':>5} | {'ours plain':>10} {'ours spec':>9} {'x':>5} "
           f"{'acc':>5} {'spec dv':>7} {'x':>5} | {'lc plain':>8} {'lc spec':>7} {'x':>5} "
           f"{'acc':>5} | {'spec/lc':>7} {'dv/lc':>6} {'plain/lc':>8}")
    print(hdr)
    print("-" * len(hdr))

    def f(v, w, p=2):
        return f"{v:{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"

    for r in rows:
        print(f"{r['agreement']:5.2f} {r['n_max']:5d} | {f(r.get('ours_plain'), 10)} "
              f"{f(r.get('ours_spec'), 9)} {f(r.get('ours_speedup'), 5)} "
              f"{f(r.get('ours_accept'), 5)} {f(r.get('ours_spec_dv'), 7)} "
              f"{f(r.get('ours_dv_speedup'), 5)} | {f(r.get('lc_plain'), 8)} "
              f"{f(r.get('lc_spec'), 7)} {f(r.get('lc_speedup'), 5)} "
              f"{f(r.get('lc_accept'), 5)} | {f(r.get('spec_vs_llamacpp'), 7, 3)} "
              f"{f(r.get('spec_dv_vs_llamacpp'), 6, 3)} {f(r.get('plain_vs_llamacpp'), 8, 3)}")
    print(json.dumps({"bench": "spec", "n": args.n, "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
