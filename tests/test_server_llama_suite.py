"""Behaviours llama.cpp's own server tests (``scripts/llama_server_suite.py``) check, kept
here on a small generated model so ``python3 -m pytest`` guards them without the suite:
``--metrics`` off is a 501, ``__verbose``, assistant prefill and ``continue_final_message``,
``/chat/completions/input_tokens``, ``n`` choices, llama.cpp's built-in templates by name
with ``--no-jinja``. The reference is llama-server 0.3.36's ``tools/server/*.cpp``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.http.chat import ChatTemplate
from pyggspec.serving.server import ServerConfig, create_app

SAMPLING = SamplingParams(temp=0.0, seed=42)
BOOK = [{"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def model_path(models):
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=256, n_parallel=2, n_threads=1, sampling=SAMPLING) as e:
        yield e


def client(engine, model_path, manage_scheduler=False, **cfg):
    """An app over the module's engine (whose scheduler the ``http`` app runs: tests that
    make their own app ask for ``http`` too)."""
    app = create_app(engine, ServerConfig(model_id="suite", model_path=str(model_path),
                                          sampling=SAMPLING, **cfg),
                     manage_scheduler=manage_scheduler)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def http(engine, model_path):
    with client(engine, model_path, manage_scheduler=True) as c:
        yield c


def test_metrics_off_is_501(engine, model_path, http):
    with client(engine, model_path, endpoint_metrics=False) as c:
        r = c.get("/metrics")
        assert r.status_code == 501 and "--metrics" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "not_supported_error"
        assert c.get("/props").json()["endpoint_metrics"] is False


def test_verbose_object(engine, model_path, http):
    """llama-server: ``__verbose`` (its /completion result, the prompt as read) when the
    request's ``verbose`` is true; its default is the server's --verbose."""
    body = {"messages": BOOK, "max_tokens": 2}
    assert "__verbose" not in http.post("/v1/chat/completions", json=body).json()
    r = http.post("/v1/chat/completions", json={**body, "verbose": True}).json()
    assert "Book" in r["__verbose"]["prompt"] and "<|im_start|>" in r["__verbose"]["prompt"]
    assert r["__verbose"]["tokens_evaluated"] == r["usage"]["prompt_tokens"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "verbose": True})
    assert r.json()["__verbose"]["prompt"] == "hi"
    with client(engine, model_path, verbose=True) as c:
        for verbose in (True, False):
            r = c.post("/chat/completions", json={**body, "verbose": verbose}).json()
            assert ("__verbose" in r) is verbose


def _prompt(http, **body):
    r = http.post("/apply-template", json={"messages": BOOK, **body})
    return r.status_code, r.json()


def test_assistant_prefill_and_continue_final_message(http):
    """A trailing assistant message is continued (llama-server's prefill_assistant), as
    ``continue_final_message`` does explicitly; content parts join with a blank line."""
    start = "<|im_start|>user\nWhat is the best book<|im_end|>\n<|im_start|>assistant\n"
    s, r = _prompt(http, messages=BOOK + [{"role": "assistant", "content": "Whill"}])
    assert s == 200 and r["prompt"].endswith(start + "Whill"), r
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    s, r = _prompt(http, messages=BOOK + [{"role": "assistant", "content": parts}])
    assert s == 200 and r["prompt"].endswith(start + "Wh\n\nill"), r
    s, r = _prompt(http, messages=BOOK + [{"role": "assistant", "content": "Whill"}],
                   add_generation_prompt=False, continue_final_message=True)
    assert s == 200 and r["prompt"].endswith(start + "Whill"), r
    # the continuation is what a chat request generates from
    r = http.post("/v1/chat/completions", json={
        "messages": BOOK + [{"role": "assistant", "content": "Whill"}], "max_tokens": 2,
        "verbose": True})
    assert r.status_code == 200 and r.json()["__verbose"]["prompt"].endswith(start + "Whill")


@pytest.mark.parametrize("body", [
    {"add_generation_prompt": True, "continue_final_message": True,
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"},
                  {"role": "assistant", "content": "b"}]},
])
def test_continuation_conflicts_are_400(http, body):
    for path in ("/apply-template", "/v1/chat/completions"):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_no_prefill_assistant_renders_a_finished_turn(engine, model_path, http):
    msgs = BOOK + [{"role": "assistant", "content": "Whill"}]
    with client(engine, model_path, prefill_assistant=False) as c:
        r = c.post("/apply-template", json={"messages": msgs}).json()
    assert r["prompt"].endswith("Whill<|im_end|>\n<|im_start|>assistant\n")


def test_add_generation_prompt_false(http):
    s, r = _prompt(http, add_generation_prompt=False)
    assert s == 200 and r["prompt"].endswith("What is the best book<|im_end|>\n")


def test_chat_input_tokens(http, engine):
    prompt = _prompt(http)[1]["prompt"]
    n = len(engine.tokenizer.tokenize(prompt, add_special=True, parse_special=True))
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        r = http.post(path, json={"messages": BOOK})
        assert r.status_code == 200 and r.json() == {"input_tokens": n,
                                                     "object": "response.input_tokens"}
    assert http.post("/v1/chat/completions/input_tokens", json={}).status_code == 400


def test_several_choices(http):
    r = http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 4, "n": 2,
                                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length"
               for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 8
    for bad in ({"n": 0}, {"n": 2, "stream": True}, {"n": "2"}):
        r = http.post("/v1/chat/completions", json={"messages": BOOK, **bad})
        assert r.status_code == 400, (bad, r.text)
    assert http.post("/v1/completions", json={"prompt": "a", "n": 2}).status_code == 400


def test_builtin_template_by_name_without_jinja(engine):
    """``--no-jinja --chat-template command-r``: llama.cpp's built-in template by name."""
    t = ChatTemplate(engine.tokenizer, "command-r", jinja=False)
    out = t.render([{"role": "system", "content": "You are a test."},
                    {"role": "user", "content": "Hi there"}])
    assert out == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert "built-in command-r" in t.name
    with pytest.raises(ValueError, match="built-in templates"):
        ChatTemplate(engine.tokenizer, "no-such-template", jinja=False)


def test_metrics_header_in_llama_servers_casing(http):
    """llama.cpp's test_metrics reads a plain dict of response headers."""
    r = http.get("/metrics")
    assert r.status_code == 200
    assert b"Process-Start-Time-Unix" in [k for k, _ in r.headers.raw]


def test_context_error_in_llama_servers_words(http):
    r = http.post("/completion", json={"prompt": [300] * 300, "n_predict": 4})
    assert r.status_code == 400
    assert "exceeds the available context size" in r.json()["error"]["message"]


def test_template_date_variables_and_thinking_markers(engine):
    """llama.cpp's template context has today's date (date_string, datetime); a template
    whose thinking markers are not Qwen's <think> still thinks with --reasoning auto."""
    import datetime

    from pyggspec.serving.http.chat_request import parse_chat_request
    from pyggspec.serving.http.protocol import parse_messages

    t = ChatTemplate(engine.tokenizer, "{{ date_string }}|{{ datetime }}")
    today = datetime.date.today()
    assert t.render([{"role": "user", "content": "x"}]) == (
        f"{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}")
    cohere = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
              "<|CHATBOT_TOKEN|>{% if not enable_thinking %}<|START_THINKING|><|END_THINKING|>"
              "{% endif %}{% endif %}")
    t = ChatTemplate(engine.tokenizer, cohere)
    assert t.supports_thinking and not t.thinks
    body = {"messages": [{"role": "user", "content": "x"}]}
    req = parse_chat_request(body, parse_messages(body), ServerConfig(model_id="t"), t)
    assert req.kwargs["enable_thinking"] is True
    off = parse_chat_request(body, parse_messages(body),
                             ServerConfig(model_id="t", reasoning="off"), t)
    assert off.kwargs["enable_thinking"] is False
    assert not ChatTemplate(engine.tokenizer, "{{ messages[0].content }}").supports_thinking


