"""The vision projector (issue 52, groundwork): a tiny Qwen3.5 VL checkpoint converted by
llama.cpp's converter (text GGUF + ``--mmproj``), opened with libmtmd through
``pyggspec.vision``: facts, prompt -> chunks, image -> embedding rows, bad input.

Oracle for the rows: transformers' own Qwen3-VL vision model (Qwen3.5's tower is Qwen3-VL's
without deepstack) on the same weights and the same pixels; llama.cpp's mtmd CLI is not
built here. Needs torch + transformers and the llama.cpp source, like the other converter
tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.converter

REPO = Path(__file__).resolve().parents[1]


def _skip_reason() -> str | None:
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed (pip install torch==2.13.0 transformers==4.57.6)"
    from pyggspec.testing.hf_checkpoint import find_llamacpp_src

    if find_llamacpp_src(REPO) is None:
        return "llama.cpp converter source not found (PYGGSPEC_LLAMACPP_SRC)"
    return None


_REASON = _skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

from pyggspec.errors import ModelFileError
from pyggspec.testing.hf_checkpoint import HFSpec
from pyggspec.testing.hf_vision import (
    VISION_TOKENS,
    VisionSpec,
    VLFiles,
    bmp_bytes,
    converted_vl_models,
    mismatched_vision,
    png_bytes,
    test_image_pixels,
    vision_weights,
    write_mmproj,
)
from pyggspec.tokenizer import Tokenizer
from pyggspec.vision.projector import (
    ImageChunk,
    ImageError,
    Projector,
    TextChunk,
    read_projector_info,
)


@pytest.fixture(scope="session")
def vl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, VLFiles]:
    """dense, moe, and a projector that does not fit the dense model (one converter run)."""
    dense, vs = HFSpec(), VisionSpec()
    files = converted_vl_models(tmp_path_factory.mktemp("vl"), [
        (dense, vs), (replace(dense, moe=True), vs), (dense, mismatched_vision(vs, 64))])
    return dict(zip(("dense", "moe", "mismatch"), files))


@pytest.fixture(scope="module")
def proj(vl: dict[str, VLFiles]):
    with Projector(vl["dense"].mmproj, vl["dense"].model, n_threads=2, offload=False) as p:
        yield p


def _image_chunks(chunks: list) -> list[ImageChunk]:
    return [c for c in chunks if isinstance(c, ImageChunk)]


# ------------------------------------------------------------------------------- the fixture

def test_fixture_files(vl: dict[str, VLFiles]) -> None:
    """The converter kept the MTP head and the vision tokens, and wrote a Qwen3-VL projector."""
    from pyggspec.modelfile.gguf import GGUFFile

    for name in ("dense", "moe"):
        g = GGUFFile(vl[name].model)
        arch = g.get("general.architecture")
        assert arch == ("qwen35moe" if name == "moe" else "qwen35")
        assert g.get(f"{arch}.nextn_predict_layers") == 1
        toks = list(g.get("tokenizer.ggml.tokens"))
        assert all(t in toks for t in VISION_TOKENS)
        assert not any(n.startswith(("v.", "mm.")) for n in g.tensors)
        g.close()
        m = GGUFFile(vl[name].mmproj)
        assert (m.get("general.architecture"), m.get("general.type")) == ("clip", "mmproj")
        assert m.get("clip.projector_type") == "qwen3vl_merger"
        assert "v.patch_embd.weight.1" in m.tensors and "mm.2.bias" in m.tensors
        assert not any(n.startswith("blk.") for n in m.tensors)
        m.close()


def test_writer_matches_converter(vl: dict[str, VLFiles], tmp_path: Path) -> None:
    """``write_mmproj`` (no torch: what the CI-run projector tests use) writes the converter's
    file exactly: metadata (keys, types, values, order), tensors, order, types and data."""
    from pyggspec.testing.layout import (
        compare_layouts,
        compare_values,
        format_differences,
        read_layout,
    )

    for name in ("dense", "mismatch"):
        f = vl[name]
        ours = write_mmproj(tmp_path / f"{name}.gguf", f.vision, f.spec.n_embd, seed=1,
                            rms_norm_eps=f.spec.rms_norm_eps)
        diffs = compare_layouts(read_layout(f.mmproj), read_layout(ours), check_kv_order=True)
        diffs += compare_values(f.mmproj, ours)
        assert not diffs, f"{name}:\n" + format_differences(diffs)


# ------------------------------------------------------------------------------------ facts

def test_projector_info(vl: dict[str, VLFiles]) -> None:
    vs = vl["dense"].vision
    info = read_projector_info(vl["dense"].mmproj)
    assert info.projector_type == "qwen3vl_merger" and info.supported
    assert info.n_embd == info.projection_dim == 64
    assert (info.n_embd_vision, info.n_layer, info.n_head, info.n_ff) == (
        vs.hidden_size, vs.depth, vs.num_heads, vs.intermediate_size)
    assert (info.patch_size, info.n_merge, info.n_deepstack) == (16, 2, 0)
    assert (info.image_min_tokens, info.image_max_tokens) == (8, 4096)
    assert set(info.tensor_types) == {"f16", "f32"}
    assert sum(info.tensor_types.values()) == info.n_tensors == 4 + 12 * vs.depth + 6
    assert 0 < info.weights_bytes < info.file_size
    bad = read_projector_info(vl["mismatch"].mmproj)
    assert (bad.n_embd, bad.projection_dim) == (128, 64)  # the rows, not the written key


def test_projector_opens(proj: Projector, vl: dict[str, VLFiles]) -> None:
    assert proj.n_embd == 64 and proj.uses_mrope and proj.marker == "<__media__>"
    assert set(proj.compute_buffers) == {"CPU"} and proj.compute_buffers["CPU"] > 0
    with Tokenizer(vl["moe"].model) as tok:
        with Projector(vl["moe"].mmproj, tok, offload=False) as p:
            assert p.tokenizer is tok and p.n_embd == 64
        assert not tok.closed  # a shared tokenizer is the caller's to close


# --------------------------------------------------------------------------- prompt -> chunks

def test_tokenize_chunks(proj: Projector) -> None:
    data = png_bytes(test_image_pixels(96, 64))
    prompt = "<|im_start|>user\nLook: <__media__> what is it?<|im_end|>"
    chunks = proj.tokenize(prompt, [data])
    assert [type(c) for c in chunks] == [TextChunk, ImageChunk, TextChunk]
    tok = proj.tokenizer
    start, end = (tok.tokenize(t, add_special=False)[0] for t in VISION_TOKENS[:2])
    before, img, after = chunks
    assert list(before.tokens) == tok.tokenize("<|im_start|>user\nLook: ") + [start]
    assert list(after.tokens) == [end] + tok.tokenize(" what is it?<|im_end|>",
                                                      add_special=False)
    # 96x64 is under the 8-token minimum: libmtmd scales it up to 128x96 -> 4x3 rows
    assert (img.nx, img.ny, img.n_tokens, img.n_pos) == (4, 3, 12, 4)
    assert img.id == hashlib.sha256(data).hexdigest() and img.non_causal is False
    # no marker: the image is not placed; a mismatch is refused before libmtmd
    with pytest.raises(ImageError, match="0 <__media__> marker"):
        proj.tokenize("no marker", [data])
    assert [type(c) for c in proj.tokenize("two <__media__><__media__>", [data, data])] == [
        TextChunk, ImageChunk, TextChunk, ImageChunk, TextChunk]


def test_image_token_budget(vl: dict[str, VLFiles], proj: Projector) -> None:
    """libmtmd's budget for this projector: at least 8, at most 4096 merged tokens."""
    small = proj.tokenize("<__media__>", [png_bytes(test_image_pixels(16, 16))])
    assert _image_chunks(small)[0].n_tokens >= 8
    big = bmp_bytes(np.full((2112, 2112, 3), 128, dtype=np.uint8))  # 4356 tokens unscaled
    (c,) = _image_chunks(proj.tokenize("<__media__>", [big]))
    assert 4096 - 2 * 64 < c.n_tokens <= 4096 and c.nx == c.ny
    with Projector(vl["dense"].mmproj, proj.tokenizer, image_max_tokens=16,
                   offload=False) as p:
        (c,) = _image_chunks(p.tokenize("<__media__>", [big]))
        assert c.n_tokens <= 16


