"""Tiny Hugging Face-format Qwen3.5 / Qwen3.5-MoE checkpoints, and llama.cpp's converter on them.

Why: our GGUF fixture writer claims to lay files out exactly as llama.cpp's
``convert_hf_to_gguf.py`` does. The only honest proof is to run that converter on a real
HF-format checkpoint of the same model and compare. This module makes such checkpoints
(numpy only: safetensors and tokenizer.json are written by hand), in two ways:

* ``write_hf_checkpoint(dir, HFSpec(...), seed)``: fresh random weights from a seed, in the
  layout the released Qwen3.5/3.6 checkpoints use (``Qwen3_5ForConditionalGeneration`` with a
  nested ``text_config``, ``model.language_model.*`` names, ``mtp.*`` head, fused MoE experts in
  the trunk and per-expert tensors in the MTP layer), or the flat ``*ForCausalLM`` layout.
* ``hf_from_gguf(gguf_path, dir)``: the inverse of the converter applied to an existing GGUF
  (e.g. one from ``pyggspec.testing.write_model``): -1 on norms, ``A_log = log(-ssm_a)``,
  inverse V-head reorder, conv1d unsqueeze, experts unstacked, tokenizer rebuilt from the
  GGUF vocabulary. Converting the result must give back the same GGUF, values included.

``run_llamacpp_converter`` runs the converter in a subprocess (its own vendored ``gguf-py``
must not mix with the installed one), with exactly one patch, documented at
``_CONVERTER_BOOTSTRAP``.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ConvertJob",
    "ConverterError",
    "HFSpec",
    "find_llamacpp_src",
    "hf_from_gguf",
    "hf_spec_from_model_spec",
    "hf_weights",
    "run_llamacpp_converter",
    "run_llamacpp_converter_jobs",
    "write_hf_checkpoint",
    "write_safetensors",
]

# Qwen3.5's pre-tokenizer regex as in its tokenizer.json (llama.cpp pre type "qwen35").
QWEN35_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A ChatML template in the style of Qwen's (no tools, optional thinking block).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# (content, special) in Qwen3.5's order; <think> tags are added but not special there.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tiny model speaks in tokens; the "
    "tokens become words and the words become sentences. Speculative decoding drafts a "
    "few tokens with a small head and verifies them with the target model in one batch. "
    "Hello world! hello there, how are you? I am fine, thank you. 1234567890 + 42 = 1276. "
    "def main():\n    return print('hello')\n"
)


class ConverterError(RuntimeError):
    """llama.cpp's converter failed; carries its output tail."""


