"""Acceptance: which of a sequence's drafts the target confirms (gpt-fast's rule, pure).

The target's choice at verify row i is ``choose(i)`` -- sampled from the target's own
logits at that position by the sequence's chain, in order -- so the emitted tokens are
exactly what plain decoding would emit: speculation is lossless by construction.
"""

from __future__ import annotations

from collections.abc import Callable


def accept(drafts: list[int], choose: Callable[[int], int],
           is_stop: Callable[[int], bool]) -> tuple[list[int], int, bool]:
    """Take the target's choices row by row until one differs from the draft.

    Returns (the target's choices in order, accepted draft count n, whether the last
    choice is a stop token). A stop token ends the target's output: no later row is looked
    at, and it is not a confirmed draft (the scheduler's update decides what it means for
    the sequence; the verify only must not read past the end of the output).
    """
    emitted: list[int] = []
    for i in range(len(drafts) + 1):
        y = choose(i)
        emitted.append(y)
        if is_stop(y):
            return emitted, i, True
        if i == len(drafts) or y != drafts[i]:
            return emitted, i, False
    raise AssertionError("unreachable")
