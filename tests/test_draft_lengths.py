"""The draft-length rule (speculative/lengths.py): its decision on constructed survival and
costs, its measurements and tries; then the rule in the engine and what a user sees."""

from __future__ import annotations

import json
import time

import pytest

from pyggspec.speculative import lengths as L
from pyggspec.speculative.lengths import DraftLengths, best_length, expected_tokens


def geometric(a: float, cap: int) -> list[float]:
    """Survival of a head whose drafts are accepted with probability ``a`` each."""
    return [a ** (i + 1) for i in range(cap)]


def linear(per_draft: float, cap: int) -> list[float]:
    return [1.0 + per_draft * k for k in range(cap + 1)]


# --- the decision (pure) -------------------------------------------------------------------
def test_a_batch_of_8_where_a_4_row_verify_costs_1_5_plain_steps_declines():
    """At a large batch a 4-row verify is dear (1.5 plain steps); with 0.3 acceptance the
    three drafts yield 1.42 tokens a step, shorter drafts no more per cost: no draft."""
    ratio = [1.0, 1.35, 1.45, 1.5]
    s = geometric(0.3, 3)
    assert expected_tokens(s, 3) == pytest.approx(1.417)
    assert best_length(s, ratio) == 0


def test_acceptance_0_9_at_1_2_plain_steps_per_4_row_verify_drafts_3():
    assert best_length(geometric(0.9, 3), [1.0, 1.1, 1.15, 1.2]) == 3


def test_a_compute_bound_verify_drafts_only_what_pays():
    """On a 2-core CPU a row costs ~0.6 of a step: at 0.7 acceptance one draft pays
    (1.7 / 1.6), more do not; at 0.95 all three do; at 0.5 none."""
    r = linear(0.6, 3)
    assert best_length(geometric(0.7, 3), r) == 1
    assert best_length(geometric(0.95, 3), linear(0.45, 3)) == 3
    assert best_length(geometric(0.5, 3), r) == 0


def test_ties_take_the_shorter_length():
    assert best_length([0.0, 0.0], [1.0, 1.0, 1.0]) == 0


# --- measurements and tries -----------------------------------------------------------------
def drive(rule: DraftLengths, steps: int, ms: dict[int, float], accept: float,
          B: int = 1, kind: str = "draft-mtp") -> list[int]:
    """Run ``steps`` steps: each k-step costs ``ms[k]``; a draft's positions survive with a
    deterministic share ``accept`` each (position i survives in round(accept^(i+1) * 100)
    of 100 steps)."""
    chosen = []
    for t in range(steps):
        k = rule.lengths(B)[kind]
        chosen.append(k)
        rule.observe_step(B, kind if k else "", k, ms[k])
        if k:
            n = sum(1 for i in range(k) if (t * 37) % 100 < round(100 * accept ** (i + 1)))
            for _ in range(B):
                rule.observe_draft(kind, k, n)
    return chosen


def test_a_fresh_rule_tries_each_length_once_then_keeps_the_best():
    rule = DraftLengths(3, ["draft-mtp"])
    chosen = drive(rule, 200, {0: 10.0, 1: 13.0, 2: 15.0, 3: 17.0}, 0.95)
    assert sorted(chosen[:4]) == [0, 1, 2, 3]  # the cap first (untried: optimistic)
    assert chosen[0] == 3
    late = chosen[50:]
    assert late.count(3) > 0.8 * len(late)
    d = rule.to_dict()["draft-mtp"]
    assert d["ratios"]["1x3"] == pytest.approx(1.7)
    assert d["survival"][0] > 0.9 and sum(d["lengths"]) == 200


def test_where_drafting_loses_the_tries_cost_about_their_share():
    """Every length costs more than it yields: the rule declines and its tries of the
    other lengths cost ~EXPLORE_SHARE of the time (a fresh process's few tries early)."""
    rule = DraftLengths(3, ["draft-mtp"])
    ms = {0: 10.0, 1: 19.0, 2: 27.0, 3: 35.0}
    chosen = drive(rule, 2000, ms, 0.7)
    late = chosen[100:]
    assert late.count(0) > 0.95 * len(late)
    spent = sum(ms[k] for k in late)
    plain = 10.0 * len(late)
    tokens = len(late) + sum(expected_tokens(geometric(0.7, 3), k) - 1 for k in late)
    # time per token against plain decoding's: within ~2 shares of it
    assert (spent / tokens) / (plain / len(late)) < 1 + 3 * L.EXPLORE_SHARE
    first = chosen[:128]  # a fresh run: each length tried once or twice, early
    tokens = len(first) + sum(expected_tokens(geometric(0.7, 3), k) - 1 for k in first)
    assert sum(ms[k] for k in first) / tokens / 10.0 < 1.04


def test_lengths_within_noise_of_each_other_are_both_kept_measured():
    rule = DraftLengths(3, ["draft-mtp"])
    chosen = drive(rule, 600, {0: 10.0, 1: 12.0, 2: 13.5, 3: 15.2}, 0.9)
    late = chosen[100:]
    assert late.count(2) > 0 and late.count(3) > 0
    assert late.count(0) < 0.1 * len(late)


