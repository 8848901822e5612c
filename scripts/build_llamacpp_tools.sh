#!/usr/bin/env bash
# Build llama.cpp's own tools from the llama-cpp-python 0.3.36 sdist (the same llama.cpp
# pyggspec runs on) for the benchmarks: llama-server (the speed reference), llama-bench,
# llama-quantize, llama-speculative-simple and llama-completion. Output:
# .cache/llama.cpp-build/bin/. Nothing is copied into the repository; install.sh keeps the
# sdist in .cache/.
#
# Built WITHOUT AMX: on hosts whose CPU reports AMX but whose VM never grants the tile
# state, an AMX build crashes as soon as weights are repacked (llama.cpp's default). So the
# x86 ISA is spelled out from /proc/cpuinfo (GGML_NATIVE=OFF) with every AMX option off,
# rather than -march=native, which would switch AMX back on.
#
#   scripts/build_llamacpp_tools.sh                 # all tools
#   scripts/build_llamacpp_tools.sh llama-server    # just these targets
#
# Environment: PYGGSPEC_LLAMACPP_SRC (llama.cpp source tree), PYGGSPEC_LLAMACPP_BUILD (build
# folder), CMAKE_ARGS (added after the flags below, so they win: e.g. -DGGML_CUDA=on or
# -DGGML_VULKAN=on; scripts/gpu_check.sh uses this), PYGGSPEC_BUILD_JOBS (default: all
# cores), CMAKE_GENERATOR (CMake's own variable, e.g. Ninja).
#   scripts/build_llamacpp_tools.sh --print-isa-flags   # only print those ISA flags
set -euo pipefail
cd "$(dirname "$0")/.."
isa_flags() {  # sets ISA: this CPU's x86 flags, every AMX option off
  ISA=()
  if [ "$(uname -m)" = "x86_64" ] && [ -r /proc/cpuinfo ]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
    ISA+=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    has sse4_2 && ISA+=(-DGGML_SSE42=ON)
    has avx && ISA+=(-DGGML_AVX=ON)
    has avx2 && ISA+=(-DGGML_AVX2=ON)
    has fma && ISA+=(-DGGML_FMA=ON)
    has f16c && ISA+=(-DGGML_F16C=ON)
    has bmi2 && ISA+=(-DGGML_BMI2=ON)
    has avx_vnni && ISA+=(-DGGML_AVX_VNNI=ON)
    has avx512f avx512cd avx512vl avx512dq avx512bw && ISA+=(-DGGML_AVX512=ON)
    has avx512vbmi && ISA+=(-DGGML_AVX512_VBMI=ON)
    has avx512_vnni && ISA+=(-DGGML_AVX512_VNNI=ON)
    has avx512_bf16 && ISA+=(-DGGML_AVX512_BF16=ON)
  fi
  return 0  # the last test above fails on a CPU without it: not the function's failure
}
isa_flags
if [ "${1:-}" = "--print-isa-flags" ]; then  # for gpu_check.sh's llama-cpp-python build
  echo "${ISA[*]}"
  exit 0
fi
SRC="${PYGGSPEC_LLAMACPP_SRC:-.cache/llama-cpp-python-0.3.36/vendor/llama.cpp}"
OUT="${PYGGSPEC_LLAMACPP_BUILD:-.cache/llama.cpp-build}"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "build_llamacpp_tools.sh: llama.cpp source not found at $SRC (run ./install.sh first)" >&2
  exit 1
fi
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(llama-server llama-bench llama-quantize llama-speculative-simple llama-completion)
fi

echo "build_llamacpp_tools.sh: ${ISA[*]:-native ISA}" >&2

# shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags: split on purpose
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DGGML_RPC=OFF -DBUILD_SHARED_LIBS=OFF \
  "${ISA[@]}" ${CMAKE_ARGS:-} >/dev/null
cmake --build "$OUT" -j "${PYGGSPEC_BUILD_JOBS:-$(nproc)}" --target "${TARGETS[@]}"
for t in "${TARGETS[@]}"; do ls -l "$OUT/bin/$t"; done
