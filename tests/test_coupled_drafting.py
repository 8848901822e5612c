"""Coupled drafting: sampled speculation stays token-identical to plain seeded sampling over
randomized chains, sequences, architectures and rollback modes, and coupled drafts are
accepted at least as often as greedy drafts at every temperature."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import Request

N_CASES = 208  # randomized lossless cases (issue: >= 200)
N_TOKENS = 10


@pytest.fixture(scope="module")
def paths(models):
    return {arch: models.get(arch, dtype="f32", agreement=0.9, tied_embeddings=False)
            for arch in ("dense", "moe")}


def random_params(rng: random.Random, n_vocab: int) -> SamplingParams:
    """A chain with a random mix of the samplers (values in their usual ranges)."""
    kw: dict = {"temp": round(rng.uniform(0.3, 3.0), 2), "seed": rng.randrange(1 << 30),
                "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([1, 5, 40])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.5, 0.9, 0.97])
    if rng.random() < 0.4:
        kw["min_p"] = rng.choice([0.02, 0.1, 0.3])
    if rng.random() < 0.25:
        kw["typical_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.35:
        kw["repeat_penalty"] = rng.choice([1.1, 1.3, 0.9])
        kw["repeat_last_n"] = rng.choice([8, 64])
    if rng.random() < 0.25:
        kw["frequency_penalty"] = rng.choice([0.2, 0.5])
        kw["presence_penalty"] = rng.choice([0.0, 0.3])
    if rng.random() < 0.3:
        kw["logit_bias"] = [(rng.randrange(n_vocab), rng.choice([-5.0, 2.0, 8.0]))
                            for _ in range(rng.randint(1, 3))]
    return SamplingParams(**kw)


def test_randomized_sampled_speculation_is_lossless(paths, make_engine):
    """>= 200 seeded cases: temperatures 0.3-3, chains with top-k / top-p / min-p / typical
    / penalties / logit bias, 1-4 sequences with their own chains, dense and MoE, snapshot
    and checkpoint rollback, coupled and greedy drafts, host and graph sampling."""
    rng = random.Random(20261123)
    configs = [(arch, rb, ds, bs) for arch in ("dense", "moe")
               for rb, bs in (("snapshot", True), ("checkpoint", False))
               for ds in ("coupled", "greedy")]
    engines = {(arch, rb, ds, bs): make_engine(
        paths[arch], n_ctx=256, n_parallel=4, load_tokenizer=True, spec_type="draft-mtp",
        spec=SpecConfig(n_max=rng.choice([2, 3, 4]), rollback=rb, draft_sampling=ds),
        backend_sampling=bs) for arch, rb, ds, bs in configs}
    plains = {arch: make_engine(paths[arch], n_ctx=256, n_parallel=4, load_tokenizer=True)
              for arch in paths}
    n_vocab = plains["dense"].n_vocab
    drafted = accepted = 0
    for case in range(N_CASES):
        cfg = configs[case % len(configs)]
        e = engines[cfg]
        n_seq = rng.randint(1, 4)
        prompts = [[rng.randrange(3, n_vocab) for _ in range(rng.randint(1, 6))]
                   for _ in range(n_seq)]
        params = [random_params(rng, n_vocab) for _ in range(n_seq)]
        want = [plains[cfg[0]].generate(p, max_tokens=N_TOKENS, ignore_eos=True,
                                        sampling=sp).tokens
                for p, sp in zip(prompts, params)]
        res = _batch(e, prompts, params)
        assert [r.tokens for r in res] == want, (case, cfg, params)
        drafted += sum(r.timings.draft_n for r in res)
        accepted += sum(r.timings.draft_n_accepted for r in res)
    assert drafted > 0 and accepted > 0.2 * drafted


def _batch(e: Engine, prompts, params, n: int = N_TOKENS):
    """Each sequence with its own chain, all in one batch (slot i for prompt i)."""
    handles = [e.submit(Request(p, max_tokens=n, sampling=sp, ignore_eos=True,
                                cache_prompt=False, slot=i))
               for i, (p, sp) in enumerate(zip(prompts, params))]
    return [h.result() for h in handles]


@pytest.mark.parametrize("temp", [0.6, 1.0, 1.5, 3.0])
def test_coupled_acceptance_at_least_greedy(paths, make_engine, temp):
    """On the constructed-agreement model: mean acceptance over 3 seeds of coupled drafts is
    at least that of greedy drafts; at high temperature greedy drafts collapse and coupled
    drafts keep much more (the 0.8B-shaped bench model's numbers are in
    docs/benchmarks.md: scripts/bench_coupled.py)."""
    path = paths["dense"]
    acc = {}
    for ds in ("coupled", "greedy"):
        with make_engine(path, n_ctx=512, load_tokenizer=True, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, draft_sampling=ds, adaptive=False)) as e:
            prompt = [300, 301, 302]
            prompt += e.generate(prompt, max_tokens=4, ignore_eos=True).tokens  # on the cycle
            rates = []
            for seed in (1, 2, 3):
                r = e.generate(prompt, max_tokens=64, ignore_eos=True,
                               sampling=SamplingParams(temp=temp, top_k=0, top_p=1.0,
                                                       min_p=0.0, seed=seed))
                rates.append(r.spec.acceptance)
            acc[ds] = sum(rates) / len(rates)
    assert acc["coupled"] >= acc["greedy"] - 1e-9, acc
    if temp >= 3.0:  # measured here: coupled 0.38, greedy 0.10 (this head is flatter than
        assert acc["coupled"] >= acc["greedy"] + 0.15, acc  # the target: coupling is partial)


def test_cli_draft_sampling_flag(paths):
    path = str(paths["dense"])
    base = ["run", "-m", path, "--prompt-tokens", "300,301", "-n", "12", "--ignore-eos",
            "--spec-type", "draft-mtp", "--temp", "1.5", "--seed", "3", "--json", "-ngl", "0"]
    outs = {}
    for mode in ("coupled", "greedy"):
        r = CliRunner().invoke(main, [*base, "--spec-draft-sampling", mode])
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        assert d["spec"]["draft_sampling"]["mode"] == mode
        outs[mode] = d["tokens"]
    assert outs["coupled"] == outs["greedy"]  # drafts never change the output
    r = CliRunner().invoke(main, [*base, "--spec-draft-sampling", "bogus"])
    assert r.exit_code == 2 and "--spec-draft-sampling" in r.output
    with pytest.raises(ValueError, match="draft_sampling"):
        SpecConfig(draft_sampling="bogus")


def test_coupled_acceptance_stays_high_with_a_calibrated_head(models, make_engine):
    """A head whose logits equal the target's (agreement 1.0): coupled drafts share the
    target's noise counter for every draft position, so they stay accepted at temperature 3
    (measured: 0.98) while greedy drafts collapse (0.11). A draft drawn with the wrong
    counter (e.g. row j's noise off by one) would fall to the greedy level."""
    path = models.dense(dtype="f32", agreement=1.0, tied_embeddings=False)
    acc = {}
    for ds in ("coupled", "greedy"):
        with make_engine(path, n_ctx=512, load_tokenizer=True, spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, draft_sampling=ds, adaptive=False)) as e:
            prompt = [300, 301, 302]
            prompt += e.generate(prompt, max_tokens=4, ignore_eos=True).tokens
            drafted = accepted = 0
            for seed in (1, 2, 3):
                r = e.generate(prompt, max_tokens=64, ignore_eos=True,
                               sampling=SamplingParams(temp=3.0, top_k=0, top_p=1.0,
                                                       min_p=0.0, seed=seed))
                drafted += r.spec.n_drafted
                accepted += r.spec.n_accepted
            acc[ds] = accepted / drafted
    assert acc["coupled"] >= 0.9 and acc["greedy"] <= 0.3, acc


