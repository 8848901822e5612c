"""Prefix matching for prompt reuse (multi-turn chat): how many of a slot's cached tokens
a new prompt continues. A new request goes to the idle slot sharing the longest prefix,
and continues from its cache (or from a checkpoint inside the shared prefix: the recurrent
state cannot lose a tail). What a slot holds is
:class:`~pyggspec.memory.slots.SlotMemory`'s; what is reused is the worker's decision.
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
