"""n-gram drafters in the engine (--spec-type ngram-simple / ngram-mod, alone and with
draft-mtp): lossless, and drafting the text the prompt already holds."""

from __future__ import annotations

import pytest

from pyggspec.config import ConfigError, EngineConfig, SpecConfig


@pytest.fixture(scope="module")
def path(models):
    return models.get("dense", dtype="f32", agreement=0.7, tied_embeddings=False)


def repeat_prompt(make_engine, path, n: int = 40, head: int = 14) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation is text it already holds: the model's own greedy
    chain S, other tokens, then the first ``head`` tokens of S (the continuation: the rest
    of S). Returns (prompt, S)."""
    seed = [300, 301, 302]
    with make_engine(path, n_ctx=512) as e:
        chain = e.generate(seed, max_tokens=n, ignore_eos=True).tokens
    s = seed + chain
    prompt = s + [700, 701, 702, 703, 704] + s[:head]
    return prompt, s


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-mod", "ngram-mod,draft-mtp",
                                       "ngram-simple,ngram-mod,draft-mtp"])
@pytest.mark.parametrize("adaptive", [None, False])
def test_ngram_drafts_are_lossless_and_draft_the_repeated_text(path, make_engine, spec_type,
                                                               adaptive):
    prompt, _ = repeat_prompt(make_engine, path)
    with make_engine(path, n_ctx=512) as e:
        ref = e.generate(prompt, max_tokens=24, ignore_eos=True).tokens
    spec = SpecConfig(n_max=6, adaptive=adaptive, ngram_simple_size_n=4,
                      ngram_simple_size_m=8, ngram_mod_n_match=4, ngram_mod_n_min=2,
                      ngram_mod_n_max=8)
    with make_engine(path, n_ctx=512, spec_type=spec_type, spec=spec) as e:
        g = e.generate(prompt, max_tokens=24, ignore_eos=True)
        counts = e.drafter.counters()
    assert g.tokens == ref
    kind = spec_type.split(",")[0]
    assert counts[kind]["drafts"] > 0, counts
    if adaptive is False:  # fixed lengths: the repeated text is drafted to the cap
        assert g.spec.acceptance > 0.7 and g.spec.mean_accepted_length > 3


def test_ngram_only_needs_no_mtp_head(models, make_engine):
    """n-gram drafting runs on a trunk-only file (no MTP head, no MTP cache)."""
    trunk, _ = models.split("dense", dtype="f32", agreement=0.7, tied_embeddings=False)
    with make_engine(trunk, n_ctx=256) as e:
        ref = e.generate([300, 301, 302] * 8, max_tokens=16, ignore_eos=True).tokens
    with make_engine(trunk, n_ctx=256, spec_type="ngram-simple",
                     spec=SpecConfig(ngram_simple_size_n=2, ngram_simple_size_m=4)) as e:
        assert e.mtp is None and e.drafter.mtp is None and e.mtp_kv is None
        g = e.generate([300, 301, 302] * 8, max_tokens=16, ignore_eos=True)
    assert g.tokens == ref


def test_spec_type_parsing():
    assert EngineConfig(spec_type="draft-mtp,ngram-mod").spec_type == "ngram-mod,draft-mtp"
    assert EngineConfig(spec_type="none").spec_type is None
    assert EngineConfig(spec_type="ngram-simple").spec_types == ("ngram-simple",)
    assert not EngineConfig(spec_type="ngram-simple").uses_mtp
    with pytest.raises(ConfigError, match="--spec-type.*'ngram-cache'"):
        EngineConfig(spec_type="ngram-cache")
    with pytest.raises(ConfigError, match="--spec-ngram-simple-size-n"):
        SpecConfig(ngram_simple_size_n=0)


def test_cli_ngram_flags(path):
    import json

    from click.testing import CliRunner

    from pyggspec.cli import main

    r = CliRunner().invoke(main, ["run", "-m", str(path), "--prompt-tokens", "300,301,302",
                                  "-n", "8", "--ignore-eos", "--json", "--spec-type",
                                  "ngram-simple,draft-mtp", "--spec-ngram-simple-size-n", "2",
                                  "--spec-ngram-simple-size-m", "4"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d["spec"]["drafters"]) == {"ngram-simple", "draft-mtp"}
    bad = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "x", "--spec-type",
                                    "ngram-map-k"])
    assert bad.exit_code == 2 and "ngram-map-k" in bad.output
