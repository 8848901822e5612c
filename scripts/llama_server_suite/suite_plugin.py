"""pytest plugin loaded into llama.cpp's server test suite (``-p suite_plugin``) by
``scripts/llama_server_suite.py``; the suite's own files are used unchanged.

What it changes, and why:

* ``wget`` (the suite's only downloader, ``utils.download_file``) is a stub that fails: these
  runs must never download anything. A test that needs a downloaded file fails, and is then
  listed in ``model_specific.toml``.
* ``requests.get`` of the suite's test images (tinygemma3's ``test/*.png`` on Hugging Face,
  which test_vision_api.py fetches to send as base64) answers a generated PNG instead, so
  the model-independent assertions (status codes, token counts) run without a network.
* ``ServerPreset.load_all`` (a session fixture that starts every preset once so that its
  model is downloaded before the tests) does nothing: the launcher's models are local.
* The tests listed in ``model_specific.toml`` get their mark: ``model-specific`` and
  ``not-supported`` ones are skipped with their reason, ``pending`` ones run as
  non-strict xfail (so a pending feature that lands shows up as XPASS).
* Every test's outcome is written to ``$PYGGSPEC_SUITE_REPORT`` (JSON: nodeid -> outcome,
  list kind) for the runner's per-file table.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
LIST = Path(os.environ.get("PYGGSPEC_SUITE_LIST", HERE / "model_specific.toml"))
KINDS = ("model-specific", "not-supported", "missing", "pending")


def _no_download(url: str, out: str | None = None) -> str:
    raise RuntimeError(f"download of {url} refused: pyggspec's runs of llama.cpp's server "
                       "tests never download (list the test in model_specific.toml)")


_wget = types.ModuleType("wget")
_wget.download = _no_download  # type: ignore[attr-defined]
sys.modules["wget"] = _wget


TEST_IMAGES = ("https://huggingface.co/ggml-org/tinygemma3-GGUF/resolve/main/test/",)


def _patch_requests() -> None:
    """``requests.get`` answers the known test-image URLs with a generated PNG (seeded by
    the URL); any other URL goes to the real function (and fails without a network)."""
    try:
        import requests
    except ImportError:
        return
    from pyggspec.testing.hf_vision import png_bytes, test_image_pixels

    real = requests.get

    def get(url: str, *a: Any, **kw: Any) -> Any:
        if isinstance(url, str) and url.startswith(TEST_IMAGES):
            r = requests.Response()
            r.status_code, r.url = 200, url
            r._content = png_bytes(test_image_pixels(96, 64, seed=len(url)))
            r.headers["Content-Type"] = "image/png"
            return r
        return real(url, *a, **kw)

    requests.get = get


_patch_requests()


def load_list(path: Path = LIST) -> dict[str, dict[str, str]]:
    """``model_specific.toml`` -> {test id: {"kind": ..., "reason": ...}}.

    The file has one table per kind (``[model-specific]``, ``[not-supported]``,
    ``[pending]``), each mapping a test id to its reason. A test id is a node id relative to
    the suite's directory (``unit/test_x.py::test_y[param]``), or a prefix of one ending in
    ``*`` (``unit/test_embedding.py::*``, ``unit/test_x.py::test_y[*``), so a whole file or
    every parametrization of a test takes one line."""
    data = tomllib.loads(path.read_text())
    out: dict[str, dict[str, str]] = {}
    for kind, entries in data.items():
        if kind not in KINDS:
            raise ValueError(f"{path}: unknown table [{kind}] (one of {', '.join(KINDS)})")
        for test_id, reason in entries.items():
            if test_id in out:
                raise ValueError(f"{path}: {test_id} listed twice")
            out[test_id] = {"kind": kind, "reason": str(reason)}
    return out


def match(nodeid: str, listed: dict[str, dict[str, str]]) -> tuple[str, dict[str, str]] | None:
    """The entry for ``nodeid``: its exact id, else the longest matching ``*`` prefix."""
    if nodeid in listed:
        return nodeid, listed[nodeid]
    best: tuple[str, dict[str, str]] | None = None
    for key, entry in listed.items():
        if (key.endswith("*") and nodeid.startswith(key[:-1])
                and (best is None or len(key) > len(best[0]))):
            best = (key, entry)
    return best


_outcomes: dict[str, dict[str, Any]] = {}
_used: set[str] = set()
_listed: dict[str, dict[str, str]] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    global _listed
    utils = sys.modules.get("utils")
    if utils is not None:  # the suite's conftest imported it
        utils.ServerPreset.load_all = staticmethod(lambda: None)
    _listed = load_list()
    for item in items:
        hit = match(item.nodeid, _listed)
        if hit is None:
            continue
        key, entry = hit
        _used.add(key)
        reason = f"{entry['kind']}: {entry['reason']}"
        if entry["kind"] == "pending":
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
        else:
            item.add_marker(pytest.mark.skip(reason=reason))
        item.user_properties.append(("pyggspec_list", entry["kind"]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    kind = dict(report.user_properties).get("pyggspec_list")
    rec = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "list": kind})
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.passed else "xfailed"
        else:
            outcome = report.outcome
        if rec["outcome"] in ("passed",) or outcome == "failed":
            rec["outcome"] = outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("PYGGSPEC_SUITE_REPORT")
    if not out:
        return
    stale = sorted(k for k in _listed if k not in _used) if session.items else []
    Path(out).write_text(json.dumps({"tests": _outcomes, "unused_list_entries": stale},
                                    indent=1))
