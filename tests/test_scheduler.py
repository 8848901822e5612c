"""The scheduler: continuous batching equals solo generation, graphs are never rebuilt as
slots come and go, per-request sampling / stop strings / limits, cancellation, queue and
validation errors, failures confined to one request, the background thread and asyncio."""

from __future__ import annotations

import asyncio

import pytest

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.request import QueueFull, Request, RequestError, RequestFailed

PROMPTS = [[300, 301, 302], [400, 401], [500, 501, 502, 503, 504], [310], [320, 321, 322, 323]]
SAMPLED = SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.0, seed=77)


@pytest.fixture(scope="module")
def model(models):
    return models.dense(dtype="f32", agreement=0.8, tied_embeddings=False)


@pytest.fixture(scope="module")
def engines(model):
    """A plain and a speculative engine shared by the module's tests (opened here, closed
    at the module's end, also when one fails to open)."""
    out: dict[str, Engine] = {}
    try:
        out["plain"] = Engine(model, n_ctx=256, n_parallel=4, n_threads=2, ctx_checkpoints=0)
        out["spec"] = Engine(model, n_ctx=256, n_parallel=4, n_threads=2, ctx_checkpoints=0,
                             spec_type="draft-mtp", spec=SpecConfig(n_max=3, adaptive=False))
        yield out
    finally:
        for e in out.values():
            e.close()


def solo(e: Engine, prompt, n, sampling=None) -> list[int]:
    """One request alone in the engine, from an empty slot."""
    r = e.submit(Request(prompt, max_tokens=n, ignore_eos=True, sampling=sampling,
                         cache_prompt=False)).result()
    return r.tokens


def _traffic(e: Engine, plan, slots) -> list[list[int]]:
    """Submit one request every other step (pinned to ``slots``), then run to the end."""
    handles = []
    for (p, n, sp), slot in zip(plan, slots, strict=True):
        handles.append(e.submit(Request(p, max_tokens=n, ignore_eos=True, sampling=sp,
                                        slot=slot, cache_prompt=False)))
        e.scheduler.step()
        e.scheduler.step()
    e.scheduler.run_until_idle()
    return [h.result().tokens for h in handles]


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_requests_joining_and_leaving_equal_solo(engines, kind):
    """Requests arrive while others decode (their prompts interleave with decode steps),
    finish at different times and are replaced; each equals its solo run, greedy and
    seeded. The same traffic in other slots builds no graph: shapes do not depend on
    which slots are live."""
    e = engines[kind]
    plan = [(p, 6 + 3 * i, None if i % 2 else SAMPLED) for i, p in enumerate(PROMPTS)]
    ref = [solo(e, p, n, sp) for p, n, sp in plan]
    assert _traffic(e, plan, [0, 1, 2, 3, 0]) == ref
    builds = (e.target.n_builds, e.mtp.n_builds if e.mtp is not None else 0)
    for slots in ([3, 1, 0, 2, 3], [2, 0, 3, 1, 2]):
        assert _traffic(e, plan, slots) == ref
    assert (e.target.n_builds, e.mtp.n_builds if e.mtp is not None else 0) == builds


def test_graph_builds_do_not_depend_on_slots(engines):
    """A one-sequence decode in each slot, then pairs of slots: one graph per shape."""
    e = engines["plain"]
    for slot in range(4):
        e.submit(Request(PROMPTS[0], max_tokens=4, ignore_eos=True, slot=slot,
                         cache_prompt=False)).result()
    before = e.target.n_builds
    for slots in ((0, 3), (1, 2), (2, 3), (0, 1), (3,), (1,)):
        hs = [e.submit(Request(PROMPTS[0], max_tokens=4, ignore_eos=True, slot=s,
                               cache_prompt=False)) for s in slots]
        e.scheduler.run_until_idle()
        assert len({tuple(h.result().tokens) for h in hs}) == 1
        if len(slots) == 2 and slots == (0, 3):
            before = e.target.n_builds  # the first pair builds the B=2 shapes
    assert e.target.n_builds == before


