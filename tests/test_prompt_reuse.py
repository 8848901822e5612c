"""Prompt reuse across requests (multi-turn chat): continuing from a slot's cache, or from a
recurrent-state checkpoint saved along an earlier prompt, gives exactly the tokens of a
cold start -- greedy and seeded, plain and speculative, dense and MoE."""

from __future__ import annotations

import pytest

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import Request

P1 = [300 + i for i in range(14)]
SEEDED = SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.0, seed=5)


@pytest.fixture(scope="module", params=["dense", "moe"])
def engines(request, models):
    path = models.get(request.param, dtype="f32", agreement=0.8, tied_embeddings=False)
    # small ubatches and checkpoint spacing: for P1 (14 tokens) checkpoints at 4 (spacing),
    # then 6 and 10 (4 + n_ubatch and 4 tokens before its end)
    kw = {"n_ctx": 256, "n_parallel": 2, "n_threads": 2, "n_ubatch": 4,
          "ctx_checkpoints": 8, "checkpoint_min_step": 4, "load_tokenizer": False}
    # module-scoped (shared by the module's tests): make_engine is per test, so the two
    # engines are opened here and closed at the module's end, also when one fails to open
    out: dict[str, Engine] = {}
    try:
        out["plain"] = Engine(path, **kw)
        out["spec"] = Engine(path, spec_type="draft-mtp",
                             spec=SpecConfig(n_max=3, adaptive=False), **kw)
        yield out
    finally:
        for e in out.values():
            e.close()


def run(e: Engine, prompt, n, sampling, cache=True, slot=0):
    return e.submit(Request(prompt, max_tokens=n, ignore_eos=True, sampling=sampling,
                            cache_prompt=cache, slot=slot)).result()


@pytest.mark.parametrize("kind", ["plain", "spec"])
@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_reuse_equals_cold_start(engines, kind, sampling):
    e = engines[kind]
    e.clear(0)  # not the checkpoints of the module's earlier prompts
    r1 = run(e, P1, 10, sampling)
    assert r1.timings.cache_n == 0
    cases = {
        # the next turn: everything cached continues (no checkpoint needed)
        "continue": (P1 + r1.tokens + [777, 778, 779], len(P1) + len(r1.tokens) - 1),
        # a different answer after the same prompt: the checkpoint 4 tokens before its end
        "checkpoint": (P1 + [901, 902, 903, 904, 905], len(P1) - 4),
        # the same prompt again (all but its last token shared): the same checkpoint
        "repeat": (P1, len(P1) - 4),
        # diverging inside the prompt: the checkpoint 4 + n_ubatch before its end
        "near end": (P1[:9] + [903, 904], 6),
        # diverging earlier: the spacing checkpoint at 4
        "earlier": (P1[:5] + [903, 904], 4),
        # diverging before the first checkpoint: from scratch
        "cold": (P1[:2] + [905, 906, 907], 0),
    }
    for name, (prompt, cached) in cases.items():
        e.clear(0)
        run(e, P1, 10, sampling)  # the slot holds turn one again (and its checkpoints only)
        warm = run(e, prompt, 12, sampling)
        cold = run(e, prompt, 12, sampling, cache=False, slot=1)
        assert warm.tokens == cold.tokens, name
        assert warm.timings.cache_n == cached, name
        assert warm.timings.prompt_n == len(prompt) - cached, name
        if kind == "spec" and e.draft_lengths is None:
            # the MTP cache and its pending hidden row were carried over correctly:
            # the same drafts as from scratch (fixed draft length: an adaptive one
            # depends on measured timings)
            assert (warm.spec.n_drafted, warm.spec.n_accepted) == \
                (cold.spec.n_drafted, cold.spec.n_accepted), name


def test_best_slot_is_picked_and_memory_reported(engines):
    e = engines["plain"]
    a = run(e, P1, 6, None, slot=0)
    run(e, [500, 501, 502, 503, 504], 6, None, slot=1)
    # not pinned: the slot holding the longest common prefix takes the request
    r = e.submit(Request(P1 + a.tokens + [42], max_tokens=4, ignore_eos=True)).result()
    assert r.slot == 0 and r.timings.cache_n == len(P1) + len(a.tokens) - 1
    slots = e.scheduler.slots()
    assert slots[0]["n_cached"] >= len(P1) + len(a.tokens) and slots[0]["n_checkpoints"] > 0
    mem = e.memory()
    assert mem["prompt_checkpoints"]["host"] == e.scheduler.checkpoint_bytes() > 0


def test_cache_prompt_off_and_spec_request_after_plain_request(engines):
    """A request that did not speculate leaves no MTP pairs: a speculative request reusing
    its cache falls back to a checkpoint that has them, or starts cold; tokens unchanged."""
    e = engines["spec"]
    r1 = e.submit(Request(P1, max_tokens=8, ignore_eos=True, speculative=False,
                          slot=0)).result()
    prompt = P1 + r1.tokens + [11, 12]
    warm = run(e, prompt, 10, None)
    cold = run(e, prompt, 10, None, cache=False, slot=1)
    assert warm.tokens == cold.tokens
    assert warm.timings.cache_n < len(P1)  # no checkpoint of the plain request is used
    again = run(e, prompt, 10, None, cache=False)
    assert again.timings.cache_n == 0 and again.tokens == cold.tokens


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_repeated_short_prompt_is_reused(models, make_engine, spec):
    """llama.cpp's test_metrics_prompt_processed_and_cached: the same 10-token prompt twice
    on one slot, checkpoint settings at their defaults (spacing 512). The one checkpoint
    inside the shared prefix (all but the last token) is 4 tokens before the prompt's end:
    the second request evaluates those 4, and writes what a fresh run writes (with MTP:
    the same drafts, so the carry came back with the state)."""
    path = models.get("dense", dtype="f32", agreement=0.8, tied_embeddings=False)
    kw = {"n_ctx": 256, "n_parallel": 2, "n_ubatch": 64, "n_batch": 64}
    if spec:
        kw |= {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=3, adaptive=False)}
    e = make_engine(path, **kw)
    prompt = [400 + 7 * i for i in range(10)]
    for sampling in (None, SEEDED):
        first = run(e, prompt, 12, sampling)
        again = run(e, prompt, 12, sampling)
        fresh = run(e, prompt, 12, sampling, cache=False, slot=1)
        assert (again.timings.cache_n, again.timings.prompt_n) == (6, 4)
        assert again.tokens == fresh.tokens == first.tokens
        if spec:
            assert (again.spec.n_drafted, again.spec.n_accepted) == \
                (fresh.spec.n_drafted, fresh.spec.n_accepted)
            assert again.spec.n_drafted > 0
