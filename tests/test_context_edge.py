"""The length/context rule (``serving.sequence.emit_room``) at the edge of the context.

Prompt + output never exceed n_ctx: the last emitted token may take position n_ctx - 1
(llama-server's rule). Plain decoding, speculation at every draft length and the first token
after the prompt stop at the same token with the same reason; -n 0 samples nothing.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.errors import PyggspecError
from pyggspec.serving.sequence import emit_room
from pyggspec.speculative.stats import SpecStats

N_CTX = 40
PROMPT = list(range(300, 316))  # 16 tokens


@pytest.fixture(scope="module")
def model(models):
    # a perfect head accepts every draft, so speculation runs right up to the edge
    return models.dense(dtype="f32", agreement=1.0, tied_embeddings=False)


@pytest.fixture(scope="module")
def engines(model, shared_engine):
    """One plain engine and one speculative engine per n_max 1..6, reused by every test."""
    kw = {"n_ctx": N_CTX, "n_threads": 1, "load_tokenizer": True}
    out = {0: shared_engine(model, **kw)}
    for k in range(1, 7):
        out[k] = shared_engine(model, spec_type="draft-mtp", spec=SpecConfig(n_max=k), **kw)
    return out


def run(e: Engine, prompt, n, ignore_eos=True, stats=None):
    r = e.generate(prompt, max_tokens=n, ignore_eos=ignore_eos)
    if stats is not None and r.spec is not None:
        stats.merge(r.spec)
    return r.tokens, r.stop_reason


def test_rule():
    assert emit_room(40, 16, 100) == 24
    assert emit_room(40, 39, 100) == 1 and emit_room(40, 40, 100) == 0
    assert emit_room(40, 16, 3) == 3 and emit_room(40, 16, 0) == 0


def test_plain_and_spec_stop_at_the_same_token(engines):
    plain, reason = run(engines[0], PROMPT, 100)
    assert (len(plain), reason) == (N_CTX - len(PROMPT), "context")
    for k in range(1, 7):
        e = engines[k]
        st = SpecStats()
        assert run(e, PROMPT, 100, stats=st) == (plain, "context"), k
        assert st.n_accepted > 0
        # nothing was evaluated past the context (the last token is emitted, not evaluated)
        assert e.seq_len(0) <= N_CTX - 1


@pytest.mark.parametrize("n_prompt", [N_CTX - 3, N_CTX - 2, N_CTX - 1])
def test_near_full_prompt_and_first_token(engines, n_prompt):
    prompt = [300 + i % 50 for i in range(n_prompt)]
    want = N_CTX - n_prompt
    for k in range(7):
        toks, reason = run(engines[k], prompt, 100)
        assert (len(toks), reason) == (want, "context"), k
        # a budget that ends on the context edge is "length", one more is "context"
        assert run(engines[k], prompt, want)[1] == "length", k


def test_budgets_at_the_edge_agree(engines):
    ref = {n: run(engines[0], PROMPT, n) for n in (1, 2, 23, 24, 25)}
    assert ref[24][1] == "length" and ref[25] == (ref[24][0], "context")
    for k in range(1, 7):
        for n, want in ref.items():
            assert run(engines[k], PROMPT, n) == want, (k, n)


def test_n_zero_generates_nothing(engines):
    for k in range(7):
        assert run(engines[k], PROMPT, 0) == ([], "length"), k
        # a prompt that fills the context exactly is fine when nothing is asked for
        full = [300 + i % 50 for i in range(N_CTX)]
        assert run(engines[k], full, 0) == ([], "length"), k
        with pytest.raises(PyggspecError, match="leaves no room to generate"):
            engines[k].generate(full, max_tokens=1)
        with pytest.raises(PyggspecError, match="does not fit the context"):
            engines[k].generate(full + [1], max_tokens=0)


def test_eos_at_the_context_edge(engines):
    """The token at position n_ctx - 1 is still checked for end-of-generation, on every path."""
    plain, _ = run(engines[0], PROMPT, 100)
    edge = plain[-1]  # the token sampled for the last position
    assert edge not in plain[:-1], "fixture: pick a prompt whose last token is new"
    for k in range(7):
        e = engines[k]
        e.tokenizer.is_eog = lambda t: t == edge
        try:
            assert run(e, PROMPT, 100, ignore_eos=False) == (plain[:-1], "eos"), k
            # one short of the edge the budget wins and eos is never sampled
            assert run(e, PROMPT, len(plain) - 1, ignore_eos=False) == (plain[:-1], "length"), k
        finally:
            del e.tokenizer.is_eog


def test_cli_context_edge_and_n_zero(model):
    base = ["run", "-m", str(model), "--prompt-tokens", ",".join(map(str, PROMPT)), "-c",
            str(N_CTX), "--ignore-eos", "--json", "-ngl", "0", "-t", "1", "--temp", "0"]
    outs = []
    for extra in ([], ["--spec-type", "draft-mtp"]):
        r = CliRunner().invoke(main, [*base, "-n", "100", *extra])
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        outs.append((d["tokens"], d["stop_reason"]))
    assert outs[0] == outs[1] and len(outs[0][0]) == N_CTX - len(PROMPT)
    r = CliRunner().invoke(main, [*base, "-n", "0", "--spec-type", "draft-mtp"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["tokens"], d["stop_reason"], d["n_prompt"]) == ([], "length", len(PROMPT))


def test_parallel_sequences_reach_the_edge_at_different_steps(model, make_engine):
    """One sequence at the edge (no drafts left) batched with one still drafting (its
    padded verify rows run past the edge's positions)."""
    prompts = [PROMPT, [300 + i % 50 for i in range(N_CTX - 4)]]
    outs = []
    for kw in ({}, {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=4)}):
        with make_engine(model, n_ctx=N_CTX, n_parallel=2, n_threads=1, load_tokenizer=True,
                         **kw) as e:
            outs.append([(r.tokens, r.stop_reason)
                         for r in e.generate_batch(prompts, max_tokens=100, ignore_eos=True)])
    assert outs[0] == outs[1]
    assert [len(t) for t, _ in outs[0]] == [N_CTX - len(p) for p in prompts]
