"""The fixture generator (``pyggspec.testing``): converter layout, determinism, and llama.cpp.

Why: every other test trusts these files to be what llama.cpp's converter would write for a
Qwen3.5 checkpoint. Here we pin the layout (keys, types, tensor names/shapes/dtypes, the
converter's transforms), determinism, and that llama.cpp itself loads, tokenizes and runs
every variant, including the MTP-only sidecar and the constructed-agreement MTP head.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, TokenType, quants

from pyggspec.testing import (
    ModelSpec,
    agreement_plan,
    build_vocab,
    cached_model,
    oracle,
    qwen35_0_8b,
    tiny_dense,
    tiny_moe,
    write_model,
    write_split,
)
from pyggspec.testing.writer import _reorder_v_heads, plan_tensors

needs_llama = pytest.mark.skipif(not oracle.available(), reason="llama_cpp not installed")

PRESETS = {"dense": tiny_dense, "moe": tiny_moe}


@pytest.fixture(scope="session")
def fixtures(models) -> dict[str, tuple[ModelSpec, Path]]:
    """name -> (spec, path) for a covering set of variants (split = two entries)."""
    out: dict[str, tuple[ModelSpec, Path]] = {}
    for arch, preset in PRESETS.items():
        for dtype in ("f32", "f16", "q8_0"):
            spec = preset(dtype=dtype)
            out[f"{arch}-grafted-{dtype}"] = (spec, models.path(spec))
        spec = preset(mtp="none")
        out[f"{arch}-none-f32"] = (spec, models.path(spec))
        for dtype in ("f32", "q8_0"):
            spec = preset(dtype=dtype)
            trunk, mtp = models.path(spec, layout="split")
            out[f"{arch}-split-{dtype}-trunk"] = (spec, trunk)
            out[f"{arch}-split-{dtype}-mtp"] = (spec, mtp)
    for arch, dtype in (("dense", "f32"), ("moe", "q8_0")):
        spec = PRESETS[arch](dtype=dtype, agreement=0.85)
        out[f"{arch}-agree-{dtype}"] = (spec, models.path(spec))
    return out


def _kv(r: GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _types(r: GGUFReader, key: str) -> list[GGUFValueType]:
    return list(r.fields[key].types)


def _tensors(path: Path) -> dict[str, tuple[QT, tuple[int, ...], np.ndarray]]:
    """name -> (type, ne, data) ; ne in ggml order."""
    r = GGUFReader(path)
    return {t.name: (t.tensor_type, tuple(int(x) for x in t.shape), t.data) for t in r.tensors}


def _f32(t: tuple[QT, tuple[int, ...], np.ndarray]) -> np.ndarray:
    return quants.dequantize(t[2], t[0]).reshape(tuple(reversed(t[1])))


# --------------------------------------------------------------------------------------------
# vocabulary
# --------------------------------------------------------------------------------------------

def test_vocab_is_a_real_bpe() -> None:
    v = build_vocab(1024)
    assert len(v.tokens) == 1024 == len(v.token_types)
    assert len(set(v.tokens)) == len(v.tokens)
    assert 200 <= len(v.merges) <= 1000
    index = {t: i for i, t in enumerate(v.tokens)}
    for m in v.merges:  # every merge joins two existing tokens into an existing token
        a, b = m.split(" ")
        assert a in index and b in index and (a + b) in index
    assert v.token_types[:v.n_normal] == (TokenType.NORMAL,) * v.n_normal
    assert v.tokens[v.endoftext_id:v.im_end_id + 1] == ("<|endoftext|>", "<|im_start|>",
                                                        "<|im_end|>")
    assert set(v.token_types[v.n_normal:v.n_normal + 3]) == {TokenType.CONTROL}
    assert v.tokens[-1] == "[PAD1023]" and v.token_types[-1] == TokenType.UNUSED
    assert (v.eos_id, v.pad_id, v.bos_id) == (v.im_end_id, v.endoftext_id, v.endoftext_id)
    assert sorted(v.token_bytes(i)[0] for i in range(256)) == list(range(256))


# --------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_same_seed_same_bytes(arch: str, fixtures, tmp_path: Path) -> None:
    spec, path = fixtures[f"{arch}-grafted-q8_0"]
    again = write_model(tmp_path / "again.gguf", spec)
    assert again.read_bytes() == path.read_bytes()
    trunk, mtp = write_split(tmp_path, PRESETS[arch](dtype="q8_0"))
    assert trunk.read_bytes() == fixtures[f"{arch}-split-q8_0-trunk"][1].read_bytes()
    assert mtp.read_bytes() == fixtures[f"{arch}-split-q8_0-mtp"][1].read_bytes()
    other = write_model(tmp_path / "other.gguf", spec.replace(seed=1))
    assert other.read_bytes() != path.read_bytes()


def test_cached_model_writes_once(tmp_path: Path) -> None:
    spec = tiny_dense(dtype="q8_0")
    p = cached_model(spec, tmp_path)
    mtime = p.stat().st_mtime_ns
    assert cached_model(spec, tmp_path) == p and p.stat().st_mtime_ns == mtime
    trunk, mtp = cached_model(spec, tmp_path, layout="split")
    assert mtp.name == "mtp-" + trunk.name
    assert cached_model(spec.replace(seed=3), tmp_path) != p


# --------------------------------------------------------------------------------------------
# converter layout
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dense-grafted-f16", "moe-grafted-q8_0"])
def test_metadata_as_the_converter_writes_it(name: str, fixtures) -> None:
    spec, path = fixtures[name]
    r = GGUFReader(path)
    kv = _kv(r)
    a = spec.arch
    keys = list(kv)
    assert keys[:3] == ["general.architecture", "general.type", "general.name"]
    assert kv["general.architecture"] == a
    assert kv[f"{a}.block_count"] == spec.n_layer + 1
    assert kv[f"{a}.nextn_predict_layers"] == 1
    assert kv[f"{a}.attention.recurrent_layers"] == [True, False, True, False, False]
    assert _types(r, f"{a}.attention.recurrent_layers") == [GGUFValueType.ARRAY,
                                                           GGUFValueType.BOOL]
    assert kv[f"{a}.rope.dimension_sections"] == list(spec.rope_sections)
    assert _types(r, f"{a}.rope.dimension_sections")[1] == GGUFValueType.INT32
    assert kv[f"{a}.rope.dimension_count"] == spec.head_dim // 4
    assert kv[f"{a}.full_attention_interval"] == spec.full_attention_interval
    assert kv[f"{a}.ssm.inner_size"] == spec.d_state * spec.dt_rank
    assert kv[f"{a}.ssm.group_count"] == spec.n_group
    assert kv[f"{a}.ssm.time_step_rank"] == spec.dt_rank
    assert kv[f"{a}.attention.key_length"] == kv[f"{a}.attention.value_length"] == spec.head_dim
    assert kv["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7}[spec.dtype]
    for k in (f"{a}.block_count", f"{a}.context_length", "general.file_type",
              f"{a}.ssm.state_size", "tokenizer.ggml.eos_token_id"):
        assert _types(r, k) == [GGUFValueType.UINT32], k
    for k in (f"{a}.rope.freq_base", f"{a}.attention.layer_norm_rms_epsilon"):
        assert _types(r, k) == [GGUFValueType.FLOAT32], k
    if spec.is_moe:
        assert kv[f"{a}.expert_count"] == 8 and kv[f"{a}.expert_used_count"] == 2
        assert kv[f"{a}.expert_feed_forward_length"] == spec.n_ff_exp
        assert kv[f"{a}.expert_shared_feed_forward_length"] == spec.n_ff_shexp
        assert f"{a}.feed_forward_length" not in kv  # HF MoE configs have no intermediate_size
    else:
        assert kv[f"{a}.feed_forward_length"] == spec.n_ff
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen35"
    assert _types(r, "tokenizer.ggml.token_type")[1] == GGUFValueType.INT32
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert keys[-1] == "tokenizer.chat_template"
    # vocab section follows general.quantization_version, as in convert_hf_to_gguf
    assert keys.index("general.quantization_version") + 1 == keys.index("tokenizer.ggml.model")


def _expected_block(spec: ModelSpec, il: int, dtype: str) -> dict[str, tuple[str, tuple]]:
    """GGUF name suffix -> (type, ne) for block il, from REFERENCE §1.4-1.6 shapes."""
    d, hd, q = spec.n_embd, spec.head_dim, {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[dtype]
    exp: dict[str, tuple[str, tuple]] = {
        "attn_norm.weight": ("F32", (d,)), "post_attention_norm.weight": ("F32", (d,))}
    if il < spec.n_layer and spec.layer_is_recurrent(il):
        exp |= {
            "attn_qkv.weight": (q, (d, spec.conv_dim)),
            "attn_gate.weight": (q, (d, spec.value_dim)),
            "ssm_conv1d.weight": ("F32", (spec.d_conv, spec.conv_dim)),
            "ssm_dt.bias": ("F32", (spec.dt_rank,)), "ssm_a": ("F32", (spec.dt_rank,)),
            "ssm_beta.weight": (q, (d, spec.dt_rank)), "ssm_alpha.weight": (q, (d, spec.dt_rank)),
            "ssm_norm.weight": ("F32", (spec.d_state,)),
            "ssm_out.weight": (q, (spec.value_dim, d)),
        }
    else:
        exp |= {
            "attn_q.weight": (q, (d, 2 * spec.n_head * hd)),
            "attn_k.weight": (q, (d, spec.n_head_kv * hd)),
            "attn_v.weight": (q, (d, spec.n_head_kv * hd)),
            "attn_output.weight": (q, (spec.n_head * hd, d)),
            "attn_q_norm.weight": ("F32", (hd,)), "attn_k_norm.weight": ("F32", (hd,)),
        }
    if spec.is_moe:
        e, f, fs = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
        exp |= {
            "ffn_gate_inp.weight": ("F32", (d, e)),
            "ffn_gate_exps.weight": (q, (d, f, e)), "ffn_up_exps.weight": (q, (d, f, e)),
            "ffn_down_exps.weight": (q, (f, d, e)),
            "ffn_gate_inp_shexp.weight": ("F32", (d, 1)),
            "ffn_gate_shexp.weight": (q, (d, fs)), "ffn_up_shexp.weight": (q, (d, fs)),
            "ffn_down_shexp.weight": (q, (fs, d)),
        }
    else:
        exp |= {"ffn_gate.weight": (q, (d, spec.n_ff)), "ffn_up.weight": (q, (d, spec.n_ff)),
                "ffn_down.weight": (q, (spec.n_ff, d))}
    if il == spec.n_layer:
        exp |= {"nextn.eh_proj.weight": (q, (2 * d, d)), "nextn.enorm.weight": ("F32", (d,)),
                "nextn.hnorm.weight": ("F32", (d,)),
                "nextn.shared_head_norm.weight": ("F32", (d,))}
    return exp


@pytest.mark.parametrize("name", [
    "dense-grafted-f32", "dense-grafted-q8_0", "moe-grafted-f16", "moe-grafted-q8_0",
    "dense-none-f32", "moe-none-f32", "dense-split-q8_0-trunk", "dense-split-q8_0-mtp",
    "moe-split-q8_0-mtp",
])
def test_tensor_names_shapes_types(name: str, fixtures) -> None:
    spec, path = fixtures[name]
    got = {n: (t[0].name, t[1]) for n, t in _tensors(path).items()}
    q = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[spec.dtype]
    d, v = spec.n_embd, spec.n_vocab
    want: dict[str, tuple[str, tuple]] = {"token_embd.weight": (q, (d, v)),
                                          "output_norm.weight": ("F32", (d,))}
    if not spec.tied_embeddings:
        want["output.weight"] = (q, (d, v))
    trunk = not name.endswith("-mtp")
    mtp = "grafted" in name or name.endswith("-mtp")
    blocks = (list(range(spec.n_layer)) if trunk else []) + ([spec.n_layer] if mtp else [])
    for il in blocks:
        for suffix, tv in _expected_block(spec, il, spec.dtype).items():
            want[f"blk.{il}.{suffix}"] = tv
    assert got == want


def test_tensor_order_follows_sorted_hf_names(fixtures) -> None:
    """The converter visits HF tensors in sorted-name order: lm_head, embed, layers.0,
    layers.1, layers.10.. (string order), norm, then mtp.*."""
    spec = tiny_dense(n_layer=12, full_attention_interval=4)
    names = [e.name for e in plan_tensors(spec, "full")]
    assert names[:2] == ["output.weight", "token_embd.weight"]
    blocks = [n.split(".")[1] for n in names if n.startswith("blk.")]
    firsts = list(dict.fromkeys(blocks))
    assert firsts == ["0", "1", "10", "11", "2", "3", "4", "5", "6", "7", "8", "9", "12"]
    assert names.index("output_norm.weight") == names.index("blk.12.nextn.eh_proj.weight") - 1
    gdn = [n.split(".", 2)[2] for n in names if n.startswith("blk.0.")]
    assert gdn[:6] == ["attn_norm.weight", "ssm_a", "ssm_conv1d.weight", "ssm_dt.bias",
                       "ssm_alpha.weight", "ssm_beta.weight"]
    assert names[-3:] == ["blk.12.nextn.shared_head_norm.weight", "blk.12.nextn.enorm.weight",
                          "blk.12.nextn.hnorm.weight"]


def test_names_match_gguf_py_tensor_map() -> None:
    """Our HF->GGUF names agree with gguf-py's own TensorNameMap (where it knows the name)."""
    import gguf

    from pyggspec.testing.writer import _BLOCK_NAMES, _GLOBAL_NAMES, gguf_name

    for arch, spec in (("QWEN35", tiny_dense()), ("QWEN35MOE", tiny_moe())):
        tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), spec.n_layer + 1)
        for hf in list(_GLOBAL_NAMES) + [f"model.layers.1.{k}" for k in _BLOCK_NAMES]:
            ref = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
            if ref is not None:
                assert gguf_name(hf) == ref, hf


