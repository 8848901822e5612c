"""Placement plan: llama.cpp's -ngl / -dev / -ot / --cpu-moe rules on the tiny fixtures."""

from __future__ import annotations

import pytest

from pyggspec.errors import DeviceError, PyggspecError
from pyggspec.modelfile import ModelFile
from pyggspec.weights import CPU_MOE_REGEX, layer_devices, plan_placement, sum_bytes

DEVS = ["CPU", "GPU0"]


@pytest.fixture(scope="module")
def dense(tiny):
    with ModelFile.open(tiny("dense")) as m:  # 4 trunk + MTP block 4, untied output
        yield m


@pytest.fixture(scope="module")
def moe(tiny):
    with ModelFile.open(tiny("moe-tied", arch="qwen35moe", tied=True)) as m:
        yield m


def blocks_on(p, dev):
    return [i for i, d in enumerate(p.layer_devices) if d == dev]


def test_ngl_0_everything_on_cpu(dense):
    p = plan_placement(dense, DEVS, n_gpu_layers=0)
    assert set(p.tensor_devices.values()) == {"CPU"}
    assert p.bytes_by_device == {"CPU": dense.total_bytes, "GPU0": 0}
    assert p.i_gpu_start == 6 and p.output_device == "CPU"


def test_ngl_1_is_the_output_layer(dense):
    p = plan_placement(dense, DEVS, n_gpu_layers=1)
    assert p.output_device == "GPU0" and blocks_on(p, "GPU0") == []
    assert p.device_of("output.weight") == p.device_of("output_norm.weight") == "GPU0"
    assert p.device_of("token_embd.weight") == "CPU"
    assert p.bytes_by_device["GPU0"] == (dense.tensors["output.weight"].nbytes
                                         + dense.tensors["output_norm.weight"].nbytes)


def test_ngl_2_offloads_the_mtp_block_next(dense):
    p = plan_placement(dense, DEVS, n_gpu_layers=2)
    assert blocks_on(p, "GPU0") == [4]
    assert p.device_of("blk.4.nextn.eh_proj.weight") == "GPU0"
    assert p.device_of("blk.3.attn_q.weight") == "CPU"


@pytest.mark.parametrize("ngl", [6, 99, "all", None, -1])
def test_ngl_all(dense, ngl):
    p = plan_placement(dense, DEVS, n_gpu_layers=ngl)
    assert p.n_gpu_layers == 6 and p.i_gpu_start == 0
    assert blocks_on(p, "GPU0") == [0, 1, 2, 3, 4]
    assert p.device_of("token_embd.weight") == "CPU"  # the input layer never moves
    assert p.bytes_by_device["CPU"] == dense.tensors["token_embd.weight"].nbytes
    assert p.total_bytes == dense.total_bytes


def test_no_offload_device(dense):
    p = plan_placement(dense, ["CPU"], n_gpu_layers="all")
    assert set(p.tensor_devices.values()) == {"CPU"} and p.offload_devices == ()
    p = plan_placement(dense, DEVS, n_gpu_layers="all", device="none")
    assert set(p.tensor_devices.values()) == {"CPU"}


def test_split_over_two_devices():
    # llama.cpp: layer il goes to upper_bound(cumulative shares, (il - start) / n_offloaded)
    blocks, out, start = layer_devices(5, 6, ["A", "B"])
    assert start == 0 and blocks == ("A", "A", "A", "B", "B") and out == "B"
    blocks, out, _ = layer_devices(5, 6, ["A", "B"], tensor_split=[1, 2])
    assert blocks == ("A", "A", "B", "B", "B") and out == "B"
    blocks, out, start = layer_devices(5, 3, ["A", "B"])
    assert start == 3 and blocks == ("CPU", "CPU", "CPU", "A", "A") and out == "B"


def test_tied_output_is_copied_to_the_output_device(moe):
    assert moe.tied_output
    emb = moe.tensors["token_embd.weight"].nbytes
    p0 = plan_placement(moe, DEVS, n_gpu_layers=0)
    assert p0.output_copy_device is None and p0.total_bytes == moe.total_bytes
    p1 = plan_placement(moe, DEVS, n_gpu_layers=1)
    assert p1.output_copy_device == "GPU0"
    assert p1.total_bytes == moe.total_bytes + emb
    assert p1.bytes_by_device["GPU0"] == emb + moe.tensors["output_norm.weight"].nbytes


