"""``pyggspec serve`` against llama-server's response shapes (issue 21, API parity).

llama.cpp's ``tools/server`` is the reference: error bodies for malformed requests, the
final ``usage`` chunk of OpenAI streams, ``llamacpp:`` Prometheus series, ``/props`` and
``/v1/models`` fields. One small agreement model with an MTP head, one in-process app for
the module; requests are a few tokens long.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.http.chat import CHATML, ChatTemplate
from pyggspec.serving.http.model_info import ftype_name
from pyggspec.serving.http.template_caps import probe_caps
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server import sse_data

N_CTX = 256
SAMPLING = SamplingParams(temp=0.0, top_k=7, top_p=0.9, min_p=0.02, repeat_penalty=1.1,
                          repeat_last_n=32, presence_penalty=0.25, seed=42)
POSTS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
         "/completion", "/tokenize", "/detokenize", "/apply-template")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def model_path(models) -> Path:
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=N_CTX, n_parallel=2, n_threads=1, spec_type="draft-mtp",
                spec=SpecConfig(n_max=3), sampling=SAMPLING) as e:
        yield e


@pytest.fixture(scope="module")
def http(engine, model_path):
    app = create_app(engine, ServerConfig(model_id="parity", model_path=str(model_path),
                                          sampling=SAMPLING, n_predict=48))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


# ---------------------------------------------------------------------------- 1. errors
@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize("raw", [b"{not json", b'{"a": 1} trailing', b"{'a': 1}", b"",
                                 b"\xff\xfe", b"[]", b"5", b'"text"', b"null", b"true"])
def test_malformed_or_non_object_body_is_400(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # llama-server's / OpenAI's shape
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/completion", "n_predict", "ten"), ("/completion", "temperature", "hot"),
    ("/completion", "top_k", 1.5), ("/completion", "repeat_last_n", 10**30),
    ("/completion", "top_k", 2**31), ("/completion", "presence_penalty", 1e300),
    ("/completion", "seed", "x"), ("/completion", "stream", "yes"),
    ("/completion", "cache_prompt", 1), ("/completion", "n_keep", "all"),
    ("/completion", "dry_multiplier", "x"), ("/completion", "timings_per_token", "no"),
    ("/completion", "id_slot", 0.5), ("/completion", "reasoning_format", 3),
    ("/v1/completions", "max_tokens", [1]), ("/v1/completions", "echo", "true"),
    ("/v1/completions", "stream_options", "usage"),
    ("/v1/chat/completions", "max_completion_tokens", {}),
    ("/v1/chat/completions", "chat_template_kwargs", []),
    ("/v1/chat/completions", "stop", 5), ("/tokenize", "with_pieces", "yes"),
    ("/detokenize", "tokens", "1 2"),
])
def test_wrong_type_or_range_of_a_known_field_is_400(http, path, field, value):
    base = {"/tokenize": {"content": "x"}, "/detokenize": {"tokens": [1]},
            "/v1/completions": {"prompt": "x"},
            "/v1/chat/completions": CHAT}.get(path, {"prompt": "x", "n_predict": 2})
    r = http.post(path, json={**base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field


def test_no_field_value_is_a_500(http):
    """Every request field pyggspec reads, with values of every JSON kind: never a 500."""
    fields = ["prompt", "messages", "model", "stream_options", "n_predict", "max_tokens",
              "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
              "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "samplers",
              "logit_bias", "stop", "ignore_eos", "n", "echo", "suffix", "cache_prompt",
              "return_tokens", "speculative", "speculative.n_max", "chat_template_kwargs",
              "response_format", "logprobs", "n_probs", "grammar", "json_schema", "tools",
              "n_keep"]
    values = [None, True, 0, -1, 1.5, "s", [], [1], {}, {"a": 1}, 10**30, 1e308, -(2**31) - 1]
    bases = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "x", "max_tokens": 2},
             "/completion": {"prompt": "x", "n_predict": 2}}
    bad = []
    for path, base in bases.items():
        for f in fields:
            for v in values:
                r = http.post(path, json={**base, f: v})
                if r.status_code >= 500:
                    bad.append((path, f, v, r.status_code, r.text[:120]))
    assert not bad


# ---------------------------------------------------------------------------- 2. stream usage
def _stream(http, path, body) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return sse_data(r.iter_lines())


def test_completions_stream_final_chunk_has_usage(http):
    body = {"prompt": "Once upon", "max_tokens": 5, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    # without include_usage: llama-server's last chunk is its whole final result, usage in it
    *_, last, done = _stream(http, "/v1/completions", body)
    assert done == "[DONE]"
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 5 == whole["usage"]["completion_tokens"]
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    # with include_usage: OpenAI's extra chunk, no choices, just before [DONE]
    chunks = _stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *_, fin, use, done = chunks
    assert done == "[DONE]" and fin["choices"][0]["finish_reason"] == "length"
    assert use["choices"] == [] and use["object"] == "text_completion"
    assert use["usage"] == {**whole["usage"], "prompt_tokens_details": use["usage"][
        "prompt_tokens_details"]}
    assert sum(1 for c in chunks[:-1] if c["choices"] == []) == 1


def test_chat_stream_usage_only_when_asked(http):
    chunks = _stream(http, "/v1/chat/completions", CHAT)
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])  # llama-server
    chunks = _stream(http, "/v1/chat/completions",
                     {**CHAT, "stream_options": {"include_usage": True}})
    *_, fin, use, done = chunks
    assert done == "[DONE]" and fin["choices"][0]["finish_reason"] in ("stop", "length")
    assert use["choices"] == [] and use["object"] == "chat.completion.chunk"
    assert use["usage"]["total_tokens"] == (use["usage"]["prompt_tokens"]
                                            + use["usage"]["completion_tokens"])


# ---------------------------------------------------------------------------- 3. /metrics
def _metrics(http) -> tuple[str, dict[str, tuple[str, float]]]:
    """llama.cpp's test_metrics.py parser: {name: (type, value)} of unlabelled llamacpp:
    samples, every one with a # TYPE line."""
    r = http.get("/metrics")
    assert r.status_code == 200 and "Process-Start-Time-Unix" in r.headers
    out, types = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            assert name in types, name
            out[name] = (types[name], float(value))
    return r.text, out