# ---------------------------------------------------------------------------- image -> rows

def test_encode_rows(proj: Projector, vl: dict[str, VLFiles]) -> None:
    a = png_bytes(test_image_pixels(96, 64, seed=1))
    b = png_bytes(test_image_pixels(96, 64, seed=2))
    (ca,) = _image_chunks(proj.tokenize("<__media__>", [a]))
    (cb,) = _image_chunks(proj.tokenize("<__media__>", [b]))
    ea, eb = proj.encode(ca), proj.encode(cb)
    assert ea.shape == (ca.n_tokens, 64) and ea.dtype == np.float32
    assert np.isfinite(ea).all() and np.abs(ea).max() > 0.1
    assert np.array_equal(ea, proj.encode(ca))  # deterministic
    assert not np.allclose(ea, eb)  # the pixels matter
    assert len({r.tobytes() for r in ea}) == ca.n_tokens  # every row its own
    with Projector(vl["dense"].mmproj, proj.tokenizer, offload=False) as fresh:  # a fresh context agrees
        (c2,) = _image_chunks(fresh.tokenize("<__media__>", [a]))
        assert np.array_equal(fresh.encode(c2), ea)


def test_encode_matches_transformers(proj: Projector, vl: dict[str, VLFiles]) -> None:
    """libmtmd's rows == transformers' Qwen3-VL vision model on the same weights and pixels.

    128x96 is a multiple of 32 inside the budget, so libmtmd does not resample it; the HF
    weights are rounded to f16 where the converter wrote f16. What is left is ggml's f16
    matmuls and the merger's GELU (tanh in ggml, erf in HF).
    """
    import torch
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLVisionConfig,
        Qwen3VLVisionModel,
    )

    f = vl["dense"]
    cfg = json.loads((f.hf_dir / "config.json").read_text())["vision_config"]
    cfg.pop("model_type")
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**cfg)).eval()
    sd = {}
    for k, v in vision_weights(f.vision, f.spec.n_embd, seed=1).items():
        k = k.removeprefix("model.visual.")
        if v.ndim >= 2 and k != "pos_embed.weight":
            v = v.astype(np.float16).astype(np.float32)
        sd[k] = torch.from_numpy(v)
    model.load_state_dict(sd, strict=True)
    px = test_image_pixels(128, 96, seed=3)
    proc = Qwen2VLImageProcessor(do_resize=False, patch_size=16, temporal_patch_size=2,
                                 merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    inp = proc(images=[px], return_tensors="pt")
    with torch.no_grad():
        out = model(inp["pixel_values"], grid_thw=inp["image_grid_thw"])
    ref = (out[0] if isinstance(out, tuple) else out).numpy()
    (c,) = _image_chunks(proj.tokenize("<__media__>", [png_bytes(px)]))
    assert (c.nx, c.ny) == (4, 3)
    rows = proj.encode(c)
    assert rows.shape == ref.shape
    err = np.abs(rows - ref).max() / np.abs(ref).max()
    assert err < 5e-3, err


# -------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("data,why", [
    (b"", "empty image"),
    (b"not an image at all", "cannot decode the image"),
    (png_bytes(test_image_pixels(40, 40))[:60], "cannot decode the image"),
])
def test_bad_image_bytes(proj: Projector, data: bytes, why: str) -> None:
    with pytest.raises(ImageError) as e:
        proj.image(data, "x.png")
    assert str(e.value).startswith("pyggspec: x.png: ") and why in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_projector(vl: dict[str, VLFiles], tmp_path: Path, proj: Projector) -> None:
    tok = proj.tokenizer
    with pytest.raises(ModelFileError, match="outputs rows of 128.*takes 64") as e:
        Projector(vl["mismatch"].mmproj, tok)
    assert str(e.value).startswith(f"pyggspec: {vl['mismatch'].mmproj}: ")
    with pytest.raises(ModelFileError, match="not a projector"):
        Projector(vl["dense"].model, tok)
    with pytest.raises(ModelFileError, match="no such file"):
        Projector(tmp_path / "missing.gguf", tok)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(ModelFileError):
        Projector(junk, tok)


