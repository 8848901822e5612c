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
import re
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
import plan as plan_mod
import shapes
from shapes import LABELS, model_spec  # noqa: F401 - model_spec: for callers of bench.py

SHAPES = LABELS  # shape -> its label in the table (shapes.py: the sources of each shape)
QUANT = {"q": "q4_k"}  # the large shapes' type (--quant)


def model_path(shape: str, agreement: float) -> Path:
    """Written once into benchlib.CACHE (the 0.8B q8_0 one is bench_serve's default model);
    the large shapes: one file per shape, its MTP head rewritten per agreement."""
    return shapes.model_path(shape, agreement, QUANT["q"])


def model_label(shape: str, agreement: float) -> str:
    return shapes.model_label(shape, agreement, QUANT["q"])


def _ok(r: dict) -> dict:
    """An ours_host answer, or its error raised (the run then fails, as a crashed child)."""
    if "error" in r:
        raise RuntimeError(r["error"])
    return r


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
        return statistics.median(s) if s else self.guess.get(shape, 30.0)

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
        self.scales: list[float] = []  # actual / planned seconds of the row groups
        self.starts: list[dict] = []  # process starts of the row groups (load included)
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
                if isinstance(r, dict) else r if r is None else type(r).__name__)
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
        dt = self._timed(name, fn)
        self.items_done.append({"item": name, "seconds": round(dt, 1)})
        self.write()

    def _timed(self, name: str, fn) -> float:
        """Run one item; its error is recorded and the next item runs. Seconds it took."""
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported, the next item runs
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        return time.monotonic() - t0

    def item_est(self, name: str, est: float, fn) -> None:
        """:meth:`item` for a row group priced by plan.py: ``est`` seconds, scaled by the
        median of actual / estimated over the groups run so far."""
        scale = statistics.median(self.scales) if self.scales else 1.0
        need = est * scale
        left = self.budget.deadline - time.time() if self.budget.deadline else float("inf")
        if need > left:
            self.skipped.append(f"{name} (~{need:.0f}s: plan {est:.0f}s x {scale:.2f}, "
                                f"{max(0, left):.0f}s left)")
            print(f"[bench] skip {name}: ~{need:.0f}s needed, {max(0, left):.0f}s left",
                  file=sys.stderr, flush=True)
            return
        print(f"[bench] {name} (~{need:.0f}s: plan {est:.0f}s x {scale:.2f})", file=sys.stderr,
              flush=True)
        dt = self._timed(name, fn)
        self.scales.append(dt / max(est, 1.0))
        self.items_done.append({"item": name, "seconds": round(dt, 1), "plan_s": round(est, 1)})
        self.write()

    def best_n(self, shape: str, agreement: float, who: str) -> int:
        """The fastest n_max of ``who`` in the -np 1 rows measured so far (3 if none)."""
        model = model_label(shape, agreement)
        best, k = 0.0, 3
        for row in self.rows:
            m = re.fullmatch(r"greedy, draft-mtp n_max (\d+)", row["setting"])
            if row["model"] == model and m and row["tps"].get(who, 0.0) > best:
                best, k = row["tps"][who], int(m.group(1))
        return k

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

    def mtp_group(self, shape: str, agreement: float, P: int, ours_n: list[int],
                  llama_n: list[int], builds: list[str], ours: bool = True,
                  prefill: bool = False) -> None:
        """A row group of the large shapes (``persistent.py``): our engines in one process,
        one llama-server per setting, ``--mtp-reps`` paired repetitions per setting; -np
        ``P`` (P sequences at once: aggregate tokens/s). Rows as :meth:`mtp` makes them,
        with each engine's median step split in the notes and the JSON (``split``)."""
        import persistent

        a = self.args
        path = model_path(shape, agreement)
        n = a.n
        prompts = bench_mtp.prompts(P, path)
        got: dict[tuple[str, str], list[dict | None]] = {}
        host = None
        label = model_label(shape, agreement)
        ctx = max(a.ctx, persistent.PREFILL + 64)
        if ours:
            engines = {"default": {"spec_type": "draft-mtp", "spec": {}},
                       "fixed": {"spec_type": "draft-mtp",
                                 "spec": {"n_max": max(ours_n), "adaptive": False}}}
            common = {"n_ctx": ctx, "n_parallel": P, "n_threads": a.threads}
            t0 = time.monotonic()
            # under the watchdog: a start that hangs is killed (self.run notes the failure)
            host = self.run(shape, f"start {label} np{P} pyggspec (2 engines)",
                            persistent.OursHost, path, engines, common)
            if host is not None:
                self.starts.append({"what": f"{label} np{P} pyggspec", **host.ready,
                                    "seconds": round(time.monotonic() - t0, 2)})
                print(f"  pyggspec host up: {host.ready}", file=sys.stderr, flush=True)

        def ours_req(k: str, rep: int) -> None:
            if host is None:
                return
            if k == "plain":
                kw = {"engine": "fixed", "speculative": False}
            elif k == "default":
                kw = {"engine": "default"}
            else:
                kw = {"engine": "fixed", "n_draft_max": int(k)}
            r = self.run(shape, f"mtp {shape} a{agreement} np{P} pyggspec {k} rep{rep + 1}",
                         lambda: _ok(host.request(prompts=prompts, n=n, **kw)))
            got.setdefault(("pyggspec", k), []).append(r)

        # our default runs beside llama-server's default (n_max 3), else its last setting
        default_block = "3" if 3 in llama_n else (str(llama_n[-1]) if llama_n else "plain")
        try:
            for b in builds:
                for k in [0, *llama_n]:
                    key = "plain" if k == 0 else str(k)
                    t0 = time.monotonic()
                    srv = self.run(shape, f"start {label} np{P} llama {b} {key}",
                                   persistent.LlamaSrv, path, a.threads, ctx, P, k, build=b)
                    if srv is not None:
                        self.starts.append({"what": f"{label} np{P} llama {b} {key}",
                                            "seconds": round(time.monotonic() - t0, 2)})
                    ours_keys = [key] if (ours and b == builds[0]) else []
                    if ours_keys and key != "plain" and int(key) not in ours_n:
                        ours_keys.remove(key)
                    if ours and b == builds[0] and key == default_block:
                        ours_keys.append("default")  # llama-server's default n_max is 3
                    for rep in range(a.mtp_reps):
                        pair = ([("llama", None)] + [("ours", x) for x in ours_keys])
                        if rep % 2:
                            pair.reverse()
                        for who, x in pair:
                            if who == "ours":
                                ours_req(x, rep)
                            elif srv is not None:
                                r = self.run(shape, f"mtp {shape} a{agreement} np{P} {b} {key} "
                                             f"rep{rep + 1}", srv.request, prompts, n)
                                got.setdefault((b, key), []).append(r)
                        if prefill and key == "plain" and b == builds[0]:
                            pp = benchlib.bench_prompt(persistent.PREFILL, path, seed=99 + rep)
                            if srv is not None:
                                r = self.run(shape, f"prefill {shape} {b} rep{rep + 1}",
                                             srv.request, [pp], 2)
                                got.setdefault((b, "prefill"), []).append(r)
                            if host is not None:
                                r = self.run(shape, f"prefill {shape} pyggspec rep{rep + 1}",
                                             lambda pp=pp: _ok(host.request(
                                                 engine="fixed", prompts=[pp], n=2,
                                                 speculative=False)))
                                got.setdefault(("pyggspec", "prefill"), []).append(r)
                    if srv is not None:
                        srv.close()
            for k in ours_n:  # our fixed lengths no llama setting paired with
                if ours and host is not None and k not in llama_n:
                    for rep in range(a.mtp_reps):
                        ours_req(str(k), rep)
        finally:
            if host is not None:
                host.close()
        self.group_rows(shape, agreement, P, got, ["pyggspec", *builds] if ours else builds)

    def group_rows(self, shape: str, agreement: float, P: int,
                   got: dict[tuple[str, str], list], who_all: list[str]) -> None:
        model = model_label(shape, agreement) + (f" -np {P}" if P > 1 else "")
        import persistent

        keys = ["plain", *sorted({k for (_, k) in got if k.isdigit()}, key=int), "default"]
        med: dict[tuple[str, str], float] = {}
        for k in keys:
            setting = ("greedy, plain" if k == "plain" else
                       f"greedy, draft-mtp n_max {k}" if k != "default" else
                       "greedy, draft-mtp default (ours: calibrated; llama-server: n_max 3)")
            row = self.row("mtp", model, setting)
            row["reps"], row["split"] = {}, {}
            for who in who_all:
                rs = got.get((who, k if not (k == "default" and who != "pyggspec") else "3"))
                if not rs:
                    continue
                tps = [r["tps"] if r else None for r in rs]
                if not any(tps):
                    continue
                row["reps"][who] = tps
                row["tps"][who] = med[(who, k)] = statistics.median(v for v in tps if v)
                acc = [r["accept"] for r in rs if r and "accept" in r]
                if acc:
                    row["accept"][who] = statistics.median(acc)
                sp = persistent.median_split([r["split"] for r in rs if r and "split" in r])
                if sp:
                    row["split"][who] = sp
                    row["notes"].append(persistent.split_note(who, sp))
                plains = got.get((who, "plain")) or []
                if k != "plain" and plains:
                    pairs = [r["tps"] / p["tps"] for r, p in zip(rs, plains) if r and p]
                    if pairs:
                        row["speedup"][who] = statistics.median(pairs)
                    if any(r and p and r["tokens"] != p["tokens"] for r, p in zip(rs, plains)):
                        row["notes"].append(f"{who}: output differs from plain")
            self.add_row(row)
        for who in who_all[1:] if who_all[0] == "pyggspec" else []:
            # our default against that llama-server's best n_max, and our best fixed
            best = max((k for k in keys if k.isdigit() and (who, k) in med),
                       key=lambda k: med[(who, k)], default=None)
            ours_d = got.get(("pyggspec", "default")) or []
            theirs = got.get((who, best)) if best else None
            if not best or not ours_d or not theirs:
                continue
            row = self.row("mtp", model, f"greedy, ours default vs llama {who} best n_max "
                           f"({best})")
            row["tps"] = {"pyggspec": med.get(("pyggspec", "default"), 0.0),
                          who: med[(who, best)]}
            row["reps"] = {"pyggspec": [r["tps"] if r else None for r in ours_d],
                           who: [r["tps"] if r else None for r in theirs]}
            fixed = [k for k in keys if k.isdigit() and ("pyggspec", k) in med]
            if fixed:
                bf = max(fixed, key=lambda k: med[("pyggspec", k)])
                row["notes"].append(f"ours default / ours best fixed (n_max {bf}): "
                                    f"{med[('pyggspec', 'default')] / med[('pyggspec', bf)]:.3f}")
            self.add_row(row)
        for who in who_all:  # prefill pp512 (-np 1 groups)
            rs = [r for r in got.get((who, "prefill")) or [] if r]
            vals = [r.get("prefill_tps") for r in rs if r.get("prefill_tps")]
            if vals:
                row = self.row("decode", model_label(shape, agreement),
                               f"prefill pp{persistent.PREFILL}")
                row["tps"][who] = statistics.median(vals)
                row["reps"] = {who: vals}
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
                    base = got.get((who, "plain", c))
                    if mode == "draft-mtp" and base and base["agg_tps"]:
                        # issue 54: speculation must not lose to plain decoding here
                        row["speedup"][who] = v["agg_tps"] / base["agg_tps"]
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
                     "plain of the same engine. "
                     + ("Large shapes (27B, 35B-A3B and their tiny stand-ins; "
                        "scripts/gpu_check/shapes.py): trunk layers of a kind share weights "
                        "(each layer still read from its own bytes), 4-bit files (Q4_K: every "
                        "2-D weight Q4_K, not llama-quantize's Q4_K_M mix), one file per shape "
                        "with its MTP eh_proj rewritten per agreement; one process per engine "
                        "setting kept for a row group (ours: one process, a default-rule engine "
                        "and a fixed-draft engine whose per-request cap gives n_max 1-4; plain "
                        "= that engine without speculation), the same requests paired seconds "
                        "apart, one engine running at a time; llama-server's default n_max is "
                        "3. Notes: median step split per engine (ours: verify = target graph "
                        "compute, MTP runs x ms, host = Python, graph computes = syncs per "
                        "step, rebuilds; llama-server: ms per step from its timings, graphs "
                        "reused from its log)."
                        if any(x in shapes.BIG for x in self.args.shapes) else
                        "One fresh process per run, one engine at a time."))]
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
            {"meta": self.meta(), "rows": self.rows, "runs": self.runs, "starts": self.starts,
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
    ap.add_argument("--quant", choices=shapes.QUANTS, default="q4_k",
                    help="type of the large shapes' files (27b, 35b-a3b and their tiny "
                         "stand-ins; default q4_k)")
    ap.add_argument("--plan", action="store_true",
                    help="print the time plan of one device draw (plan.py) and exit")
    ap.add_argument("--budget", type=float, default=12.5,
                    help="--plan: gpu_check.sh's --budget minutes (default 12.5)")
    ap.add_argument("--new-build", action="store_true",
                    help="--plan: with llama-server b11549 (its build and its rows)")
    a = ap.parse_args()
    a.device = a.device or ("CUDA0" if a.backend == "cuda" else "Vulkan0")
    if a.device == "none":  # off a GPU: no -dev for either engine (with --ngl 0)
        a.device = None
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
        # the large shapes keep both agreements: the second is a rewritten MTP head, cheap
        a.agreements = a.agreements or ([0.95, 0.70] if all(x in shapes.BIG for x in a.shapes)
                                        else [0.95])
        a.prompt, a.gen, a.n, a.n_sampled, a.reps = 64, 16, 16, 16, 1
        a.mtp_reps = a.mtp_reps or 1
        a.n_max, a.temps, a.clients, a.requests = [1, 2, 3], [0.6], [1, 2], 1
        a.serve_prompt, a.serve_gen, a.ctx = 32, 16, 512
    else:
        a.shapes = a.shapes or ["27b", "35b-a3b"]
        a.agreements = a.agreements or [0.95, 0.70]
        # MTP rows: 256 tokens (128 take ~0.2 s on an H200's 0.8B shape), 5 paired reps
        a.prompt, a.gen, a.n, a.n_sampled, a.reps = 512, 128, 256, 96, 2
        # 5 paired reps for the small shapes' fresh processes (rows 52-54), 3 for the large
        # shapes' row groups (the device draw's 15 minutes: plan.py)
        a.mtp_reps = a.mtp_reps or (3 if all(x in shapes.BIG for x in a.shapes) else 5)
        a.n_max, a.temps, a.clients, a.requests = [1, 2, 3, 4], [0.6, 1.0], [1, 4, 8], 2
        a.serve_prompt, a.serve_gen, a.ctx = 128, 128, 2048
    return a


def plan_settings(a: argparse.Namespace, new_build: bool) -> plan_mod.Settings:
    return plan_mod.Settings(shapes=tuple(a.shapes), agreements=tuple(a.agreements),
                             n_max=tuple(a.n_max), reps=a.mtp_reps, n=a.n, parallel=4,
                             serve_parallel=max(a.clients), clients=tuple(a.clients),
                             serve_requests=a.requests, serve_gen=a.serve_gen,
                             new_build=new_build)


def shape_gib(shape: str) -> float:
    """A shape's file size: the file's where written, else from its tensor plan."""
    spec = shapes.model_spec(shape, 0.95, QUANT["q"])
    d = benchlib.CACHE / f"gpu_check-{spec.digest()}"
    f = d / f"{spec.model_name}-{QUANT['q'].upper()}.gguf"
    return (f.stat().st_size if f.exists() else shapes.file_bytes(shape, QUANT["q"])) / 2**30


def plan_text(a: argparse.Namespace) -> str:
    """The dry run: the time plan of one device draw for these shapes."""
    s = plan_settings(a, a.new_build)
    gib = {sh: shape_gib(sh) for sh in a.shapes}
    return plan_mod.format_plan(plan_mod.time_plan(a.budget, s, gib))


def big_main(a: argparse.Namespace, r: Runner) -> int:
    """The large shapes (and their tiny stand-ins): row groups in plan.py's priority order,
    each skipped when its estimate (scaled by what the finished groups took against
    theirs) would end past --deadline."""
    labels = [b for b, _ in a.llama]
    ref, newer = labels[0], labels[1:]  # 0.3.36 (our very ggml) first, b11549 after
    s = plan_settings(a, bool(newer))
    gib = {sh: shape_gib(sh) for sh in a.shapes}
    est = {it.name: it.seconds for it in plan_mod.time_plan(a.budget, s, gib).items}
    a0 = a.agreements[0]
    n_lo, n_hi = a.n_max[0], a.n_max[-1]
    items = []
    for sh in a.shapes:
        items.append((f"mtp {sh} a{a0} -np 1 (plain, default, n_max {n_lo}-{n_hi})",
                      lambda sh=sh: r.mtp_group(sh, a0, 1, a.n_max, a.n_max, [ref],
                                                prefill=True)))
    for sh in a.shapes:  # per shape: -np 4, then serve -np 8
        items.append((f"mtp {sh} a{a0} -np 4 (plain, default, best n_max)",
                      lambda sh=sh: r.mtp_group(sh, a0, 4, [r.best_n(sh, a0, "pyggspec")],
                                                [r.best_n(sh, a0, ref)], [ref])))
        items.append(((f"serve {sh} -np {max(a.clients)} ({'/'.join(map(str, a.clients))} "
                      "clients, plain and draft-mtp)"), lambda sh=sh: r.serve(sh, ref)))
    for g in a.agreements[1:]:
        for sh in a.shapes:
            items.append((f"mtp {sh} a{g} -np 1",
                          lambda sh=sh, g=g: r.mtp_group(sh, g, 1, a.n_max, a.n_max, [ref])))
    for b in newer:
        for sh in a.shapes:
            items.append((f"mtp {sh} a{a0} -np 1 llama {b}",
                          lambda sh=sh, b=b: r.mtp_group(sh, a0, 1, a.n_max, a.n_max, [b],
                                                         ours=False)))
    t0 = time.monotonic()
    for name, fn in items:
        key = name.replace(f" llama {newer[0]}", " llama b11549") if newer else name
        r.item_est(name, est.get(key, 60.0), fn)
    r.write()
    print(f"[bench] done in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    print(r.markdown())
    return 0


def main() -> int:
    a = parse_args()
    QUANT["q"] = a.quant
    if a.plan:
        print(plan_text(a), end="")
        return 0
    if a.make_models:
        for shape in a.shapes:
            # the large shapes: one file, the other agreements are a rewritten eh_proj
            for agr in a.agreements[:1] if shape in shapes.BIG else a.agreements:
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
    if all(x in shapes.BIG for x in a.shapes):
        return big_main(a, r)
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
