#!/usr/bin/env python3
"""Run llama.cpp's own server tests against ``pyggspec serve`` and print per-file counts.

The suite is ``tools/server/tests`` of the llama.cpp that llama-cpp-python 0.3.36 vendors
(``.cache/llama-cpp-python-0.3.36``, which ``./install.sh`` unpacks; fetched here with
``pip download`` when missing). Its ``utils.py`` starts ``$LLAMA_SERVER_BIN_PATH`` with
llama-server's command lines; that is ``scripts/llama_server_suite/launcher``, which swaps
the Hugging Face model flags for small generated qwen35 models and runs ``pyggspec serve``
with the other flags unchanged. ``scripts/llama_server_suite/suite_plugin.py`` stops every
download and applies ``model_specific.toml`` (tests that read a particular model's text,
features refused on purpose, pending work).

Usage::

    python3 scripts/llama_server_suite.py                  # the suite, not its slow tests
    python3 scripts/llama_server_suite.py -- -k completion # extra pytest arguments
    python3 scripts/llama_server_suite.py --json out.json  # the outcomes as JSON too

Exit status 0 when no test failed unexpectedly (a listed test is not a failure; an
unlisted failure or an XPASS of a model-specific entry is), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "scripts" / "llama_server_suite"
VERSION = "0.3.36"
CACHE = ROOT / ".cache"
SRC = CACHE / f"llama-cpp-python-{VERSION}"
SUITE = SRC / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
# what the suite imports beyond pytest (its requirements.txt pins old versions of pytest,
# numpy and openai; the installed ones work, so only what is missing is installed)
NEEDS = {"requests": "requests", "openai": "openai", "filelock": "filelock"}
COLUMNS = ("passed", "failed", "listed", "xfailed", "xpassed", "skipped")


def say(msg: str) -> None:
    print(f"[llama-server-suite] {msg}", flush=True)


def ensure_suite() -> Path:
    """The suite's directory, unpacking llama-cpp-python's sdist (as install.sh does)."""
    if SUITE.is_dir():
        return SUITE
    sdists = sorted(CACHE.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not sdists:
        say(f"downloading the llama-cpp-python {VERSION} source (pip download)")
        CACHE.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d",
                        str(CACHE)], check=True)
        sdists = sorted(CACHE.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix="sdist."))
    with tarfile.open(sdists[0]) as tf:
        for m in tf.getmembers():
            parts = Path(m.name).parts[1:]
            if not parts:
                continue
            m.name = str(Path(*parts))
            tf.extract(m, tmp, filter="data") if hasattr(tarfile, "data_filter") \
                else tf.extract(m, tmp)
    if not SRC.exists():
        tmp.rename(SRC)
    return SUITE


def ensure_requirements() -> None:
    missing = [pkg for mod, pkg in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        say(f"installing {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing],
                       check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(report: dict) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Per-file counts, and the unexpected outcomes (failures, XPASS of skipped kinds)."""
    per: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0))
    bad: list[str] = []
    for nodeid, rec in sorted(report["tests"].items()):
        f = nodeid.split("::", 1)[0]
        out = rec["outcome"]
        if rec.get("list") and out == "skipped":
            out = "listed"
        per[f][out if out in COLUMNS else "failed"] += 1
        if out == "failed":
            bad.append(nodeid)
    return per, bad


def print_table(per: dict[str, dict[str, int]]) -> None:
    w = max([len(f) for f in per] + [5])
    print(f"{'file':<{w}}  " + "  ".join(f"{c:>7}" for c in COLUMNS))
    tot = dict.fromkeys(COLUMNS, 0)
    for f, c in sorted(per.items()):
        print(f"{f:<{w}}  " + "  ".join(f"{c[k]:>7}" for k in COLUMNS))
        for k in COLUMNS:
            tot[k] += c[k]
    print(f"{'total':<{w}}  " + "  ".join(f"{tot[k]:>7}" for k in COLUMNS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the outcomes here too")
    ap.add_argument("--slow", action="store_true", help="include the suite's slow tests")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)

    suite = ensure_suite()
    # test_slot_save.py's multimodal tests save to "./tmp" of the suite's directory, which
    # must exist (llama-server, like serve, refuses a --slot-save-path that is not a folder)
    (suite / "tmp").mkdir(exist_ok=True)
    ensure_requirements()
    say("writing the stand-in models")
    subprocess.run([sys.executable, str(HERE / "launcher"), "--prepare"], check=True,
                   stdout=subprocess.DEVNULL)
    fd, report_path = tempfile.mkstemp(prefix="llama-server-suite.", suffix=".json")
    os.close(fd)
    env = {**os.environ,
           "LLAMA_SERVER_BIN_PATH": str(HERE / "launcher"),
           "PORT": os.environ.get("PORT", str(free_port())),
           # one ggml thread per server (llama.cpp's LLAMA_ARG_THREADS, read by serve's -t
           # too): pytest and the server share 2 cores in CI, and a spinning 2-thread pool
           # on a busy machine is many times slower than one thread for these tiny models
           "LLAMA_ARG_THREADS": os.environ.get("LLAMA_ARG_THREADS", "1"),
           "PYGGSPEC_SUITE_REPORT": report_path,
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-m", "pytest", "-p", "suite_plugin", "-p", "no:cacheprovider",
           "-q", "-rfE", "--tb=short"]
    if not a.slow:
        cmd += ["-m", "not slow"]
    cmd += a.pytest_args
    say(f"running in {suite}: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    subprocess.run(cmd, check=False, cwd=suite, env=env)
    report = json.loads(Path(report_path).read_text() or "{}")
    os.unlink(report_path)
    per, bad = table(report)
    print()
    say(f"per-file counts ({time.monotonic() - t0:.0f} s; 'listed': skipped by "
        "scripts/llama_server_suite/model_specific.toml)")
    print_table(per)
    if report.get("unused_list_entries") and not a.pytest_args:
        say("list entries that matched no test: " + ", ".join(report["unused_list_entries"]))
    if a.json:
        a.json.write_text(json.dumps({"per_file": per, "unexpected": bad, **report}, indent=1))
    if bad:
        say(f"{len(bad)} unexpected failures:")
        for b in bad:
            print(f"  {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
