"""Every value a user can pass is checked before it reaches ggml or a sampler: one-line
errors naming the flag; filters always keep a candidate; -b is llama.cpp's logical batch."""

from __future__ import annotations

import logging
import math
from itertools import pairwise

import numpy as np
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.errors import PyggspecError
from pyggspec.ggml import buffer, context, device, sched
from pyggspec.sampling import DeviceSampling, RowInput, SamplerChain, SamplingParams, SamplingPlan
from pyggspec.sampling import stages as S
from pyggspec.sampling.host import run_host


@pytest.fixture(scope="module")
def model(models):
    return models.dense(dtype="f32", agreement=0.8, tied_embeddings=False)


def cli(*args: str):
    return CliRunner().invoke(main, ["run", *args])


def one_line(r, prefix: str) -> None:
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), r.output


# --- engine API ---------------------------------------------------------------------------
def test_step_checks_sequence_and_token_ids(model, make_engine):
    with make_engine(model, n_ctx=64, n_parallel=2, n_threads=1) as e:
        e.eval([300, 301], seq_id=1)
        for seq, tok in ((2, 5), (-1, 5), (1, e.n_vocab), (1, -1)):
            with pytest.raises(PyggspecError, match="sequence|token id"):
                e.decode_token(seq, tok)
        assert e.seq_len(1) == 2  # nothing was evaluated
        ref = e.eval([302], seq_id=1)[-1]
        e.worker.memory.truncate(1, e.seq_len(1) - 1)
        e.eval([300, 301], seq_id=0)
        np.testing.assert_allclose(e.decode_token(0, 302), ref, rtol=1e-5, atol=1e-5)


def test_copy_seq_copies_the_mtp_cache(model, make_engine):
    with make_engine(model, n_ctx=64, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=2)) as e:
        e.generate([300, 301, 302], max_tokens=6, ignore_eos=True)
        n = e.worker.memory.mtp_length(0)
        assert n > 0
        e.copy_seq(0, 1)
        assert e.worker.memory.mtp_length(1) == n
        for il in e.mtp_kv.layers:
            for t in (e.mtp_kv.k(il), e.mtp_kv.v(il)):
                assert (e.mtp_kv.cells(t, 0, n) == e.mtp_kv.cells(t, 1, n)).all()


def test_batch_size_is_the_logical_batch(model, make_engine):
    """-b splits each sequence's tokens into logical batches, -ub each of those; as in
    llama.cpp -ub is capped at -b (it used to be an error, and the CLI raised -b instead)."""
    from pyggspec.testing.oracle import OracleModel, rel_err

    prompt = [300 + i % 100 for i in range(80)]
    for n_batch, n_ubatch, want in ((40, 32, [32, 8, 32, 8]), (16, 512, [16] * 5)):
        with make_engine(model, n_ctx=128, n_threads=1, n_batch=n_batch,
                         n_ubatch=n_ubatch) as e:
            assert e.n_ubatch == min(n_batch, n_ubatch)
            sizes: list[int] = []
            run = e.target.run

            def counted(ub, sizes=sizes, run=run, **kw):
                sizes.append(ub.tokens.shape[1])
                return run(ub, **kw)

            e.target.run = counted
            out = e.eval(prompt)
        assert sizes == want
        # other splits are other shapes (ggml may sum in another order): held to llama.cpp's
        # logits for the same splits, bit for bit
        with OracleModel(model) as om, om.context(n_ctx=128, n_batch=max(want),
                                                  n_threads=1) as oc:
            ends = np.cumsum([0, *want])
            ref = np.concatenate([oc.eval(prompt[a:b]) for a, b in pairwise(ends)])
        assert np.array_equal(out, ref), rel_err(out, ref)


def test_context_clamped_to_training_context_is_said_once(tiny, make_engine, caplog):
    path = tiny("ctx64", meta={".context_length": 64})
    with caplog.at_level(logging.WARNING, logger="pyggspec.engine"):
        with make_engine(path, n_ctx=100, n_threads=1) as e:
            assert e.n_ctx == 64
            e.eval([1, 2, 3])
        with make_engine(path, n_ctx=64, n_threads=1) as e:
            assert e.n_ctx == 64
    msgs = [r.getMessage() for r in caplog.records if r.name == "pyggspec.engine"]
    assert len(msgs) == 1 and "-c 100" in msgs[0] and "64" in msgs[0]


def test_engine_rejects_out_of_vocabulary_bias_and_bad_cache_types(model, make_engine):
    with pytest.raises(PyggspecError, match="--logit-bias: token 5000 is outside the vocab"):
        make_engine(model, sampling=SamplingParams(logit_bias=((5000, 1.0),)))
    with make_engine(model, n_ctx=32, n_threads=1) as e:
        with pytest.raises(PyggspecError, match="--logit-bias"):
            e.generate([300], max_tokens=2, sampling=SamplingParams(logit_bias=((5000, 1.0),)))
        with pytest.raises(PyggspecError, match="-n: must be >= 0"):
            e.generate([300], max_tokens=-1)
    for kw, flag in (("type_k", "-ctk"), ("type_v", "-ctv"), ("mtp_type_k", "-ctkd"),
                     ("mtp_type_v", "-ctvd")):
        with pytest.raises(PyggspecError, match=f"{flag}: unsupported KV cache type 'q9'"):
            make_engine(model, spec_type="draft-mtp", **{kw: "q9"})


