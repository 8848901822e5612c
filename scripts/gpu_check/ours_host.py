#!/usr/bin/env python3
"""One long-lived pyggspec process for gpu_check's large shapes: engines opened once, then
greedy requests on demand, each with where its steps' time went.

Why: a 27B / 35B-A3B file takes seconds to load per engine, and a fresh process per run
(rows 50-54) would spend the device budget on loading. The engines of one row group stay
open for its repetitions; llama-server gets one process per setting, kept for the group.

    python3 ours_host.py CONFIG_JSON        (CONFIG_JSON: {"path", "common", "engines"})

``common``: Engine keywords for every engine (n_ctx, n_parallel, n_threads, n_gpu_layers,
device); ``engines``: name -> {"spec_type": ..., "spec": SpecConfig keywords}. It prints one
JSON line ``{"ready": ..., "load_s": {...}}``, then answers each stdin line (JSON: engine,
prompts, n, speculative, n_draft_max) with one JSON line: tokens, tps, acceptance and
``split``, the requests' steps taken apart from the engine's own counters (read from the
outside: worker.py is not changed):

* ``steps``: decode/verify steps (prompt chunks excluded), ``ms_per_step`` their wall time;
* ``host_ms_per_step``: the part outside graph computes (Python: scheduling, inputs,
  outputs, sampling on the host, the draft-length rule);
* ``verify_ms_per_step``: the target graph's compute (``GraphRunner.compute_ms_total``:
  the wall time inside ggml_backend_sched_graph_compute, launches and the wait included,
  not kernel time alone); ``mtp_ms_per_run`` / ``mtp_runs_per_step``: the MTP head's;
* ``syncs_per_step``: graph computes per step (``GraphRunner.execute`` calls, counted by
  wrapping it: each ends in a synchronisation, the host waiting for the device before it
  reads the outputs);
* ``builds`` / ``rebuilds`` / ``build_ms``: graphs built (shapes seen again included) and
  the time building and allocating them took, during these requests.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def open_engines(cfg: dict) -> tuple[dict, dict]:
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine

    engines, load = {}, {}
    for name, kw in cfg["engines"].items():
        t0 = time.perf_counter()
        extra = dict(cfg["common"])
        if kw.get("spec_type"):
            extra["spec_type"] = kw["spec_type"]
            extra["spec"] = SpecConfig(**kw.get("spec", {}))
        e = engines[name] = Engine(cfg["path"], load_tokenizer=False, progress=False, **extra)
        # warm-up: a 64-token request (llama-server's warm-up is as long: persistent.py)
        warm = [301, 302, 303, 304, 305, 306, 307, 308]
        e.generate_batch([warm] * e.n_parallel, max_tokens=64, ignore_eos=True)
        load[name] = round(time.perf_counter() - t0, 2)
    return engines, load


def counters(e) -> dict:
    w = e.worker
    out = {}
    for part, r in (("target", w.target), ("mtp", w.mtp)):
        if r is None:
            continue
        out[part] = {"compute_ms": r.compute_ms_total, "build_ms": r.build_ms_total,
                     "builds": r.n_builds, "rebuilds": r.n_rebuilds}
    return out


def run(e, cmd: dict) -> dict:
    """The command's greedy requests (prompt i in slot i), stepped to the end."""
    from pyggspec.serving.request import Request

    steps: list[dict] = []
    before = e.worker.run

    def traced(batch):
        k0, n0 = counters(e), dict(computes)
        out = before(batch)
        if batch.decode and not batch.prompt:  # decode/verify steps only, not prompt chunks
            k1 = counters(e)
            steps.append({"ms": out.decode_ms, "device_ms": out.device_ms,
                          "target": computes["target"] - n0["target"],
                          "mtp": computes["mtp"] - n0["mtp"],
                          **{f"{k}_ms": k1[k]["compute_ms"] - k0[k]["compute_ms"] for k in k1}})
        return out

    computes = {"target": 0, "mtp": 0}  # graph computes: each ends in a synchronisation
    wrapped = []
    for part, r in (("target", e.worker.target), ("mtp", e.worker.mtp)):
        if r is None:
            continue

        def execute(*a, _f=r.execute, _p=part, **k):
            computes[_p] += 1
            return _f(*a, **k)

        r.execute = execute
        wrapped.append(r)
    c0 = counters(e)
    e.worker.run = traced
    t0 = time.perf_counter()
    try:
        hs = [e.submit(Request(list(p), max_tokens=cmd["n"], ignore_eos=True, slot=i,
                               speculative=cmd.get("speculative"),
                               n_draft_max=cmd.get("n_draft_max")))
              for i, p in enumerate(cmd["prompts"])]
        while e.step():
            pass
    finally:
        e.worker.run = before
        for r in wrapped:
            del r.execute  # the class's method again
    wall = time.perf_counter() - t0
    c1 = counters(e)
    res = [h.result() for h in hs]
    n_tok = sum(len(r.tokens) for r in res)
    t = res[0].timings.to_dict(host=True)
    out = {"tokens": [r.tokens for r in res], "wall_s": wall,
           "tps": t["predicted_per_second"] if len(res) == 1 else n_tok / wall,
           "prefill_tps": t["prompt_per_second"]}
    drafted = sum(r.timings.draft_n for r in res)
    if drafted:
        out["accept"] = sum(r.timings.draft_n_accepted for r in res) / drafted
    n = max(len(steps), 1)
    d = {k: sum(s.get(f"{k}_ms", 0.0) for s in steps) for k in c1}
    split = {"steps": len(steps),
             "ms_per_step": sum(s["ms"] for s in steps) / n,
             "ms_per_step_median": statistics.median(s["ms"] for s in steps) if steps else 0.0,
             "host_ms_per_step": sum(s["ms"] - s["device_ms"] for s in steps) / n,
             "verify_ms_per_step": d.get("target", 0.0) / n,
             "verify_ms_per_step_median": (statistics.median(s.get("target_ms", 0.0)
                                                             for s in steps) if steps else 0.0),
             "syncs_per_step": sum(s["target"] + s["mtp"] for s in steps) / n,
             "builds": sum(c1[k]["builds"] - c0[k]["builds"] for k in c1),
             "rebuilds": sum(c1[k]["rebuilds"] - c0[k]["rebuilds"] for k in c1),
             "build_ms": sum(c1[k]["build_ms"] - c0[k]["build_ms"] for k in c1)}
    runs = sum(s["mtp"] for s in steps)
    if "mtp" in d and runs:
        split["mtp_ms_per_run"] = d["mtp"] / runs
        split["mtp_runs_per_step"] = runs / n
    out["split"] = split
    return out


def main() -> int:
    cfg = json.loads(sys.argv[1])
    engines, load = open_engines(cfg)
    print(json.dumps({"ready": True, "load_s": load}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = run(engines[cmd["engine"]], cmd)
        except Exception as e:  # noqa: BLE001 - the caller reports it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
