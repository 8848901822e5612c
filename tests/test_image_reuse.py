"""Prompt reuse over image rows and slot files holding them (issue 52, item 2).

A slot's cached image rows are reused by a later prompt when it holds the same image (by
content, as llama-server keys them) at the same cells; a different image stops the reuse at
its first row. Slot files keep the image rows, restore them in another slot or process, and
are refused without the projector that encoded them (llama-server's words).

Oracle: llama.cpp + libmtmd on the same files (greedy tokens identical)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyggspec.memory.slotfile import SlotFileError
from pyggspec.models.batch import MediaRows, SlotRows
from pyggspec.testing.hf_vision import VisionSpec, png_bytes, test_image_pixels, write_mmproj
from pyggspec.testing.oracle_vision import image_prompt

TURN1 = "<|im_start|>user\nLook <__media__> here<|im_end|>\n<|im_start|>assistant\n"
N = 6


@pytest.fixture(scope="module")
def files(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("imgreuse")
    return {"model": models.dense(dtype="f32"),
            "mmproj": write_mmproj(d / "mmproj.gguf", VisionSpec(), 64),
            "other_mmproj": write_mmproj(d / "other.gguf", VisionSpec(), 64, seed=2),
            "a": png_bytes(test_image_pixels(200, 70, seed=3)),
            "b": png_bytes(test_image_pixels(200, 70, seed=4)), "dir": d}


def _oracle(files, prompt: str, images: list[bytes]) -> list[int]:
    return image_prompt(files["model"], files["mmproj"], prompt, images, n_new=N).greedy


def _engine(make_engine, files, **kw):
    return make_engine(files["model"], n_ctx=256, mmproj=files["mmproj"],
                       mmproj_offload=False, load_tokenizer=True, **kw)


def _image_start(e, files) -> int:
    rows = e.image_rows(TURN1, [files["a"]])
    return rows.tokens.index(-1)


def _image_end(e, files) -> int:
    """The row after the image (a hybrid model resumes at a checkpoint at or before the
    common prefix: reuse past this row is reuse of the image rows)."""
    t = e.image_rows(TURN1, [files["a"]]).tokens
    return len(t) - t[::-1].index(-1)


@pytest.mark.parametrize("spec", [False, True])
def test_same_image_is_reused_another_is_not(files, make_engine, spec):
    kw = {"spec_type": "draft-mtp"} if spec else {}
    e = _engine(make_engine, files, **kw)
    first = e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["a"]])
    assert first.tokens == _oracle(files, TURN1, [files["a"]])
    n_prompt = len(e.image_rows(TURN1, [files["a"]]).tokens)
    again = e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["a"]])
    assert again.tokens == first.tokens
    assert _image_end(e, files) <= again.cache_n <= n_prompt - 1
    other = e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["b"]])
    assert other.tokens == _oracle(files, TURN1, [files["b"]])
    # the text before the image at most (a checkpoint there, if any: none is here)
    assert other.cache_n <= _image_start(e, files)


def test_next_chat_turn_reuses_the_image(files, make_engine):
    """Turn 2 sends turn 1, its answer and a new question with the same image: the slot
    continues after the answer instead of prefilling (and encoding) the image again."""
    e = _engine(make_engine, files)
    first = e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["a"]])
    turn2 = (TURN1 + first.text + "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n"
             "<|im_start|>assistant\n")
    second = e.generate(turn2, max_tokens=N, ignore_eos=True, images=[files["a"]])
    # past the image (where turn 1's answer, retokenized, first differs from its tokens,
    # or the checkpoint before it)
    assert second.cache_n >= _image_end(e, files)
    assert second.tokens == _oracle(files, turn2, [files["a"]])


def test_slot_file_keeps_image_rows(files, make_engine, tmp_path):
    e = _engine(make_engine, files, n_parallel=2, spec_type="draft-mtp")
    first = e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["a"]])
    n_prompt = len(e.image_rows(TURN1, [files["a"]]).tokens)
    path = tmp_path / "img.slot"
    saved = e.save_slot(0, path)
    e.erase_slot(0)
    # a fresh engine (another process, as llama-server's restart test) restores it in slot 1
    f = _engine(make_engine, files, n_parallel=2, spec_type="draft-mtp")
    assert f.restore_slot(1, path).n_tokens == saved.n_tokens
    # two prompts pin to slots 0 and 1: the image one lands on the restored slot
    r = f.generate_batch(["x", TURN1], max_tokens=N, ignore_eos=True,
                         images=[None, [files["a"]]])[1]
    assert r.tokens == first.tokens and _image_end(f, files) <= r.cache_n <= n_prompt - 1
    # a different image after a restore: only the text before it is reused
    f.restore_slot(0, path)
    o = f.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["b"]])
    assert o.cache_n <= _image_start(f, files)
    assert o.tokens == _oracle(files, TURN1, [files["b"]])


def test_slot_file_with_images_needs_its_projector(files, make_engine, tmp_path):
    e = _engine(make_engine, files)
    e.generate(TURN1, max_tokens=N, ignore_eos=True, images=[files["a"]])
    path = tmp_path / "img.slot"
    e.save_slot(0, path)
    text = make_engine(files["model"], n_ctx=256, load_tokenizer=True)
    with pytest.raises(SlotFileError, match="Cannot restore media tokens without an mmproj"):
        text.restore_slot(0, path)
    r = text.generate("The quick brown fox", max_tokens=N, ignore_eos=True)  # still usable
    assert len(r.tokens) == N
    other = make_engine(files["model"], n_ctx=256, mmproj=files["other_mmproj"],
                        mmproj_offload=False, load_tokenizer=True)
    with pytest.raises(SlotFileError, match="another projector"):
        other.restore_slot(0, path)
    # a text-only slot file restores without a projector
    e.generate("only text here", max_tokens=N, ignore_eos=True)
    e.save_slot(0, tmp_path / "text.slot")
    assert text.restore_slot(0, tmp_path / "text.slot").n_tokens > 0


def _rows(images, n_rows: int = 20) -> MediaRows:
    is_embd = np.zeros(n_rows, bool)
    for a, n, _ in images or [(4, 5, "")]:
        is_embd[a:a + n] = True
    return MediaRows(np.zeros((int(is_embd.sum()), 2), np.float32), is_embd,
                     np.zeros((4, n_rows), np.int32), n_rows,
                     None if images is None else tuple(images))


def test_same_images_cuts_at_the_first_other_image():
    """The reuse rule on constructed spans: a common prefix of n cells is kept up to the
    first image that is not the same image at the same cells in both."""
    t = SlotRows(1)
    t.add(0, 0, _rows([(4, 5, "A"), (12, 3, "B")]))
    assert t.same_images(0, _rows([(4, 5, "A"), (12, 3, "B")]), 19) == 19
    assert t.same_images(0, _rows([(4, 5, "A"), (12, 3, "C")]), 19) == 12
    assert t.same_images(0, _rows([(4, 5, "X"), (12, 3, "B")]), 19) == 4
    assert t.same_images(0, _rows([(4, 5, "A")]), 19) == 12  # the slot's second image
    assert t.same_images(0, _rows([(4, 5, "A"), (12, 3, "C")]), 10) == 10  # before it
    assert t.same_images(0, None, 19) == 4  # a text prompt keeps the text before it
    assert t.same_images(0, None, 3) == 3
    assert t.same_images(0, _rows(None), 19) == 4  # images of unknown content: never
    u = SlotRows(1)
    u.add(0, 0, _rows(None))
    assert u.same_images(0, _rows([(4, 5, "A")]), 19) == 4
    assert SlotRows(1).same_images(0, _rows([(4, 5, "A")]), 19) == 4  # nothing held
