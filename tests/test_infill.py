"""``POST /infill`` (issue 21: llama-server's fill-in-the-middle endpoint).

The prompt is llama.cpp's ``format_prompt_infill`` token for token: checked against a
transcription of that C++ function (every cut: prefix, suffix, extra context; SPM order), on
a generated model whose vocabulary carries Qwen's FIM tokens, and, where the repository has
llama-server b11549 built, against llama-server itself on the same GGUF. A model without FIM
tokens gets llama-server's 501; malformed fields are 400s as there.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pyggspec.engine import Engine
from pyggspec.serving.http.infill import format_infill
from pyggspec.serving.server import ServerConfig, create_app
from pyggspec.testing.vocab import FIM_TOKENS, build_vocab
from tests.test_server import sse_data

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / ".cache/llama.cpp-b11549-build/bin/llama-server"
N_CTX, N_BATCH = 512, 64
PREFIX = "def main(argv: list[str]) -> int:\n    total = 0\n"
SUFFIX = "    return total\n\n\nif __name__ == \"__main__\":\n    main([])\n"
EXTRA = [{"filename": "util.py", "text": "def value(index):\n    return index * 2\n"},
         {"text": "class Tokenizer:\n    pass\n"}]
BODY = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
        "prompt": "    for index", "n_predict": 4, "temperature": 0}


@pytest.fixture(scope="module")
def fim_path(models) -> Path:
    return models.dense(dtype="f32", fim_tokens=True)


@pytest.fixture(scope="module")
def engine(fim_path):
    with Engine(fim_path, n_ctx=N_CTX, n_parallel=1, n_batch=N_BATCH, n_threads=2) as e:
        yield e


@pytest.fixture(scope="module")
def http(engine, fim_path):
    app = create_app(engine, ServerConfig(model_id="fim", model_path=str(fim_path)))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def ids_by_text() -> dict[str, int]:
    v = build_vocab(1024, fim=True)
    return {t: v.tokens.index(t) for t in FIM_TOKENS}


def reference(tok, prefix, suffix, extra, prompt, n_batch, n_predict, n_ctx, spm=False):
    """llama.cpp b11549 ``format_prompt_infill``, transcribed statement by statement (FIM
    ids looked up by their text in the vocabulary, as llama-vocab.cpp does for Qwen)."""
    ids = ids_by_text()
    FIM_PRE, FIM_SUF, FIM_MID = ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"]
    FIM_REP, FIM_SEP = ids["<|repo_name|>"], ids["<|file_sep|>"]

    def common_tokenize(s):
        return tok.tokenize(s, add_special=False, parse_special=False)

    extra_tokens = []
    tokens_prefix = common_tokenize(prefix)
    tokens_suffix = common_tokenize(suffix)
    extra_tokens.append(FIM_REP)
    extra_tokens += common_tokenize("myproject\n")
    for chunk in extra:
        text = chunk.get("text", "")
        filename = chunk.get("filename", "tmp")
        extra_tokens.append(FIM_SEP)
        extra_tokens += common_tokenize(filename + "\n")
        extra_tokens += common_tokenize(text)
    extra_tokens.append(FIM_SEP)
    extra_tokens += common_tokenize("filename\n")
    n_prefix_take = min(len(tokens_prefix), 3 * int(n_batch / 4))
    n_suffix_take = min(len(tokens_suffix), max(0, int(n_batch / 4) - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    del tokens_prefix[: len(tokens_prefix) - n_prefix_take]
    del tokens_suffix[n_suffix_take:]
    tokens_prefix.insert(0, FIM_PRE)
    tokens_prefix += prompt
    tokens_suffix.insert(0, FIM_SUF)
    embd_inp = list(tokens_suffix if spm else tokens_prefix)
    embd_end = tokens_prefix if spm else tokens_suffix
    embd_inp[:0] = extra_tokens[len(extra_tokens) - n_extra_take:]
    embd_inp += embd_end
    embd_inp.append(FIM_MID)
    return embd_inp


def test_fim_tokens_are_found_in_the_vocabulary(engine, models):
    ids = ids_by_text()
    fim = engine.tokenizer.fim
    assert (fim.pre, fim.suf, fim.mid, fim.pad, fim.rep, fim.sep) == tuple(
        ids[t] for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
                         "<|repo_name|>", "<|file_sep|>"))
    assert not engine.tokenizer.add_bos


@pytest.mark.parametrize("spm", [False, True])
@pytest.mark.parametrize("n_batch, n_ctx, n_predict", [
    (2048, 512, -1),  # llama-server's defaults on a small context: no extra context at all
    (64, 512, -1),  # prefix and suffix cut, all the extra context
    (16, 512, -1),  # the suffix gets nothing (the prompt takes its quarter)
    (64, 100, 8),  # only the tail of the extra context
])
def test_prompt_is_llama_cpps_token_for_token(engine, spm, n_batch, n_ctx, n_predict):
    tok = engine.tokenizer
    prompt = tok.tokenize(BODY["prompt"], add_special=False, parse_special=True)
    got = format_infill(tok, PREFIX, SUFFIX, EXTRA, prompt, n_batch=n_batch,
                        n_predict=n_predict, n_ctx=n_ctx, spm=spm)
    want = reference(tok, PREFIX, SUFFIX, EXTRA, prompt, n_batch, n_predict, n_ctx, spm)
    assert got == want
    ids = ids_by_text()
    assert got[-1] == ids["<|fim_middle|>"]
    take = n_ctx - n_batch - 2 * n_predict  # extra tokens kept: its tail, ending at the
    assert (ids["<|file_sep|>"] in got) == (take > 0)  # current file's <|file_sep|>


def test_token_ids_and_strings_mix_in_prefix_and_suffix(engine):
    """``input_prefix`` / ``input_suffix`` take llama.cpp's mixed prompts: strings and ids."""
    tok = engine.tokenizer
    a = format_infill(tok, ["x = ", 65, "y"], [66], [], [], n_batch=2048, n_predict=-1,
                      n_ctx=N_CTX)
    ids = ids_by_text()
    plain = tok.tokenize("x = ", add_special=False, parse_special=False)
    y = tok.tokenize("y", add_special=False, parse_special=False)
    assert a == [ids["<|fim_prefix|>"], *plain, 65, *y, ids["<|fim_suffix|>"], 66,
                 ids["<|fim_middle|>"]]


