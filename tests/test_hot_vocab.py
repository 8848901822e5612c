"""The draft head's hot vocabulary (--spec-draft-hot-vocab): drafts scored over a learnt
subset of the LM head's rows, lossless, falling back to the whole head when the subset does
not hold the emitted text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import ConfigError, SpecConfig
from pyggspec.models.mtp import PAD_LOGIT, MtpBatch
from pyggspec.sampling.params import SamplingParams
from pyggspec.speculative import hot_vocab
from pyggspec.speculative.hot_vocab import HotVocab, hot_rows

PROMPTS = [[300, 301, 302], [400, 401]]


@pytest.fixture(scope="module")
def dense(models):
    return models.get("dense", dtype="f32", agreement=0.9, tied_embeddings=False)


@pytest.fixture(scope="module")
def q4(models):
    return models.get("dense", dtype="q4_0", agreement=0.9, tied_embeddings=False,
                      n_embd=256, n_ff=512)


# --- the state --------------------------------------------------------------------------
def test_rows_sized_by_the_weights_memory():
    # 2% of 1.1 GB of weights, Q8_0 rows of 1024 (1088 bytes), 248,320 ids
    k = hot_rows(248320, 1088, 1_100_000_000, None)
    assert k % 256 == 0 and k * 1088 + 4 * 248320 <= 0.02 * 1_100_000_000
    assert k == 19200
    assert hot_rows(248320, 1088, 10**12, None) == hot_vocab.MAX_ROWS  # capped
    assert hot_rows(1024, 1024, 10**6, None) == 0  # a tiny model: too few rows to pay
    assert hot_rows(1024, 1024, 10**12, None) == 0  # not under half the vocabulary
    assert hot_rows(1024, 1024, 0, 700) == 512  # asked: whole 256s, under the vocabulary
    assert hot_rows(1024, 1024, 0, 1024) == 0 and hot_rows(1024, 1024, 0, 100) == 0


def test_set_learnt_from_what_is_seen():
    h = HotVocab(1000, 4)
    assert list(h.ids) == [0, 1, 2, 3] and h.active
    assert not h.observe([5, 5, 5, 7, 1], emitted=False)  # prompts: counted, no coverage
    assert h.coverage == 1.0 and h.misses == 4
    ids = h.choose()
    # the counted ids first; ties (count 0) go to the current members, then the lower id
    assert list(ids) == [0, 1, 5, 7] and h.member[[0, 1, 5, 7]].all()
    for _ in range(20):  # emitted tokens outside the set pull the coverage down
        h.observe([9], emitted=True)
    assert not h.active and h.coverage < hot_vocab.MIN_COVERAGE
    assert h.to_dict()["emitted_in_set"] == 0.0
    assert list(h.choose())[-1] == 9 and h.active  # chosen again: judged afresh


def test_refresh_is_due_after_misses_and_tokens(monkeypatch):
    monkeypatch.setattr(hot_vocab, "REFRESH_MISSES", 3)
    monkeypatch.setattr(hot_vocab, "REFRESH_MIN_TOKENS", 5)
    h = HotVocab(100, 8)
    assert not h.observe([1, 2, 3, 50], emitted=True)  # 1 miss
    assert h.observe([51, 52], emitted=True)  # 3 misses in 6 tokens: due
    h2 = HotVocab(100, 8)
    assert not h2.observe([50, 51, 52], emitted=True)  # 3 misses but 3 tokens
    assert h2.observe([1, 2], emitted=True)


def test_a_steps_few_tokens_count_as_a_prompts_many(monkeypatch):
    """The short path (a decode step's tokens, plain Python) keeps exactly the state the
    numpy path keeps for the same tokens: counts, coverage, misses, out-of-range ids."""
    rng = np.random.default_rng(0)
    steps = [list(rng.integers(-2, 130, rng.integers(1, 6))) for _ in range(400)]
    fast, slow = HotVocab(128, 16), HotVocab(128, 16)
    for i, t in enumerate(steps):
        emitted = i % 3 != 0
        due = fast.observe(t, emitted)
        monkeypatch.setattr(hot_vocab, "SHORT", -1)  # every list through numpy
        assert slow.observe(np.array(t), emitted) == due
        monkeypatch.setattr(hot_vocab, "SHORT", 8)
    assert np.array_equal(fast.counts, slow.counts)
    assert fast.coverage == pytest.approx(slow.coverage, abs=1e-12)
    assert (fast.misses, fast.seen, fast.n_emitted, fast.n_emitted_in) == (
        slow.misses, slow.seen, slow.n_emitted, slow.n_emitted_in)


# --- the graphs ---------------------------------------------------------------------------
@pytest.mark.parametrize("device_argmax", [True, False])
def test_hot_logits_are_the_heads_rows(dense, make_engine, device_argmax):
    """The hot graph's logits are the whole head's at the set's ids and never-drawn
    elsewhere; its argmax is the set's best id (in the graph and on the host)."""
    e = make_engine(dense, n_ctx=128, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=2, hot_vocab=512),
                    draft_backend_sampling=device_argmax)
    e.generate(PROMPTS[0], max_tokens=6, ignore_eos=True)
    mtp = e.mtp
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(1024, 512, replace=False)).astype(np.int32)
    mtp.set_hot(ids)

    def run(hot: bool, logits: bool):
        mb = MtpBatch(np.array([[301, 302]], np.int32),
                      np.full((1, 2, e.hp.n_embd), 0.5, np.float32),
                      np.array([3]), (0,), np.array([1], np.int32), logits=logits, hot=hot)
        return mtp.run(mb)

    full = run(False, True).logits
    wide = run(True, True).logits
    assert wide.shape == full.shape
    np.testing.assert_array_equal(wide[:, ids], full[:, ids])
    out = np.setdiff1d(np.arange(1024), ids)
    assert (wide[:, out] == PAD_LOGIT).all()
    best = ids[full[:, ids].argmax(axis=1)]
    assert list(run(True, False).ids) == list(best)


