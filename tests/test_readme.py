"""README.md cannot rot (issue 55): every command block on it is run here (and the
Python examples of docs/python.md).

Each fenced ``sh`` / ``bash`` block is run line by line and each ``python`` block as a
script, with the model names swapped for tiny generated GGUFs (``model.gguf`` -> a
grafted-MTP model, ``trunk.gguf`` / ``mtp.gguf`` -> a trunk-only file and its MTP-only
sidecar) and ``pyggspec`` on PATH replaced by a shim whose built-in demo model is the tiny
preset (the 0.8B-shaped one takes a minute to generate). ``pyggspec serve`` is started,
asked ``/health`` and one chat request, then stopped.

Two lines are NOT run, on purpose: ``./install.sh`` (it rebuilds llama-cpp-python: 5-10
minutes, and it is what set up the environment this test runs in) and ``python3 -m
pytest`` (it is the suite this test belongs to). The test checks they are on the page.

The relative links of the README and the docs/ pages are checked too: the file exists,
and an ``#anchor`` names an ``<a id=...>`` or a heading of the target page.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.test_infill import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
NOT_RUN = ("./install.sh", "python3 -m pytest")  # see the module docstring: why
TIMEOUT = 120  # seconds per command
SHIM = """#!{python}
import sys
import pyggspec.testing as testing
testing.qwen35_0_8b = testing.tiny_dense  # the demo model: the tiny preset (seconds)
from pyggspec.cli import main
main(sys.argv[1:], prog_name="pyggspec")
"""


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def command_lines(body: str) -> list[str]:
    """A shell block's commands: one per line, comment-only lines dropped."""
    return [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_is_one_screen_and_names_the_setup():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    lines = [ln for lang, b in blocks(text) if lang in ("sh", "bash") for ln in command_lines(b)]
    for cmd in NOT_RUN:
        assert any(ln.startswith(cmd) for ln in lines), f"README lost {cmd!r}"
    assert any("pyggspec run --spec-type draft-mtp" in ln for ln in lines)
    assert any(ln.startswith("pyggspec bench") for ln in lines)


def _pages() -> list[Path]:
    docs = REPO / "docs"
    return [README, *sorted(docs.glob("*.md")), *sorted(docs.glob("*/*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page: Path):
    """Relative links of the README and docs/ pages: the file exists, an ``#anchor``
    names an ``<a id=...>`` or a heading of the target page."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        f = (page.parent / path).resolve() if path else page
        if not f.exists():
            bad.append(target)
            continue
        if anchor and f.suffix == ".md":
            text = f.read_text()
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}
            if f'<a id="{anchor}">' not in text and anchor not in slugs:
                bad.append(target)
    assert not bad, f"links that do not resolve: {bad}"


@pytest.fixture(scope="module")
def shell(models, tmp_path_factory):
    """The environment the README's commands run in: the shim first on PATH, a private
    cache for the demo model, tiny models, 2 threads."""
    root = tmp_path_factory.mktemp("readme")
    bindir = root / "bin"
    bindir.mkdir()
    shim = bindir / "pyggspec"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               XDG_CACHE_HOME=str(root / "cache"), LLAMA_ARG_THREADS="2",
               PYGGSPEC_DEBUG="1")
    trunk, mtp = models.split(dtype="q8_0", agreement=0.9)
    names = {"trunk.gguf": str(trunk), "mtp.gguf": str(mtp),
             "model.gguf": str(models.dense(dtype="q8_0", agreement=0.9))}
    return env, names, root


def _swap(text: str, names: dict[str, str]) -> str:
    for k, v in names.items():
        text = text.replace(k, v)
    return text


def _serve(cmd: str, env: dict[str, str], cwd: Path) -> None:
    """Start the README's serve line on a free port, check it answers, stop it."""
    port = free_port()
    cmd = re.sub(r"--port \d+", f"--port {port}", cmd)
    if "--port" not in cmd:
        cmd += f" --port {port}"
    cmd += " -c 512"
    p = subprocess.Popen(shlex.split(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, p, TIMEOUT, cmd)
        body = json.dumps({"model": "m", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["message"] is not None
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_readme_commands_run(shell):
    env, names, root = shell
    ran = 0
    for lang, body in blocks(README.read_text()):
        if lang in ("sh", "bash"):
            for line in command_lines(body):
                if line.startswith(NOT_RUN):
                    continue  # see the module docstring
                cmd = _swap(line, names)
                if cmd.startswith("pyggspec serve"):
                    _serve(cmd.split(" #", 1)[0], env, root)
                else:
                    r = subprocess.run(["bash", "-c", cmd], env=env, cwd=root, text=True,
                                       capture_output=True, timeout=TIMEOUT, check=False)
                    assert r.returncode == 0, f"{line}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
                    if "run --spec-type draft-mtp" in line and "-m " not in line:
                        assert "plain decoding" in r.stderr and "demo: ->" in r.stderr, r.stderr
                ran += 1
        elif lang == "python":
            r = subprocess.run([sys.executable, "-c", _swap(body, names)], env=env, cwd=root,
                               text=True, capture_output=True, timeout=TIMEOUT, check=False)
            assert r.returncode == 0, f"{body}\n{r.stderr[-3000:]}"
            ran += 1
    assert ran >= 8


def test_python_doc_examples_run(shell):
    """docs/python.md promises that its examples run as written: each block is run."""
    env, names, root = shell
    page = REPO / "docs" / "python.md"
    ran = 0
    for lang, body in blocks(page.read_text()):
        if lang != "python":
            continue
        r = subprocess.run([sys.executable, "-c", _swap(body, names)], env=env, cwd=root,
                           text=True, capture_output=True, timeout=TIMEOUT, check=False)
        assert r.returncode == 0, f"{body}\n{r.stderr[-3000:]}"
        ran += 1
    assert ran >= 5
