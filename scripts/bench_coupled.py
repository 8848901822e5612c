#!/usr/bin/env python3
"""Sampled MTP speculation: coupled vs probabilistic vs greedy drafts vs llama-server, paired.

On a constructed-agreement model (0.8B-shaped, real 248,320-token vocabulary) at each
temperature and seed, one engine at a time and in alternating order, fresh processes:

  pyggspec      plain sampling; draft-mtp (fixed n_max) with coupled, probabilistic (p/q
                rejection) and greedy drafts
  llama-server  plain sampling, --spec-type draft-mtp --spec-draft-n-max N; for a build
                that has it (b11549) also --spec-draft-sampling probabilistic

all with the same sampling settings (``--temp T``, no top-k/top-p/min-p unless given, the
seed). Acceptance and tokens/s per run; ratios are paired within a (temperature, seed).
pyggspec's coupled and greedy-draft outputs must equal its plain output token for token
(checked in every row); probabilistic drafts and llama-server's sampled speculation keep
the distribution, not the tokens (reported).

    python3 scripts/bench_coupled.py                                  # the full table
    python3 scripts/bench_coupled.py --temps 1.5 3.0 --seeds 1 --types Q8_0
    python3 scripts/bench_coupled.py --llama b11549=.cache/llama.cpp-b11549-build \
        --top-k 20 --top-p 0.95                     # Qwen's recommended truncation
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

N_PROMPT = 32


def sampling_kw(args: argparse.Namespace, temp: float, seed: int) -> dict:
    return {"temperature": temp, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p, "seed": seed}


def on_cycle_prompt(path: Path, seed: int) -> list[int]:
    """A seeded prompt plus its first greedy tokens: the constructed model's logits are
    peaked only along its cycle, so a sampled run starts there (off the cycle every logit is
    ~0 and sampling is uniform over the vocabulary)."""
    base = benchlib.bench_prompt(N_PROMPT, path, seed=seed)
    body = f"""
out = {{"tokens": e.generate({base!r}, max_tokens=4, ignore_eos=True,
                            sampling=SamplingParams(temp=0.0)).tokens}}
