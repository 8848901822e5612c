#!/usr/bin/env python3
"""MTP speculative decoding: pyggspec vs llama-server on the same GGUF, paired per request.

For each constructed-agreement model (0.8B-shaped, real 248,320-token vocabulary; generated
once in F16 and quantized with llama.cpp's llama-quantize) and each ``--parallel``, every
repetition runs, one engine at a time and in alternating order:

  llama-server  plain, and --spec-type draft-mtp --spec-draft-n-max N for each N
                (default repacking, and with --no-repack unless --llama-repack on)
  pyggspec      plain, its default speculation (calibrated draft lengths), and
                --spec-draft-fixed --spec-draft-n-max N for each N

each as a fresh process doing the same greedy requests (``--parallel`` concurrent ones:
tokens/s is then the aggregate). Speed-ups are spec / plain of the same engine in the
same repetition; "vs llama" ratios divide by llama-server's best N (and by its plain run).
Every speculative output is checked against the same engine's plain output.

    scripts/build_llamacpp_tools.sh llama-server llama-quantize      # once
    python3 scripts/bench_mtp.py                                      # the full table
    python3 scripts/bench_mtp.py --agreement 0.95 --types Q8_0 --n-max 2 3 --reps 2
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


def prompts(n: int, path: Path) -> list[list[int]]:
    """``n`` distinct seeded prompts inside the model's vocabulary (the same for both engines)."""
    return [benchlib.bench_prompt(N_PROMPT, path, seed=i) for i in range(n)]


def run_llama(path: Path, args: argparse.Namespace, P: int, n_max: int, repack: bool) -> dict:
    flags = ["-t", str(args.threads), "-c", str(args.ctx * P), "-np", str(P)]
    if n_max:
        flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
    if not repack:
        flags.append("--no-repack")
    with benchlib.LlamaServer(path, flags) as srv:
        srv.complete(prompts(1, path)[0][:8], 4)  # warm-up, as our engine warms its graphs
        res, wall = srv.complete_many(prompts(P, path), args.n)
    tim = [r["timings"] for r in res]
    n_gen = sum(t["predicted_n"] for t in tim)
    out = {"tokens": [r.get("tokens", []) for r in res],
           "tps": n_gen / wall if P > 1 else tim[0]["predicted_per_second"]}
    drafted = sum(t.get("draft_n", 0) for t in tim)
    if n_max and drafted:
        out["accept"] = sum(t.get("draft_n_accepted", 0) for t in tim) / drafted
    return out


def ours_kw(args: argparse.Namespace, P: int, n_max: int | None, spec: bool | str,
            draft_head: str = "") -> str:
    """The ``Engine(...)`` keywords (source text) of one of our runs; ``spec`` with
    ``n_max`` None: pyggspec's default speculation; ``spec="cap"``: the default rule with
    ``n_max`` as its cap."""
    kw = ""
    if spec:
        # a fixed n_max is drafted every step (--spec-draft-fixed); the default chooses
        fixed = "" if spec == "cap" else "adaptive=False, "
        cfg = "SpecConfig(" + (f"n_max={n_max}, {fixed}" if n_max else "") + (
            f"draft_head={draft_head!r}" if draft_head else "") + ")"
        kw = f", spec_type='draft-mtp', spec={cfg}"
    return f"n_ctx={args.ctx}, n_parallel={P}, n_threads={args.threads}{kw}"


def ours_body(args: argparse.Namespace, P: int, path: Path, warmup: bool = True) -> str:
    """One timed batch of ``P`` greedy requests on ``e`` (after a short warm-up request)."""
    warm = ("e.generate_batch([p[:8] for p in prompts[:1]], max_tokens=4, ignore_eos=True)"
            if warmup else "")
    return f"""
prompts = {prompts(P, path)!r}
{warm}
t0 = time.perf_counter()
res = e.generate_batch(prompts, max_tokens={args.n}, ignore_eos=True)
wall = time.perf_counter() - t0
t = res.timings.to_dict(host=True)
out = {{"tokens": [r.tokens for r in res], "python_ms": t["python_ms_per_step"],
       "tps": t["predicted_per_second"] if {P} == 1 else
              sum(len(r.tokens) for r in res) / wall}}
if e.draft_lengths is not None:  # what the default chose (so far in this process), and why
    out["budget"] = e.draft_lengths.to_dict()
"""