def test_per_request_sampling_in_one_batch(engines):
    """Greedy, two seeds and penalties side by side equal each alone (chains of different
    structure share a batch; their rows finish on the host)."""
    e = engines["spec"]
    params = [SamplingParams(temp=0.0), SAMPLED,
              SamplingParams(temp=0.7, top_k=0, top_p=1.0, min_p=0.05, seed=3),
              SamplingParams(temp=0.0, repeat_penalty=1.3)]
    ref = [solo(e, PROMPTS[i], 12, sp) for i, sp in enumerate(params)]
    hs = [e.submit(Request(PROMPTS[i], max_tokens=12, ignore_eos=True, sampling=sp,
                           cache_prompt=False)) for i, sp in enumerate(params)]
    assert [h.result().tokens for h in hs] == ref
    assert ref[0] != ref[1]


def test_spec_off_and_draft_cap_per_request(engines):
    e = engines["spec"]
    ref = solo(engines["plain"], PROMPTS[2], 20)
    hs = [e.submit(Request(PROMPTS[2], max_tokens=20, ignore_eos=True, speculative=False,
                           cache_prompt=False)),
          e.submit(Request(PROMPTS[2], max_tokens=20, ignore_eos=True, n_draft_max=1,
                           cache_prompt=False)),
          e.submit(Request(PROMPTS[2], max_tokens=20, ignore_eos=True, cache_prompt=False))]
    res = [h.result() for h in hs]
    assert all(r.tokens == ref for r in res)
    assert res[0].spec is None and res[0].timings.draft_n == 0
    assert res[1].spec.n_drafted > 0 and len(res[1].spec.per_position) == 1
    assert res[2].timings.draft_n == res[2].spec.n_drafted > 0
    assert res[2].timings.draft_n_accepted == res[2].spec.n_accepted