def test_infill_endpoint_builds_that_prompt_and_generates(http, engine):
    tok = engine.tokenizer
    prompt = tok.tokenize(BODY["prompt"], add_special=False, parse_special=True)
    want = reference(tok, PREFIX, SUFFIX, EXTRA, prompt, N_BATCH, -1, N_CTX)
    r = http.post("/infill", json={**BODY, "return_tokens": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_evaluated"] == len(want) and out["prompt"] == tok.detokenize(want)
    assert out["tokens_predicted"] == len(out["tokens"]) > 0 and out["stop"] is True
    cold = engine.generate(want, max_tokens=4)
    assert out["tokens"] == cold.tokens[: len(out["tokens"])]
    r = http.post("/infill", json={**BODY, "stream": True})
    assert r.status_code == 200
    chunks = sse_data(r.text.splitlines())
    assert chunks[-1]["stop"] is True and "".join(c["content"] for c in chunks) == out["content"]


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123},
                                   {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}, "text", None])
def test_invalid_input_extra_is_400(http, extra):
    """llama.cpp's own test_invalid_input_extra_req cases (and non-object chunks)."""
    r = http.post("/infill", json={**BODY, "input_extra": [extra]})
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("change, message", [
    ({"input_prefix": None}, '"input_prefix" is required'),
    ({"input_suffix": None}, '"input_suffix" is required'),
    ({"prompt": 5}, '"prompt" must be a string'),
    ({"input_extra": {"text": "x"}}, '"input_extra" must be an array'),
    ({"input_extra": None}, '"input_extra" must be an array'),
    ({"input_prefix": [1.5]}, '"input_prefix" must be a string, or an array'),
    ({"input_suffix": [10**9]}, '"input_suffix" must be a string, or an array'),
])
def test_bad_fields_are_400(http, change, message):
    body = {**BODY, **change}
    body = {k: v for k, v in body.items() if not (v is None and k.startswith("input_")
                                                   and k != "input_extra")}
    r = http.post("/infill", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_model_without_fim_tokens_is_501(models):
    path = models.dense(dtype="f32")
    with Engine(path, n_ctx=64, n_parallel=1, n_threads=2) as e:
        assert e.tokenizer.fim.pre is None
        c = TestClient(create_app(e, ServerConfig(model_id="x"), manage_scheduler=False),
                       raise_server_exceptions=False)
        r = c.post("/infill", json=BODY)
    assert r.status_code == 501
    assert r.json()["error"] == {
        "message": "Infill is not supported by this model: prefix token is missing. suffix "
                   "token is missing. middle token is missing. ",
        "type": "not_supported_error", "param": None, "code": 501}


def test_spm_infill_puts_the_suffix_first(http, engine):  # http: the scheduler runs
    app = create_app(engine, ServerConfig(model_id="fim", spm_infill=True),
                     manage_scheduler=False)
    tok = engine.tokenizer
    prompt = tok.tokenize(BODY["prompt"], add_special=False, parse_special=True)
    want = reference(tok, PREFIX, SUFFIX, EXTRA, prompt, N_BATCH, -1, N_CTX, spm=True)
    with TestClient(app, raise_server_exceptions=False) as c:
        out = c.post("/infill", json={**BODY, "n_predict": 1}).json()
    assert out["prompt"] == tok.detokenize(want)


# --------------------------------------------------------------------------- llama-server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``base``/health until it answers 200; fail if ``proc`` exits or time runs out."""
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, f"{what}: exited early"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() - t0 < timeout, f"{what}: not up in {timeout} s"
        time.sleep(0.2)


@pytest.mark.skipif(not LLAMA_SERVER.exists(),
                    reason=f"no llama-server b11549 build at {LLAMA_SERVER} "
                           "(scripts/build_llamacpp_tools.sh builds it)")
@pytest.mark.parametrize("spm", [False, True])
def test_same_prompt_as_llama_server(http, engine, fim_path, spm):
    """llama-server b11549 on the same GGUF, same per-slot context, batch and -n: the
    prompt it evaluates for /infill (echoed detokenized, and its token count) is ours."""
    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(fim_path), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(N_CTX), "-np", "1", "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", "1",
           "--no-warmup", "--no-webui", *(["--spm-infill"] if spm else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, 120, "llama-server")
        body = {**BODY, "n_predict": 1, "cache_prompt": False}
        req = urllib.request.Request(base + "/infill", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            theirs = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    app = create_app(engine, ServerConfig(model_id="fim", spm_infill=spm),
                     manage_scheduler=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        ours = c.post("/infill", json={**BODY, "n_predict": 1}).json()
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
    assert ours["prompt"] == theirs["prompt"]
