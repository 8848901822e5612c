"""Acceptance (speculative/verify.py) and the MTP carry-over (Carry) as plain logic."""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.models.batch import chunk_group, padded_rows
from pyggspec.speculative.mtp import Carry
from pyggspec.speculative.verify import accept

EOS = 99


def is_eos(t: int) -> bool:
    return t == EOS


def chooser(choices):
    seen = []

    def choose(i):
        seen.append(i)
        return choices[i]

    return choose, seen


@pytest.mark.parametrize("drafts,target,want,n", [
    ([], [7], [7], 0),  # no drafts: the target's one token
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted + the bonus token
    ([1, 2, 3], [1, 5, 3, 4], [1, 5], 1),  # first mismatch ends it; its token is the target's
    ([1, 2, 3], [6, 2, 3, 4], [6], 0),
])
def test_accept_takes_rows_until_the_first_mismatch(drafts, target, want, n):
    choose, seen = chooser(target)
    got, k, stopped = accept(drafts, choose, is_eos)
    assert (got, k, stopped) == (want, n, False)
    assert seen == list(range(len(want)))  # rows past the mismatch are never sampled


def test_accept_stops_at_a_stop_token_and_reads_no_further():
    choose, seen = chooser([1, EOS, 3, 4])
    assert accept([1, 2, 3], choose, is_eos) == ([1, EOS], 1, True)
    assert seen == [0, 1]
    choose, seen = chooser([1, EOS, 3, 4])  # a drafted stop token confirmed: still the end
    assert accept([1, EOS, 3], choose, is_eos) == ([1, EOS], 1, True)
    choose, _ = chooser([EOS])
    assert accept([], choose, is_eos) == ([EOS], 0, True)


def test_padded_rows_pads_odd_counts_of_three_or_more():
    assert [padded_rows(t, 1) for t in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert padded_rows(3, 2) == 3 and padded_rows(2, 3) == 2 and padded_rows(3, 3) == 4


def test_one_row_per_sequence_is_never_padded():
    """A step that drafts nothing: padding would give every sequence a second row."""
    assert [padded_rows(1, b) for b in range(1, 8)] == [1] * 7


def test_chunk_group_equal_lengths_within_ubatch_and_logical_batch():
    # smallest remaining count, at most n_ubatch tokens in all, in the given order
    assert chunk_group({"a": 10, "b": 3, "c": 7}, dict.fromkeys("abc", 0), 8, 100) == \
        (3, ["a", "b"])
    assert chunk_group({"a": 10}, {"a": 0}, 4, 100) == (4, ["a"])
    # never across a logical batch (-b) boundary: 6 done of a 8-token batch -> 2 more
    assert chunk_group({"a": 10}, {"a": 6}, 4, 8) == (2, ["a"])


def test_carry_extends_with_what_the_target_committed():
    h = np.arange(12, dtype=np.float32).reshape(6, 2)
    c = Carry.start(5, h[0])  # nothing owed before 5; h[0] pairs with the token at 5
    assert c.pos0 == 5 and c.tokens == () and c.hidden.shape == (1, 2)
    # a verify without drafting (the head rested): pending 40 and 1 accepted draft 41
    c2 = c.extend([40, 41], h[1:3])
    assert c2.pos0 == 5 and c2.tokens == (40, 41)
    np.testing.assert_array_equal(c2.hidden, h[0:3])  # h_4, h_5, h_6: one row more
    # after a draft wrote the pending token's pair the carry is empty; the pending token
    # is not owed again, the accepted draft is
    empty = Carry(8, (), np.zeros((0, 2), np.float32))
    c3 = empty.extend([50, 51], h[3:5])
    assert c3.pos0 == 8 and c3.tokens == (51,)
    np.testing.assert_array_equal(c3.hidden, h[3:5])
    assert len(c3.hidden) == len(c3.tokens) + 1
