"""Write tiny Qwen3.5 GGUFs in exactly the layout llama.cpp's converter produces.

We sample weights in the Hugging Face form (``model.layers.i.linear_attn.A_log``, ...) and run
them through the same steps ``convert_hf_to_gguf.py`` applies to a Qwen3.5 checkpoint
(``conversion/qwen.py``: ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``), so the file means
what a converted checkpoint means:

* tensors visited in sorted HF-name order (the converter's safetensors reader sorts names);
  ``mtp.*`` renamed to block ``N`` (``mtp.fc`` -> ``eh_proj``, ``pre_fc_norm_embedding`` ->
  ``enorm``, ``pre_fc_norm_hidden`` -> ``hnorm``, ``norm`` -> ``shared_head.norm``);
* V heads of every ``linear_attn.*`` tensor permuted from grouped to tiled order when
  K heads != V heads; ``A_log`` -> ``-exp(A_log)``; ``dt_bias`` -> ``ssm_dt.bias``;
  conv1d squeezed; ``+1`` on every ``*norm.weight`` except ``linear_attn.norm.weight``;
  fused MoE ``gate_up_proj`` split into gate and up;
* dtype rule of ``ModelBase.prepare_tensors``: 1-D tensors, ``*_norm.weight``,
  ``ffn_gate_inp``, ``ffn_gate_inp_shexp``, ``ssm_conv1d`` and names not ending in
  ``.weight`` stay F32; everything else takes the outtype (Q8_0 falls back to F16 when a row
  is not a multiple of 32);
* metadata keys, types and order as ``TextModel`` / ``Qwen2MoeModel`` / ``_QwenMtpMixin`` /
  ``Qwen3NextModel`` / ``_Qwen35MRopeMixin`` write them, then the GPT-2 vocabulary.

Files are written tensor by tensor (header first, data streamed) so the 0.8B preset needs
memory for only a couple of tensors at a time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, QuantError, quants, size_label
from gguf import GGMLQuantizationType as QT
from gguf.constants import RopeScalingType

from pyggspec.testing.agreement import AgreementPlan, agreement_plan, embeddings, rng_for
from pyggspec.testing.spec import ModelSpec, RopeScaling
from pyggspec.testing.vocab import CHAT_TEMPLATE, build_vocab

Part = Literal["full", "trunk", "mtp"]
Maker = Callable[[], np.ndarray]

_FILE_TYPE = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_M, "iq4_xs": LlamaFileType.MOSTLY_IQ4_XS}
_OUT_QTYPE = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_k": QT.Q4_K,
              "iq4_xs": QT.IQ4_XS}
# llama-quantize-style types: quantized by ggml itself (gguf-py cannot quantize them all)
_GGML_QUANTIZED = (QT.Q4_0, QT.Q4_K, QT.IQ4_XS)

# HF (after the converter's renames) -> GGUF, per block; the converter gets these from
# gguf-py's TensorNameMap.
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_proj.bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_MTP_RENAME = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm",
               "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}
# Tensors the converter keeps in F32 whatever the outtype (by GGUF tensor kind).
_F32_KINDS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
# ggml quantization of tensors this large runs on threads, by row ranges (ggml quantizes rows
# independently: the bytes are the same); PYGGSPEC_WRITER_THREADS=1 turns it off
_PARALLEL_MIN = 1 << 24


def writer_threads() -> int:
    """Threads for one large tensor's quantization (default: the cores, at most 16)."""
    n = os.environ.get("PYGGSPEC_WRITER_THREADS", "")
    return max(1, int(n)) if n.strip() else min(16, os.cpu_count() or 1)


