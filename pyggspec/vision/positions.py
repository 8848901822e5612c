"""M-RoPE positions of a prompt's rows, as llama.cpp gives them for Qwen3.5 (IMROPE) with the
Qwen3-VL projector (libmtmd's ``MTMD_POS_TYPE_MROPE``).

Why a pure function: the trunk graph takes four position sections per row (section-major:
all rows' section 0, then section 1, ...), and the MTP head needs the same for the image rows
it mirrors; both must match llama.cpp exactly or the outputs drift. The rules, from
llama.cpp 0.3.36 (unchanged in b11549):

* text token at position ``p``: ``(p, p, p, 0)`` (``llm_graph_input_pos::set_input``);
* image chunk of ``nx`` x ``ny`` merged rows starting at ``p0``, row ``i`` (raster order):
  ``t = p0``, ``y = p0 + i // nx``, ``x = p0 + i % nx``, ``z = 0``
  (``mtmd_image_tokens_get_decoder_pos``), written to the sections as ``(t, y, x, z)``
  (``decode_embd_batch::set_position_mrope_2d``: section 1 is the row, section 2 the column);
* after the image the position advances by ``max(nx, ny)`` (``mtmd_image_tokens_get_n_pos``),
  so the next text token is at ``p0 + max(nx, ny)``.

Masking (for whoever feeds these rows to a graph): llama.cpp's KV cells keep section 0 as the
position, so all rows of one image share ``t = p0``; its causal mask then orders them by
``(y, x)`` (``llama_kv_cell_ext::is_2d_gt``), i.e. raster order, which is exactly row order.
A mask built from row order is therefore llama.cpp's; one built from section 0 alone would
let an image's rows see each other both ways, which llama.cpp does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

__all__ = ["image_n_pos", "image_positions", "prompt_positions", "text_positions"]

N_SECTIONS = 4


class _Chunk(Protocol):
    n_tokens: int


def image_n_pos(nx: int, ny: int) -> int:
    """How far the position advances past an ``nx`` x ``ny`` image (``max(nx, ny)``)."""
    return max(int(nx), int(ny))


def image_positions(nx: int, ny: int, pos_0: int) -> np.ndarray:
    """int32 [4, nx*ny], section-major ``(t, y, x, z)`` for an image's rows from ``pos_0``."""
    if nx < 1 or ny < 1:
        raise ValueError(f"an image has at least one row and column, not {nx}x{ny}")
    i = np.arange(nx * ny, dtype=np.int64)
    out = np.empty((N_SECTIONS, nx * ny), dtype=np.int64)
    out[0] = pos_0
    out[1] = pos_0 + i // nx
    out[2] = pos_0 + i % nx
    out[3] = 0
    return out.astype(np.int32)


def text_positions(n: int, pos_0: int) -> np.ndarray:
    """int32 [4, n], section-major ``(p, p, p, 0)`` for ``n`` text tokens from ``pos_0``."""
    p = np.arange(pos_0, pos_0 + n, dtype=np.int32)
    return np.stack([p, p, p, np.zeros_like(p)])


def prompt_positions(chunks: Iterable[_Chunk], pos_0: int = 0) -> tuple[np.ndarray, int]:
    """Positions of every row of a tokenized prompt (text chunks have ``tokens``, image chunks
    ``nx`` / ``ny``), concatenated: (int32 [4, n_rows], the position after the last row)."""
    parts: list[np.ndarray] = []
    pos = int(pos_0)
    for c in chunks:
        nx, ny = getattr(c, "nx", None), getattr(c, "ny", None)
        if nx is not None and ny is not None:
            if c.n_tokens != nx * ny:
                raise ValueError(f"image chunk of {c.n_tokens} rows is not {nx}x{ny}")
            parts.append(image_positions(nx, ny, pos))
            pos += image_n_pos(nx, ny)
        else:
            parts.append(text_positions(c.n_tokens, pos))
            pos += c.n_tokens
    if not parts:
        return np.zeros((N_SECTIONS, 0), dtype=np.int32), pos
    return np.concatenate(parts, axis=1), pos