@dataclass(frozen=True)
class HFSpec:
    """Dimensions of a tiny Qwen3.5 checkpoint (HF config names in the comments).

    Defaults: K heads != V heads so the converter's V-head reorder runs, two full-attention
    layers, every matrix row a multiple of 32 so q8_0 never falls back to f16.
    """

    moe: bool = False
    n_embd: int = 64  # hidden_size
    n_layer: int = 4  # num_hidden_layers (trunk)
    full_attention_interval: int = 2  # layer_types: every k-th layer is full attention
    n_head: int = 4  # num_attention_heads
    n_head_kv: int = 2  # num_key_value_heads
    head_dim: int = 32
    n_ff: int = 128  # intermediate_size (dense only; MoE configs have none)
    ssm_n_group: int = 2  # linear_num_key_heads
    ssm_dt_rank: int = 4  # linear_num_value_heads
    ssm_d_state: int = 32  # linear_key_head_dim == linear_value_head_dim
    ssm_d_conv: int = 4  # linear_conv_kernel_dim
    n_expert: int = 8  # num_experts
    n_expert_used: int = 2  # num_experts_per_tok
    n_ff_exp: int = 32  # moe_intermediate_size
    n_ff_shexp: int = 64  # shared_expert_intermediate_size
    mtp_layers: int = 1  # mtp_num_hidden_layers
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] | None = None  # None: scaled-down [11, 11, 10]
    rms_norm_eps: float = 1e-6
    context_length: int = 4096  # max_position_embeddings
    n_merges: int = 64  # BPE merges learned from a built-in corpus
    vocab_size: int | None = None  # None: tokenizer size rounded up to a multiple of 32
    layout: str = "vlm"  # "vlm" (released checkpoints) or "causal" (flat *ForCausalLM)
    fused_experts: bool = True  # trunk experts as gate_up_proj/down_proj 3-D tensors
    layer_types: tuple[str, ...] | None = None  # explicit HF layer_types, overrides interval
    extra_text_config: dict[str, Any] = field(default_factory=dict)

    def resolved_layer_types(self) -> list[str]:
        """HF ``layer_types``: explicit, or ``full_attention`` every ``interval``-th layer."""
        if self.layer_types is not None:
            return list(self.layer_types)
        k = self.full_attention_interval
        return [
            "full_attention" if (i + 1) % k == 0 else "linear_attention"
            for i in range(self.n_layer)
        ]

    def resolved_mrope_section(self) -> list[int]:
        """M-RoPE sections summing to n_rot/2 (Qwen3.5 uses [11, 11, 10] for n_rot 64)."""
        if self.mrope_section is not None:
            return list(self.mrope_section)
        half = int(self.head_dim * self.partial_rotary_factor) // 2
        base, rem = divmod(half, 3)
        return [base + 1 if i < rem else base for i in range(3)]


def hf_spec_from_model_spec(ms: Any, **overrides: Any) -> HFSpec:
    """The HF checkpoint that ``pyggspec.testing.ModelSpec`` ``ms`` claims to be a conversion of.

    Built from the spec's meaning (not from a written GGUF), so converting it checks the
    writer's metadata semantics independently of ``hf_from_gguf``. A MoE spec's ``n_ff`` is
    dropped: released Qwen3.5-MoE configs have no ``intermediate_size``.
    """
    moe = ms.arch == "qwen35moe"
    fields: dict[str, Any] = {
        "moe": moe, "n_embd": ms.n_embd, "n_layer": ms.n_layer,
        "full_attention_interval": ms.full_attention_interval, "n_head": ms.n_head,
        "n_head_kv": ms.n_head_kv, "head_dim": ms.head_dim, "n_ff": ms.n_ff,
        "ssm_n_group": ms.n_group, "ssm_dt_rank": ms.dt_rank, "ssm_d_state": ms.d_state,
        "ssm_d_conv": ms.d_conv, "n_expert": ms.n_expert, "n_expert_used": ms.n_expert_used,
        "n_ff_exp": ms.n_ff_exp, "n_ff_shexp": ms.n_ff_shexp, "mtp_layers": ms.n_mtp,
        "tie_word_embeddings": ms.tied_embeddings, "rope_theta": ms.rope_theta,
        "partial_rotary_factor": ms.partial_rotary_factor,
        "mrope_section": tuple(ms.rope_sections[:3]), "rms_norm_eps": ms.rms_eps,
        "context_length": ms.context_length, "vocab_size": ms.n_vocab,
    }
    fields.update(overrides)
    return HFSpec(**fields)


# ---------------------------------------------------------------------------------------------
# tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(corpus: str, n_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Deterministic byte-level BPE: 256 byte tokens, then ``n_merges`` learned merges."""
    b2u = bytes_to_unicode()
    alphabet = [b2u[b] for b in range(256)]
    words: Counter[tuple[str, ...]] = Counter()
    for i, w in enumerate(corpus.split(" ")):
        text = (" " if i else "") + w
        words[tuple(b2u[b] for b in text.encode("utf-8"))] += 1
    vocab = list(alphabet)
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        vocab.append(best[0] + best[1])
        new_words: Counter[tuple[str, ...]] = Counter()
        for w, c in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return vocab, merges


def _byte_level(flag_regex: bool = False) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
            "use_regex": flag_regex}


