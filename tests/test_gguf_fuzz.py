"""Damaged GGUFs never crash the CLI (issue 13, item 10; DESIGN §4 "Files").

Converter-layout fixtures (grafted dense and MoE, trunk-only, MTP-only) are mutated, seeded:
byte flips in the header, the key/value region and the tensor-info region, truncations at
random offsets, and absurd counts, lengths, value types, scalar values, dims, ggml types and
data offsets, alone or several at once. Every case must end, for ``inspect`` and for ``run``,
in exit 0 or in one line ``pyggspec: FILE: ...`` with exit 1: never a Python exception that
is not a PyggspecError, a signal or a hang.

* ``inspect`` runs in this process through click's CliRunner (pure Python) with
  ``PYGGSPEC_DEBUG=1``, so any other exception surfaces, under an alarm against hangs.
* ``run`` (ggml compute, llama.cpp's tokenizer) runs the same CLI entry in-process inside a
  worker child; a case that kills the worker or passes its deadline is a failure (the worker
  is restarted for the rest).
* A few cases also run as real ``python -m pyggspec`` subprocesses with a timeout.

``PYGGSPEC_FUZZ_SEED`` / ``PYGGSPEC_FUZZ_CASES`` change the seed / the number of cases.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from pyggspec.cli import main

REPO = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("PYGGSPEC_FUZZ_SEED", "13"))
N_CASES = int(os.environ.get("PYGGSPEC_FUZZ_CASES", "320"))
N_SUBPROCESS = 20
RUN_TIMEOUT_S = 60.0  # one `run` case in the worker (a tiny model takes well under a second)
RUN_FLAGS = ["--prompt-tokens", "1,2", "-n", "1", "-c", "64", "-t", "1", "--temp", "0"]


# ----------------------------------------------------------------------------- GGUF fields
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


@dataclass
class Fields:
    """Byte offsets of a GGUF's fields, found by an independent walk of the format (not the
    reader under test)."""

    size: int
    kv_end: int = 0
    info_end: int = 0
    lengths: list[int] = field(default_factory=list)  # u64 string / array lengths
    vtypes: list[int] = field(default_factory=list)  # u32 value and array element types
    scalars: list[tuple[int, str]] = field(default_factory=list)  # (offset, struct format)
    ndims: list[int] = field(default_factory=list)
    dims: list[int] = field(default_factory=list)  # i64
    ttypes: list[int] = field(default_factory=list)  # u32 ggml types
    toffsets: list[int] = field(default_factory=list)  # u64 data offsets


def walk(b: bytes) -> Fields:
    f = Fields(len(b))

    def u32(p: int) -> int:
        return struct.unpack_from("<I", b, p)[0]

    def u64(p: int) -> int:
        return struct.unpack_from("<Q", b, p)[0]

    def value(vt: int, p: int) -> int:
        if vt in _SCALAR:
            f.scalars.append((p, _SCALAR[vt]))
            return p + struct.calcsize(_SCALAR[vt])
        if vt == 8:
            f.lengths.append(p)
            return p + 8 + u64(p)
        assert vt == 9, vt
        f.vtypes.append(p)
        et, n = u32(p), u64(p + 4)
        f.lengths.append(p + 4)
        p += 12
        for i in range(n):  # the first few elements (and a string array's last) suffice
            if et in _SCALAR:
                if i >= 4:
                    return p + (n - i) * struct.calcsize(_SCALAR[et])
                p = value(et, p)
            else:
                assert et == 8, et
                if i < 3 or i == n - 1:
                    f.lengths.append(p)
                p += 8 + u64(p)
        return p

    n_tensors, n_kv = struct.unpack_from("<qq", b, 8)
    p = 24
    for _ in range(n_kv):
        f.lengths.append(p)
        p += 8 + u64(p)
        f.vtypes.append(p)
        p = value(u32(p), p + 4)
    f.kv_end = p
    for _ in range(n_tensors):
        f.lengths.append(p)
        p += 8 + u64(p)
        f.ndims.append(p)
        nd = u32(p)
        p += 4
        for _ in range(nd):
            f.dims.append(p)
            p += 8
        f.ttypes.append(p)
        f.toffsets.append(p + 4)
        p += 12
    f.info_end = p
    return f


# ----------------------------------------------------------------------------- mutations
def _absurd(rng: random.Random, orig: int, bits: int) -> int:
    pool = [0, 1, 2, 3, 4, 5, 31, 32, 33, 63, 64, 255, 256, 1023, 1024, 4097, 65535, 2**31 - 1,
            2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
            orig - 1, orig + 1, orig * 2, orig // 2, orig + 2**32, -orig]
    return rng.choice(pool) % (1 << bits)


def _put_int(b: bytearray, off: int, fmt: str, v: int) -> None:
    bits = struct.calcsize(fmt) * 8
    v %= 1 << bits
    struct.pack_into("<" + {8: "B", 16: "H", 32: "I", 64: "Q"}[bits], b, off, v)


def _set_field(rng: random.Random, b: bytearray, offs: list[int], fmt: str, what: str) -> str:
    if not offs:
        return "none"
    off = rng.choice(offs)
    orig = struct.unpack_from(fmt, b, off)[0]
    v = _absurd(rng, orig, struct.calcsize(fmt) * 8)
    _put_int(b, off, fmt, v)
    return f"{what}@{off}: {orig} -> {v}"


def _flip(rng: random.Random, b: bytearray, lo: int, hi: int, what: str) -> str:
    hi = min(hi, len(b))
    out = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        off = rng.randrange(lo, hi)
        x = rng.randrange(1, 256)
        b[off] ^= x
        out.append(f"{off}^{x}")
    return f"flip-{what} " + ",".join(out)


def m_flip_header(rng, b, f):
    return _flip(rng, b, 0, 24, "header")


def m_flip_kv(rng, b, f):
    return _flip(rng, b, 24, f.kv_end, "kv")


def m_flip_info(rng, b, f):
    return _flip(rng, b, f.kv_end, f.info_end, "info")


def m_truncate(rng, b, f):
    end = f.info_end + 64 if rng.random() < 0.6 else len(b)
    n = rng.randrange(0, end)
    del b[n:]
    return f"truncate {n}"


def m_count(rng, b, f):
    off = rng.choice((8, 16))
    return _set_field(rng, b, [off], "<Q", "n_tensors" if off == 8 else "n_kv")


def m_length(rng, b, f):
    return _set_field(rng, b, f.lengths, "<Q", "length")


def m_vtype(rng, b, f):
    off = rng.choice(f.vtypes)
    v = rng.choice((*range(14), 2**31, 2**32 - 1))
    struct.pack_into("<I", b, off, v)
    return f"vtype@{off} -> {v}"


def m_scalar(rng, b, f):
    off, fmt = rng.choice(f.scalars)
    if fmt in ("<f", "<d"):
        v = rng.choice((0.0, -1.0, 1e-30, 1e38, float("inf"), float("-inf"), float("nan")))
        struct.pack_into(fmt, b, off, v)
        return f"scalar@{off} -> {v}"
    if fmt == "<?":
        b[off] = rng.choice((0, 1, 2, 255))
        return f"bool@{off} -> {b[off]}"
    return _set_field(rng, b, [off], fmt, "scalar")


def m_ndims(rng, b, f):
    off = rng.choice(f.ndims)
    v = rng.choice((0, 1, 2, 3, 4, 5, 255, 2**32 - 1))
    struct.pack_into("<I", b, off, v)
    return f"n_dims@{off} -> {v}"


def m_dim(rng, b, f):
    return _set_field(rng, b, f.dims, "<Q", "dim")


def m_ttype(rng, b, f):
    off = rng.choice(f.ttypes)
    v = rng.choice((*range(46), 255, 2**31, 2**32 - 1))
    struct.pack_into("<I", b, off, v)
    return f"ggml_type@{off} -> {v}"


def m_toffset(rng, b, f):
    return _set_field(rng, b, f.toffsets, "<Q", "data_offset")


SINGLE: list[Callable[[random.Random, bytearray, Fields], str]] = [
    m_flip_header, m_flip_kv, m_flip_kv, m_flip_info, m_flip_info, m_truncate, m_count,
    m_length, m_vtype, m_scalar, m_scalar, m_scalar, m_ndims, m_dim, m_dim, m_ttype,
    m_toffset,
]


def mutate(rng: random.Random, data: bytes, f: Fields) -> tuple[bytes, str]:
    b = bytearray(data)
    if rng.random() < 0.15:
        muts = [rng.choice(SINGLE) for _ in range(rng.randint(2, 4))]
        muts.sort(key=lambda m: m is m_truncate)  # offsets stay valid until a cut
    else:
        muts = [rng.choice(SINGLE)]
    desc = [m(rng, b, f) for m in muts]
    return bytes(b), "; ".join(desc)


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    id: int
    base: str
    path: Path
    what: str
    inspect: list[list[str]]
    run: list[str]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory, models) -> list[Case]:
    root = tmp_path_factory.mktemp("fuzz")  # the mutated files
    trunk, mtp = models.split("dense", dtype="q8_0")
    bases = {
        "dense": models.dense(dtype="q8_0"),
        "moe": models.moe(dtype="q8_0"),
        "trunk": trunk,
        "mtp": mtp,
    }
    data = {k: p.read_bytes() for k, p in bases.items()}
    fields = {k: walk(d) for k, d in data.items()}
    rng = random.Random(SEED)
    out: list[Case] = []
    names = list(bases)
    for i in range(N_CASES):
        base = names[i % len(names)]
        blob, what = mutate(rng, data[base], fields[base])
        p = root / f"case{i:04d}-{base}.gguf"
        p.write_bytes(blob)
        s = str(p)
        if base == "mtp":
            inspect = [["inspect", s], ["inspect", str(trunk), "--mtp", s]]
            run = ["run", "-m", str(trunk), "-md", s, "--spec-type", "draft-mtp"]
        else:
            inspect = [["inspect", s]]
            run = ["run", "-m", s] + (["--spec-type", "draft-mtp"] if base != "trunk" else [])
        out.append(Case(i, base, p, what, inspect, run + RUN_FLAGS))
    return out


def _verdict(case: Case, code: int | None, stderr: str, exc: str | None = None,
             run: bool = False) -> str | None:
    """None when the outcome is allowed, else why not.

    ``inspect`` must name the damaged file. A ``run`` whose file passed every check may stop
    on something else (e.g. a training context of 2 tokens leaves no room for the prompt):
    then its last line is still a one-line ``pyggspec: WHERE: ...`` error, after at most a
    couple of notices."""
    if exc:
        return f"exception escaped:\n{exc}"
    if code == 0:
        return None
    if code != 1:
        return f"exit code {code}"
    lines = stderr.strip().splitlines() or [""]
    err = lines[-1]
    if (len(lines) > 1 and not run) or len(lines) > 3 or "Traceback" in stderr:
        return f"not one line: {stderr[-1500:]!r}"
    if not all(ln.isprintable() and len(ln) <= 1000 for ln in lines):
        return f"raw bytes from the file in the message: {stderr[:1000]!r}"
    if err.startswith(f"pyggspec: {case.path}: "):
        return None
    if run and err.startswith("pyggspec: ") and not err.startswith("pyggspec: internal"):
        return None
    return f"error does not name the file: {err!r}"


def _fail_report(bad: list[tuple[Case, str, str]]) -> str:
    lines = [f"{len(bad)} case(s) failed (seed {SEED}):"]
    for c, cmd, why in bad[:10]:
        lines.append(f"- case {c.id} ({c.base}; {c.what}) {cmd}: {why}")
    return "\n".join(lines)


class _Hang(Exception):
    pass


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    def fire(signum, frame):
        raise _Hang(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_fields_walker(cases):
    """The mutations hit every region: the walk finds each field kind in every base."""
    kinds = {c.what.split()[0].split("@")[0] for c in cases}
    assert {"flip-header", "flip-kv", "flip-info", "truncate", "n_tensors", "n_kv", "length",
            "vtype", "dim", "n_dims", "ggml_type", "data_offset"} <= kinds, kinds
    assert len(cases) >= 300 or N_CASES < 300


def test_inspect_in_process(cases):
    runner = CliRunner()
    bad: list[tuple[Case, str, str]] = []
    outcomes = {0: 0, 1: 0}
    for c in cases:
        for args in c.inspect:
            exc = None
            try:
                with _deadline(20):
                    r = runner.invoke(main, args, env={"PYGGSPEC_DEBUG": "1"})
            except _Hang as e:
                bad.append((c, " ".join(args[:1]), f"hang: {e}"))
                continue
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                import traceback

                exc = "".join(traceback.format_exception(*r.exc_info))[-2000:]
            why = _verdict(c, r.exit_code, r.stderr, exc)
            if why:
                bad.append((c, " ".join(args), why))
            else:
                outcomes[r.exit_code] += 1
    assert not bad, _fail_report(bad)
    # the mutations are neither all harmless nor all fatal
    assert outcomes[0] > 10 and outcomes[1] > 100, outcomes


def test_file_text_in_errors_is_escaped(tmp_path):
    """Names and values from a damaged file reach messages escaped, on one printable line."""
    from conftest import write_tiny

    p = write_tiny(tmp_path / "arch.gguf", meta={"general.architecture": "qw\x1b[2Jen\n35"})
    r = CliRunner().invoke(main, ["inspect", str(p)])
    err = r.stderr.strip()
    assert r.exit_code == 1 and err.isprintable(), err
    assert err == (f"pyggspec: {p}: unsupported architecture 'qw\\x1b[2Jen\\n35' "
                   "(pyggspec runs qwen35 and qwen35moe)")
    data = bytearray(p.read_bytes())
    f = walk(bytes(data))
    key_len = f.lengths[0]  # the first key's length: point it into the binary vocabulary
    struct.pack_into("<Q", data, key_len, 300)
    q = tmp_path / "key.gguf"
    q.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["inspect", str(q)])
    err = r.stderr.strip()
    assert r.exit_code == 1 and err.isprintable() and len(err) < 400, err


# ----------------------------------------------------------------------------- run (worker)
_WORKER = r"""
import json, os, sys, traceback
os.environ["PYGGSPEC_DEBUG"] = "1"
from click.testing import CliRunner
from pyggspec.cli import main
runner = CliRunner()
print("@@READY", flush=True)
for line in sys.stdin:
    r = runner.invoke(main, json.loads(line))
    exc = None
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        exc = "".join(traceback.format_exception(*r.exc_info))[-2000:]
    sys.stdout.write("\n@@RESULT " + json.dumps({"code": r.exit_code, "stderr": r.stderr,
                                                 "exc": exc}) + "\n")
    sys.stdout.flush()