def test_costs_are_per_batch_size():
    rule = DraftLengths(2, ["draft-mtp"])
    drive(rule, 100, {0: 10.0, 1: 11.0, 2: 12.0}, 0.9, B=1)
    chosen = drive(rule, 200, {0: 20.0, 1: 40.0, 2: 60.0}, 0.9, B=8)
    assert chosen[-100:].count(0) > 90  # declines at batch 8
    # still drafts for one sequence
    assert best_length(rule.survival["draft-mtp"], rule.ratios(1, "draft-mtp")) == 2


def test_survival_is_per_kind_and_a_running_mean():
    rule = DraftLengths(2, ["ngram-mod", "draft-mtp"])
    for _ in range(100):
        rule.observe_draft("ngram-mod", 2, 2)
        rule.observe_draft("draft-mtp", 2, 0)
    assert rule.survival["ngram-mod"] == [1.0, 1.0]
    assert max(rule.survival["draft-mtp"]) < 0.02  # (the prior's share fades)
    for _ in range(L.SURVIVAL_MEMORY):
        rule.observe_draft("draft-mtp", 1, 1)  # only the positions verified move
    assert rule.survival["draft-mtp"][0] > 0.6 and rule.survival["draft-mtp"][1] < 0.02


def test_the_decision_is_cheap():
    import time

    rule = DraftLengths(3, ["draft-mtp"])
    drive(rule, 100, {0: 10.0, 1: 13.0, 2: 15.0, 3: 17.0}, 0.9)
    t0 = time.perf_counter()
    for _ in range(1000):
        k = rule.lengths(1)["draft-mtp"]
        rule.observe_step(1, "draft-mtp" if k else "", k, 15.0)
        rule.observe_draft("draft-mtp", k, k)
    assert (time.perf_counter() - t0) / 1000 < 1e-4  # < 0.1 ms a step


# --- in the engine ---------------------------------------------------------------------------
PROMPTS = [[300, 301, 302], [400, 401], [500, 501, 502, 503, 504], [310]]


@pytest.fixture(scope="module")
def paths(models):
    return {(arch, agr): models.get(arch, dtype="f32", agreement=agr, tied_embeddings=False)
            for arch in ("dense", "moe") for agr in (0.95, None)}


def pin(rule: DraftLengths, ratio: list[float]) -> None:
    """Costs the rule sees instead of measured ones: its choices then follow acceptance,
    not how busy the machine is."""
    rule.ratios = lambda B, kind: list(ratio)


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("seeded", [False, True])
def test_the_default_is_lossless_and_reports_its_lengths(paths, make_engine, arch, seeded):
    from pyggspec.sampling import SamplingParams

    sp = SamplingParams(temp=0.8, seed=7) if seeded else SamplingParams(temp=0.0)
    for agr in (0.95, None):
        path = paths[(arch, agr)]
        with make_engine(path, n_ctx=256, n_parallel=4) as e:
            ref = [r.tokens for r in e.generate_batch(PROMPTS, max_tokens=24, ignore_eos=True,
                                                      sampling=sp)]
        with make_engine(path, n_ctx=256, n_parallel=4, spec_type="draft-mtp") as e:
            g = e.generate_batch(PROMPTS, max_tokens=24, ignore_eos=True, sampling=sp)
            assert [r.tokens for r in g] == ref
            d = e.draft_lengths.to_dict()["draft-mtp"]
            assert sum(d["lengths"]) > 0 and d["ratios"]
            assert sum(g.stats.draft_lengths) == g.stats.n_steps


def test_declined_steps_run_plain_and_keep_the_head_in_step(paths, make_engine):
    """While the rule declines, a step is a plain one (no verify batch) whose hidden rows
    become the head's owed pairs; when drafting pays again the head drafts from the right
    pairs (acceptance as high as ever), written in one catch-up that no step is priced
    with, and the output is plain decoding's."""
    path = paths[("dense", 0.95)]
    prompt = PROMPTS[2]
    with make_engine(path, n_ctx=256) as e:
        ref = e.generate(prompt, max_tokens=90, ignore_eos=True).tokens
    with make_engine(path, n_ctx=256, spec_type="draft-mtp") as e:
        w, rule = e.worker, e.draft_lengths
        real = rule.lengths
        rule.lengths = lambda B: dict.fromkeys(real(B), 0)  # declines, never tries
        steps, verify, lean, walls = [0], [0], [0], []
        run, vb, plain = w.run, w._verify_batch, w._plain

        caught = []  # (run's own wall, the wall the rule was told, catch-up) per catch-up

        def counted_run(batch):
            steps[0] += 1
            if steps[0] == 40:  # drafting pays from here on
                rule.lengths = real
                pin(rule, [1.0, 1.01, 1.02, 1.03])
            c0, n0, t0 = w.mtp_drafter.catch_up_ms, len(walls), time.perf_counter()
            out = run(batch)
            c = w.mtp_drafter.catch_up_ms - c0
            if c > 0 and len(walls) == n0 + 1:
                caught.append(((time.perf_counter() - t0) * 1000, walls[-1], c))
            return out

        w.run = counted_run
        w._verify_batch = lambda *a, **k: verify.__setitem__(0, verify[0] + 1) or vb(*a, **k)
        w._plain = lambda items, out, carry=False: (
            lean.__setitem__(0, lean[0] + carry) or plain(items, out, carry))
        observe = rule.observe_step
        rule.observe_step = lambda B, kind, k, ms: walls.append(ms) or observe(B, kind, k, ms)
        g = e.generate(prompt, max_tokens=90, ignore_eos=True)
        catch_up = w.mtp_drafter.catch_up_ms
    assert g.tokens == ref
    assert lean[0] >= 30 and lean[0] + verify[0] == g.spec.n_steps
    assert g.spec.acceptance > 0.8 and g.spec.n_drafted > 20
    assert catch_up > 0  # the owed pairs were written on their own
    # ... and no step is priced with them: the wall the rule was told leaves the catch-up
    # out of the step's own wall (exact intervals, so no ratio that a busy machine breaks)
    assert caught
    for wall, told, c in caught:
        assert told <= wall - c + 0.05


