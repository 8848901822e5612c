"""What the benchmarks share: llama.cpp's tools, the 0.8B-shaped models, a llama-server run.

The reference is llama-server built from the vendored llama.cpp without AMX
(``scripts/build_llamacpp_tools.sh``), one fresh server per configuration, started and
stopped around its requests so that only one engine uses the cores at a time (DESIGN §6).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from typing_extensions import Self

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(os.environ.get("PYGGSPEC_LLAMACPP_BUILD", ROOT / ".cache" / "llama.cpp-build")) / "bin"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggspec" / "bench"


# --- GPU offload (scripts/gpu_check.sh): unset, nothing changes from the CPU benchmarks ------
class Offload:
    """``-ngl`` and ``-dev`` given to both engines: llama-server's flags, the Engine's
    ``n_gpu_layers`` / ``device`` in the child processes, ``pyggspec serve``'s flags."""

    ngl: int | None = None
    device: str | None = None


OFFLOAD = Offload()


def add_offload_args(ap) -> None:
    """The benchmarks' GPU options (all off by default: CPU runs as before)."""
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=None,
                    help="layers on the GPU for both engines (e.g. 99: full offload)")
    ap.add_argument("-dev", "--device", dest="device", default=None,
                    help="ggml device for both engines (e.g. CUDA0, Vulkan0)")
    ap.add_argument("--llama-build", type=Path, default=None,
                    help="llama.cpp build folder whose bin/ holds the llama-server to compare "
                         "with (default: $PYGGSPEC_LLAMACPP_BUILD or .cache/llama.cpp-build)")


def set_offload(args) -> None:
    OFFLOAD.ngl = getattr(args, "ngl", None)
    OFFLOAD.device = getattr(args, "device", None)
    if getattr(args, "llama_build", None):
        use_llama_build(args.llama_build)


def use_llama_build(build: str | os.PathLike) -> None:
    """Compare with the llama-server of this llama.cpp build folder from now on."""
    global TOOLS
    TOOLS = Path(build) / "bin"


def llama_offload_flags() -> list[str]:
    """``-ngl N -dev NAME`` as set (the same flag names serve ``pyggspec serve``)."""
    flags = []
    if OFFLOAD.ngl is not None:
        flags += ["-ngl", str(OFFLOAD.ngl)]
    if OFFLOAD.device:
        flags += ["-dev", OFFLOAD.device]
    return flags


def engine_offload_kw() -> str:
    """Keyword arguments for the ``Engine(...)`` the benchmarks run in a child ("" unset)."""
    kw = ""
    if OFFLOAD.ngl is not None:
        kw += f", n_gpu_layers={OFFLOAD.ngl}"
    if OFFLOAD.device:
        kw += f", device={OFFLOAD.device!r}"
    return kw


def tool(name: str) -> Path:
    p = TOOLS / name
    if not p.exists():
        sys.exit(f"{p} not found; run scripts/build_llamacpp_tools.sh first")
    return p


def bench_model(agreement: float, qtype: str) -> Path:
    """The 0.8B-shaped constructed-agreement model (generated once in F16) quantized by
    llama.cpp's own llama-quantize to ``qtype`` (F16: as generated)."""
    from pyggspec.testing import cached_model, qwen35_0_8b

    src = cached_model(qwen35_0_8b(dtype="f16", agreement=agreement), CACHE)
    if qtype.upper() == "F16":
        return src
    dst = src.with_name(src.name.replace("-F16", f"-{qtype}"))
    if not dst.exists():
        print(f"quantizing {src.name} -> {qtype}", file=sys.stderr)
        tmp = dst.with_suffix(".tmp")
        subprocess.run([str(tool("llama-quantize")), str(src), str(tmp), qtype, "2"],
                       check=True, capture_output=True)
        tmp.rename(dst)
    return dst


def bench_prompt(n: int, path: Path, seed: int = 0) -> list[int]:
    """``n`` seeded token ids inside the model's vocabulary (the same for both engines)."""
    import numpy as np

    from pyggspec.modelfile import open_model

    with open_model(path) as m:
        hi = min(5000, m.trunk.n_vocab)
    return [int(t) for t in np.random.default_rng(seed).integers(hi // 16, hi, size=n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServer:
    """``with LlamaServer(model, flags) as srv: srv.complete(...)``: a fresh llama-server
    on a free loopback port, gone when the block ends."""

    def __init__(self, model: Path, flags: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(tool("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), *flags, *llama_offload_flags()]

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): "
                                   f"{self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self.proc.poll() is not None and hasattr(exc, "add_note"):
            # the request failed because the server died: say so, with its last words
            exc.add_note(f"llama-server exited ({self.proc.returncode}): "
                         + (self.proc.stderr.read() or "")[-2000:])
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def complete(self, prompt: list[int], n_predict: int, **kw) -> dict:
        """One greedy /completion; its ``timings`` and the generated token ids."""
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                "temperature": 0, "cache_prompt": False, "return_tokens": True, **kw}
        return post(self.base + "/completion", body)

    def complete_many(self, prompts: list[list[int]], n_predict: int) -> tuple[list[dict], float]:
        """The prompts as concurrent requests; their responses and the wall time."""
        out: list[dict | None] = [None] * len(prompts)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                out[i] = self.complete(prompts[i], n_predict)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return [o for o in out if o is not None], wall


def run_child(code: str) -> dict:
    """Run ``code`` in a fresh Python (its threads and memory gone afterwards, like a
    server process); it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"child failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
