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
    the prompt (a generated token) sits at its cell less ``len(pos[0]) - n_pos``.
    ``images``: each image's (first row, rows, content id), which prompt reuse compares
    (llama-server keys cached image rows by content); None: unknown, never reused."""

    embd: np.ndarray  # float32 [n_embd_rows, n_embd]: the embedding rows in row order
    is_embd: np.ndarray  # bool [n_rows]
    pos: np.ndarray  # int32 [4, n_rows]
    n_pos: int
    images: tuple[tuple[int, int, str], ...] | None = None

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



def _first(m: MediaRows) -> int:
    return int(np.argmax(m.is_embd))


class SlotRows:
    """The image rows each slot's cells hold, and the RoPE positions of its rows: the one
    table the trunk's and the MTP head's batches take embedding rows and positions from.

    A slot holds spans: ``media`` over cells ``cell0 ..`` (its rows' positions from
    ``base``, the slot's position at ``cell0``). A cell inside a span has the span's
    position and, at an image row, its embedding; any other cell sits at its own index
    less the shifts (rows - positions) of the spans before it. ``shift[slot]``: that shift
    past the slot's last span (the rows a step appends: decode, verify, drafts)."""

    def __init__(self, n_slots: int) -> None:
        self.shift = np.zeros(n_slots, np.int64)
        self._end = np.zeros(n_slots, np.int64)  # the cell after the slot's last span
        self._spans: list[list[tuple[int, int, MediaRows]]] = [[] for _ in range(n_slots)]
        self.n_spans = 0

    def spans(self, slot: int) -> list[tuple[int, int, MediaRows]]:
        return self._spans[slot]

    def add(self, slot: int, cell0: int, media: MediaRows) -> None:
        """``media``'s rows go to cells ``cell0..`` (after every span the slot has)."""
        if cell0 < self._end[slot]:
            raise ValueError(f"slot {slot}: rows at cell {cell0} inside an earlier span")
        self._spans[slot].append((cell0, cell0 - int(self.shift[slot]), media))
        self.shift[slot] += media.shift
        self._end[slot] = cell0 + media.n_rows
        self.n_spans += 1

    def truncate(self, slot: int, n: int) -> None:
        """Forget cells >= ``n``: spans past it go; a span cut before its first image row
        held only text at plain positions, and goes too (prompt reuse stops there)."""
        keep = []
        for cell0, base, m in self._spans[slot]:
            if cell0 + m.n_rows <= n:
                keep.append((cell0, base, m))
            elif cell0 < n and m.is_embd[: n - cell0].any():
                raise ValueError(f"slot {slot}: cutting at cell {n} inside an image")
        self._set(slot, keep)

    def clear(self, slot: int) -> None:
        self._set(slot, [])

    def same_images(self, slot: int, media: MediaRows | None, n: int) -> int:
        """How much of a common prefix of ``n`` cells (the slot's tokens and a prompt's,
        image rows' ids equal) may be reused: up to the first image that is not the same
        image at the same cells in both. ``media``: the prompt's rows (from cell 0)."""
        held = [(c0 + a, k, i) for c0, _, m in self._spans[slot] if m.is_embd.any()
                for a, k, i in (m.images if m.images is not None else [(_first(m), 0, "")])]
        new = [] if media is None else list(media.images if media.images is not None else
                                            [(_first(media), 0, "")])
        for j in range(max(len(held), len(new))):
            a = held[j] if j < len(held) else None
            b = new[j] if j < len(new) else None
            start = min(x[0] for x in (a, b) if x is not None)
            if start >= n:
                break
            if a != b or not a[2]:
                return start
        return n

    def export(self, slot: int) -> tuple[list[dict], dict[str, np.ndarray]]:
        """The slot's spans as a slot file's header entries and named arrays
        (:meth:`load` reads them back)."""
        head, arrays = [], {}
        for k, (cell0, base, m) in enumerate(self._spans[slot]):
            head.append({"cell0": cell0, "base": base, "n_pos": m.n_pos,
                         "images": None if m.images is None else [list(x) for x in m.images]})
            arrays.update({f"media{k}.embd": m.embd, f"media{k}.is_embd": m.is_embd,
                           f"media{k}.pos": m.pos})
        return head, arrays

    @staticmethod
    def parse(head: list, get) -> list[tuple[int, int, MediaRows]]:
        """Spans from :meth:`export`'s entries; ``get(name)``: the named array. ValueError
        (or KeyError / TypeError) on anything malformed."""
        spans = []
        for k, h in enumerate(head):
            ims = h["images"]
            m = MediaRows(np.asarray(get(f"media{k}.embd"), np.float32),
                          np.asarray(get(f"media{k}.is_embd"), bool),
                          np.asarray(get(f"media{k}.pos"), np.int32), int(h["n_pos"]),
                          None if ims is None else tuple((int(a), int(n), str(i))
                                                         for a, n, i in ims))
            spans.append((int(h["cell0"]), int(h["base"]), m))
        return spans

    def load(self, slot: int, spans: list[tuple[int, int, MediaRows]]) -> None:
        """The slot holds ``spans`` (from :meth:`parse`) and nothing else."""
        self._set(slot, list(spans))

    def copy(self, src: int, dst: int) -> None:
        self._set(dst, list(self._spans[src]))

    def _set(self, slot: int, spans: list[tuple[int, int, MediaRows]]) -> None:
        self.n_spans += len(spans) - len(self._spans[slot])
        self._spans[slot] = spans
        self.shift[slot] = sum(m.shift for _, _, m in spans)
        self._end[slot] = max((c + m.n_rows for c, _, m in spans), default=0)

    def fill(self, pos0: np.ndarray, T: int, slots: tuple[int, ...]
             ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None,
                        np.ndarray | None]:
        """For a batch of ``len(slots)`` sequences x T rows from cells ``pos0``:
        (rope_pos [4, B*T] or None, rope_shift [B] or None, embd_rows [B*T] or None,
        embd [B*T, n_embd] or None). (None, None, None, None): no slot holds a span;
        only the shift: every row is past its slot's spans."""
        if not self.n_spans:
            return None, None, None, None
        idx = list(slots)
        shift = self.shift[idx]
        if (pos0 >= self._end[idx]).all():
            return None, shift, None, None
        B = len(slots)
        rope = np.zeros((4, B * T), np.int32)
        mask = np.zeros(B * T, bool)
        embd = None
        t = np.arange(T, dtype=np.int64)
        for b, slot in enumerate(slots):
            sl = slice(b * T, (b + 1) * T)
            cells = int(pos0[b]) + t
            before = np.zeros(T, np.int64)  # shifts of the spans that end before each cell
            r = rope[:, sl]
            for cell0, base, m in self._spans[slot]:
                before += np.where(cells >= cell0 + m.n_rows, m.shift, 0)
            r[:3] = cells - before
            for cell0, base, m in self._spans[slot]:
                inside = (cells >= cell0) & (cells < cell0 + m.n_rows)
                if not inside.any():
                    continue
                j = cells[inside] - cell0
                r[:, inside] = m.pos[:, j]
                r[:3, inside] += base
                e = m.is_embd[j]
                if e.any():
                    if embd is None:
                        embd = np.zeros((B * T, m.embd.shape[1]), np.float32)
                    rows = np.flatnonzero(inside)[e] + b * T
                    mask[rows] = True
                    embd[rows] = m.embd[m._index[j[e]]]  # type: ignore[attr-defined]
        return rope, shift, (mask if embd is not None else None), embd

    def apply(self, batch) -> None:
        """Set a :class:`UBatch`'s (or an MTP batch's) embedding rows and positions from
        the table (all None when its slots hold no spans); image rows' ids become 0 (a row
        the graph does not read; a copy: the caller commits its own ids)."""
        T = batch.tokens.shape[1]
        rope, shift, mask, embd = self.fill(batch.pos0, T, tuple(batch.slots))
        batch.rope_pos, batch.rope_shift = rope, shift
        batch.embd, batch.embd_rows = embd, mask
        if rope is not None:
            batch.tokens = np.maximum(batch.tokens, 0)

