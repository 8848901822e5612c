"""Hyper-parameters of a ``qwen35`` / ``qwen35moe`` GGUF, read the way llama.cpp reads them.

Sources: ``llama_model_base::load_hparams`` (src/llama-model.cpp) for the generic keys and
``load_arch_hparams`` in src/models/qwen35.cpp / qwen35moe.cpp for the arch keys. Per-layer
keys (head counts, FFN sizes, experts used) may be a scalar or an array of ``block_count``
entries; we always store the expanded tuple. Tensor shapes use the layer-0 value, exactly as
llama.cpp's loaders do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyggspec.errors import ModelFileError
from pyggspec.modelfile import rope as _rope
from pyggspec.modelfile.gguf import GGUFFile
from pyggspec.modelfile.rope import RopeParams

SUPPORTED_ARCHS = ("qwen35", "qwen35moe")
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = _rope.SCALING_TYPES

# n_layer (trunk) -> llama.cpp's size label (llama_model_qwen35[moe]::load_arch_hparams)
_DENSE_TYPES = {24: ("0.8B", "2B", 1024), 32: ("4B", "9B", 2560), 64: ("27B", "27B", 0)}
_MOE_TYPES = {40: "35B-A3B", 48: "122B-A10B", 60: "397B-A17B"}


@dataclass(frozen=True)
class HParams:
    """Everything llama.cpp reads from the metadata for these two archs (resolved defaults)."""

    arch: str
    n_ctx_train: int
    n_embd: int
    n_embd_out_impl: int  # 0 = absent (then n_embd_out == n_embd)
    n_layer_all: int  # block_count: trunk + MTP blocks
    n_layer_nextn: int
    n_expert: int
    n_expert_used_arr: tuple[int, ...]
    n_ff_arr: tuple[int, ...]
    n_head_arr: tuple[int, ...]
    n_head_kv_arr: tuple[int, ...]
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    rope_freq_base: float
    rope_scaling_type: str
    rope_freq_scale: float  # 1 / rope.scaling.factor (1.0 when absent)
    rope_attn_factor: float  # rope.scaling.attn_factor (1.0 when absent)
    n_ctx_orig_yarn: int
    rope_finetuned: bool
    rope_sections: tuple[int, int, int, int]
    rms_eps: float
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_dt_rank: int
    ssm_n_group: int
    recurrent_arr: tuple[bool, ...]  # is_recr per block, n_layer_all entries
    recurrent_from: str  # "array" (attention.recurrent_layers) or "interval"
    full_attention_interval: int
    n_ff_exp_arr: tuple[int, ...]  # 0 = absent
    n_ff_shexp_impl: int  # 0 = absent

    # -- derived ---------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        """Trunk layers (llama.cpp ``n_layer()``): block_count minus the MTP blocks."""
        return self.n_layer_all - self.n_layer_nextn

    @property
    def rope(self) -> RopeParams:
        """The rope arguments llama.cpp's context derives from these keys (YaRN included)."""
        return _rope.resolve(self.rope_scaling_type, self.rope_freq_base, self.rope_freq_scale,
                             self.rope_attn_factor, self.n_ctx_orig_yarn or self.n_ctx_train)

    @property
    def n_embd_out(self) -> int:
        return self.n_embd_out_impl or self.n_embd

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def n_head(self) -> int:
        return self.n_head_arr[0]

    @property
    def n_head_kv(self) -> int:
        return self.n_head_kv_arr[0]

    @property
    def n_ff(self) -> int:
        return self.n_ff_arr[0]

    @property
    def n_expert_used(self) -> int:
        return self.n_expert_used_arr[0]

    @property
    def head_dim(self) -> int:
        return self.n_embd_head_k

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    @property
    def n_ff_exp(self) -> int:
        """Expert FFN width; llama.cpp falls back to ``n_ff / n_expert_used``."""
        if self.n_ff_exp_arr[0]:
            return self.n_ff_exp_arr[0]
        return self.n_ff // self.n_expert_used if self.n_expert_used else 0

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_shexp_impl or self.n_ff

    # gated delta net: the loader uses d_state as both head_k_dim and head_v_dim
    @property
    def head_k_dim(self) -> int:
        return self.ssm_d_state

    @property
    def head_v_dim(self) -> int:
        return self.ssm_d_state

    @property
    def key_dim(self) -> int:
        return self.ssm_d_state * self.ssm_n_group

    @property
    def value_dim(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def n_embd_r(self) -> int:
        """Conv-state floats per GDN layer per sequence: (d_conv-1) * (d_inner + 2*G*S)."""
        return (max(self.ssm_d_conv, 1) - 1) * (
            self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state
        )

    @property
    def n_embd_s(self) -> int:
        """SSM-state floats per GDN layer per sequence: d_state * d_inner."""
        return self.ssm_d_state * self.ssm_d_inner

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_arr[il])

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """"recurrent" / "attention" for each trunk layer."""
        return tuple(
            "recurrent" if self.recurrent_arr[i] else "attention" for i in range(self.n_layer)
        )

    @property
    def n_recurrent_layers(self) -> int:
        return sum(1 for i in range(self.n_layer) if self.recurrent_arr[i])

    @property
    def n_attention_layers(self) -> int:
        return self.n_layer - self.n_recurrent_layers

    @property
    def mtp_blocks(self) -> range:
        return range(self.n_layer, self.n_layer_all)

    @property
    def model_type(self) -> str:
        """llama.cpp's size label, or "?" for shapes it does not recognise."""
        if self.is_moe:
            return _MOE_TYPES.get(self.n_layer, "?")
        t = _DENSE_TYPES.get(self.n_layer)
        if t is None:
            return "?"
        return t[0] if (t[2] == 0 or self.n_embd == t[2]) else t[1]

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> HParams:
        """Read and check the hyper-parameters; ModelFileError names the offending key."""
        return _read(f)


