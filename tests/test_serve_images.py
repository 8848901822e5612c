"""Images through the HTTP server (issue 52): OpenAI chat ``image_url`` parts with base64
data URIs, ``/props`` and ``/v1/models`` modality, and the 400s for bad image input.

Oracle: ``Engine.generate`` on the same rendered prompt with the same image (greedy tokens
identical); the projector is ``write_mmproj``'s, the text model the project's f32 one."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pyggspec.engine import Engine
from pyggspec.serving.http.app import create_app
from pyggspec.serving.http.chat import CHATML
from pyggspec.serving.http.state import ServerConfig
from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj

N = 6


@pytest.fixture(scope="module")
def files(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("serveimg")
    return {"model": models.dense(dtype="f32"),
            "mmproj": write_mmproj(d / "mmproj.gguf", VisionSpec(), 64), "dir": d}


@pytest.fixture(scope="module")
def png() -> bytes:
    return png_bytes(test_image_pixels(120, 90, seed=3))


@pytest.fixture(scope="module")
def engine(files):
    with Engine(files["model"], n_ctx=256, n_parallel=2, n_threads=1,
                mmproj=files["mmproj"], mmproj_offload=False) as e:
        yield e


@pytest.fixture(scope="module")
def http(engine, files):
    (files["dir"] / "img.png").write_bytes(png_bytes(test_image_pixels(120, 90, seed=3)))
    app = create_app(engine, ServerConfig(model_id="vl", chat_template=CHATML,
                                          media_path=str(files["dir"])))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _chat(url: str, text: str = "Look here") -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": N, "ignore_eos": True, "temperature": 0, "return_tokens": True}


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_chat_image_matches_engine(http, engine, png):
    r = http.post("/v1/chat/completions", json=_chat(_uri(png)))
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = "<|im_start|>user\nLook here<__media__><|im_end|>\n<|im_start|>assistant\n"
    ref = engine.generate(prompt, max_tokens=N, ignore_eos=True, images=[png])
    assert out["choices"][0]["message"]["content"] == ref.text
    assert out["usage"]["prompt_tokens"] == len(ref.prompt_tokens) > 10
    # the same image from --media-path
    r = http.post("/v1/chat/completions", json=_chat("file://img.png"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text


def test_props_and_models(http):
    props = http.get("/props").json()
    assert props["modalities"]["vision"] is True and props["modalities"]["audio"] is False
    assert "multimodal" in http.get("/v1/models").json()["models"][0]["capabilities"]


@pytest.mark.parametrize("url", [
    "data:text/html;base64,aGVsbG8=",  # not an image mime
    "data:image/png;base64,bm90IGFuIGltYWdl",  # not image bytes
    "malformed",
    "file://../img.png",  # outside --media-path
    "file://missing.png",
])
def test_bad_images_are_400(http, url):
    r = http.post("/v1/chat/completions", json=_chat(url))
    assert r.status_code == 400, r.text


def test_image_larger_than_context_is_400(http):
    big = png_bytes(test_image_pixels(640, 640, seed=1))
    r = http.post("/v1/chat/completions", json=_chat(_uri(big)))
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_no_projector_is_400(models):
    with Engine(models.dense(dtype="f32"), n_ctx=128, n_threads=1) as e, \
            TestClient(create_app(e, ServerConfig(model_id="t", chat_template=CHATML))) as c:
        r = c.post("/v1/chat/completions", json=_chat("data:image/png;base64,AAAA"))
        assert r.status_code == 400 and "--mmproj" in r.json()["error"]["message"]
        assert c.get("/props").json()["modalities"]["vision"] is False


def test_bad_image_beside_a_stream(http, png):
    """-np 2: a streamed text chat runs while an image request fails; the stream ends as
    the same chat alone does."""
    text = {"messages": [{"role": "user", "content": "a text prompt"}], "max_tokens": N,
            "ignore_eos": True, "temperature": 0}
    alone = http.post("/v1/chat/completions", json=text).json()["choices"][0]["message"]
    with http.stream("POST", "/v1/chat/completions", json={**text, "stream": True}) as s:
        bad = http.post("/v1/chat/completions", json=_chat("data:image/png;base64,AAAA"))
        body = "".join(s.iter_text())
    assert bad.status_code == 400
    assert '"finish_reason":"length"' in body.replace(" ", "")
    again = http.post("/v1/chat/completions", json=text).json()["choices"][0]["message"]
    assert again == alone


def test_speculative_image_chat_is_lossless(files, png):
    """--spec-type draft-mtp: the same greedy text as plain decoding over an image chat."""
    outs = []
    for spec in (None, "draft-mtp"):
        with Engine(files["model"], n_ctx=256, n_threads=1, spec_type=spec,
                    mmproj=files["mmproj"], mmproj_offload=False) as e, \
                TestClient(create_app(e, ServerConfig(model_id="vl",
                                                      chat_template=CHATML))) as c:
            r = c.post("/v1/chat/completions", json=_chat(_uri(png)))
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["message"]["content"])
    assert outs[0] == outs[1]


def test_completion_multimodal_data(http, engine, png):
    """llama-server's /completion prompt object: the server's marker places the image."""
    marker = http.get("/props").json()["media_marker"]
    text = "Look " + marker + " here"
    r = http.post("/completion", json={"prompt": {"prompt_string": text, "multimodal_data": [
        base64.b64encode(png).decode()]}, "n_predict": N, "ignore_eos": True,
        "temperature": 0})
    assert r.status_code == 200, r.text
    ref = engine.generate("Look <__media__> here", max_tokens=N, ignore_eos=True, images=[png])
    assert r.json()["content"] == ref.text
    for bad in (["malformed"], [""]):
        r = http.post("/completion", json={"prompt": {"prompt_string": text,
                                                      "multimodal_data": bad}})
        assert r.status_code == 400, r.text


def test_anthropic_image_blocks(http, png):
    """Anthropic ``image`` blocks (base64 source), in a message and in a tool result."""
    src = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    r = http.post("/v1/messages", json={"max_tokens": N, "messages": [{"role": "user", "content": [
        {"type": "image", "source": src}, {"type": "text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["type"] in ("text", "thinking")
    r = http.post("/v1/messages", json={"max_tokens": N, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "File: a.png"}, {"type": "image", "source": src}]}]}]})
    assert r.status_code == 200, r.text
    n = http.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": [
        {"type": "image", "source": src}]}]}).json()["input_tokens"]
    assert n > 10


def test_responses_input_image(http, png):
    r = http.post("/v1/responses", json={"max_output_tokens": N, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": _uri(png)}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 10
    r = http.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:text/html;base64,aGVsbG8="}]}]})
    assert r.status_code == 400


def test_remote_image_url(http, engine, png):
    """An http(s) image URL is fetched (as llama-server does), here from a loopback server;
    a 404, a refused connection and a non-image page are 400s."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/a.png": png, "/page": b"<html>not an image</html>"}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        r = http.post("/v1/chat/completions", json=_chat(base + "/a.png"))
        assert r.status_code == 200, r.text
        ref = http.post("/v1/chat/completions", json=_chat(_uri(png))).json()
        assert r.json()["choices"][0]["message"]["content"] == \
            ref["choices"][0]["message"]["content"]
        for url in (base + "/missing.png", base + "/page"):
            r = http.post("/v1/chat/completions", json=_chat(url))
            assert r.status_code == 400, r.text
    finally:
        srv.shutdown()
        srv.server_close()
    r = http.post("/v1/chat/completions", json=_chat(base + "/a.png"))  # nothing listens
    assert r.status_code == 400 and "failed to download" in r.json()["error"]["message"]


