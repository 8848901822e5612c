"""Engine.stream: pieces as they come, then the request's result with the call's timings."""

from __future__ import annotations


def test_stream_yields_the_tokens_and_times_the_call(models, make_engine):
    path = models.dense(dtype="f32", agreement=0.9)
    with make_engine(path, n_ctx=64) as e:
        want = e.generate([300, 301, 302], max_tokens=8, ignore_eos=True).tokens
        s = e.stream([300, 301, 302], max_tokens=8, ignore_eos=True)
        got = [p.token for p in s if p.token >= 0]
    assert got == want and s.result.tokens == want
    t = s.result.timings
    # the request's own timings: its prompt and its generation took time
    assert t.predicted_n == 8 and t.predicted_ms > 0 and t.prompt_ms > 0