@pytest.mark.parametrize("draft_backend_sampling", [True, False])
def test_coupled_drafts_over_a_draft_vocabulary(paths, make_engine, draft_backend_sampling):
    """--spec-draft-vocab: the head's logits cover the first N ids only; the chains (whose
    noise is keyed by the full vocabulary) see the other ids as never drawn, in the MTP graph
    and on the host. Lossless, with a top-k chain and a penalty."""
    path = paths["dense"]
    sp = SamplingParams(temp=2.5, top_k=40, top_p=1.0, min_p=0.0, seed=5,
                        repeat_penalty=1.1)
    prompts = [[300, 301, 302], [400, 401]]
    with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True) as e:
        want = [r.tokens for r in e.generate_batch(prompts, max_tokens=24, ignore_eos=True,
                                                   sampling=sp)]
    with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3, draft_vocab=512, adaptive=False),
                     backend_sampling=True, draft_backend_sampling=draft_backend_sampling) as e:
        g = e.generate_batch(prompts, max_tokens=24, ignore_eos=True, sampling=sp)
        got = [r.tokens for r in g]
        assert g.stats.n_drafted > 0 and not e.drafter.mtp.failed
        assert bool(e.mtp.plans) == draft_backend_sampling  # the chains ran in the graph
    assert got == want


