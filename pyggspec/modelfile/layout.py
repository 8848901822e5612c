"""The tensors a ``qwen35`` / ``qwen35moe`` GGUF must hold, and the check against a file.

Mirrors ``load_arch_tensors`` (src/models/qwen35.cpp, qwen35moe.cpp) and the helpers
``create_tensor_qkv`` / ``create_tensor_gate_up_exps`` (src/llama-model.cpp): which tensors are
required, which are optional, which alternatives exclude each other, and each shape in ggml
order. Deliberate differences from llama.cpp, each safer than an abort later:

* GDN ``attn_qkv`` / ``attn_gate`` are "not required" in llama.cpp's loader but its graph
  dereferences them, so we require them.
* Tensors that ggml's CPU kernels consume only as f32 (norm weights, biases, ``ssm_a`` through
  ``ggml_mul``/``ggml_add``; ``ssm_conv1d`` through ``ggml_ssm_conv``) must be f32; llama.cpp
  loads other types and then aborts in the compute.
* A file declaring an MTP block that holds none of its tensors is accepted as trunk-only with a
  warning (llama.cpp refuses it: "tensor 'blk.N.attn_norm.weight' not found").
* Tensors nothing reads are reported as warnings (llama.cpp refuses such a file with "wrong
  number of tensors").
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from pyggspec.modelfile.gguf import TensorInfo
from pyggspec.modelfile.hparams import HParams

F32_ONLY_REASON = "ggml's CPU kernel for its op takes only f32"
# ggml types with no CPU dot product (ggml-cpu.c type_traits_cpu: no vec_dot): a weight of
# one of these crashes the matrix multiply instead of failing cleanly
NO_COMPUTE_TYPES = frozenset({"q8_1", "q8_K", "i8", "i16", "i32", "i64", "f64"})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the model can use: name, expected ``ne`` (ggml order), flags."""

    name: str
    ne: tuple[int, ...]
    required: bool = True
    f32_only: bool = False
    block: int = -1  # -1: input/output tensors, else the blk index

    @property
    def ne4(self) -> tuple[int, int, int, int]:
        return tuple(self.ne) + (1,) * (4 - len(self.ne))  # type: ignore[return-value]


@dataclass(frozen=True)
class ValidationReport:
    """Outcome of checking a file against its hparams. ``errors`` empty means it loads."""

    errors: tuple[str, ...]
    warnings: tuple[str, ...]
    unused: tuple[str, ...]  # present tensors nothing reads
    expected: tuple[TensorSpec, ...] = field(repr=False)

    @property
    def ok(self) -> bool:
        return not self.errors


def _is_f32_only(name: str) -> bool:
    return (name.endswith(("norm.weight", ".bias", ".ssm_a", "ssm_conv1d.weight")))


class _Builder:
    def __init__(self, present: Container[str]) -> None:
        self.present = present
        self.specs: list[TensorSpec] = []

    def add(self, name: str, ne: tuple[int, ...], required: bool = True, block: int = -1) -> bool:
        self.specs.append(TensorSpec(name, ne, required, _is_f32_only(name), block))
        return name in self.present

    def scales(self, base: str, block: int, n: int = 1) -> None:
        """Optional NVFP4/FP8 ``.scale`` / ``.input_scale`` companions (llama.cpp generic pass)."""
        if base + ".weight" in self.present:
            self.add(base + ".scale", (n,), False, block)
            self.add(base + ".input_scale", (n,), False, block)


