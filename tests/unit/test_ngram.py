"""The n-gram drafters against llama.cpp's rules (common/ngram-map.cpp, speculative.cpp)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pyggspec.speculative import ngram_mod
from pyggspec.speculative.drafter import Draft, DraftItem
from pyggspec.speculative.ngram_mod import NgramMod
from pyggspec.speculative.ngram_simple import NgramSimple, simple_draft


def reference_simple(tokens: list[int], sampled: int, n: int, m: int) -> list[int]:
    """common_ngram_simple_draft, transcribed loop for loop."""
    cur = len(tokens)
    if cur <= n + m + 1:
        return []
    pattern = [tokens[j] for j in range(cur - n + 1, cur)] + [sampled]
    match = 0
    for j in range(cur - n - 1, 0, -1):
        if all(tokens[j + k] == pattern[k] for k in range(len(pattern))):
            match = j
            break
    if match == 0:
        return []
    copy = min(m, cur - (match + n))
    if copy < n:
        return []
    return [tokens[match + n + j] for j in range(copy)]


def test_simple_draft_is_llama_cpps_on_random_histories():
    rng = random.Random(0)
    proposals = 0
    for _ in range(3000):
        n, m = rng.randint(1, 4), rng.randint(1, 6)
        vocab = rng.randint(2, 5)
        toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        sampled = rng.randrange(vocab)
        want = reference_simple(toks, sampled, n, m)
        assert simple_draft(np.array(toks, np.int32), sampled, n, m) == want, (toks, n, m)
        proposals += bool(want)
    assert proposals > 300  # the cases exercised include matches


def _items(slot: int, pending: int, cap: int, stop=None) -> list[DraftItem]:
    return [DraftItem(slot, pending, cap, stop)]


def test_simple_drafter_caps_stops_and_follows_a_changed_history():
    d = NgramSimple(size_n=2, size_m=5)
    hist = {0: [1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 1, 2]}
    got = d.draft(_items(0, 3, 8), hist.__getitem__)[0].tokens
    assert got == reference_simple(hist[0], 3, 2, 5) == [4, 5, 6, 7, 9]
    assert d.draft(_items(0, 3, 2), hist.__getitem__)[0].tokens == [4, 5]
    assert d.draft(_items(0, 3, 8, lambda t: t == 5), hist.__getitem__)[0].tokens == [4, 5]
    hist[0] = hist[0] + [3, 4]  # grew: the cached copy is extended
    assert d.draft(_items(0, 5, 8), hist.__getitem__)[0].tokens == reference_simple(
        hist[0], 5, 2, 5)
    hist[0] = [5, 6, 1, 2, 3, 4, 5, 6, 7, 0, 5]  # replaced (a new request): rebuilt
    assert d.draft(_items(0, 6, 3), hist.__getitem__)[0].tokens == [7, 0, 5]
    # llama.cpp stops at the last match even when too little follows it to copy
    assert not d.draft(_items(0, 8, 3), {0: [8] * 11}.__getitem__)
    assert not d.draft(_items(0, 1, 3), {0: [1, 2]}.__getitem__)  # too short: nothing
    assert d.counters()["lookups"] == 7


def test_simple_drafter_forgets_the_history_of_the_last_request():
    """A new request's history may have the old one's length and last token: ``begin``
    drops the cached copy, so the draft is llama.cpp's for the new history."""
    d = NgramSimple(size_n=2, size_m=3)
    old, new = [1, 2, 3, 4, 5, 6, 7, 1, 2], [5, 2, 4, 4, 6, 9, 9, 0, 2]
    d.draft(_items(0, 3, 8), lambda s: old)
    d.begin(0, new)
    got = d.draft(_items(0, 4, 8), lambda s: new)
    assert (got[0].tokens if got else []) == reference_simple(new, 4, 2, 3)


def test_mod_drafts_the_continuation_of_a_repeated_text():
    d = NgramMod(n_match=3, n_min=2, n_max=6)
    text = list(range(10, 30))
    d.begin(0, text)
    hist = text + [99, 98] + text[:4]
    got = d.draft(_items(0, text[4], 10), lambda s: hist)[0].tokens
    assert got == text[5:11]
    assert d.draft(_items(0, text[4], 2), lambda s: hist)[0].tokens == text[5:7]
    assert not d.draft(_items(0, 77, 10), lambda s: hist)  # unknown n-gram


def test_mod_needs_n_min_hits_and_shares_its_table_across_slots():
    d = NgramMod(n_match=2, n_min=4, n_max=8)
    d.begin(0, [1, 2, 3, 4, 5, 6])
    # slot 1 never saw the text: the table is shared
    assert d.draft(_items(1, 2, 8), lambda s: [0, 1])[1].tokens == [3, 4, 5, 6]
    assert not d.draft(_items(1, 4, 8), lambda s: [0, 3])  # 2 hits < n_min 4


def test_mod_resets_when_full_and_after_five_low_rounds(monkeypatch):
    monkeypatch.setattr(ngram_mod, "TABLE_MAX", 5)
    d = NgramMod(n_match=2, n_min=1, n_max=4)
    d.begin(0, list(range(20)))
    assert d.counters()["resets"] == 1 and not d.table
    d.begin(0, [1, 2, 3, 1, 2])
    draft = Draft([3, 1, 2, 3])
    for _ in range(4):
        d.accepted(0, draft, 0, [7])
    assert d.table  # four low rounds: kept
    d.accepted(0, draft, 2, [3, 1, 7])  # a good round ends the streak
    for _ in range(4):
        d.accepted(0, draft, 0, [7])
    assert d.table
    d.accepted(0, draft, 0, [7])  # the fifth in a row
    assert not d.table and d.counters()["resets"] == 2


@pytest.mark.parametrize("cls", [NgramSimple, NgramMod])
def test_kinds_keep_no_state_the_slot_needs(cls):
    d = cls()
    assert d.state(0) == () and not d.needs_hidden
    d.forget(0)
    d.restore(0, ())
