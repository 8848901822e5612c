"""draft-mtp speculative decoding: lossless, drafts equal llama.cpp's, rollback exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.errors import PyggspecError
from pyggspec.testing.oracle import OracleModel

PROMPTS = [[300, 301, 302], [400, 401], [500, 501, 502, 503, 504], [310]]


def agreement_model(models, arch="dense", agreement=0.8, layout="model"):
    spec = models.spec(arch, dtype="f32", agreement=agreement, tied_embeddings=False)
    return models.path(spec, layout=layout)


def plain_outputs(make_engine, path, prompts, n):
    with make_engine(path, n_ctx=256, n_parallel=len(prompts), load_tokenizer=True) as e:
        return [r.tokens for r in e.generate_batch(prompts, max_tokens=n, ignore_eos=True)]


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("rollback", ["snapshot", "checkpoint"])
@pytest.mark.parametrize("n_max", [1, 3, 5])
def test_lossless_many_sequences(models, make_engine, arch, rollback, n_max):
    path = agreement_model(models, arch, 0.7)
    ref = plain_outputs(make_engine, path, PROMPTS, 30)
    cfg = SpecConfig(n_max=n_max, rollback=rollback, adaptive=False)  # every position drafted
    with make_engine(path, n_ctx=256, n_parallel=4, load_tokenizer=True, spec_type="draft-mtp",
                     spec=cfg) as e:
        out = e.generate_batch(PROMPTS, max_tokens=30, ignore_eos=True)
        stats = out.stats
        assert e.rollback == rollback
    assert [r.tokens for r in out] == ref
    assert stats.n_drafted > 0 and 0 < stats.n_accepted < stats.n_drafted
    assert len(stats.per_position) == n_max


def test_snapshot_needs_fewer_target_evals_than_checkpoint(models, make_engine):
    path = agreement_model(models, "dense", 0.7)
    evals = {}
    for rb in ("snapshot", "checkpoint"):
        with make_engine(path, n_ctx=256, n_parallel=1, load_tokenizer=True, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, rollback=rb)) as e:
            g = e.generate_batch([PROMPTS[0]], max_tokens=40, ignore_eos=True)
            evals[rb] = g.stats.n_target_evals
    assert evals["snapshot"] < evals["checkpoint"]


def test_p_min_and_n_min_limit_drafts(models, make_engine):
    path = agreement_model(models, "dense", 0.7)
    ref = plain_outputs(make_engine, path, PROMPTS[:1], 30)
    drafted = {}
    for p_min in (0.0, 0.9):
        with make_engine(path, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=4, p_min=p_min)) as e:
            out = e.generate_batch(PROMPTS[:1], max_tokens=30, ignore_eos=True)
            drafted[p_min] = out.stats.n_drafted
            assert out[0].tokens == ref[0]
    with make_engine(path, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=4, n_min=4)) as e:
        out2 = e.generate_batch(PROMPTS[:1], max_tokens=30, ignore_eos=True)
        assert out2.stats.n_drafted % 4 == 0  # every kept draft has exactly n_min=n_max tokens
    assert out2[0].tokens == ref[0]
    # p_min cuts drafts that the unconstrained run makes (same prompt, same model)
    assert 0 < drafted[0.9] < drafted[0.0]


def test_perfect_head_accepts_everything(models, make_engine):
    path = agreement_model(models, "dense", 1.0)
    with make_engine(path, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3)) as e:
        g = e.generate_batch(PROMPTS[:1], max_tokens=40, ignore_eos=True)
        assert g.stats.acceptance == 1.0


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("layout", ["model", "split"])
def test_mtp_logits_equal_llamacpp_mtp(models, make_engine, arch, layout):
    """The head sees the pairs (x_q, h_{q-1}) and computes the same numbers as llama.cpp's
    MTP context, grafted or from a separate MTP-only file."""
    from pyggspec.models.mtp import MtpBatch

    files = agreement_model(models, arch, 0.8, layout=layout)
    trunk, mtp_file = (files, files) if layout == "model" else files
    prompt = PROMPTS[2]
    with OracleModel(trunk) as om, om.context(n_ctx=256, n_batch=256, nextn=True) as oc:
        t = int(oc.eval(prompt)[-1].argmax())
        hid = np.stack([oc.hidden_nextn(i) for i in range(len(prompt))])
    paired = np.concatenate([np.zeros((1, hid.shape[1]), np.float32), hid])
    with OracleModel(mtp_file, load_mtp=True) as om, om.context(n_ctx=256, n_batch=256,
                                                                 mtp=True) as mc:
        ref = mc.mtp_eval(prompt + [t], paired, 0)
    md = None if layout == "model" else mtp_file
    with make_engine(trunk, mtp_path=md, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=1), draft_backend_sampling=False) as e:
        # the production prompt path: the prompt's pairs go into the MTP cache, the first
        # token is sampled, and the slot's carry holds the pair the first draft needs
        assert e.generate(prompt, max_tokens=1, ignore_eos=True).tokens == [t]
        # the whole pair sequence once more (the same pairs), every row's logits
        n = len(prompt) + 1
        res = e.mtp.run(MtpBatch(np.array([prompt + [t]], np.int32), paired[None],
                                 np.array([0]), (0,), np.arange(n, dtype=np.int32)))
        rel = np.abs(res.logits - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4
        from pyggspec.speculative.drafter import DraftItem

        d = e.drafter.mtp.draft([DraftItem(0, t, 1, None)])
        assert d[0].tokens == [int(ref[-1].argmax())]
        p = np.exp(ref[-1] - ref[-1].max())
        assert abs(d[0].probs[0] - p.max() / p.sum()) < 1e-5


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("layout", ["model", "split"])
@pytest.mark.parametrize("n_max,p_min", [(1, 0.0), (2, 0.5), (4, 0.0), (4, 0.5)])
def test_greedy_lossless_grafted_and_separate(models, make_engine, arch, layout, n_max, p_min):
    files = agreement_model(models, arch, 0.8, layout=layout)
    trunk, md = (files, None) if layout == "model" else files
    ref = plain_outputs(make_engine, trunk, PROMPTS[:2], 24)
    with make_engine(trunk, mtp_path=md, n_ctx=256, n_parallel=2, load_tokenizer=True,
                     spec_type="draft-mtp", spec=SpecConfig(n_max=n_max, p_min=p_min)) as e:
        g = e.generate_batch(PROMPTS[:2], max_tokens=24, ignore_eos=True)
        out = [r.tokens for r in g]
        assert g.stats.n_accepted > 0
    assert out == ref


def test_acceptance_at_095_agreement(models, make_engine):
    """One draft per step measures the head's agreement itself (deeper drafts compound)."""
    path = agreement_model(models, "dense", 0.95)
    with make_engine(path, n_ctx=512, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=1, adaptive=False)) as e:
        g = e.generate_batch([PROMPTS[0]], max_tokens=200, ignore_eos=True)
        assert g.stats.acceptance >= 0.9