def test_real_qwen35_template_image_chat(http, engine, png):
    """Issue 52, item 6: with Qwen3.5's own template an image chat renders what llama-server
    b11549 renders for the same request (checked with its server on the same template):
    thinking on by default (``<think>\\n`` opens the answer), ``<think>\\n\\n</think>\\n\\n``
    with ``enable_thinking: false``; ``reasoning_format: none`` returns the opened block in
    ``content`` before the generated text, as llama-server does."""
    from tests.test_server_chat_parse import QWEN35_JINJA

    if not QWEN35_JINJA.exists():
        pytest.skip(f"no Qwen3.5 template here ({QWEN35_JINJA})")
    # the module's engine, whose scheduler the ``http`` app runs (this app must not stop it)
    app = create_app(engine, ServerConfig(model_id="vl", chat_template=QWEN35_JINJA.read_text()),
                     manage_scheduler=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        body = _chat(_uri(png))
        prompt = c.post("/apply-template", json=body).json()["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n")
        off = c.post("/apply-template", json={
            **body, "chat_template_kwargs": {"enable_thinking": False}}).json()["prompt"]
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        marker = c.get("/props").json()["media_marker"]
        assert prompt.count(marker) == 1
        r = c.post("/v1/chat/completions", json={**body, "reasoning_format": "none"})
        assert r.status_code == 200, r.text
        ref = engine.generate(prompt.replace(marker, "<__media__>"), max_tokens=N,
                              ignore_eos=True, images=[png])
        assert r.json()["choices"][0]["message"]["content"] == "<think>\n" + ref.text


def test_return_progress_counts_image_rows(http, engine, png):
    """``return_progress`` over an image prompt: every report's total is the prompt with its
    image rows (what ``usage.prompt_tokens`` says), processed only grows, the last one is
    complete -- as llama-server reports an image chunk's rows."""
    body = {**_chat(_uri(png)), "stream": True, "return_progress": True,
            "cache_prompt": False, "stream_options": {"include_usage": True}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    n_prompt = next(c["usage"]["prompt_tokens"] for c in chunks if c.get("usage"))
    text_only = len(engine.tokenize(
        "<|im_start|>user\nLook here<|im_end|>\n<|im_start|>assistant\n"))
    assert n_prompt > text_only + 1  # the image's rows are counted
    assert progress and all(p["total"] == n_prompt for p in progress)
    assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
    assert progress[-1]["processed"] == n_prompt


def test_images_are_encoded_on_the_engine_thread(http, png, monkeypatch):
    """Image encoding runs on the scheduler's thread, the one that computes the engine's
    graphs: encoded on an executor thread (a second OpenMP caller of ggml) it left every
    later decode step ~2x slower (journal row 95)."""
    import threading

    vision = http.app.state.pyggspec.vision
    seen: list[str] = []
    rows = vision.rows

    def spy(chunks):
        seen.append(threading.current_thread().name)
        return rows(chunks)

    monkeypatch.setattr(vision, "rows", spy)
    for url in ("/v1/chat/completions", "/completion"):
        body = _chat(_uri(png)) if url != "/completion" else {
            "prompt": {"prompt_string": f"Look {http.get('/props').json()['media_marker']}",
                       "multimodal_data": [base64.b64encode(png).decode()]},
            "n_predict": 1, "cache_prompt": False}
        assert http.post(url, json=body).status_code == 200
    assert seen == ["pyggspec-scheduler"] * 2


def test_verbose_prompt_of_an_image_chat(http, png):
    """``__verbose.prompt`` of an image chat is its text rows detokenized, the image rows
    left out, as llama-server's ``server_tokens::detokenize`` leaves them out (it was a
    500: an image row's id is negative); /completion's "prompt" likewise."""
    r = http.post("/v1/chat/completions", json={**_chat(_uri(png)), "verbose": True})
    assert r.status_code == 200, r.text
    prompt = r.json()["__verbose"]["prompt"]
    assert prompt == ("<|im_start|>user\nLook here<|vision_start|><|vision_end|><|im_end|>\n"
                      "<|im_start|>assistant\n")  # libmtmd's wrapping tokens are text rows
    marker = http.get("/props").json()["media_marker"]
    r = http.post("/completion", json={
        "prompt": {"prompt_string": f"Look {marker} here",
                   "multimodal_data": [base64.b64encode(png).decode()]},
        "n_predict": 1, "cache_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == "Look <|vision_start|><|vision_end|> here"
