"""Progress output in logs (issue 13, item 8): when stderr is not a terminal each phase writes
one line at its start and one at its end, never carriage-return frames; on a terminal the
live bar stays.

The CLI runs for real (``pyggspec run`` with the built-in demo model, whose generation and
upload are the two progress phases), with two test-only substitutions made in the child before
``main`` runs: the demo spec is the tiny preset (generates in a second, not a minute) and the
upload bar's 256 MiB threshold is 0.
"""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from pyggspec.progress import Progress, is_terminal

REPO = Path(__file__).resolve().parents[1]
BOOT = """
import sys
import pyggspec.testing as testing
import pyggspec.weights.load as weights
testing.qwen35_0_8b = testing.tiny_dense
weights.PROGRESS_MIN_BYTES = 0
from pyggspec.cli import main
main(sys.argv[1:], prog_name="pyggspec")
"""
ARGS = ["run", "--spec-type", "draft-mtp", "--prompt-tokens", "1,2,3", "-n", "2", "-c", "64",
        "-t", "1", "--no-mmap"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frame(done: int, total: int, dt: float) -> str:
    return f"step {done}/{total}"


def test_progress_not_a_terminal_writes_two_lines():
    out = io.StringIO()
    p = Progress(1000, _frame, start="step: starting", header="phase one", stream=out,
                 interval=0.0)
    for _ in range(1000):
        p.update()
    p.finish()
    p.finish()  # idempotent
    assert out.getvalue() == "phase one\nstep: starting\nstep 1000/1000\n"


def test_progress_on_a_terminal_redraws_in_place():
    out = _Tty()
    assert is_terminal(out) and not is_terminal(io.StringIO()) and not is_terminal(None)
    p = Progress(10, _frame, start="unused on a tty", header="phase one", stream=out,
                 interval=0.0)
    for _ in range(10):
        p.update()
    p.finish()
    text = out.getvalue()
    assert text.startswith("phase one\n\rstep 0/10\rstep 1/10")
    assert text.endswith("\rstep 10/10\n") and "unused" not in text
    assert text.count("\n") == 2


def _env(cache: Path) -> dict[str, str]:
    return dict(os.environ, XDG_CACHE_HOME=str(cache), PYGGSPEC_DEBUG="1")


def _run_piped(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BOOT, *ARGS], cwd=REPO, env=_env(cache),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, check=False)


def test_cli_log_has_one_line_per_phase(tmp_path):
    p = _run_piped(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    assert "\r" not in err, err[:2000]
    lines = err.splitlines()
    gen = [ln for ln in lines if "demo model (once)" in ln]
    bar = [ln for ln in lines if " tensors " in ln]
    load = [ln for ln in lines if ln.startswith("pyggspec: loading weights")]
    assert len(gen) == 1 and len(bar) == 1, err
    n = bar[0].split(" tensors")[0].split()[-1]  # "N/N"
    assert n.split("/")[0] == n.split("/")[1], bar
    assert len(load) == 2 and load[0].endswith("MiB)") and "100%" in load[1], err
    # (the AMX probe's notice, on a host where it fails, is said once per host, not a phase)
    assert sum("AMX weight buffers" not in ln for ln in lines) < 20, err
    # second run: the demo model is cached, so only the upload phase remains
    p = _run_piped(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "\r" not in p.stderr and "demo model (once)" not in p.stderr
    assert sum(ln.startswith("pyggspec: loading weights") for ln in p.stderr.splitlines()) == 2


def test_cli_terminal_keeps_the_live_bar(tmp_path):
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # keep "\n" as written (no "\r\n" translation)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO once the child side is closed
                return
            if not b:
                return
            chunks.append(b)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.run([sys.executable, "-c", BOOT, *ARGS], cwd=REPO, env=_env(tmp_path),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                           timeout=300, check=False)
    finally:
        os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, err[-3000:]
    assert "demo model (once)" in err
    assert "\r  [" in err, err[:2000]  # demo bar redrawn in place
    assert "\rpyggspec: loading weights" in err, err[:2000]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