def test_metrics_has_llamacpp_series_beside_ours(http):
    _, before = _metrics(http)
    n_prompt = n_pred = 0
    for n in (1, 4, 9):
        t = http.post("/completion", json={"prompt": "I believe", "n_predict": n,
                                           "ignore_eos": True}).json()["timings"]
        n_prompt += t["prompt_n"]
        n_pred += t["predicted_n"]
    text, m = _metrics(http)
    counters = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total",
                "n_tokens_max", "spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total"]
    gauges = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
              "requests_deferred", "n_busy_slots_per_decode"]
    for name in counters:
        assert m["llamacpp:" + name][0] == "counter", name
    for name in gauges:
        assert m["llamacpp:" + name][0] == "gauge", name
    for name in counters + gauges:
        assert f"# HELP llamacpp:{name} " in text
    assert "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding " \
           "cached tokens" in text

    def delta(name: str) -> float:
        return m["llamacpp:" + name][1] - before.get("llamacpp:" + name, ("", 0.0))[1]

    assert delta("tokens_predicted_total") == n_pred
    assert delta("prompt_tokens_total") == n_prompt
    assert m["llamacpp:n_decode_total"][1] > 0 and m["llamacpp:requests_processing"][1] == 0
    assert m["llamacpp:n_tokens_max"][1] >= 9
    assert m["llamacpp:n_busy_slots_per_decode"][1] >= 1
    assert m["llamacpp:predicted_tokens_seconds"][1] > 0
    # the throughput gauges cover the window since the previous scrape (llama-server)
    _, again = _metrics(http)
    assert again["llamacpp:predicted_tokens_seconds"][1] == 0
    assert again["llamacpp:tokens_predicted_total"][1] == m["llamacpp:tokens_predicted_total"][1]
    # pyggspec's own series stay
    assert "pyggspec:tokens_predicted_total " in text and "pyggspec:memory_bytes{" in text


