"""The CLI: inspect output (human and JSON), one-line errors with exit 1, models, devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest
from click.testing import CliRunner
from conftest import DELETE, write_tiny

from pyggspec.cli import load_models, main


@dataclass
class _Dev:
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int
    backend: str


# the memory planner imports the real device module; load it before any test replaces that
# module with a fake (otherwise this file fails when run on its own)
import pyggspec.compute
import pyggspec.memory  # noqa: F401


def fake_devices(monkeypatch, *devs: _Dev) -> None:
    """Serve ``devs`` as the binding's device list (tests must not depend on the machine)."""
    fake = types.ModuleType("pyggspec.ggml.device")
    fake.list_devices = lambda: [_Dev("CPU", "host cpu", "cpu", 1 << 30, 2 << 30, "CPU"), *devs]
    fake.backends_available = lambda: sorted({"CPU", *(d.backend for d in devs)})
    monkeypatch.setitem(sys.modules, "pyggspec.ggml.device", fake)


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    fake_devices(monkeypatch)


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, path, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in result.output, result.output
    assert err.startswith(f"pyggspec: {path}: "), err
    for f in fragments:
        assert f in err, err
    assert result.stdout == ""


def test_inspect_human(tiny):
    r = run("inspect", tiny("dense"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    for s in ("qwen35 (dense)", "4 trunk + 1 MTP", "RARA", "grafted, in the model file",
              "eh_proj, enorm, hnorm, shared_head_norm", "embedding shared with token_embd",
              "gpt2 (pre qwen35), 256 tokens", "eos 255 '<|endoftext|>'", "memory"):
        assert s in out, (s, out)


def test_inspect_json_dense(tiny):
    r = run("inspect", tiny("dense"), "--json", "--ctx", "1000", "--parallel", "3")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["arch"] == "qwen35" and d["n_embd"] == 64 and d["n_vocab"] == 256
    assert d["n_layer"] == 4 and d["n_layer_nextn"] == 1
    assert d["layer_kinds"] == ["recurrent", "attention", "recurrent", "attention"]
    assert d["mtp"]["status"] == "grafted" and d["mtp"]["block"] == 4
    assert "blk.4.nextn.eh_proj.weight" in d["mtp"]["tensors"]
    assert d["tensor_types"] == {"f32": d["total_bytes"]}
    assert d["tokenizer"]["n_tokens"] == 256 and d["tokenizer"]["chat_template"] is True
    mem = d["memory"]
    assert mem["n_ctx"] == 1000 and mem["n_parallel"] == 3
    assert mem["kv_per_seq"] == 2 * 1000 * 2 * 64 * 2
    assert mem["state_total"] == 3 * mem["per_seq"]
    assert mem["weights_by_device"] == {"CPU": d["total_bytes"]}


def test_inspect_json_moe_split_and_offload(monkeypatch, tiny):
    fake_devices(monkeypatch, _Dev("RPC0", "127.0.0.1:50052", "gpu", 1, 1, "RPC"))
    r = run("inspect", tiny("moe-trunk", arch="qwen35moe", mtp="none", dtype="q8_0"),
            "--mtp", tiny("moe-mtp", arch="qwen35moe", mtp="only", dtype="q8_0"),
            "-ngl", "2", "--device", "RPC0", "--cpu-moe", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["arch"] == "qwen35moe" and d["moe"]["n_expert"] == 8
    assert d["mtp"]["status"] == "mtp-only" and d["mtp"]["source"] == "separate"
    assert set(d["tensor_types"]) == {"q8_0", "f32"}
    assert "RPC0" in d["memory"]["weights_by_device"]
    assert d["memory"]["mtp_kv_per_seq"] > 0


def test_inspect_tensor_list(tiny):
    r = run("inspect", tiny("dense"), "--tensors")
    assert r.exit_code == 0
    assert "blk.4.nextn.eh_proj.weight" in r.stdout


def test_inspect_subprocess_no_traceback(tmp_path):
    missing = tmp_path / "nope.gguf"
    env = dict(os.environ, PYGGSPEC_DEBUG="")
    p = subprocess.run([sys.executable, "-m", "pyggspec", "inspect", str(missing)],
                       capture_output=True, text=True, env=env, check=False)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == f"pyggspec: {missing}: no such file\n"


# --------------------------------------------------------------------------- malformed files
def _truncated(tmp_path, tiny):
    data = tiny("dense").read_bytes()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[: len(data) // 2])
    return p, ["truncated", "tensor"]


def _truncated_header(tmp_path, tiny):
    p = tmp_path / "header.gguf"
    p.write_bytes(tiny("dense").read_bytes()[:100])
    return p, ["truncated or corrupt GGUF header"]


def _bad_magic(tmp_path, tiny):
    data = bytearray(tiny("dense").read_bytes())
    data[:4] = b"GGML"
    p = tmp_path / "magic.gguf"
    p.write_bytes(bytes(data))
    return p, ["not a GGUF file", "b'GGML'"]


def _bad_version(tmp_path, tiny):
    data = bytearray(tiny("dense").read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    p = tmp_path / "version.gguf"
    p.write_bytes(bytes(data))
    return p, ["unsupported GGUF version 7"]


def _empty(tmp_path, tiny):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    return p, ["file is empty"]


def _unknown_arch(tmp_path, tiny):
    return write_tiny(tmp_path / "arch.gguf", meta={"general.architecture": "llama"}), \
        ["unsupported architecture 'llama'"]


def _missing_key(tmp_path, tiny):
    return write_tiny(tmp_path / "key.gguf", meta={".ssm.state_size": DELETE}), \
        ["missing required metadata key 'qwen35.ssm.state_size'"]


def _missing_tensor(tmp_path, tiny):
    return write_tiny(tmp_path / "missing.gguf", drop=("blk.3.attn_output.weight",)), \
        ["missing tensor 'blk.3.attn_output.weight'", "[128, 64]"]


def _wrong_shape(tmp_path, tiny):
    return write_tiny(tmp_path / "shape.gguf", reshape={"blk.0.ssm_out.weight": (32, 64)}), \
        ["tensor 'blk.0.ssm_out.weight' has wrong shape", "expected [64, 64], got [32, 64]"]


def _wrong_type(tmp_path, tiny):
    return write_tiny(tmp_path / "type.gguf", retype={"output_norm.weight": "f16"}), \
        ["tensor 'output_norm.weight' must be f32", "got f16"]


def _directory(tmp_path, tiny):
    d = tmp_path / "adir"
    d.mkdir()
    return d, ["is a directory"]


def _nonexistent(tmp_path, tiny):
    return tmp_path / "missing-file.gguf", ["no such file"]


@pytest.mark.parametrize("make", [
    _truncated, _truncated_header, _bad_magic, _bad_version, _empty, _unknown_arch,
    _missing_key, _missing_tensor, _wrong_shape, _wrong_type, _directory, _nonexistent,
], ids=lambda f: f.__name__.strip("_"))
def test_inspect_malformed(tmp_path, tiny, make):
    path, fragments = make(tmp_path, tiny)
    assert_one_line_error(run("inspect", path), path, *fragments)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_inspect_permission_denied(tmp_path, tiny):
    p = tmp_path / "locked.gguf"
    p.write_bytes(tiny("dense").read_bytes())
    p.chmod(0)
    assert_one_line_error(run("inspect", p), p, "permission denied")


def test_mtp_errors_name_the_mtp_file(tiny):
    trunk = tiny("trunk", mtp="none")
    assert_one_line_error(run("inspect", trunk, "--mtp", trunk), trunk,
                          "not an MTP file (nextn_predict_layers = 0)")
    other = tiny("mtp-wide", mtp="only", n_embd=128)
    assert_one_line_error(run("inspect", trunk, "--mtp", other), other,
                          "does not belong to trunk.gguf", "n_embd 128 here vs 64")
    other = tiny("mtp-vocab", mtp="only", n_vocab=300)
    assert_one_line_error(run("inspect", trunk, "--mtp", other), other, "n_vocab 300 here vs 256")


def test_usage_errors_exit_2(tiny):
    assert run("inspect", tiny("dense"), "-ngl", "lots").exit_code == 2
    assert run("inspect", tiny("dense"), "-ot", "nodevice").exit_code == 2
    # -c 0 is llama.cpp's "the training context" (tests/test_cli_llama_flags.py); below is not
    assert run("inspect", tiny("dense"), "--ctx", "-1").exit_code == 2
    assert run("inspect").exit_code == 2


def test_unknown_override_device_is_one_line(tiny):
    r = run("inspect", tiny("dense"), "-ot", r"blk\.4\.=CUDA9")
    assert r.exit_code == 1 and "unknown device 'CUDA9'" in r.stderr
    assert r.stderr.startswith("pyggspec: --override-tensor: ")


# --------------------------------------------------------------------------- models, devices
def test_models_toml():
    entries = load_models()
    ids = {e["id"] for e in entries}
    assert {"qwen3.5-0.8b", "qwen3.6-27b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"} <= ids
    for e in entries:
        assert e["arch"] in ("qwen35", "qwen35moe")
        assert e["mtp"] in ("grafted", "sidecar", "convert")
        assert e["hf_repo"].startswith("Qwen/")
    r = run("models", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == entries
    r = run("models")
    assert r.exit_code == 0 and "qwen3.6-27b" in r.stdout and "HF_REPO" in r.stdout


def test_devices_against_interface(monkeypatch):
    fake_devices(monkeypatch, _Dev("RPC0", "127.0.0.1:50052", "gpu", 1 << 30, 2 << 30, "RPC"))
    r = run("devices", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["name"] for x in d] == ["CPU", "RPC0"] and d[1]["backend"] == "RPC"
    r = run("devices")
    assert r.exit_code == 0 and "RPC0" in r.stdout and "1.00 GiB / 2.00 GiB" in r.stdout


def test_inspect_uses_binding_devices(monkeypatch, tiny):
    fake_devices(monkeypatch, _Dev("CUDA0", "H100", "gpu", 1, 1, "CUDA"))
    d = json.loads(run("inspect", tiny("dense"), "--json", "-ngl", "1").stdout)
    assert d["placement"][0]["offload_devices"] == ["CUDA0"]
    assert d["placement"][0]["output_device"] == "CUDA0"
    r = run("inspect", tiny("dense"), "--device", "CUDA7")
    assert r.exit_code == 1 and "unknown device 'CUDA7'" in r.stderr


def test_inspect_permission_denied_simulated(monkeypatch, tiny):
    """Root can read anything, so simulate EACCES where the file is opened."""
    import pyggspec.modelfile.gguf as reader

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(reader, "open", denied, raising=False)
    path = tiny("dense")
    assert_one_line_error(run("inspect", path), path, "permission denied")


def test_inspect_without_binding(monkeypatch, tiny):
    """A missing or broken binding degrades the device list to the CPU, with a warning."""
    broken = types.ModuleType("pyggspec.ggml.device")

    def boom():
        raise OSError("libggml.so: cannot open shared object file")

    broken.list_devices = boom
    monkeypatch.setitem(sys.modules, "pyggspec.ggml.device", broken)
    d = json.loads(run("inspect", tiny("dense"), "--json", "-ngl", "all").stdout)
    assert d["memory"]["weights_by_device"] == {"CPU": d["total_bytes"]}
    assert any("binding not usable" in w for w in d["warnings"])
    d = json.loads(run("inspect", tiny("dense"), "--json", "-ngl", "1", "-dev", "RPC0").stdout)
    assert d["placement"][0]["output_device"] == "RPC0"