def tokenizer_json(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    added: list[tuple[int, str, bool]],
) -> dict[str, Any]:
    """A Qwen2-style ``tokenizer.json`` (NFC, Qwen3.5 split regex, byte-level BPE)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": s}
            for i, c, s in added
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN35_PRETOKENIZER_REGEX},
                 "behavior": "Isolated", "invert": False},
                _byte_level(),
            ],
        },
        "post_processor": _byte_level(),
        "decoder": _byte_level(),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges],
        },
    }


def tokenizer_config_json(
    added: list[tuple[int, str, bool]],
    eos: str | None,
    pad: str | None,
    chat_template: str | None,
) -> dict[str, Any]:
    """``tokenizer_config.json`` as Qwen3.5 ships it (bos null, eos <|im_end|>)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": s}
            for i, c, s in added
        },
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ---------------------------------------------------------------------------------------------
# safetensors (written by hand: numpy is the only dependency)

_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write ``tensors`` as one safetensors file, keys sorted like the safetensors library."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: unsupported dtype {a.dtype}")
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).astype("<" + tensors[name].dtype.str[1:],
                                                                copy=False).tobytes())


# ---------------------------------------------------------------------------------------------
# config + weights


def _text_prefix(layout: str) -> str:
    return "model.language_model." if layout == "vlm" else "model."


def text_config(spec: HFSpec, vocab_size: int, eos_id: int, bos_id: int | None) -> dict[str, Any]:
    """The text part of a Qwen3.5 config, with the keys the converter reads."""
    d = spec.ssm_d_state
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if spec.moe else "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": bos_id,
        "dtype": "float32",
        "eos_token_id": eos_id,
        "full_attention_interval": spec.full_attention_interval,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.n_embd,
        "initializer_range": 0.02,
        "layer_types": spec.resolved_layer_types(),
        "linear_conv_kernel_dim": spec.ssm_d_conv,
        "linear_key_head_dim": d,
        "linear_num_key_heads": spec.ssm_n_group,
        "linear_num_value_heads": spec.ssm_dt_rank,
        "linear_value_head_dim": d,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": spec.context_length,
        "mtp_num_hidden_layers": spec.mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": spec.n_head,
        "num_hidden_layers": spec.n_layer,
        "num_key_value_heads": spec.n_head_kv,
        "partial_rotary_factor": spec.partial_rotary_factor,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": spec.resolved_mrope_section(),
            "partial_rotary_factor": spec.partial_rotary_factor,
            "rope_theta": spec.rope_theta,
            "rope_type": "default",
        },
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if spec.moe:
        cfg.update({
            "moe_intermediate_size": spec.n_ff_exp,
            "num_experts": spec.n_expert,
            "num_experts_per_tok": spec.n_expert_used,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": spec.n_ff_shexp,
        })
    else:
        cfg["intermediate_size"] = spec.n_ff
    cfg.update(spec.extra_text_config)
    return dict(sorted(cfg.items()))


def full_config(spec: HFSpec, tcfg: dict[str, Any]) -> dict[str, Any]:
    """config.json: nested under ``text_config`` (released layout) or flat (CausalLM)."""
    if spec.layout == "vlm":
        arch = "Qwen3_5MoeForConditionalGeneration" if spec.moe else "Qwen3_5ForConditionalGeneration"
        return {
            "architectures": [arch],
            "model_type": "qwen3_5_moe" if spec.moe else "qwen3_5",
            "text_config": tcfg,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "transformers_version": "4.57.1",
        }
    if spec.layout == "causal":
        arch = "Qwen3_5MoeForCausalLM" if spec.moe else "Qwen3_5ForCausalLM"
        out = dict(tcfg)
        out["architectures"] = [arch]
        out["model_type"] = "qwen3_5_moe_text" if spec.moe else "qwen3_5_text"
        return out
    raise ValueError(f"unknown layout {spec.layout!r}")


def _mat(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)


