"""Before/after check for changes of shape: the same generations, draft counts and memory
figures on the generated test models, as one JSON object (compare two commits' outputs).

    python3 scripts/shape_check.py > before.json      # at the old commit
    python3 scripts/shape_check.py > after.json       # at the new one
    python3 scripts/shape_check.py --compare before.json after.json

Everything compared is deterministic (greedy or seeded); ``wall_ms_per_step`` and
``python_ms_per_step`` (a plain decode step's wall time and host share on the tiny model,
medians of 5 requests) are printed beside, not compared. To time an older commit, run this
script with ``PYTHONPATH`` at that commit's checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.testing import cached_model, tiny_dense, tiny_moe

# the adaptive policy chooses draft lengths from measured costs: its counts vary run to run
# (two runs of the same commit differ), its tokens do not
TIMED = {("dense/spec-adaptive", "spec")}
PROMPTS = [[5, 9, 14, 3, 7, 22, 8], [11, 4, 4, 19, 2], [30, 31, 32, 33, 34, 35, 36, 37, 38],
           [6, 2, 9]]


def _spec(**kw):
    from pyggspec.engine import SpecConfig  # where it lives may move; the engine re-exports

    return SpecConfig(**kw)


def _run(path: Path, *, n_parallel: int = 1, spec: dict | None = None, sampling=None,
         prompts=PROMPTS[:1], max_tokens: int = 40, **kw) -> dict:
    args = {"n_ctx": 256, "n_parallel": n_parallel, "load_tokenizer": False, "progress": False}
    if spec is not None:
        args.update(spec_type="draft-mtp", spec=_spec(**spec))
    args.update(kw)
    with Engine(path, **args) as e:
        res = e.generate_batch(prompts, max_tokens=max_tokens, ignore_eos=True,
                               sampling=sampling)
        out = {"tokens": [r.tokens for r in res], "stop": [r.stop_reason for r in res],
               "memory": e.memory(), "plan": e.memory_plan.to_dict()}
        if spec is not None:
            st = res.stats if hasattr(res, "stats") else e.stats  # per call (new) or engine (old)
            out["spec"] = {"n_drafted": st.n_drafted, "n_accepted": st.n_accepted,
                           "n_steps": st.n_steps, "n_target_evals": st.n_target_evals,
                           "n_mtp_evals": st.n_mtp_evals,
                           "draft_lengths": list(st.draft_lengths)}
    return out


def _reuse(path: Path) -> dict:
    """Prompt reuse through the scheduler: a second prompt extending the first."""
    args = {"n_ctx": 256, "n_parallel": 1, "load_tokenizer": False, "progress": False,
                "spec_type": "draft-mtp", "spec": _spec(n_max=3), "checkpoint_min_step": 4}
    with Engine(path, **args) as e:
        a = e.generate(PROMPTS[2], max_tokens=12, ignore_eos=True)
        b = e.generate(PROMPTS[2] + a.tokens + [3, 4], max_tokens=12, ignore_eos=True)
        c = e.generate(PROMPTS[2][:5] + [1, 2], max_tokens=12, ignore_eos=True)
        return {"tokens": [a.tokens, b.tokens, c.tokens],
                "cache_n": [a.cache_n, b.cache_n, c.cache_n]}


def _python_share(path: Path) -> tuple[float, float]:
    """(wall ms per plain decode step, host share of it in ms): medians of 5 requests of
    300 tokens on one engine, after a warm-up (the tiny model's device time is small, so
    the wall time is mostly the Python of a step)."""
    walls, pys = [], []
    with Engine(path, n_ctx=512, load_tokenizer=False, progress=False) as e:
        e.generate(PROMPTS[0], max_tokens=16, ignore_eos=True)
        for _ in range(5):
            t0 = time.perf_counter()
            r = e.generate(PROMPTS[0], max_tokens=300, ignore_eos=True)
            walls.append((time.perf_counter() - t0) * 1000 / 300)
            pys.append(statistics.median(r.timings.python_ms))
    return statistics.median(walls), statistics.median(pys)


def collect() -> dict:
    d = Path(tempfile.gettempdir()) / "pyggspec-shape-check"
    d.mkdir(exist_ok=True)
    dense = cached_model(tiny_dense(dtype="q8_0", agreement=0.9), d)
    moe = cached_model(tiny_moe(dtype="q8_0", agreement=0.9), d)
    seeded = SamplingParams(temp=0.9, seed=7)
    out: dict = {}
    for name, path in (("dense", dense), ("moe", moe)):
        out[f"{name}/plain"] = _run(path)
        out[f"{name}/plain-seeded"] = _run(path, sampling=seeded)
        out[f"{name}/spec-greedy"] = _run(path, spec={"n_max": 3})
        out[f"{name}/spec-seeded-coupled"] = _run(path, spec={"n_max": 3}, sampling=seeded)
        out[f"{name}/spec-seeded-greedy-drafts"] = _run(
            path, spec={"n_max": 2, "draft_sampling": "greedy"}, sampling=seeded)
        out[f"{name}/spec-checkpoint"] = _run(path, spec={"n_max": 3, "rollback": "checkpoint"})
        out[f"{name}/np3-spec"] = _run(path, n_parallel=3, spec={"n_max": 3}, prompts=PROMPTS)
        out[f"{name}/np3-plain-seeded"] = _run(path, n_parallel=3, prompts=PROMPTS,
                                               sampling=seeded)
        out[f"{name}/reuse"] = _reuse(path)
    out["dense/spec-adaptive"] = _run(dense, spec={"n_max": 3, "adaptive": True},
                                      prompts=PROMPTS[:2], n_parallel=2)
    out["dense/spec-p-min"] = _run(dense, spec={"n_max": 4, "p_min": 0.5})
    out["dense/np2-pmin-short"] = _run(dense, n_parallel=2, spec={"n_max": 3},
                                       prompts=PROMPTS[:3], max_tokens=7, n_ubatch=4)
    return out


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args()
    if a.compare:
        x, y = (json.loads(Path(p).read_text()) for p in a.compare)
        bad = 0
        print(f"{'case':32} {'what':8} {'before':>12} {'after':>12}")
        for k in sorted(set(x["cases"]) | set(y["cases"])):
            cx, cy = x["cases"].get(k, {}), y["cases"].get(k, {})
            for part in sorted(set(cx) | set(cy)):
                dx, dy = _digest(cx.get(part)), _digest(cy.get(part))
                if (k, part) in TIMED:
                    print(f"{k:32} {part:8} {dx:>12} {dy:>12} (timing-dependent: not compared)")
                    continue
                bad += dx != dy
                print(f"{k:32} {part:8} {dx:>12} {dy:>12} {'' if dx == dy else 'DIFFERS'}")
        for k in ("wall_ms_per_step", "python_ms_per_step"):
            print(f"{k} (plain, tiny dense): {x.get(k)} -> {y.get(k)}")
        print("identical" if not bad else f"{bad} parts differ")
        return 1 if bad else 0
    res = {"cases": collect()}
    if not a.no_timing:
        d = Path(tempfile.gettempdir()) / "pyggspec-shape-check"
        wall, py = _python_share(cached_model(tiny_dense(dtype="q8_0", agreement=0.9), d))
        res["python_ms_per_step"] = round(py, 4)
        res["wall_ms_per_step"] = round(wall, 4)
    json.dump(res, sys.stdout, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