def test_converter_transforms(fixtures) -> None:
    _, path = fixtures["dense-grafted-f32"]
    t = _tensors(path)
    assert (_f32(t["blk.0.ssm_a"]) < 0).all()  # -exp(A_log)
    # +1 on zero-centred norms (stored ~1), not on the GDN gated norm (~1 as sampled)
    for n in ("blk.0.attn_norm.weight", "blk.1.attn_q_norm.weight", "output_norm.weight",
              "blk.4.nextn.enorm.weight", "blk.4.nextn.hnorm.weight",
              "blk.4.nextn.shared_head_norm.weight"):
        assert abs(float(_f32(t[n]).mean()) - 1.0) < 0.1, n
    assert abs(float(_f32(t["blk.0.ssm_norm.weight"]).mean()) - 1.0) < 0.1
    # tied MoE: no output.weight; untied dense: output.weight present
    assert "output.weight" in t
    assert "output.weight" not in _tensors(fixtures["moe-grafted-f32"][1])


def test_v_head_reorder_grouped_to_tiled() -> None:
    grouped = np.arange(2 * 3 * 1)  # K heads 2, 3 V heads per K head, head dim 1
    np.testing.assert_array_equal(_reorder_v_heads(grouped, 0, 2, 3, 1), [0, 3, 1, 4, 2, 5])
    w = np.arange(2 * 2 * 4).reshape(1, -1)  # columns of out_proj, head dim 4
    tiled = _reorder_v_heads(w, 1, 2, 2, 4).reshape(4, 4)[:, 0]
    np.testing.assert_array_equal(tiled, [0, 8, 4, 12])


