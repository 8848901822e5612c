"""Prefix matching for prompt reuse (multi-turn chat): how many of a slot's cached tokens
a new prompt continues. A new request goes to the idle slot sharing the longest prefix,
and continues from its cache (or from a checkpoint inside the shared prefix: the recurrent
state cannot lose a tail). What a slot holds is
:class:`~pyggspec.memory.slots.SlotMemory`'s; what is reused is the worker's decision.

:func:`prompt_checkpoints` says where a prompt's checkpoints go (the scheduler ends its
prompt chunks there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], np.int64)
    y = np.asarray(b[:n], np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


# llama-server's checkpoints before a prompt's end, in tokens (server-context.cpp, after
# llama.cpp PR 20288): n_ubatch is added to the first one
END_OFFSET = 4


def prompt_checkpoints(n_prompt: int, n_cached: int, n_ubatch: int, n_batch: int,
                       ) -> tuple[int, ...]:
    """Prompt positions, ascending, after which the recurrent state is checkpointed
    whatever the spacing: ``4 + n_ubatch`` and ``4`` tokens before the prompt's end (each
    at most ``n_batch``), past the ``n_cached`` reused tokens -- llama-server's rule.

    Reuse needs a checkpoint inside the shared prefix, and the usual ones end just before
    the prompt's end: the same prompt again reuses all but its last token (evaluated
    anew for its logits), a chat's next turn may re-render the last few tokens, an edited
    last message changes less than a ubatch. A checkpoint at the prompt's end serves
    none of the first (the 10-token prompt of llama.cpp's test_metrics is not reused
    without one before it). They cost one more prompt chunk per prompt (the last 4 tokens
    alone: ~50 ms for the 0.8B-shaped model on 2 CPU cores, a 10-token prompt 125 -> 175
    ms, within the noise from 512 tokens) and no more state copies than a copy at the end
    did: they take the places of the prompt-end copy and of the spacing copy near it (one
    copy of that model's recurrent state: 19.3 MiB, ~2.9 ms)."""
    stops = {n_prompt - min(n_batch, off) for off in (END_OFFSET + n_ubatch, END_OFFSET)}
    return tuple(sorted(p for p in stops if p > n_cached))