"""


class _Worker:
    """A child running the CLI entry in-process for one case at a time."""

    def __init__(self, log: Path) -> None:
        with open(log, "ab") as err:  # the child keeps its own copy of the descriptor
            self.p = subprocess.Popen([sys.executable, "-c", _WORKER], cwd=REPO,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                      env=dict(os.environ, PYGGSPEC_DEBUG="1"))
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.p.stdout, selectors.EVENT_READ)
        self.buf = b""
        if self._line("@@READY", 120) is None:
            raise RuntimeError(f"fuzz worker did not start (see {log})")

    def _line(self, marker: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                s = line.decode(errors="replace")
                i = s.find(marker)
                if i >= 0:
                    return s[i + len(marker):]
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                return None
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:  # the worker is gone
                try:
                    self.p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                return None
            self.buf += chunk

    def call(self, args: list[str], timeout: float) -> tuple[dict | None, str]:
        try:
            self.p.stdin.write((json.dumps(args) + "\n").encode())
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        s = self._line("@@RESULT ", timeout)
        if s is not None:
            return json.loads(s), ""
        if self.p.poll() is None:
            self.close()
            return None, f"hang: no result after {timeout:.0f} s"
        rc = self.p.returncode
        self.close()
        sig = f" (signal {signal.Signals(-rc).name})" if rc < 0 else ""
        return None, f"worker died with exit status {rc}{sig}"

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.sel.close()


def test_run_in_worker(cases, tmp_path):
    log = tmp_path / "worker.log"
    worker = _Worker(log)
    bad: list[tuple[Case, str, str]] = []
    outcomes = {0: 0, 1: 0}
    try:
        for c in cases:
            res, why = worker.call(c.run, RUN_TIMEOUT_S)
            if res is None:
                bad.append((c, "run", why))
                worker = _Worker(log)
                continue
            why = _verdict(c, res["code"], res["stderr"], res["exc"], run=True)
            if why:
                bad.append((c, "run", why))
            else:
                outcomes[res["code"]] += 1
    finally:
        worker.close()
    assert not bad, _fail_report(bad)
    assert outcomes[0] > 10 and outcomes[1] > 100, outcomes


def test_real_subprocesses(cases):
    """A sample as real ``python -m pyggspec`` processes: exit status, stderr, no signal."""
    from pyggspec.errors import PyggspecError
    from pyggspec.modelfile import ModelFile

    rng = random.Random(SEED + 1)
    valid: list[Case] = []
    broken: list[Case] = []
    for c in rng.sample(cases, len(cases)):  # half of them files that load: ggml runs them
        try:
            ModelFile.open(c.path).close()
            valid.append(c)
        except PyggspecError:
            broken.append(c)
    half = N_SUBPROCESS // 2
    sample = valid[:half] + broken[:N_SUBPROCESS - min(half, len(valid))]
    bad: list[tuple[Case, str, str]] = []
    for k, c in enumerate(sample):
        args = c.run if k % 2 == 0 or k < half else c.inspect[0]
        try:
            p = subprocess.run([sys.executable, "-m", "pyggspec", *args], cwd=REPO,
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=RUN_TIMEOUT_S, check=False,
                               env=dict(os.environ, PYGGSPEC_DEBUG=""))
        except subprocess.TimeoutExpired:
            bad.append((c, args[0], f"hang: killed after {RUN_TIMEOUT_S:.0f} s"))
            continue
        why = _verdict(c, p.returncode, p.stderr, run=args[0] == "run")
        if p.returncode < 0:
            why = f"killed by {signal.Signals(-p.returncode).name}"
        if why:
            bad.append((c, args[0], why))
    assert not bad, _fail_report(bad)
