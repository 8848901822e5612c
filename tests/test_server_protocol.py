"""The server's request parsing, chat templates and metrics text, without a running model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pyggspec.sampling import SamplingParams
from pyggspec.serving.http.chat import CHATML, ChatTemplate
from pyggspec.serving.http.metrics import ServeMetrics, render
from pyggspec.serving.http.protocol import (
    ApiError,
    parse_body,
    parse_gen,
    parse_messages,
    parse_prompt,
    parse_sampling,
)
from pyggspec.testing import cached_model, tiny_dense

D = SamplingParams(temp=0.0)


def err(fn, *a, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*a, **kw)
    return e.value


@pytest.mark.parametrize("raw, what", [
    (b"", "empty"), (b"{", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not UTF-8"), (b"null", "must be a JSON object"),
    (b'{"prompt": "\\udc00"}', "unpaired surrogate"),
])
def test_bad_bodies_are_400_with_a_reason(raw, what):
    e = err(parse_body, raw)
    assert e.status == 400 and what in e.message
    body = e.body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == 400


@pytest.mark.parametrize("field, value, param", [
    ("temperature", "hot", "temperature"), ("temperature", float("nan"), "temperature"),
    ("top_p", 2.0, "top_p"), ("min_p", -0.1, "min_p"), ("top_k", 1.5, "top_k"),
    ("top_k", True, "top_k"), ("repeat_penalty", 0, "repeat_penalty"), ("seed", -2, "seed"),
    ("samplers", ["top_k", "bogus"], "samplers"), ("logit_bias", {"99999": 1}, "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", [[1, "x"]], "logit_bias"),
    ("presence_penalty", math.inf, "presence_penalty"),
])
def test_bad_sampling_values_name_their_field(field, value, param):
    e = err(parse_sampling, {field: value}, D, 1024)
    assert e.status == 400 and e.param == param and param in e.message


def test_sampling_over_server_defaults():
    p = parse_sampling({"temperature": 0.7, "top_k": 5, "seed": 7,
                        "logit_bias": {"3": -100, "4": False}}, D, 1024)
    assert (p.temp, p.top_k, p.seed, p.top_p) == (0.7, 5, 7, D.top_p)
    assert p.logit_bias == ((3, -100.0), (4, -math.inf))
    assert parse_sampling({"seed": -1}, D, 1024).seed == 0xFFFFFFFF
    assert parse_sampling({"logit_bias": [[5, 1.5]]}, D, 1024).logit_bias == ((5, 1.5),)


def test_gen_limits_and_unsupported_fields():
    g = parse_gen({"max_tokens": 5, "stop": "x", "stream": True,
                   "stream_options": {"include_usage": True}}, D, 1024, None)
    assert (g.max_tokens, g.stop, g.stream, g.include_usage) == (5, ("x",), True, True)
    assert parse_gen({"n_predict": -1, "max_tokens": 3}, D, 1024, 9).max_tokens is None
    assert parse_gen({}, D, 1024, 9).max_tokens == 9
    for body, param in (({"max_tokens": -3}, "max_tokens"), ({"n": 2}, "n"),
                        ({"stop": [1]}, "stop"), ({"stream": "yes"}, "stream"),
                        ({"logprobs": True}, "logprobs"), ({"speculative": 1}, "speculative"),
                        ({"response_format": {"type": "sound"}}, "response_format")):
        e = err(parse_gen, body, D, 1024, None)
        assert e.status == 400 and e.param == param, body


def test_prompt_shapes():
    assert parse_prompt({"prompt": "hi"}, 100) == ["hi"]
    assert parse_prompt({"prompt": [1, 2, 3]}, 100) == [1, 2, 3]
    assert parse_prompt({"prompt": [[1, 2]]}, 100) == [1, 2]
    assert parse_prompt({"prompt": [1, "a", 2]}, 100) == [1, "a", 2]
    for bad in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [1, 200]}, {"prompt": ["a", "b"]},
                {"prompt": [[1], [2]]}, {"prompt": [1.5]}):
        assert err(parse_prompt, bad, 100).status == 400


def test_messages():
    msgs = parse_messages({"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert [m["content"] for m in msgs] == ["s", "a\nb", ""]
    for bad in ({}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user"}]}, {"messages": ["hi"]},
                {"messages": [{"role": "user", "content": 5}]}):
        assert err(parse_messages, bad).status == 400
    e = err(parse_messages, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert e.status == 400 and e.type == "not_supported_error"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pyggspec.tokenizer import Tokenizer

    path = cached_model(tiny_dense(dtype="q8_0"), tmp_path_factory.mktemp("proto"))
    with Tokenizer(path) as tok:
        yield tok


def test_chat_template_jinja_equals_llama_builtin(tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    jinja = ChatTemplate(tokenizer).render(msgs)
    assert jinja == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello"
                     "<|im_end|>\n<|im_start|>assistant\n")
    assert ChatTemplate(tokenizer, jinja=False).render(msgs) == jinja
    assert ChatTemplate(tokenizer, template=CHATML).render(msgs) == jinja


def test_chat_template_errors_are_400(tokenizer):
    t = ChatTemplate(tokenizer, template="{{ raise_exception('roles must alternate') }}")
    e = err(t.render, [{"role": "user", "content": "x"}])
    assert e.status == 400 and "roles must alternate" in e.message
    t = ChatTemplate(tokenizer, template="{% if enable_thinking %}T{% endif %}{{ messages[0]"
                                         "['content'] }}")
    assert t.render([{"role": "user", "content": "x"}], kwargs={"enable_thinking": True}) == "Tx"
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate(tokenizer, template="{% if %}")


class _Spec:
    n_drafted, n_accepted, n_steps = 7, 4, 4
    drafted_at, accepted_at = [4, 2, 1], [3, 1, 0]


class _Timings:
    prompt_n, prompt_ms, predicted_n, predicted_ms, cache_n = 10, 5.0, 11, 20.0, 2


class _Result:
    stop_reason, timings, spec = "eos", _Timings(), _Spec()
    prompt_tokens, tokens = [1] * 12, [2] * 11


def test_metrics_text():
    m = ServeMetrics(n_max=3)
    m.count_request("/v1/chat/completions", 200)
    m.record_result(_Result())
    m.record_ttft(0.03)
    text = render(m.families(busy_slots=1, n_slots=4, queued=2,
                             memory={"kv": {"CPU": 1024}, "weights": {"CPU": 4096}}))
    lines = text.splitlines()
    assert 'pyggspec:requests_total{endpoint="/v1/chat/completions",status="200"} 1' in lines
    assert "pyggspec:spec_decode_num_draft_tokens_total 7" in lines
    assert "pyggspec:spec_decode_num_accepted_tokens_total 4" in lines
    assert 'pyggspec:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1' in lines
    # draft lengths per step: 4 steps, drafted 1, 1, 2, 3 tokens -> <=0: 0, <=1: 2, <=2: 3
    assert 'pyggspec:spec_decode_draft_length_bucket{le="0"} 0' in lines
    assert 'pyggspec:spec_decode_draft_length_bucket{le="1"} 2' in lines
    assert 'pyggspec:spec_decode_draft_length_bucket{le="3"} 4' in lines
    assert "pyggspec:spec_decode_draft_length_sum 7" in lines
    assert "pyggspec:requests_deferred 2" in lines
    assert 'pyggspec:memory_bytes{component="kv",device="CPU"} 1024' in lines
    assert "# TYPE pyggspec:time_to_first_token_seconds histogram" in lines


QWEN35_TEMPLATE = (Path(__file__).resolve().parents[1] / ".cache" / "llama-cpp-python-0.3.36"
                   / "vendor" / "llama.cpp" / "models" / "templates" / "Qwen3.5-4B.jinja")


@pytest.mark.skipif(not QWEN35_TEMPLATE.is_file(),
                    reason="needs the llama-cpp-python sdist that install.sh keeps in .cache/")
def test_real_qwen35_template_needs_jinja(tokenizer):
    """Qwen3.5's own template: thinking is dropped from history and the generation prompt
    opens <think> (or closes it with enable_thinking false) -- what llama.cpp's built-in
    matcher cannot do (it sees <|im_start|> and renders plain ChatML)."""
    src = QWEN35_TEMPLATE.read_text()
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"},
            {"role": "user", "content": "again"}]
    head = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
            "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    t = ChatTemplate(tokenizer, template=src)
    assert t.render(msgs) == head + "<think>\n"
    assert t.render(msgs, kwargs={"enable_thinking": False}) == head + "<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="--jinja"):
        ChatTemplate(tokenizer, template=src, jinja=False)


def test_ttft_histogram_is_counts_not_values():
    """The time-to-first-token histogram keeps one count per bucket (its memory does not
    grow with the requests served); values on a bound count in that bucket."""
    m = ServeMetrics(n_max=3)
    for s in [0.005, 0.01, 0.02, 0.3, 100.0] * 1000:
        m.record_ttft(s)
    assert len(m.ttft_counts) == 12 and sum(m.ttft_counts) == 5000
    lines = render(m.families(busy_slots=0, n_slots=1, queued=0)).splitlines()
    h = "pyggspec:time_to_first_token_seconds"
    assert f'{h}_bucket{{le="0.01"}} 2000' in lines
    assert f'{h}_bucket{{le="0.025"}} 3000' in lines
    assert f'{h}_bucket{{le="0.5"}} 4000' in lines
    assert f'{h}_bucket{{le="30.0"}} 4000' in lines
    assert f'{h}_bucket{{le="+Inf"}} 5000' in lines
    assert f"{h}_count 5000" in lines
    total = float(next(x for x in lines if x.startswith(f"{h}_sum")).split()[1])
    assert abs(total - 1000 * (0.005 + 0.01 + 0.02 + 0.3 + 100.0)) < 1e-6
