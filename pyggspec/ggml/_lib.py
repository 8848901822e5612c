"""Load (building once if needed) the cffi extension over llama-cpp-python's ggml.

This is the only module that imports the compiled extension. The build is keyed by a
hash of our C sources and of the installed ggml, so upgrading llama-cpp-python or
editing ``native/`` rebuilds automatically; the result lives in
``pyggspec/ggml/_native/<key>/`` (or ``$XDG_CACHE_HOME/pyggspec`` when the package
directory is read-only).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from pyggspec.errors import BindingError

_NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"
_module: ModuleType | None = None


def _builder() -> ModuleType:
    path = _NATIVE_DIR / "build.py"
    if not path.is_file():
        raise BindingError(
            _NATIVE_DIR,
            "pyggspec's native/ sources are missing; install pyggspec in editable mode "
            "(./install.sh) from a source checkout",
        )
    spec = importlib.util.spec_from_file_location("_pyggspec_native_build", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def _out_root() -> Path:
    local = Path(__file__).resolve().parent / "_native"
    try:
        local.mkdir(exist_ok=True)
        if os.access(local, os.W_OK):
            return local
    except OSError:
        pass
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyggspec" / "native"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _find_built(out: Path, name: str) -> Path | None:
    hits = sorted(out.glob(f"{name}*.so")) + sorted(out.glob(f"{name}*.pyd"))
    return hits[0] if hits else None


def ensure_built(verbose: bool = False) -> Path:
    """Return the path of the compiled extension, compiling it first if it is stale."""
    builder = _builder()
    try:
        ggml = builder.find_ggml()
    except RuntimeError as e:
        raise BindingError(None, str(e)) from None
    if ggml.version != builder.LLAMA_CPP_VERSION:
        raise BindingError(
            ggml.package_dir,
            f"llama-cpp-python {ggml.version} is installed but pyggspec needs exactly "
            f"{builder.LLAMA_CPP_VERSION}; run ./install.sh",
        )
    out = _out_root() / builder.build_key(ggml)
    built = _find_built(out, builder.MODULE_NAME)
    if built is not None:
        return built
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = _find_built(out, builder.MODULE_NAME)
        if built is None:
            print("pyggspec: compiling the ggml binding (once) ...", file=sys.stderr)
            try:
                built = builder.build(out, ggml, verbose=verbose)
            except Exception as e:  # noqa: BLE001  (compiler missing, header drift, ...)
                raise BindingError(out, f"building the ggml binding failed: {e}") from None
    return built


def native() -> ModuleType:
    """The compiled extension module (``.ffi`` and ``.lib``), loaded once per process."""
    global _module
    if _module is None:
        path = ensure_built()
        name = path.name.split(".")[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(mod)
        # ggml logs at WARN and above go to stderr; everything is counted.
        mod.lib.pyggspec_log_set_min_level(3)
        # known-broken devices get their ggml switches before any of them initialises
        from pyggspec.ggml import quirks

        quirks.apply(mod.lib, mod.ffi)
        _module = mod
        # plain module attributes from now on: no __getattr__ call on the hot path
        globals()["ffi"] = mod.ffi
        globals()["lib"] = mod.lib
    return _module


def __getattr__(name: str):
    if name == "ffi":
        return native().ffi
    if name == "lib":
        return native().lib
    raise AttributeError(name)
