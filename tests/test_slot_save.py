"""Slot save / restore / erase (issue 21: llama-server's ``--slot-save-path`` and
``POST /slots/{id}?action=save|restore|erase``).

A saved slot restored later -- into the same slot or another, after the slot was erased and
overwritten -- continues exactly as if it had never left: the next generation's tokens and
its drafts (MTP cache and carry-over restored) equal those of a slot that kept its state,
and prompt reuse takes the restored tokens. Files from another model or cache setup, damaged
or missing files are refused (400 over HTTP), never loaded as garbage rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import pytest
from fastapi.testclient import TestClient

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.memory import slotfile
from pyggspec.memory.slotfile import SlotFile, SlotFileError
from pyggspec.serving.http.slot_actions import NO_SAVE_PATH, valid_filename
from pyggspec.serving.request import Request
from pyggspec.serving.server import ServerConfig, create_app

P1 = [300 + i for i in range(14)]
KW = {"n_ctx": 256, "n_parallel": 2, "n_threads": 2, "n_ubatch": 4, "ctx_checkpoints": 8,
      "checkpoint_min_step": 4, "load_tokenizer": False}
SPEC = {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=3, adaptive=False)}


def run(e: Engine, prompt, n, slot=None, **kw):
    return e.submit(Request(prompt, max_tokens=n, ignore_eos=True, slot=slot, **kw)).result()


@pytest.fixture(scope="module", params=["dense", "moe"])
def engines(request, models):
    path = models.get(request.param, dtype="f32", agreement=0.8, tied_embeddings=False)
    out: dict[str, Engine] = {}
    try:
        out["plain"] = Engine(path, **KW)
        out["spec"] = Engine(path, **SPEC, **KW)
        yield out
    finally:
        for e in out.values():
            e.close()


# --------------------------------------------------------------------------- the file format
def test_file_round_trip_and_damage_is_refused(tmp_path):
    sf = SlotFile({"identity": {"x": 1}, "n_tokens": 3})
    sf.add("tokens", np.array([1, 2, 3], np.int32))
    sf.add("rows", np.arange(24, dtype=np.uint8).reshape(2, 12))
    p = tmp_path / "s.bin"
    n = slotfile.write(p, sf)
    assert n == p.stat().st_size and not list(tmp_path.glob(".*tmp"))
    back, n_read = slotfile.read(p)
    assert n_read == n and back.header == sf.header
    assert all(np.array_equal(back.arrays[k], v) for k, v in sf.arrays.items())
    raw = p.read_bytes()
    cases = {"damaged (section 'rows' fails its CRC-32)": raw[:-1] + bytes([raw[-1] ^ 1]),
             "truncated": raw[:-5], "bytes past its last section": raw + b"x",
             "not a pyggspec slot file": b"GGUF" + raw[4:],
             "version 7": raw[:8] + (7).to_bytes(4, "little") + raw[12:]}
    for why, data in cases.items():
        p.write_bytes(data)
        with pytest.raises(SlotFileError, match=re.escape(why)):
            slotfile.read(p)
    with pytest.raises(SlotFileError, match="no slot file 'gone.bin'"):
        slotfile.read(tmp_path / "gone.bin")


@pytest.mark.parametrize("name, ok", [
    ("slot1.bin", True), ("a b.bin", True), ("ünï.bin", True), ("../x", False),
    ("a/b", False), ("a\\b", False), ("..", False), (".", False), ("x..y", False),
    ("x.", False), (" x", False), ("x ", False), ("", False), ("a:b", False),
    ("a*b", False), ("a\x01b", False), ("a\u2215b", False), ("x" * 256, False),
])
def test_file_names_as_llama_cpp_validates_them(name, ok):
    assert valid_filename(name) is ok


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_restored_slot_continues_exactly(engines, kind, tmp_path):
    """save -> erase -> overwrite -> restore (into the other slot, then its own): the next
    turn's tokens, cache use and drafts equal those of the slot that never left, and a
    restored slot saves to the same bytes."""
    e = engines[kind]
    r1 = run(e, P1, 10, slot=0)
    # the last token is sampled, not yet in the cache (a verify step may also have
    # committed accepted drafts past the length limit: the cache holds what was computed)
    n = e.seq_len(0)
    assert n >= len(P1) + len(r1.tokens) - 1 and (kind == "spec" or n == len(P1) + 9)
    saved = e.save_slot(0, tmp_path / "a.bin")
    assert (saved.slot, saved.n_tokens) == (0, n) and saved.n_bytes == \
        (tmp_path / "a.bin").stat().st_size
    nxt = P1 + r1.tokens + [777, 778, 779]
    ref = run(e, nxt, 12, slot=0)  # the slot that kept its state
    assert ref.timings.cache_n >= len(P1) and (kind == "spec" or ref.timings.cache_n == n)
    held = e.seq_len(0)
    assert e.erase_slot(0).n_tokens == held and e.seq_len(0) == 0
    e.erase_slot(1)
    run(e, [500 + i for i in range(20)], 6, slot=0)  # other rows in slot 0
    for slot in (1, 0):
        got = e.restore_slot(slot, tmp_path / "a.bin")
        assert (got.slot, got.n_tokens, got.n_bytes) == (slot, n, saved.n_bytes)
        assert e.seq_len(slot) == n and e.scheduler.slots()[slot]["n_cached"] == n
        e.save_slot(slot, tmp_path / "b.bin")
        assert (tmp_path / "b.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()
        out = run(e, nxt, 12)  # not pinned: prompt reuse picks the restored slot
        assert out.slot == slot and out.tokens == ref.tokens
        assert (out.timings.cache_n, out.timings.prompt_n) == \
            (ref.timings.cache_n, ref.timings.prompt_n)
        if kind == "spec":  # the MTP cache and carry-over came back: the same drafts
            assert (out.spec.n_drafted, out.spec.n_accepted) == \
                (ref.spec.n_drafted, ref.spec.n_accepted)
            assert out.spec.n_drafted > 0
        e.erase_slot(slot)


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_restored_checkpoints_serve_a_shorter_prefix(engines, kind, tmp_path):
    """The slot's prompt checkpoints travel with it: a prompt that leaves the saved tokens
    inside the first prompt resumes from the checkpoint there, with a cold start's tokens."""
    e = engines[kind]
    run(e, P1, 6, slot=0)
    e.save_slot(0, tmp_path / "c.bin")
    e.erase_slot(0)
    e.restore_slot(1, tmp_path / "c.bin")
    prompt = P1[:10] + [903, 904]
    warm = run(e, prompt, 8, slot=1)
    cold = run(e, prompt, 8, slot=0, cache_prompt=False)
    assert warm.tokens == cold.tokens and warm.timings.cache_n == 10  # P1's, 4 before its end


