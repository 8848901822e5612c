"""Tokenizer: llama.cpp's vocabulary (vocab-only load) on the tiny fixtures' real BPE vocab."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyggspec.errors import ModelFileError
from pyggspec.modelfile import ModelFile
from pyggspec.tokenizer import Detokenizer, Tokenizer

pytest.importorskip("llama_cpp", reason="the tokenizer is llama.cpp's vocabulary, through "
                    "llama-cpp-python (pip install -e .)")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv: list[str]) -> int:\n    return 0\n",
    "héllo wörld — naïve café",
    "日本語のテキスト 🦊🐶 emoji",
    "<|im_start|>user\nHi 日本<|im_end|>\n<|im_start|>assistant\n",
    "",
    "   leading and trailing spaces   ",
]


def _python(code: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh Python process (output captured as text, 120 s at most)."""
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def paths(models) -> dict[str, Path]:
    _, mtp = models.split("dense", dtype="q8_0")
    return {"full": models.dense(dtype="q8_0"), "mtp": mtp}


@pytest.fixture(scope="module")
def tok(paths):
    t = Tokenizer(paths["full"])
    yield t
    t.close()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.tokenize(text, add_special=False)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.detokenize(ids) == text


def test_special_tokens_parsed(tok):
    (im_start,) = tok.tokenize("<|im_start|>")
    assert tok.token_to_piece(im_start) == b"<|im_start|>"
    assert len(tok.tokenize("<|im_start|>", parse_special=False)) > 1
    (im_end,) = tok.tokenize("<|im_end|>")
    assert tok.is_eog(im_end) and tok.is_eog(tok.eos)
    assert not tok.is_eog(tok.tokenize("a")[0])
    assert tok.token_to_piece(im_end, special=False) == b""


def test_facts_match_the_file(tok, paths):
    with ModelFile.open(paths["full"]) as f:
        info = f.tokenizer
        assert tok.n_vocab == info.n_tokens
        assert tok.bos == info.bos_id and tok.eos == info.eos_id
        assert tok.add_bos == bool(info.add_bos)
        assert tok.chat_template == f.gguf.get("tokenizer.chat_template")


@pytest.fixture(scope="module")
def llama_ids(paths) -> dict[str, list[list[int]]]:
    """``llama_cpp.Llama(vocab_only=True).tokenize`` of TEXTS (special on / off), computed in a
    fresh process: ``Llama`` probes every registered device, and a dead RPC server left
    registered by another test would abort this one."""
    code = (
        "import json, sys, llama_cpp\n"
        "texts = json.loads(sys.stdin.read())\n"
        f"m = llama_cpp.Llama(model_path={str(paths['full'])!r}, vocab_only=True, verbose=False)\n"
        "print(json.dumps({t: [m.tokenize(t.encode(), add_bos=True, special=s)\n"
        "                      for s in (True, False)] for t in texts}))\n"
    )
    r = _python(code, stdin=json.dumps(TEXTS))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("text", TEXTS)
def test_ids_agree_with_llama_cpp(tok, llama_ids, text):
    with_special, without = llama_ids[text]
    assert tok.tokenize(text, add_special=True, parse_special=True) == with_special
    assert tok.tokenize(text, add_special=True, parse_special=False) == without


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full(tok, text):
    ids = tok.tokenize(text, add_special=False)
    final = tok.detokenize(ids)
    for k in range(len(ids) + 1):
        d = Detokenizer(tok)
        streamed = d.extend(ids[:k])
        assert final.startswith(streamed)  # never emits a character it must take back
        assert "\ufffd" not in streamed
        assert streamed + d.flush() == tok.detokenize(ids[:k])
        assert d.text == tok.detokenize(ids[:k])


def test_detokenizer_holds_back_split_characters(tok):
    ids = tok.tokenize("🦊", add_special=False)
    assert len(ids) > 1  # the byte-level BPE splits the 4-byte character
    d = tok.detokenizer()
    outs = [d.add(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🦊"
    assert not d.pending and d.flush() == ""


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Hi 日本"}, {"role": "assistant", "content": "Hello!"}]
    want = ("<|im_start|>user\nHi 日本<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want
    gen = tok.apply_chat_template(msgs)
    assert gen == want + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, jinja=True) == gen  # jinja2 fallback renders the same
    ids = tok.tokenize(gen)
    assert ids.count(tok.tokenize("<|im_start|>")[0]) == 3


def test_mtp_only_file_has_the_vocab(tok, paths):
    with Tokenizer(paths["mtp"]) as m:
        assert m.n_vocab == tok.n_vocab and m.eos == tok.eos
        for text in TEXTS:
            assert m.tokenize(text) == tok.tokenize(text)


def test_load_is_quiet(paths, capfd):
    capfd.readouterr()
    Tokenizer(paths["full"]).close()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_errors(tmp_path, tok):
    with pytest.raises(ModelFileError, match="nope.gguf: no such file"):
        Tokenizer(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelFileError, match=r"bad.gguf: cannot load the vocabulary: .*version"):
        Tokenizer(bad)
    with pytest.raises(ValueError, match="out of range"):
        tok.token_to_piece(tok.n_vocab)
    with pytest.raises(ValueError, match="out of range"):
        tok.detokenize([0, -1])


def test_close_is_idempotent(paths):
    t = Tokenizer(paths["full"])
    t.close()
    t.close()
    assert t.closed
    with pytest.raises(ModelFileError, match="closed"):
        t.tokenize("x")


def test_ggml_log_callback_survives(paths):
    """pyggspec's C log callback (installed by the binding) is still ggml's after the
    tokenizer imported llama_cpp and loaded a vocabulary."""
    code = (
        "from pyggspec.ggml import _lib; _lib.lib\n"
        "from pyggspec import tokenizer as t\n"
        "base = t._ggml_base(); before = t._get_log(base)[0].value\n"
        f"t.Tokenizer({str(paths['full'])!r}).close()\n"
        "assert t._get_log(base)[0].value == before, 'ggml log callback replaced'\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


def test_load_ignores_a_dead_rpc_device(paths):
    """A vocab-only load must not probe devices (llama.cpp aborts on a dead RPC server).

    In a child process: ggml keeps the dead server's device registered for the life of the
    process, and any later test there that lists devices would abort."""
    from pyggspec.ggml import device

    if not device.has_rpc():
        pytest.skip("llama-cpp-python built without RPC")
    code = (
        "from pyggspec.ggml import device\n"
        "from pyggspec.tokenizer import Tokenizer\n"
        "with device.RpcServer() as server:\n"
        "    device.add_rpc_server(server.endpoint)\n"
        "# the server is gone, its device still registered\n"
        f"with Tokenizer({str(paths['full'])!r}) as t:\n"
        "    assert t.tokenize('hi', add_special=False)\n"
    )
    r = _python(code)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
