"""The projector without torch: ``write_mmproj`` (proven equal to llama.cpp's converter output
in tests/test_mmproj.py) paired with the project's own tiny text model, so CI runs libmtmd
even where the converter tests are skipped. The text vocabulary has no <|vision_start|> /
<|vision_end|> tokens; libmtmd then writes them as plain text, which changes nothing here."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pyggspec.errors import ModelFileError
from pyggspec.testing.hf_vision import (
    VisionSpec,
    mismatched_vision,
    png_bytes,
    test_image_pixels,
    write_mmproj,
)
from pyggspec.vision.positions import prompt_positions
from pyggspec.vision.projector import ImageChunk, ImageError, Projector, TextChunk

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mmproj")
    vs = VisionSpec()
    return {"model": models.dense(), "moe": models.moe(),
            "mmproj": write_mmproj(d / "mmproj.gguf", vs, 64),
            "mismatch": write_mmproj(d / "mismatch.gguf", mismatched_vision(vs, 64), 64),
            "f32": write_mmproj(d / "mmproj-f32.gguf", replace(vs, depth=1), 64,
                                outtype="f32")}


def test_projector_rows(files: dict[str, Path]) -> None:
    with Projector(files["mmproj"], files["model"], n_threads=2, offload=False) as p:
        assert p.n_embd == 64 and p.uses_mrope and p.compute_buffers.get("CPU", 0) > 0
        data = png_bytes(test_image_pixels(200, 70, seed=4))
        chunks = p.tokenize("describe <__media__> please", [data])
        assert [type(c) for c in chunks] == [TextChunk, ImageChunk, TextChunk]
        img = chunks[1]
        assert isinstance(img, ImageChunk) and img.n_tokens == img.nx * img.ny >= 8
        rows = p.encode(img)
        assert rows.shape == (img.n_tokens, 64) and np.isfinite(rows).all()
        assert np.array_equal(rows, p.encode(img))
        pos, nxt = prompt_positions(chunks)
        assert pos.shape == (4, sum(c.n_tokens for c in chunks))
        assert nxt == sum(c.n_pos for c in chunks)
        with pytest.raises(ImageError, match="cannot decode"):
            p.image(b"\x89PNG\r\n\x1a\n broken", "b.png")
    for name, model in (("f32", "model"), ("mmproj", "moe")):
        with Projector(files[name], files[model], offload=False) as p:
            (c,) = [c for c in p.tokenize("<__media__>", [data]) if isinstance(c, ImageChunk)]
            assert p.encode(c).shape == (c.n_tokens, 64)


def test_mismatch_and_wrong_files(files: dict[str, Path]) -> None:
    with pytest.raises(ModelFileError, match="outputs rows of 128.*takes 64"):
        Projector(files["mismatch"], files["model"])
    with pytest.raises(ModelFileError, match="not a projector"):
        Projector(files["model"], files["model"])
    with pytest.raises(ModelFileError, match="CLIP cannot be used as main model"):
        Projector(files["mmproj"], files["mmproj"])


def test_inspect(files: dict[str, Path]) -> None:
    r = subprocess.run([sys.executable, "-m", "pyggspec", "inspect", str(files["model"]),
                        "--mmproj", str(files["mmproj"]), "--no-mmproj-offload", "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["mmproj"]["projector_type"] == "qwen3vl_merger"
    assert d["memory"]["mmproj"]["CPU"] == d["mmproj"]["weights"]["CPU"] > 0


# ------------------------------------------------------- llama.cpp + libmtmd (the oracle)

def test_oracle_image_prompt(files: dict[str, Path]) -> None:
    """llama.cpp's own image-prompt decode runs on these files, deterministically, sees the
    image, and advances positions as pyggspec.vision.positions says."""
    from pyggspec.testing.oracle_vision import image_prompt

    a = png_bytes(test_image_pixels(96, 64, seed=1))
    b = png_bytes(test_image_pixels(96, 64, seed=2))
    prompt = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
    r1 = image_prompt(files["model"], files["mmproj"], prompt, [a], n_new=3)
    r2 = image_prompt(files["model"], files["mmproj"], prompt, [a], n_new=3)
    r3 = image_prompt(files["model"], files["mmproj"], prompt, [b])
    assert np.isfinite(r1.logits).all() and np.array_equal(r1.logits, r2.logits)
    assert r1.greedy == r2.greedy and len(r1.greedy) == 3
    assert np.abs(r1.logits - r3.logits).max() > 1e-3  # the image reaches the logits
    with Projector(files["mmproj"], files["model"], offload=False) as p:
        chunks = p.tokenize(prompt, [a])
    _, nxt = prompt_positions(chunks)
    assert (r1.n_past, r1.n_rows) == (nxt, sum(c.n_tokens for c in chunks))


def test_libmtmd_checks_width_only_with_a_full_model(files: dict[str, Path]) -> None:
    """With the full model libmtmd refuses the mismatched projector itself; with the
    vocab-only one it would not (llama_model_n_embd_inp is 0), hence Projector's own check."""
    from pyggspec.testing.oracle import OracleModel
    from pyggspec.tokenizer import Tokenizer
    from pyggspec.vision import _mtmd

    with (OracleModel(files["model"]) as om,
          pytest.raises(_mtmd.MtmdError, match="mismatch between text model")):
        _mtmd.Context(str(files["mismatch"]), om.model, use_gpu=False, n_threads=2,
                      image_min_tokens=None, image_max_tokens=None)
    with Tokenizer(files["model"]) as tok:
        ctx = _mtmd.Context(str(files["mismatch"]), tok._model, use_gpu=False, n_threads=2,
                            image_min_tokens=None, image_max_tokens=None, warmup=False)
        ctx.close()