def test_stop_strings_hold_back_and_cut(engines):
    """A stop string spanning tokens ends the request before it; streamed text never
    shows a part of it and adds up to the final text."""
    e = engines["plain"]
    full = e.submit(Request(PROMPTS[1], max_tokens=24, ignore_eos=True,
                            cache_prompt=False)).result()
    text = full.text
    assert len(text) > 12
    # a stop string made of the end of one token's text and the start of the next
    pieces = [e.detokenize([t]) for t in full.tokens]
    k = next(i for i in range(2, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    start = len("".join(pieces[:k]))
    stop = pieces[k][-1] + pieces[k + 1][:1]
    cut = text.find(stop)
    assert 0 <= cut <= start + len(pieces[k]) - 1
    h = e.submit(Request(PROMPTS[1], max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"],
                         cache_prompt=False))
    streamed = "".join(ev.text for ev in h)
    r = h.result()
    assert r.stop_reason == "stop" and r.stop_word == stop
    assert r.text == text[:cut] == streamed
    assert r.tokens == full.tokens[:len(r.tokens)] and len(r.tokens) < len(full.tokens)


def test_limits_and_reasons(engines):
    e = engines["spec"]
    r = e.submit(Request(PROMPTS[0], max_tokens=5, ignore_eos=True)).result()
    assert (len(r.tokens), r.stop_reason) == (5, "length")
    r = e.submit(Request(list(range(300, 550)), max_tokens=None, ignore_eos=True)).result()
    assert (len(r.tokens), r.stop_reason) == (6, "context")
    t = r.timings.to_dict()
    assert t["prompt_n"] + t["cache_n"] == 250 and t["predicted_n"] == 6


def test_validation_errors_at_submit(engines):
    e = engines["plain"]
    bad = [Request([]), Request([e.n_vocab]), Request([-1]), Request(list(range(257))),
           Request(list(range(300, 556))), Request([1], max_tokens=2.5),
           Request([1], sampling=SamplingParams(logit_bias=((e.n_vocab, 1.0),))),
           Request([1], speculative=True), Request([1], n_draft_max=1), Request([1], slot=4),
           Request([1], stop="x")]
    for req in bad:
        with pytest.raises(RequestError):
            e.submit(req)
    assert e.scheduler.idle


def test_cancel_queue_full_and_failure_isolation(engines, monkeypatch):
    e = engines["plain"]
    sched = e.scheduler
    sched.max_queue = 2
    try:
        hs = [e.submit(Request(p, max_tokens=40, ignore_eos=True, cache_prompt=False))
              for p in PROMPTS[:2]]
        with pytest.raises(QueueFull):
            e.submit(Request(PROMPTS[2], max_tokens=4))
    finally:
        sched.max_queue = 64
    sched.step()
    sched.step()
    hs[0].cancel()
    sched.step()
    r0 = hs[0].result()
    assert r0.stop_reason == "cancelled" and 0 < len(r0.tokens) < 40
    assert sched.slots()[0]["state"] == "idle"
    # a request whose prompt chunk fails fails alone; the running one carries on
    w = e.worker
    orig = w._prompt

    def failing(chunks, out):
        if any(c.tokens[:1] == [PROMPTS[3][0]] for c in chunks):
            raise RuntimeError("injected chunk failure")
        return orig(chunks, out)

    monkeypatch.setattr(w, "_prompt", failing)
    bad = e.submit(Request(PROMPTS[3], max_tokens=4, ignore_eos=True, cache_prompt=False))
    with pytest.raises(RequestFailed, match="injected chunk failure"):
        bad.result()
    monkeypatch.setattr(w, "_prompt", orig)
    r1 = hs[1].result()
    assert r1.stop_reason == "length" and r1.tokens == solo(e, PROMPTS[1], 40)
    m = sched.metrics()
    assert m["requests_failed"] >= 1 and m["requests_cancelled"] >= 1
    assert m["busy_slots"] == 0 and m["queue_depth"] == 0


def test_background_thread_and_asyncio(engines):
    e = engines["spec"]
    ref = [solo(e, p, 10) for p in PROMPTS[:3]]
    sched = e.scheduler
    sched.start()
    try:
        async def one(p):
            h = e.submit(Request(p, max_tokens=10, ignore_eos=True, cache_prompt=False))
            toks = [t async for ev in h for t in ev.tokens]
            res = await h.aresult()
            assert res.tokens == toks
            return toks

        async def main():
            return await asyncio.gather(*(one(p) for p in PROMPTS[:3]))

        assert asyncio.run(main()) == ref
        # blocking iteration from this thread while the loop runs in its own
        h = e.submit(Request(PROMPTS[0], max_tokens=10, ignore_eos=True, cache_prompt=False))
        assert [t for ev in h for t in ev.tokens] == ref[0]
        m = sched.metrics()
        assert m["draft_n"] > 0 and m["generated_tokens"] >= 40
        assert sum(m["draft_length_histogram"].values()) == m["verify_steps"]
    finally:
        sched.stop()
    from pyggspec.serving.request import SchedulerClosed

    with pytest.raises(SchedulerClosed):
        e.submit(Request([1]))
    sched.start()  # reopened; synchronous use again after stopping
    sched.stop()
    sched.reopen()
    assert e.generate(PROMPTS[0], 10, ignore_eos=True).tokens == ref[0]


def test_create_completion_shapes(engines):
    e = engines["spec"]
    out = e.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0)
    assert out["object"] == "text_completion"
    ch = out["choices"][0]
    assert ch["finish_reason"] in ("stop", "length") and isinstance(ch["text"], str)
    assert out["usage"]["prompt_tokens"] == 3
    chunks = list(e.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == ch["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == ch["finish_reason"]
    msgs = [{"role": "user", "content": "hello"}]
    chat = e.create_chat_completion(msgs, max_tokens=6, temperature=0.0)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    parts = list(e.create_chat_completion(msgs, max_tokens=6, temperature=0.0, stream=True))
    assert parts[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parts) == \
        chat["choices"][0]["message"]["content"]
