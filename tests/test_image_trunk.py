"""Image rows in the trunk graph against llama.cpp + libmtmd on the same files (issue 52).

The projector is ``write_mmproj``'s (equal to llama.cpp's converter output, see
tests/test_mmproj.py), paired with the project's own tiny text models, so this runs
without torch. The oracle is libmtmd's own image decode into a llama.cpp context
(``pyggspec.testing.oracle_vision``): image rows as embedding batches at its M-RoPE
positions, text as token batches.

Evaluated with llama.cpp's split (text chunk, image chunk, text chunk as separate batches)
f32 logits are bit-identical, as the text oracle tests demand of f32; with the whole prompt
in one mixed ubatch (text and image rows together, which llama.cpp never does) the chunked
gated-delta kernels sum in another order, so the bound is the split noise the text tests
measure (1e-4 relative) and greedy tokens are identical.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj
from pyggspec.testing.oracle import rel_err
from pyggspec.testing.oracle_vision import image_prompt
from pyggspec.vision.projector import ImageChunk, Projector
from pyggspec.vision.rows import chunk_rows, prompt_rows

PROMPT = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
N_GREEDY = 8


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mmproj(tmp_path_factory.mktemp("img") / "mmproj.gguf", VisionSpec(), 64)


def _image(seed: int = 1, w: int = 96, h: int = 64) -> bytes:
    return png_bytes(test_image_pixels(w, h, seed=seed))


def _greedy(engine, last: np.ndarray, n: int, rows: list | None = None) -> list[int]:
    out, lg = [], last
    for _ in range(n):
        t = int(lg.argmax())
        out.append(t)
        lg = engine.eval([t], 0)[-1]
        if rows is not None:
            rows.append(lg)
    return out


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_image_prompt_logits_match_libmtmd(models, make_engine, mmproj, arch):
    path = models.get(arch, dtype="f32")
    img = _image()
    ref = image_prompt(path, mmproj, PROMPT, [img], n_new=N_GREEDY)
    e = make_engine(path, n_ctx=256)
    with Projector(mmproj, path, n_threads=2, offload=False) as p:
        chunks = p.tokenize(PROMPT, [img])
        assert any(isinstance(c, ImageChunk) for c in chunks)
        # llama.cpp's split: one batch per chunk -> bit-identical f32 logits
        for c in chunks:
            r = chunk_rows(p, [c])
            res = e.decode({0: r.tokens}, media={0: r.media} if r.media else None)
        split = res[0].logits[-1]
        assert e.seq_len(0) == ref.n_rows
        assert np.array_equal(split, ref.logits), f"max rel err {rel_err(split, ref.logits):.3g}"
        assert _greedy(e, split, N_GREEDY) == ref.greedy
        # the whole prompt in one mixed ubatch
        e.clear(0)
        r = prompt_rows(p, PROMPT, [img])
        mixed = e.decode({0: r.tokens}, media={0: r.media})[0].logits[-1]
        assert rel_err(mixed, ref.logits) <= 1e-4
        assert _greedy(e, mixed, N_GREEDY) == ref.greedy


def test_image_reaches_logits_and_chunking_agrees(models, make_engine, mmproj):
    """Another image changes the logits; a prompt cut into ubatches of 5 rows (across the
    image) gives the one-ubatch logits within split noise; two sequences in one ubatch,
    one with the image and one with text only, each equal their solo runs."""
    path = models.dense(dtype="f32")
    a, b = _image(1), _image(2)
    e = make_engine(path, n_ctx=256, n_parallel=2, n_ubatch=5, n_batch=5)
    with Projector(mmproj, path, n_threads=2, offload=False) as p:
        ra, rb = prompt_rows(p, PROMPT, [a]), prompt_rows(p, PROMPT, [b])
        la = e.decode({0: ra.tokens}, media={0: ra.media})[0].logits[-1]
        e.clear(0)
        lb = e.decode({0: rb.tokens}, media={0: rb.media})[0].logits[-1]
        assert np.abs(la - lb).max() > 1e-3
        e.clear(0)
        ref = image_prompt(path, mmproj, PROMPT, [a])
        assert rel_err(la, ref.logits) <= 1e-4
        text = [int(t) for t in np.random.default_rng(5).integers(5, 200, size=13)]
        both = e.decode({0: ra.tokens, 1: text}, media={0: ra.media})
        assert rel_err(both[0].logits[-1], la) <= 1e-5
        e.clear(0)
        e.clear(1)
        solo = e.decode({1: text})[1].logits[-1]
        assert rel_err(both[1].logits[-1], solo) <= 1e-5


def test_position_after_image(models, make_engine, mmproj):
    """Text after an image continues at llama.cpp's position (max(nx, ny) past the image),
    not at its cell: the logits of every token decoded after the prompt equal the oracle's
    (at the cell's position they differ by ~1e-2 on this model), and the rows are cells
    (seq_len counts image rows)."""
    path = models.dense(dtype="f32")
    img = _image(3, 200, 70)  # a wide image: nx != ny, rows != positions
    e = make_engine(path, n_ctx=256)
    with Projector(mmproj, path, n_threads=2, offload=False) as p:
        r = prompt_rows(p, PROMPT, [img])
        (c,) = [c for c in r.chunks if isinstance(c, ImageChunk)]
        assert c.nx != c.ny and r.media.shift == c.n_tokens - max(c.nx, c.ny)
    ref = image_prompt(path, mmproj, PROMPT, [img], n_new=N_GREEDY)
    last = e.decode({0: r.tokens}, media={0: r.media})[0].logits[-1]
    assert e.seq_len(0) == ref.n_rows == len(r.tokens)
    rows: list[np.ndarray] = []
    assert _greedy(e, last, N_GREEDY, rows) == ref.greedy
    assert np.array_equal(np.array(rows), ref.greedy_logits)


def test_bad_media_rows(models, make_engine, mmproj):
    from pyggspec.errors import PyggspecError

    path = models.dense(dtype="f32")
    e = make_engine(path, n_ctx=256)
    with Projector(mmproj, path, n_threads=2, offload=False) as p:
        r = prompt_rows(p, PROMPT, [_image()])
    with pytest.raises(PyggspecError, match="media rows do not match"):
        e.decode({0: r.tokens[:-1]}, media={0: r.media})
    with pytest.raises(PyggspecError, match="out of range"):
        e.decode({0: r.tokens})  # image rows without their embeddings