def ours_turns(args: argparse.Namespace, P: int, path: Path) -> str:
    """What :meth:`benchlib.EngineHost.run_turns` runs for ``--ours-turns step``: the same
    ``P`` greedy requests on every engine of ``group``, step by step in turns, and per
    engine the ``out`` :func:`ours_body` gives (tokens/s over decode time for one sequence,
    over all steps for several, as llama-server's timings and a wall clock count)."""
    return f"""
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from benchlib import step_turns
got = step_turns(group, {prompts(P, path)!r}, {args.n})
outs = {{}}
for name, g in got.items():
    e, st = group[name], g["spec"]
    out = {{"tokens": [r.tokens for r in g["results"]], "python_ms": g["python_ms"],
           "tps": 1000 / g["ms_per_token"]}}
    if st is not None:
        out["accept"] = st.acceptance
        out["mean_len"] = st.mean_accepted_length
        out["stats"] = st.to_dict()
    if e.draft_lengths is not None:
        out["budget"] = e.draft_lengths.to_dict()
    outs[name] = out
"""


def run_ours(path: Path, args: argparse.Namespace, P: int, n_max: int | None,
             spec: bool, draft_head: str = "") -> dict:
    """One of our runs in a fresh process (``--ours-process fresh``)."""
    return benchlib.run_engine(path, ours_kw(args, P, n_max, spec, draft_head),
                               ours_body(args, P, path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="benchmark this GGUF instead")
    ap.add_argument("--agreement", type=float, nargs="+", default=[0.95, 0.7])
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M"])
    ap.add_argument("--n-max", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4])
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--llama-repack", choices=["both", "on", "off"], default="both")
    ap.add_argument("--draft-head", nargs="*", default=[], metavar="TYPE",
                    help="also run pyggspec's default with --spec-draft-head TYPE")
    ap.add_argument("--default-cap", type=int, nargs="*", default=[], metavar="K",
                    help="also the default rule with --spec-draft-n-max K")
    ap.add_argument("--no-ours-fixed", action="store_true",
                    help="skip pyggspec at fixed n_max (only plain and its default)")
    ap.add_argument("--llama", nargs="+", default=[], metavar="LABEL=BUILD",
                    help="compare with several llama-servers: each LABEL=BUILD folder (its "
                         "bin/llama-server) gets its own plain and n_max runs (e.g. "
                         "b11549=.cache/llama.cpp-b11549-build 0.3.36=.cache/llama.cpp-build)")
    ap.add_argument("--no-llama", action="store_true",
                    help="run only pyggspec (plain, default, fixed n_max): more repetitions "
                         "of our own ratios in the same time")
    ap.add_argument("--llama-n-max", type=int, nargs="+", default=None,
                    help="llama-server's n_max values (default: --n-max)")
    ap.add_argument("--ours-process", choices=["fresh", "shared"], default="fresh",
                    help="fresh: each of our runs in a new process, as a user starting the "
                         "CLI; shared: all our engines of a row in one process kept for the "
                         "row's repetitions, taking turns request by request, as in a "
                         "long-lived server (our ratios then see the same phases of the VM)")
    ap.add_argument("--ours-turns", choices=["request", "step"], default="request",
                    help="with --ours-process shared: our engines take turns request by "
                         "request, or step by step (benchlib.step_turns: on these VMs only "
                         "that pairs them within the same second; llama-server still "
                         "request by request)")
    ap.add_argument("--json-out", type=Path, help="also write the table's JSON here")
    benchlib.add_offload_args(ap)
    args = ap.parse_args()
    benchlib.set_offload(args)
    if args.ours_turns == "step" and args.ours_process != "shared":
        ap.error("--ours-turns step needs --ours-process shared")
    repacks = {"both": [True, False], "on": [True], "off": [False]}[args.llama_repack]
    builds = ([] if args.no_llama else
              [tuple(b.split("=", 1)) for b in args.llama] or [("", None)])

    table = []
    models = ([(0.0, args.model.name, args.model)] if args.model else
              [(a, qt, None) for a in args.agreement for qt in args.types])
    # (name, engine, n_max, spec or repack, draft head)
    runs: list[tuple[str, str, int | None, bool, str]] = [
        ("ours plain", "ours", None, False, ""), ("ours default", "ours", None, True, "")]
    runs += [(f"ours head={h}", "ours", None, True, h) for h in args.draft_head]
    runs += [(f"ours default cap={k}", "ours", k, "cap", "") for k in args.default_cap]
    if not args.no_ours_fixed:
        runs += [(f"ours n={k}", "ours", k, True, "") for k in args.n_max]
    for label, build in builds:
        for rp in repacks:
            tag = ("" if rp else " -nr") + (f" [{label}]" if label else "")
            runs += [(f"llama plain{tag}", "llama", 0, rp, build or "")]
            runs += [(f"llama n={k}{tag}", "llama", k, rp, build or "")
                     for k in (args.llama_n_max or args.n_max)]
    for agr, qt, given in models:
        path = given or benchlib.bench_model(agr, qt)
        for P in args.parallel:
            reps: list[dict[str, dict]] = []
            host = None
            if args.ours_process == "shared":
                host = benchlib.EngineHost(
                    path, {name: ours_kw(args, P, n_max, flag, head)
                           for name, engine, n_max, flag, head in runs if engine == "ours"},
                    ours_body(args, P, path, warmup=False),
                    warmup=f"e.generate_batch([{prompts(1, path)[0][:8]!r}], max_tokens=4, "
                           "ignore_eos=True)", turns=ours_turns(args, P, path))
            try:
                for rep in range(args.reps):
                    got: dict[str, dict] = {}
                    order = runs if rep % 2 == 0 else runs[::-1]
                    for name, engine, n_max, flag, head in order:
                        t0 = time.monotonic()
                        if engine == "llama" and head:  # head: this run's llama.cpp build
                            benchlib.use_llama_build(head)
                        if engine == "ours" and host is not None and args.ours_turns == "step":
                            if name not in got:  # all of ours at once, step by step
                                got.update(host.run_turns([r[0] for r in order
                                                           if r[1] == "ours"]))
                        elif engine == "ours":
                            got[name] = (host.run(name) if host is not None else
                                         run_ours(path, args, P, n_max, flag, head))
                        else:
                            got[name] = run_llama(path, args, P, n_max or 0, flag)
                        print(f"{agr} {qt} np{P} rep {rep} {name:16s} {got[name]['tps']:7.2f} t/s "
                              f" accept {got[name].get('accept', float('nan')):.3f} "
                              f"({time.monotonic() - t0:.0f}s){budget_line(got[name])}",
                              file=sys.stderr)
                    reps.append(got)
            finally:
                if host is not None:
                    host.close()
            table.append(summarize(agr, qt, P, reps, repacks, [b for b, _ in builds]))
            if args.json_out:  # after every row: a run cut short keeps what it measured
                args.json_out.write_text(json.dumps({"bench": "mtp", "n": args.n,
                                                     "reps": args.reps, "rows": table}))
    print_table(table, args)
    return 0


