"""What a generated test model looks like: one frozen dataclass plus presets.

A :class:`ModelSpec` holds the numbers a HF ``config.json`` would hold for a Qwen3.5 text model
(under GGUF-ish names) plus the knobs of our random initialisation. Everything the writer does
is a pure function of the spec, so ``spec.digest()`` names a file's content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["qwen35", "qwen35moe"]
MtpLayout = Literal["grafted", "none"]
# f32/f16/q8_0: the converter's out types; q4_0/q4_k/iq4_xs: what llama-quantize makes
# of the same model (the converter cannot write them)
DType = Literal["f32", "f16", "q8_0", "q4_0", "q4_k", "iq4_xs"]
RopeType = Literal["linear", "yarn", "longrope"]

# Bump when the bytes written for a given spec change (invalidates cached_model files).
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class RopeScaling:
    """HF ``rope_parameters`` scaling entries; written only when a spec asks for them.

    The converter (``TextModel.set_gguf_parameters``) writes: linear -> type + factor; yarn ->
    type + factor + original_context_length, plus yarn_ext_factor / yarn_attn_factor /
    yarn_beta_fast / yarn_beta_slow for the optional entries given here; longrope -> type only.
    """

    rope_type: RopeType
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    extrapolation_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "yarn", "longrope"):
            raise ValueError(f"RopeScaling: unknown rope_type {self.rope_type!r}")
        if self.rope_type != "longrope" and self.factor is None:
            raise ValueError(f"RopeScaling: {self.rope_type} needs a factor")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("RopeScaling: yarn needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """Shape, layout and initialisation of one generated model.

    Field names follow llama.cpp's hparams. ``n_layer`` counts trunk blocks only; the MTP block
    (if any) is block ``n_layer``. ``n_group`` = GDN K heads (HF ``linear_num_key_heads``),
    ``dt_rank`` = GDN V heads (HF ``linear_num_value_heads``), ``d_state`` = GDN head dim.
    """

    arch: Arch = "qwen35"
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 128
    d_conv: int = 4
    d_state: int = 32
    n_group: int = 2
    dt_rank: int = 4
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_vocab: int = 1024
    full_attention_interval: int = 2
    partial_rotary_factor: float = 0.25
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)
    rope_theta: float = 10_000_000.0
    context_length: int = 4096
    rope_scaling: RopeScaling | None = None  # None: no rope.scaling.* keys (Qwen3.5's default)
    rms_eps: float = 1e-6
    tied_embeddings: bool = False
    mtp: MtpLayout = "grafted"
    dtype: DType = "f32"
    seed: int = 0
    # constructed-agreement MTP (DESIGN §5): target MTP/target top-1 agreement rate, or None
    agreement: float | None = None
    # --- initialisation knobs (random models) ---
    embed_std: float = 1.0  # token embedding std; the residual stream starts at unit scale
    weight_scale: float = 1.0  # input projections: std = weight_scale / sqrt(fan_in)
    out_scale: float = 0.25  # output projections (o_proj, out_proj, down): keeps layers small
    norm_jitter: float = 0.1  # std of the zero-centred HF norm weights (GGUF stores 1 + w)
    router_scale: float = 3.0  # MoE router std * sqrt(n_embd): wide top-k margins
    # --- constructed-agreement knobs ---
    agreement_out_scale: float = 0.01  # output projections of trunk and MTP layers
    logit_scale: float = 20.0  # LM-head logit of the intended next token
    name: str = ""
    # Qwen's fill-in-the-middle tokens (<|fim_prefix|> ...) after the chat tokens (/infill)
    fim_tokens: bool = False
    # benchmark models of 27B-35B parameters (scripts/gpu_check): every trunk layer of a
    # kind (gated delta net / full attention) gets the weights of the first layer of that
    # kind, sampled and quantized once, written at every layer's own offset (the engines
    # still read each layer's own bytes: decoding speed is that of distinct weights). The
    # MTP block, embeddings and LM head stay as without it.
    shared_layers: bool = False

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"ModelSpec: {msg}")

        if self.arch not in ("qwen35", "qwen35moe"):
            bad(f"arch must be qwen35 or qwen35moe, not {self.arch!r}")
        if self.mtp not in ("grafted", "none"):
            bad(f"mtp must be 'grafted' or 'none' (use write_split for the MTP-only file), "
                f"not {self.mtp!r}")
        if self.dtype not in ("f32", "f16", "q8_0", "q4_0", "q4_k", "iq4_xs"):
            bad(f"dtype must be f32, f16, q8_0, q4_0, q4_k or iq4_xs, not {self.dtype!r}")
        if self.n_head % self.n_head_kv:
            bad("n_head must be a multiple of n_head_kv")
        if self.dt_rank % self.n_group:
            bad("dt_rank (V heads) must be a multiple of n_group (K heads)")
        if len(self.rope_sections) != 4:
            bad("rope_sections needs 4 ints")
        if sum(self.rope_sections) * 2 != self.n_rot:
            bad(f"rope_sections {self.rope_sections} must sum to n_rot/2 = {self.n_rot // 2}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            bad(f"n_rot={self.n_rot} must be even and <= head_dim")
        if self.arch == "qwen35moe":
            if not (0 < self.n_expert_used <= self.n_expert):
                bad("qwen35moe needs 0 < n_expert_used <= n_expert")
            if self.n_ff_exp <= 0 or self.n_ff_shexp <= 0:
                bad("qwen35moe needs n_ff_exp and n_ff_shexp")
        elif self.n_expert or self.n_expert_used:
            bad("qwen35 (dense) must have n_expert = n_expert_used = 0")
        if not any(self.layer_is_recurrent(i) for i in range(self.n_layer)):
            bad("need at least one gated-delta-net layer")
        if all(self.layer_is_recurrent(i) for i in range(self.n_layer)):
            bad("need at least one full-attention layer")
        if self.agreement is not None:
            if not 0.0 < self.agreement <= 1.0:
                bad("agreement must be in (0, 1]")
            if self.tied_embeddings:
                bad("the constructed-agreement model needs an untied LM head")
            if self.mtp != "grafted":
                bad("the constructed-agreement model is about the MTP head: use mtp='grafted' "
                    "(write_split splits it)")

    # --- derived numbers ---
    @property
    def n_rot(self) -> int:
        """RoPE dims, as the converter computes it: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_group

    @property
    def value_dim(self) -> int:
        return self.d_state * self.dt_rank

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def n_mtp(self) -> int:
        return 1 if self.mtp == "grafted" else 0

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    def layer_is_recurrent(self, il: int) -> bool:
        """HF ``layer_types``: every ``full_attention_interval``-th layer is full attention."""
        return (il + 1) % self.full_attention_interval != 0

    def weights_layer(self, il: int) -> int:
        """The trunk layer whose weights layer ``il`` holds: itself, or with
        ``shared_layers`` the first trunk layer of its kind (the MTP block: itself)."""
        if not self.shared_layers or il >= self.n_layer:
            return il
        kind = self.layer_is_recurrent(il)
        return next(i for i in range(self.n_layer) if self.layer_is_recurrent(i) == kind)

    @property
    def model_name(self) -> str:
        return self.name or f"pyggspec-tiny-{self.arch}"

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def digest(self) -> str:
        """Content hash of the spec (and the generator version): names cached files."""
        payload = dict(dataclasses.asdict(self), _v=GENERATOR_VERSION)
        for opt_in in ("rope_scaling", "fim_tokens", "shared_layers"):  # older digests kept
            if not payload[opt_in]:
                del payload[opt_in]
        blob = json.dumps(payload, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _with_agreement_defaults(base: dict[str, Any], overrides: dict[str, Any]) -> ModelSpec:
    """Merge overrides; an agreement model unties the LM head unless told otherwise."""
    fields = {**base, **overrides}
    if fields.get("agreement") is not None and "tied_embeddings" not in overrides:
        fields["tied_embeddings"] = False
    return ModelSpec(**fields)


def tiny_dense(**overrides: Any) -> ModelSpec:
    """4 layers (GDN, attn, GDN, attn), n_embd 64, 2 K / 4 V GDN heads (V reorder exercised)."""
    base: dict[str, Any] = {"arch": "qwen35", "name": "pyggspec-tiny-qwen35"}
    return _with_agreement_defaults(base, overrides)


def tiny_moe(**overrides: Any) -> ModelSpec:
    """Same trunk as :func:`tiny_dense` with 8 experts (2 used) + shared expert; tied head."""
    base: dict[str, Any] = {
        # n_ff 0: real Qwen3.5-MoE configs have no intermediate_size, so the converter
        # writes no feed_forward_length
        "arch": "qwen35moe", "name": "pyggspec-tiny-qwen35moe", "n_ff": 0,
        "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 64, "n_ff_shexp": 64,
        "tied_embeddings": True,
    }
    return _with_agreement_defaults(base, overrides)


def qwen35_0_8b(**overrides: Any) -> ModelSpec:
    """Real Qwen3.5-0.8B text dimensions with random weights (and our small BPE vocab).

    Numbers from Qwen/Qwen3.5-0.8B ``config.json`` (``text_config``), as quoted in public
    repositories that mirror it: hidden_size 1024, num_hidden_layers 24, intermediate_size 3584,
    num_attention_heads 8, num_key_value_heads 2, head_dim 256, linear_num_key_heads 16,
    linear_num_value_heads 16, linear_key_head_dim = linear_value_head_dim 128,
    linear_conv_kernel_dim 4, full_attention_interval 4, rms_norm_eps 1e-6,
    max_position_embeddings 262144, vocab_size 248320, tie_word_embeddings true,
    mtp_num_hidden_layers 1, rope_parameters: rope_theta 1e7, partial_rotary_factor 0.25,
    mrope_section [11, 11, 10] (padded to 4 by the converter).
    """
    base: dict[str, Any] = {
        "arch": "qwen35", "name": "pyggspec-qwen35-0.8b-shape",
        "n_embd": 1024, "n_layer": 24, "n_head": 8, "n_head_kv": 2, "head_dim": 256,
        "n_ff": 3584, "d_conv": 4, "d_state": 128, "n_group": 16, "dt_rank": 16,
        "n_vocab": 248320, "full_attention_interval": 4, "partial_rotary_factor": 0.25,
        "rope_sections": (11, 11, 10, 0), "rope_theta": 10_000_000.0,
        "context_length": 262144, "rms_eps": 1e-6, "tied_embeddings": True,
    }
    return _with_agreement_defaults(base, overrides)