def expected_tensors(hp: HParams, n_vocab: int, present: Container[str],
                     mtp_only: bool = False, include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor llama.cpp would create for this file, alternatives resolved by presence.

    ``mtp_only`` makes the trunk blocks optional (an MTP sidecar file); ``include_mtp`` adds
    the MTP blocks (set False when their tensors are known to be absent).
    """
    b = _Builder(present)
    E, V = hp.n_embd, n_vocab
    b.add("token_embd.weight", (E, V))
    b.add("output_norm.weight", (E,))
    if b.add("output.weight", (E, V), required=False):
        b.scales("output", -1)
    trunk_req = not mtp_only
    for il in range(hp.n_layer):
        _block(b, hp, V, il, trunk_req, mtp=False)
    if include_mtp:
        for il in hp.mtp_blocks:
            _block(b, hp, V, il, True, mtp=True)
    return b.specs


def _block(b: _Builder, hp: HParams, V: int, il: int, req: bool, mtp: bool) -> None:
    E = hp.n_embd
    p = f"blk.{il}."

    def add(name: str, ne: tuple[int, ...], required: bool = req) -> bool:
        return b.add(p + name, ne, required, il)

    def scales(base: str, n: int = 1) -> None:
        b.scales(p + base, il, n)

    add("attn_norm.weight", (E,))
    add("post_attention_norm.weight", (E,))
    if mtp or not hp.is_recurrent(il):
        hd, nh = hp.n_embd_head_k, hp.n_head
        nq, nk, nv = hd * nh * 2, hp.n_embd_k_gqa, hp.n_embd_v_gqa
        if add("attn_qkv.weight", (E, nq + nk + nv), required=False):
            scales("attn_qkv")
            if not add("attn_qkv.bias", (nq + nk + nv,), required=False):
                for n, w in (("q", nq), ("k", nk), ("v", nv)):
                    add(f"attn_{n}.bias", (w,), required=False)
        else:
            for n, w in (("q", nq), ("k", nk), ("v", nv)):
                add(f"attn_{n}.weight", (E, w))
                scales(f"attn_{n}")
            for n, w in (("q", nq), ("k", nk), ("v", nv)):
                add(f"attn_{n}.bias", (w,), required=False)
        add("attn_output.weight", (hd * nh, E))
        scales("attn_output")
        add("attn_q_norm.weight", (hd,))
        add("attn_k_norm.weight", (hd,))
    else:
        add("attn_qkv.weight", (E, hp.conv_dim))
        scales("attn_qkv")
        add("attn_gate.weight", (E, hp.value_dim))
        scales("attn_gate")
        add("ssm_conv1d.weight", (hp.ssm_d_conv, hp.conv_dim))
        add("ssm_dt.bias", (hp.ssm_dt_rank,))
        add("ssm_a", (hp.ssm_dt_rank,))
        add("ssm_beta.weight", (E, hp.ssm_dt_rank))
        scales("ssm_beta")
        add("ssm_alpha.weight", (E, hp.ssm_dt_rank))
        scales("ssm_alpha")
        add("ssm_norm.weight", (hp.head_v_dim,))
        add("ssm_out.weight", (hp.value_dim, E))
        scales("ssm_out")

    if hp.is_moe:
        X, F, S = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
        add("ffn_gate_inp.weight", (E, X))
        add("ffn_down_exps.weight", (F, E, X))
        scales("ffn_down_exps", X)
        if not add("ffn_gate_up_exps.weight", (E, 2 * F, X), required=False):
            add("ffn_gate_exps.weight", (E, F, X))
            add("ffn_up_exps.weight", (E, F, X))
            scales("ffn_gate_exps", X)
            scales("ffn_up_exps", X)
        add("ffn_gate_inp_shexp.weight", (E,))
        for n, ne in (("gate", (E, S)), ("up", (E, S)), ("down", (S, E))):
            add(f"ffn_{n}_shexp.weight", ne)
            scales(f"ffn_{n}_shexp")
    else:
        F = hp.n_ff
        for n, ne in (("gate", (E, F)), ("down", (F, E)), ("up", (E, F))):
            add(f"ffn_{n}.weight", ne)
            scales(f"ffn_{n}")

    if mtp:
        add("nextn.eh_proj.weight", (2 * E, E))
        scales("nextn.eh_proj")
        add("nextn.enorm.weight", (E,))
        add("nextn.hnorm.weight", (E,))
        add("nextn.embed_tokens.weight", (E, V), required=False)
        if add("nextn.shared_head_head.weight", (E, V), required=False):
            scales("nextn.shared_head_head")
        add("nextn.shared_head_norm.weight", (E,), required=False)


def hparams_errors(hp: HParams) -> list[str]:
    """Values ggml asserts on deep inside a kernel (an abort of the whole process there), so
    they are refused with the file's name first. llama.cpp loads such files and then aborts.
    """
    errors: list[str] = []
    a = hp.arch
    i32 = 2**31 - 1
    for key, v, lo in (("context_length", hp.n_ctx_train, 1),
                       ("rope.scaling.original_context_length", hp.n_ctx_orig_yarn, 0)):
        if not lo <= v <= i32:  # ggml takes it as an int32 op parameter
            errors.append(f"{a}.{key} = {v} must be in {lo}..{i32}")
    if not (math.isfinite(hp.rms_eps) and hp.rms_eps >= 0):  # ggml_rms_norm asserts eps >= 0
        errors.append(f"{a}.attention.layer_norm_rms_epsilon = {hp.rms_eps} must be a "
                      "finite number >= 0")
    if not (math.isfinite(hp.rope_freq_base) and hp.rope_freq_base > 0):
        errors.append(f"{a}.rope.freq_base = {hp.rope_freq_base} must be a finite number > 0")
    if hp.n_rot % 2:
        errors.append(f"{a}.rope.dimension_count = {hp.n_rot} must be even (ggml rotates "
                      "pairs of dimensions)")
    sec = hp.rope_sections
    if min(sec) < 0 or not 0 < sum(sec) <= hp.n_embd_head_k:
        errors.append(f"{a}.rope.dimension_sections = {list(sec)}: each must be >= 0 and "
                      f"their sum in 1..{hp.n_embd_head_k} (head size) for ggml's "
                      "multi-section rope")
    return errors


def fmt_shape(ne: tuple[int, ...]) -> str:
    """llama.cpp's shape style: ``[2048, 151936]`` (trailing 1-dims dropped)."""
    dims = list(ne)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_tensors(specs: list[TensorSpec], tensors: Mapping[str, TensorInfo]) -> tuple[
        list[str], list[str]]:
    """Presence, shape and type of every spec; returns (errors, unused tensor names)."""
    errors: list[str] = []
    known: set[str] = set()
    for s in specs:
        known.add(s.name)
        t = tensors.get(s.name)
        if t is None:
            if s.required:
                errors.append(f"missing tensor '{s.name}' (expected shape {fmt_shape(s.ne)})")
            continue
        if t.ne != s.ne4:
            errors.append(f"tensor '{s.name}' has wrong shape: expected {fmt_shape(s.ne)}, "
                          f"got {fmt_shape(t.ne)}")
            continue
        if t.type.name in NO_COMPUTE_TYPES:
            errors.append(f"tensor '{s.name}' has type {t.type.name}, which ggml's CPU "
                          "backend cannot multiply or read rows from")
            continue
        if s.f32_only and t.type.name != "f32":
            errors.append(f"tensor '{s.name}' must be f32 ({F32_ONLY_REASON}), "
                          f"got {t.type.name}")
    unused = [n for n in tensors if n not in known]
    return errors, unused