def test_a_head_that_never_agrees_mostly_rests(paths, make_engine):
    with make_engine(paths[("dense", None)], n_ctx=256, spec_type="draft-mtp") as e:
        pin(e.draft_lengths, [1.0, 1.2, 1.4, 1.6])
        g = e.generate(PROMPTS[0], max_tokens=120, ignore_eos=True)
        chosen = e.draft_lengths.to_dict()["draft-mtp"]["lengths"]
    assert chosen[0] > 0.8 * sum(chosen)
    assert g.spec.n_mtp_evals < 0.5 * g.spec.n_steps  # pairs wait and go in batches


def test_fixed_length_flag(paths, make_engine):
    from pyggspec.config import SpecConfig

    with make_engine(paths[("dense", None)], n_ctx=256, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=3, adaptive=False)) as e:
        assert e.draft_lengths is None
        g = e.generate(PROMPTS[0], max_tokens=30, ignore_eos=True)
    # every step drafts n_max but the last ones (the room is shorter)
    assert g.spec.draft_lengths[3] >= g.spec.n_steps - 3


def test_a_fresh_default_engine_starts_as_fast_as_plain(paths):
    """No start-up calibration: a speculative engine opens in about the time a plain one
    does (the MTP head's own graphs and weights aside)."""
    import time

    from pyggspec.engine import Engine

    path = paths[("dense", 0.95)]
    walls = {}
    for name, kw in (("plain", {}), ("spec", {"spec_type": "draft-mtp"})):
        t0 = time.perf_counter()
        with Engine(path, n_ctx=256, n_threads=1, load_tokenizer=False, **kw) as e:
            walls[name] = time.perf_counter() - t0
            assert e.scheduler.stats.n_steps == 0  # nothing ran before the first request
    assert walls["spec"] < walls["plain"] + 1.0


# --- what a user sees: run --json / text and /metrics -----------------------------------------
def test_cli_default_reports_the_rule(paths):
    from click.testing import CliRunner

    from pyggspec.cli import main

    base = ["run", "-m", str(paths[("dense", 0.95)]), "--prompt-tokens", "300,301", "-n", "24",
            "--ignore-eos", "-ngl", "0"]
    r = CliRunner().invoke(main, [*base, "--spec-type", "draft-mtp", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rule = d["spec"]["draft_lengths"]["draft-mtp"]
    assert sum(rule["lengths"]) > 0 and len(rule["survival"]) == 3 and rule["ratios"]
    assert d["spec"]["drafters"]["draft-mtp"]["drafts"] > 0
    assert d["timings"]["python_ms_per_step"] > 0
    plain = CliRunner().invoke(main, [*base, "--json"])
    assert json.loads(plain.output)["tokens"] == d["tokens"]
    text = CliRunner().invoke(main, [*base, "--spec-type", "draft-mtp"])
    assert text.exit_code == 0 and "draft lengths [draft-mtp]" in text.output
    assert "survival = [" in text.output


def test_metrics_report_the_rule(paths):
    from fastapi.testclient import TestClient

    from pyggspec.engine import Engine
    from pyggspec.serving.http.app import create_app
    from pyggspec.serving.http.state import ServerConfig

    path = paths[("dense", 0.95)]
    with Engine(path, n_ctx=256, n_parallel=1, n_threads=1, spec_type="draft-mtp") as e:
        app = create_app(e, ServerConfig(model_id="m", model_path=str(path), n_predict=16))
        with TestClient(app) as c:
            assert c.post("/completion", json={"prompt": [300, 301], "n_predict": 16}
                          ).status_code == 200
            text = c.get("/metrics").text
    for name in ("spec_draft_survival", "spec_draft_step_cost_ratio",
                 "spec_draft_length_chosen_total"):
        assert f"# TYPE pyggspec:{name} " in text, name
    line = next(ln for ln in text.splitlines()
                if ln.startswith("pyggspec:spec_draft_survival{"))
    assert 'kind="draft-mtp"' in line and 'position="0"' in line
