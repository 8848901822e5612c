"""``pyggspec inspect`` on an MTP-only GGUF (``convert_hf_to_gguf.py --mtp``): it describes the
head and what a trunk must match, and ``--pair TRUNK`` checks one trunk (issue 13, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import write_tiny

from pyggspec.cli import main
from pyggspec.modelfile import PAIR_KEYS, ModelFile


def run(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def split(models) -> dict[str, Path]:
    """Converter-layout trunk + MTP-only pairs from the project's generator (dense and MoE)."""
    out: dict[str, Path] = {}
    for name in ("dense", "moe"):
        out[f"{name}-trunk"], out[f"{name}-mtp"] = models.split(name, dtype="q8_0")
    return out


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_json_describes_the_head(split, arch):
    path = split[f"{arch}-mtp"]
    r = run("inspect", path, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    with ModelFile.open(path) as mf, ModelFile.open(split[f"{arch}-trunk"]) as trunk:
        hp = mf.hparams
        block = hp.n_layer
        mtp = d["mtp"]
        assert (mtp["status"], mtp["block"], mtp["file"]) == ("mtp-only", block, str(path))
        assert d["arch"] == hp.arch == trunk.hparams.arch
        assert (d["n_layer"], d["n_embd"], d["n_vocab"]) == (trunk.hparams.n_layer,
                                                             hp.n_embd, mf.n_vocab)
        # every tensor of the head, with its type, dims and size, and the shared ones
        head = {t["name"]: t for t in mtp["head_tensors"]}
        assert set(head) == {n for n in mf.tensors if n.startswith(f"blk.{block}.")}
        assert f"blk.{block}.nextn.eh_proj.weight" in head
        for name, t in head.items():
            info = mf.tensors[name]
            assert (t["type"], t["ne"], t["bytes"]) == (info.type_name, list(info.shape),
                                                        info.nbytes)
        assert {t["name"] for t in mtp["shared_tensors"]} == set(mf.tensors) - set(head)
        assert "q8_0" in d["tensor_types"] and d["n_tensors"] == len(mf.tensors)
        # vocabulary and what a trunk must match: the real trunk's own values
        assert d["tokenizer"]["n_tokens"] == mf.n_vocab
        assert d["tokenizer"]["tokens_sha256"] == trunk.tokenizer.tokens_sha256
        req = mtp["pairs_with"]
        assert tuple(req) == PAIR_KEYS
        assert req["n_layer"] == block and req["n_embd"] == trunk.hparams.n_embd
        assert req["n_vocab"] == trunk.n_vocab and req["arch"] == trunk.hparams.arch
        assert mtp["pair"] is None
        assert d["memory"]["mtp_kv_per_seq"] > 0


def test_human_output(split):
    path = split["dense-mtp"]
    r = run("inspect", path)
    assert r.exit_code == 0, r.output
    with ModelFile.open(path) as mf:
        block = mf.hparams.n_layer
        for s in ("mtp-only", f"as block {block}", "no trunk layers", "pairs with",
                  f"blk.{block}.nextn.eh_proj.weight", "q8_0", "tokens sha256",
                  f"n_layer {block}", f"n_vocab {mf.n_vocab}",
                  mf.tokenizer.tokens_sha256[:12]):
            assert s in r.stdout, (s, r.stdout)
    r = run("inspect", path, "--tensors")
    assert r.exit_code == 0 and "token_embd.weight" in r.stdout


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_pair_with_its_trunk(split, arch):
    mtp, trunk = split[f"{arch}-mtp"], split[f"{arch}-trunk"]
    r = run("inspect", mtp, "--pair", trunk, "--json")
    assert r.exit_code == 0, r.output
    pair = json.loads(r.stdout)["mtp"]["pair"]
    assert pair == {"trunk": str(trunk), "trunk_mtp": "none", "ok": True, "mismatches": []}
    r = run("inspect", mtp, "--pair", trunk)
    assert r.exit_code == 0 and f"{trunk.name}: ok" in r.stdout
    # the same pair the other way round still works
    assert run("inspect", trunk, "--mtp", mtp, "--json").exit_code == 0


def test_pair_mismatch_lists_everything_and_exits_1(split):
    mtp, trunk = split["dense-mtp"], split["moe-trunk"]
    r = run("inspect", mtp, "--pair", trunk, "--json")
    assert r.exit_code == 1
    d = json.loads(r.stdout)  # the full description still comes out
    keys = [m["key"] for m in d["mtp"]["pair"]["mismatches"]]
    assert d["mtp"]["pair"]["ok"] is False and keys[0] == "arch" and "n_expert" in keys
    err = r.stderr.strip()
    assert "\n" not in err and "Traceback" not in r.output
    assert err.startswith(f"pyggspec: {mtp}: does not pair with {trunk.name}: arch qwen35 "
                          "here vs qwen35moe in the trunk (and "), err
    r = run("inspect", mtp, "--pair", trunk)
    assert r.exit_code == 1 and "does NOT pair" in r.stdout


def test_same_vocab_size_other_tokens(tmp_path):
    """Equal n_vocab is not enough: the token list itself must be the trunk's."""
    mtp = write_tiny(tmp_path / "mtp.gguf", mtp="only")
    other = write_tiny(tmp_path / "other.gguf", mtp="none", meta={
        "tokenizer.ggml.tokens": [f"u{i}" for i in range(254)] + ["<|im_start|>",
                                                                  "<|endoftext|>"]})
    r = run("inspect", mtp, "--pair", other, "--json")
    assert r.exit_code == 1
    mism = json.loads(r.stdout)["mtp"]["pair"]["mismatches"]
    assert [m["key"] for m in mism] == ["tokens_sha256"]
    r = run("inspect", other, "--mtp", mtp)
    assert r.exit_code == 1 and "tokens_sha256" in r.stderr
    assert run("inspect", mtp, "--pair", write_tiny(tmp_path / "t.gguf", mtp="none")
               ).exit_code == 0


def test_wrong_uses_are_clear(split, tmp_path):
    mtp, trunk = split["dense-mtp"], split["dense-trunk"]
    r = run("inspect", mtp, "--mtp", trunk)
    assert r.exit_code == 2 and "--pair TRUNK" in r.output
    r = run("inspect", trunk, "--pair", mtp)
    assert r.exit_code == 2 and "--pair" in r.output
    r = run("inspect", mtp, "--pair", mtp)
    assert r.exit_code == 1
    assert r.stderr.strip() == f"pyggspec: {mtp}: is an MTP-only file too, not a trunk model"
    missing = tmp_path / "nope.gguf"
    r = run("inspect", mtp, "--pair", missing)
    assert r.exit_code == 1 and r.stderr.strip() == f"pyggspec: {missing}: no such file"
