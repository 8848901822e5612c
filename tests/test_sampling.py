"""Sampler chains: graph path vs host path pick the same token, distributions, fallbacks."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pyggspec.ggml import buffer, context, device, sched
from pyggspec.sampling import (
    DeviceSampling,
    RowInput,
    SamplerChain,
    SamplingParams,
    SamplingStats,
    force_unsupported,
    gumbel_noise,
    plan_chain,
    sample_host,
)
from pyggspec.sampling.params import parse_logit_bias, parse_samplers


class Harness:
    """Logits live in a buffer on ``dev`` (like the LM head output), the sampler ops are
    appended after them, the scheduler runs the graph; graph reused for every step."""

    def __init__(self, backends, dev, plan, rows_per_seq=1, stats=None):
        V, R = plan.n_vocab, plan.n_rows
        self.lctx = context.Context(2)
        self.logits_leaf = self.lctx.new_tensor("f32", (V, R), "logits_store")
        self.lbuf = buffer.Buffer.for_context(self.lctx, dev, "logits")
        self.ctx = context.Context(256, graph_size=512)
        self.graph = sched.Graph(self.ctx, [], 512)
        # an op on the device produces the logits the sampler reads
        logits = self.ctx.scale(self.logits_leaf, 1.0)
        self.graph.expand(logits)
        self.handle = DeviceSampling.build(self.ctx, self.graph, logits, plan, rows_per_seq,
                                           stats=stats)
        self.sched = sched.BackendScheduler(backends, graph_size=512)
        self.plan = plan

    def step(self, logits: np.ndarray, rows) -> np.ndarray:
        self.sched.alloc(self.graph)
        self.logits_leaf.set(np.ascontiguousarray(logits, dtype=np.float32))
        self.handle.set_inputs(rows)
        self.sched.compute(self.graph)
        return self.handle.finish_host(rows)

    def close(self):
        self.handle.close()
        self.sched.close()
        self.ctx.close()
        self.lbuf.close()
        self.lctx.close()


@pytest.fixture(scope="module")
def cpu():
    b = device.cpu_device().open(n_threads=1)
    yield b
    b.close()


def _logits(kind: str, R: int, V: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal((R, V)) * 3
    elif kind == "heavy":  # real-looking: a few dominant tokens, long heavy tail
        x = rng.standard_t(2, size=(R, V)) * 1.5
        x[:, rng.integers(0, V, 5)] += 12
    else:  # "ties": coarse values, many exact ties including at maxima and top-k boundary
        x = np.round(rng.standard_normal((R, V)) * 2) / 2
    return x.astype(np.float32)


CHAINS = {
    "default": SamplingParams(seed=7),
    "greedy": SamplingParams(temp=0.0, seed=1),
    "greedy_pen_bias": SamplingParams(temp=0.0, repeat_penalty=1.5, frequency_penalty=0.3,
                                      logit_bias=((3, 5.0), (11, -np.inf))),
    "pen_all": SamplingParams(seed=3, repeat_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.2, repeat_last_n=8),
    "no_topk_minp": SamplingParams(seed=4, top_k=0, top_p=1.0, min_p=0.1, temp=0.7),
    "temp_first": SamplingParams(seed=5, samplers=("temperature", "min_p", "top_k", "top_p"),
                                 temp=1.3),
    "topk_temp_dist": SamplingParams(seed=6, top_p=1.0, min_p=0.0, top_k=20, temp=0.9,
                                     samplers=("top_k", "temperature")),
    "typical": SamplingParams(seed=8, typical_p=0.9, samplers=("penalties", "typ_p", "top_k",
                                                              "temperature"),
                              repeat_penalty=1.2),
    "minp_first": SamplingParams(seed=9, samplers=("min_p", "penalties", "top_k", "top_p",
                                                   "temperature"), repeat_penalty=1.1,
                                 logit_bias=((0, 1.0),)),
    "plain_dist": SamplingParams(seed=10, top_k=0, top_p=1.0, min_p=0.0, temp=1.0),
}


def _compare(cpu, params, logits, rows_per_seq=1, n_steps=3, seed=0):
    """Run n_steps with every row, device vs host; returns the plan used."""
    R, V = logits.shape
    n_seq = R // rows_per_seq
    dev = device.cpu_device()
    plan = plan_chain(params, dev, V, R, True)
    h = Harness([cpu], dev, plan, rows_per_seq)
    rng = np.random.default_rng(seed)
    chains = [SamplerChain(params, V) for _ in range(n_seq)]
    for c in chains:
        c.accept_prompt(rng.integers(0, V, 20).tolist() + [3, 3, 11])
    try:
        for step in range(n_steps):
            drafts = [rng.integers(0, V, rows_per_seq - 1).tolist() for _ in range(n_seq)]
            rows = [RowInput(chains[s], tuple(drafts[s][:i]))
                    for s in range(n_seq) for i in range(rows_per_seq)]
            got = h.step(logits, rows)
            want = [sample_host(ri.chain, logits[r], ri.prefix) for r, ri in enumerate(rows)]
            assert got.tolist() == want, (step, plan.describe())
            for s in range(n_seq):
                chains[s].accept(int(got[s * rows_per_seq]))
            logits = np.roll(logits, 7, axis=1)
    finally:
        h.close()
    return plan


@pytest.mark.parametrize("kind", ["normal", "heavy", "ties"])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_device_and_host_pick_same_token(cpu, name, kind):
    logits = _logits(kind, 4, 3000, hash((name, kind)) % 1000)
    plan = _compare(cpu, CHAINS[name], logits)
    assert plan.n_device >= 1 or CHAINS[name].samplers[0] == "typ_p"


def test_plans_are_what_we_expect():
    dev = device.cpu_device()
    d = plan_chain(CHAINS["default"], dev, 3000, 2, True).describe()
    assert d["device_stages"] == ["top_k"] and d["output"] == "candidates"
    assert d["host_stages"] == ["top_p", "min_p", "temperature", "dist"]
    g = plan_chain(CHAINS["greedy_pen_bias"], dev, 3000, 2, True).describe()
    assert g["device_stages"] == ["logit_bias", "penalties", "greedy"] and g["output"] == "token"
    m = plan_chain(CHAINS["no_topk_minp"], dev, 3000, 2, True).describe()
    assert m["device_stages"] == ["min_p", "temperature", "dist"]
    t = plan_chain(CHAINS["typical"], dev, 3000, 2, True).describe()
    assert t["device_stages"] == ["penalties"] and t["output"] == "logits"
    assert any("typ_p" in r for r in t["reasons"])
    off = plan_chain(CHAINS["default"], dev, 3000, 2, False)
    assert off.n_device == 0 and off.output == "none"


def test_verify_rows_and_multi_sequence(cpu):
    """2 sequences x 4 rows (a verify step): each row sees its drafts in the penalty window
    and the noise counter of its position; different seeds / temps per sequence."""
    p = SamplingParams(seed=11, repeat_penalty=1.4, top_k=0, top_p=1.0, min_p=0.02,
                       samplers=("penalties", "min_p", "temperature"))
    logits = _logits("heavy", 8, 2000, 5)
    _compare(cpu, p, logits, rows_per_seq=4, n_steps=4)
    _compare(cpu, CHAINS["default"], _logits("normal", 8, 2000, 6), rows_per_seq=4)


def test_verify_rows_equal_sequential_sampling():
    """Sampling row i with the drafts before it as prefix == accepting them one by one."""
    V = 500
    p = SamplingParams(seed=123, repeat_penalty=1.3, frequency_penalty=0.1)
    L = _logits("normal", 4, V, 1)
    a, b = SamplerChain(p, V), SamplerChain(p, V)
    seq = []
    for i in range(4):
        t = a.sample(L[i])
        a.accept(t)
        seq.append(t)
    batch = [b.sample(L[i], seq[:i]) for i in range(4)]
    assert batch == seq
    snap = b.snapshot()
    for t in seq[:2]:
        b.accept(t)
    b.restore(snap)
    assert b.snapshot() == snap and b.sample(L[0]) == seq[0]


def test_exact_argmax_tie_rule(cpu):
    """ggml's CPU argmax returns the last maximum; the sampler's graph argmax the lowest."""
    V = 64
    x = np.zeros((2, V), dtype=np.float32)
    x[0, [5, 9, 40]] = 3.0
    x[1] = -np.inf
    p = SamplingParams(temp=0.0)
    plan = plan_chain(p, device.cpu_device(), V, 2, True)
    h = Harness([cpu], device.cpu_device(), plan)
    try:
        ch = SamplerChain(p, V)
        rows = [RowInput(ch), RowInput(ch)]
        assert h.step(x, rows).tolist() == [5, 0]
        assert [sample_host(ch, r) for r in x] == [5, 0]
    finally:
        h.close()


def test_top_k_boundary_tie_reads_full_row(cpu, caplog):
    V = 100
    x = np.full((1, V), -5.0, dtype=np.float32)
    x[0, 90:] = 2.0  # ten tied at the top, k = 4: the rule keeps ids 90..93
    p = SamplingParams(seed=2, top_k=4, top_p=1.0, min_p=0.0, temp=1.0)
    stats = SamplingStats()
    plan = plan_chain(p, device.cpu_device(), V, 1, True)
    h = Harness([cpu], device.cpu_device(), plan, stats=stats)
    ch = SamplerChain(p, V)
    try:
        with caplog.at_level(logging.WARNING, logger="pyggspec.sampling"):
            for _ in range(20):
                t = int(h.step(x, [RowInput(ch)])[0])
                assert t == sample_host(ch, x[0]) and 90 <= t <= 93
                ch.accept(t)
    finally:
        h.close()
    assert stats.fallbacks["top_k tie at the boundary: full row read"] == 20


def test_forced_unsupported_op_gives_partial_offload(cpu, caplog):
    p = SamplingParams(seed=5, repeat_penalty=1.2, logit_bias=((1, 2.0),))
    dev = device.cpu_device()
    with force_unsupported("TOP_K"):
        stats = SamplingStats()
        with caplog.at_level(logging.WARNING, logger="pyggspec.sampling"):
            plan = plan_chain(p, dev, 2000, 2, True, stats=stats)
        assert [s.name for s in plan.device_stages] == ["logit_bias", "penalties"]
        assert plan.output == "logits" and "TOP_K" in plan.reasons[0]
        assert sum(stats.fallbacks.values()) == 1 and "TOP_K" in caplog.text
        _compare(cpu, p, _logits("heavy", 2, 2000, 3))
    with force_unsupported("SET_ROWS"):
        plan = plan_chain(p, dev, 2000, 2, True)
        assert plan.n_device == 0 and "SET_ROWS" in plan.reasons[0]
    plan = plan_chain(p, dev, 2000, 2, True, output_split=True)
    assert plan.n_device == 0 and "split" in plan.reasons[0]


def test_probe_uses_real_vocabulary_width(cpu):
    """248,320 wide, 2 rows: probed and run at the real width; same token as the host."""
    V = 248320
    p = SamplingParams(seed=1, repeat_penalty=1.1)
    logits = _logits("heavy", 2, V, 9)
    plan = _compare(cpu, p, logits, n_steps=2)
    assert plan.n_device == 2


def test_rpc_device_runs_the_prefix(cpu, rpc_device):
    rpc = rpc_device
    rb = rpc.open()
    try:
        for params, forced in ((CHAINS["default"], ()), (CHAINS["greedy_pen_bias"], ()),
                               (CHAINS["no_topk_minp"], ()),
                               (CHAINS["greedy_pen_bias"], ("ARGMAX",))):
            V, R = 3000, 2
            with force_unsupported(*forced):
                plan = plan_chain(params, rpc, V, R, True)
            assert plan.device is rpc and plan.n_device >= 1
            if forced:  # partial offload: bias + penalties on RPC, greedy on the host
                assert plan.output == "logits" and plan.host_stages[0].name == "greedy"
            h = Harness([rb, cpu], rpc, plan)
            try:
                ch = [SamplerChain(params, V) for _ in range(R)]
                for step in range(3):
                    x = _logits("heavy", R, V, step)
                    rows = [RowInput(c) for c in ch]
                    got = h.step(x, rows)
                    assert got.tolist() == [sample_host(c, x[i]) for i, c in enumerate(ch)]
                    for c, t in zip(ch, got):
                        c.accept(int(t))
                ops = [t for t in h.graph.nodes() if t.name.startswith("smpl") is False
                       and t.op in ("TOP_K", "SET_ROWS", "ARGMAX", "STEP")]
                assert ops and all(h.sched.tensor_backend(t).startswith("RPC") for t in ops)
            finally:
                h.close()
    finally:
        rb.close()


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    m = exp > 0
    assert counts[~m].sum() == 0, "sampled a token outside the filtered set"
    return float(((counts[m] - exp[m]) ** 2 / exp[m]).sum())


@pytest.mark.parametrize("params,filt", [
    (SamplingParams(seed=21, top_k=6, top_p=1.0, min_p=0.0, temp=0.8), "topk"),
    (SamplingParams(seed=22, top_k=0, top_p=1.0, min_p=0.2, temp=1.0), "minp"),
    (SamplingParams(seed=23, top_k=0, top_p=0.7, min_p=0.0, temp=1.0), "topp"),
])
def test_seeded_sampling_matches_filtered_distribution(params, filt):
    from scipy import stats as scipy_stats  # a test extra: never skipped
    V = 24
    x = np.linspace(2.0, -2.0, V).astype(np.float32)
    order = np.argsort(-x, kind="stable")
    if filt == "topk":
        keep = order[:6]
        lg = x[keep] / 0.8
    elif filt == "minp":
        keep = np.flatnonzero(x >= x.max() + np.log(0.2))
        lg = x[keep]
    else:
        p = np.exp(x - x.max())
        p /= p.sum()
        n = int(np.searchsorted(np.cumsum(p[order]), 0.7)) + 1
        keep = order[:n]
        lg = x[keep]
    probs = np.zeros(V)
    w = np.exp(lg - lg.max())
    probs[keep] = w / w.sum()
    ch = SamplerChain(params, V)
    counts = np.zeros(V)
    for _ in range(6000):
        t = ch.sample(x)
        ch.accept(t)
        counts[t] += 1
    dof = len(keep) - 1
    stat = _chi2(counts, probs)
    assert stat < scipy_stats.chi2.ppf(0.999, dof), (stat, dof)


def test_device_dist_distribution(cpu):
    """The full-width graph dist (in-graph noise + exact argmax) is the same distribution."""
    V = 12
    x = np.linspace(1.5, -1.5, V).astype(np.float32)[None, :]
    p = SamplingParams(seed=31, top_k=0, top_p=1.0, min_p=0.0, temp=1.0)
    plan = plan_chain(p, device.cpu_device(), V, 1, True)
    assert plan.output == "token"
    h = Harness([cpu], device.cpu_device(), plan)
    ch = SamplerChain(p, V)
    counts = np.zeros(V)
    try:
        for _ in range(2000):
            t = int(h.step(x, [RowInput(ch)])[0])
            ch.accept(t)
            counts[t] += 1
    finally:
        h.close()
    probs = np.exp(x[0] - x[0].max())
    probs /= probs.sum()
    assert _chi2(counts, probs) < 45.0  # chi2(11) 0.9999 quantile is ~35.6


def test_same_seed_same_tokens_and_noise_is_subset_consistent():
    V = 1000
    x = _logits("normal", 1, V, 0)[0]
    p = SamplingParams(seed=77, top_k=50)

    def run(params):
        ch = SamplerChain(params, V)
        out = []
        for _ in range(30):
            t = ch.sample(x)
            ch.accept(t)
            out.append(t)
        return out

    assert run(p) == run(p)
    assert run(p) != run(SamplingParams(seed=78, top_k=50))
    full = gumbel_noise(5, 9, None, V)
    ids = np.array([3, 999, 0, 500], dtype=np.int32)
    assert np.array_equal(gumbel_noise(5, 9, ids, V), full[ids])
    r1, r2 = SamplerChain(SamplingParams(), V), SamplerChain(SamplingParams(), V)
    assert r1.seed != r2.seed  # default seed draws a random one


def test_stats_and_buffer_sizes(cpu):
    p = SamplingParams(seed=1, repeat_penalty=1.2)
    V, R = 2000, 6
    stats = SamplingStats()
    plan = plan_chain(p, device.cpu_device(), V, R, True, stats=stats)
    h = Harness([cpu], device.cpu_device(), plan, rows_per_seq=3, stats=stats)
    ch = [SamplerChain(p, V) for _ in range(2)]
    rows = [RowInput(c) for c in ch for _ in range(3)]
    try:
        h.step(_logits("normal", R, V, 1), rows)
        d = stats.to_dict()
        assert d["device"] == "CPU" and d["device_stages"] == ["penalties", "top_k"]
        # 40 ids + 40 logits + 1 count per row
        assert d["bytes_d2h_per_token"] == (40 * 4 * 2 + 4)
        sizes = h.handle.buffer_bytes
        assert sizes["inputs"] == 4 * 64 * R * 4 and sizes["outputs"] == R * (40 * 8 + 4)
    finally:
        h.close()


def test_params_parsing_and_click_options():
    import click
    from click.testing import CliRunner

    from pyggspec.cli.common import sampling_options

    assert parse_samplers("top-k;nucleus;temp;penalties") == ("top_k", "top_p", "temperature",
                                                             "penalties")
    assert parse_logit_bias(["15043+1", "2-inf"]) == ((15043, 1.0), (2, -np.inf))
    with pytest.raises(ValueError):
        parse_samplers("topx")
    with pytest.raises(ValueError):
        SamplingParams(repeat_penalty=0.0)

    @click.command()
    @sampling_options
    def cmd(sampling):
        click.echo(repr((sampling.params, sampling.backend_sampling,
                         sampling.draft_backend_sampling)))

    r = CliRunner().invoke(cmd, [])
    assert r.exit_code == 0, r.output
    assert repr((SamplingParams(), None, True)) == r.output.strip()  # None: graph_sampling
    r = CliRunner().invoke(cmd, ["-bs"])
    assert r.exit_code == 0 and repr((SamplingParams(), True, True)) == r.output.strip()
    r = CliRunner().invoke(cmd, ["--temp", "0", "--top-k", "5", "--samplers", "top_k;temp",
                                 "-l", "3+2.5", "--no-backend-sampling",
                                 "--no-spec-draft-backend-sampling", "--seed", "9"])
    assert r.exit_code == 0, r.output
    want = SamplingParams(temp=0.0, top_k=5, samplers=("top_k", "temperature"),
                          logit_bias=((3, 2.5),), seed=9)
    assert repr((want, False, False)) == r.output.strip()
    r = CliRunner().invoke(cmd, ["--samplers", "bogus"])
    assert r.exit_code != 0 and "unknown sampler" in r.output


def test_graph_sampling_default_is_off_on_the_cpu_only():
    """-bs unset: chains in the graph on any device but the CPU; set: as asked."""
    from pyggspec.sampling import graph_sampling

    assert graph_sampling(None, "CPU") is False
    assert graph_sampling(None, "CUDA0") is True and graph_sampling(None, "RPC0") is True
    assert graph_sampling(True, "CPU") is True and graph_sampling(False, "CUDA0") is False


def test_raw_ggml_argmax_tie_rule_is_not_ours(cpu):
    """Why the graph argmax is built by hand: ggml's CPU argmax keeps the last maximum."""
    ctx = context.Context(8, graph_size=16)
    x = ctx.input("f32", (8, 1), "x")
    am = ctx.argmax(x).set_output()
    g = sched.Graph(ctx, [am], 16)
    s = sched.BackendScheduler([cpu], graph_size=16)
    try:
        s.alloc(g)
        x.set(np.array([[0, 2, 1, 2, 0, 0, 2, 0]], dtype=np.float32))
        s.compute(g)
        assert int(am.get()[0]) == 6  # lowest-id rule says 1
    finally:
        s.close()
        ctx.close()