def test_v_reorder_is_consistent_across_tensors(fixtures) -> None:
    """V head h in the file uses K head h mod n_group: the same permutation hits dt_bias,
    A, alpha/beta rows, z rows, V rows and out_proj columns. Compare to an unreordered spec."""
    spec, path = fixtures["dense-grafted-f32"]
    t = _tensors(path)
    same = {e.name: e for e in plan_tensors(spec.replace(n_group=4), "full")}  # K == V heads
    perm = _reorder_v_heads(np.arange(spec.dt_rank), 0, 2, 2, 1)
    # dt_bias is sampled from the same RNG stream whatever n_group is
    np.testing.assert_array_equal(_f32(t["blk.0.ssm_dt.bias"]),
                                  same["blk.0.ssm_dt.bias"].make()[perm])


def test_q8_0_matches_ggml_reference() -> None:
    """Q8_0 bytes are ggml's own (quantize_row_q8_0_ref via ggml_quantize_chunk)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="ggml's quantizer is llama-cpp-python's "
                                    "libggml-base (pip install -e .)")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib",
                                   "libggml-base.so"))
    f = lib.ggml_quantize_chunk
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    f.restype = ctypes.c_size_t
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 128)).astype(np.float32) * np.float32(3.0)
    x[2, :32] = 0.0
    ours = quants.quantize(x, QT.Q8_0)
    ref = np.zeros_like(ours)
    assert f(int(QT.Q8_0), x.ctypes.data, ref.ctypes.data, 0, 16, 128, None) == ours.nbytes
    assert np.array_equal(ours, ref)


def test_specs_validate() -> None:
    s = qwen35_0_8b()
    assert (s.n_rot, s.conv_dim, s.value_dim, s.n_vocab) == (64, 6144, 2048, 248320)
    assert s.tied_embeddings and not qwen35_0_8b(agreement=0.9).tied_embeddings
    with pytest.raises(ValueError):
        tiny_dense(rope_sections=(4, 4, 4, 0))
    with pytest.raises(ValueError):
        tiny_dense(agreement=0.9, tied_embeddings=True)
    with pytest.raises(ValueError):
        tiny_dense(dt_rank=3)


def test_agreement_calibration() -> None:
    for rate in (0.7, 0.95):
        plan = agreement_plan(tiny_dense(agreement=rate))
        assert abs(plan.achieved_rate - rate) < 3.0 / len(plan.cycle)
        v = build_vocab(1024)
        assert plan.next_token[plan.cycle[0]] == plan.cycle[1]
        real = plan.next_token[: v.n_normal + 3]
        assert np.isin(real, plan.cycle).all()  # never a special/EOG/PAD token


def test_make_tiny_model_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"
    mod_spec = importlib.util.spec_from_file_location("make_tiny_model", script)
    assert mod_spec and mod_spec.loader
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    assert mod.main(["--arch", "moe", "--dtype", "q8_0", "--mtp", "split", "-o",
                     str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mtp-pyggspec-tiny-qwen35moe-Q8_0.gguf" in out and "tensors" in out
    assert mod.main(["--agreement", "0.9", "-o", str(tmp_path / "a.gguf")]) == 0
    assert "calibrated" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# llama.cpp loads and runs every variant
# --------------------------------------------------------------------------------------------

SAMPLE = "Hello, world! The quick brown fox jumps over the lazy dog.\n    return 42"


@needs_llama
def test_llama_cpp_vocab_only_and_tokenizer(fixtures) -> None:
    ref: list[int] | None = None
    for name, (_spec, path) in fixtures.items():
        with oracle.OracleModel(path, vocab_only=True) as m:
            assert m.n_vocab == 1024, name
            ids = m.tokenize(SAMPLE)
            assert len(ids) < len(SAMPLE) // 2, name  # merges applied
            assert m.detokenize(ids).decode() == SAMPLE
            ref = ref or ids
            assert ids == ref, name
            v = build_vocab(1024)
            chat = m.tokenize("<|im_start|>user\nhi<|im_end|>")
            assert chat[0] == v.im_start_id and chat[-1] == v.im_end_id


@needs_llama
def test_llama_cpp_full_load_and_decode(fixtures) -> None:
    for name, (spec, path) in fixtures.items():
        is_mtp_only = name.endswith("-mtp")
        with oracle.OracleModel(path, load_mtp=is_mtp_only) as m:
            assert m.n_layer == spec.n_layer, name
            assert m.n_embd == spec.n_embd and m.n_vocab == spec.n_vocab, name
            has_mtp = ("grafted" in name or "agree" in name or is_mtp_only)
            assert m.n_layer_nextn == (1 if has_mtp else 0), name
            if is_mtp_only:
                continue
            with m.context(n_ctx=128) as c:
                logits = c.eval(m.tokenize(SAMPLE)[:12])
                assert logits.shape == (12, spec.n_vocab) and np.isfinite(logits).all(), name
                if spec.dtype == "f32":
                    assert float(np.abs(logits).max()) < 1e3, name


@needs_llama
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_mtp_only_file_matches_grafted_head(arch: str, fixtures) -> None:
    """The mtp-*.gguf sidecar loads (load_mtp=True) and its MTP head computes exactly what
    the grafted block of the same spec computes."""
    spec, grafted = fixtures[f"{arch}-grafted-f32"]
    _, sidecar = fixtures[f"{arch}-split-f32-mtp"]
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, spec.n_embd)).astype(np.float32)
    toks = [300, 301, 302, 303, 304]
    out = []
    for path in (grafted, sidecar):
        with oracle.OracleModel(path, load_mtp=True) as m, m.context(mtp=True, n_ctx=64) as d:
            out.append(d.mtp_eval(toks, h, pos0=0))
    assert np.isfinite(out[0]).all()
    np.testing.assert_allclose(out[0], out[1], rtol=0, atol=1e-5)


@needs_llama
@pytest.mark.parametrize("name", ["dense-agree-f32", "moe-agree-q8_0"])
def test_constructed_agreement_in_llama_cpp(name: str, fixtures) -> None:
    """Target greedy follows f; llama.cpp's MTP head agrees with the target's next token at
    about the calibrated rate."""
    spec, path = fixtures[name]
    plan = agreement_plan(spec)
    n_new = 200
    with oracle.OracleModel(path, load_mtp=True) as m:
        prompt = m.tokenize("Hello, world!")
        with m.context(n_ctx=512, nextn=True) as c:
            logits = c.eval(prompt)
            hidden = [c.hidden_nextn(i) for i in range(len(prompt))]
            seq = list(prompt)
            for _ in range(n_new):
                t = int(np.argmax(logits[-1]))
                assert t == plan.next_token[seq[-1]]
                seq.append(t)
                logits = c.eval([t])
                hidden.append(c.hidden_nextn(0))
        with m.context(n_ctx=512, mtp=True) as d:
            # pair (x_q, h_{q-1}) predicts x_{q+1}
            mtp_logits = d.mtp_eval(seq[1:], np.stack(hidden[:-1]), pos0=1)
    pred = mtp_logits.argmax(axis=1)[:-1]
    gen = slice(len(prompt) - 1, None)
    rate = float(np.mean(pred[gen] == np.asarray(seq[2:])[gen]))
    assert abs(rate - plan.achieved_rate) < 0.08, (rate, plan.achieved_rate)


@pytest.mark.slow
@needs_llama
def test_qwen35_0_8b_shapes_load(tmp_path: Path) -> None:
    spec = qwen35_0_8b(dtype="q8_0", agreement=0.95, n_layer=4)
    path = write_model(tmp_path / "m.gguf", spec)
    with oracle.OracleModel(path) as m:
        assert (m.n_layer, m.n_embd, m.n_vocab) == (4, 1024, 248320)
