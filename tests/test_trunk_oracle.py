"""The trunk graph against llama.cpp (through llama_cpp) on the same generated GGUF.

f32 fixtures must give bit-identical logits (DESIGN allows 1e-4 relative, but the same ggml
ops run in the same order on the same library in the same process, so nothing less than
equality holds or is asserted). f16/q8_0 weights: pyggspec and
llama.cpp run the same quantized kernels, so the bound is the same numerical noise ggml
shows between batch shapes (measured < 1e-5 relative); we allow 1e-3 and require identical
greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.testing.oracle import OracleModel, oracle_greedy, rel_err

PROMPT = [int(t) for t in np.random.default_rng(7).integers(5, 900, size=40)]
N_GREEDY = 32


def ours_greedy(engine, prompt, n, seq=0):
    lg = engine.eval(prompt, seq)
    rows, toks = [lg], []
    for _ in range(n):
        t = int(lg[-1].argmax())
        toks.append(t)
        lg = engine.eval([t], seq)
        rows.append(lg)
    return np.concatenate(rows), toks


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("mtp", ["grafted", "none"])
def test_f32_logits_and_greedy_match_llamacpp(models, make_engine, arch, mtp):
    path = models.get(arch, dtype="f32", mtp=mtp)
    ref, ref_toks = oracle_greedy(path, PROMPT, N_GREEDY)
    with make_engine(path, n_ctx=256) as e:
        ours, toks = ours_greedy(e, PROMPT, N_GREEDY)
    assert toks == ref_toks
    assert ours.shape == ref.shape == (len(PROMPT) + N_GREEDY, ref.shape[1])
    assert np.array_equal(ours, ref), f"max relative error {rel_err(ours, ref):.3g}"


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_quantized_logits_match_llamacpp(models, make_engine, arch, dtype):
    path = models.get(arch, dtype=dtype)
    ref, ref_toks = oracle_greedy(path, PROMPT, 16)
    with make_engine(path, n_ctx=256) as e:
        ours, toks = ours_greedy(e, PROMPT, 16)
    assert toks == ref_toks
    assert rel_err(ours, ref) <= 1e-3


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_batched_sequences_equal_solo(models, make_engine, arch):
    path = models.get(arch)
    rng = np.random.default_rng(3)
    prompts = {s: [int(t) for t in rng.integers(5, 900, size=n)]
               for s, n in zip(range(4), (17, 17, 9, 23))}
    with make_engine(path, n_ctx=256, n_parallel=4) as e:
        batched = e.decode(prompts, logits="all")
        nxt = {s: [int(batched[s].logits[-1].argmax())] for s in prompts}
        step = e.decode(nxt, logits="all")  # 4 sequences, one token each, one ubatch
        for s, p in prompts.items():
            e.clear(0)
            solo = e.eval(p, 0)
            assert rel_err(batched[s].logits, solo) <= 1e-5
            solo_step = e.eval(nxt[s], 0)
            assert rel_err(step[s].logits, solo_step) <= 1e-5


def test_ubatch_splits_equal_single_batch(models, make_engine):
    """Chunked and token-by-token prefill agree to f32 noise. The chunked and the
    autoregressive gated-delta kernels sum in different orders (llama.cpp itself differs by
    1.8e-5 relative between ubatches of 1 and 64 tokens on this fixture), so each split is
    held to llama.cpp's logits for the same split, bit for bit: the difference between our
    splits is then exactly the one ggml shows between them on this host."""
    path = models.dense()
    with OracleModel(path) as om:
        for n_ubatch in (64, 7, 1):
            with make_engine(path, n_ctx=256, n_ubatch=n_ubatch) as e:
                ours = e.eval(PROMPT)
            with om.context(n_ctx=256, n_batch=n_ubatch, n_threads=2) as oc:
                ref = np.concatenate([oc.eval(PROMPT[i:i + n_ubatch])
                                      for i in range(0, len(PROMPT), n_ubatch)])
            assert np.array_equal(ours, ref), (n_ubatch, rel_err(ours, ref))


def test_tail_removal_and_copy(models, make_engine):
    """A copied sequence continues where its source was. The 40-token and 42-token batches
    are different shapes (ggml may pick other kernels), so each is held to llama.cpp's
    logits for the same batches, bit for bit."""
    path = models.dense()
    with make_engine(path, n_ctx=256, n_parallel=2) as e:
        full = e.eval(PROMPT, 0)
        e.copy_seq(0, 1)
        cont = e.eval([11, 12], 1)
        e.clear(0)
        whole = e.eval(PROMPT + [11, 12], 0)
        assert e.seq_len(1) == len(PROMPT) + 2
    with OracleModel(path) as om:
        with om.context(n_ctx=256, n_batch=256, n_threads=2) as oc:
            ref_full = oc.eval(PROMPT)
            ref_cont = oc.eval([11, 12])
        with om.context(n_ctx=256, n_batch=256, n_threads=2) as oc:
            ref_whole = oc.eval(PROMPT + [11, 12])
    assert np.array_equal(full, ref_full) and np.array_equal(cont, ref_cont)
    assert np.array_equal(whole, ref_whole)


def test_rpc_partial_offload_equals_cpu(models, make_engine, rpc_device):
    path = models.moe()
    with make_engine(path, n_ctx=256) as e:
        ref = e.eval(PROMPT)
        ref_step = e.eval([5])
    dev = rpc_device
    with make_engine(path, n_ctx=256, n_gpu_layers=3, device=dev.name) as e:
        assert dev.name in e.placement.layer_devices
        assert "CPU" in e.placement.layer_devices
        ours = e.eval(PROMPT)
        step = e.eval([5])
        assert e.memory()["weights"].get(dev.name, 0) > 0
    # the RPC server runs ggml's CPU kernels on the same shapes: nothing but equality
    assert np.array_equal(ours, ref), rel_err(ours, ref)
    assert np.array_equal(step, ref_step), rel_err(step, ref_step)


def test_graph_reused_across_decode_steps(models, make_engine):
    path = models.dense()
    with make_engine(path, n_ctx=256) as e:
        e.eval(PROMPT)
        e.eval([5])
        misses = e.target.graphs.misses
        for t in range(10):
            e.eval([6 + t])
        assert e.target.graphs.misses == misses  # no rebuild while the shape is unchanged
        assert e.target.last_python_ms > 0


def test_step_fast_path_equals_eval(models, make_engine):
    """Engine.step (one token, no per-call allocation) gives eval's logits.

    Against a one-token eval at the same position (same batch shape, same kernels) the
    fast path must be bit-identical. Against the two-token eval ``ref`` the shapes differ,
    and ggml picks other kernels per batch shape and ISA (AVX2 agrees to ~1e-7, AVX-512
    differs by 5e-6), so there each shape is held to llama.cpp's own logits for the same
    shape, bit for bit: the difference between our two shapes is then exactly the one
    ggml shows between them on this host, whatever its size."""
    path = models.dense()
    with make_engine(path, n_ctx=256, n_parallel=2) as e:
        e.eval(PROMPT, 0)
        e.eval(PROMPT, 1)
        ref = e.eval([17, 18], 0)
        a = e.decode_token(1, 17).copy()
        b = e.decode_token(1, 18).copy()
        assert e.seq_len(1) == len(PROMPT) + 2
        e.clear(0)
        e.eval(PROMPT, 0)
        one_a = e.eval([17], 0)[0]
        one_b = e.eval([18], 0)[0]
    assert np.array_equal(a, one_a) and np.array_equal(b, one_b)
    with OracleModel(path) as om:
        with om.context(n_ctx=256, n_batch=256, n_threads=2) as oc:
            oc.eval(PROMPT)
            two = oc.eval([17, 18])
        with om.context(n_ctx=256, n_batch=256, n_threads=2) as oc:
            oc.eval(PROMPT)
            singles = np.concatenate([oc.eval([17]), oc.eval([18])])
    assert np.array_equal(ref, two), rel_err(ref, two)
    assert np.array_equal(np.stack([a, b]), singles), rel_err(np.stack([a, b]), singles)
