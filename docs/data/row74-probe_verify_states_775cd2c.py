"""The "before" row of docs/benchmarks.md row 74: at 775cd2c, the 4 x 4 verify graph writing
T snapshots into planes against the same graph writing final states only (the procedure of
scripts/probe_verify_states.py, which needs 6d1e393 or later)."""
import statistics
import sys
import time

sys.path.insert(0, 'scripts')  # run from a checkout of 775cd2c: PYTHONPATH=. python3 THIS 0.7 Q4_K_M
import benchlib
import numpy as np

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.models.batch import UBatch

path = benchlib.bench_model(float(sys.argv[1]), sys.argv[2])
B = T = 4
e = Engine(str(path), n_ctx=2048 * B, n_parallel=B, n_threads=2, load_tokenizer=False,
           progress=False, spec_type="draft-mtp", spec=SpecConfig(n_max=3, rollback="snapshot"))
w, mem = e.worker, e.worker.memory
for s in range(B):
    e.decode({s: benchlib.bench_prompt(32, path, seed=s)})
rng = np.random.default_rng(0)
def ub(nw):
    src = np.array([mem.state_row(s) for s in range(B)], np.int32)
    planes = [mem.spare_planes(s)[:nw] for s in range(B)]
    dst = np.array([[mem.state_row(s, planes[s][j]) for s in range(B)] for j in range(nw)], np.int32)
    return UBatch(rng.integers(10, 1000, size=(B, T)).astype(np.int32),
                  np.array([mem.length(s) for s in range(B)], np.int64), tuple(range(B)),
                  np.arange(B * T, dtype=np.int32), hidden=True, state_src=src, state_dst=dst)
runs = {1: [], T: []}
for rep in range(14):
    for nw in ((T, 1) if rep % 2 else (1, T)):
        u = ub(nw); t0 = time.perf_counter(); w.target.run(u, copy=False)
        runs[nw].append((time.perf_counter() - t0) * 1e3)
f, k = statistics.median(runs[1][2:]), statistics.median(runs[T][2:])
print(f"OLD {sys.argv[2]} 4x4: final states only {f:.1f} ms; snapshots into planes {k:.1f} ms = +{k-f:.1f} ms ({k/f-1:+.1%})")