def test_erase_waits_for_the_slots_request(engines):
    """An action on a busy slot runs when its request has ended (llama-server defers it):
    the request finishes whole, then the slot is emptied."""
    e = engines["plain"]
    h = e.submit(Request(P1, max_tokens=9, ignore_eos=True, slot=1))
    e.step()  # admitted: slot 1 is busy now
    res = e.erase_slot(1)  # drives the loop (no server thread) until slot 1 is idle
    r = h.result()
    assert len(r.tokens) == 9 and res.n_tokens == len(P1) + 8 and e.seq_len(1) == 0


def test_spec_file_restores_into_a_plain_engine(engines, tmp_path):
    """The MTP part is skipped by an engine without a head; the trunk state is used."""
    e, plain = engines["spec"], engines["plain"]
    r1 = run(e, P1, 8, slot=0)
    e.save_slot(0, tmp_path / "s.bin")
    got = plain.restore_slot(1, tmp_path / "s.bin")
    nxt = P1 + r1.tokens + [5, 6]
    out = run(plain, nxt, 6, slot=1)
    assert got.n_tokens == e.seq_len(0) and out.timings.cache_n >= len(P1)
    assert out.tokens == run(plain, nxt, 6, slot=0, cache_prompt=False).tokens


def test_another_model_or_cache_setup_is_refused(models, engines, tmp_path):
    """Another model (other weights with the same shapes, or another arch), other KV cache
    types, more tokens than the context: a clear error, and the slot keeps what it held."""
    e = engines["spec"]
    run(e, P1, 6, slot=0)
    e.save_slot(0, tmp_path / "s.bin")
    arch = "moe" if e.hp.arch == "qwen35" else "dense"
    others = {
        "fingerprint": Engine(models.get("dense" if arch == "moe" else "moe", dtype="f32",
                                         agreement=0.8, tied_embeddings=False, seed=7), **KW),
        "arch": Engine(models.get(arch, dtype="f32", agreement=0.8, tied_embeddings=False),
                       **KW),
        "type_k": Engine(e.model_path, **{**KW, "type_k": "q8_0"}),
        "more than this server's context": Engine(e.model_path, **{**KW, "n_ctx": 16}),
    }
    try:
        for why, other in others.items():
            run(other, [1, 2, 3], 2, slot=1)
            with pytest.raises(SlotFileError, match=why):
                other.restore_slot(1, tmp_path / "s.bin")
            assert other.seq_len(1) == 4  # untouched
    finally:
        for o in others.values():
            o.close()
    with pytest.raises(SlotFileError, match="no slot file"):
        e.restore_slot(0, tmp_path / "missing.bin")


# --------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    path = models.dense(dtype="f32", agreement=0.8, tied_embeddings=False)
    save_dir = tmp_path_factory.mktemp("slots")
    with Engine(path, **SPEC, **{**KW, "load_tokenizer": True}) as e:
        app = create_app(e, ServerConfig(model_id="slots", model_path=str(path),
                                         slot_save_path=str(save_dir)))
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c, e, save_dir