@pytest.mark.parametrize("arch,extra", [("dense", {}), ("moe", {}),
                                         ("dense", {"draft_vocab": 512})])
def test_chained_drafts_equal_step_by_step(models, make_engine, arch, extra):
    """Argmax drafts made in one graph (MtpGraph._chain_step) are the drafts the head
    makes one graph per draft: same tokens, same probabilities, same output."""
    path = agreement_model(models, arch, 0.7)
    runs = {}
    for chained in (True, False):
        with make_engine(path, n_ctx=256, n_parallel=4, load_tokenizer=True,
                         spec_type="draft-mtp",
                         spec=SpecConfig(n_max=4, adaptive=False, **extra)) as e:
            mtp = e.drafter.mtp
            if not chained:
                mtp.mtp.chains = lambda mb: False
            seen, run = [], mtp.run

            def record(reqs, chains=None, run=run, seen=seen):
                out = run(reqs, chains)
                seen.append({s: (d.tokens[:], d.probs[:]) for s, d in out.items()})
                return out

            graphs, execute = [0], mtp.mtp.execute

            def counted(*a, graphs=graphs, execute=execute):
                graphs[0] += 1
                return execute(*a)

            mtp.run = record
            mtp.mtp.execute = counted
            evals = mtp.mtp.n_evals
            g = e.generate_batch(PROMPTS, max_tokens=24, ignore_eos=True)
            runs[chained] = ([r.tokens for r in g], seen, mtp.mtp.n_evals - evals, graphs[0])
    (tok_c, seen_c, ev_c, gr_c), (tok_s, seen_s, ev_s, gr_s) = runs[True], runs[False]
    assert tok_c == tok_s
    assert ev_c == ev_s and gr_s == ev_s and gr_c < 0.6 * ev_c
    assert len(seen_c) == len(seen_s) and any(len(d[0]) > 1 for s in seen_c for d in s.values())
    for a, b in zip(seen_c, seen_s):
        assert {s: d[0] for s, d in a.items()} == {s: d[0] for s, d in b.items()}
        for s in a:
            np.testing.assert_allclose(a[s][1], b[s][1], rtol=1e-5, atol=1e-7)


