"""Vertex AI prediction mode (``AIP_MODE=PREDICTION``, issue 21): ``POST /predict`` with
``{"instances": [...]}`` answers ``{"predictions": [...]}``, each instance exactly as its
endpoint answers a direct request (llama-server 0.3.36's ``register_gcp_compat``; llama.cpp's
own ``unit/test_compat_gcp.py`` runs in tests/test_llama_server_suite.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from pyggspec.cli import main
from pyggspec.cli import serve as serve_mod
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.serving.http.vertex import VertexAI, request_format
from pyggspec.serving.server import ServerConfig, create_app
from tests.test_server_chat_parse import QWENISH

SAMPLING = SamplingParams(temp=0.0, seed=42)
CHAT = {"max_tokens": 6, "messages": [{"role": "user", "content": "Say hello"}]}


def test_settings_come_from_the_environment():
    assert VertexAI.from_env({}) is None
    assert VertexAI.from_env({"AIP_MODE": "TRAINING"}) is None
    assert VertexAI.from_env({"AIP_MODE": "PREDICTION"}) == VertexAI(8080, "/predict", None)
    v = VertexAI.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9001",
                           "AIP_PREDICT_ROUTE": "v1/endpoints/e:predict",
                           "AIP_HEALTH_ROUTE": "/ping"})
    assert v == VertexAI(9001, "/v1/endpoints/e:predict", "/ping")
    with pytest.raises(ValueError, match="AIP_HTTP_PORT='x8': not a port number"):
        VertexAI.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "x8"})


def test_request_formats_are_llama_servers_camel_case():
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/completion") == "completion"
    assert request_format("/v1/messages/count_tokens") == "messagesCountTokens"


@pytest.fixture(scope="module")
def model_path(models) -> Path:
    return models.dense(dtype="f32", agreement=0.9)


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, n_ctx=512, n_parallel=2, n_threads=1, n_batch=64, n_ubatch=16,
                sampling=SAMPLING) as e:
        yield e


def _client(engine, model_path, api_key=None, **kw):
    app = create_app(engine, ServerConfig(model_id="vertex", model_path=str(model_path),
                                          sampling=SAMPLING, chat_template=QWENISH,
                                          vertex=VertexAI(**kw), api_key=api_key))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def http(engine, model_path):
    with _client(engine, model_path) as c:
        yield c


def test_each_instance_answers_as_its_endpoint(http):
    """Two chat instances (run together, as parallel requests), a completion that asked to
    stream (answered whole), and a tokenize by path: each prediction is what the endpoint
    itself answers."""
    direct = http.post("/v1/chat/completions", json=CHAT).json()
    completion = http.post("/completion", json={"prompt": "Hello", "n_predict": 4}).json()
    tokens = http.post("/tokenize", json={"content": "Hello world"}).json()
    r = http.post("/predict", json={"instances": [
        {"@requestFormat": "chatCompletions", **CHAT},
        {"@requestFormat": "chatCompletions", **CHAT},
        {"@requestFormat": "completion", "prompt": "Hello", "n_predict": 4, "stream": True},
        {"@requestFormat": "/tokenize", "content": "Hello world"}]})
    assert r.status_code == 200
    chat1, chat2, comp, tok = r.json()["predictions"]
    for p in (chat1, chat2):
        assert p["object"] == "chat.completion"
        assert p["choices"][0]["message"] == direct["choices"][0]["message"]
        assert p["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    assert comp["content"] == completion["content"] and comp["tokens_predicted"] == 4
    assert tok == tokens


def test_a_bad_instance_gets_its_error_and_the_others_their_answers(http):
    r = http.post("/predict", json={"instances": [
        "not an object",
        {"messages": []},
        {"@requestFormat": "embeddings"},
        {"@requestFormat": "chatCompletions", "messages": "nope"},
        {"@requestFormat": "tokenize", "content": "ok"}]})
    assert r.status_code == 200
    p = r.json()["predictions"]
    assert p[0]["error"]["message"] == "each instance must be a JSON object"
    assert p[1]["error"]["message"] == "each instance must include a string @requestFormat"
    assert p[2]["error"]["message"] == "no handler registered for @requestFormat: embeddings"
    assert p[3]["error"]["code"] == 400 and p[3]["error"]["param"] == "messages"
    assert p[4]["tokens"]
    assert all(e["error"]["type"] == "invalid_request_error" for e in p[:4])


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b"{}", "request body must include an array field named instances"),
    (b'{"instances": {}}', "request body must include an array field named instances"),
    (b'{"instances": [' + b",".join([b"{}"] * 129) + b"]}",
     "instances array exceeds maximum size of 128"),
])
def test_a_bad_prediction_is_a_400(http, body, message):
    r = http.post("/predict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert message.lower() in r.json()["error"]["message"].lower()


def test_routes_api_key_and_health(engine, model_path):
    """Custom routes; the health route is public as /health is; /predict and the instances
    it runs need the key."""
    with _client(engine, model_path, predict_route="/v1/endpoints/e:predict",
                 health_route="/ping", api_key="k") as c:
        assert c.get("/ping").json() == {"status": "ok"}
        body = {"instances": [{"@requestFormat": "tokenize", "content": "a"}]}
        assert c.post("/v1/endpoints/e:predict", json=body).status_code == 401
        r = c.post("/v1/endpoints/e:predict", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["predictions"][0]["tokens"]
        moved = c.post("/predict", json=body, headers={"Authorization": "Bearer k"})
        assert moved.status_code == 404  # the default route is not there when moved


def test_a_prediction_route_that_is_an_endpoint_is_refused(engine, model_path):
    with pytest.raises(ValueError, match="AIP_PREDICT_ROUTE=/completion conflicts"):
        _client(engine, model_path, predict_route="/completion")


def test_serve_takes_aip_settings(monkeypatch):
    """``pyggspec serve`` under AIP_MODE=PREDICTION listens on AIP_HTTP_PORT (as llama-server,
    over --port, saying so) and hands the settings to the app; a bad port is one line."""
    import pyggspec.serving.server as server_mod

    seen = {}
    class FakeEngine(contextlib.nullcontext):
        spec_type, n_ctx = None, 512

    monkeypatch.setattr(serve_mod, "engine_from_config", lambda path, config: FakeEngine())
    monkeypatch.setattr(server_mod, "create_app",
                        lambda engine, config, **kw: seen.setdefault("config", config))
    monkeypatch.setattr(server_mod, "serve",
                        lambda app, host, port, **kw: seen.setdefault("port", port))
    monkeypatch.setattr(serve_mod, "_add_cors", lambda *a: None)
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9011", "AIP_HEALTH_ROUTE": "ping"}
    r = CliRunner().invoke(main, ["serve", "-m", "x.gguf", "--port", "8123"], env=env)
    assert r.exit_code == 0, r.output
    assert seen["port"] == 9011
    assert seen["config"].vertex == VertexAI(9011, "/predict", "/ping")
    assert "AIP_HTTP_PORT 9011 replaces port 8123" in r.output
    seen.clear()
    r = CliRunner().invoke(main, ["serve", "-m", "x.gguf"], env={**env, "AIP_HTTP_PORT": "-3"})
    assert r.exit_code == 2 and "AIP_HTTP_PORT='-3': not a port number" in r.output
    seen.clear()
    r = CliRunner().invoke(main, ["serve", "-m", "x.gguf"], env={"AIP_MODE": ""})
    assert r.exit_code == 0 and seen["config"].vertex is None