# --- the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("repack", [False, True])
def test_greedy_lossless_over_a_hot_set(q4, make_engine, repack):
    with make_engine(q4, n_ctx=128, repack=repack) as e:
        want = e.generate(PROMPTS[0], max_tokens=40, ignore_eos=True).tokens
    res = {}
    for hv in (0, 768):
        e = make_engine(q4, n_ctx=128, repack=repack, spec_type="draft-mtp",
                        spec=SpecConfig(n_max=3, hot_vocab=hv))
        r = e.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)
        assert r.tokens == want
        res[hv] = r.spec.n_accepted
        assert (e.drafter.mtp.hot is None) == (hv == 0)
    # the set (the first 768 of 1024 ids) holds most of what this head drafts
    assert res[768] > 0


@pytest.mark.parametrize("draft_backend_sampling", [True, False])
@pytest.mark.parametrize("mode", ["coupled", "probabilistic"])
def test_sampled_drafts_over_a_hot_set(dense, make_engine, draft_backend_sampling, mode):
    """Coupled drafts stay bit-identical to plain sampling with the chains drawing over the
    widened hot logits (graph and host); probabilistic drafts are reproducible."""
    sp = SamplingParams(temp=1.5, top_k=40, top_p=0.95, min_p=0.0, seed=5, repeat_penalty=1.1)
    with make_engine(dense, n_ctx=256, n_parallel=2) as e:
        want = [r.tokens for r in e.generate_batch(PROMPTS, max_tokens=24, ignore_eos=True,
                                                   sampling=sp)]
    got = []
    for _ in range(2):
        e = make_engine(dense, n_ctx=256, n_parallel=2, spec_type="draft-mtp",
                        spec=SpecConfig(n_max=3, hot_vocab=768, draft_sampling=mode, adaptive=False),
                        backend_sampling=True, draft_backend_sampling=draft_backend_sampling)
        g = e.generate_batch(PROMPTS, max_tokens=24, ignore_eos=True, sampling=sp)
        assert g.stats.n_drafted > 0 and not e.drafter.mtp.failed
        got.append([r.tokens for r in g])
        e.close()
    assert got[0] == got[1]
    if mode == "coupled":
        assert got[0] == want


