"""The scheduler's decisions against a fake worker: what it schedules (prompt chunks,
first-token sampling, draft caps) and how its update ends sequences (end of generation,
length, context, cancel, a failing step) -- no model, no ggml."""

from __future__ import annotations

import pytest

from pyggspec.serving.request import Request, RequestFailed
from pyggspec.serving.scheduler import Scheduler, SchedulerLimits
from pyggspec.serving.sequence import SeqOutput, StepOutput

EOS = 99


class FakeMemory:
    def __init__(self, n: int) -> None:
        self.toks: list[list[int]] = [[] for _ in range(n)]

    def tokens(self, slot):
        return self.toks[slot]

    def length(self, slot):
        return len(self.toks[slot])

    def checkpoints(self, slot):
        return []

    def checkpoint_bytes(self, slot=None):
        return 0


class FakeWorker:
    """Answers each decode item with ``script(slot, n_draft)`` tokens (default: n_draft + 1
    tokens counting up); records every batch."""

    def __init__(self, n: int, script=None, fail_slot: int | None = None) -> None:
        self.memory = FakeMemory(n)
        self.batches = []
        self.script = script or (lambda slot, k: [10 + slot] * (k + 1))
        self.fail_slot = fail_slot
        self.lengths = None  # fixed draft lengths (Worker's draft-length rule: none)
        self.drafter = None  # no MTP head (Worker.drafter: its drafter, or None)

    def begin(self, slot, prompt, params, reuse, spec, media=None):
        self.memory.toks[slot] = []
        return 0

    def clear(self, slot):
        self.memory.toks[slot] = []

    def run(self, batch):
        self.batches.append(batch)
        out = StepOutput()
        for c in batch.prompt:
            self.memory.toks[c.slot] += c.tokens
            out.seqs[c.slot] = SeqOutput([1] if c.sample else [], target_evals=1)
        for d in batch.decode:
            if d.slot == self.fail_slot:
                out.failed[d.slot] = RuntimeError("injected")
                continue
            toks = self.script(d.slot, d.n_draft)
            out.seqs[d.slot] = SeqOutput(toks, d.n_draft, max(0, len(toks) - 1), d.spec,
                                         target_evals=1)
        return out


def make(n_parallel=2, n_ctx=64, n_ubatch=4, spec=True, n_max=3, ctx_checkpoints=0,
         checkpoint_min_step=512, **kw):
    w = FakeWorker(n_parallel, **kw)
    lim = SchedulerLimits(n_ctx=n_ctx, n_vocab=128, n_parallel=n_parallel, n_ubatch=n_ubatch,
                          n_batch=64, speculative=spec, spec_n_max=n_max,
                          ctx_checkpoints=ctx_checkpoints,
                          checkpoint_min_step=checkpoint_min_step)
    return Scheduler(w, lim), w


