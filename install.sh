#!/usr/bin/env bash
# pyggspec: one-command install on Linux (or macOS).
#
#   ./install.sh                                  CPU + RPC backends
#   CMAKE_ARGS="-DGGML_CUDA=on" ./install.sh      add CUDA (or -DGGML_METAL=on, -DGGML_VULKAN=on)
#
# 1. llama-cpp-python 0.3.36 (supplies ggml's libraries and headers, the tokenizer and the
#    test oracle) is built from source with the RPC backend plus whatever CMAKE_ARGS adds.
#    pip's wheel cache ignores CMAKE_ARGS, so the build never uses the cache. An installed
#    llama_cpp is rebuilt when it lacks RPC or a backend CMAKE_ARGS asks for (Vulkan, CUDA,
#    Metal); PYGGSPEC_REBUILD=1 rebuilds it anyway (e.g. after changing other CMake flags).
#    Vulkan: needs glslc, the Vulkan and SPIR-V headers (Debian/Ubuntu: apt-get install
#    glslc libvulkan-dev spirv-headers, plus mesa-vulkan-drivers for the software device);
#    headers older than 1.3.254 get native/vulkan_compat (see below).
# 2. pyggspec itself, editable, with the test extras.
# 3. pyggspec's cffi extension is compiled against that ggml and the devices are listed.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
VERSION=0.3.36
CACHE=.cache
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
SRC="$CACHE/llama-cpp-python-$VERSION"

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }

llama_status() {
  # prints: missing | wrong-version | no-rpc | no-<backend> | ok
  "$PY" - "$VERSION" "${CMAKE_ARGS:-}" <<'PYEOF'
import importlib.util, pathlib, re, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None or not spec.submodule_search_locations:
    print("missing"); sys.exit()
pkg = pathlib.Path(list(spec.submodule_search_locations)[0])
ver = ""
for line in (pkg / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        ver = line.split("=", 1)[1].strip().strip("\"'")
if ver != sys.argv[1]:
    print("wrong-version"); sys.exit()
def has(lib):
    return any((pkg / "lib").glob(f"libggml-{lib}*"))
if not has("rpc"):
    print("no-rpc"); sys.exit()
# a backend CMAKE_ARGS asks for (-DGGML_VULKAN=on, ...) that the installed build lacks
for flag, lib in (("VULKAN", "vulkan"), ("CUDA", "cuda"), ("METAL", "metal")):
    if re.search(rf"-DGGML_{flag}(:BOOL)?=(on|1|true|yes)\b", sys.argv[2], re.I) and not has(lib):
        print(f"no-{lib}"); sys.exit()
print("ok")
PYEOF
}

# --- sources (kept for llama.cpp's converter, used by the optional converter tests) ---
mkdir -p "$CACHE"
if [ ! -f "$SDIST" ]; then
  say "downloading llama-cpp-python $VERSION source"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
fi
if [ ! -d "$SRC" ]; then
  mkdir -p "$SRC.tmp" && tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1 && mv "$SRC.tmp" "$SRC"
fi

# --- Vulkan on older headers -------------------------------------------------------------
# 0.3.36's ggml-vulkan.cpp names VK_EXT_layer_settings types that Vulkan headers before
# 1.3.254 (Debian 12: 1.3.239, Ubuntu 22.04: 1.3.204) lack. Only then, put our shim
# (native/vulkan_compat/vulkan/vulkan.hpp: the real header plus those few types) first on
# the C++ include path. ggml is not modified; newer headers build untouched.
wants_vulkan() { printf '%s' "${CMAKE_ARGS:-}" | grep -qiE -- '-DGGML_VULKAN(:BOOL)?=(on|1|true|yes)'; }
vulkan_headers_lack_layer_settings() {
  local inc core
  inc=$(pkg-config --variable=includedir vulkan 2>/dev/null || true)
  for core in "${VULKAN_SDK:+$VULKAN_SDK/include}/vulkan/vulkan_core.h" "${inc:-/usr/include}/vulkan/vulkan_core.h" /usr/include/vulkan/vulkan_core.h; do
    if [ -f "$core" ]; then
      grep -q 'VK_EXT_layer_settings' "$core" && return 1 || return 0
    fi
  done
  echo "install.sh: -DGGML_VULKAN=on but no Vulkan headers found (Debian/Ubuntu: apt-get install libvulkan-dev glslc spirv-headers mesa-vulkan-drivers)" >&2
  exit 1
}
if wants_vulkan; then
  command -v glslc >/dev/null || { echo "install.sh: -DGGML_VULKAN=on needs glslc (Debian/Ubuntu: apt-get install glslc spirv-headers libvulkan-dev)" >&2; exit 1; }
  if vulkan_headers_lack_layer_settings; then
    say "Vulkan headers predate VK_EXT_layer_settings: building with native/vulkan_compat"
    CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_FLAGS=-I$PWD/native/vulkan_compat"
  fi
fi

# --- 1. llama-cpp-python with RPC -------------------------------------------------------
status=$(llama_status)
if [ "$status" != "ok" ] || [ -n "${PYGGSPEC_REBUILD:-}" ]; then
  say "building llama-cpp-python $VERSION from source (status: $status; takes 5-10 minutes)"
  "$PY" -m pip uninstall --quiet -y llama-cpp-python >/dev/null 2>&1 || true
  CMAKE_ARGS="-DGGML_RPC=on ${CMAKE_ARGS:-}" "$PY" -m pip install --no-cache-dir "$SDIST"
  status=$(llama_status)
  if [ "$status" != "ok" ]; then
    echo "install.sh: llama-cpp-python $VERSION still lacks the RPC backend ($status)." >&2
    echo "  Fix: CMAKE_ARGS=-DGGML_RPC=on $PY -m pip install --no-cache-dir --force-reinstall llama-cpp-python==$VERSION" >&2
    exit 1
  fi
else
  say "llama-cpp-python $VERSION with RPC already installed"
fi

# --- 2. pyggspec -----------------------------------------------------------------------
say "installing pyggspec (editable) with test extras"
"$PY" -m pip install --quiet -e '.[test]'

# --- 3. native binding + a look at the devices ---------------------------------------
say "compiling the ggml binding"
"$PY" native/build.py >/dev/null
"$PY" -m pyggspec devices
say "done. Run the tests with: $PY -m pytest"