"""
    return base + benchlib.run_engine(path, "n_ctx=256", body)["tokens"]


def run_llama(path: Path, args: argparse.Namespace, temp: float, prompt: list[int],
              seed: int, n_max: int, draft_sampling: str = "") -> dict:
    flags = ["-t", str(args.threads), "-c", str(args.ctx), "-np", "1"]
    if n_max:
        flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
    if draft_sampling:
        flags += ["--spec-draft-sampling", draft_sampling]
    with benchlib.LlamaServer(path, flags) as srv:
        srv.complete(prompt[:8], 4)  # warm-up, as our engine warms its graphs
        r = srv.complete(prompt, args.n, **sampling_kw(args, temp, seed))
    t = r["timings"]
    out = {"tokens": r.get("tokens", []), "tps": t["predicted_per_second"]}
    if n_max and t.get("draft_n"):
        out["accept"] = t.get("draft_n_accepted", 0) / t["draft_n"]
    return out


def run_ours(path: Path, args: argparse.Namespace, temp: float, prompt: list[int],
             seed: int, draft_sampling: str | None, backend_sampling: bool | None = None
             ) -> dict:
    """``draft_sampling`` None: plain decoding; ``backend_sampling`` None: ``args``'."""
    bs = args.backend_sampling if backend_sampling is None else backend_sampling
    kw = ""
    if draft_sampling:
        kw = (", spec_type='draft-mtp', spec=SpecConfig("  # fixed lengths: compares the modes
              f"n_max={args.ours_n_max}, adaptive=False, draft_sampling={draft_sampling!r})")
    params = (f"SamplingParams(temp={temp}, top_k={args.top_k}, top_p={args.top_p}, "
              f"min_p={args.min_p}, seed={seed})")
    body = f"""
e.generate({prompt[:8]!r}, max_tokens=4, ignore_eos=True)  # warm-up
r = e.generate({prompt!r}, max_tokens={args.n}, ignore_eos=True, sampling={params})
out = {{"tokens": r.tokens, "tps": r.timings.to_dict()["predicted_per_second"]}}
"""
    return benchlib.run_engine(path, f"n_ctx={args.ctx}, n_threads={args.threads}, "
                               f"backend_sampling={bs}{kw}", body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="benchmark this GGUF instead")
    ap.add_argument("--agreement", type=float, default=0.95)
    ap.add_argument("--types", nargs="+", default=["Q8_0"])
    ap.add_argument("--temps", type=float, nargs="+", default=[0.6, 1.0, 1.5, 3.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--llama-n-max", type=int, nargs="+", default=[3])
    ap.add_argument("--llama", nargs="+", default=[], metavar="LABEL=BUILD",
                    help="llama-servers to compare with (each LABEL=BUILD folder's "
                         "bin/llama-server; default: benchlib's 0.3.36 build); a build whose "
                         "llama-server has --spec-draft-sampling also runs probabilistic drafts")
    ap.add_argument("--ours-n-max", type=int, default=3)
    ap.add_argument("--backend-sampling", action=argparse.BooleanOptionalAction, default=True,
                    help="pyggspec samples in the graph (in-graph noise; its default) or on "
                         "the host")
    ap.add_argument("--host-too", action="store_true",
                    help="also run ours plain and coupled with the other sampling path "
                         "(graph vs host), paired in the same rows")
    ap.add_argument("-n", type=int, default=96, help="tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=2)
    benchlib.add_offload_args(ap)
    args = ap.parse_args()
    benchlib.set_offload(args)

    # (name, engine, what, llama build, llama draft sampling)
    runs: list[tuple[str, str, object, str, str]] = [
        ("ours plain", "ours", None, "", ""), ("ours coupled", "ours", "coupled", "", ""),
        ("ours probabilistic", "ours", "probabilistic", "", ""),
        ("ours greedy-draft", "ours", "greedy", "", "")]
    for label, build in ([tuple(b.split("=", 1)) for b in args.llama] or [("", "")]):
        tag = f" [{label}]" if label else ""
        runs += [(f"llama plain{tag}", "llama", 0, build, "")]
        runs += [(f"llama n={k}{tag}", "llama", k, build, "") for k in args.llama_n_max]
        if build and has_probabilistic(build):
            runs += [(f"llama prob n={k}{tag}", "llama", k, build, "probabilistic")
                     for k in args.llama_n_max]
    other = "host" if args.backend_sampling else "graph"
    if args.host_too:
        runs[1:1] = [(f"ours plain {other}", "ours-other", None, "", ""),
                     (f"ours coupled {other}", "ours-other", "coupled", "", "")]
    table = []
    models = ([(args.model.name, args.model)] if args.model else
              [(qt, benchlib.bench_model(args.agreement, qt)) for qt in args.types])
    for qt, path in models:
        prompts = {seed: on_cycle_prompt(path, seed) for seed in args.seeds}
        for temp in args.temps:
            reps: list[dict[str, dict]] = []
            for i, seed in enumerate(args.seeds):
                got: dict[str, dict] = {}
                p = prompts[seed]
                for name, engine, what, build, ds in (runs if i % 2 == 0 else runs[::-1]):
                    t0 = time.monotonic()
                    if build:
                        benchlib.use_llama_build(build)
                    if engine == "ours":
                        got[name] = run_ours(path, args, temp, p, seed, what)
                    elif engine == "ours-other":
                        got[name] = run_ours(path, args, temp, p, seed, what,
                                             not args.backend_sampling)
                    else:
                        got[name] = run_llama(path, args, temp, p, seed, what, ds)
                    print(f"{qt} temp {temp} seed {seed} {name:18s} {got[name]['tps']:7.2f} t/s"
                          f"  accept {got[name].get('accept', float('nan')):.3f}"
                          f"  ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
                reps.append(got)
            table.append(summarize(qt, temp, reps))
    print_table(table, args)
    return 0


def has_probabilistic(build: str) -> bool:
    """Whether this build's llama-server knows --spec-draft-sampling (b11368 and later)."""
    import subprocess

    out = subprocess.run([str(Path(build) / "bin" / "llama-server"), "--help"],
                         check=False, capture_output=True, text=True, timeout=60)
    return "--spec-draft-sampling" in out.stdout + out.stderr


def summarize(qt: str, temp: float, reps: list[dict[str, dict]]) -> dict:
    names = list(reps[0])

    def paired(a: str, b: str) -> tuple[float, float, float]:
        """Median of the per-repetition ratios, with their min and max."""
        v = [r[a]["tps"] / r[b]["tps"] for r in reps]
        return round(statistics.median(v), 3), round(min(v), 3), round(max(v), 3)

    llama_spec = [n for n in names if n.startswith("llama ") and "plain" not in n]
    best = max(llama_spec, key=lambda n: statistics.median(r[n]["tps"] for r in reps))
    llama_plain = "llama plain" + (best[best.index(" ["):] if " [" in best else "")
    return {
        "type": qt, "temp": temp,
        "tps": {n: round(statistics.median(r[n]["tps"] for r in reps), 3) for n in names},
        "accept": {n: round(statistics.mean(r[n]["accept"] for r in reps), 4) for n in names
                   if all("accept" in r[n] for r in reps)},
        "identical": all(r[n]["tokens"] == r["ours plain"]["tokens"] for r in reps
                         for n in ("ours coupled", "ours greedy-draft")),
        "llama_identical": [r[best]["tokens"] == r[llama_plain]["tokens"] for r in reps],
        "coupled_speedup": paired("ours coupled", "ours plain"),
        "probabilistic_speedup": paired("ours probabilistic", "ours plain"),
        "greedy_speedup": paired("ours greedy-draft", "ours plain"),
        "llama_best": best, "llama_speedup": paired(best, llama_plain),
        "coupled_vs_llama_best": paired("ours coupled", best),
        "probabilistic_vs_llama_best": paired("ours probabilistic", best),
        "plain_vs_llama_plain": paired("ours plain", llama_plain),
    }


def print_table(table: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.n} sampled tokens, top_k {args.top_k} top_p {args.top_p} min_p "
          f"{args.min_p}, seeds {args.seeds}, {args.threads} threads; pyggspec "
          f"n_max {args.ours_n_max}, {'graph' if args.backend_sampling else 'host'} sampling")
    def f(v: tuple[float, float, float]) -> str:
        return f"{v[0]:.3f} ({v[1]:.2f}–{v[2]:.2f})"

    print("| type | temp | accept coupled / prob / greedy | llama best (accept) | x coupled | "
          "x prob | x greedy | x llama | coupled / llama best | prob / llama best | "
          "identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        a = r["accept"]
        print(f"| {r['type']} | {r['temp']} | {a.get('ours coupled', 0):.3f} / "
              f"{a.get('ours probabilistic', 0):.3f} / {a.get('ours greedy-draft', 0):.3f} | "
              f"{r['llama_best']} ({a.get(r['llama_best'], 0):.3f}) | "
              f"{f(r['coupled_speedup'])} | {f(r['probabilistic_speedup'])} | "
              f"{f(r['greedy_speedup'])} | {f(r['llama_speedup'])} | "
              f"{f(r['coupled_vs_llama_best'])} | {f(r['probabilistic_vs_llama_best'])} | "
              f"{r['identical']} |")
    other = [n for n in table[0]["tps"] if n.startswith("ours") and n.endswith(("host", "graph"))]
    if other:
        print("\n| temp | " + " | ".join(["ours plain", "ours coupled", *other]) + " |")
        print("|---|" + "---:|" * (2 + len(other)))
        for r in table:
            print(f"| {r['temp']} | " + " | ".join(f"{r['tps'][n]:.2f}" for n in
                                                   ["ours plain", "ours coupled", *other]) + " |")
    print(json.dumps({"bench": "coupled", "n": args.n, "seeds": args.seeds, "rows": table}))


if __name__ == "__main__":
    sys.exit(main())
