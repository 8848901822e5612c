"""M-RoPE positions of text and image rows (``pyggspec.vision.positions``): llama.cpp's rules
written out by hand on small cases (libmtmd itself is the judge in tests/test_mmproj.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pyggspec.vision.positions import (
    image_n_pos,
    image_positions,
    prompt_positions,
    text_positions,
)


@dataclass
class Text:
    tokens: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Img:
    nx: int
    ny: int

    @property
    def n_tokens(self) -> int:
        return self.nx * self.ny


def test_image_rows_3x2() -> None:
    p = image_positions(3, 2, 10)
    assert p.dtype == np.int32 and p.shape == (4, 6)
    assert p[0].tolist() == [10] * 6  # t: the image's start for every row
    assert p[1].tolist() == [10, 10, 10, 11, 11, 11]  # y: the row
    assert p[2].tolist() == [10, 11, 12, 10, 11, 12]  # x: the column
    assert p[3].tolist() == [0] * 6
    assert image_n_pos(3, 2) == 3 and image_n_pos(2, 5) == 5


def test_text_rows() -> None:
    p = text_positions(3, 4)
    assert p.tolist() == [[4, 5, 6], [4, 5, 6], [4, 5, 6], [0, 0, 0]]
    assert text_positions(0, 9).shape == (4, 0)


def test_prompt_walk() -> None:
    """text (3) | image 4x3 | text (2): the image starts at 3 and advances max(4, 3) = 4."""
    pos, nxt = prompt_positions([Text((1, 2, 3)), Img(4, 3), Text((7, 8))], pos_0=0)
    assert pos.shape == (4, 3 + 12 + 2) and nxt == 3 + 4 + 2
    assert pos[:, :3].tolist() == text_positions(3, 0).tolist()
    assert np.array_equal(pos[:, 3:15], image_positions(4, 3, 3))
    assert pos[:, 15:].tolist() == [[7, 8], [7, 8], [7, 8], [0, 0]]
    # a later turn continues from where the first one stopped
    pos2, nxt2 = prompt_positions([Img(2, 2)], pos_0=nxt)
    assert pos2[0].tolist() == [9] * 4 and nxt2 == 11
    assert prompt_positions([], 5)[1] == 5


def test_rejects_bad_chunks() -> None:
    with pytest.raises(ValueError):
        image_positions(0, 3, 0)

    @dataclass
    class Bad(Img):
        @property
        def n_tokens(self) -> int:
            return 5

    with pytest.raises(ValueError, match="not 2x2"):
        prompt_positions([Bad(2, 2)])