class _Keys:
    """Typed metadata access with llama.cpp's required/optional semantics."""

    def __init__(self, f: GGUFFile, arch: str) -> None:
        self.f = f
        self.arch = arch
        self.path: Path = f.path

    def err(self, msg: str) -> ModelFileError:
        return ModelFileError(self.path, msg)

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def scalar(self, suffix: str, kind: Callable[[Any], Any], default: Any = None,
               required: bool = False) -> Any:
        k = self.key(suffix)
        kv = self.f.metadata.get(k)
        if kv is None:
            if required:
                raise self.err(f"missing required metadata key '{k}'")
            return default
        if kv.type.startswith("array"):
            raise self.err(f"metadata '{k}' must be a single value, found {kv.type}")
        return _convert(self, k, kv.type, kv.value, kind)

    def per_layer(self, suffix: str, n: int, kind: Callable[[Any], Any], default: Any,
                  required: bool = False) -> tuple[tuple[Any, ...], bool]:
        """llama.cpp ``get_key_or_arr``: scalar broadcast to n entries, or an array of exactly n."""
        k = self.key(suffix)
        kv = self.f.metadata.get(k)
        if kv is None:
            if required:
                raise self.err(f"missing required metadata key '{k}'")
            return (default,) * n, False
        if kv.type.startswith("array"):
            vals = list(kv.value)
            if len(vals) != n:
                raise self.err(f"metadata '{k}' has {len(vals)} entries, expected {n}")
            elem = kv.type[6:-1]
            return tuple(_convert(self, k, elem, v, kind) for v in vals), True
        v = _convert(self, k, kv.type, kv.value, kind)
        return (v,) * n, True


_INT_TYPES = {"u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"}
_FLOAT_TYPES = {"f32", "f64"}


def _convert(keys: _Keys, key: str, gtype: str, value: Any, kind: Callable[[Any], Any]) -> Any:
    if kind is int and (gtype in _INT_TYPES or gtype == "bool"):
        return int(value)
    if kind is float and (gtype in _FLOAT_TYPES or gtype in _INT_TYPES):
        return float(value)
    if kind is bool and (gtype == "bool" or gtype in _INT_TYPES):
        return bool(value)
    if kind is str and gtype == "string":
        return str(value)
    raise keys.err(f"metadata '{key}' has type {gtype}, expected {kind.__name__}")


