#!/usr/bin/env python3
"""gpu_check's benchmarks: pyggspec vs llama-server on one GPU, both fully offloaded.

Run by ``scripts/gpu_check.sh bench`` (or ``run`` / ``device``); it reuses the benchmark
scripts' own run functions (``bench_decode``, ``bench_mtp``, ``bench_coupled``,
``bench_serve``: each run a fresh process, one engine at a time) with ``-ngl`` and ``-dev``
set through ``benchlib``, on constructed-agreement models of Qwen3.5-0.8B and ~9B shape
(q8_0, real 248,320-token vocabulary), against llama-server of each llama.cpp build given
with ``--llama LABEL=BUILD_DIR``.

Items run in priority order; an item that would not end before ``--deadline`` (from the
measured seconds per run) is skipped and listed, so a device budget always ends with a table.
Writes ``gpu_check.md`` (one markdown table plus its notes) and ``gpu_check.json`` (every
run) into ``--results``; prints the table.

    python3 scripts/gpu_check/bench.py --backend cuda --device CUDA0 \\
        --llama 0.3.36=.gpu/build/tools-0.3.36-cuda --llama b11549=.gpu/build/tools-b11549-cuda
    python3 scripts/gpu_check/bench.py --make-models --shapes 0.8b 9b   # only write the models
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/: benchlib and the bench_* modules
sys.path.insert(0, str(HERE.parent.parent))  # the repo root: pyggspec

import bench_coupled
import bench_decode
import bench_mtp
import bench_serve
import benchlib

# Qwen3.5-9B text dimensions (Qwen/Qwen3.5-9B config.json: hidden 4096, 32 layers, FFN
# 12288, 16 Q / 4 KV heads of 256, Gated DeltaNet 16 QK / 32 V heads of 128, vocabulary
# 248,320); the rest as the 0.8B preset. The LM head is untied (constructed agreement).
NINE_B = {"name": "pyggspec-qwen35-9b-shape", "n_embd": 4096, "n_layer": 32, "n_head": 16,
          "n_head_kv": 4, "head_dim": 256, "n_ff": 12288, "d_state": 128, "n_group": 16,
          "dt_rank": 32}
SHAPES = {"tiny": "tiny", "0.8b": "0.8B", "9b": "9B"}  # tiny: a smoke test of this script


def model_spec(shape: str, agreement: float):
    from pyggspec.testing import qwen35_0_8b, tiny_dense

    if shape == "tiny":
        return tiny_dense(dtype="q8_0", agreement=agreement)
    extra = NINE_B if shape == "9b" else {}
    return qwen35_0_8b(dtype="q8_0", agreement=agreement, **extra)


def model_path(shape: str, agreement: float) -> Path:
    """Written once into benchlib.CACHE (the 0.8B q8_0 one is bench_serve's default model)."""
    from pyggspec.testing import cached_model

    return cached_model(model_spec(shape, agreement), benchlib.CACHE)


def model_label(shape: str, agreement: float) -> str:
    return f"{SHAPES[shape]} a{agreement:.2f} Q8_0"


def kill_children() -> None:
    """SIGKILL every process below this one (servers, child engines): the watchdog of a run
    that passed its time limit; the run then fails instead of holding the device budget."""
    me = os.getpid()
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    todo, mine = [me], []
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        mine += kids
        todo += kids
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    print(f"[bench] watchdog: killed {len(mine)} processes", file=sys.stderr, flush=True)


def one_line(e: BaseException) -> str:
    """The line of a failure worth a table note: ggml's abort message or a child's Python
    exception (its stderr holds it among log lines and backtraces), else the last line."""
    import re

    text = "\n".join([str(e), *getattr(e, "__notes__", [])])
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pat in (r"\.(c|cc|cpp|cu|h):\d+: ", r"GGML_ASSERT|GGML_ABORT",
                r"^[\w.]*(Error|Exception|Exit)\b"):
        for ln in reversed(lines):
            if re.search(pat, ln):
                return ln[:300]
    for ln in lines:
        m = re.match(r"llama-server exited \((-?\d+)\)", ln)
        if m and int(m.group(1)) < 0:
            sig = -int(m.group(1))
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
            return f"llama-server crashed ({name}) during the request: {lines[0]}"[:300]
    m = re.match(r"child failed \((-\d+)\)", lines[0]) if lines else None
    if m:  # benchlib.run_child: killed by a signal, no message of its own
        sig = -int(m.group(1))
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        return f"child crashed ({name}); its last line: {lines[-1]}"[:300]
    return (lines[-1] if lines else type(e).__name__)[:300]


class Budget:
    """Seconds per run, measured per model shape; items that would pass the deadline skip."""

    def __init__(self, deadline: float, guess: dict[str, float]) -> None:
        self.deadline = deadline
        self.seen: dict[str, list[float]] = {}
        self.guess = guess

    def per_run(self, shape: str) -> float:
        s = self.seen.get(shape)
        return statistics.median(s) if s else self.guess[shape]

    def fits(self, shape: str, n_runs: int) -> tuple[bool, float]:
        need = n_runs * self.per_run(shape)
        return (not self.deadline or time.time() + need <= self.deadline), need

    def record(self, shape: str, seconds: float) -> None:
        self.seen.setdefault(shape, []).append(seconds)


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.builds: list[tuple[str, Path]] = args.llama
        self.rows: list[dict] = []  # the table
        self.runs: list[dict] = []  # every run, for the JSON
        self.skipped: list[str] = []
        self.errors: list[str] = []
        self.error_text: list[dict] = []  # the whole message (child stderr tail), for the JSON
        self.items_done: list[dict] = []
        guess = ({"0.8b": 8.0, "9b": 20.0, "tiny": 3.0} if args.backend == "cuda"
                 else {"0.8b": 60.0, "9b": 600.0, "tiny": 10.0})
        self.budget = Budget(args.deadline, guess)

    # --- one run ---------------------------------------------------------------------
    def run(self, shape: str, what: str, fn, *a, build: str | None = None) -> dict | None:
        """One fresh-process run; its wall time feeds the budget; a failure becomes a row
        note and an error line, never an abort."""
        if build is not None:
            benchlib.use_llama_build(dict(self.builds)[build])
        t0 = time.monotonic()
        limit = max(self.args.run_limit, 8 * self.budget.per_run(shape))
        dog = threading.Timer(limit, kill_children)  # a hung server or child ends here
        dog.daemon = True
        dog.start()
        try:
            r = fn(*a)
        except BaseException as e:  # SystemExit from bench_serve too
            if isinstance(e, KeyboardInterrupt):
                raise
            msg = one_line(e)
            if time.monotonic() - t0 >= limit:
                msg = f"timed out after {limit:.0f}s (processes killed): {msg}"
            self.errors.append(f"{what}: {msg}")
            self.error_text.append({"what": what, "error": "\n".join(
                [str(e), *getattr(e, "__notes__", [])])[-3000:]})
            print(f"  {what}: FAILED: {msg}", file=sys.stderr, flush=True)
            if os.environ.get("GPU_CHECK_TRACEBACK"):
                traceback.print_exc()
            r = None
        finally:
            dog.cancel()
        dt = time.monotonic() - t0
        self.budget.record(shape, dt)
        slim = ({k: v for k, v in r.items() if k not in ("tokens", "stats")}
                if isinstance(r, dict) else r)
        self.runs.append({"what": what, "seconds": round(dt, 2), "result": slim})
        self.write()  # every run reaches the JSON at once: a lost machine keeps what ran
        if isinstance(r, dict):
            tps = r.get("tps", r.get("decode_tps", r.get("agg_tps")))
            acc = r.get("accept")
            print(f"  {what}: " + (f"{tps:.2f} t/s" if isinstance(tps, float) else "ok")
                  + (f", accept {acc:.3f}" if isinstance(acc, float) else "")
                  + f" ({dt:.0f}s)", file=sys.stderr, flush=True)
        return r

    def item(self, name: str, shape: str, n_runs: int, fn) -> None:
        ok, need = self.budget.fits(shape, n_runs)
        if not ok:
            left = max(0, self.budget.deadline - time.time())
            self.skipped.append(f"{name} (~{need:.0f}s for {n_runs} runs, {left:.0f}s left)")
            print(f"[bench] skip {name}: ~{need:.0f}s needed, {left:.0f}s left", file=sys.stderr,
                  flush=True)
            return
        print(f"[bench] {name} ({n_runs} runs, ~{need:.0f}s)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported, the next item runs
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        self.items_done.append({"item": name, "seconds": round(time.monotonic() - t0, 1)})
        self.write()

    # --- items -------------------------------------------------------------------------
    def decode(self, shape: str) -> None:
        """Prefill and decode, as bench_decode: one prompt + greedy tokens per fresh process."""
        a = self.args
        path = model_path(shape, 0.95)
        got: dict[str, list[dict]] = {"pyggspec": []}
        for label, _ in self.builds:
            got[label] = []
        for rep in range(a.reps):
            order = list(got) if rep % 2 == 0 else list(got)[::-1]
            for who in order:
                if who == "pyggspec":
                    r = self.run(shape, f"decode {shape} pyggspec", bench_decode.run_pyggspec,
                                 path, a.prompt, a.gen, a.threads, True)
                else:
                    r = self.run(shape, f"decode {shape} llama {who}",
                                 bench_decode.run_llama_server, path, a.prompt, a.gen,
                                 a.threads, True, build=who)
                if r:
                    got[who].append(r)
        model = model_label(shape, 0.95)
        for key, setting in (("prefill_tps", f"prefill pp{a.prompt}"),
                             ("decode_tps", f"decode tg{a.gen}")):
            row = self.row("decode", model, setting)
            for who, rs in got.items():
                if rs:
                    row["tps"][who] = statistics.median(r[key] for r in rs)
            self.pair_ratios(row, {w: [r[key] for r in rs] for w, rs in got.items()})
            if key == "decode_tps" and got["pyggspec"]:
                ms = statistics.median(r["python_ms"] for r in got["pyggspec"])
                row["notes"].append(f"pyggspec host ms/step {ms:.3f}")
            self.rows.append(row)

    def mtp(self, shape: str, agreement: float, builds: list[str], ours: bool = True) -> None:
        """Greedy MTP speculation at n_max 1-4 and each engine's default, as bench_mtp (one
        request per fresh process), ``--mtp-reps`` paired repetitions: each repetition runs
        every setting on every engine back to back (engine order alternating), so a ratio is
        taken between runs minutes apart at most, and the table gives the median of the
        per-repetition ratios with their range. Our default is the calibrated one
        (``SpecConfig()``: lengths chosen per step), never a fixed n_max standing in for it.
        Every speculative output is checked against plain of the same repetition."""
        from pyggspec.config import SpecConfig

        a = self.args
        path = model_path(shape, agreement)
        ns = SimpleNamespace(ctx=a.ctx, threads=a.threads, n=a.n)
        fixed_default = SpecConfig().adaptive is False  # None (the default) means calibrated
        who_all = (["pyggspec"] if ours else []) + builds
        keys = ["plain", *a.n_max, "default"]
        got: dict[tuple[str, str], list[dict | None]] = {
            (w, str(k)): [] for w in who_all for k in keys}
        for rep in range(a.mtp_reps):
            for k in keys:
                order = who_all if (rep + keys.index(k)) % 2 == 0 else who_all[::-1]
                for who in order:
                    tag = f"mtp {shape} a{agreement} {who} {k} rep{rep + 1}"
                    if who == "pyggspec":
                        n_max = None if k in ("plain", "default") else k
                        r = self.run(shape, tag, bench_mtp.run_ours, path, ns, 1, n_max,
                                     k != "plain")
                    else:
                        r = self.run(shape, tag, self.llama_mtp, path, ns, k, build=who)
                    got[(who, str(k))].append(r)
        model = model_label(shape, agreement)
        for k in keys:
            setting = ("greedy, plain" if k == "plain" else
                       f"greedy, draft-mtp n_max {k}" if k != "default" else
                       "greedy, draft-mtp default" + (" (ours: fixed)" if fixed_default
                                                      else " (ours: calibrated)"))
            row = self.row("mtp", model, setting)
            row["reps"] = {}
            for who in who_all:
                rs = got[(who, str(k))]
                tps = [r["tps"] if r else None for r in rs]
                if not any(tps):
                    continue
                row["reps"][who] = tps
                row["tps"][who] = statistics.median(v for v in tps if v)
                acc = [r["accept"] for r in rs if r and "accept" in r]
                if acc:
                    row["accept"][who] = statistics.median(acc)
                if k != "plain":
                    plains = got[(who, "plain")]
                    pairs = [(r["tps"] / p["tps"]) for r, p in zip(rs, plains) if r and p]
                    if pairs:
                        row["speedup"][who] = statistics.median(pairs)
                    if any(r and p and r["tokens"] != p["tokens"] for r, p in zip(rs, plains)):
                        row["notes"].append(f"{who}: output differs from plain")
                if who == "pyggspec" and k == "default":  # what the length rule chose
                    hist = [(r.get("budget") or {}).get("draft-mtp", {}).get("lengths") or []
                            for r in rs if r]
                    total = [sum(h[i] for h in hist if i < len(h))
                             for i in range(max(map(len, hist), default=0))]
                    if sum(total):
                        row["notes"].append("ours: steps by draft length " + ", ".join(
                            f"{i}: {n}" for i, n in enumerate(total) if n))
            self.add_row(row)

    @staticmethod
    def llama_mtp(path: Path, ns: SimpleNamespace, k) -> dict:
        """bench_mtp.run_llama, plus llama-server's own default draft length."""
        if k != "default":
            return bench_mtp.run_llama(path, ns, 1, 0 if k == "plain" else int(k), True)
        flags = ["-t", str(ns.threads), "-c", str(ns.ctx), "-np", "1",
                 "--spec-type", "draft-mtp"]
        with benchlib.LlamaServer(path, flags) as srv:
            srv.complete(bench_mtp.prompts(1, path)[0][:8], 4)
            r = srv.complete(bench_mtp.prompts(1, path)[0], ns.n)
        t = r["timings"]
        out = {"tokens": r.get("tokens", []), "tps": t["predicted_per_second"]}
        if t.get("draft_n"):
            out["accept"] = t.get("draft_n_accepted", 0) / t["draft_n"]
        return out

    def sampled(self, shape: str, agreement: float, build: str) -> None:
        """Sampled speculation at each temperature, as bench_coupled: pyggspec plain, coupled
        and greedy drafts (n_max 3) vs llama-server plain and draft-mtp n_max 3."""
        a = self.args
        path = model_path(shape, agreement)
        ns = SimpleNamespace(top_k=0, top_p=1.0, min_p=0.0, ctx=a.ctx, threads=a.threads,
                             n=a.n_sampled, ours_n_max=3, backend_sampling=None)
        model = model_label(shape, agreement)
        prompt = self.run(shape, f"sampled {shape} prompt", bench_coupled.on_cycle_prompt,
                          path, 1)
        if prompt is None:
            return
        prob = self.supports(build, "--spec-draft-sampling")  # b11549: p/q rejection drafts
        for temp in a.temps:
            got = {}
            runs = [("ours plain", bench_coupled.run_ours, (None,)),
                    ("ours coupled", bench_coupled.run_ours, ("coupled",)),
                    ("ours greedy", bench_coupled.run_ours, ("greedy",)),
                    ("llama plain", self.llama_sampled, (0, ())),
                    ("llama n3", self.llama_sampled, (3, ()))]
            if prob:
                runs.append(("llama n3 prob", self.llama_sampled,
                             (3, ("--spec-draft-sampling", "probabilistic"))))
            for name, fn, extra in runs:
                r = self.run(shape, f"sampled {shape} temp {temp} {name}", fn, path, ns, temp,
                             prompt, 1, *extra, build=build if name.startswith("llama") else None)
                if r:
                    got[name] = r
            rows = [(f"temp {temp}, plain", "ours plain", "llama plain"),
                    (f"temp {temp}, draft-mtp n_max 3 (ours: coupled drafts)", "ours coupled",
                     "llama n3"),
                    (f"temp {temp}, draft-mtp n_max 3 (ours: greedy drafts)", "ours greedy",
                     "llama n3")]
            if prob:
                prob_setting = (f"temp {temp}, draft-mtp n_max 3 (ours: coupled; llama: "
                                "--spec-draft-sampling probabilistic)")
                rows.append((prob_setting, "ours coupled", "llama n3 prob"))
            for setting, ours_key, llama_key in rows:
                row = self.row("sampled", model, setting)
                for who, key, plain_key in (("pyggspec", ours_key, "ours plain"),
                                            (build, llama_key, "llama plain")):
                    r = got.get(key)
                    if not r:
                        continue
                    row["tps"][who] = r["tps"]
                    if "accept" in r:
                        row["accept"][who] = r["accept"]
                    if key != plain_key and got.get(plain_key):
                        row["speedup"][who] = r["tps"] / got[plain_key]["tps"]
                if ours_key != "ours plain" and got.get(ours_key) and got.get("ours plain"):
                    same = got[ours_key]["tokens"] == got["ours plain"]["tokens"]
                    row["notes"].append("pyggspec output " + ("= plain (seeded)" if same
                                                              else "DIFFERS from plain"))
                self.add_row(row)

    @staticmethod
    def llama_sampled(path: Path, ns: SimpleNamespace, temp: float, prompt: list[int],
                      seed: int, n_max: int, extra: tuple[str, ...]) -> dict:
        """bench_coupled.run_llama with extra llama-server flags."""
        flags = ["-t", str(ns.threads), "-c", str(ns.ctx), "-np", "1"]
        if n_max:
            flags += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max), *extra]
        with benchlib.LlamaServer(path, flags) as srv:
            srv.complete(prompt[:8], 4)  # warm-up, as our engine warms its graphs
            r = srv.complete(prompt, ns.n, **bench_coupled.sampling_kw(ns, temp, seed))
        t = r["timings"]
        out = {"tokens": r.get("tokens", []), "tps": t["predicted_per_second"]}
        if n_max and t.get("draft_n"):
            out["accept"] = t.get("draft_n_accepted", 0) / t["draft_n"]
        return out

    def supports(self, build: str, flag: str) -> bool:
        """Whether that llama-server's --help names the flag."""
        exe = dict(self.builds)[build] / "bin" / "llama-server"
        try:
            r = subprocess.run([str(exe), "--help"], capture_output=True, text=True,
                               timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return flag in r.stdout + r.stderr

    def serve(self, shape: str, build: str) -> None:
        """bench_serve: each server with -np P, loaded with 1..P concurrent streamed clients
        (distinct prompts, greedy), plain and draft-mtp n_max 3."""
        a = self.args
        path = model_path(shape, 0.95)
        ns = SimpleNamespace(model=path, threads=a.threads, parallel=max(a.clients),
                             ctx=a.serve_prompt + a.serve_gen + 64, no_repack=False, n_max=3)
        model = model_label(shape, 0.95)
        got: dict[tuple[str, str, int], dict] = {}
        for mode in ("plain", "draft-mtp"):
            for engine in ("pyggspec", "llama-server"):
                who = "pyggspec" if engine == "pyggspec" else build
                r = self.run(shape, f"serve {shape} {mode} {who}", self.serve_one, engine, ns,
                             mode == "draft-mtp", build=None if engine == "pyggspec" else build)
                if r:
                    for c in a.clients:
                        got[(who, mode, c)] = r[c]
        for mode in ("plain", "draft-mtp"):
            for c in a.clients:
                row = self.row("serve", model, f"{mode}, -np {ns.parallel}, {c} client"
                               + ("s" if c > 1 else "") + " (aggregate t/s)")
                ttft = []
                for who in ("pyggspec", build):
                    v = got.get((who, mode, c))
                    if not v:
                        continue
                    row["tps"][who] = v["agg_tps"]
                    if v["accept"] is not None:
                        row["accept"][who] = v["accept"]
                    ttft.append(f"{who} {v['ttft_ms']:.0f}")
                if ttft:
                    row["notes"].append("TTFT ms " + ", ".join(ttft))
                self.add_row(row)

    def serve_one(self, engine: str, ns: SimpleNamespace, spec: bool) -> dict:
        a = self.args
        out = {}
        with bench_serve.Server(engine, ns, spec) as srv:
            bench_serve.one_request(srv.url, [301, 302, 303, 304], 8)  # warm-up
            vocab = bench_serve.n_vocab(srv.url)
            for c in a.clients:
                out[c] = bench_serve.load(srv.url, c, a.requests, a.serve_prompt, a.serve_gen,
                                          salt=c, vocab=vocab)
        first = out[a.clients[0]]
        return {**out, "tps": first["agg_tps"]}

    # --- rows, output ----------------------------------------------------------------------
    @staticmethod
    def row(bench: str, model: str, setting: str) -> dict:
        return {"bench": bench, "model": model, "setting": setting, "tps": {}, "accept": {},
                "speedup": {}, "ratio": {}, "notes": []}

    def add_row(self, row: dict) -> None:
        """Append, or fill the columns of the row with the same bench, model and setting
        (another llama build measured later). Ratios pair the rows' repetitions by index
        (``row["reps"]``, the MTP rows), else their single values."""
        if not row["tps"]:
            return

        def per_rep(r: dict) -> dict[str, list]:
            reps = r.get("reps") or {}
            return {w: reps.get(w, [v]) for w, v in r["tps"].items()}

        for old in self.rows:
            if (old["bench"], old["model"], old["setting"]) == (
                    row["bench"], row["model"], row["setting"]):
                for k in ("tps", "accept", "speedup"):
                    old[k].update(row[k])
                if "reps" in row:
                    old.setdefault("reps", {}).update(row["reps"])
                old["notes"] += row["notes"]
                self.pair_ratios(old, per_rep(old))
                return
        self.pair_ratios(row, per_rep(row))
        self.rows.append(row)

    @staticmethod
    def pair_ratios(row: dict, vals: dict[str, list[float]]) -> None:
        """pyggspec / each llama build: median of per-repetition ratios."""
        ours = vals.get("pyggspec") or []
        for who, v in vals.items():
            if who == "pyggspec" or not v or not ours:
                continue
            pairs = [o / x for o, x in zip(ours, v) if o and x]
            if not pairs:
                continue
            row["ratio"][who] = statistics.median(pairs)
            if len(pairs) > 1:  # the table prints it beside the median
                row.setdefault("ratio_range", {})[who] = [min(pairs), max(pairs), len(pairs)]

    def meta(self) -> dict:
        a = self.args
        m = {"backend": a.backend, "device": a.device, "ngl": a.ngl, "threads": a.threads,
             "quick": a.quick, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
             "llama_builds": {k: str(v) for k, v in self.builds},
             "settings": {"prompt": a.prompt, "gen": a.gen, "n": a.n, "n_sampled": a.n_sampled,
                          "reps": a.reps, "mtp_reps": a.mtp_reps, "n_max": a.n_max,
                          "temps": a.temps,
                          "clients": a.clients, "requests": a.requests,
                          "serve_prompt": a.serve_prompt, "serve_gen": a.serve_gen,
                          "shapes": a.shapes, "agreements": a.agreements}}
        try:
            m["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                check=False).stdout.strip()
        except OSError:
            pass
        if a.backend == "vulkan":
            m["gpu"] = "Mesa lavapipe (llvmpipe): software Vulkan on the CPU"
        if a.tests and Path(a.tests).exists():
            m["tests"] = json.loads(Path(a.tests).read_text())
        if a.timings and Path(a.timings).exists():
            m["stages"] = Path(a.timings).read_text().splitlines()
        return m

    def markdown(self) -> str:
        m = self.meta()
        labels = [b for b, _ in self.builds]
        head = ["bench", "model", "setting", "pyggspec t/s"]
        head += [f"llama {b} t/s" for b in labels]
        head += [f"ours / {b}" for b in labels]
        who = "; ".join(["ours", *labels])
        head += [f"x spec/plain ({who})", f"accept ({who})", "notes"]
        out = [f"# gpu_check: pyggspec vs llama-server, {m['backend']} {m['device']}"
               + (" (quick)" if m["quick"] else ""), "",
               f"- device: {m.get('gpu', '?')}; host {m['host']}; {m['date']}",
               f"- both engines: -ngl {m['ngl']}, -t {m['threads']}; llama-server builds: "
               + ", ".join(f"{k} ({v})" for k, v in m["llama_builds"].items()),
               f"- settings: {json.dumps(m['settings'])}"]
        if "tests" in m:
            t = m["tests"]
            out.append(f"- device tests (pytest -m device): rc {t.get('rc')}, "
                       f"{t.get('summary') or 'no summary'} ({t.get('seconds')}s)")
        if "stages" in m:
            out.append("- stages: " + "; ".join(m["stages"]))
        out += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

        def f(v, fmt):
            return fmt % v if isinstance(v, (int, float)) else "-"

        for r in self.sorted_rows():
            cells = [r["bench"], r["model"], r["setting"], f(r["tps"].get("pyggspec"), "%.2f")]
            cells += [f(r["tps"].get(b), "%.2f") for b in labels]
            rng = r.get("ratio_range", {})
            cells += [f(r["ratio"].get(b), "%.3f")
                      + (" ({:.3f}-{:.3f}, {} reps)".format(*rng[b]) if b in rng else "")
                      for b in labels]
            sp = r["speedup"]
            cells.append("; ".join([f(sp.get("pyggspec"), "%.2f")]
                                   + [f(sp.get(b), "%.2f") for b in labels])
                         if sp else "")
            ac = r["accept"]
            cells.append("; ".join([f(ac.get("pyggspec"), "%.3f")]
                                   + [f(ac.get(b), "%.3f") for b in labels])
                         if ac else "")
            cells.append("; ".join(r["notes"]))
            out.append("| " + " | ".join(cells) + " |")
        if self.skipped:
            out += ["", "Skipped (device budget): " + "; ".join(self.skipped)]
        if self.errors:
            out += ["", "Errors:"] + [f"- {e}" for e in self.errors]
        out += ["", ("t/s: generated tokens per second (prefill: prompt tokens), the server's "
                     "own timings for llama-server, the engine's for pyggspec; serve rows: all "
                     "generated tokens / wall time. 'ours / X': pyggspec over that llama-server "
                     "(median of paired repetitions, with their range). x: speculative over "
                     "plain of the same engine. One fresh process per run, one engine at a "
                     "time.")]
        return "\n".join(out) + "\n"

    def sorted_rows(self) -> list[dict]:
        """By benchmark, then model (shape, agreement high to low), then as measured."""
        benches = ["decode", "mtp", "sampled", "serve"]
        shapes = list(SHAPES.values())

        def key(ir):
            i, r = ir
            shape, agr = r["model"].split()[:2]
            return (benches.index(r["bench"]), shapes.index(shape), -float(agr[1:]), i)

        return [r for _, r in sorted(enumerate(self.rows), key=key)]

    def write(self) -> None:
        res = Path(self.args.results)
        res.mkdir(parents=True, exist_ok=True)
        (res / "gpu_check.md").write_text(self.markdown())
        (res / "gpu_check.json").write_text(json.dumps(
            {"meta": self.meta(), "rows": self.rows, "runs": self.runs,
             "items": self.items_done, "skipped": self.skipped, "errors": self.errors,
             "error_text": self.error_text},
            indent=1, default=str))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cuda", "vulkan"], default="cuda")
    ap.add_argument("--device", default=None, help="ggml device (default CUDA0 / Vulkan0)")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--llama", action="append", default=[], metavar="LABEL=BUILD_DIR",
                    help="a llama.cpp build folder (bin/llama-server); the last one given is "
                         "the reference of the sampled and serve rows")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; 0: none")
    ap.add_argument("--results", default=".gpu/results")
    ap.add_argument("--timings", default=None, help="stage timings file to quote")
    ap.add_argument("--tests", default=None, help="tests.json from gpu_check.sh test")
    ap.add_argument("--quick", action="store_true",
                    help="one model (0.8B-shaped; vulkan: tiny), agreement 0.95, few tokens, "
                         "1 repetition")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    ap.add_argument("--agreements", type=float, nargs="+", default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--run-limit", type=float, default=None,
                    help="seconds one run may take before its processes are killed (default "
                         "240 cuda, 1200 vulkan; at least 8x the measured seconds per run)")
    ap.add_argument("--mtp-reps", type=int, default=None,
                    help="paired repetitions of the MTP rows (default 5; --quick 1)")
    ap.add_argument("--make-models", action="store_true",
                    help="only write the models (gpu_check.sh does this while it builds)")
    a = ap.parse_args()
    a.device = a.device or ("CUDA0" if a.backend == "cuda" else "Vulkan0")
    a.threads = a.threads or (min(8, os.cpu_count() or 1) if a.backend == "cuda" else 2)
    a.run_limit = a.run_limit or (240.0 if a.backend == "cuda" else 1200.0)
    builds = []
    for spec in a.llama:
        label, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "bin" / "llama-server").exists():
            ap.error(f"--llama {spec}: expected LABEL=BUILD_DIR with BUILD_DIR/bin/llama-server")
        builds.append((label, Path(path)))
    a.llama = builds
    if a.quick:  # lavapipe runs llama-server on the 0.8B shape at ~0.4 t/s: tiny there
        a.shapes = a.shapes or (["tiny"] if a.backend == "vulkan" else ["0.8b"])
        a.agreements = a.agreements or [0.95]
        a.prompt, a.gen, a.n, a.n_sampled, a.reps = 64, 16, 16, 16, 1
        a.mtp_reps = a.mtp_reps or 1
        a.n_max, a.temps, a.clients, a.requests = [1, 2, 3], [0.6], [1, 2], 1
        a.serve_prompt, a.serve_gen, a.ctx = 32, 16, 512
    else:
        a.shapes = a.shapes or ["0.8b", "9b"]
        a.agreements = a.agreements or [0.95, 0.70]
        # MTP rows: 256 tokens (128 take ~0.2 s on an H200's 0.8B shape), 5 paired reps
        a.prompt, a.gen, a.n, a.n_sampled, a.reps = 512, 128, 256, 96, 2
        a.mtp_reps = a.mtp_reps or 5
        a.n_max, a.temps, a.clients, a.requests = [1, 2, 3, 4], [0.6, 1.0], [1, 4, 8], 2
        a.serve_prompt, a.serve_gen, a.ctx = 128, 128, 2048
    return a


