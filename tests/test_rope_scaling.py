"""RoPE scaling from the GGUF (issue 13, item 5): YaRN and linear run as llama.cpp runs them.

The YaRN fixture uses a small ``original_context_length`` (64) so the prompt runs past it and
the interpolated / ramped rope dimensions differ from the unscaled ones. Trunk logits and MTP
logits are compared with llama.cpp on the same f32 file (1e-4, as in test_trunk_oracle), and
the graph as it was (only ``freq_scale``: no ``ext_factor``, no ``attn_factor``) is shown to
miss by far more than that. Scaling we cannot run as written is refused with the key named.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import write_tiny

from pyggspec.config import SpecConfig
from pyggspec.errors import ModelFileError
from pyggspec.modelfile import HParams, ModelFile
from pyggspec.models.mtp import MtpBatch
from pyggspec.testing.oracle import OracleModel, oracle_greedy, rel_err
from pyggspec.testing.spec import RopeScaling

YARN = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64)
PROMPT = [int(t) for t in np.random.default_rng(11).integers(5, 900, size=96)]
N_GREEDY = 8


def ours_greedy(make_engine, path, prompt, n):
    with make_engine(path, n_ctx=256) as e:
        lg = e.eval(prompt)
        rows, toks = [lg], []
        for _ in range(n):
            toks.append(int(lg[-1].argmax()))
            lg = e.eval([toks[-1]])
            rows.append(lg)
    return np.concatenate(rows), toks


def _old_graph_rope(monkeypatch):
    """What the graph passed before: freq_scale and n_ctx_orig only (ext 0, attn 1)."""
    real = HParams.rope.fget
    monkeypatch.setattr(HParams, "rope", property(
        lambda hp: dataclasses.replace(real(hp), ext_factor=0.0, attn_factor=1.0)))


def test_yarn_hparams_resolve_like_llamacpp(models):
    path = models.dense(rope_scaling=YARN)
    with ModelFile.open(path) as m:
        hp = m.hparams
    assert (hp.rope_scaling_type, hp.rope_freq_scale, hp.n_ctx_orig_yarn) == ("yarn", 0.25, 64)
    r = hp.rope
    # ext_factor 1; attn_factor = get_mscale(4) / (1 + 0.1 ln 4) in float32; betas 32 / 1
    assert (r.n_ctx_orig, r.freq_scale, r.ext_factor, r.beta_fast, r.beta_slow) == \
        (64, 0.25, 1.0, 32.0, 1.0)
    assert abs(r.attn_factor - 1.0) < 1e-7


def test_yarn_logits_match_llamacpp(models, make_engine, monkeypatch):
    path = models.dense(rope_scaling=YARN, mtp="none")
    ref, ref_toks = oracle_greedy(path, PROMPT, N_GREEDY)
    ours, toks = ours_greedy(make_engine, path, PROMPT, N_GREEDY)
    assert toks == ref_toks
    assert rel_err(ours, ref) <= 1e-4
    # the graph as it was runs this file with visibly different positions
    _old_graph_rope(monkeypatch)
    old, _ = ours_greedy(make_engine, path, PROMPT, N_GREEDY)
    assert rel_err(old, ref) > 1e-2


def test_yarn_mtp_logits_match_llamacpp(models, make_engine, monkeypatch):
    """The MTP head's attention ropes with the same scaling."""
    path = models.dense(rope_scaling=YARN)
    prompt = PROMPT[:80]
    with OracleModel(path) as om, om.context(n_ctx=256, n_batch=256, nextn=True) as oc:
        t = int(oc.eval(prompt)[-1].argmax())
        hid = np.stack([oc.hidden_nextn(i) for i in range(len(prompt))])
    paired = np.concatenate([np.zeros((1, hid.shape[1]), np.float32), hid])
    with OracleModel(path, load_mtp=True) as om, om.context(n_ctx=256, n_batch=256,
                                                             mtp=True) as mc:
        ref = mc.mtp_eval(prompt + [t], paired, 0)

    def ours() -> np.ndarray:
        with make_engine(path, n_ctx=256, spec_type="draft-mtp", spec=SpecConfig(n_max=1),
                         draft_backend_sampling=False) as e:
            n = len(prompt) + 1
            res = e.mtp.run(MtpBatch(np.array([prompt + [t]], np.int32), paired[None],
                                     np.array([0]), (0,), np.arange(n, dtype=np.int32)))
            return res.logits

    assert rel_err(ours(), ref) <= 1e-4
    _old_graph_rope(monkeypatch)
    assert rel_err(ours(), ref) > 1e-2


