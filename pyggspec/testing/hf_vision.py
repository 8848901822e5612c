"""Tiny Qwen3.5 vision-language checkpoints (random vision tower of the real layout), and
llama.cpp's converter on them: the text GGUF and the ``--mmproj`` projector GGUF.

Why: image inputs (issue 52) go through libmtmd, which only opens projector files that
llama.cpp's converter writes. The honest fixture is therefore a Hugging Face checkpoint of the
released ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` shape
(nested ``text_config`` + ``vision_config``, ``model.visual.*`` tensors, the Qwen3.5 vision
tokens, a ``preprocessor_config.json``) with tiny dimensions, converted twice by the real
``convert_hf_to_gguf.py``: once as the text model (MTP kept, as a grafted head) and once with
``--mmproj`` (projector type ``qwen3vl_merger``). The text part is ``hf_checkpoint``'s, unchanged;
this module adds the vision tower, its config and its tokens.

``write_mmproj`` writes the same projector GGUF directly (numpy + gguf-py, no torch), so that
projector tests also run where torch is not installed; the converter tests prove the two
files identical.

The vision tower follows transformers' Qwen3.5 vision model (the Qwen3-VL one without
deepstack): a Conv3d patch embedding (temporal patch 2), learned position embeddings on a
square grid, pre-norm ViT blocks with LayerNorm, fused qkv and a GELU MLP, and the patch
merger (LayerNorm over the ViT width, then fc1 -> GELU -> fc2 on 2x2 merged patches, out to
the text model's width).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pyggspec.testing.hf_checkpoint import (
    ConvertJob,
    HFSpec,
    _mat,
    _vec,
    find_llamacpp_src,
    run_llamacpp_converter_jobs,
    write_hf_checkpoint,
    write_safetensors,
)

__all__ = [
    "VISION_TOKENS",
    "MmprojJob",
    "VLFiles",
    "VisionSpec",
    "bmp_bytes",
    "converted_vl_model",
    "converted_vl_models",
    "mismatched_vision",
    "png_bytes",
    "test_image_pixels",
    "test_image_png",
    "vision_weights",
    "write_hf_vl_checkpoint",
    "write_mmproj",
]

# Qwen3.5's vision tokens, in its order (all special). libmtmd wraps an image's rows in
# <|vision_start|> ... <|vision_end|> for this projector and tokenizes both as text, so the
# vocabulary must have them as single tokens for the chunks to look like a real model's.
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                                  "<|image_pad|>", "<|video_pad|>")

# Qwen3.5's preprocessor_config.json, but for the pixel budget (size): the converter reads
# only image_mean / image_std from it; libmtmd applies its own token budget (8..4096 merged
# tokens for this projector).
_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


@dataclass(frozen=True)
class VisionSpec:
    """Dimensions of the tiny vision tower (HF ``vision_config`` names in the comments).

    Real Qwen3.5: depth 27, width 1152, 16 heads, MLP 4304, 2304 position embeddings (48x48),
    patch 16, merge 2, temporal patch 2, no deepstack layers. Here the head width is 32 so
    the ViT's 2-D M-RoPE has four sections of 8; the position grid is 4x4 (libmtmd
    interpolates it to each image's patch grid).
    """

    hidden_size: int = 64  # hidden_size
    depth: int = 2  # depth
    num_heads: int = 2  # num_heads
    intermediate_size: int = 128  # intermediate_size
    patch_size: int = 16  # patch_size
    spatial_merge_size: int = 2  # spatial_merge_size
    temporal_patch_size: int = 2  # temporal_patch_size (the converter supports only 2)
    num_position_embeddings: int = 16  # a square: (image_size / patch_size) ** 2
    in_channels: int = 3
    out_hidden_size: int | None = None  # None: the text model's hidden_size
    deepstack_visual_indexes: tuple[int, ...] = ()

    def config(self, text_hidden: int, model_type: str) -> dict[str, Any]:
        """``vision_config`` as Qwen3.5's config.json has it."""
        return {
            "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
            "depth": self.depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": self.hidden_size,
            "in_channels": self.in_channels,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "model_type": model_type,
            "num_heads": self.num_heads,
            "num_position_embeddings": self.num_position_embeddings,
            "out_hidden_size": self.out_hidden_size or text_hidden,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
        }