def main() -> int:
    a = parse_args()
    if a.make_models:
        for shape in a.shapes:
            for agr in a.agreements:
                t0 = time.monotonic()
                p = model_path(shape, agr)
                print(f"[models] {model_label(shape, agr)}: {p} ({time.monotonic() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
        return 0
    if not a.llama:
        sys.exit("bench.py: no --llama LABEL=BUILD_DIR given")
    benchlib.OFFLOAD.ngl = a.ngl
    benchlib.OFFLOAD.device = a.device
    r = Runner(a)
    ref = a.llama[-1][0]  # the newest build given: the sampled and serve reference
    labels = [b for b, _ in a.llama]
    plan = []  # (name, shape, runs, fn): priority order
    n_mtp = a.mtp_reps * (2 + len(a.n_max))  # plain, each n_max, default: per engine
    for shape in a.shapes:
        plan.append((f"decode+prefill {shape}", shape, a.reps * (1 + len(labels)),
                     lambda s=shape: r.decode(s)))
        plan.append((f"mtp greedy {shape} a{a.agreements[0]}", shape, 2 * n_mtp,
                     lambda s=shape: r.mtp(s, a.agreements[0], [ref])))
    plan.append((f"sampled {a.shapes[0]} a{a.agreements[0]}", a.shapes[0],
                 1 + 6 * len(a.temps), lambda: r.sampled(a.shapes[0], a.agreements[0], ref)))
    plan.append((f"serve {a.shapes[0]}", a.shapes[0], 4 * (1 + len(a.clients)),
                 lambda: r.serve(a.shapes[0], ref)))
    for shape in a.shapes:
        for agr in a.agreements[1:]:
            plan.append((f"mtp greedy {shape} a{agr}", shape, 2 * n_mtp,
                         lambda s=shape, g=agr: r.mtp(s, g, [ref])))
    for label in labels[:-1]:  # the other builds' MTP rows
        for shape in a.shapes:
            for agr in a.agreements:
                plan.append((f"mtp greedy {shape} a{agr} llama {label}", shape, n_mtp,
                             lambda s=shape, g=agr, b=label: r.mtp(s, g, [b], ours=False)))
    for shape in a.shapes[1:]:
        plan.append((f"sampled {shape} a{a.agreements[0]}", shape, 1 + 6 * len(a.temps),
                     lambda s=shape: r.sampled(s, a.agreements[0], ref)))
        plan.append((f"serve {shape}", shape, 4 * (1 + len(a.clients)),
                     lambda s=shape: r.serve(s, ref)))
    t0 = time.monotonic()
    for name, shape, n_runs, fn in plan:
        r.item(name, shape, n_runs, fn)
    r.write()
    print(f"[bench] done in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    print(r.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