def completion(c, prompt, n=8, **kw):
    r = c.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                    "return_tokens": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_http_save_erase_restore(server):
    c, e, save_dir = server
    first = completion(c, P1)
    slot = first["id_slot"]
    n = e.seq_len(slot)
    r = c.post(f"/slots/{slot}?action=save", json={"filename": "turn1.bin"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["id_slot", "filename", "n_saved", "n_written", "timings"]
    assert body["id_slot"] == slot and body["filename"] == "turn1.bin"
    assert body["n_saved"] == n and body["n_written"] == (save_dir / "turn1.bin").stat().st_size
    assert body["timings"]["save_ms"] >= 0
    nxt = P1 + first["tokens"] + [777, 778]
    ref = completion(c, nxt)
    assert ref["id_slot"] == slot and ref["timings"]["cache_n"] >= len(P1)
    for s in (0, 1):
        r = c.post(f"/slots/{s}?action=erase")
        assert r.status_code == 200 and list(r.json()) == ["id_slot", "n_erased"]
    assert c.get("/slots").json()[slot]["n_cached"] == 0
    other = 1 - slot
    r = c.post(f"/slots/{other}?action=restore", json={"filename": "turn1.bin"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["id_slot", "filename", "n_restored", "n_read", "timings"]
    assert (body["id_slot"], body["n_restored"], body["n_read"]) == \
        (other, n, (save_dir / "turn1.bin").stat().st_size)
    assert "restore_ms" in body["timings"]
    out = completion(c, nxt)  # prompt reuse takes the restored tokens
    assert out["id_slot"] == other and out["tokens"] == ref["tokens"]
    assert out["timings"]["cache_n"] == ref["timings"]["cache_n"]
    assert out["timings"]["draft_n"] == ref["timings"]["draft_n"] > 0


@pytest.mark.parametrize("url, body, status, message", [
    ("/slots/abc?action=erase", None, 400, "Invalid slot ID"),
    ("/slots/5?action=erase", None, 400, "Invalid slot ID"),
    ("/slots/-1?action=save", {"filename": "x.bin"}, 400, "Invalid slot ID"),
    ("/slots/0?action=fly", None, 400, "Invalid action"),
    ("/slots/0", None, 400, "Invalid action"),
    ("/slots/0?action=save", {"filename": "../escape.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {"filename": "/tmp/abs.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": "..\\x"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {"filename": 5}, 400, "'filename'"),
    ("/slots/0?action=save", {}, 400, "'filename'"),
    ("/slots/0?action=restore", {"filename": "nope.bin"}, 400,
     "Unable to restore slot: no slot file 'nope.bin'"),
])
def test_http_errors(server, url, body, status, message):
    c, _, save_dir = server
    r = c.post(url, json=body) if body is not None else c.post(url)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error"
    assert message in err["message"]
    assert not (save_dir.parent / "escape.bin").exists()


def test_http_refuses_another_models_file(server, models, tmp_path):
    c, _, save_dir = server
    with Engine(models.moe(dtype="f32", agreement=0.8, tied_embeddings=False), **KW) as o:
        run(o, P1, 4, slot=0)
        o.save_slot(0, save_dir / "moe.bin")
    before = c.get("/slots").json()[0]["n_cached"]
    r = c.post("/slots/0?action=restore", json={"filename": "moe.bin"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("Unable to restore slot: the slot was saved for another model")
    assert "arch is 'qwen35moe' there, 'qwen35' here" in msg
    assert c.get("/slots").json()[0]["n_cached"] == before


def test_http_without_slot_save_path_is_501(server):
    _, e, _ = server
    app = create_app(e, ServerConfig(model_id="x"), manage_scheduler=False)
    c = TestClient(app, raise_server_exceptions=False)  # no lifespan: nothing runs
    r = c.post("/slots/0?action=save", json={"filename": "x.bin"})
    assert r.status_code == 501 and r.json()["error"]["message"] == NO_SAVE_PATH
    assert r.json()["error"]["type"] == "not_supported_error"


def test_cli_slot_save_path_reaches_the_server(tmp_path, monkeypatch):
    """``serve --slot-save-path DIR`` puts DIR in the server's config."""
    from click.testing import CliRunner

    from pyggspec.cli import main
    from pyggspec.cli import serve as serve_mod

    seen = {}

    def fake_app(engine, config, max_queue=None):
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr(serve_mod, "engine_from_config", lambda *a: MagicMock())
    monkeypatch.setattr("pyggspec.serving.server.create_app", fake_app)
    r = CliRunner().invoke(main, ["serve", "-m", str(Path(__file__)), "--slot-save-path",
                                  str(tmp_path), "--spm-infill"])
    assert r.exit_code == 0, r.output
    assert seen["config"].slot_save_path == str(tmp_path) and seen["config"].spm_infill
