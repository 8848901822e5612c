"""gpu_check's time plan for one device draw: what runs when, from measured build times and
writer throughput and estimated engine speeds; a pure function of its inputs.

``time_plan(...)`` lays the stages of one ``gpu_check.sh device`` run on a clock that starts
when the device tool asks for a machine: the machine's start, the builds (critical path:
llama-cpp-python with CUDA, then the native binding, then llama-server 0.3.36; the device
tests run beside the llama-server build), the models written beside the builds (they must
be done when the builds are), then the benchmark items in priority order, each with its
estimated seconds. Items that would end after the draw's budget are marked skipped, as the
running benchmarks skip them (bench.py scales the estimates by what the finished items
took). ``format_plan`` prints it; ``bench.py --plan`` / ``gpu_check.sh plan`` show it.

Sources of the numbers (H200, 16 cores; docs/data/row5{2,4}-gpu_check-h200-*.timings.txt):
llama-cpp-python 0.3.36 CUDA (sm_90, 16 jobs) 298 / 308 / 29 (resumed) s, llama-server 0.3.36
on that ggml 53 / 56 / 63 s, native binding 5-7 s, wheels 3-6 s, device tests 15-16 s. The
model writer: measured off a GPU (``WRITER`` below). Engine speeds, load times and
process starts on the large shapes: estimates (nobody has run them on a GPU yet), stated
in ``ENGINE``; the running benchmarks replace them with what they measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- measured ------------------------------------------------------------------------------
BUILD_S = {  # seconds on the H200 (rows 52, 54); b11549: not built there yet (estimate)
    "wheels": 4.0, "llama-cpp-python": 303.0, "native": 6.0, "llama-server 0.3.36": 55.0,
    "llama-server b11549": 330.0,
}
TESTS_S = 16.0
MACHINE_START_S = 90.0  # "a minute or more" (device README); row 54's first reply: ~1.5 min
RETURN_S = 30.0  # the last reply's transfer and the give-back (estimate)
DRAW_MIN = 15.0  # device time of one drawn task, all of it
# the writer (pyggspec.testing with shared_layers, Q4_K), measured off a GPU on 2026-12-02:
# 2 threads (PYGGSPEC_WRITER_THREADS=2) at nice 19 on a 2-core AVX-512 VM shared with other
# work; wall and CPU seconds (user + sys) of the whole file, its size
# (scripts/gpu_check/measure_writer.py; docs/data/gpu_check-offgpu-cb7173a.md)
WRITER = {"27b": {"s": 223.2, "cpu_s": 354.0, "gib": 14.33},
          "35b-a3b": {"s": 319.3, "cpu_s": 451.8, "gib": 18.68},
          "tiny-dense": {"s": 1.0, "cpu_s": 1.0, "gib": 0.003},
          "tiny-moe": {"s": 1.0, "cpu_s": 1.0, "gib": 0.017}}
# on the device each writer gets ~WRITER_DEVICE_CORES cores beside the CUDA build (nice 5
# against nvcc's 16 jobs: an assumption), at this VM's speed per core (the H200 host's Xeon
# cores are taken as no faster); the build loses the writers' CPU seconds over 16 cores
WRITER_DEVICE_CORES = 4.0
DEVICE_CORES = 16.0
DISK_GIB = 64.0
BUILD_GIB = 6.0  # .gpu/build with both llama.cpp trees (estimate)

# --- estimated (no GPU run of these shapes yet) --------------------------------------------
ENGINE = {
    # plain decode tokens/s at -np 1, one process start, and load seconds per GiB; spec
    # step cost grows by ``verify_per_draft`` of a plain step per drafted token (dense GPU
    # verify ~1.1x a step for 4 rows: DESIGN §10; MoE reads more experts per extra row)
    "27b": {"plain_tps": 135.0, "start_s": 4.0, "load_s_per_gib": 0.35,
            "verify_per_draft": 0.06, "mtp_per_draft": 0.04},
    "35b-a3b": {"plain_tps": 230.0, "start_s": 4.0, "load_s_per_gib": 0.35,
                "verify_per_draft": 0.25, "mtp_per_draft": 0.08},
    # the off-GPU stand-ins on 2 CPU cores (GPU_CHECK_NO_CUDA=1): only for skipping there
    "tiny-dense": {"plain_tps": 150.0, "start_s": 4.0, "load_s_per_gib": 1.0,
                   "verify_per_draft": 0.5, "mtp_per_draft": 0.2},
    "tiny-moe": {"plain_tps": 100.0, "start_s": 4.0, "load_s_per_gib": 1.0,
                 "verify_per_draft": 0.5, "mtp_per_draft": 0.2},
}


@dataclass
class Settings:
    """The benchmark settings the plan prices (bench.py's defaults for the large shapes)."""

    shapes: tuple[str, ...] = ("27b", "35b-a3b")
    agreements: tuple[float, ...] = (0.95, 0.70)
    n_max: tuple[int, ...] = (1, 2, 3, 4)
    reps: int = 3
    n: int = 256  # tokens per MTP request
    parallel: int = 4  # the -np 4 rows
    serve_parallel: int = 8
    clients: tuple[int, ...] = (1, 4, 8)
    serve_requests: int = 2
    serve_gen: int = 128
    new_build: bool = False  # b11549 beside 0.3.36


@dataclass
class Item:
    name: str
    seconds: float
    start: float = 0.0
    fits: bool = True
    detail: str = ""

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class Plan:
    budget_s: float
    stages: list[Item] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    bench_start: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def end(self) -> float:
        done = [i.end for i in self.items if i.fits]
        return max(done, default=self.bench_start)


def accept_tokens(a: float, n: int) -> float:
    """Expected tokens per step with n drafts each accepted with probability a (in a row)."""
    return sum(a ** i for i in range(n + 1))


def tps(shape: str, n: int, a: float, P: int = 1) -> float:
    """Estimated tokens/s of one sequence (P: concurrent sequences, aggregate)."""
    e = ENGINE[shape]
    base = e["plain_tps"]
    if n == 0:
        per_seq = base
    else:
        cost = 1.0 + n * (e["verify_per_draft"] + e["mtp_per_draft"])
        per_seq = base * accept_tokens(a, n) / cost
    # a batch of P rows costs ~1 + 0.15 (P - 1) of one row on a memory-bound step
    return per_seq * P / (1.0 + 0.15 * (P - 1))


def load_s(shape: str, gib: float) -> float:
    e = ENGINE[shape]
    return e["start_s"] + gib * e["load_s_per_gib"]


def mtp_group_s(shape: str, gib: float, a: float, s: Settings, P: int,
                llama_n: tuple[int, ...], ours_n: tuple[int, ...], builds: int = 1,
                ours: bool = True) -> tuple[float, str]:
    """One row group: our host (two engines), one llama-server per setting, ``s.reps``
    paired requests each, plus a prefill request per repetition."""
    ld = load_s(shape, gib)
    req = s.n * P
    t_ours = 0.0
    if ours:
        t_ours = ld + gib * ENGINE[shape]["load_s_per_gib"] + 4.0  # 2 engines + warm-ups
        t_ours += s.reps * sum(req / tps(shape, k, a, P) + 0.3
                               for k in (0, *ours_n, 3))  # plain, fixed, default
    t_llama = builds * len((0, *llama_n)) * (ld + 2.0)
    t_llama += builds * s.reps * sum(req / tps(shape, k, a, P) + 0.3 for k in (0, *llama_n))
    return t_ours + t_llama, (("ours 1 process, 2 engines; " if ours else "")
                              + f"llama-server {builds} x {1 + len(llama_n)} processes; "
                              f"{s.reps} reps")


def serve_s(shape: str, gib: float, s: Settings) -> float:
    t = 4 * (load_s(shape, gib) + 2.0)  # ours / llama-server, plain / draft-mtp
    for c in s.clients:
        for spec in (0, 3):
            one = s.serve_gen / (tps(shape, spec, 0.95, min(c, s.serve_parallel)) / c)
            t += 2 * s.serve_requests * one
    return t


def time_plan(budget_min: float = 12.5, s: Settings | None = None,
              gib: dict[str, float] | None = None,
              writer_s: dict[str, float] | None = None) -> Plan:
    """The stages and items of one draw: ``budget_min`` is gpu_check.sh's ``--budget``, the
    minutes from the worker's start on the machine (the clock here) until no benchmark item
    may start that would not end by then; the machine's start before it and the last reply
    and give-back after it are the rest of the draw's 15 minutes. ``gib``: each shape's
    file size; ``writer_s``: its writing time on the device (default: ``WRITER`` scaled by
    ``WRITER_DEVICE_SPEEDUP``)."""
    s = s or Settings()
    gib = gib or {k: v["gib"] for k, v in WRITER.items()}
    writer_s = writer_s or {k: v["cpu_s"] / WRITER_DEVICE_CORES for k, v in WRITER.items()}
    p = Plan(budget_s=budget_min * 60.0)
    t = 0.0
    stolen = sum(WRITER.get(sh, {}).get("cpu_s", 0.0) for sh in s.shapes) / DEVICE_CORES
    for name in ("wheels", "llama-cpp-python", "native"):
        sec = BUILD_S[name] + (stolen if name == "llama-cpp-python" else 0.0)
        p.stages.append(Item(name + (f" (+{stolen:.0f}s: the writers' CPU)" if name ==
                                     "llama-cpp-python" and stolen else ""), sec, t))
        t += sec
    server = Item("llama-server 0.3.36", BUILD_S["llama-server 0.3.36"], t)
    tests = Item("device tests (beside the llama-server build)", TESTS_S, t)
    p.stages += [server, tests]
    t += max(server.seconds, tests.seconds)
    w0 = BUILD_S["wheels"]
    w_end = w0
    for shape in s.shapes:  # one writer process per shape, in parallel with the builds
        ws = writer_s.get(shape, 0.0)
        p.stages.append(Item(f"write {shape} ({gib.get(shape, 0):.1f} GiB, beside the builds)",
                             ws, w0))
        w_end = max(w_end, w0 + ws)
    if w_end > t:
        p.notes.append(f"the models end {w_end - t:.0f}s after the builds: the benchmarks wait")
        t = w_end
    need = sum(gib.get(sh, 0.0) for sh in s.shapes) + BUILD_GIB
    p.notes.append(f"disk: {need:.1f} GiB of {DISK_GIB:.0f} (models {need - BUILD_GIB:.1f}, "
                   f"builds ~{BUILD_GIB:.0f})")
    if s.new_build:  # beside the llama-server 0.3.36 build; the benchmarks wait for it
        # (both builds take all cores: the sum of their times, not the longer one)
        b = Item("llama-server b11549 (its own CUDA ggml, beside 0.3.36's: the CPU shared)",
                 BUILD_S["llama-server b11549"], server.end)
        p.stages.append(b)
        t = max(t, b.end)
    p.bench_start = t
    items: list[Item] = []
    a0 = s.agreements[0]
    for shape in s.shapes:  # 1: -np 1 at the first agreement, every n_max, both engines
        sec, d = mtp_group_s(shape, gib[shape], a0, s, 1, s.n_max, s.n_max)
        items.append(Item(f"mtp {shape} a{a0} -np 1 (plain, default, n_max "
                          f"{s.n_max[0]}-{s.n_max[-1]})", sec, detail=d))
    for shape in s.shapes:  # 2: per shape -np 4 (plain / default / best fixed), then serve
        sec, d = mtp_group_s(shape, gib[shape], a0, s, s.parallel, (3,), (3,))
        items.append(Item(f"mtp {shape} a{a0} -np {s.parallel} (plain, default, best n_max)",
                          sec, detail=d))
        items.append(Item(f"serve {shape} -np {s.serve_parallel} ({'/'.join(map(str, s.clients))}"
                          " clients, plain and draft-mtp)", serve_s(shape, gib[shape], s),
                          detail="4 server processes"))
    for a in s.agreements[1:]:  # 4: the other agreement at -np 1 (eh_proj rewritten)
        for shape in s.shapes:
            sec, d = mtp_group_s(shape, gib[shape], a, s, 1, s.n_max, s.n_max)
            items.append(Item(f"mtp {shape} a{a} -np 1", sec + 3.0, detail=d))
    if s.new_build:  # 5: b11549 beside 0.3.36 (llama-server only)
        for shape in s.shapes:
            sec, d = mtp_group_s(shape, gib[shape], a0, s, 1, s.n_max, (), ours=False)
            items.append(Item(f"mtp {shape} a{a0} -np 1 llama b11549", sec, detail=d))
    t_item = t
    for it in items:
        it.start = t_item
        it.fits = it.end <= p.budget_s
        if it.fits:
            t_item = it.end
    p.items = items
    return p


def format_plan(p: Plan) -> str:
    def mmss(x: float) -> str:
        return f"{int(x // 60):2d}:{int(x % 60):02d}"

    out = [(f"gpu_check time plan (H200): --budget {p.budget_s / 60:.1f} min, the clock from the "
           "worker's start on the machine"), "",
           "  start   end   seconds  stage"]
    for st in p.stages:
        out.append(f"  {mmss(st.start)} {mmss(st.end)}  {st.seconds:7.0f}  {st.name}")
    out += ["", f"  benchmarks from {mmss(p.bench_start)} (priority order; estimated seconds):",
            "  start   end   seconds  item"]
    for it in p.items:
        mark = "" if it.fits else "   SKIPPED (past the budget)"
        out.append(f"  {mmss(it.start)} {mmss(it.end)}  {it.seconds:7.0f}  {it.name}{mark}"
                   + (f"  [{it.detail}]" if it.detail and it.fits else ""))
    total = MACHINE_START_S + p.end + RETURN_S
    out += ["", f"  last item ends at {mmss(p.end)} of {mmss(p.budget_s)}"
            + (" (fits)" if p.end <= p.budget_s else " (OVER)"),
            f"  device time: machine start ~{MACHINE_START_S:.0f}s + {p.end:.0f}s + last reply "
            f"and give-back ~{RETURN_S:.0f}s = {total / 60:.1f} min of the draw's "
            f"{DRAW_MIN:.0f}" + (" (fits)" if total <= DRAW_MIN * 60 else " (OVER)")]
    out += [f"  note: {n}" for n in p.notes]
    return "\n".join(out) + "\n"
