"""Randomized equivalence: snapshot rollback, checkpoint rollback and no speculation give
identical tokens over 200 runs (prompts, seeds, n_max 1-6, p_min, 1-4 sequences, greedy
and sampled, dense and MoE); snapshots need fewer target evaluations whenever a draft was
rejected. And the state after every speculative step equals plain decoding's."""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import Request

N_RUNS = 200


@pytest.fixture(scope="module")
def engines(models):
    """One plain and twelve speculative engines per architecture, shared by the module's
    tests (opened here, closed at the module's end, also when one fails to open)."""
    out = {}
    opened = []
    try:
        for arch in ("dense", "moe"):
            path = models.get(arch, dtype="f32", agreement=0.7, tied_embeddings=False)
            e = Engine(path, n_ctx=128, n_parallel=4, n_threads=2, load_tokenizer=False)
            opened.append(e)
            out[(arch, None, 0)] = e
            for rb in ("snapshot", "checkpoint"):
                for n_max in range(1, 7):
                    e = Engine(path, n_ctx=128, n_parallel=4, n_threads=2, load_tokenizer=False,
                               spec_type="draft-mtp",  # fixed lengths: stats comparable
                               spec=SpecConfig(n_max=n_max, rollback=rb, adaptive=False))
                    opened.append(e)
                    out[(arch, rb, n_max)] = e
        yield out
    finally:
        for e in opened:
            e.close()


def _run(e: Engine, prompts, n, sampling, p_min=0.0):
    if e.spec_type:
        e.drafter.mtp.p_min = p_min
    res = e.generate_batch(prompts, max_tokens=n, ignore_eos=True, sampling=sampling)
    return [r.tokens for r in res], res.stats


def test_random_runs_identical(engines):
    rng = np.random.default_rng(1234)
    partial = 0
    for run in range(N_RUNS):
        arch = ("dense", "moe")[run % 2]
        n_max = int(rng.integers(1, 7))
        n_seqs = int(rng.integers(1, 5))
        prompts = [[int(t) for t in rng.integers(5, 1000, size=int(rng.integers(1, 12)))]
                   for _ in range(n_seqs)]
        n = int(rng.integers(3, 16))
        p_min = float(rng.choice([0.0, 0.3, 0.7]))
        sampling = (SamplingParams(temp=0.0) if rng.random() < 0.5 else
                    SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.0,
                                   seed=int(rng.integers(0, 2**31))))
        ref, _ = _run(engines[(arch, None, 0)], prompts, n, sampling)
        snap_e = engines[(arch, "snapshot", n_max)]
        ck_e = engines[(arch, "checkpoint", n_max)]
        snap, s = _run(snap_e, prompts, n, sampling, p_min)
        ck, c = _run(ck_e, prompts, n, sampling, p_min)
        ctx = f"run {run}: {arch} n_max={n_max} seqs={n_seqs} p_min={p_min} {sampling}"
        assert snap == ref, ctx
        assert ck == ref, ctx
        assert (s.n_drafted, s.n_accepted) == (c.n_drafted, c.n_accepted), ctx
        if s.n_accepted < s.n_drafted:
            partial += 1
            assert s.n_target_evals < c.n_target_evals, ctx
    assert partial > N_RUNS // 4  # the comparison above really ran