def test_falls_back_to_the_whole_head_and_learns(dense, make_engine, monkeypatch):
    """A set that misses the emitted text is put off (drafts use the whole head); chosen
    again from the counts, it holds the text and is used again. Lossless throughout."""
    monkeypatch.setattr(hot_vocab, "REFRESH_MISSES", 8)
    monkeypatch.setattr(hot_vocab, "REFRESH_MIN_TOKENS", 16)
    with make_engine(dense, n_ctx=512) as e:
        want = e.generate(PROMPTS[0], max_tokens=120, ignore_eos=True).tokens
    e = make_engine(dense, n_ctx=512, spec_type="draft-mtp",
                    spec=SpecConfig(n_max=3, hot_vocab=256, adaptive=False))
    hot = e.drafter.mtp.hot
    # the text once (its counts: a server sees its texts again), then the set seeded with
    # ids the text never uses: everything it emits misses
    assert e.generate(PROMPTS[0], max_tokens=120, ignore_eos=True).tokens == want
    emitted = set(want) | set(PROMPTS[0])
    unused = np.array(sorted(set(range(1024)) - emitted)[:256], np.int32)
    hot.ids = unused
    hot.member[:] = False
    hot.member[unused] = True
    e.mtp.set_hot(unused)
    seen_off = []
    orig = e.mtp.run

    def spy(mb):
        seen_off.append(not mb.hot)
        return orig(mb)

    monkeypatch.setattr(e.mtp, "run", spy)
    r = e.generate(PROMPTS[0], max_tokens=120, ignore_eos=True)
    assert r.tokens == want
    assert any(seen_off)  # put off: the whole head drafted
    assert hot.n_choices >= 1  # chosen again from what was seen
    assert np.isin(want, hot.ids).mean() > 0.9  # it holds the text now
    assert list(e.mtp.hot.host_ids) == list(hot.ids)
    assert hot.active and not seen_off[-1]  # in use again at the end


def test_memory_counts_the_hot_rows(dense, make_engine):
    a = make_engine(dense, n_ctx=128, spec_type="draft-mtp", spec=SpecConfig(hot_vocab=0))
    b = make_engine(dense, n_ctx=128, spec_type="draft-mtp", spec=SpecConfig(hot_vocab=512))
    wa, wb = (sum(x.memory()["weights"].values()) for x in (a, b))
    n_embd = a.hp.n_embd
    assert wb - wa >= 512 * n_embd * 4 + 4 * (512 + 1024)  # f32 rows + the two tables


# --- options ------------------------------------------------------------------------------
def test_options_conflict_and_parse(dense):
    with pytest.raises(ConfigError, match="--spec-draft-hot-vocab"):
        SpecConfig(hot_vocab=512, draft_vocab=256)
    with pytest.raises(ConfigError, match="--spec-draft-hot-vocab"):
        SpecConfig(hot_vocab=512, p_min=0.5)
    SpecConfig(hot_vocab=None, p_min=0.5)  # auto steps aside for p_min
    base = ["run", "-m", str(dense), "--prompt-tokens", "300,301,302", "-n", "12",
            "--ignore-eos", "--json", "--spec-type", "draft-mtp", "--spec-draft-fixed"]
    r = CliRunner().invoke(main, [*base, "--spec-draft-hot-vocab", "512"])
    assert r.exit_code == 0, r.output
    hv = json.loads(r.output)["spec"]["hot_vocab"]
    assert hv["size"] == 512 and set(hv) >= {"active", "coverage", "emitted_in_set"}
    r = CliRunner().invoke(main, [*base, "--spec-draft-hot-vocab", "off"])
    assert r.exit_code == 0 and "hot_vocab" not in json.loads(r.output)["spec"]
    r = CliRunner().invoke(main, [*base, "--spec-draft-hot-vocab", "lots"])
    assert r.exit_code != 0 and "expected auto, off or a number" in r.output
    assert "Traceback" not in r.output


def test_metrics_report_the_hot_vocabulary(dense):
    """GET /metrics: size, in use, coverage, choices -- what --json's spec.hot_vocab says."""
    from fastapi.testclient import TestClient

    from pyggspec.engine import Engine
    from pyggspec.serving.http.app import create_app
    from pyggspec.serving.http.state import ServerConfig

    with Engine(dense, n_ctx=256, n_parallel=1, n_threads=1, spec_type="draft-mtp",
                spec=SpecConfig(n_max=2, hot_vocab=512)) as e:
        app = create_app(e, ServerConfig(model_id="m", model_path=str(dense), n_predict=16))
        with TestClient(app) as c:
            assert c.post("/completion", json={"prompt": PROMPTS[0], "n_predict": 16}
                          ).status_code == 200
            text = c.get("/metrics").text
            want = e.drafter.mtp.hot.to_dict()
    got = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
           if ln.startswith("pyggspec:spec_draft_hot_vocab_")}
    assert got["pyggspec:spec_draft_hot_vocab_size"] == 512
    assert got["pyggspec:spec_draft_hot_vocab_active"] == float(want["active"])
    assert got["pyggspec:spec_draft_hot_vocab_coverage"] == pytest.approx(want["coverage"])
    assert got["pyggspec:spec_draft_hot_vocab_choices_total"] == want["choices"]
    assert got["pyggspec:spec_draft_hot_vocab_emitted_in_set"] == pytest.approx(
        want["emitted_in_set"])
    assert "# TYPE pyggspec:spec_draft_hot_vocab_active gauge" in text
