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
    """B sequences x T tokens each; ``outputs`` marks which flat rows need logits."""

    tokens: np.ndarray  # int32 [B, T]
    pos0: np.ndarray  # int64 [B]: position of each sequence's first token here
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


@dataclass
class StepResult:
    logits: np.ndarray  # float32 [n_out, n_vocab]
    hidden: np.ndarray | None  # float32 [n_tokens, n_embd] (post output_norm) or None
    ids: np.ndarray | None = None  # int32 [n_out]: tokens chosen by the sampler chain