def test_linear_logits_match_llamacpp(models, make_engine):
    path = models.dense(rope_scaling=RopeScaling("linear", factor=2.0), mtp="none")
    ref, ref_toks = oracle_greedy(path, PROMPT[:48], 4)
    ours, toks = ours_greedy(make_engine, path, PROMPT[:48], 4)
    assert toks == ref_toks
    assert rel_err(ours, ref) <= 1e-4


def test_yarn_keys_written_as_converter_writes_them(models):
    rs = dataclasses.replace(YARN, beta_fast=32.0, beta_slow=1.0)
    path = models.dense(rope_scaling=rs, mtp="none")
    with ModelFile.open(path) as m:
        md, hp = m.gguf.metadata, m.hparams
        keys = list(md)
        i = keys.index("qwen35.attention.head_count_kv")
        assert keys[i + 1:i + 7] == [f"qwen35.rope.scaling.{k}" for k in (
            "type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow")] \
            + ["qwen35.rope.dimension_sections"]
        assert [md[k].type for k in keys[i + 1:i + 6]] == ["string", "f32", "u32", "f32", "f32"]
        assert md[keys[i + 1]].value == "yarn"
    assert hp.rope.ext_factor == 1.0  # the explicit defaults are accepted


def test_none_type_never_scales(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={".rope.scaling.type": "none",
                                              ".rope.scaling.factor": 4.0})
    r = ModelFile.open(p, validate=False).hparams.rope
    assert (r.freq_scale, r.ext_factor, r.attn_factor) == (1.0, 0.0, 1.0)


def test_attn_factor_key_scales_the_rotation(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={".rope.scaling.type": "linear",
                                              ".rope.scaling.factor": 2.0,
                                              ".rope.scaling.attn_factor": 0.5})
    r = ModelFile.open(p, validate=False).hparams.rope
    assert (r.freq_scale, r.ext_factor, r.attn_factor) == (0.5, 0.0, 0.5)


@pytest.mark.parametrize("meta, message", [
    ({".rope.scaling.type": "longrope"},
     r"qwen35\.rope\.scaling\.type = 'longrope' is not supported"),
    ({".rope.scaling.type": "yarn", ".rope.scaling.factor": 4.0,
      ".rope.scaling.yarn_beta_fast": 16.0},
     r"qwen35\.rope\.scaling\.yarn_beta_fast = 16 is not supported"),
    ({".rope.scaling.type": "yarn", ".rope.scaling.factor": 4.0,
      ".rope.scaling.yarn_log_multiplier": 0.1},
     r"qwen35\.rope\.scaling\.yarn_log_multiplier = 0\.1 is not supported"),
    ({".rope.scaling.type": "yarn", ".rope.scaling.factor": 4.0,
      ".rope.scaling.yarn_attn_factor": 1.0},
     r"qwen35\.rope\.scaling\.yarn_attn_factor = 1 is not supported .* runs 1\.13863"),
    ({".rope.scaling.type": "linear", ".rope.scaling.factor": -2.0},
     r"qwen35\.rope\.scaling\.factor = -2 must be"),
])
def test_unsupported_scaling_is_refused(tmp_path, meta, message):
    p = write_tiny(tmp_path / "a.gguf", meta=meta)
    with pytest.raises(ModelFileError, match=message) as e:
        ModelFile.open(p)
    assert str(e.value).startswith(f"pyggspec: {p}: ")


def test_yarn_tuning_keys_equal_to_what_runs_are_accepted(tmp_path):
    p = write_tiny(tmp_path / "a.gguf", meta={
        ".rope.scaling.type": "yarn", ".rope.scaling.factor": 4.0,
        ".rope.scaling.original_context_length": 1024, ".rope.scaling.yarn_ext_factor": 1.0,
        ".rope.scaling.yarn_attn_factor": float(1 + 0.1 * np.log(4.0)),
        ".rope.scaling.yarn_beta_fast": 32.0, ".rope.scaling.yarn_beta_slow": 1.0})
    r = ModelFile.open(p, validate=False).hparams.rope
    assert (r.n_ctx_orig, r.freq_scale, r.ext_factor) == (1024, 0.25, 1.0)