# ---------------------------------------------------------------------------- 4. /props
def test_props_fields_from_the_real_model_and_settings(http, engine):
    p = http.get("/props").json()
    assert p["model_ftype"] == "all F32" and p["model_path"].endswith(".gguf")
    assert p["modalities"] == {"vision": False, "video": False, "audio": False}
    tok = engine.tokenizer
    assert p["bos_token"] == tok.token_to_piece(tok.bos).decode()
    assert p["eos_token"] == tok.token_to_piece(tok.eos).decode()
    caps = p["chat_template_caps"]
    assert sorted(caps) == list(caps) == [
        "supports_object_arguments", "supports_parallel_tool_calls",
        "supports_preserve_reasoning", "supports_reasoning_effort", "supports_string_content",
        "supports_system_role", "supports_tool_calls", "supports_tools",
        "supports_typed_content"]
    assert caps["supports_string_content"] and caps["supports_system_role"]
    assert p["total_slots"] == 2 and p["model_alias"] == "parity"
    d = p["default_generation_settings"]
    assert d["n_ctx"] == N_CTX
    s = d["params"]
    assert {k: s[k] for k in ("seed", "temperature", "top_k", "top_p", "min_p", "typical_p",
                              "repeat_penalty", "repeat_last_n", "presence_penalty",
                              "frequency_penalty", "n_predict", "max_tokens", "stop",
                              "ignore_eos")} == {
        "seed": 42, "temperature": 0.0, "top_k": 7, "top_p": 0.9, "min_p": 0.02,
        "typical_p": 1.0, "repeat_penalty": 1.1, "repeat_last_n": 32,
        "presence_penalty": 0.25, "frequency_penalty": 0.0, "n_predict": 48,
        "max_tokens": 48, "stop": [], "ignore_eos": False}
    # llama-server's other sampler fields, in their disabled state (not implemented here)
    for key in ("dynatemp_range", "top_n_sigma", "xtc_probability", "xtc_threshold",
                "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                "mirostat", "mirostat_tau", "mirostat_eta", "n_probs", "min_keep", "n_keep",
                "samplers", "logit_bias", "grammar", "chat_format", "reasoning_format",
                "speculative.types", "timings_per_token", "post_sampling_probs", "lora"):
        assert key in s, key
    assert s["mirostat"] == 0 and s["dry_multiplier"] == 0.0 and s["speculative.types"] == \
        "draft-mtp"


def test_request_settings_echo_what_the_request_set(http):
    r = http.post("/completion", json={"prompt": "x", "n_predict": 3, "top_k": 3,
                                       "temperature": 0.7, "stop": ["zz"], "seed": 5,
                                       "speculative": False}).json()
    g = r["generation_settings"]
    assert (g["top_k"], g["temperature"], g["stop"], g["seed"], g["n_predict"]) == \
        (3, 0.7, ["zz"], 5, 3)
    assert g["speculative.types"] == "none" and g["top_p"] == 0.9  # server default kept


# ---------------------------------------------------------------------------- 5. /v1/models
def test_models_list_and_meta_from_the_model_file(http, engine):
    body = http.get("/v1/models").json()
    assert [m["name"] for m in body["models"]] == ["parity"]
    assert body["models"][0]["details"]["format"] == "gguf"
    assert body["object"] == "list" and [d["id"] for d in body["data"]] == ["parity"]
    meta = body["data"][0]["meta"]
    trunk = engine.model.trunk
    assert meta["n_params"] == sum(t.n_elements for t in trunk.tensors.values())
    assert meta["size"] == sum(t.nbytes for t in trunk.tensors.values())
    assert (meta["vocab_type"], meta["ftype"]) == (2, "all F32")  # gpt2 BPE = LLAMA_VOCAB_TYPE_BPE
    assert (meta["n_vocab"], meta["n_ctx"], meta["n_embd"]) == (engine.n_vocab, N_CTX,
                                                                engine.hp.n_embd)
    assert meta["n_ctx_train"] == engine.hp.n_ctx_train
    assert meta["speculative"] == "draft-mtp"  # pyggspec's own stay


def test_completions_without_v1_is_llama_servers_shape(http):
    r = http.post("/completions", json={"prompt": "x", "n_predict": 2}).json()
    assert "content" in r and "choices" not in r and r["stop"] is True