def test_device_failure_is_recorded_not_silent(caplog):
    p = SamplingParams(seed=1)
    stats = SamplingStats()
    plan = plan_chain(p, device.cpu_device(), 100, 1, True, stats=stats)
    ctx = context.Context(64, graph_size=128)
    g = sched.Graph(ctx, [], 128)
    h = DeviceSampling.build(ctx, g, ctx.input("f32", (100, 1), "l"), plan, 1, stats=stats)
    with caplog.at_level(logging.WARNING, logger="pyggspec.sampling"):
        h.fail("graph compute failed: test")
    assert stats.to_dict()["fallbacks"] == {"device sampling failed: graph compute failed: test": 1}
    assert "graph compute failed: test" in caplog.text
    h.close()
    ctx.close()


def test_plan_for_several_sequences():
    from pyggspec.sampling import plan_chains

    dev = device.cpu_device()
    same = plan_chains([SamplingParams(seed=1, temp=0.7), SamplingParams(seed=2, temp=1.2)],
                       dev, 1000, 4, True)
    assert same.n_device == 1
    stats = SamplingStats()
    mixed = plan_chains([SamplingParams(), SamplingParams(temp=0.0)], dev, 1000, 4, True,
                        stats=stats)
    assert mixed.n_device == 0 and "different structure" in mixed.reasons[0]
    assert stats.fallbacks
