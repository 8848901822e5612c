#!/usr/bin/env python3
"""``--fit`` against hand-tuned ``-ngl`` under a device budget (issue 53).

The device is a ggml RPC server on loopback (this CPU behind RPC: no GPU is needed); its
budget is set with llama.cpp's own knob, ``-fitt`` = the device's free memory less the
budget. For each budget (a fraction of what the model needs on the device whole), every
repetition runs, one fresh ``pyggspec run`` process at a time in turn: the fit (no placement
flags) and ``--fit off -ngl N`` for every N whose predicted device memory fits the budget
(``pyggspec inspect``'s plan, the one the fit uses): the most that fit, one and two fewer,
and none. Reported per budget: the fit's choice,
its measured device memory against the budget, and its tokens/s over each hand-tuned
length's, paired per repetition (median and range).

    python3 scripts/bench_fit.py --agreement 0.95 --budgets 0.5 0.8 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
import benchlib

MiB = 1 << 20


def pyggspec(*args: str) -> dict:
    """One fresh CLI process; its ``--json`` output."""
    p = subprocess.run([sys.executable, "-m", "pyggspec", *args, "--json"],
                       check=False, capture_output=True, text=True, timeout=1800,
                       cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"pyggspec {' '.join(args)}: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def device_bytes(out: dict, dev: str) -> int:
    return int(out["memory"]["by_device"].get(dev, 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=None, help="this GGUF instead")
    ap.add_argument("--agreement", type=float, default=0.95)
    ap.add_argument("--type", default="q8_0", help="the generated model's type")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.8],
                    help="device budgets as fractions of the model's whole need")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=128, help="tokens per run")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--spec-type", default="draft-mtp")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()

    from pyggspec.ggml.device import RpcServer, add_rpc_server

    path = args.model or benchlib.generated_model(args.agreement, args.type)
    server = RpcServer(n_threads=args.threads)
    (dev,) = add_rpc_server(server.endpoint)
    free = dev.memory()[0]
    prompt = ",".join(map(str, benchlib.bench_prompt(64, path)))
    common = ["-m", str(path), "--rpc", server.endpoint, "-dev", dev.name, "-t",
              str(args.threads), "--spec-type", args.spec_type, "-c", "4096"]
    run = [*common, "--prompt-tokens", prompt, "-n", str(args.n), "--ignore-eos",
           "--temp", "0"]

    def need(*flags: str) -> int:
        return int(pyggspec("inspect", str(path), "--rpc", server.endpoint, "-dev", dev.name,
                            "-c", "4096", "--fit", "off",
                            *flags)["memory"]["by_device"].get(dev.name, 0))

    whole = need()
    n_layer = int(pyggspec("inspect", str(path))["n_layer_all"])
    needs = {n: need("-ngl", str(n)) for n in range(n_layer + 2)}  # -ngl 0 .. every layer + output
    table = []
    try:
        for frac in args.budgets:
            budget = int(whole * frac)
            fitt = str((free - budget) // MiB)
            fits = [n for n, b in needs.items() if b <= budget]
            print(f"budget {budget / MiB:.0f} MiB ({frac:.2f} of {whole / MiB:.0f}): "
                  f"-ngl {fits[0]}..{fits[-1]} fit by the plan", flush=True)
            # what a user tuning by hand tries: the most layers that fit, two fewer, none
            fits = sorted({0, *fits[-3:]})
            tps: dict[str, list[float]] = {"fit": []}
            fit_dev, fit_choice = [], None
            for rep in range(args.reps):
                order = ["fit", *(f"ngl={n}" for n in fits)]
                if rep % 2:
                    order.reverse()
                for name in order:
                    flags = ["-fitt", fitt] if name == "fit" else \
                        ["--fit", "off", "-ngl", name.split("=")[1]]
                    out = pyggspec("run", *run, *flags)
                    tps.setdefault(name, []).append(out["timings"]["predicted_per_second"])
                    if name == "fit":
                        fit_dev.append(device_bytes(out, dev.name))
                        fit_choice = out.get("fit")
                print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in
                                                       tps.items()), flush=True)
            row = {"budget_frac": frac, "budget": budget, "fit": fit_choice,
                   "fit_device_bytes": max(fit_dev), "within_budget": max(fit_dev) <= budget,
                   "tps": tps, "ratios": {}}
            for name, vals in tps.items():
                if name == "fit":
                    continue
                r = [f / h for f, h in zip(tps["fit"], vals)]
                row["ratios"][name] = {"median": statistics.median(r), "min": min(r),
                                       "max": max(r)}
            table.append(row)
    finally:
        server.close()
    print("\n| budget (of whole) | fit's choice | fit's device use / budget | fit / best hand-tuned -ngl "
          "[range] | fit / largest -ngl that fits [range] |\n|---|---|---|---|---|")
    for row in table:
        best = max(row["ratios"], key=lambda k: statistics.median(row["tps"][k]))
        largest = max(row["ratios"], key=lambda k: int(k.split("=")[1]))
        b, lg = row["ratios"][best], row["ratios"][largest]
        chose = row["fit"] or {}
        print(f"| {row['budget'] / MiB:.0f} MiB ({row['budget_frac']:.2f}) | "
              f"-ngl {chose.get('n_gpu_layers')} | "
              f"{row['fit_device_bytes'] / row['budget']:.3f} | {b['median']:.3f} ({best}) "
              f"[{b['min']:.3f}-{b['max']:.3f}] | {lg['median']:.3f} ({largest}) "
              f"[{lg['min']:.3f}-{lg['max']:.3f}] |")
    benchlib.write_results(args, rows=table)


if __name__ == "__main__":
    main()
