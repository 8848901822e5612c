"""Weight upload: the placement plan turned into ggml tensors whose bytes equal the file's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggspec.errors import DeviceError, PyggspecError
from pyggspec.modelfile import Model, open_model
from pyggspec.weights import MTP_PREFIX, Weights, load_weights, plan_placement, sum_bytes


@pytest.fixture(scope="session")
def files(models) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for arch in ("dense", "moe"):
        for dtype in ("f32", "f16", "q8_0"):
            out[f"{arch}-{dtype}"] = models.get(arch, dtype=dtype)
    out["split-trunk"], out["split-mtp"] = models.split("dense", dtype="q8_0")
    return out


@pytest.fixture(scope="module")
def rpc(rpc_device):
    """A loopback RPC server's device (the second device of DESIGN §5), shared per session."""
    return rpc_device


def _file_bytes(model: Model, key: str) -> np.ndarray:
    """The file bytes behind a Weights key (``mtp:`` = MTP file, tied output = token_embd)."""
    f = model.trunk
    if key.startswith(MTP_PREFIX):
        f, key = model.mtp_file, key[len(MTP_PREFIX):]
    elif key not in f.tensors and model.mtp_file is not None:
        f = model.mtp_file  # its blk.N.* keep their names
    if key == "output.weight" and f.tied_output:
        key = "token_embd.weight"
    return f.tensor_data(key)


def _assert_all_equal(w: Weights, model: Model) -> None:
    for key in w:
        got = w.get(key).get().view(np.uint8).reshape(-1)
        assert np.array_equal(got, _file_bytes(model, key)), key


@pytest.mark.parametrize("use_mmap", [True, False], ids=["mmap", "copy"])
@pytest.mark.parametrize("name", ["dense-f32", "dense-f16", "dense-q8_0", "moe-f32", "moe-f16",
                                  "moe-q8_0"])
def test_cpu_upload_bytes_equal_file(files, name, use_mmap):
    with open_model(files[name]) as model:
        plan = plan_placement(model.trunk, ["CPU"])
        with load_weights(model, plan, use_mmap=use_mmap, progress=False) as w:
            assert set(w) == set(plan.tensor_devices)
            _assert_all_equal(w, model)
            assert w.mapped_bytes == (plan.total_bytes if use_mmap else 0)
            assert all(w.is_mapped(n) == use_mmap for n in w)
            assert w.bytes_by_device() == dict(plan.bytes_by_device)
            for n in w:
                assert w.get(n).name == n
                assert w.device_of(n).name == "CPU"
                info = model.trunk.tensors[n]
                assert w.get(n).ne == info.ne and int(w.get(n).type) == info.type.id


def test_tied_output_alias_on_same_device(files):
    with open_model(files["moe-q8_0"]) as model:
        assert model.trunk.tied_output
        plan = plan_placement(model.trunk, ["CPU"])
        w = load_weights(model, plan, progress=False)
        assert "output.weight" not in w.names() and w.has("output.weight")
        assert w.get("output.weight") is not None
        assert w.get("output.weight").ptr == w.get("token_embd.weight").ptr
        w.close()


def test_untied_output_is_its_own_tensor(files):
    with open_model(files["dense-f32"]) as model:
        assert not model.trunk.tied_output
        with load_weights(model, plan_placement(model.trunk, ["CPU"]), progress=False) as w:
            assert w.get("output.weight").ptr != w.get("token_embd.weight").ptr


def test_close_twice_and_lookups_after_close(files):
    with open_model(files["dense-q8_0"]) as model:
        w = load_weights(model, plan_placement(model.trunk, ["CPU"]), progress=False)
        assert all(b.closed is False for b in w.buffers)
        w.close()
        w.close()
        assert w.closed and all(b.closed for b in w.buffers)
        with pytest.raises(PyggspecError, match="weights are closed"):
            w.get("token_embd.weight")


def test_mapping_outlives_the_model_file(files):
    model = open_model(files["dense-f16"])
    want = bytes(model.trunk.tensor_data("blk.0.ffn_up.weight"))
    w = load_weights(model, plan_placement(model.trunk, ["CPU"]), progress=False)
    assert w.is_mapped("blk.0.ffn_up.weight")
    model.close()  # the weights keep the mapping alive
    assert w.get("blk.0.ffn_up.weight").get().tobytes() == want
    w.close()


def test_misaligned_mapping_falls_back_to_copy(files, monkeypatch):
    from pyggspec.weights import load as weights

    monkeypatch.setattr(weights, "TENSOR_ALIGNMENT", 1 << 30)  # nothing qualifies
    with open_model(files["dense-q8_0"]) as model, \
            load_weights(model, plan_placement(model.trunk, ["CPU"]), progress=False) as w:
        assert w.mapped_bytes == 0
        _assert_all_equal(w, model)


