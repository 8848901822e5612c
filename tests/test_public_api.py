"""The public Python API (issue 55): everything a user needs comes from ``import pyggspec``.

This file imports nothing of pyggspec but the package itself, so a name that a user would
have to fetch from a submodule fails here. The model comes from the session's fixture.
"""

from __future__ import annotations

import inspect
import pydoc
import subprocess
import sys

import pytest

import pyggspec

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_all_names_resolve_and_are_documented():
    assert "Engine" in pyggspec.__all__ and "SamplingParams" in pyggspec.__all__
    for name in pyggspec.__all__:
        obj = getattr(pyggspec, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        assert inspect.getdoc(obj), f"pyggspec.{name} has no docstring"
    assert set(pyggspec.__all__) <= set(dir(pyggspec))
    assert set(pyggspec.__all__) == {*pyggspec._EXPORTS, "PyggspecError", "__version__"}
    with pytest.raises(AttributeError):
        pyggspec.no_such_name  # noqa: B018


def test_import_is_cheap():
    """``import pyggspec`` loads no engine, no cffi, no click (the CLI and scripts start
    fast); the names come on first use."""
    code = ("import sys, pyggspec; "
            "print(sorted(m for m in ('pyggspec.engine', 'cffi', '_cffi_backend', 'click', "
            "'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT).stdout.strip()
    assert out == "[]"


def test_engine_methods_have_docstrings_and_help_reads():
    public = [n for n, v in vars(pyggspec.Engine).items()
              if not n.startswith("_") and callable(v)]
    missing = [n for n in public if not inspect.getdoc(getattr(pyggspec.Engine, n))]
    assert not missing, f"Engine methods without a docstring: {missing}"
    text = pydoc.render_doc(pyggspec.Engine, renderer=pydoc.plaintext)
    for word in ("spec_type", "n_parallel", "SpecConfig", "generate", "n_gpu_layers"):
        assert word in text


def test_signatures_have_type_hints():
    for fn in (pyggspec.Engine.generate, pyggspec.Engine.stream, pyggspec.run_bench,
               pyggspec.demo_model, pyggspec.inspect_model):
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, fn
        for p in sig.parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                assert p.annotation is not inspect.Parameter.empty, (fn, p.name)


def test_generate_through_the_public_names(models):
    path = models.dense(dtype="q8_0", agreement=0.9)
    cfg = pyggspec.EngineConfig(spec_type="draft-mtp", spec=pyggspec.SpecConfig(n_max=2),
                                sampling=pyggspec.SamplingParams(temp=0), n_ctx=256,
                                n_threads=2, load_tokenizer=False, progress=False)
    with pyggspec.Engine(path, config=cfg) as e:
        r = e.generate([1, 2, 3, 4], max_tokens=12, ignore_eos=True)
        assert isinstance(r, pyggspec.Result) and len(r.tokens) == 12
        assert isinstance(r.spec, pyggspec.SpecStats) and r.spec.n_drafted > 0
        pieces = list(e.stream([1, 2, 3, 4], max_tokens=4, ignore_eos=True))
        assert all(isinstance(p, pyggspec.Piece) for p in pieces)
    with pyggspec.Engine(path, n_ctx=256, n_threads=2, load_tokenizer=False,
                         progress=False) as plain:
        assert plain.generate([1, 2, 3, 4], max_tokens=12, ignore_eos=True).tokens == r.tokens
    with pytest.raises(pyggspec.ConfigError):
        pyggspec.SpecConfig(n_max=0)
    assert issubclass(pyggspec.ConfigError, pyggspec.PyggspecError)
