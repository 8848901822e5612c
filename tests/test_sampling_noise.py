"""The counter-keyed Gumbel noise: the graph computes it bit-identically to the host (at
the real 248,320-token width), it is Gumbel-distributed, and device sampling uploads only
the short key vectors per row, never vocabulary-sized noise."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pyggspec.ggml import context, device, sched
from pyggspec.sampling import (
    DeviceSampling,
    RowInput,
    SamplerChain,
    SamplingParams,
    SamplingStats,
    gumbel_noise,
    plan_chain,
)
from pyggspec.sampling import noise as N

QWEN_VOCAB = 248_320


@pytest.fixture(scope="module")
def cpu():
    b = device.cpu_device().open(n_threads=2)
    yield b
    b.close()


def graph_noise(backend, n_vocab: int, key: int, counters: list[int]) -> np.ndarray:
    """[rows, n_vocab] noise computed by a ggml graph on ``backend``."""
    R = len(counters)
    ctx = context.Context(512, graph_size=1024)
    inputs = {}

    def new_input(name, type, shape):
        inputs[name] = ctx.input(type, shape, name)
        return inputs[name]

    g = N.build_noise(ctx, n_vocab, R, new_input)
    out = ctx.cont(g) if not g.is_contiguous else ctx.scale(g, 1.0)
    out.set_output()
    graph = sched.Graph(ctx, [], 1024)
    graph.expand(out)
    s = sched.BackendScheduler([backend], graph_size=1024)
    try:
        s.alloc(graph)
        arrays = N.key_inputs([N.row_keys(key, c, N.Grid.for_vocab(n_vocab)) for c in counters])
        for name, t in inputs.items():
            t.set(arrays[name])
        s.compute(graph)
        return out.get().reshape(R, n_vocab).copy()
    finally:
        s.close()
        ctx.close()


@pytest.mark.parametrize("n_vocab", [QWEN_VOCAB, 151_936, 1000, 7])
def test_graph_noise_is_bit_identical_to_host(cpu, n_vocab):
    counters = [0, 1, 2, 12345]
    got = graph_noise(cpu, n_vocab, key=0xDEADBEEF, counters=counters)
    want = np.stack([gumbel_noise(0xDEADBEEF, c, None, n_vocab) for c in counters])
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_host_noise_of_a_subset_equals_the_full_row():
    full = gumbel_noise(3, 4, None, QWEN_VOCAB)
    ids = np.array([QWEN_VOCAB - 1, 0, 511, 512, 485, 123_456], dtype=np.int32)
    assert np.array_equal(gumbel_noise(3, 4, ids, QWEN_VOCAB), full[ids])


def test_transform_is_close_to_the_exact_gumbel_and_bounded():
    n = np.arange(0, 1 << N.N_BITS, 61, dtype=np.float64)
    u = (n + 0.5) / 2.0 ** N.N_BITS
    high = np.floor(n / 2048) * 2048
    g = N._recipe(N._NumpyOps, high.astype(np.float32), (n - high).astype(np.float32))
    assert np.max(np.abs(g - -np.log(-np.log(u)))) < 5e-5
    assert np.all(np.diff(g) >= 0)  # monotone in n: no token is reordered by the polynomial
    assert N.G_MIN <= g.min() and g.max() <= N.G_MAX


def test_noise_is_gumbel_and_independent_across_ids_and_counters():
    """What sampling needs is the distribution over (key, counter) of the noise at fixed
    ids: Gumbel marginals and no dependence between ids (tabulation is 3-wise independent
    per grid) or between counters. Within one row the ~2000 key values make pair
    statistics fluctuate, but without a systematic sign."""
    row = gumbel_noise(99, 0, None, QWEN_VOCAB).astype(np.float64)
    assert stats.kstest(row, stats.gumbel_r.cdf).pvalue > 1e-4
    ids = np.array([0, 1, 485, 512, 513, 997, 131_072, QWEN_VOCAB - 1])
    draws = np.stack([gumbel_noise(11, c, ids, QWEN_VOCAB) for c in range(3000)]).astype(
        np.float64)
    for k in range(len(ids)):
        assert stats.kstest(draws[:, k], stats.gumbel_r.cdf).pvalue > 1e-4, ids[k]
    corr = np.corrcoef(draws.T)[np.triu_indices(len(ids), 1)]
    assert np.max(np.abs(corr)) < 0.08  # 3000 draws: |r| of independent pairs is < 0.08
    lag = [np.corrcoef(r[:-1], r[1:])[0, 1]
           for r in (gumbel_noise(5, c, None, QWEN_VOCAB) for c in range(30))]
    assert abs(np.mean(lag)) < 0.015
    across = np.corrcoef(gumbel_noise(5, 0, None, QWEN_VOCAB), gumbel_noise(5, 1, None, QWEN_VOCAB))
    assert abs(across[0, 1]) < 0.01
    # the maximum over many ids is Gumbel(log n), not fixed (a permuted pool would be)
    mx = np.array([gumbel_noise(7, c, None, 4096).max() for c in range(400)])
    assert 0.9 < mx.std() < 1.7  # Gumbel's std is 1.28


def test_device_sampling_uploads_keys_not_vocabulary_noise(cpu):
    """Per row the host writes 2 * (a + b) key values (~4 KB at 248,320), not 1 MB."""
    from tests.test_sampling import Harness

    V, R = QWEN_VOCAB, 2
    p = SamplingParams(seed=5, top_k=0, top_p=1.0, min_p=0.0, temp=0.7)
    st = SamplingStats()
    plan = plan_chain(p, device.cpu_device(), V, R, True, stats=st)
    assert plan.output == "token"
    h = Harness([cpu], device.cpu_device(), plan, stats=st)
    chains = [SamplerChain(p, V) for _ in range(R)]
    x = np.random.default_rng(0).standard_normal((R, V)).astype(np.float32) * 4
    try:
        for _ in range(3):
            rows = [RowInput(c) for c in chains]
            got = h.step(x, rows)
            assert got.tolist() == [c.sample(x[i]) for i, c in enumerate(chains)]
            for c, t in zip(chains, got):
                c.accept(int(t))
    finally:
        h.close()
    grid = N.Grid.for_vocab(V)
    assert st.bytes_h2d / st.tokens < 4 * (2 * (grid.a + grid.b) + 8)
    assert isinstance(h.handle, DeviceSampling)


def test_graph_sampling_matches_softmax_at_full_width_with_a_crowd(cpu):
    """Chi-square at the real width: 8 leading tokens against 248,312 tail tokens that
    together hold ~10% of the mass -- the case where a wrong upper noise tail (or a
    deterministic crowd maximum) would show."""
    from tests.test_sampling import Harness

    V, R, steps = QWEN_VOCAB, 8, 300
    x = np.full(V, -12.0, np.float32)
    lead = np.array([5, 70_000, 248_000, 1, 485, 512, 100, 200_000])
    x[lead] = np.linspace(2.0, 0.25, len(lead), dtype=np.float32)
    p = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temp=1.0)
    plan = plan_chain(p, device.cpu_device(), V, R, True)
    h = Harness([cpu], device.cpu_device(), plan)
    chains = [SamplerChain(SamplingParams(seed=1000 + i, top_k=0, top_p=1.0, min_p=0.0, temp=1.0),
                           V)
              for i in range(R)]
    xs = np.broadcast_to(x, (R, V))
    counts = np.zeros(len(lead) + 1)
    index = {int(t): i for i, t in enumerate(lead)}
    try:
        for _ in range(steps):
            for c, t in zip(chains, h.step(xs, [RowInput(c) for c in chains])):
                c.accept(int(t))
                counts[index.get(int(t), len(lead))] += 1
    finally:
        h.close()
    w = np.exp(x.astype(np.float64) - x.max())
    probs = np.append(w[lead], w.sum() - w[lead].sum()) / w.sum()
    stat = float(((counts - probs * counts.sum()) ** 2 / (probs * counts.sum())).sum())
    assert stat < stats.chi2.ppf(0.999, len(probs) - 1), (stat, counts, probs * counts.sum())
