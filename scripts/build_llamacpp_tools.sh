#!/usr/bin/env bash
# Build llama.cpp's own command-line tools from the llama-cpp-python 0.3.36 sdist (the same
# llama.cpp pyggspec runs on) for the benchmarks: llama-speculative-simple (llama.cpp's
# draft-mtp driver) and llama-completion. Output: .cache/llama.cpp-build/bin/.
# Nothing is copied into the repository; install.sh keeps the sdist in .cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${PYGGSPEC_LLAMACPP_SRC:-.cache/llama-cpp-python-0.3.36/vendor/llama.cpp}"
OUT="${PYGGSPEC_LLAMACPP_BUILD:-.cache/llama.cpp-build}"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "build_llamacpp_tools.sh: llama.cpp source not found at $SRC (run ./install.sh first)" >&2
  exit 1
fi
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DGGML_RPC=OFF -DBUILD_SHARED_LIBS=OFF ${CMAKE_ARGS:-} >/dev/null
cmake --build "$OUT" -j "$(nproc)" --target llama-speculative-simple llama-completion
ls -l "$OUT/bin/llama-speculative-simple" "$OUT/bin/llama-completion"