# ---------------------------------------------------------------------------- units
def test_ftype_name_as_llama_cpp():
    assert ftype_name(15, []) == "Q4_K - Medium" and ftype_name(1, []) == "F16"
    assert ftype_name(1024 | 7, []) == "Q8_0"
    assert ftype_name(None, ["f32", "q4_K", "q4_K"]) == "(guessed) Q4_K - Medium"
    assert ftype_name(999, []) == "unknown, may not work"


class _NoSpecials:
    bos = eos = chat_template = None


def test_template_caps_of_chatml_and_a_tool_template():
    chatml = ChatTemplate(_NoSpecials(), CHATML).caps()
    assert chatml["supports_string_content"] and chatml["supports_system_role"]
    assert not chatml["supports_tools"] and not chatml["supports_tool_calls"]
    assert not chatml["supports_typed_content"]
    tools = ("{%- if tools %}{% for t in tools %}<tool>{{ t.function.name }}</tool>{% endfor %}"
             "{% endif %}{%- for m in messages %}{% if m.content is string %}{{ m.content }}"
             "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
             "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
             "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endfor %}")
    caps = ChatTemplate(_NoSpecials(), tools).caps()
    assert caps["supports_tools"] and caps["supports_tool_calls"]
    assert caps["supports_parallel_tool_calls"] and caps["supports_typed_content"]
    assert caps["supports_object_arguments"] and not caps["supports_preserve_reasoning"]
    # a template that refuses everything supports nothing it was probed for
    def refuse(variables):
        raise ValueError("no")
    none = probe_caps(refuse)
    assert not any(v for k, v in none.items())


QWEN35 = (Path(__file__).resolve().parents[1] / ".cache" / "llama-cpp-python-0.3.36" / "vendor"
          / "llama.cpp" / "models" / "templates" / "Qwen3.5-4B.jinja")


@pytest.mark.skipif(not QWEN35.is_file(), reason="needs the llama-cpp-python sdist in .cache/")
def test_template_caps_of_qwen35():
    caps = ChatTemplate(_NoSpecials(), QWEN35.read_text()).caps()
    assert caps["supports_tools"] and caps["supports_tool_calls"]
    assert caps["supports_parallel_tool_calls"] and caps["supports_object_arguments"]
    assert caps["supports_system_role"] and caps["supports_typed_content"]


# ---------------------------------------------------------------------------- flags' effects
def test_no_slots_is_501_and_models_lists_aliases_and_tags(engine, model_path):
    """llama-server's --no-slots (GET /slots: 501 not_supported_error), -a A,B and --tags
    (/v1/models data[].aliases / tags; the id is the first alias)."""
    app = create_app(engine, ServerConfig(model_id="code", model_path=str(model_path),
                                          aliases=("code", "fim"), tags=("chat",),
                                          endpoint_slots=False),
                     manage_scheduler=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        assert c.get("/props").json()["endpoint_slots"] is False
        card = c.get("/v1/models").json()["data"][0]
        assert (card["id"], card["aliases"], card["tags"]) == ("code", ["code", "fim"],
                                                               ["chat"])


def test_system_fingerprint_has_llama_servers_form(http):
    """llama-server's system_fingerprint is 'b<build>-<commit>'; its tests and clients read
    the 'b' prefix (whole and streamed answers)."""
    r = http.post("/v1/chat/completions", json=CHAT).json()
    assert r["system_fingerprint"].startswith("b")
    chunks = _stream(http, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert all(c["system_fingerprint"].startswith("b") for c in chunks if isinstance(c, dict))


def test_id_slot_pins_the_request_to_that_slot(http):
    """llama-server's id_slot: the request runs on that slot (its answer says so); -1 means
    any; an id the server does not have, or below -1, is a 400 naming the field."""
    for slot in (1, 0, 1):
        r = http.post("/completion", json={"prompt": "hello", "n_predict": 2, "id_slot": slot})
        assert r.status_code == 200 and r.json()["id_slot"] == slot
    r = http.post("/completion", json={"prompt": "hello", "n_predict": 2, "id_slot": -1})
    assert r.status_code == 200 and r.json()["id_slot"] in (0, 1)
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "id_slot": 1})
    assert r.status_code == 200
    for bad in (2, -2):
        r = http.post("/completion", json={"prompt": "hello", "n_predict": 2, "id_slot": bad})
        assert r.status_code == 400 and "id_slot" in r.json()["error"]["message"]
