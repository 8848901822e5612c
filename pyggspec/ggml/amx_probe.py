"""Does ggml's AMX buffer type actually run on this host? Asked in a child process.

ggml lists the AMX buffer type whenever it was compiled with AMX, and the CPU reports AMX
flags inside VMs whose kernel never grants the tile state: there the first AMX matrix
multiply kills the process (llama.cpp segfaults on Q8_0/Q4 models on these hosts). So the
tile code is run once in a child process on small weights of every type AMX claims; the
verdict is cached per host CPU and library build, and AMX is used only after a clean run.

Run as ``python -m pyggspec.ggml.amx_probe`` to see the verdict (``--fresh`` ignores the
cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# block sizes of the probed types: (ggml type name, bytes per block, values per block,
# byte offsets of the f16 scales inside a block)
_PROBE_TYPES = (("Q8_0", 34, 32, (0,)), ("Q4_0", 18, 32, (0,)), ("Q4_K", 144, 256, (0, 2)))
_TIMEOUT_S = 60


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggspec"
    return root / "amx-probe.json"


def _host_key() -> str:
    """CPU model + flags and the ggml build the binding was compiled against."""
    h = hashlib.sha256()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                h.update(line.encode())
                if line.startswith("flags"):
                    break
    except OSError:
        h.update(os.uname().machine.encode())
    from pyggspec.ggml import _lib

    h.update(_lib.ensure_built().parent.name.encode())  # keyed by the installed ggml build
    return h.hexdigest()[:24]


def _run_probe() -> int:
    """In the child: multiply by a small AMX-held weight of each type; exit 0 when all ran
    and gave finite results, 3 when AMX is not offered, 4 on a wrong result."""
    import numpy as np

    from pyggspec.ggml import _lib
    from pyggspec.ggml.buffer import Buffer
    from pyggspec.ggml.context import Context
    from pyggspec.ggml.device import cpu_device
    from pyggspec.ggml.dtypes import GGMLType
    from pyggspec.ggml.repack import extra_buffer_types, supports_weight
    from pyggspec.ggml.sched import Graph

    dev = cpu_device()
    amx = next((b for b in extra_buffer_types(dev) if b.name == "AMX"), None)
    if amx is None:
        return 3
    lib = _lib.lib
    backend = dev.open(1)
    rng = np.random.default_rng(0)
    K, N, M = 512, 32, 8
    for name, bsize, bvals, scales in _PROBE_TYPES:
        t = GGMLType[name]
        if not supports_weight(dev, amx, t, (K, N)):
            continue
        blocks = rng.integers(0, 256, size=(N * K // bvals, bsize), dtype=np.uint8)
        for off in scales:  # keep the f16 scales small and finite
            blocks[:, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        with Context(4) as wctx, Context(8, graph_size=16) as ctx:
            w = wctx.new_tensor(t, (K, N), "w")
            wbuf = Buffer.in_buffer_type(wctx, amx, dev, "amx probe")
            if wbuf is None:
                return 5
            w.set(blocks.tobytes())
            x = ctx.new_tensor(GGMLType.F32, (K, M), "x")
            y = ctx.mul_mat(w, x)
            g = Graph(ctx, [y], 16)
            ibuf = Buffer.for_context(ctx, dev, "amx probe inputs")
            x.set(rng.standard_normal((M, K)).astype(np.float32))
            status = lib.ggml_backend_graph_compute(backend.ptr, g.ptr)
            out = y.get()
            ibuf.close()
            wbuf.close()
            if status != lib.GGML_STATUS_SUCCESS or not np.isfinite(out).all():
                return 4
    backend.close()
    return 0


def cached_verdict() -> tuple[bool, str] | None:
    """The verdict an earlier probe left for this host (None: not probed here yet)."""
    try:
        data = json.loads(_cache_file().read_text())
        if data.get("key") == _host_key():
            return bool(data["usable"]), str(data["why"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def amx_usable(fresh: bool = False) -> tuple[bool, str]:
    """(usable, why): the cached verdict for this host, probing in a child when unknown."""
    key = _host_key()
    cache = _cache_file()
    if not fresh and (known := cached_verdict()) is not None:
        return known
    try:
        r = subprocess.run([sys.executable, "-m", "pyggspec.ggml.amx_probe", "--child"],
                           check=False, capture_output=True, timeout=_TIMEOUT_S)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        rc = None
    if rc == 0:
        usable, why = True, "AMX tile code ran in a probe process"
    elif rc == 3:
        usable, why = False, "ggml offers no AMX buffer type here"
    elif rc is None:
        usable, why = False, f"the AMX probe process hung ({_TIMEOUT_S} s)"
    elif rc < 0:
        usable, why = False, f"the AMX probe process died with signal {-rc}"
    else:
        usable, why = False, f"the AMX probe process failed (exit {rc})"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "usable": usable, "why": why}))
    except OSError:
        pass
    return usable, why


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return _run_probe()
    usable, why = amx_usable(fresh="--fresh" in argv)
    print(f"AMX {'usable' if usable else 'not used'}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
