"""The sampling flags' parsers (``sampling.params``), as llama.cpp's ``common/arg.cpp`` and
``common/sampling.cpp`` read the same strings. Range checks of the values themselves are in
tests/test_validation.py."""

from __future__ import annotations

import math

import pytest

from pyggspec.sampling.params import (
    DEFAULT_SAMPLERS,
    parse_logit_bias,
    parse_sampler_chars,
    parse_samplers,
)


def test_sampler_names_aliases_case_and_empty_entries():
    assert parse_samplers("top_k;top-p;TEMP") == ("top_k", "top_p", "temperature")
    assert parse_samplers("topk; nucleus ;;typ;min-p") == ("top_k", "top_p", "typ_p", "min_p")
    assert parse_samplers("") == ()
    assert parse_samplers(";".join(DEFAULT_SAMPLERS)) == DEFAULT_SAMPLERS


def test_unknown_sampler_name_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unknown sampler 'topx'"):
        parse_samplers("top_k;topx")


def test_sampler_chars_are_llamacpp_sampler_seq():
    assert parse_sampler_chars("ekypmt") == ("penalties", "top_k", "typ_p", "top_p", "min_p",
                                             "temperature")
    assert parse_sampler_chars("dsx") == ("dry", "top_n_sigma", "xtc")
    assert parse_sampler_chars("") == ()
    with pytest.raises(ValueError, match="'qz'"):
        parse_sampler_chars("kqtz")


@pytest.mark.parametrize("item,want", [
    ("15043+1", (15043, 1.0)),
    ("15043-1", (15043, -1.0)),
    ("2-inf", (2, -math.inf)),
    ("2+inf", (2, math.inf)),  # a value the range check refuses later, not the parser
    ("7+0.25", (7, 0.25)),
    ("0-0", (0, -0.0)),
    (" 9+2 ", (9, 2.0)),
])
def test_logit_bias(item, want):
    assert parse_logit_bias([item]) == (want,)


def test_logit_bias_keeps_the_order_and_repeats():
    assert parse_logit_bias(["3+1", "1-2", "3+4"]) == ((3, 1.0), (1, -2.0), (3, 4.0))
    assert parse_logit_bias([]) == ()


@pytest.mark.parametrize("item", ["5", "+1", "-5+1", "abc", "5+", "5+x", "x+5", "5*2", ""])
def test_malformed_logit_bias_names_the_item(item):
    with pytest.raises(ValueError, match="TOKEN_ID\\(\\+/-\\)BIAS"):
        parse_logit_bias([item])


@pytest.mark.parametrize("item,want", [("5+1e-3", (5, 1e-3)), ("5-1e+2", (5, -100.0)),
                                       ("5+-1", (5, -1.0))])
def test_logit_bias_values_llamacpp_accepts(item, want):
    assert parse_logit_bias([item]) == (want,)