def test_bad_input_in_a_subprocess(vl: dict[str, VLFiles], tmp_path: Path) -> None:
    """A mismatched projector and corrupt bytes give one line, no traceback, no abort."""
    code = (
        "import sys\n"
        "from pyggspec.errors import PyggspecError\n"
        "from pyggspec.vision.projector import Projector\n"
        "try:\n"
        f"    p = Projector({str(vl['mismatch'].mmproj)!r}, {str(vl['dense'].model)!r})\n"
        "except PyggspecError as e:\n"
        "    print(e)\n"
        f"p = Projector({str(vl['dense'].mmproj)!r}, {str(vl['dense'].model)!r})\n"
        "try:\n"
        "    p.image(b'\\x89PNG\\r\\n\\x1a\\n garbage', 'bad.png')\n"
        "except PyggspecError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(x.startswith("pyggspec: ") for x in lines), r.stdout
    assert "n_embd" in lines[0] and lines[1].startswith("pyggspec: bad.png: cannot decode")
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ pyggspec inspect --mmproj

def _inspect(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyggspec", "inspect", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)


def test_inspect_mmproj(vl: dict[str, VLFiles]) -> None:
    f = vl["dense"]
    plain = json.loads(_inspect(f.model, "--json").stdout)
    r = _inspect(f.model, "--mmproj", f.mmproj, "--no-mmproj-offload", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    mm, info = d["mmproj"], read_projector_info(f.mmproj)
    assert (mm["projector_type"], mm["n_embd"], mm["matches_model"]) == (
        "qwen3vl_merger", 64, True)
    assert (mm["image_min_tokens"], mm["image_max_tokens"]) == (8, 4096)
    assert mm["vision"]["n_layer"] == f.vision.depth and mm["n_tensors"] == info.n_tensors
    assert mm["weights"] == {"CPU": info.weights_bytes}
    assert set(mm["compute"]) == {"CPU"} and mm["compute"]["CPU"] > 0
    mem = d["memory"]
    added = info.weights_bytes + mm["compute"]["CPU"]
    assert (mem["mmproj"], mem["mmproj_compute"]) == (mm["weights"], mm["compute"])
    assert mem["total_bytes"] == plain["memory"]["total_bytes"] + added
    assert mem["by_device"]["CPU"] == plain["memory"]["by_device"]["CPU"] + added
    # the human report: a projector row, and the projector in the engine plan's sum
    r = _inspect(f.model, "-mm", f.mmproj, "--no-mmproj-offload")
    assert r.returncode == 0, r.stderr[-2000:]
    for s in ("projector", "qwen3vl_merger", "image budget 8..4096 tokens", "mmproj_compute",
              f.mmproj.name):
        assert s in r.stdout, (s, r.stdout)


@pytest.mark.parametrize("which,msg", [("mismatch", "outputs rows of 128"),
                                       ("text", "not a projector (mmproj) file")])
def test_inspect_bad_mmproj(vl: dict[str, VLFiles], which: str, msg: str) -> None:
    f = vl["dense"]
    bad = vl["mismatch"].mmproj if which == "mismatch" else f.model
    r = _inspect(f.model, "--mmproj", bad)
    assert r.returncode == 1 and r.stdout == ""
    line = r.stderr.strip()
    assert line.startswith(f"pyggspec: {bad}: ") and msg in line and "\n" not in line, r.stderr


# ------------------------------------------------------------------------------- positions

def test_positions_match_libmtmd(proj: Projector) -> None:
    """Our M-RoPE positions == libmtmd's own (mtmd_helper_image_get_decoder_pos), and the
    position after each chunk advances by its n_pos as libmtmd counts it."""
    from pyggspec.vision.positions import image_positions, prompt_positions

    wide = png_bytes(test_image_pixels(200, 70, seed=4))
    tall = png_bytes(test_image_pixels(64, 160, seed=5))
    chunks = proj.tokenize("a <__media__> b <__media__> c", [wide, tall])
    pos, nxt = prompt_positions(chunks, pos_0=5)
    assert nxt == 5 + sum(c.n_pos for c in chunks)
    row, p = 0, 5
    for c in chunks:
        if isinstance(c, ImageChunk):
            assert c.nx != c.ny and c.n_pos == max(c.nx, c.ny)
            t, x, y, z = proj.decoder_positions(c, p).T  # libmtmd's (t, x, y, z)
            ours = image_positions(c.nx, c.ny, p)
            assert np.array_equal(ours, np.stack([t, y, x, z]))  # batch order (t, y, x, z)
            assert np.array_equal(pos[:, row:row + c.n_tokens], ours)
        row += c.n_tokens
        p += c.n_pos
    assert row == pos.shape[1]