def test_parallel_sequences_equal_solo_runs(models, make_engine):
    path = agreement_model(models, "moe", 0.8)
    with make_engine(path, n_ctx=256, n_parallel=4, load_tokenizer=True,
                     spec_type="draft-mtp") as e:
        together = [r.tokens for r in e.generate_batch(PROMPTS, max_tokens=20,
                                                       ignore_eos=True)]
        solo = [e.generate_batch([p], max_tokens=20, ignore_eos=True)[0].tokens
                for p in PROMPTS]
    assert together == solo


def test_draft_vocab_is_lossless_and_exclusive_with_p_min(models, make_engine):
    path = agreement_model(models, "dense", 0.8)
    ref = plain_outputs(make_engine, path, PROMPTS[:1], 24)
    with make_engine(path, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3, draft_vocab=512)) as e:
        g = e.generate_batch(PROMPTS[:1], max_tokens=24, ignore_eos=True)
        out = g[0].tokens
        assert g.stats.n_drafted > 0
    assert out == ref[0]
    with pytest.raises(PyggspecError, match="p_min needs the full-vocabulary"):
        make_engine(path, n_threads=None, load_tokenizer=True, spec_type="draft-mtp",
                    spec=SpecConfig(draft_vocab=512, p_min=0.5))


def test_state_after_rollback_equals_plain_decoding(models, make_engine):
    """After speculation the KV rows and the conv/SSM states equal plain decoding's."""
    path = agreement_model(models, "dense", 0.6)
    with make_engine(path, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3, rollback="snapshot", adaptive=False)) as e:
        g = e.generate_batch([PROMPTS[0]], max_tokens=25, ignore_eos=True)
        out = g[0].tokens
        assert 0 < g.stats.n_accepted < g.stats.n_drafted  # partial acceptance happened
        n = e.seq_len(0)
        spec_state = e.rs.snapshot(0)
        spec_k = {il: e.kv.k(il).read_bytes(0, n * e.kv.k(il).nb[1]) for il in e.kv.layers}
    committed = PROMPTS[0] + out[: n - len(PROMPTS[0])]
    with make_engine(path, n_ctx=256, load_tokenizer=True) as p:
        p.eval(committed)
        assert p.seq_len(0) == n
        plain_state = p.rs.snapshot(0)
        plain_k = {il: p.kv.k(il).read_bytes(0, n * p.kv.k(il).nb[1]) for il in p.kv.layers}
    for key, data in plain_state.data.items():
        a = np.frombuffer(spec_state.data[key], np.float32)
        b = np.frombuffer(data, np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(key))
    for il, data in plain_k.items():
        a = np.frombuffer(spec_k[il], np.float16).astype(np.float32)
        b = np.frombuffer(data, np.float16).astype(np.float32)
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_separate_mtp_file_drafts_like_grafted(models, make_engine):
    grafted = agreement_model(models, "dense", 0.8)
    trunk, mtp = agreement_model(models, "dense", 0.8, layout="split")
    stats = []
    outs = []
    for model, md in ((grafted, None), (trunk, mtp)):
        with make_engine(model, mtp_path=md, n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                         spec=SpecConfig(adaptive=False)) as e:  # timing-free draft lengths
            g = e.generate_batch([PROMPTS[1]], max_tokens=30, ignore_eos=True)
            outs.append(g[0].tokens)
            stats.append((g.stats.n_drafted, g.stats.n_accepted))
    assert outs[0] == outs[1]
    assert stats[0] == stats[1]


def test_model_without_mtp_head_is_a_clear_error(models, make_engine):
    path = models.dense(dtype="f32", mtp="none")
    with pytest.raises(PyggspecError, match="no MTP head .nextn_predict_layers = 0.; pass "
                       "--spec-draft-model"):
        make_engine(path, n_threads=None, load_tokenizer=True, spec_type="draft-mtp")
    r = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "hi", "--spec-type",
                                  "draft-mtp", "-ngl", "0"])
    assert r.exit_code == 1
    assert r.output.strip().startswith(f"pyggspec: {path}: no MTP head")