def _quantize(qtype: int, rows: np.ndarray) -> bytes:
    """``quantize_rows`` over row ranges on :func:`writer_threads` threads (the C call
    releases the GIL) for large tensors; the same bytes as one call."""
    from pyggspec.ggml.quantize import quantize_rows

    n = writer_threads()
    if rows.size < _PARALLEL_MIN or n == 1 or len(rows) < 2 * n:
        return quantize_rows(qtype, rows)
    step = -(-len(rows) // (4 * n))  # a few chunks per thread: even loads
    with ThreadPoolExecutor(n) as pool:
        parts = pool.map(lambda i: quantize_rows(qtype, rows[i:i + step]),
                         range(0, len(rows), step))
        return b"".join(parts)


def gguf_name(hf_name: str) -> str:
    """Map a converter-internal HF name (``model.layers.i.*`` form) to its GGUF name."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if parts[:2] != ["model", "layers"]:
        raise KeyError(hf_name)
    return f"blk.{parts[2]}.{_BLOCK_NAMES[parts[3]]}"


def converter_qtype(name: str, shape: tuple[int, ...], dtype: str) -> QT:
    """The tensor type ``ModelBase.prepare_tensors`` picks for a GGUF tensor."""
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return QT.F32
    if name.endswith(_F32_KINDS) or name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return QT.F32
    qtype = _OUT_QTYPE[dtype]
    if qtype in _GGML_QUANTIZED and shape[-1] % quants.GGML_QUANT_SIZES[qtype][0] != 0:
        qtype = QT.Q8_0  # like llama-quantize: rows that do not fit the blocks get Q8_0/F16
    if qtype == QT.Q8_0 and shape[-1] % 32 != 0:
        return QT.F16  # the converter catches QuantError and falls back to F16
    return qtype


@dataclass
class TensorEntry:
    """One GGUF tensor: its name, numpy shape (reverse of ggml ne), type and data maker."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    make: Maker
    # ModelSpec.shared_layers: the tensor whose data this one repeats (its own name for the
    # first of them); "": data of its own
    share: str = ""

    def data(self) -> np.ndarray:
        arr = self.make()
        if arr.shape != self.shape:
            raise AssertionError(f"{self.name}: made {arr.shape}, planned {self.shape}")
        if self.qtype in _GGML_QUANTIZED:
            rows = arr.astype(np.float32, copy=False).reshape(-1, arr.shape[-1])
            raw = _quantize(int(self.qtype), rows)
            return np.frombuffer(raw, np.uint8).reshape(
                quants.quant_shape_to_byte_shape(self.shape, self.qtype))
        try:
            return quants.quantize(arr.astype(np.float32, copy=False), self.qtype)
        except QuantError as e:  # pragma: no cover - planned types never hit this
            raise AssertionError(f"{self.name}: {e}") from e


# --------------------------------------------------------------------------------------------
# HF-form weights
# --------------------------------------------------------------------------------------------

class _HFModel:
    """Lazily generated HF state dict of a Qwen3.5 text model (+ ``mtp.*``)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.plan: AgreementPlan | None = (
            agreement_plan(spec) if spec.agreement is not None else None)
        self._emb: np.ndarray | None = None
        self.tensors: dict[str, tuple[tuple[int, ...], Maker]] = {}
        self._build()

    # -- samplers --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        """The RNG key of a tensor: with ``shared_layers`` a trunk layer's tensors take the
        keys of the layer whose weights they repeat (``ModelSpec.weights_layer``)."""
        if not self.spec.shared_layers or not key.startswith("model.layers."):
            return key
        il, rest = key[len("model.layers."):].split(".", 1)
        return f"model.layers.{self.spec.weights_layer(int(il))}.{rest}"

    def _normal(self, key: str, shape: tuple[int, ...], std: float) -> Maker:
        key = self._key(key)

        def make() -> np.ndarray:
            a = rng_for(self.spec, key).standard_normal(shape, dtype=np.float32)
            a *= np.float32(std)
            return a
        return make

    def _proj(self, key: str, out_f: int, in_f: int, scale: float | None = None) -> Maker:
        return self._normal(key, (out_f, in_f), (scale or self.spec.weight_scale) / in_f**0.5)

    def _out_proj(self, key: str, out_f: int, in_f: int) -> Maker:
        s = self.spec
        scale = s.agreement_out_scale if s.agreement is not None else s.out_scale
        return self._normal(key, (out_f, in_f), scale / in_f**0.5)

    def _zero_centred_norm(self, key: str, n: int) -> Maker:
        """Qwen3.5 RMSNorm weights are stored as w with the layer computing (1 + w)."""
        if self.spec.agreement is not None:
            return lambda: np.zeros(n, dtype=np.float32)
        return self._normal(key, (n,), self.spec.norm_jitter)

    def embeddings(self) -> np.ndarray:
        if self._emb is None:
            self._emb = embeddings(self.spec)
        return self._emb

    def release(self) -> None:
        self._emb = None

    # -- structure -------------------------------------------------------------------------
    def _add(self, name: str, shape: tuple[int, ...], make: Maker) -> None:
        self.tensors[name] = (shape, make)

    def _build(self) -> None:
        s = self.spec
        d = s.n_embd
        self._add("model.embed_tokens.weight", (s.n_vocab, d), self.embeddings)
        self._add("model.norm.weight", (d,), self._zero_centred_norm("model.norm.weight", d))
        if not s.tied_embeddings:
            if self.plan is not None:
                plan = self.plan
                head: Maker = lambda: plan.lm_head(s, self.embeddings())
            else:
                head = self._proj("lm_head.weight", s.n_vocab, d)
            self._add("lm_head.weight", (s.n_vocab, d), head)
        for il in range(s.n_layer):
            self._block(f"model.layers.{il}.", recurrent=s.layer_is_recurrent(il))
        if s.n_mtp:
            self._block("mtp.layers.0.", recurrent=False)
            if self.plan is not None:
                plan = self.plan
                fc: Maker = lambda: plan.fc(s)
            else:
                fc = self._proj("mtp.fc.weight", d, 2 * d)
            self._add("mtp.fc.weight", (d, 2 * d), fc)
            for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
                self._add(f"mtp.{n}.weight", (d,), self._zero_centred_norm(f"mtp.{n}.weight", d))

    def _block(self, p: str, recurrent: bool) -> None:
        s = self.spec
        d = s.n_embd
        self._add(p + "input_layernorm.weight", (d,),
                  self._zero_centred_norm(p + "input_layernorm.weight", d))
        self._add(p + "post_attention_layernorm.weight", (d,),
                  self._zero_centred_norm(p + "post_attention_layernorm.weight", d))
        if recurrent:
            self._gdn(p + "linear_attn.")
        else:
            self._attention(p + "self_attn.")
        if s.is_moe:
            self._moe(p + "mlp.")
        else:
            self._add(p + "mlp.gate_proj.weight", (s.n_ff, d),
                      self._proj(p + "mlp.gate_proj.weight", s.n_ff, d))
            self._add(p + "mlp.up_proj.weight", (s.n_ff, d),
                      self._proj(p + "mlp.up_proj.weight", s.n_ff, d))
            self._add(p + "mlp.down_proj.weight", (d, s.n_ff),
                      self._out_proj(p + "mlp.down_proj.weight", d, s.n_ff))

    def _attention(self, p: str) -> None:
        s = self.spec
        d, hd = s.n_embd, s.head_dim
        # q_proj rows are per head [q (hd), gate (hd)]: attn_output_gate = true
        self._add(p + "q_proj.weight", (2 * s.n_head * hd, d),
                  self._proj(p + "q_proj.weight", 2 * s.n_head * hd, d))
        self._add(p + "k_proj.weight", (s.n_head_kv * hd, d),
                  self._proj(p + "k_proj.weight", s.n_head_kv * hd, d))
        self._add(p + "v_proj.weight", (s.n_head_kv * hd, d),
                  self._proj(p + "v_proj.weight", s.n_head_kv * hd, d))
        self._add(p + "o_proj.weight", (d, s.n_head * hd),
                  self._out_proj(p + "o_proj.weight", d, s.n_head * hd))
        self._add(p + "q_norm.weight", (hd,), self._zero_centred_norm(p + "q_norm.weight", hd))
        self._add(p + "k_norm.weight", (hd,), self._zero_centred_norm(p + "k_norm.weight", hd))

    def _gdn(self, p: str) -> None:
        s = self.spec
        d = s.n_embd
        spec = self.spec

        def a_log() -> np.ndarray:
            # HF init: A ~ U(0, 16), A_log = log(A); keep away from 0
            a = rng_for(spec, self._key(p + "A_log")).uniform(1.0, 16.0, s.dt_rank).astype(
                np.float32)
            return np.log(a)

        def norm() -> np.ndarray:  # plain (not zero-centred) RMSNorm weight
            if spec.agreement is not None:
                return np.ones(s.d_state, dtype=np.float32)
            return 1.0 + self._normal(p + "norm.weight", (s.d_state,), spec.norm_jitter)()

        self._add(p + "in_proj_qkv.weight", (s.conv_dim, d),
                  self._proj(p + "in_proj_qkv.weight", s.conv_dim, d))
        self._add(p + "in_proj_z.weight", (s.value_dim, d),
                  self._proj(p + "in_proj_z.weight", s.value_dim, d))
        self._add(p + "in_proj_a.weight", (s.dt_rank, d),
                  self._proj(p + "in_proj_a.weight", s.dt_rank, d))
        self._add(p + "in_proj_b.weight", (s.dt_rank, d),
                  self._proj(p + "in_proj_b.weight", s.dt_rank, d))
        self._add(p + "A_log", (s.dt_rank,), a_log)
        self._add(p + "dt_bias", (s.dt_rank,), self._normal(p + "dt_bias", (s.dt_rank,), 0.5))
        self._add(p + "conv1d.weight", (s.conv_dim, 1, s.d_conv),
                  self._normal(p + "conv1d.weight", (s.conv_dim, 1, s.d_conv),
                               spec.weight_scale / s.d_conv**0.5))
        self._add(p + "norm.weight", (s.d_state,), norm)
        self._add(p + "out_proj.weight", (d, s.value_dim),
                  self._out_proj(p + "out_proj.weight", d, s.value_dim))

    def _moe(self, p: str) -> None:
        s = self.spec
        d, e, f, fs = s.n_embd, s.n_expert, s.n_ff_exp, s.n_ff_shexp
        self._add(p + "gate.weight", (e, d),
                  self._normal(p + "gate.weight", (e, d), s.router_scale / d**0.5))
        # fused expert layout (transformers >= 5 checkpoints); per-expert files convert the same
        self._add(p + "experts.gate_up_proj", (e, 2 * f, d),
                  self._normal(p + "experts.gate_up_proj", (e, 2 * f, d),
                               s.weight_scale / d**0.5))
        scale = s.agreement_out_scale if s.agreement is not None else s.out_scale
        self._add(p + "experts.down_proj", (e, d, f),
                  self._normal(p + "experts.down_proj", (e, d, f), scale / f**0.5))
        self._add(p + "shared_expert.gate_proj.weight", (fs, d),
                  self._proj(p + "shared_expert.gate_proj.weight", fs, d))
        self._add(p + "shared_expert.up_proj.weight", (fs, d),
                  self._proj(p + "shared_expert.up_proj.weight", fs, d))
        self._add(p + "shared_expert.down_proj.weight", (d, fs),
                  self._out_proj(p + "shared_expert.down_proj.weight", d, fs))
        self._add(p + "shared_expert_gate.weight", (1, d),
                  self._proj(p + "shared_expert_gate.weight", 1, d))


# --------------------------------------------------------------------------------------------
# The converter's tensor pipeline
# --------------------------------------------------------------------------------------------

def _reorder_v_heads(a: np.ndarray, axis: int, n_k: int, per_k: int, hd: int) -> np.ndarray:
    """Grouped-by-K-head V order [G0v0, G0v1, G1v0, ...] -> tiled [G0v0, G1v0, G0v1, ...]."""
    axis %= a.ndim
    shape = a.shape
    a = a.reshape(shape[:axis] + (n_k, per_k, hd) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def _filter_and_rename(name: str, spec: ModelSpec, part: Part) -> str | None:
    """``_QwenMtpMixin.filter_tensors``: drop by mode, move ``mtp.*`` to block N."""
    if name.startswith("mtp."):
        if part == "trunk":
            return None
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[1] == "layers":
            return f"model.layers.{spec.n_layer + int(parts[2])}.{parts[3]}"
        return f"model.layers.{spec.n_layer}.{_MTP_RENAME[parts[1]]}.{parts[2]}"
    if part == "mtp" and name not in ("model.embed_tokens.weight", "model.norm.weight",
                                      "lm_head.weight"):
        return None
    return name


def _modify(name: str, shape: tuple[int, ...], make: Maker,
            spec: ModelSpec) -> list[tuple[str, tuple[int, ...], Maker]]:
    """``modify_tensors`` of the Qwen3.5 class chain for one HF tensor (shape-aware, lazy)."""
    s = spec
    # _LinearAttentionVReorderBase: V heads grouped -> tiled (only when K heads != V heads)
    if s.n_group != s.dt_rank and "linear_attn." in name:
        n_k, per_k, hd = s.n_group, s.dt_rank // s.n_group, s.d_state
        inner = make
        if ".in_proj_qkv." in name:
            def make() -> np.ndarray:
                a = inner()
                qk = 2 * s.key_dim
                return np.concatenate([a[:qk], _reorder_v_heads(a[qk:], 0, n_k, per_k, hd)])
        elif ".in_proj_z." in name:
            def make() -> np.ndarray:
                return _reorder_v_heads(inner(), 0, n_k, per_k, hd)
        elif ".in_proj_a." in name or ".in_proj_b." in name or ".A_log" in name \
                or ".dt_bias" in name:
            def make() -> np.ndarray:
                return _reorder_v_heads(inner(), 0, n_k, per_k, 1)
        elif ".conv1d" in name:
            def make() -> np.ndarray:
                a = inner().squeeze()
                qk = 2 * s.key_dim
                return np.concatenate([a[:qk], _reorder_v_heads(a[qk:], 0, n_k, per_k, hd)])
        elif ".out_proj." in name:
            def make() -> np.ndarray:
                return _reorder_v_heads(inner(), 1, n_k, per_k, hd)
    # Qwen3NextModel.modify_tensors
    inner2 = make
    if name.endswith(".A_log"):
        def make() -> np.ndarray:
            return -np.exp(inner2())
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        shape = tuple(n for n in shape if n != 1)

        def make() -> np.ndarray:
            return inner2().squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        def make() -> np.ndarray:
            return inner2() + np.float32(1.0)
    # Qwen2MoeModel.modify_tensors: fused experts
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", shape, make)]
    if name.endswith("mlp.experts.gate_up_proj"):
        e, f2, d = shape
        f = f2 // 2
        base = name.removesuffix(".gate_up_proj")
        fused = make
        return [
            (base + ".gate_proj.weight", (e, f, d), lambda: np.ascontiguousarray(fused()[:, :f])),
            (base + ".up_proj.weight", (e, f, d), lambda: np.ascontiguousarray(fused()[:, f:])),
        ]
    return [(name, shape, make)]


def plan_tensors(spec: ModelSpec, part: Part) -> list[TensorEntry]:
    """The GGUF tensors of one file, in the converter's order, with lazy data."""
    hf = _HFModel(spec)
    entries: list[TensorEntry] = []
    for hf_name in sorted(hf.tensors):
        name = _filter_and_rename(hf_name, spec, part)
        if name is None:
            continue
        shape, make = hf.tensors[hf_name]
        for new_name, new_shape, new_make in _modify(name, shape, make, spec):
            g = gguf_name(new_name)
            entries.append(TensorEntry(g, new_shape, converter_qtype(g, new_shape, spec.dtype),
                                       new_make, _shared_name(g, spec)))
    return entries


def _shared_name(g: str, spec: ModelSpec) -> str:
    """The GGUF tensor whose data ``g`` repeats with ``spec.shared_layers`` ("" otherwise)."""
    if not spec.shared_layers or not g.startswith("blk."):
        return ""
    il, rest = g[len("blk."):].split(".", 1)
    return f"blk.{spec.weights_layer(int(il))}.{rest}" if int(il) < spec.n_layer else ""


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------

def _add_rope_scaling(w: GGUFWriter, rs: RopeScaling) -> None:
    """``rope_parameters`` scaling keys as ``TextModel.set_gguf_parameters`` writes them."""
    w.add_rope_scaling_type(RopeScalingType(rs.rope_type))
    if rs.rope_type == "longrope":
        return
    w.add_rope_scaling_factor(float(rs.factor))  # type: ignore[arg-type]
    if rs.rope_type != "yarn":
        return
    w.add_rope_scaling_orig_ctx_len(int(rs.original_max_position_embeddings))  # type: ignore
    for value, add in ((rs.extrapolation_factor, w.add_rope_scaling_yarn_ext_factor),
                       (rs.attention_factor, w.add_rope_scaling_yarn_attn_factor),
                       (rs.beta_fast, w.add_rope_scaling_yarn_beta_fast),
                       (rs.beta_slow, w.add_rope_scaling_yarn_beta_slow)):
        if value is not None:
            add(float(value))


def _add_metadata(w: GGUFWriter, spec: ModelSpec, part: Part) -> None:
    """KV pairs in the converter's order (general.architecture is added by GGUFWriter)."""
    s = spec
    arch = s.arch
    with_mtp = part != "trunk" and s.n_mtp > 0
    block_count = s.n_layer + (s.n_mtp if with_mtp else 0)

    # ModelBase.prepare_metadata: set_type, Metadata.set_gguf_meta_model
    w.add_type("model")
    w.add_name(s.model_name)
    total, shared, expert, n_exp = w.get_total_parameter_count()
    if total > 0:
        w.add_size_label(size_label(total, shared, expert, n_exp))

    # TextModel.set_gguf_parameters
    w.add_block_count(block_count)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    if s.n_ff > 0:
        w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    if s.rope_scaling is not None:  # opt-in: Qwen3.5's own configs have no scaling
        _add_rope_scaling(w, s.rope_scaling)
    w.add_array(f"{arch}.rope.dimension_sections", [int(x) for x in s.rope_sections])
    w.add_rope_freq_base(float(s.rope_theta))
    w.add_layer_norm_rms_eps(float(s.rms_eps))
    if s.is_moe:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_file_type(_FILE_TYPE[s.dtype])
    # Qwen2MoeModel
    if s.is_moe:
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    # _QwenMtpMixin (absent for --no-mtp)
    if with_mtp:
        w.add_nextn_predict_layers(s.n_mtp)
    # Qwen3NextModel
    w.add_ssm_conv_kernel(s.d_conv)
    w.add_ssm_state_size(s.d_state)
    w.add_ssm_group_count(s.n_group)
    w.add_ssm_time_step_rank(s.dt_rank)
    w.add_ssm_inner_size(s.value_dim)
    recurrent = [s.layer_is_recurrent(i) for i in range(s.n_layer)]
    recurrent += [False] * (block_count - s.n_layer)
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(s.full_attention_interval)
    w.add_rope_dimension_count(s.n_rot)
    # ModelBase.prepare_metadata
    w.add_quantization_version(GGML_QUANT_VERSION)

    # TextModel._set_vocab_gpt2 + SpecialVocab.add_to_gguf
    v = build_vocab(s.n_vocab, fim=s.fim_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.token_types))
    w.add_token_merges(list(v.merges))
    w.add_eos_token_id(v.eos_id)  # tokenizer_config.json eos_token
    w.add_pad_token_id(v.pad_id)  # tokenizer_config.json pad_token
    w.add_bos_token_id(v.bos_id)  # config.json text_config.bos_token_id
    w.add_add_bos_token(False)  # ByteLevel post-processor / add_bos_token: false
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