def _check_rope_scaling(k: _Keys, scaling: str, freq_scale: float, attn_factor: float) -> None:
    """Refuse rope scaling we do not run exactly as written (see ``modelfile.rope``)."""
    if scaling not in _rope.SCALING_IMPLEMENTED:
        raise k.err(f"{k.arch}.rope.scaling.type = '{scaling}' is not supported (pyggspec "
                    f"implements {', '.join(_rope.SCALING_IMPLEMENTED)}; llama.cpp's qwen35 "
                    "graph would run it without its long/short rope factors)")
    for suffix, want in _rope.unread_key_values(scaling, freq_scale, attn_factor).items():
        got = k.scalar(suffix, float, None)
        if got is not None and not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6):
            raise k.err(f"{k.arch}.{suffix} = {got:g} is not supported with rope.scaling.type "
                        f"'{scaling}': llama.cpp's qwen35 loader ignores this key and runs "
                        f"{want:g}, so the file would not run as it says")


def _read(f: GGUFFile) -> HParams:
    arch_kv = f.metadata.get("general.architecture")
    if arch_kv is None:
        raise ModelFileError(f.path, "missing required metadata key 'general.architecture'")
    arch = str(arch_kv.value)
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(
            f.path, f"unsupported architecture '{arch}' (pyggspec runs qwen35 and qwen35moe)"
        )
    k = _Keys(f, arch)

    n_ctx_train = k.scalar("context_length", int, required=True)
    n_embd = k.scalar("embedding_length", int, required=True)
    n_embd_out_impl = k.scalar("embedding_length_out", int, 0)
    n_all = k.scalar("block_count", int, required=True)
    if not 0 < n_all <= LLAMA_MAX_LAYERS:
        raise k.err(f"{arch}.block_count = {n_all} is outside 1..{LLAMA_MAX_LAYERS}")
    n_nextn = k.scalar("nextn_predict_layers", int, 0)
    if n_nextn >= n_all:
        raise k.err(f"{arch}.nextn_predict_layers = {n_nextn} leaves no trunk layers "
                    f"(block_count = {n_all})")
    if n_nextn > 1:
        raise k.err(f"{arch}.nextn_predict_layers = {n_nextn}: only one MTP block is supported "
                    "(llama.cpp's qwen35 graphs assert the same)")
    n_expert = k.scalar("expert_count", int, 0)
    n_expert_used, _ = k.per_layer("expert_used_count", n_all, int, 0)
    used_max = max(n_expert_used)
    if n_expert > LLAMA_MAX_EXPERTS:
        raise k.err(f"{arch}.expert_count = {n_expert} exceeds {LLAMA_MAX_EXPERTS}")
    if used_max > n_expert:
        raise k.err(f"{arch}.expert_used_count = {used_max} exceeds expert_count = {n_expert}")
    if n_expert > 0 and used_max == 0:
        raise k.err(f"{arch}.expert_count = {n_expert} but expert_used_count is 0")
    if arch == "qwen35moe" and n_expert == 0:
        raise k.err(f"missing required metadata key '{arch}.expert_count' (MoE needs experts)")

    n_ff, _ = k.per_layer("feed_forward_length", n_all, int, 0)
    n_head, _ = k.per_layer("attention.head_count", n_all, int, 0)
    n_head_kv, has_kv = k.per_layer("attention.head_count_kv", n_all, int, 0)
    if not has_kv:
        n_head_kv = n_head
    if n_head[0] <= 0:
        raise k.err(f"missing required metadata key '{arch}.attention.head_count'")
    if n_head_kv[0] <= 0:
        raise k.err(f"{arch}.attention.head_count_kv must be > 0")

    rope_finetuned = k.scalar("rope.scaling.finetuned", bool, False)
    n_ctx_orig = k.scalar("rope.scaling.original_context_length", int, n_ctx_train)
    freq_base = k.scalar("rope.freq_base", float, 10000.0)
    scaling = k.scalar("rope.scaling.type", str, "linear")
    if scaling not in ROPE_SCALING_TYPES:
        raise k.err(f"{arch}.rope.scaling.type '{scaling}' is not one of "
                    f"{', '.join(ROPE_SCALING_TYPES)}")
    factor = k.scalar("rope.scaling.factor", float, None)
    if factor is None:
        factor = k.scalar("rope.scale_linear", float, 0.0)
    if not (math.isfinite(factor) and factor >= 0.0):
        raise k.err(f"{arch}.rope.scaling.factor = {factor:g} must be a finite number >= 0")
    freq_scale = 1.0 if factor == 0.0 else 1.0 / factor
    attn_factor = k.scalar("rope.scaling.attn_factor", float, 1.0)
    _check_rope_scaling(k, scaling, freq_scale, attn_factor)

    hd_k = k.scalar("attention.key_length", int, n_embd // n_head[0])
    hd_v = k.scalar("attention.value_length", int, n_embd // n_head[0])
    n_rot = k.scalar("rope.dimension_count", int, hd_k)
    if hd_k <= 0 or hd_v <= 0:
        raise k.err(f"{arch}.attention.key_length/value_length must be > 0")
    if not 0 < n_rot <= hd_k:
        raise k.err(f"{arch}.rope.dimension_count = {n_rot} must be in 1..{hd_k} (head size)")

    # arch part
    n_ff_exp = (0,) * n_all
    n_ff_shexp = 0
    if arch == "qwen35moe":
        n_ff_exp, _ = k.per_layer("expert_feed_forward_length", n_all, int, 0)
        n_ff_shexp = k.scalar("expert_shared_feed_forward_length", int, 0)
    rms_eps = k.scalar("attention.layer_norm_rms_epsilon", float, required=True)
    sections, _ = k.per_layer("rope.dimension_sections", 4, int, 0, required=True)
    d_conv = k.scalar("ssm.conv_kernel", int, required=True)
    d_inner = k.scalar("ssm.inner_size", int, required=True)
    d_state = k.scalar("ssm.state_size", int, required=True)
    dt_rank = k.scalar("ssm.time_step_rank", int, required=True)
    n_group = k.scalar("ssm.group_count", int, required=True)
    for name, v in (("ssm.conv_kernel", d_conv), ("ssm.inner_size", d_inner),
                    ("ssm.state_size", d_state), ("ssm.time_step_rank", dt_rank),
                    ("ssm.group_count", n_group)):
        if v <= 0:
            raise k.err(f"{arch}.{name} must be > 0, is {v}")
    if d_inner != d_state * dt_rank:
        raise k.err(f"{arch}.ssm.inner_size = {d_inner} but state_size * time_step_rank = "
                    f"{d_state * dt_rank} (llama.cpp assumes head_v_dim == head_k_dim)")
    if dt_rank % n_group:
        raise k.err(f"{arch}.ssm.time_step_rank = {dt_rank} is not a multiple of "
                    f"ssm.group_count = {n_group}")

    interval = k.scalar("full_attention_interval", int, 4)
    recr, has_arr = k.per_layer("attention.recurrent_layers", n_all, bool, False)
    n_layer = n_all - n_nextn
    if not has_arr:
        if interval <= 0:
            raise k.err(f"{arch}.full_attention_interval must be > 0, is {interval}")
        recr = tuple(i < n_layer and (i + 1) % interval != 0 for i in range(n_all))
    if arch == "qwen35moe" and n_ff_exp[0] == 0 and n_ff[0] == 0:
        raise k.err(f"missing required metadata key '{arch}.expert_feed_forward_length' "
                    "(and no feed_forward_length to derive it from)")
    if arch == "qwen35" and n_ff[0] <= 0:
        raise k.err(f"missing required metadata key '{arch}.feed_forward_length'")

    return HParams(
        arch=arch, n_ctx_train=n_ctx_train, n_embd=n_embd, n_embd_out_impl=n_embd_out_impl,
        n_layer_all=n_all, n_layer_nextn=n_nextn, n_expert=n_expert,
        n_expert_used_arr=n_expert_used, n_ff_arr=n_ff, n_head_arr=n_head,
        n_head_kv_arr=n_head_kv, n_embd_head_k=hd_k, n_embd_head_v=hd_v, n_rot=n_rot,
        rope_freq_base=freq_base, rope_scaling_type=scaling, rope_freq_scale=freq_scale,
        rope_attn_factor=attn_factor, n_ctx_orig_yarn=n_ctx_orig, rope_finetuned=rope_finetuned,
        rope_sections=tuple(sections),  # type: ignore[arg-type]
        rms_eps=rms_eps, ssm_d_conv=d_conv, ssm_d_inner=d_inner, ssm_d_state=d_state,
        ssm_dt_rank=dt_rank, ssm_n_group=n_group, recurrent_arr=tuple(bool(x) for x in recr),
        recurrent_from="array" if has_arr else "interval", full_attention_interval=interval,
        n_ff_exp_arr=n_ff_exp, n_ff_shexp_impl=n_ff_shexp,
    )