def test_prompt_shapes_several_and_objects():
    """llama-server's ``tokenize_input_prompts``: an array with no ids at its top level
    holds several prompts; ``{"prompt_string": ...}`` is a prompt; multimodal data is not."""
    from pyggspec.serving.http.protocol import ApiError, parse_prompts

    assert parse_prompts({"prompt": "a"}, 100) == [["a"]]
    assert parse_prompts({"prompt": [1, "a", 2]}, 100) == [[1, "a", 2]]
    assert parse_prompts({"prompt": [[1, 2], "a", {"prompt_string": "b"}, [3, "c"]]}, 100) \
        == [[1, 2], ["a"], ["b"], [3, "c"]]
    assert parse_prompts({"prompt": {"prompt_string": "x"}}, 100) == [["x"]]
    for bad in ({"prompt": []}, {"prompt": [[]]}, {"prompt": [{"text": "x"}]},
                {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}},
                {"prompt": [[1, 200]]}, {"prompt": [["a"]] * 17}, {"prompt": [[1.5]]}):
        with pytest.raises(ApiError) as e:
            parse_prompts(bad, 100)
        assert e.value.status == 400, bad


def test_several_prompts_in_one_request(http):
    ids = [300, 301, 302]
    r = http.post("/completion", json={"prompt": [ids, ids], "n_predict": 3,
                                       "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1]
    assert body[0]["content"] == body[1]["content"] and body[0]["prompt"] == ids
    r = http.post("/completion", json={"prompt": [ids, {"prompt_string": "hi"}],
                                       "n_predict": 2})
    assert r.status_code == 200 and len(r.json()) == 2
    r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 6
    r = http.post("/completion", json={"prompt": [ids, ids], "stream": True})
    assert r.status_code == 400
    r = http.post("/completion", json={"prompt": [ids, [300] * 300], "n_predict": 2})
    assert r.status_code == 400  # every prompt is checked before any is queued
    assert http.post("/completion", json={"prompt": {"prompt_string": "hi"},
                                          "n_predict": 2}).status_code == 200


def test_logit_bias_keyed_by_text(http, engine):
    """A key that is text biases each of its tokens (llama-server tokenizes it, no special
    tokens); ids, as numbers or numeric strings, are ids."""
    from pyggspec.serving.http.protocol import parse_sampling

    tok = engine.tokenizer
    ids = tok.tokenize(" the book ", add_special=False, parse_special=False)
    p = parse_sampling({"logit_bias": [[" the book ", -100], [5, 1.0]]}, SAMPLING,
                       engine.n_vocab, lambda t: tok.tokenize(t, add_special=False,
                                                              parse_special=False))
    assert p.logit_bias == tuple((t, -100.0) for t in ids) + ((5, 1.0),)
    p = parse_sampling({"logit_bias": {" the book ": False, "7": 2}}, SAMPLING,
                       engine.n_vocab, lambda t: tok.tokenize(t, add_special=False,
                                                              parse_special=False))
    assert p.logit_bias == tuple((t, float("-inf")) for t in ids) + ((7, 2.0),)
    r = http.post("/completion", json={"prompt": "What is the best book", "n_predict": 4,
                                       "logit_bias": {" the book ": -100}})
    assert r.status_code == 200, r.text
    assert http.post("/completion", json={"prompt": "x", "logit_bias": [["a", "b"]]}
                     ).status_code == 400


def test_ignore_eos_lists_the_eog_biases(http, engine):
    """llama-server's ignore_eos adds a -inf bias (JSON null) per end-of-generation token
    to generation_settings.logit_bias; without it the list is the request's own."""
    r = http.post("/completion", json={"prompt": "x", "n_predict": 2, "ignore_eos": True})
    bias = r.json()["generation_settings"]["logit_bias"]
    assert sorted(b["token"] for b in bias) == sorted(engine.tokenizer.eog_ids())
    assert bias and all(b["bias"] is None for b in bias)
    r = http.post("/completion", json={"prompt": "x", "n_predict": 2})
    assert r.json()["generation_settings"]["logit_bias"] == []