def budget_line(res: dict) -> str:
    """The default's choices in one run, per drafter kind: steps per draft length (0
    first), the survival per position and the step costs in plain steps it judged by."""
    b = res.get("budget")
    if not b:
        return ""
    return "".join(f"  [{kind}] lengths {d['lengths']} survival {d['survival']} "
                   f"ratios {d['ratios']}" for kind, d in b.items())


def summarize(agr: float, qt: str, P: int, reps: list[dict[str, dict]],
              repacks: list[bool], labels: list[str]) -> dict:
    names = list(reps[0])

    def med(name: str) -> float:
        return statistics.median(r[name]["tps"] for r in reps)

    def paired(a: str, b: str) -> float:
        return statistics.median(r[a]["tps"] / r[b]["tps"] for r in reps)

    def spread(a: str, b: str) -> list[float]:
        x = sorted(r[a]["tps"] / r[b]["tps"] for r in reps)
        return [round(x[0], 3), round(x[-1], 3)]

    def plain_of(n: str) -> str:
        if n.startswith("ours"):
            return "ours plain"
        return "llama plain" + n[n.index(" ", len("llama n=")):] if " " in n[len("llama "):] \
            else "llama plain"

    row: dict = {"agreement": agr, "type": qt, "parallel": P,
                 "tps": {n: round(med(n), 3) for n in names},
                 "accept": {n: round(reps[0][n]["accept"], 4) for n in names
                            if "accept" in reps[0][n]}}
    # lossless: every speculative output equals the same engine's plain output
    row["identical"] = all(r[n]["tokens"] == r[plain_of(n)]["tokens"]
                           for r in reps for n in names if "plain" not in n)
    row["ours_speedup"] = {n: round(paired(n, "ours plain"), 3) for n in names
                           if n.startswith("ours") and n != "ours plain"}
    row["ours_speedup_spread"] = {n: spread(n, "ours plain") for n in row["ours_speedup"]}
    if "ours default" in names:  # per repetition: what the default chose, and why
        row["default_budgets"] = [r["ours default"].get("budget") for r in reps]
    fixed = [n for n in names if n.startswith("ours n=")]
    if fixed and "ours default" in names:
        best_fixed = max(fixed, key=med)
        row["ours_best_fixed"] = best_fixed
        row["default_vs_best_fixed"] = round(paired("ours default", best_fixed), 3)
        row["default_vs_best_fixed_spread"] = spread("ours default", best_fixed)
    for label in labels:
        for rp in repacks:
            tag = ("" if rp else " -nr") + (f" [{label}]" if label else "")
            spec = [n for n in names if n.startswith("llama n=") and n.endswith(tag)
                    and ("-nr" in n) == (not rp)]
            if not spec:
                continue
            best = max(spec, key=med)
            key = ("llama" + tag).replace(" ", "_")
            row[f"{key}_best"] = best
            row[f"{key}_speedup"] = round(paired(best, "llama plain" + tag), 3)
            row[f"default_vs_{key}_best"] = round(paired("ours default", best), 3)
            row[f"default_vs_{key}_best_spread"] = spread("ours default", best)
            row[f"plain_vs_{key}_plain"] = round(paired("ours plain", "llama plain" + tag), 3)
    return row


