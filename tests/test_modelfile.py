"""ModelFile: header parsing, hparams, tensor checks, MTP detection, pairs, estimates."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import DELETE, write_tiny

from pyggspec.errors import ModelFileError
from pyggspec.modelfile import (
    ModelFile,
    kv_bytes_per_seq,
    open_model,
    recurrent_bytes_per_seq,
)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_variants_load(tiny, arch, dtype):
    path = tiny(f"{arch}-{dtype}", arch=arch, dtype=dtype, tied=arch == "qwen35moe")
    with ModelFile.open(path) as m:
        hp = m.hparams
        assert hp.arch == arch and hp.is_moe == (arch == "qwen35moe")
        assert (hp.n_layer, hp.n_layer_all, hp.n_layer_nextn) == (4, 5, 1)
        assert hp.layer_kinds == ("recurrent", "attention", "recurrent", "attention")
        assert not hp.is_recurrent(4)  # the MTP block is attention
        assert m.mtp.status == "grafted" and m.mtp.block == 4
        assert "blk.4.nextn.eh_proj.weight" in m.mtp.nextn_tensors
        assert not m.mtp.own_embedding and not m.mtp.own_head and m.mtp.own_head_norm
        assert m.report.ok and not m.report.warnings
        assert m.tied_output == (arch == "qwen35moe")
        types = m.bytes_by_type()
        assert set(types) == ({"f32"} if dtype == "f32" else {dtype, "f32"})
        assert sum(types.values()) == m.total_bytes
        if hp.is_moe:
            assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (8, 2, 32, 64)


def test_derived_dims(tiny):
    with ModelFile.open(tiny("dense")) as m:
        hp = m.hparams
        assert (hp.head_dim, hp.n_rot, hp.n_embd_k_gqa) == (32, 8, 64)
        assert (hp.key_dim, hp.value_dim, hp.conv_dim) == (32, 64, 128)
        assert hp.n_embd_r == 3 * 128 and hp.n_embd_s == 16 * 64
        assert hp.rms_eps == 1e-6 and hp.rope_sections == (2, 1, 1, 0)
        assert hp.n_embd_out == 64 and hp.model_type == "?"


def test_tensor_index_and_zero_copy_data(tiny):
    path = tiny("dense")
    with ModelFile.open(path) as m:
        t = m.tensors["blk.1.attn_q.weight"]
        assert (t.type_name, t.type_id, t.shape) == ("f32", 0, (64, 256))
        assert t.nbytes == 64 * 256 * 4
        view = m.tensor_data(t.name)
        assert view.nbytes == t.nbytes and not view.flags.writeable and not view.flags.owndata
        ref = {rt.name: rt for rt in gguf.GGUFReader(path).tensors}[t.name]
        np.testing.assert_array_equal(view.view(np.float32).reshape(256, 64), ref.data)


def test_tokenizer_summary(tiny):
    with ModelFile.open(tiny("dense")) as m:
        tok = m.tokenizer
        assert (tok.model, tok.pre, tok.n_tokens, tok.n_merges) == ("gpt2", "qwen35", 256, 2)
        assert (tok.eos_id, tok.eos_token) == (255, "<|endoftext|>")
        assert tok.bos_id is None and tok.has_chat_template and tok.add_bos is False


def test_interval_fallback(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", n_layer=8,
                   meta={".attention.recurrent_layers": DELETE,
                         ".full_attention_interval": DELETE})
    # default interval 4: layers 3 and 7 are attention; our file has attention at 1,3,5,7,
    # so the check must now fail on layer 1's tensors
    with pytest.raises(ModelFileError, match=r"blk\.1\."):
        ModelFile.open(p)
    hp = ModelFile.open(p, validate=False).hparams
    assert hp.recurrent_from == "interval"
    assert [i for i, k in enumerate(hp.layer_kinds) if k == "attention"] == [3, 7]


def test_interval_key_used(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={".attention.recurrent_layers": DELETE})
    with ModelFile.open(p) as m:  # full_attention_interval = 2 matches the tensors
        assert m.hparams.layer_kinds == ("recurrent", "attention") * 2


@pytest.mark.parametrize("key", [".attention.layer_norm_rms_epsilon",
                                 ".rope.dimension_sections", ".ssm.conv_kernel",
                                 ".ssm.state_size", ".ssm.group_count", ".ssm.time_step_rank",
                                 ".ssm.inner_size", ".embedding_length", ".block_count"])
def test_missing_required_key(tmp_path, key):
    p = write_tiny(tmp_path / "a.gguf", meta={key: DELETE})
    with pytest.raises(ModelFileError, match=f"missing required metadata key 'qwen35{key}'"):
        ModelFile.open(p)


def test_rope_sections_must_have_four(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={".rope.dimension_sections": [2, 1, 1]})
    with pytest.raises(ModelFileError, match="3 entries, expected 4"):
        ModelFile.open(p)


def test_unknown_arch(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={"general.architecture": "llama"})
    with pytest.raises(ModelFileError, match="unsupported architecture 'llama'"):
        ModelFile.open(p)


@pytest.mark.parametrize("damage, message", [
    ({"drop": ("blk.2.ssm_a",)}, r"missing tensor 'blk\.2\.ssm_a' \(expected shape \[4\]\)"),
    ({"reshape": {"blk.1.attn_k.weight": (64, 32)}},
     r"tensor 'blk\.1\.attn_k\.weight' has wrong shape: expected \[64, 64\], got \[64, 32\]"),
    ({"retype": {"blk.0.attn_norm.weight": "f16"}},
     r"tensor 'blk\.0\.attn_norm\.weight' must be f32 .*got f16"),
    ({"retype": {"blk.0.ssm_conv1d.weight": "f16"}}, r"ssm_conv1d\.weight' must be f32"),
    ({"drop": ("blk.4.nextn.eh_proj.weight",)}, r"missing tensor 'blk\.4\.nextn\.eh_proj"),
    ({"drop": ("blk.0.attn_gate.weight",)}, r"missing tensor 'blk\.0\.attn_gate\.weight'"),
])
def test_bad_tensors(tmp_path, damage, message):
    p = write_tiny(tmp_path / "a.gguf", **damage)
    with pytest.raises(ModelFileError, match=message) as e:
        ModelFile.open(p)
    assert str(e.value).startswith(f"pyggspec: {p}: ")


def test_vocab_mismatch(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", reshape={"token_embd.weight": (64, 250)})
    with pytest.raises(ModelFileError, match="tokenizer has 256 tokens but token_embd.weight "
                                             "has 250 rows"):
        ModelFile.open(p)


def test_quantized_row_not_multiple_of_block(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", retype={"blk.0.ssm_beta.weight": "q8_0"},
                   reshape={"blk.0.ssm_beta.weight": (64, 4)})
    with ModelFile.open(p) as m:  # 64 is a multiple of 32: fine
        assert m.tensors["blk.0.ssm_beta.weight"].type_name == "q8_0"


def test_fused_alternatives_accepted(tmp_path):
    qkv = 2 * 4 * 32 + 2 * 2 * 32
    p = write_tiny(tmp_path / "a.gguf", arch="qwen35moe",
                   drop=("blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_v.weight",
                         "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"),
                   extra={"blk.1.attn_qkv.weight": (64, qkv),
                          "blk.0.ffn_gate_up_exps.weight": (64, 64, 8)})
    with ModelFile.open(p) as m:
        assert m.report.ok and not m.report.unused


def test_unused_tensor_is_a_warning(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", extra={"blk.0.something_new.weight": (32,)})
    with ModelFile.open(p) as m:
        assert m.report.unused == ("blk.0.something_new.weight",)
        assert "not used by qwen35" in m.report.warnings[0]


def test_declared_mtp_without_tensors(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", mtp="none",
                   meta={".nextn_predict_layers": 1, ".block_count": 5,
                         ".attention.recurrent_layers": [True, False, True, False, False]})
    with ModelFile.open(p) as m:
        assert m.mtp.status == "missing" and not m.mtp.usable
        assert "has no tensors" in m.report.warnings[0]
        assert m.hparams.n_layer == 4


def test_mtp_only_file(tiny):
    with ModelFile.open(tiny("mtp-only", mtp="only")) as m:
        assert m.mtp.status == "mtp-only" and not m.has_trunk
        assert not any(n.startswith("blk.0.") for n in m.tensors)


def test_trunk_only_file(tiny):
    with ModelFile.open(tiny("trunk", mtp="none")) as m:
        assert m.mtp.status == "none" and m.hparams.n_layer_nextn == 0 and m.has_trunk


def test_open_model_pair(tiny):
    with open_model(tiny("trunk", mtp="none"), tiny("mtp-only", mtp="only")) as model:
        assert model.mtp_source == "separate" and model.mtp_owner is model.mtp_file
    with open_model(tiny("dense")) as model:
        assert model.mtp_source == "grafted" and model.mtp_owner is model.trunk
    with open_model(tiny("trunk", mtp="none")) as model:
        assert model.mtp_source is None


def test_pair_errors(tiny):
    trunk, sidecar = tiny("trunk", mtp="none"), tiny("mtp-only", mtp="only")
    with pytest.raises(ModelFileError, match=r"not an MTP file \(nextn_predict_layers = 0\)") \
            as e:
        open_model(trunk, trunk)
    assert e.value.where == str(trunk)
    with pytest.raises(ModelFileError, match="is an MTP-only file") as e:
        open_model(sidecar)
    assert e.value.where == str(sidecar)
    with pytest.raises(ModelFileError, match="not an MTP-only file"):
        open_model(trunk, tiny("dense"))
    other = tiny("mtp-wide", mtp="only", n_embd=128)
    with pytest.raises(ModelFileError, match="does not belong to trunk.gguf: n_embd 128 here "
                                             "vs 64 in the model") as e:
        open_model(trunk, other)
    assert e.value.where == str(other)
    other = tiny("mtp-vocab320", mtp="only", n_vocab=320)
    with pytest.raises(ModelFileError, match="n_vocab 320 here vs 256"):
        open_model(trunk, other)


def test_estimates(tiny):
    with ModelFile.open(tiny("dense")) as m:
        hp = m.hparams
        # 2 attention layers x ctx x (K + V) x 2 heads x 32 dims x 2 bytes (f16)
        assert kv_bytes_per_seq(hp, 100) == 2 * 100 * 2 * 64 * 2
        assert kv_bytes_per_seq(hp, 100, "f32", "f32") == 2 * 100 * 2 * 64 * 4
        assert kv_bytes_per_seq(hp, 100, "q8_0", "q8_0") == 2 * 100 * 2 * (64 // 32 * 34)
        assert recurrent_bytes_per_seq(hp) == 2 * (384 + 1024) * 4
        assert recurrent_bytes_per_seq(hp, n_snapshots=3) == 4 * 2 * (384 + 1024) * 4


def test_generator_fixtures(testing_models):
    """The project generator's files load, validate and pair."""
    for name, path in testing_models.items():
        if name.endswith("-split-mtp"):
            continue
        with ModelFile.open(path) as m:
            assert m.report.ok, name
            expected = "none" if name.endswith("nomtp") or "split" in name else "grafted"
            assert m.mtp.status == expected, name
    for arch in ("dense", "moe"):
        with open_model(testing_models[f"{arch}-split-trunk"],
                        testing_models[f"{arch}-split-mtp"]) as model:
            assert model.mtp_source == "separate"