# --------------------------------------------------------------------------------------------
# Public writers
# --------------------------------------------------------------------------------------------

def _write(path: Path, spec: ModelSpec, part: Part,
           progress: Callable[[int, int], None] | None = None) -> Path:
    """``progress(done, total)`` is called after each tensor (tensor counts)."""
    entries = plan_tensors(spec, part)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        w = GGUFWriter(None, spec.arch)
        for e in entries:
            if e.qtype in (QT.F32, QT.F16):
                dt = np.dtype(np.float32 if e.qtype == QT.F32 else np.float16)
                w.add_tensor_info(e.name, e.shape, dt, int(np.prod(e.shape)) * dt.itemsize,
                                  raw_dtype=e.qtype)
            else:
                bshape = quants.quant_shape_to_byte_shape(e.shape, e.qtype)
                w.add_tensor_info(e.name, bshape, np.dtype(np.uint8), int(np.prod(bshape)),
                                  raw_dtype=e.qtype)
        _add_metadata(w, spec, part)
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        shared: dict[str, np.ndarray] = {}  # shared_layers: each repeated tensor's data
        for i, e in enumerate(entries):
            if e.share:
                data = shared.get(e.share)
                if data is None:
                    data = shared[e.share] = e.data()
            else:
                data = e.data()
            w.write_tensor_data(data)
            if progress is not None:
                progress(i + 1, len(entries))
        w.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def default_stem(spec: ModelSpec) -> str:
    """``<name>-<OUTTYPE>``, like the converter's default file name."""
    return f"{spec.model_name}-{spec.dtype.upper()}"


