"""What a model graph is fed and what it returns, and the one padding rule for batch rows.

Below both the runners that build batches (the worker, the drafter) and the code that sizes
graphs ahead of time (``compute``): they all take shapes from :func:`padded_rows`, so a
batch the loop runs is a shape the compute buffers were sized for.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


def padded_rows(T: int, B: int) -> int:
    """Rows per sequence for a batch of B sequences needing T rows each.

    ggml's CPU matrix kernels take activation columns in pairs: an odd count of three or
    more costs more than one more column (0.8B q8_0, 2 threads: 3 tokens 128 ms, 4 tokens
    117 ms; 5: 174 ms, 6: 155 ms). Padding rows are evaluated and ignored. One row per
    sequence (a speculative step that drafts nothing) is never padded: the pad would be a
    second row for every sequence (three sequences: six rows for three), the dearest step.
    """
    if T > 1 and T * B >= 3 and (T * B) % 2 == 1:
        return T + 1
    return T


def most_verify_rows(n_parallel: int, n_max: int) -> int:
    """Rows per sequence of the longest verify batch: the most padded rows any batch size
    up to ``n_parallel`` gives a sequence with ``n_max`` drafts. ``n_parallel`` times it
    bounds every verify batch (the snapshot arena; the per-step graphs of several devices
    are sized with that shape)."""
    return max(padded_rows(n_max + 1, B) for B in range(1, n_parallel + 1))


MTP_NO_PAD_ROWS = 64  # MTP catch-up batches this long (prompt warm-up) are not padded


def catch_up_rows(T: int, B: int) -> int:
    """Rows per sequence of an MTP catch-up batch (new pairs + the first draft) whose
    longest sequence needs T: padded like a verify batch, except prompt-sized ones."""
    return padded_rows(T, B) if T < MTP_NO_PAD_ROWS else T


def chunk_group(left: Mapping[K, int], offset: Mapping[K, int], n_ubatch: int,
                n_batch: int) -> tuple[int, list[K]]:
    """The next ubatch of prompt chunks: (T, sequences) -- the sequences (in ``left``'s
    order) sharing the smallest remaining count, T tokens each, at most ``n_ubatch``
    tokens in all, never across a sequence's logical batch (-b) boundary (``offset``:
    tokens it has evaluated since its logical batches began). The gated-delta-net graph
    needs equal lengths; the one rule for the scheduler's prompts and ``Engine.decode``."""
    T = min(min(left.values()), n_ubatch)
    group = [k for k, n in left.items() if n >= T][: max(1, n_ubatch // T)]
    T = min(T, *(n_batch - offset[k] % n_batch for k in group))
    return T, group


@dataclass
class UBatch:
    """B sequences x T rows each; ``outputs`` marks which flat rows need logits.

    A row is a token (its id in ``tokens``) or, where ``embd_rows`` is set, an embedding row
    given in place of the token's (an image row: the projector's output). Rows are KV
    cells: row t of sequence b goes to cell ``pos0[b] + t`` of its slot and sees the cells
    before it (llama.cpp's mask for image rows too: its M-RoPE mask orders an image's rows
    by (y, x), which is row order). Their RoPE positions are the cells' own, less
    ``rope_shift[b]`` (text after images: an image of n rows advances the position by
    fewer, ``pyggspec.vision.positions``), or given row by row in ``rope_pos``.
    """

    tokens: np.ndarray  # int32 [B, T] (an embedding row's id is not read)
    pos0: np.ndarray  # int64 [B]: KV cell of each sequence's first row here
    slots: tuple[int, ...]
    outputs: np.ndarray  # int32 [n_out]: flat indices (b*T + t) that need logits
    hidden: bool = False
    state_src: np.ndarray | None = None  # int32 [B]: recurrent rows to read
    state_dst: np.ndarray | None = None  # int32 [1, B]: rows for the new states
    # the state after every token goes to the state arena, no row is written (speculative
    # rollback: the accepted one's arena row becomes the sequence's); with one token, written
    snapshots: bool = False
    sampling: int = 0  # sampling plan id (Target.register_plan); 0: logits come back
    rows: list | None = None  # RowInput per output row, for the device sampling prefix
    # embedding rows: float32 [B * T, n_embd], read where embd_rows (bool [B * T]) is set
    embd: np.ndarray | None = None
    embd_rows: np.ndarray | None = None
    rope_pos: np.ndarray | None = None  # int32 [4, B * T]: (t, y, x, z) per row, sectioned
    rope_shift: np.ndarray | None = None  # int64 [B]: cell - RoPE position of text rows


@dataclass
class StepResult:
    logits: np.ndarray  # float32 [n_out, n_vocab]
    hidden: np.ndarray | None  # float32 [n_tokens, n_embd] (post output_norm) or None
    ids: np.ndarray | None = None  # int32 [n_out]: tokens chosen by the sampler chain




EMBD_ROW = -1  # a prompt's token id for a row given as an embedding (llama.cpp's LLAMA_TOKEN_NULL)


@dataclass(frozen=True)
class MediaRows:
    """The embedding rows of one prompt (its images) and every row's RoPE position.

    The prompt's token list holds :data:`EMBD_ROW` at the rows given here as embeddings;
    ``pos`` is every row's (t, y, x, z) position counted from the prompt's first position
    (``pyggspec.vision.positions``: the evaluator adds the sequence's position there);
    ``n_pos``: the position after the last row, from the same origin. A row past those of
    the prompt (a generated token) sits at its cell less ``len(pos[0]) - n_pos``."""

    embd: np.ndarray  # float32 [n_embd_rows, n_embd]: the embedding rows in row order
    is_embd: np.ndarray  # bool [n_rows]
    pos: np.ndarray  # int32 [4, n_rows]
    n_pos: int

    def __post_init__(self) -> None:
        n = self.is_embd.shape[0]
        if self.pos.shape != (4, n):
            raise ValueError(f"positions {self.pos.shape} for {n} rows")
        if int(self.is_embd.sum()) != self.embd.shape[0]:
            raise ValueError(f"{self.embd.shape[0]} embedding rows for "
                             f"{int(self.is_embd.sum())} marked rows")
        object.__setattr__(self, "_index", np.cumsum(self.is_embd) - 1)

    @property
    def n_rows(self) -> int:
        return int(self.is_embd.shape[0])

    @property
    def shift(self) -> int:
        """Cells minus positions after the prompt (what the rows after it are shifted by)."""
        return self.n_rows - self.n_pos

    def rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows a..b-1: (bool [b-a] which are embeddings, their float32 rows [b-a, n_embd],
        zero where a row is a token)."""
        m = self.is_embd[a:b]
        out = np.zeros((b - a, self.embd.shape[1]), np.float32)
        out[m] = self.embd[self._index[a:b][m]]  # type: ignore[attr-defined]
        return m, out


def media_inputs(ub: UBatch, parts: list[tuple[MediaRows, int, int] | None],
                 shift: np.ndarray) -> None:
    """Give ``ub`` its embedding rows and row-by-row positions: sequence b takes rows
    ``a..a+T-1`` of ``parts[b] = (media, a, base)`` (positions from ``base``, the
    sequence's position at the media's first row), or is text at its cells less
    ``shift[b]`` (None). Embedding rows' ids become 0 (a row the graph does not read)."""
    B, T = ub.tokens.shape
    rope = np.zeros((4, B * T), np.int32)
    mask = np.zeros(B * T, bool)
    width = next((p[0].embd.shape[1] for p in parts if p is not None), 0)
    embd = None
    for b, p in enumerate(parts):
        sl = slice(b * T, (b + 1) * T)
        if p is None:
            rope[:3, sl] = int(ub.pos0[b]) - int(shift[b]) + np.arange(T)
            continue
        m, a, base = p
        if a + T > m.n_rows:
            raise ValueError(f"rows {a}..{a + T - 1} past the {m.n_rows} media rows")
        rope[:, sl] = m.pos[:, a:a + T]
        rope[:3, sl] += base
        e, rows = m.rows(a, a + T)
        if e.any():
            if embd is None:
                embd = np.zeros((B * T, width), np.float32)
            mask[sl] = e
            embd[sl] = rows
    ub.rope_pos = rope
    if embd is not None:
        ub.embd, ub.embd_rows = embd, mask
    ub.tokens = np.maximum(ub.tokens, 0)  # a copy: the caller commits its own ids