def _assert_same_state(e: Engine, plain: Engine, what: str) -> None:
    """Slot 0's recurrent rows (conv and SSM, every layer) in ``e`` equal ``plain``'s."""
    a, b = e.rs.snapshot(0), plain.rs.snapshot(0)
    for key in b.data:
        np.testing.assert_allclose(np.frombuffer(a.data[key], np.float32),
                                   np.frombuffer(b.data[key], np.float32),
                                   rtol=1e-5, atol=1e-6, err_msg=f"{what} {key}")


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("rb", ["snapshot", "checkpoint"])
def test_state_after_each_step_equals_plain(engines, arch, rb):
    """After every speculative step the recurrent rows (conv and SSM) and the KV cells of
    the committed prefix equal those of plain decoding of the same tokens."""
    e = engines[(arch, rb, 3)]
    plain = engines[(arch, None, 0)]
    prompt = [300, 301, 302, 303]
    out: list[int] = []
    h = e.submit(Request(prompt, max_tokens=40, ignore_eos=True, slot=0, cache_prompt=False,
                         sampling=SamplingParams(temp=0.0)))
    h.add_callback(lambda item: out.extend(getattr(item, "tokens", ())))
    e.step()  # the prompt and the first token
    plain.clear(0)
    plain.eval(prompt, 0)
    committed = list(prompt)
    steps = 0
    while not h.done and steps < 12:
        e.step()  # one speculative step (schedule -> run -> update)
        steps += 1
        n = e.seq_len(0)
        # tokens committed to the target so far: prompt + emitted tokens except the pending one
        target_tokens = prompt + out[: n - len(prompt)]
        plain.eval(target_tokens[len(committed):], 0)
        committed = target_tokens
        assert plain.seq_len(0) == n
        _assert_same_state(e, plain, f"step {steps}")
        for il in e.kv.layers:
            ka = e.kv.cells(e.kv.k(il), 0, n)
            kb = plain.kv.cells(plain.kv.k(il), 0, n)
            np.testing.assert_allclose(ka.view(np.float16).astype(np.float32),
                                       kb.view(np.float16).astype(np.float32),
                                       rtol=2e-3, atol=2e-3)
    assert steps >= 3


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_arena_state_survives_other_verifies(engines, arch):
    """Snapshot rollback leaves a sequence's state in the arena row of its last accepted
    token; a finished sequence's state stays there until verify steps of other sequences
    would overwrite it: it is copied to its own row first, equal to plain decoding's."""
    e = engines[(arch, "snapshot", 3)]
    plain = engines[(arch, None, 0)]
    greedy = SamplingParams(temp=0.0)
    for s in range(e.n_parallel):
        e.clear(s)
    h0 = e.submit(Request([300, 301, 302, 303], max_tokens=9, ignore_eos=True, slot=0,
                          cache_prompt=False, sampling=greedy))
    while not h0.done:
        e.step()
    assert e.rs.in_arena(0)  # its last verify left it there
    tokens0 = list(e.worker.memory.tokens(0))
    h1 = e.submit(Request([500, 501, 502], max_tokens=12, ignore_eos=True, slot=1,
                          cache_prompt=False, sampling=greedy))
    while not h1.done:
        e.step()
    assert not e.rs.in_arena(0) and e.rs.in_arena(1)
    assert list(e.worker.memory.tokens(0)) == tokens0
    plain.clear(0)
    plain.eval(tokens0, 0)
    _assert_same_state(e, plain, "after other verifies")


def test_failed_verify_leaves_consistent_slots(engines, monkeypatch):
    """A verify step that fails part-way, after it overwrote the state arena (and after it
    committed one sequence): its sequences fail and their slots are cleared, none left
    pointing at an arena row another sequence's state went to; the engine then generates
    as plain decoding does."""
    from pyggspec.worker import Worker

    e = engines[("dense", "snapshot", 3)]
    plain = engines[("dense", None, 0)]
    greedy = SamplingParams(temp=0.0)
    for s in range(e.n_parallel):
        e.clear(s)
    prompts = [[300 + 10 * s, 301, 302] for s in (0, 1)]
    hs = [e.submit(Request(prompts[s], max_tokens=40, ignore_eos=True, slot=s,
                           cache_prompt=False, sampling=greedy)) for s in (0, 1)]
    steps = 0
    while not (e.rs.in_arena(0) and e.rs.in_arena(1)):
        e.step()
        steps += 1
        assert steps < 10
    real = Worker._accepted

    def fail_slot_1(self, it, *args):
        if it.slot == 1:
            raise RuntimeError("injected failure")
        return real(self, it, *args)

    monkeypatch.setattr(Worker, "_accepted", fail_slot_1)
    e.step()
    monkeypatch.undo()
    assert all(h.done for h in hs)
    for s in (0, 1):
        assert e.seq_len(s) == 0 and not e.rs.in_arena(s)
    got, _ = _run(e, prompts, 12, greedy)
    ref, _ = _run(plain, prompts, 12, greedy)
    assert got == ref