def write_model(path: str | os.PathLike[str], spec: ModelSpec,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """One GGUF: trunk + grafted MTP block (``spec.mtp == "grafted"``, the converter's default)
    or trunk only (``"none"``, the ``--no-mtp`` layout: no ``nextn_predict_layers`` key)."""
    return _write(Path(path), spec, "full" if spec.mtp == "grafted" else "trunk", progress)


def write_split(directory: str | os.PathLike[str], spec: ModelSpec) -> tuple[Path, Path]:
    """Trunk-only file (``--no-mtp``) and MTP-only file (``--mtp``, named ``mtp-<stem>.gguf``).

    The MTP-only file carries the full model's metadata (vocab, block_count = N + 1,
    nextn_predict_layers = 1, the whole recurrent-layers array) and only ``token_embd``,
    ``output_norm``, ``output`` (untied) and ``blk.N.*``.
    """
    if spec.n_mtp == 0:
        raise ValueError("write_split needs a spec with an MTP head (mtp='grafted')")
    d = Path(directory)
    stem = default_stem(spec)
    trunk = _write(d / f"{stem}.gguf", spec, "trunk")
    mtp = _write(d / f"mtp-{stem}.gguf", spec, "mtp")
    return trunk, mtp


def cached_model(
    spec: ModelSpec, cache_dir: str | os.PathLike[str], layout: Literal["model", "split"] = "model",
    progress: Callable[[int, int], None] | None = None,
) -> Path | tuple[Path, Path]:
    """Write once per (spec, layout) into ``cache_dir/<digest>/`` and reuse afterwards."""
    d = Path(cache_dir) / f"{spec.digest()}-{layout}"
    stem = default_stem(spec)
    if layout == "split":
        trunk, mtp = d / f"{stem}.gguf", d / f"mtp-{stem}.gguf"
        if trunk.exists() and mtp.exists():
            return trunk, mtp
        return write_split(d, spec)
    path = d / f"{stem}.gguf"
    if path.exists():
        return path
    return write_model(path, spec, progress)