def vision_weights(vs: VisionSpec, text_hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-form f32 weights of the vision tower (``model.visual.*``), random from ``seed``."""
    rng = np.random.default_rng(seed)
    H, F = vs.hidden_size, vs.intermediate_size
    out = vs.out_hidden_size or text_hidden
    merged = H * vs.spatial_merge_size ** 2
    P = "model.visual."
    k_in = vs.in_channels * vs.temporal_patch_size * vs.patch_size ** 2
    w: dict[str, np.ndarray] = {
        P + "patch_embed.proj.weight": (rng.standard_normal(
            (H, vs.in_channels, vs.temporal_patch_size, vs.patch_size, vs.patch_size))
            / np.sqrt(k_in)).astype(np.float32),
        P + "patch_embed.proj.bias": _vec(rng, H),
        P + "pos_embed.weight": _vec(rng, vs.num_position_embeddings * H, 0.5).reshape(
            vs.num_position_embeddings, H),
    }
    for i in range(vs.depth):
        b = f"{P}blocks.{i}."
        w[b + "norm1.weight"] = _vec(rng, H, 0.1, 1.0)
        w[b + "norm1.bias"] = _vec(rng, H)
        w[b + "norm2.weight"] = _vec(rng, H, 0.1, 1.0)
        w[b + "norm2.bias"] = _vec(rng, H)
        w[b + "attn.qkv.weight"] = _mat(rng, 3 * H, H)
        w[b + "attn.qkv.bias"] = _vec(rng, 3 * H)
        w[b + "attn.proj.weight"] = _mat(rng, H, H)
        w[b + "attn.proj.bias"] = _vec(rng, H)
        w[b + "mlp.linear_fc1.weight"] = _mat(rng, F, H)
        w[b + "mlp.linear_fc1.bias"] = _vec(rng, F)
        w[b + "mlp.linear_fc2.weight"] = _mat(rng, H, F)
        w[b + "mlp.linear_fc2.bias"] = _vec(rng, H)
    w[P + "merger.norm.weight"] = _vec(rng, H, 0.1, 1.0)
    w[P + "merger.norm.bias"] = _vec(rng, H)
    w[P + "merger.linear_fc1.weight"] = _mat(rng, merged, merged)
    w[P + "merger.linear_fc1.bias"] = _vec(rng, merged)
    w[P + "merger.linear_fc2.weight"] = _mat(rng, out, merged)
    w[P + "merger.linear_fc2.bias"] = _vec(rng, out)
    return w


def _add_tokens(out: Path, names: tuple[str, ...], n_vocab: int) -> dict[str, int]:
    """Append ``names`` as special added tokens to the written tokenizer files; their ids."""
    tj = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    used = [a["id"] for a in tj["added_tokens"]] + list(tj["model"]["vocab"].values())
    nxt = max(used) + 1
    ids: dict[str, int] = {}
    for name in names:
        if nxt >= n_vocab:
            raise ValueError(f"no room for {name} in a vocabulary of {n_vocab}")
        ids[name] = nxt
        tj["added_tokens"].append({"id": nxt, "content": name, "single_word": False,
                                   "lstrip": False, "rstrip": False, "normalized": False,
                                   "special": True})
        tc["added_tokens_decoder"][str(nxt)] = {"content": name, "lstrip": False,
                                                "normalized": False, "rstrip": False,
                                                "single_word": False, "special": True}
        nxt += 1
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False, indent=1),
                                        encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False, indent=1),
                                               encoding="utf-8")
    return ids


def write_hf_vl_checkpoint(out_dir: str | os.PathLike[str], spec: HFSpec,
                           vision: VisionSpec | None = None, seed: int = 0) -> Path:
    """A tiny ``Qwen3_5(Moe)ForConditionalGeneration`` checkpoint with a vision tower.

    The text model is ``write_hf_checkpoint(spec)`` (``layout="vlm"``); the vision weights go
    into a second shard, ``model-visual.safetensors`` (the converter reads every
    ``model*.safetensors``; the text conversion skips ``model.visual.*``, the projector
    conversion everything else).
    """
    if spec.layout != "vlm":
        raise ValueError("a vision checkpoint needs the released (vlm) layout")
    vs = vision or VisionSpec()
    out = write_hf_checkpoint(out_dir, spec, seed=seed)
    cfg = json.loads((out / "config.json").read_text())
    n_vocab = int(cfg["text_config"]["vocab_size"])
    ids = _add_tokens(out, VISION_TOKENS, n_vocab)
    cfg["vision_config"] = vs.config(spec.n_embd, cfg["model_type"])
    cfg.update({
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    })
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR, indent=2) + "\n")
    write_safetensors(out / "model-visual.safetensors",
                      vision_weights(vs, spec.n_embd, seed=seed + 1))
    return out


@dataclass(frozen=True)
class MmprojJob(ConvertJob):
    """A ``convert_hf_to_gguf.py --mmproj`` run (the projector GGUF)."""

    mode: str = "mmproj"

    def args(self) -> list[str]:
        return [str(self.hf_dir), "--mmproj", "--outtype", self.outtype, "--outfile",
                str(self.outfile)]


@dataclass(frozen=True)
class VLFiles:
    """One converted vision-language fixture: the text GGUF (MTP grafted) and its projector."""

    hf_dir: Path
    model: Path
    mmproj: Path
    spec: HFSpec
    vision: VisionSpec
    extra: dict[str, Path] = field(default_factory=dict)


def converted_vl_models(cache_dir: str | os.PathLike[str],
                        variants: list[tuple[HFSpec, VisionSpec]], *, outtype: str = "f32",
                        mmproj_outtype: str = "f16", seed: int = 0,
                        src: str | os.PathLike[str] | None = None) -> list[VLFiles]:
    """Write and convert each (text spec, vision spec) once under ``cache_dir/<digest>/``.

    Every conversion still missing runs in one converter process (importing torch and the
    converter is most of its cost). ``mmproj_outtype`` f16 is what released projector files
    use (2-D weights f16; norms, biases and position embeddings stay f32).
    """
    out: list[VLFiles] = []
    jobs: list[ConvertJob] = []
    todo: list[tuple[Path, HFSpec, VisionSpec]] = []
    for spec, vs in variants:
        key = json.dumps([asdict(spec), asdict(vs), outtype, mmproj_outtype, seed],
                         sort_keys=True, default=str)
        d = Path(cache_dir) / f"vl-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        model, mmproj = d / "model.gguf", d / "mmproj-model.gguf"
        if not (model.is_file() and mmproj.is_file()):
            todo.append((d, spec, vs))
            jobs += [ConvertJob(d / "hf", model, outtype, "grafted"),
                     MmprojJob(d / "hf", mmproj, mmproj_outtype)]
        out.append(VLFiles(d / "hf", model, mmproj, spec, vs))
    if jobs:
        src_dir = Path(src) if src else find_llamacpp_src()
        if src_dir is None:
            raise FileNotFoundError("llama.cpp converter source not found "
                                    "(set PYGGSPEC_LLAMACPP_SRC)")
        for d, spec, vs in todo:
            write_hf_vl_checkpoint(d / "hf", spec, vs, seed=seed)
        run_llamacpp_converter_jobs(jobs, src_dir)
    return out


def converted_vl_model(cache_dir: str | os.PathLike[str], spec: HFSpec | None = None,
                       vision: VisionSpec | None = None, **kw: Any) -> VLFiles:
    """One :func:`converted_vl_models` variant (defaults: dense tiny text, tiny tower)."""
    return converted_vl_models(cache_dir, [(spec or HFSpec(), vision or VisionSpec())],
                               **kw)[0]


# GGUF names of the vision tower as the converter maps them (gguf-py's TensorNameMap for
# MODEL_ARCH.MMPROJ plus Qwen3VLVisionModel.modify_tensors), per block and for the rest.
_MMPROJ_BLOCK = {
    "attn.proj": "attn_out", "attn.qkv": "attn_qkv", "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down", "norm1": "ln1", "norm2": "ln2",
}
_MMPROJ_TOP = {
    "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2", "merger.norm": "v.post_ln",
    "patch_embed.proj": "v.patch_embd", "pos_embed": "v.position_embd",
}


def _mmproj_name(hf: str) -> str:
    base, _, suffix = hf.removeprefix("model.visual.").rpartition(".")
    if base.startswith("blocks."):
        _, bid, rest = base.split(".", 2)
        return f"v.blk.{bid}.{_MMPROJ_BLOCK[rest]}.{suffix}"
    return f"{_MMPROJ_TOP[base]}.{suffix}"


def write_mmproj(path: str | os.PathLike[str], vision: VisionSpec | None = None,
                 text_hidden: int = 64, *, seed: int = 1, outtype: str = "f16",
                 rms_norm_eps: float = 1e-6, name: str = "Hf") -> Path:
    """The projector GGUF ``convert_hf_to_gguf.py --mmproj`` makes of
    :func:`vision_weights` (``seed``), written directly (numpy + gguf-py, no torch).

    Why: the projector tests then run without torch; tests/test_mmproj.py checks that this
    file equals the converter's, metadata, tensor order, types and data. The converter's
    rules followed: tensors in sorted HF-name order; the Conv3d patch embedding split along
    time into ``v.patch_embd.weight`` and ``.weight.1``; >= 2-D ``.weight`` tensors take
    the outtype except the position embeddings (F32), everything else F32; metadata keys and
    order of ``MmprojModel`` / ``Qwen3VLVisionModel`` (``name``: ``general.name``, which the
    converter derives from the checkpoint's directory name).
    """
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter, LlamaFileType, size_label

    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype {outtype!r}: f32 or f16")
    vs = vision or VisionSpec()
    tensors: list[tuple[str, np.ndarray]] = []
    for hf, a in sorted(vision_weights(vs, text_hidden, seed).items()):
        gname = _mmproj_name(hf)
        if hf.endswith("patch_embed.proj.weight"):
            parts = [(gname, a[:, :, 0]), (gname + ".1", a[:, :, 1])]
        else:
            parts = [(gname, a)]
        for n, t in parts:
            half = (outtype == "f16" and t.ndim >= 2 and n.endswith((".weight", ".weight.1"))
                    and not n.startswith("v.position_embd."))
            tensors.append((n, np.ascontiguousarray(t.astype(np.float16 if half else
                                                             np.float32))))
    ftype = LlamaFileType.MOSTLY_F16 if outtype == "f16" else LlamaFileType.ALL_F32
    w = GGUFWriter(str(path), "clip")
    w.add_type("mmproj")
    w.add_name(name)
    w.add_size_label(size_label(sum(t.size for _, t in tensors), 0, 0, 0))
    w.add_file_type(ftype)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", text_hidden)
    side = round(vs.num_position_embeddings ** 0.5)
    w.add_uint32("clip.vision.image_size", side * vs.patch_size)
    w.add_uint32("clip.vision.patch_size", vs.patch_size)
    w.add_uint32("clip.vision.embedding_length", vs.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", vs.intermediate_size)
    w.add_uint32("clip.vision.block_count", vs.depth)
    w.add_uint32("clip.vision.attention.head_count", vs.num_heads)
    w.add_array("clip.vision.image_mean", list(_PREPROCESSOR["image_mean"]))
    w.add_array("clip.vision.image_std", list(_PREPROCESSOR["image_std"]))
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", vs.spatial_merge_size)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", rms_norm_eps)
    w.add_array("clip.vision.is_deepstack_layers",
                [i in vs.deepstack_visual_indexes for i in range(vs.depth)])
    w.add_quantization_version(2)
    for n, t in tensors:
        w.add_tensor(n, t, raw_dtype=QT.F16 if t.dtype == np.float16 else QT.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def mismatched_vision(vision: VisionSpec, text_hidden: int) -> VisionSpec:
    """The same tower projecting to a different width than ``text_hidden`` (bad pairing)."""
    return replace(vision, out_hidden_size=2 * text_hidden)


# ---------------------------------------------------------------------------------------------
# test images, generated (PNG / BMP written by hand; no image library needed)


def test_image_pixels(width: int = 96, height: int = 64, seed: int = 0) -> np.ndarray:
    """A deterministic RGB image, uint8 [height, width, 3]: smooth gradients plus a little
    noise, so neighbouring patches differ (a flat image would make every image row alike)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = 127.5 * (1 + np.sin(x / 5.0) * np.cos(y / 7.0))
    img = np.stack([r, g, b], axis=-1) + rng.normal(0, 8, (height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def png_bytes(px: np.ndarray) -> bytes:
    """An RGB uint8 [h, w, 3] array as a PNG file (zlib only)."""
    import struct
    import zlib

    height, width = px.shape[:2]
    raw = b"".join(b"\x00" + np.ascontiguousarray(px[i]).tobytes() for i in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))


def bmp_bytes(px: np.ndarray) -> bytes:
    """An RGB uint8 [h, w, 3] array as a 24-bit BMP (uncompressed: cheap for big images)."""
    import struct

    height, width = px.shape[:2]
    stride = (3 * width + 3) & ~3
    rows = np.zeros((height, stride), dtype=np.uint8)
    rows[:, : 3 * width] = px[::-1, :, ::-1].reshape(height, 3 * width)  # bottom-up, BGR
    data = rows.tobytes()
    header = struct.pack("<2sIHHI", b"BM", 54 + len(data), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(data), 2835, 2835, 0, 0)
    return header + info + data


def test_image_png(width: int = 96, height: int = 64, seed: int = 0) -> bytes:
    """:func:`test_image_pixels` as PNG bytes."""
    return png_bytes(test_image_pixels(width, height, seed))


test_image_pixels.__test__ = False  # type: ignore[attr-defined]  # not pytest tests
test_image_png.__test__ = False  # type: ignore[attr-defined]