def test_p_min_of_argmax_drafts_in_coupled_mode(paths, make_engine):
    """A slot that drafts by the argmax (its coupled draws matched the target less often)
    compares p_min with the head's softmax probability of that argmax, as greedy drafts do
    -- not with the chain's probability of the unused coupled draw (which, for this head at
    temperature 2, is tiny and cut every draft). So it drafts exactly as greedy mode."""
    path = paths["dense"]
    sp = SamplingParams(temp=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=4)
    prompts = [[300, 301, 302], [400, 401]]
    got = {}
    for ds in ("coupled", "greedy"):
        with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True,
                         spec_type="draft-mtp",
                         spec=SpecConfig(n_max=3, p_min=0.5, draft_sampling=ds, adaptive=False)) as e:
            out = e.generate_batch(prompts, max_tokens=40, ignore_eos=True, sampling=sp)
            got[ds] = ([r.tokens for r in out], out.stats.n_drafted, out.stats.n_accepted)
            if ds == "coupled":
                assert e.drafter.mtp.n_coupled == 0 and e.drafter.mtp.n_argmax > 0  # argmax drafts
    assert got["coupled"] == got["greedy"] and got["greedy"][1] > 0, got


def test_a_stop_token_draft_is_the_last(paths, make_engine):
    """Drafts never go past a stop token: one that is drafted ends the drafts (it stays the
    last one; the target may sample it too)."""
    from pyggspec.speculative.mtp import DraftRequest

    prompt = [300, 301, 302]
    with make_engine(paths["dense"], n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3)) as e:
        (t,) = e.generate(prompt, max_tokens=1, ignore_eos=True).tokens
        c = e.drafter.mtp.carry[0]  # the pairs owed after the prompt; t is the pending token

        def draft(is_stop):  # the same pairs again: the same (argmax) drafts
            req = DraftRequest(0, c.pos0, [*c.tokens, t], c.hidden, 3, is_stop)
            return e.drafter.mtp.run([req])[0].tokens

        free = draft(None)
        assert len(free) == 3
        assert draft(lambda t: t == free[1]) == free[:2]
        assert draft(lambda t: t == free[0]) == free[:1]


def test_coupled_with_adaptive_length_n_min_and_p_min(paths, make_engine):
    """The adaptive draft length, n_min and p_min keep working with coupled drafts (two
    sequences with their own chains): lossless, drafts made, lengths chosen by the policy."""
    path = paths["moe"]
    sp = [SamplingParams(temp=2.5, top_k=40, top_p=1.0, min_p=0.0, seed=11),
          SamplingParams(temp=1.2, top_k=0, top_p=0.95, min_p=0.0, seed=12,
                         repeat_penalty=1.1)]
    prompts = [[300, 301, 302], [400, 401]]
    with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True) as e:
        want = [e.generate(p, max_tokens=32, ignore_eos=True, sampling=s).tokens
                for p, s in zip(prompts, sp)]
    with make_engine(path, n_ctx=256, n_parallel=2, load_tokenizer=True, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=4, n_min=2, p_min=0.02, adaptive=True)) as e:
        # costs where drafting pays, pinned: the choices must not depend on how busy the
        # machine is (measured ones may say "draft nothing" under load)
        e.draft_lengths.ratios = lambda B, kind: [1.0, 1.02, 1.04, 1.06, 1.08]
        res = _batch(e, prompts, sp, 32)
        got = [r.tokens for r in res]
        chosen = e.draft_lengths.to_dict()["draft-mtp"]["lengths"]
        assert sum(r.timings.draft_n for r in res) > 0 and sum(chosen[1:]) > 0
        assert e.drafter.mtp.n_coupled + e.drafter.mtp.n_argmax > 0
    assert got == want


def test_coupled_draws_planned_on_the_host_are_reported(paths, make_engine, caplog):
    """A chain whose graph part the head's device cannot run is drawn on the host from the
    head's logits: said once (at planning), and lossless."""
    import logging

    from pyggspec.sampling import force_unsupported

    sp = SamplingParams(temp=2.5, top_k=40, seed=2)
    with make_engine(paths["dense"], n_ctx=256, load_tokenizer=True) as e:
        want = e.generate([300, 301], max_tokens=20, ignore_eos=True, sampling=sp).tokens
    with force_unsupported("TOP_K"), caplog.at_level(logging.WARNING, "pyggspec.speculative"), \
            make_engine(paths["dense"], n_ctx=256, load_tokenizer=True, spec_type="draft-mtp",
                        spec=SpecConfig(n_max=3), backend_sampling=True) as e:
        r = e.generate([300, 301], max_tokens=20, ignore_eos=True, sampling=sp)
        got = r.tokens
        assert not e.mtp.plans and r.spec.n_drafted > 0
    assert got == want
    assert sum("coupled drafts of this chain are drawn on the host" in r.getMessage()
               for r in caplog.records) == 1