# --- sampling parameters ------------------------------------------------------------------
@pytest.mark.parametrize("kw,flag", [
    ({"temp": math.nan}, "--temp"), ({"temp": math.inf}, "--temp"),
    ({"temp": 1e-40}, "--temp"), ({"min_p": 1.5}, "--min-p"), ({"min_p": -0.1}, "--min-p"),
    ({"min_p": math.nan}, "--min-p"), ({"top_p": 1.01}, "--top-p"),
    ({"top_p": math.nan}, "--top-p"), ({"typical_p": -1.0}, "--typical"),
    ({"repeat_penalty": math.nan}, "--repeat-penalty"), ({"repeat_last_n": -1},
                                                         "--repeat-last-n"),
    ({"presence_penalty": math.inf}, "--presence-penalty"),
    ({"frequency_penalty": math.nan}, "--frequency-penalty"), ({"seed": -1}, "--seed"),
    ({"seed": 1 << 64}, "--seed"), ({"logit_bias": ((3, math.nan),)}, "--logit-bias"),
    ({"logit_bias": ((3, math.inf),)}, "--logit-bias"), ({"logit_bias": ((-3, 1.0),)},
                                                          "--logit-bias"),
    ({"samplers": ("top_k", "bogus")}, "--samplers"), ({"top_k": 2.5}, "--top-k"),
    ({"logit_bias": ((3.5, 1.0),)}, "--logit-bias"),
])
def test_sampling_params_are_range_checked(kw, flag):
    with pytest.raises(ValueError) as ei:  # a ValueError for library callers ...
        SamplingParams(**kw)
    assert isinstance(ei.value, PyggspecError)  # ... and a one-line error for the CLI
    assert str(ei.value).startswith(f"pyggspec: {flag}: ")


def test_valid_edge_values_are_accepted():
    for kw in ({"temp": -1.0}, {"temp": 0.0}, {"min_p": 1.0}, {"min_p": 0.0}, {"top_p": 0.0},
               {"typical_p": 0.0}, {"logit_bias": ((3, -math.inf),)}, {"seed": 0}):
        SamplingParams(**kw)
    SamplingParams(logit_bias=((9, 1.0),)).check_vocab(10)
    with pytest.raises(PyggspecError, match="token 10 is outside the vocabulary .0..9."):
        SamplingParams(logit_bias=((10, 1.0),)).check_vocab(10)


@pytest.mark.parametrize("args,prefix", [
    (["--min-p", "1.5"], "pyggspec: --min-p: must be between 0 and 1"),
    (["--temp", "nan"], "pyggspec: --temp: must be a finite number"),
    (["--top-p", "2"], "pyggspec: --top-p: must be between 0 and 1"),
    (["-l", "5+nan"], "pyggspec: --logit-bias: bias of token 5"),
    (["-l", "5000+1"], "pyggspec: --logit-bias: token 5000 is outside the vocabulary"),
    (["-ctkd", "foo"], "pyggspec: -ctkd: unsupported KV cache type 'foo'"),
    (["-ctvd", "q9", "--spec-type", "draft-mtp"], "pyggspec: -ctvd: unsupported KV cache"),
])
def test_cli_one_line_errors(model, args, prefix):
    r = cli("-m", str(model), "--prompt-tokens", "300,301", "-n", "2", "-ngl", "0", "-t", "1",
            *args)
    one_line(r, prefix)


# --- filters keep at least one candidate ----------------------------------------------------
def _device_pick(stages: tuple[S.Stage, ...], x: np.ndarray, chain: SamplerChain) -> int:
    """Run ``stages`` entirely in a CPU graph on logits ``x`` (one row)."""
    V = x.shape[0]
    dev = device.cpu_device()
    plan = SamplingPlan(stages, len(stages), dev, V, 1)
    be = dev.open(n_threads=1)
    lctx = context.Context(2)
    leaf = lctx.new_tensor("f32", (V, 1), "logits_store")
    lbuf = buffer.Buffer.for_context(lctx, dev, "logits")
    ctx = context.Context(256, graph_size=512)
    graph = sched.Graph(ctx, [], 512)
    logits = ctx.scale(leaf, 1.0)
    graph.expand(logits)
    h = DeviceSampling.build(ctx, graph, logits, plan)
    sc = sched.BackendScheduler([be], graph_size=512)
    try:
        sc.alloc(graph)
        leaf.set(x[None].astype(np.float32))
        rows = [RowInput(chain)]
        h.set_inputs(rows)
        sc.compute(graph)
        return int(h.finish_host(rows)[0])
    finally:
        h.close()
        sc.close()
        ctx.close()
        lbuf.close()
        lctx.close()
        be.close()


def test_min_p_keeps_the_top_candidate_on_host_and_device():
    """A min_p stage with p > 1 (unreachable through SamplingParams) still keeps the maximum,
    on both paths, as llama.cpp does; it used to drop everything and yield token 0."""
    V = 50
    x = np.linspace(-2.0, 2.0, V).astype(np.float32)[::-1].copy()
    x[7] = 5.0
    st = S.MinP(2.0)
    row = S.RowCtx((), 1, 0, V)
    kept = st.host(S.Cand(None, x), row)
    assert kept.id_array().tolist() == [7]
    for term in (S.Dist(), S.Greedy()):
        chain = SamplerChain(SamplingParams(top_k=0, top_p=1.0, min_p=0.5, temp=1.0, seed=3), V)
        chain.stages = (st, term)
        host = run_host(chain.stages, S.Cand(None, x), chain.row())
        assert host == 7 == _device_pick(chain.stages, x, chain)


def test_top_p_and_typical_keep_candidates_without_probability():
    """With every logit -inf nothing has probability > 0; the nucleus filters then keep the
    candidates instead of returning none."""
    c = S.Cand(np.array([4, 9], np.int32), np.full(2, -np.inf, np.float32))
    row = S.RowCtx((), 1, 0, 10)
    for st in (S.TopP(0.5), S.TypicalP(0.5)):
        assert len(st.host(c, row).logits) == 2