def _vec(rng: np.random.Generator, n: int, scale: float = 0.1, loc: float = 0.0) -> np.ndarray:
    return (loc + scale * rng.standard_normal(n)).astype(np.float32)


def hf_weights(spec: HFSpec, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-form f32 weights (zero-centred norms, A_log, [C,1,K] conv kernels)."""
    rng = np.random.default_rng(seed)
    H = spec.n_embd
    P = _text_prefix(spec.layout)
    key_dim = spec.ssm_d_state * spec.ssm_n_group
    value_dim = spec.ssm_d_state * spec.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    w: dict[str, np.ndarray] = {}
    w[P + "embed_tokens.weight"] = _mat(rng, n_vocab, H)
    w[P + "norm.weight"] = _vec(rng, H)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = _mat(rng, n_vocab, H)

    def attn(p: str) -> None:
        hd = spec.head_dim
        w[p + "self_attn.q_proj.weight"] = _mat(rng, 2 * spec.n_head * hd, H)
        w[p + "self_attn.k_proj.weight"] = _mat(rng, spec.n_head_kv * hd, H)
        w[p + "self_attn.v_proj.weight"] = _mat(rng, spec.n_head_kv * hd, H)
        w[p + "self_attn.o_proj.weight"] = _mat(rng, H, spec.n_head * hd)
        w[p + "self_attn.q_norm.weight"] = _vec(rng, hd)
        w[p + "self_attn.k_norm.weight"] = _vec(rng, hd)

    def gdn(p: str) -> None:
        nv = spec.ssm_dt_rank
        w[p + "linear_attn.in_proj_qkv.weight"] = _mat(rng, conv_dim, H)
        w[p + "linear_attn.in_proj_z.weight"] = _mat(rng, value_dim, H)
        w[p + "linear_attn.in_proj_b.weight"] = _mat(rng, nv, H)
        w[p + "linear_attn.in_proj_a.weight"] = _mat(rng, nv, H)
        w[p + "linear_attn.conv1d.weight"] = _vec(rng, conv_dim * spec.ssm_d_conv, 0.3).reshape(
            conv_dim, 1, spec.ssm_d_conv)
        w[p + "linear_attn.dt_bias"] = _vec(rng, nv, 0.5)
        w[p + "linear_attn.A_log"] = np.log(rng.uniform(1.0, 16.0, nv)).astype(np.float32)
        w[p + "linear_attn.norm.weight"] = _vec(rng, spec.ssm_d_state, 0.1, 1.0)
        w[p + "linear_attn.out_proj.weight"] = _mat(rng, H, value_dim)

    def ffn(p: str, fused: bool) -> None:
        if not spec.moe:
            w[p + "mlp.gate_proj.weight"] = _mat(rng, spec.n_ff, H)
            w[p + "mlp.up_proj.weight"] = _mat(rng, spec.n_ff, H)
            w[p + "mlp.down_proj.weight"] = _mat(rng, H, spec.n_ff)
            return
        E, F, S = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
        w[p + "mlp.gate.weight"] = _mat(rng, E, H)
        gate_up = np.stack([_mat(rng, 2 * F, H) for _ in range(E)])
        down = np.stack([_mat(rng, H, F) for _ in range(E)])
        if fused:
            w[p + "mlp.experts.gate_up_proj"] = gate_up
            w[p + "mlp.experts.down_proj"] = down
        else:
            for e in range(E):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :F].copy()
                w[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, F:].copy()
                w[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
        w[p + "mlp.shared_expert.gate_proj.weight"] = _mat(rng, S, H)
        w[p + "mlp.shared_expert.up_proj.weight"] = _mat(rng, S, H)
        w[p + "mlp.shared_expert.down_proj.weight"] = _mat(rng, H, S)
        w[p + "mlp.shared_expert_gate.weight"] = _mat(rng, 1, H)

    for i, kind in enumerate(spec.resolved_layer_types()):
        p = f"{P}layers.{i}."
        w[p + "input_layernorm.weight"] = _vec(rng, H)
        w[p + "post_attention_layernorm.weight"] = _vec(rng, H)
        (gdn if kind == "linear_attention" else attn)(p)
        ffn(p, spec.fused_experts)
    for j in range(spec.mtp_layers):
        p = f"mtp.layers.{j}."
        w[p + "input_layernorm.weight"] = _vec(rng, H)
        w[p + "post_attention_layernorm.weight"] = _vec(rng, H)
        attn(p)
        ffn(p, False)  # released checkpoints keep the MTP layer's experts per expert
    if spec.mtp_layers:
        w["mtp.fc.weight"] = _mat(rng, H, 2 * H)
        w["mtp.pre_fc_norm_embedding.weight"] = _vec(rng, H)
        w["mtp.pre_fc_norm_hidden.weight"] = _vec(rng, H)
        w["mtp.norm.weight"] = _vec(rng, H)
    return w


def _write_tokenizer(
    out: Path,
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    added: list[tuple[int, str, bool]],
    eos: str | None,
    pad: str | None,
    chat_template: str | None,
) -> None:
    (out / "tokenizer.json").write_text(
        json.dumps(tokenizer_json(vocab, merges, added), ensure_ascii=False, indent=1),
        encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config_json(added, eos, pad, chat_template), ensure_ascii=False,
                   indent=1),
        encoding="utf-8")


def write_hf_checkpoint(out_dir: str | os.PathLike[str], spec: HFSpec, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a tiny Qwen3.5 model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens, merges = train_bpe(_CORPUS, spec.n_merges)
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [(len(tokens) + k, c, s) for k, (c, s) in enumerate(SPECIAL_TOKENS)]
    n_tok = len(tokens) + len(added)
    n_vocab = spec.vocab_size if spec.vocab_size is not None else -(-n_tok // 32) * 32
    if n_vocab < n_tok:
        raise ValueError(f"vocab_size {n_vocab} < tokenizer size {n_tok}")
    ids = {c: i for i, c, _ in added}
    tcfg = text_config(spec, n_vocab, eos_id=ids["<|endoftext|>"], bos_id=ids["<|endoftext|>"])
    (out / "config.json").write_text(json.dumps(full_config(spec, tcfg), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"],
                                                                ids["<|endoftext|>"]],
         "pad_token_id": ids["<|endoftext|>"], "do_sample": True}, indent=2) + "\n")
    _write_tokenizer(out, vocab, merges, added, "<|im_end|>", "<|endoftext|>", CHAT_TEMPLATE)
    write_safetensors(out / "model.safetensors", hf_weights(spec, n_vocab, seed))
    return out


# ---------------------------------------------------------------------------------------------
# GGUF -> HF (the converter's transforms, inverted)

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED = 1, 3, 4, 5


def _v_perm(n_k: int, n_v: int, head: int, inverse: bool) -> np.ndarray:
    """Row permutation of the converter's V-head reorder (grouped -> tiled), or its inverse."""
    r = n_v // n_k
    idx = np.arange(n_v * head)
    if not inverse:
        return idx.reshape(n_k, r, head).transpose(1, 0, 2).reshape(-1)
    return idx.reshape(r, n_k, head).transpose(1, 0, 2).reshape(-1)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def _tensor_f32(t: Any) -> np.ndarray:
    """A GGUF tensor as f32 numpy with numpy shape = reversed ggml ne."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def hf_from_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 layout: str = "vlm", fused_experts: bool = True,
                 moe_intermediate_size: bool = False) -> Path:
    """Rebuild the HF checkpoint that llama.cpp's converter would turn into ``gguf_path``.

    Needs a grafted file (trunk + MTP) or a trunk-only one; the GGUF's own vocabulary becomes
    tokenizer.json. Values are exact for F32/F16 sources except ``A_log`` (log/exp).
    Released Qwen3.5-MoE configs have no ``intermediate_size``; a MoE file's
    ``feed_forward_length`` is carried over only with ``moe_intermediate_size=True``.
    """
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    arch = _field(r, "general.architecture")
    if arch not in ("qwen35", "qwen35moe"):
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not qwen35/qwen35moe")
    moe = arch == "qwen35moe"

    def kv(name: str, default: Any = None) -> Any:
        v = _field(r, f"{arch}.{name}")
        return default if v is None else v

    n_all = int(kv("block_count"))
    n_nextn = int(kv("nextn_predict_layers", 0))
    n_layer = n_all - n_nextn
    tensors = {t.name: t for t in r.tensors}
    if "blk.0.attn_norm.weight" not in tensors:
        raise ValueError(f"{gguf_path}: MTP-only file; rebuild from the grafted one")
    recurrent = kv("attention.recurrent_layers")
    interval = int(kv("full_attention_interval", 4))
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    layer_types = ["linear_attention" if rec else "full_attention" for rec in recurrent[:n_layer]]
    head_dim = int(kv("attention.key_length"))
    n_rot = int(kv("rope.dimension_count", head_dim))
    sections = [int(x) for x in kv("rope.dimension_sections", [])]
    while sections and sections[-1] == 0 and len(sections) > 3:
        sections.pop()
    n_k, n_v = int(kv("ssm.group_count")), int(kv("ssm.time_step_rank"))
    d_state = int(kv("ssm.state_size"))
    spec = HFSpec(
        moe=moe, n_embd=int(kv("embedding_length")), n_layer=n_layer,
        full_attention_interval=interval, n_head=int(kv("attention.head_count")),
        n_head_kv=int(kv("attention.head_count_kv")), head_dim=head_dim,
        n_ff=int(kv("feed_forward_length", 0)), ssm_n_group=n_k, ssm_dt_rank=n_v,
        ssm_d_state=d_state, ssm_d_conv=int(kv("ssm.conv_kernel")),
        n_expert=int(kv("expert_count", 0)), n_expert_used=int(kv("expert_used_count", 0)),
        n_ff_exp=int(kv("expert_feed_forward_length", 0)),
        n_ff_shexp=int(kv("expert_shared_feed_forward_length", 0)), mtp_layers=n_nextn,
        tie_word_embeddings="output.weight" not in tensors,
        rope_theta=float(str(np.float32(kv("rope.freq_base", 10000.0)))),
        partial_rotary_factor=n_rot / head_dim, mrope_section=tuple(sections) or None,
        rms_norm_eps=float(str(np.float32(kv("attention.layer_norm_rms_epsilon")))),
        context_length=int(kv("context_length")), layout=layout, fused_experts=fused_experts,
        layer_types=tuple(layer_types),
    )
    P = _text_prefix(layout)
    value_dim = d_state * n_v
    key_dim = d_state * n_k
    weights: dict[str, np.ndarray] = {}
    renames = {
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
        "attn_gate.weight": "linear_attn.in_proj_z.weight",
        "ssm_beta.weight": "linear_attn.in_proj_b.weight",
        "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
        "ssm_conv1d.weight": "linear_attn.conv1d.weight",
        "ssm_dt.bias": "linear_attn.dt_bias",
        "ssm_a": "linear_attn.A_log",
        "ssm_norm.weight": "linear_attn.norm.weight",
        "ssm_out.weight": "linear_attn.out_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    }
    nextn = {
        "nextn.eh_proj.weight": "mtp.fc.weight",
        "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
        "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
        "nextn.shared_head_norm.weight": "mtp.norm.weight",
    }
    inv_v = _v_perm(n_k, n_v, d_state, inverse=True)
    inv_v1 = _v_perm(n_k, n_v, 1, inverse=True)
    reorder = n_k != n_v
    experts: dict[int, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        a = _tensor_f32(t)
        if name == "token_embd.weight":
            weights[P + "embed_tokens.weight"] = a
            continue
        if name == "output_norm.weight":
            weights[P + "norm.weight"] = a - 1.0
            continue
        if name == "output.weight":
            weights["lm_head.weight"] = a
            continue
        parts = name.split(".", 2)
        if parts[0] != "blk":
            raise ValueError(f"{gguf_path}: unexpected tensor {name}")
        bid, rest = int(parts[1]), parts[2]
        if rest in nextn:
            weights[nextn[rest]] = a - 1.0 if "norm" in rest else a
            continue
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            experts.setdefault(bid, {})[rest.split("_")[1]] = a
            continue
        if rest not in renames:
            raise ValueError(f"{gguf_path}: no HF name for {name}")
        hf = renames[rest]
        prefix = f"{P}layers.{bid}." if bid < n_layer else f"mtp.layers.{bid - n_layer}."
        if rest.endswith("norm.weight") and rest != "ssm_norm.weight":
            a = a - 1.0
        if rest == "ssm_a":
            a = np.log(-a.astype(np.float64)).astype(np.float32)
        if rest == "ssm_conv1d.weight":
            if reorder:
                a = np.concatenate([a[: 2 * key_dim], a[2 * key_dim:][inv_v]])
            a = a[:, None, :]
        elif reorder and rest in ("attn_qkv.weight",) and a.shape[0] == 2 * key_dim + value_dim:
            a = np.concatenate([a[: 2 * key_dim], a[2 * key_dim:][inv_v]])
        elif reorder and rest == "attn_gate.weight":
            a = a[inv_v]
        elif reorder and rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
            a = a[inv_v1]
        elif reorder and rest == "ssm_out.weight":
            a = a[:, inv_v]
        if rest == "ffn_gate_inp_shexp.weight":
            a = a.reshape(1, -1)
        weights[prefix + hf] = np.ascontiguousarray(a)
    for bid, parts_ in experts.items():
        prefix = f"{P}layers.{bid}." if bid < n_layer else f"mtp.layers.{bid - n_layer}."
        gate, up, down = parts_["gate"], parts_["up"], parts_["down"]
        if fused_experts and bid < n_layer:
            weights[prefix + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            weights[prefix + "mlp.experts.down_proj"] = down
        else:
            for e in range(gate.shape[0]):
                weights[prefix + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
                weights[prefix + f"mlp.experts.{e}.up_proj.weight"] = up[e]
                weights[prefix + f"mlp.experts.{e}.down_proj.weight"] = down[e]

    # vocabulary
    tokens = [str(x) for x in _field(r, "tokenizer.ggml.tokens")]
    types = [int(x) for x in _field(r, "tokenizer.ggml.token_type")]
    merges_raw = [str(x) for x in (_field(r, "tokenizer.ggml.merges") or [])]
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == _TOKEN_NORMAL:
            vocab[tok] = i
        elif ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append((i, tok, ty == _TOKEN_CONTROL))
        elif ty != _TOKEN_UNUSED:
            raise ValueError(f"{gguf_path}: token {i} has unsupported type {ty}")

    def tok_of(key: str) -> str | None:
        v = _field(r, key)
        return None if v is None else tokens[int(v)]

    bos = _field(r, "tokenizer.ggml.bos_token_id")
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = text_config(spec, len(tokens), eos_id=None if eos is None else int(eos),
                       bos_id=None if bos is None else int(bos))
    if moe and moe_intermediate_size and kv("feed_forward_length") is not None:
        tcfg["intermediate_size"] = int(kv("feed_forward_length"))
    (out / "config.json").write_text(json.dumps(full_config(spec, tcfg), indent=2) + "\n")
    _write_tokenizer(out, vocab, merges, added, tok_of("tokenizer.ggml.eos_token_id"),
                     tok_of("tokenizer.ggml.padding_token_id"),
                     _field(r, "tokenizer.chat_template"))
    write_safetensors(out / "model.safetensors", weights)
    return out


# ---------------------------------------------------------------------------------------------
# running llama.cpp's converter

# Runs inside a fresh interpreter: argv[1] = llama.cpp dir, argv[2] = JSON list of argument
# lists, one per conversion (importing torch + the converter costs ~7 s, so jobs share it).
# The one patch to the converter: TextModel.get_vocab_base_pre hashes the tokenizer's output on
# a fixed text and only knows released tokenizers, so a tiny one is never recognised. We return
# "qwen35", what it returns for Qwen3.5's own tokenizer (our tokenizer.json uses the same
# pre-tokenizer regex). Between jobs we delete the ``no_mtp`` / ``mtp_only`` class attributes
# that ``main()`` sets on the model class for --no-mtp / --mtp and never resets, so each job
# starts as a fresh process would. Everything else (config parsing, tensor transforms, types,
# metadata, vocabulary) is the converter's own code, unchanged.
_CONVERTER_BOOTSTRAP = """
import json, sys
src, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, src)
sys.argv = ["convert_hf_to_gguf.py"]
import convert_hf_to_gguf as conv
from conversion.base import ModelBase, TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"

