"""Prefix matching for prompt reuse (``serving.prefix_cache.common_prefix``): the number of
leading tokens two token lists share, against a plain Python loop; and where a prompt's
checkpoints go (``prompt_checkpoints``, llama-server's rule)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pyggspec.serving.prefix_cache import common_prefix, prompt_checkpoints


def slow(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("a,b,want", [
    ([], [], 0),
    ([], [1, 2], 0),
    ([1, 2], [], 0),
    ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2], 2),  # one a prefix of the other, either way round
    ([1, 2], [1, 2, 3], 2),
    ([5, 2, 3], [1, 2, 3], 0),  # differs at the first token: nothing to reuse
    ([1, 2, 3, 4], [1, 2, 9, 4], 2),  # equal again after a difference does not count
    ([0], [0], 1),
])
def test_cases(a, b, want):
    assert common_prefix(a, b) == want == common_prefix(b, a)


def test_sequence_types_and_large_ids():
    big = 248_319  # Qwen3.5's vocabulary: ids past int16
    a = [1, big, 7]
    assert common_prefix(tuple(a), np.array(a, np.int32)) == 3
    assert common_prefix(a, [1, big, 8]) == 2
    assert common_prefix([2**40, 1], [2**40, 2]) == 1  # no wrap-around through int32
    assert isinstance(common_prefix(a, a), int)


def test_random_lists_equal_the_slow_loop():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 60)
        a = [rng.randrange(4) for _ in range(n)]
        b = a[:rng.randint(0, n)] + [rng.randrange(4) for _ in range(rng.randint(0, 20))]
        assert common_prefix(a, b) == slow(a, b), (a, b)


@pytest.mark.parametrize("n,cached,ubatch,batch,want", [
    (10, 0, 512, 2048, (6,)),  # llama.cpp's test_metrics prompt: 4 before its end
    (1000, 0, 512, 2048, (484, 996)),  # 4 + n_ubatch and 4 before its end
    (600, 0, 512, 512, (88, 596)),  # the first at most n_batch before it
    (1000, 990, 512, 2048, (996,)),  # only past the reused tokens
    (1000, 996, 512, 2048, ()),
    (4, 0, 512, 2048, ()),  # nothing before position 1
    (5, 0, 512, 2048, (1,)),
])
def test_prompt_checkpoints(n, cached, ubatch, batch, want):
    assert prompt_checkpoints(n, cached, ubatch, batch) == want