def print_table(table: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.n} greedy tokens per request, {args.threads} threads, -c {args.ctx}, "
          f"{args.reps} paired rep(s); x = spec / plain of the same engine")
    for r in table:
        print(f"\nagreement {r['agreement']} {r['type']} --parallel {r['parallel']}: "
              f"outputs identical to plain: {r['identical']}")
        for n, v in r["tps"].items():
            sp = r["ours_speedup"].get(n)
            print(f"  {n:18s} {v:8.2f} t/s" + (f"  x{sp:.3f}" if sp else "")
                  + (f"  accept {r['accept'][n]:.3f}" if n in r["accept"] else ""))
        if "ours_best_fixed" in r:
            print(f"  ours default / {r['ours_best_fixed']}: {r['default_vs_best_fixed']:.3f} "
                  f"(spread {r['default_vs_best_fixed_spread']})")
        for key in [k[: -len("_best")] for k in r if k.startswith("llama") and k.endswith("_best")]:
            if f"{key}_best" in r:
                print(f"  ours default / {r[key + '_best']}: {r['default_vs_' + key + '_best']:.3f}"
                      f"   (llama x{r[key + '_speedup']:.3f};  ours plain / llama plain "
                      f"{r['plain_vs_' + key + '_plain']:.3f})")
    print(json.dumps({"bench": "mtp", "n": args.n, "threads": args.threads, "reps": args.reps,
                      "rows": table}))


if __name__ == "__main__":
    sys.exit(main())