def subclasses(c):
    for s in c.__subclasses__():
        yield s
        yield from subclasses(s)

for job in jobs:
    sys.argv = ["convert_hf_to_gguf.py", *job]
    conv.main()
    for c in set(subclasses(ModelBase)):
        for attr in ("no_mtp", "mtp_only"):
            if attr in c.__dict__:
                delattr(c, attr)
"""


@dataclass(frozen=True)
class ConvertJob:
    """One converter run: HF dir -> outfile with ``--outtype`` and a MTP mode."""

    hf_dir: Path
    outfile: Path
    outtype: str = "f32"
    mode: str = "grafted"  # grafted (default conversion) | no-mtp | mtp

    def args(self) -> list[str]:
        a = [str(self.hf_dir), "--outtype", self.outtype, "--outfile", str(self.outfile)]
        if self.mode == "no-mtp":
            a.append("--no-mtp")
        elif self.mode == "mtp":
            a.append("--mtp")
        elif self.mode != "grafted":
            raise ValueError(f"unknown mode {self.mode!r}")
        return a


def find_llamacpp_src(repo_root: str | os.PathLike[str] | None = None) -> Path | None:
    """llama.cpp source dir: $PYGGSPEC_LLAMACPP_SRC, else the install script's sdist copy."""
    env = os.environ.get("PYGGSPEC_LLAMACPP_SRC")
    root = Path(repo_root) if repo_root else Path(__file__).resolve().parents[2]
    cands = [Path(env)] if env else []
    cands.append(root / ".cache" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp")
    for c in cands:
        if (c / "convert_hf_to_gguf.py").is_file() and (c / "conversion").is_dir():
            return c
    return None


def run_llamacpp_converter_jobs(
    jobs: list[ConvertJob],
    src: str | os.PathLike[str] | None = None,
    timeout: float = 900.0,
) -> list[Path]:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` for each job, in one subprocess."""
    src_dir = Path(src) if src else find_llamacpp_src()
    if src_dir is None:
        raise ConverterError("llama.cpp source not found (set PYGGSPEC_LLAMACPP_SRC)")
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use its own vendored gguf-py
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERTER_BOOTSTRAP, str(src_dir),
         json.dumps([j.args() for j in jobs])],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    missing = [j.outfile for j in jobs if not Path(j.outfile).is_file()]
    if proc.returncode != 0 or missing:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise ConverterError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}, missing "
                             f"{[str(m) for m in missing]}):\n{tail}")
    return [Path(j.outfile) for j in jobs]


def run_llamacpp_converter(
    hf_dir: str | os.PathLike[str],
    outfile: str | os.PathLike[str],
    outtype: str = "f32",
    mode: str = "grafted",
    src: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert ``hf_dir`` with llama.cpp's converter; ``mode`` grafted | no-mtp | mtp."""
    job = ConvertJob(Path(hf_dir), Path(outfile), outtype, mode)
    return run_llamacpp_converter_jobs([job], src)[0]