def test_cli_spec_json(models):
    path = agreement_model(models, "dense", 0.8)
    r = CliRunner().invoke(main, ["run", "-m", str(path), "--prompt-tokens", "300,301",
                                  "-n", "20", "--ignore-eos", "--spec-type", "draft-mtp",
                                  "--spec-draft-n-max", "2", "--spec-draft-fixed", "--json",
                                  "-ngl", "0"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    spec = d["spec"]
    for key in ("type", "n_drafted", "n_accepted", "acceptance", "per_position",
                "n_target_evals", "n_mtp_evals", "draft_lengths"):
        assert key in spec
    assert spec["type"] == "draft-mtp" and len(spec["per_position"]) == 2
    assert d["timings"]["draft_n"] == spec["n_drafted"]
    assert d["timings"]["draft_n_accepted"] == spec["n_accepted"]
    assert d["n_gen"] == 20
    r2 = CliRunner().invoke(main, ["run", "-m", str(path), "--prompt-tokens", "300,301",
                                   "-n", "20", "--ignore-eos", "--json", "-ngl", "0"])
    assert json.loads(r2.output)["tokens"] == d["tokens"]


@pytest.mark.parametrize("backend_sampling", [False, True])
def test_sampled_decoding_is_lossless(models, make_engine, backend_sampling):
    """Same seed => same tokens with and without speculation, host or device sampling.

    On a 0.95-agreement model at temp 2.2 (its logits are so peaked that lower temperatures
    sample the greedy tokens) about half of the drafts are accepted, so verify batches have
    several rows whose samples are all used: the per-row sampling counters (the noise of
    row i must be that of the i-th token after the pending one) are exercised."""
    from pyggspec.sampling import SamplingParams

    path = agreement_model(models, "dense", 0.95)
    params = SamplingParams(temp=2.2, top_k=40, top_p=1.0, min_p=0.0, seed=7,
                            repeat_penalty=1.1)
    outs = []
    for spec_type in (None, "draft-mtp"):
        with make_engine(path, n_ctx=256, n_parallel=3, load_tokenizer=True, spec_type=spec_type,
                         sampling=params, backend_sampling=backend_sampling) as e:
            g = e.generate_batch(PROMPTS[:3], max_tokens=40, ignore_eos=True)
            outs.append([r.tokens for r in g])
            if spec_type:
                st = g.stats
                assert st.n_accepted > 0.3 * st.n_drafted
                # some steps kept 2+ drafts: rows past the first were sampled and used
                assert len(st.accepted_at) >= 2 and st.accepted_at[1] > 0
            if backend_sampling:
                assert e.samplers.stats.device == "CPU"
    assert outs[0] == outs[1]
    plain = plain_outputs(make_engine, path, PROMPTS[:3], 40)
    assert outs[0] != plain  # it really sampled


def test_cli_backend_sampling_identical_tokens(models):
    path = agreement_model(models, "dense", 0.7)
    base = ["run", "-m", str(path), "-p", "The quick brown fox", "-n", "24", "--ignore-eos",
            "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "1", "--json",
            "-ngl", "0"]
    res = {}
    for flag in ("--backend-sampling", "--no-backend-sampling"):
        r = CliRunner().invoke(main, [*base, flag])
        assert r.exit_code == 0, r.output
        res[flag] = json.loads(r.output)
    assert res["--backend-sampling"]["tokens"] == res["--no-backend-sampling"]["tokens"]
    on, off = res["--backend-sampling"]["sampling"], res["--no-backend-sampling"]["sampling"]
    assert on["device"] == "CPU" and "top_k" in on["device_stages"]
    assert off["device"] is None and "dist" in off["host_stages"]
    assert on["bytes_d2h_per_token"] < off["bytes_d2h_per_token"]


def test_spec_with_rpc_partial_offload_is_lossless(models, make_engine, rpc_device):
    """The last layers, the MTP block and the LM head on a second real device (RPC); auto
    rollback picks snapshots there too."""
    path = agreement_model(models, "dense", 0.8)
    ref = plain_outputs(make_engine, path, PROMPTS[:2], 20)
    for rb in ("auto", "checkpoint"):
        with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True, n_gpu_layers=3,
                         device=rpc_device.name, spec_type="draft-mtp",
                         spec=SpecConfig(rollback=rb)) as e:
            assert rpc_device.name in e.placement.layer_devices
            assert e.rollback == ("snapshot" if rb == "auto" else rb)
            g = e.generate_batch(PROMPTS[:2], max_tokens=20, ignore_eos=True)
            out = [r.tokens for r in g]
            assert 0 < g.stats.n_accepted
            assert e.memory()["weights"].get(rpc_device.name, 0) > 0
        assert out == ref


def test_rpc_offload_alternating_graphs_equals_cpu(models, make_engine, rpc_device):
    """Prefill and decode graphs alternating on two backends (graphs rebuilt on a switch)."""
    path = agreement_model(models, "moe", 0.8)
    seqs = ([300, 301, 302], [5], [303, 304, 305], [6], [7, 8, 9])
    with make_engine(path, n_ctx=256) as e:
        ref = [e.eval(t) for t in seqs]
    with make_engine(path, n_ctx=256, n_gpu_layers=3, device=rpc_device.name) as e:
        out = [e.eval(t) for t in seqs]
    for a, b in zip(out, ref):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
