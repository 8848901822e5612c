"""Build pyggspec's cffi extension against the ggml that llama-cpp-python installed.

Run as ``python native/build.py`` (install.sh does) or let ``pyggspec.ggml`` call
:func:`build` on first import. The extension is compiled in cffi's API mode: the real
ggml headers are included, so a signature that drifted from llama-cpp-python's ggml is
a compile error here rather than a crash later.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
MODULE_NAME = "_pyggspec_ggml"
LLAMA_CPP_VERSION = "0.3.36"


@dataclass(frozen=True)
class GgmlInstall:
    """Where llama-cpp-python put ggml: the shared libraries and the headers."""

    package_dir: Path
    lib_dir: Path
    include_dir: Path
    version: str


def find_ggml() -> GgmlInstall:
    """Locate the installed llama_cpp package without importing it (importing loads llama)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "llama-cpp-python is not installed; run ./install.sh (it builds llama-cpp-python "
            f"{LLAMA_CPP_VERSION} with the RPC backend)"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    lib_dir = pkg / "lib"
    candidates = [pkg / "include", pkg.parent / "include", Path(sysconfig.get_paths()["data"]) / "include"]
    include_dir = next((c for c in candidates if (c / "ggml.h").is_file()), None)
    if not lib_dir.is_dir() or not any(lib_dir.glob("libggml*")):
        raise RuntimeError(f"{lib_dir}: no ggml shared libraries; reinstall with ./install.sh")
    if include_dir is None:
        raise RuntimeError(
            "ggml.h not found next to llama_cpp (looked in "
            + ", ".join(str(c) for c in candidates) + "); reinstall with ./install.sh"
        )
    version = "unknown"
    init = pkg / "__init__.py"
    for line in init.read_text().splitlines():
        if line.startswith("__version__"):
            version = line.split("=", 1)[1].strip().strip("\"'")
    return GgmlInstall(pkg, lib_dir, include_dir, version)


def build_key(ggml: GgmlInstall) -> str:
    """Hash of everything the compiled module depends on: our C sources and their ggml."""
    h = hashlib.sha256()
    for name in ("ggml_decls.h", "helpers.c", "build.py"):
        h.update((NATIVE_DIR / name).read_bytes())
    for lib in sorted(ggml.lib_dir.glob("libggml*")):
        st = lib.stat()
        h.update(f"{lib.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update((ggml.include_dir / "ggml.h").read_bytes())
    h.update(sys.implementation.cache_tag.encode())
    return h.hexdigest()[:16]


def make_ffi(ggml: GgmlInstall):
    import cffi

    ffi = cffi.FFI()
    ffi.cdef((NATIVE_DIR / "ggml_decls.h").read_text())
    libs = sorted({p.name.split(".so")[0][3:] for p in ggml.lib_dir.glob("libggml*.so*")})
    # ggml and ggml-base carry the core and backend API; backends (cpu, rpc, cuda...) are
    # reached through the registry, but ggml-cpu is linked for ggml_backend_cpu_*.
    link = [name for name in ("ggml", "ggml-base", "ggml-cpu") if name in libs]
    source = (
        '#include "ggml.h"\n#include "ggml-backend.h"\n#include "ggml-alloc.h"\n'
        '#include "ggml-cpu.h"\n' + (NATIVE_DIR / "helpers.c").read_text()
    )
    ffi.set_source(
        MODULE_NAME,
        source,
        include_dirs=[str(ggml.include_dir)],
        library_dirs=[str(ggml.lib_dir)],
        libraries=link,
        extra_link_args=[f"-Wl,-rpath,{ggml.lib_dir}"],
        extra_compile_args=["-O2", "-Wno-unused-function"],
    )
    return ffi


def build(out_dir: Path, ggml: GgmlInstall | None = None, verbose: bool = False) -> Path:
    """Compile the extension into ``out_dir`` and return the path of the built module."""
    ggml = ggml or find_ggml()
    out_dir.mkdir(parents=True, exist_ok=True)
    ffi = make_ffi(ggml)
    tmp = out_dir / "tmp"
    built = Path(ffi.compile(tmpdir=str(tmp), verbose=verbose))
    final = out_dir / built.name
    built.replace(final)  # atomic: a half-written module is never found
    shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if target is None:
        sys.path.insert(0, str(NATIVE_DIR.parent))
        from pyggspec.ggml import _lib

        print(_lib.ensure_built(verbose=True))
    else:
        print(build(target, verbose=True))
    os._exit(0)