def test_overrides_first_match_wins(dense):
    ot = [(r"blk\.4\.", "CPU"), (r"attn", "GPU0")]
    p = plan_placement(dense, DEVS, n_gpu_layers=0, override_tensor=ot)
    assert p.device_of("blk.4.attn_q.weight") == "CPU"  # first pattern wins
    assert p.device_of("blk.1.attn_q.weight") == "GPU0"
    assert p.device_of("blk.0.ssm_out.weight") == "CPU"
    assert p.overridden["blk.1.attn_q.weight"] == "attn"
    assert p.total_bytes == dense.total_bytes


def test_cpu_moe_keeps_every_expert_on_cpu(moe):
    p = plan_placement(moe, DEVS, n_gpu_layers="all", cpu_moe=True)
    exps = [n for n in moe.tensors if "_exps." in n]
    assert exps and all(p.device_of(n) == "CPU" for n in exps)
    assert p.device_of("blk.4.ffn_down_exps.weight") == "CPU"  # the MTP block's experts too
    assert p.device_of("blk.4.ffn_gate_inp.weight") == "GPU0"  # router stays with its layer
    assert p.device_of("blk.0.ffn_up_shexp.weight") == "GPU0"  # shared expert is not matched
    assert CPU_MOE_REGEX == r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
    assert sum(moe.tensors[n].nbytes for n in exps) <= p.bytes_by_device["CPU"]


def test_include_mtp_false_skips_the_block(dense):
    p = plan_placement(dense, DEVS, n_gpu_layers="all", include_mtp=False)
    assert p.skipped and all(n.startswith("blk.4.") for n in p.skipped)
    assert "blk.4.attn_q.weight" not in p.tensor_devices
    assert p.total_bytes == dense.total_bytes - sum(dense.tensors[n].nbytes for n in p.skipped)


def test_sidecar_and_trunk_sum(tiny):
    with ModelFile.open(tiny("trunk", mtp="none")) as t, \
            ModelFile.open(tiny("mtp-only", mtp="only")) as m:
        pt = plan_placement(t, DEVS, n_gpu_layers="all")
        pm = plan_placement(m, DEVS, n_gpu_layers=2)  # output layer + the MTP block
        assert {pm.tensor_devices[n] for n in m.tensors if n.startswith("blk.4.")} == {"GPU0"}
        total = sum_bytes(pt, pm)
        assert sum(total.values()) == t.total_bytes + m.total_bytes


def test_errors(dense):
    with pytest.raises(DeviceError, match="unknown device 'CUDA3'"):
        plan_placement(dense, DEVS, n_gpu_layers=1, device="CUDA3")
    with pytest.raises(DeviceError, match="the CPU is not an offload device"):
        plan_placement(dense, DEVS, n_gpu_layers=1, device="CPU")
    with pytest.raises(DeviceError, match="unknown device 'GPU9'"):
        plan_placement(dense, DEVS, override_tensor=[("x", "GPU9")])
    with pytest.raises(PyggspecError, match="invalid regex"):
        plan_placement(dense, DEVS, override_tensor=[("(", "CPU")])
    with pytest.raises(DeviceError, match="lacks the CPU"):
        plan_placement(dense, ["GPU0"])
    with pytest.raises(PyggspecError, match="non-negative shares"):
        plan_placement(dense, ["CPU", "A", "B"], tensor_split=[1.0])


def test_weights_a_device_cannot_hold_stay_on_the_cpu(dense, moe):
    """A device that refuses a weight as an operand (lavapipe caps one storage buffer at
    128 MiB, below a real LM head) gets it kept on the CPU, listed in ``refused``; a refused
    LM head moves the logits to the CPU (ggml would abort on the first graph otherwise)."""
    def no_head(dev, info):
        return info.name not in ("output.weight", "token_embd.weight")

    p = plan_placement(dense, DEVS, "all", accepts=no_head)
    assert p.refused == {"output.weight": "GPU0"}
    assert p.device_of("output.weight") == "CPU" and p.output_device == "CPU"
    assert p.device_of("blk.0.attn_norm.weight") == "GPU0"
    full = plan_placement(dense, DEVS, "all")
    moved = dense.tensors["output.weight"].nbytes
    assert p.bytes_by_device["CPU"] == full.bytes_by_device["CPU"] + moved
    tied = plan_placement(moe, DEVS, "all", accepts=no_head)  # tied head: the copy is refused
    assert tied.refused == {"output.weight": "GPU0"}
    assert tied.output_copy_device is None and tied.output_device == "CPU"
    assert plan_placement(dense, DEVS, "all", accepts=lambda d, i: True).refused == {}