def test_unknown_name_is_a_clear_key_error(files):
    with open_model(files["dense-f32"]) as model, \
            load_weights(model, plan_placement(model.trunk, ["CPU"]), progress=False) as w:
        with pytest.raises(KeyError, match="no weight 'blk.99.attn_q.weight'"):
            w.get("blk.99.attn_q.weight")
        with pytest.raises(KeyError, match="no separate MTP file"):
            w.get("mtp:token_embd.weight")
        assert w.get_mtp("output_norm.weight") is not None  # falls back to the trunk's
        assert not w.has("nope") and "nope" not in w


def test_progress_bar(files, capsys):
    with open_model(files["dense-f32"]) as model:
        plan = plan_placement(model.trunk, ["CPU"])
        load_weights(model, plan, use_mmap=False, progress=True).close()
        err = capsys.readouterr().err
        assert "loading weights" in err and "MB/s" in err and "100%" in err
        load_weights(model, plan, use_mmap=False, progress=False).close()
        load_weights(model, plan, use_mmap=False).close()  # small, not a TTY: quiet
        assert capsys.readouterr().err == ""


def test_separate_mtp_file(files):
    with open_model(files["split-trunk"], files["split-mtp"]) as model:
        plan = plan_placement(model.trunk, ["CPU"])
        with load_weights(model, plan, progress=False) as w:
            n = model.hparams.n_layer
            mtp = model.mtp_file
            assert {f"{MTP_PREFIX}token_embd.weight", f"{MTP_PREFIX}output_norm.weight",
                    f"blk.{n}.nextn.eh_proj.weight"} <= set(w)
            assert w.get_mtp("output_norm.weight").name == "mtp:output_norm.weight"
            _assert_all_equal(w, model)
            total = sum_bytes(plan, plan_placement(mtp, ["CPU"]))
            assert w.bytes_by_device() == total
            assert sum(total.values()) == model.trunk.total_bytes + mtp.total_bytes


def test_mtp_placement_without_mtp_file_is_an_error(files):
    with open_model(files["dense-f32"]) as model:
        plan = plan_placement(model.trunk, ["CPU"])
        with pytest.raises(PyggspecError, match="no separate MTP file"):
            load_weights(model, plan, plan, progress=False)


def test_plan_for_another_file_is_an_error(files):
    with open_model(files["dense-f32"]) as dense, open_model(files["moe-f32"]) as moe:
        plan = plan_placement(moe.trunk, ["CPU"])
        with pytest.raises(PyggspecError, match="planned for another file"):
            load_weights(dense, plan, progress=False)


# -- a second device: an RPC server on loopback --------------------------------------------------

@pytest.mark.parametrize("name", ["dense-q8_0", "moe-f16"])
def test_partial_offload_to_rpc(files, rpc, name):
    with open_model(files[name]) as model:
        devs = ["CPU", rpc.name]
        plan = plan_placement(model.trunk, devs, n_gpu_layers=2, device=rpc.name)
        on_rpc = {n for n, d in plan.tensor_devices.items() if d == rpc.name}
        n = model.hparams.n_layer
        assert f"blk.{n}.attn_q.weight" in on_rpc and "output_norm.weight" in on_rpc
        with load_weights(model, plan, progress=False) as w:
            for key in w:
                want = rpc.name if key in on_rpc else "CPU"
                if key == "output.weight" and model.trunk.tied_output:
                    want = plan.output_copy_device
                assert w.device_of(key).name == want, key
            assert not any(w.is_mapped(k) for k in on_rpc)
            assert w.is_mapped("token_embd.weight")
            _assert_all_equal(w, model)
            assert w.bytes_by_device() == dict(plan.bytes_by_device)
            assert w.bytes_by_device()[rpc.name] > 0
            if model.trunk.tied_output:  # TENSOR_DUPLICATED: a second copy on the output device
                assert plan.output_copy_device == rpc.name
                assert "output.weight" in w.names()
                assert w.get("output.weight").ptr != w.get("token_embd.weight").ptr


def test_not_enough_device_memory(files, rpc, monkeypatch):
    real = type(rpc).memory

    def tiny_free(self):
        return (1024, 2**30) if not self.is_cpu else real(self)

    monkeypatch.setattr(type(rpc), "memory", tiny_free)
    with open_model(files["dense-f32"]) as model:
        plan = plan_placement(model.trunk, ["CPU", rpc.name], n_gpu_layers="all",
                              device=rpc.name)
        with pytest.raises(DeviceError, match=rf"pyggspec: {rpc.name}: .*MiB but only 0.0 MiB"):
            load_weights(model, plan, progress=False)