def req(prompt, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("cache_prompt", False)
    return Request(list(prompt), **kw)


def test_prompt_is_chunked_and_the_last_chunk_samples():
    s, w = make(n_ubatch=4)
    h = s.submit(req(range(2, 12), max_tokens=1))
    s.run_until_idle()
    chunks = [c for b in w.batches for c in b.prompt]
    assert [len(c.tokens) for c in chunks] == [4, 4, 2]
    assert [c.pos0 for c in chunks] == [0, 4, 8]
    assert [(c.last, c.sample) for c in chunks] == [(False, False)] * 2 + [(True, True)]
    r = h.result()
    assert r.tokens == [1] and r.stop_reason == "length"


@pytest.mark.parametrize("n,step,ends,saved", [
    # 4 + n_ubatch and 4 tokens before the end (llama-server), not the end itself
    (10, 512, [2, 6, 10], [True, True, False]),
    (14, 512, [4, 6, 10, 14], [False, True, True, False]),
    (14, 4, [4, 6, 10, 14], [True, True, True, False]),  # and every 4 (spacing) before
    (3, 512, [3], [False]),  # too short for one
])
def test_prompt_chunks_end_at_the_checkpoints(n, step, ends, saved):
    s, w = make(n_ubatch=4, ctx_checkpoints=4, checkpoint_min_step=step)
    s.submit(req(range(2, 2 + n), max_tokens=1))
    s.run_until_idle()
    chunks = [c for b in w.batches for c in b.prompt]
    assert [c.pos0 + len(c.tokens) for c in chunks] == ends
    assert [c.checkpoint for c in chunks] == saved
    assert [c.sample for c in chunks] == [False] * (len(ends) - 1) + [True]


def test_no_first_token_when_nothing_may_be_emitted():
    s, w = make()
    h = s.submit(req([2, 3, 4], max_tokens=0))
    s.run_until_idle()
    (c,) = [c for b in w.batches for c in b.prompt]
    assert c.last and not c.sample  # -n 0: no sample, no random number drawn
    assert h.result().stop_reason == "length" and h.result().tokens == []


def test_draft_cap_is_room_minus_one_and_length_ends_it():
    s, w = make(n_max=3)
    h = s.submit(req([2, 3], max_tokens=6))
    s.run_until_idle()
    caps = [d.n_draft for b in w.batches for d in b.decode]
    # first token (1 emitted), then room 5 -> 3 drafts (4 emitted), then room 1 -> 0 drafts
    assert caps == [3, 0]
    r = h.result()
    assert len(r.tokens) == 6 and r.stop_reason == "length"
    assert r.spec.n_drafted == 3 and r.spec.n_steps == 2


def test_context_ends_a_sequence_like_plain_decoding():
    s, w = make(n_ctx=8, spec=False)
    h = s.submit(req([2, 3, 4, 5, 6], max_tokens=100))
    s.run_until_idle()
    r = h.result()
    # prompt 5 + output 3 = n_ctx; the last token is emitted but never evaluated
    assert len(r.tokens) == 3 and r.stop_reason == "context"
    assert all(d.n_draft == 0 for b in w.batches for d in b.decode)


def test_end_of_generation_mid_verify_drops_the_rest():
    s, _w = make(script=lambda slot, k: [20, 21, EOS, 22][: k + 1])

    class Tok:  # only is_eog is asked for here (no text, no stop strings)
        def is_eog(self, t):
            return t == EOS

        def detokenizer(self):
            return None

    s.tokenizer = Tok()
    h = s.submit(req([2, 3], max_tokens=50, ignore_eos=False))
    s.run_until_idle()
    r = h.result()
    assert r.tokens == [1, 20, 21] and r.stop_reason == "eos"


def test_cancel_frees_the_slot_at_the_next_step():
    s, _w = make(n_parallel=1)
    h = s.submit(req([2, 3], max_tokens=50))
    s.step()
    h.cancel()
    s.step()
    assert h.result().stop_reason == "cancelled"
    assert s.slots()[0]["state"] == "idle" and s.idle


def test_waiting_requests_take_freed_slots_and_pins_wait_for_theirs():
    s, _w = make(n_parallel=1)
    a = s.submit(req([2, 3], max_tokens=2))
    b = s.submit(req([4, 5], max_tokens=2, slot=0))
    s.step()
    assert s.metrics()["queue_depth"] == 1
    s.run_until_idle()
    assert a.result().slot == 0 and b.result().slot == 0
    assert a.result().stop_reason == b.result().stop_reason == "length"


def test_a_failing_step_fails_only_its_sequence():
    s, _w = make(n_parallel=2, fail_slot=1)
    ok = s.submit(req([2, 3], max_tokens=4, slot=0))
    bad = s.submit(req([4, 5], max_tokens=4, slot=1))
    s.run_until_idle()
    with pytest.raises(RequestFailed, match="injected"):
        bad.result()
    assert ok.result().stop_reason == "length" and len(ok.result().tokens) == 4
    m = s.metrics()
    assert m["requests_failed"] == 1 and m["requests_finished"] == 1
