#!/usr/bin/env bash
# shellcheck disable=SC2329  # the build functions run through timed()
# gpu_check.sh: one command for a session that is lent an NVIDIA GPU through the workplace's
# device tool (and, with --backend vulkan, the same run on a local Vulkan device).
#
# It builds llama-cpp-python (the ggml pyggspec runs on) with the GPU backend, pyggspec's
# native binding, llama-server from llama.cpp 0.3.36 (the same ggml) and from b11549 (the
# newest llama.cpp we can build), runs the device test subset, then the paired benchmarks
# pyggspec vs llama-server (full offload, -ngl 99 for both), and writes one markdown table
# and one JSON file. Run `scripts/gpu_check.sh --help` for the steps and the exact device
# calls. Everything it downloads or builds lives in the ignored folder .gpu/ (the script
# adds `/.gpu/` to .git/info/exclude); nothing of llama.cpp is ever copied into the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

LCP_VERSION=0.3.36
XLLAMA_VERSION=2026.10.11549
NEW_TAG=b11549
GPU=.gpu
CARRY=$GPU/carry        # what travels to the device machine (`carry: [".gpu/carry"]`)
DL=$GPU/dl              # downloads and trimming scratch (never carried)
BUILD=$GPU/build        # build outputs (kept on a warm device machine between calls)
# the detached worker's pid, log, first-call time: outside the working tree, because the device
# tool re-syncs the tree on every call and a lost pid file once started a second worker beside
# the first one (row 54: it relinked llama-server under a running benchmark)
STATE=${GPU_CHECK_STATE:-/tmp/pyggspec-gpu_check-$(printf '%s' "$ROOT" | cksum | cut -d' ' -f1)}
STAMPS=$GPU/build/stamps  # finished stages: beside the builds they describe, lost with them
RESULTS=$GPU/results    # table, JSON, logs
CARRY_LIMIT_MIB=56      # the device tool carries 64 MiB in all, the working tree included

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh [options] STEP

Steps
  prepare   HERE, with network: download llama-cpp-python 0.3.36 and xllamacpp 2026.10.11549
            (llama.cpp b11549) sdists, trim them to what a GPU build needs, fetch the cp312
            manylinux wheels pyggspec needs that the device image lacks. Output: .gpu/carry
            (about 15 MiB; it prints the size). Run once per session before the device calls.
  build     llama-cpp-python with the backend (cuda: from .gpu/carry into .gpu/build/site;
            vulkan: reuses the installed llama_cpp), the native binding, llama-server 0.3.36
            (linked to that same ggml) and llama-server b11549. Each part is skipped when done.
  test      the device test subset: pytest -m device with PYGGSPEC_TEST_DEVICE=<device>
            PYGGSPEC_REQUIRE_DEVICE=1
  bench     the paired benchmarks (scripts/gpu_check/bench.py): table + JSON in .gpu/results
  run       test, then bench
  device    for the device tool: start `build` + `run` as a detached worker (once per machine),
            follow its log for --follow seconds, copy the results so far into $OUT, and say
            whether to call again. Builds and tests overlap where they can (b11549 builds while
            the tests run). Repeat the same call until it prints "gpu_check: FINISHED".
  status    what is built and done (stage stamps in .gpu/build/stamps, the worker in /tmp)
  plan      (or --dry-run) print the time plan of one device draw for these options: the
            measured build times, the model writer's measured throughput, the estimated
            benchmark row groups in priority order, what fits --budget (scripts/gpu_check/
            plan.py). Needs no GPU and no build.

Options
  --backend cuda|vulkan   GPU backend (default cuda). vulkan reuses the llama-cpp-python
                          built by `CMAKE_ARGS=-DGGML_VULKAN=on ./install.sh`.
  --device NAME           ggml device for pyggspec and the tests (default CUDA0 / Vulkan0)
  --quick                 small run: one model (0.8B-shaped; vulkan: tiny), agreement 0.95
                          (the large shapes: both), fewer tokens, n_max 1-3, 1 repetition
  --shapes "S ..."        model shapes for the benchmarks (scripts/gpu_check/shapes.py, with
                          the sources of their hyper-parameters): 27b 35b-a3b (default: the
                          Qwen3.6-27B dense and Qwen3.6-35B-A3B MoE shapes, one 4-bit file
                          each, trunk layers of a kind sharing weights, the MTP head
                          rewritten per agreement; persistent processes per row group);
                          tiny-dense tiny-moe (their stand-ins off a GPU: the same code
                          paths); 0.8b 9b tiny (rows 50-54: Q8_0, a fresh process per run;
                          tiny on lavapipe: llama-server decodes 0.8B there at ~0.4 t/s)
  --mtp-reps N            paired repetitions of the MTP rows (default 3 for the large shapes,
                          5 for the small ones, 1 with --quick)
  --quant q4_k|q4_0|q8_0  the large shapes' type (default q4_k: every 2-D weight Q4_K, rows
                          outside 256-blocks Q8_0; q8_0 would not fit both shapes on 64 GiB)
  --budget MIN            minutes the whole device run may take from the first `device` call
                          (default 25); benchmarks that would not fit are skipped and listed
                          (large shapes: by plan.py's estimate scaled by what ran so far)
  --follow SEC            how long one `device` call follows the worker (default 540)
  --test-timeout SEC      the device tests' time limit (default 480; vulkan: 1800)
  --cuda-arch LIST        CMAKE_CUDA_ARCHITECTURES (default 90)
  --skip-new              do not build llama.cpp b11549 (its CUDA build costs as much device
                          time as llama-cpp-python's): for a short device budget, the benchmarks
                          then compare with llama-server 0.3.36 alone
  -j, --jobs N            build jobs (default: all cores; vulkan: 2, and builds run niced)
  --out DIR               where the table and JSON are copied (default: $OUT, else .gpu/results)
  -h, --help              this text

The device calls (the lead session makes them; the device tool is no shell command)
  0. Here: scripts/gpu_check.sh prepare     (network; ~15 MiB in .gpu/carry; checks the size)
     and  scripts/gpu_check.sh --dry-run --budget 12.5 --skip-new   (the time plan: it must
     say "fits" for the draw's 15 minutes)
  1. device.run  kind: left out, timeout_s: 600, carry: [".gpu/carry"],
                 command: "scripts/gpu_check.sh device --budget 12.5 --skip-new"
     The worker builds llama-cpp-python with CUDA (H200, 2026-11-27: 298-308 s on 16 cores),
     the binding (6 s) and llama-server 0.3.36 on that ggml (53-63 s; the device tests run
     beside it, 16 s), and writes the Qwen3.6-27B and -35B-A3B shaped models beside the
     builds (Q4_K, 14.3 + 18.7 GiB; measured here: 354 + 452 CPU seconds). Then the row
     groups, in this order, each started only if plan.py's estimate (scaled by what the
     groups before it took) ends by --budget: 27B and 35B-A3B at ~0.95 -np 1 (plain, our
     default, fixed n_max 1-4, llama-server plain and n_max 1-4, 3 paired reps, prefill
     pp512); per shape -np 4 (plain, default, each engine's best n_max) then serve -np 8
     with 1/4/8 clients (plain and draft-mtp, both engines); ~0.70 at -np 1; b11549 (only
     without --skip-new). Every run reaches gpu_check.json at once; the step split (verify,
     MTP runs, host, syncs, rebuilds; llama-server's steps and graph reuse) is in the notes.
     Machine start (~1.5 min) + 12.5 + the last reply fits 15 minutes (--dry-run shows it).
     With 25+ minutes: "--budget 22" alone also builds b11549 (beside llama-server 0.3.36)
     and runs its rows last.
  2. The very same call again, at once (a machine idle for 30 s is given back and its builds
     are lost), until a reply ends with "gpu_check: FINISHED" (two calls for --budget 12.5).
     Each reply returns $OUT: gpu_check.md (the table), gpu_check.json (every run),
     plan.txt, tests.log, worker.log, timings.txt, build_logs_tail.txt (models.log in it).
  3. give_back at once after the FINISHED reply (idle time counts against the budget).
  A reply that says "starting on a fresh machine" on a later call means the last machine was
  lost: everything starts again, with a new budget clock; lower --budget by the minutes spent.
  Manual alternative (no detached worker, same carry): "scripts/gpu_check.sh build" (repeat
  it if a call ends at its 10 minutes: the builds resume), then "scripts/gpu_check.sh run
  --budget 9" (the benchmarks stop taking items after 9 minutes).
  The shapes of rows 50-54: --shapes 0.8b (add 9b with more time), as before.

Off a GPU (the whole plan on the CPU with the tiny stand-ins; PYTHON: a Python 3.12 venv
standing in for the device image; docs/data/gpu_check-offgpu-cb7173a.md, ~50 min on 2 cores):
  PYTHON=/tmp/dev312/bin/python scripts/gpu_check.sh prepare
  GPU_CHECK_NO_CUDA=1 PYTHON=/tmp/dev312/bin/python nice -n 19 scripts/gpu_check.sh --device CPU \
    --shapes "tiny-dense tiny-moe" --quick --mtp-reps 3 --budget 90 --skip-new -j 2 device
  (repeat until FINISHED; the device tests fail at setup there: no accelerator device)

Local Vulkan check (Mesa lavapipe on this 2-core VM): after `CMAKE_ARGS=-DGGML_VULKAN=on
./install.sh`:  scripts/gpu_check.sh prepare && scripts/gpu_check.sh --backend vulkan --quick
build && scripts/gpu_check.sh --backend vulkan --quick run   (GGML_VK_VISIBLE_DEVICES=0 is set
for you: ggml-vulkan hides CPU-type devices such as llvmpipe otherwise).
EOF
}

die() { echo "gpu_check.sh: $*" >&2; exit 2; }
say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

BACKEND=cuda
DEVICE=""
QUICK=0
SHAPES=""
QUANT=q4_k
MTP_REPS=""
BUDGET=25
FOLLOW=540
TEST_TIMEOUT=""
CUDA_ARCH=90
SKIP_NEW=0
JOBS=""
OUTDIR="${OUT:-}"
STEP=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --backend) [ $# -ge 2 ] || die "--backend needs cuda or vulkan"; BACKEND=$2; shift 2 ;;
    --backend=*) BACKEND=${1#*=}; shift ;;
    --device) [ $# -ge 2 ] || die "--device needs a name"; DEVICE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --shapes) [ $# -ge 2 ] || die "--shapes needs a list (27b 35b-a3b tiny-dense tiny-moe 0.8b 9b tiny)"; SHAPES=$2; shift 2 ;;
    --mtp-reps) [ $# -ge 2 ] || die "--mtp-reps needs a number"; MTP_REPS=$2; shift 2 ;;
    --quant) [ $# -ge 2 ] || die "--quant needs q4_k, q4_0 or q8_0"; QUANT=$2; shift 2 ;;
    --dry-run) [ -z "$STEP" ] || [ "$STEP" = plan ] || die "--dry-run is the plan step (got $STEP)"; STEP=plan; shift ;;
    --budget) [ $# -ge 2 ] || die "--budget needs minutes"; BUDGET=$2; shift 2 ;;
    --follow) [ $# -ge 2 ] || die "--follow needs seconds"; FOLLOW=$2; shift 2 ;;
    --test-timeout) [ $# -ge 2 ] || die "--test-timeout needs seconds"; TEST_TIMEOUT=$2; shift 2 ;;
    --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a list"; CUDA_ARCH=$2; shift 2 ;;
    --skip-new) SKIP_NEW=1; shift ;;
    -j|--jobs) [ $# -ge 2 ] || die "--jobs needs a number"; JOBS=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a folder"; OUTDIR=$2; shift 2 ;;
    prepare|build|test|bench|run|device|status|plan|_worker|_build_new|_build_server)
      [ -z "$STEP" ] || die "one step at a time (got $STEP and $1)"; STEP=$1; shift ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$STEP" ] || die "no step given: prepare, build, test, bench, run, device, plan or status (see --help)"
case "$BACKEND" in cuda|vulkan) ;; *) die "--backend must be cuda or vulkan, not '$BACKEND'" ;; esac
[[ "$BUDGET" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--budget must be minutes, not '$BUDGET'"
SMALL=0
for s_ in $SHAPES; do
  case "$s_" in
    27b|35b-a3b|tiny-dense|tiny-moe) ;;
    0.8b|9b|tiny) SMALL=1 ;;
    *) die "--shapes: unknown shape '$s_' (27b, 35b-a3b, tiny-dense, tiny-moe; 0.8b, 9b, tiny)" ;;
  esac
done
case "$QUANT" in q4_k|q4_0|q8_0) ;; *) die "--quant must be q4_k, q4_0 or q8_0, not '$QUANT'" ;; esac
[[ "$FOLLOW" =~ ^[0-9]+$ ]] || die "--follow must be seconds, not '$FOLLOW'"
[ -z "$MTP_REPS" ] || [[ "$MTP_REPS" =~ ^[0-9]+$ ]] || die "--mtp-reps must be a number, not '$MTP_REPS'"
[ -z "$TEST_TIMEOUT" ] || [[ "$TEST_TIMEOUT" =~ ^[0-9]+$ ]] || die "--test-timeout must be seconds, not '$TEST_TIMEOUT'"
[ -z "$JOBS" ] || [[ "$JOBS" =~ ^[0-9]+$ ]] || die "--jobs must be a number, not '$JOBS'"
if [ -z "$DEVICE" ]; then
  if [ "$BACKEND" = cuda ]; then DEVICE=CUDA0; else DEVICE=Vulkan0; fi
fi
NICE=()
if [ "$BACKEND" = vulkan ]; then
  NICE=(nice -n 19)   # the local check shares a small VM: builds and benchmarks yield
  JOBS=${JOBS:-2}
  TEST_TIMEOUT=${TEST_TIMEOUT:-1800}
  export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
fi
JOBS=${JOBS:-$(nproc)}
TEST_TIMEOUT=${TEST_TIMEOUT:-480}
PY=${PYTHON:-python3}
# CMake's own variable: Ninja where it is installed (the device image has it)
if [ -z "${CMAKE_GENERATOR:-}" ] && command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
mkdir -p "$STATE" "$STAMPS" "$RESULTS"

# ---------------------------------------------------------------------------------------
# prepare (here, with network)
# ---------------------------------------------------------------------------------------
ensure_excluded() {
  local ex
  ex="$(git rev-parse --git-dir 2>/dev/null || echo .git)/info/exclude"
  mkdir -p "$(dirname "$ex")"
  grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >>"$ex"
}

# llama.cpp paths a GPU build of llama-server / llama-cpp-python does not need
TRIM=(docs models media tests benches examples pocs gguf-py conversion requirements skills
      .github .devops .gemini .pi ci .git tools/ui/src tools/ui/tests tools/ui/static
      tools/server/tests tools/server/webui
      ggml/src/ggml-sycl ggml/src/ggml-cann ggml/src/ggml-opencl ggml/src/ggml-hexagon
      ggml/src/ggml-webgpu ggml/src/ggml-openvino ggml/src/ggml-et ggml/src/ggml-virtgpu
      ggml/src/ggml-metal ggml/src/ggml-zdnn ggml/src/ggml-zendnn ggml/src/ggml-musa
      ggml/src/ggml-hip ggml/src/ggml-kompute)

trim_tree() {  # trim_tree DIR: DIR is a llama.cpp root
  local p
  for p in "${TRIM[@]}"; do rm -rf "${1:?}/$p"; done
}

xz_pack() {  # xz_pack PARENT NAME OUT
  XZ_OPT="-6 -T${JOBS}" tar -C "$1" -cJf "$3.tmp" "$2"
  mv "$3.tmp" "$3"
}

step_prepare() {
  ensure_excluded
  mkdir -p "$CARRY" "$DL"
  local lcp_sdist="$DL/llama_cpp_python-$LCP_VERSION.tar.gz"
  if [ ! -f "$lcp_sdist" ]; then
    if [ -f ".cache/llama_cpp_python-$LCP_VERSION.tar.gz" ]; then
      cp ".cache/llama_cpp_python-$LCP_VERSION.tar.gz" "$lcp_sdist"
    else
      say "downloading llama-cpp-python $LCP_VERSION sdist"
      "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$DL"
    fi
  fi
  local x_sdist="$DL/xllamacpp-$XLLAMA_VERSION.tar.gz"
  if [ ! -f "$x_sdist" ]; then
    say "downloading xllamacpp $XLLAMA_VERSION sdist (llama.cpp $NEW_TAG; pip prepares its metadata: minutes)"
    "$PY" -m pip download -q --no-deps --no-binary :all: "xllamacpp==$XLLAMA_VERSION" -d "$DL"
  fi
  local t="$DL/trim"
  if [ ! -f "$CARRY/llama-cpp-python-$LCP_VERSION.tar.xz" ]; then
    say "trimming llama-cpp-python $LCP_VERSION"
    rm -rf "$t" && mkdir -p "$t"
    tar -xzf "$lcp_sdist" -C "$t"
    mv "$t/llama_cpp_python-$LCP_VERSION" "$t/llama-cpp-python-$LCP_VERSION"
    rm -rf "$t/llama-cpp-python-$LCP_VERSION"/{.git,.github,docker,docs,examples,tests}
    rm -f "$t/llama-cpp-python-$LCP_VERSION/vendor/llama.cpp/.git"
    trim_tree "$t/llama-cpp-python-$LCP_VERSION/vendor/llama.cpp"
    xz_pack "$t" "llama-cpp-python-$LCP_VERSION" "$CARRY/llama-cpp-python-$LCP_VERSION.tar.xz"
  fi
  if [ ! -f "$CARRY/llama.cpp-$NEW_TAG.tar.xz" ]; then
    say "trimming llama.cpp $NEW_TAG (from xllamacpp $XLLAMA_VERSION)"
    rm -rf "$t" && mkdir -p "$t"
    tar -xzf "$x_sdist" -C "$t" --wildcards "xllamacpp-$XLLAMA_VERSION/thirdparty/llama.cpp/*"
    mv "$t/xllamacpp-$XLLAMA_VERSION/thirdparty/llama.cpp" "$t/llama.cpp-$NEW_TAG"
    rm -rf "$t/xllamacpp-$XLLAMA_VERSION"
    trim_tree "$t/llama.cpp-$NEW_TAG"
    xz_pack "$t" "llama.cpp-$NEW_TAG" "$CARRY/llama.cpp-$NEW_TAG.tar.xz"
  fi
  rm -rf "$t"
  if [ ! -f "$CARRY/whl/.done" ]; then
    say "fetching the cp312 manylinux wheels the device image lacks"
    rm -rf "$CARRY/whl"
    "$PY" scripts/gpu_check/wheels.py "$CARRY/whl"
    touch "$CARRY/whl/.done"
  fi
  report_sizes
}

report_sizes() {
  local carry_b tree_b total_mib
  carry_b=$(du -sb "$CARRY" | cut -f1)
  tree_b=$( { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true; } \
            | awk '{s+=$1} END {print s+0}')
  total_mib=$(( (carry_b + tree_b) / 1048576 ))
  say "carried folder $CARRY: $(( carry_b / 1048576 )) MiB ($(du -sh "$CARRY" | cut -f1)); working tree: $(( tree_b / 1024 )) KiB; together ${total_mib} MiB of the 64 MiB a device call carries"
  find "$CARRY" -type f -printf '  %10s  %p\n' | sort -k2
  if [ "$total_mib" -gt "$CARRY_LIMIT_MIB" ]; then
    echo "gpu_check.sh: $CARRY plus the working tree is ${total_mib} MiB, over ${CARRY_LIMIT_MIB} MiB" >&2
    exit 1
  fi
}

# ---------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------
SITE=$ROOT/$BUILD/site
SRC=$BUILD/src
LCP_SRC=$SRC/llama-cpp-python-$LCP_VERSION
NEW_SRC=$SRC/llama.cpp-$NEW_TAG
OLD_TOOLS=$BUILD/tools-$LCP_VERSION-$BACKEND
NEW_TOOLS=$BUILD/tools-$NEW_TAG-$BACKEND

stamp() { touch "$STAMPS/$1.$BACKEND.done"; }
done_() { [ -f "$STAMPS/$1.$BACKEND.done" ]; }

timed() {  # timed NAME LOGFILE CMD...: run, log to file, print the stage time
  local name=$1 log=$2 t0 rc=0
  shift 2
  t0=$(date +%s)
  say "$name: started (log: $log)"
  "$@" >"$log" 2>&1 || rc=$?
  echo "$name $(( $(date +%s) - t0 ))s rc=$rc" >>"$STATE/timings.txt"
  if [ $rc -ne 0 ]; then
    say "$name: FAILED after $(( $(date +%s) - t0 ))s (rc $rc); last lines of $log:"
    tail -n 25 "$log" | sed 's/^/    /'
    return $rc
  fi
  say "$name: done in $(( $(date +%s) - t0 ))s"
}

python_env() {
  # cuda: llama_cpp and the carried wheels live in .gpu/build/site; pyggspec from the tree
  if [ "$BACKEND" = cuda ]; then
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  # the benchmark models: on the device inside the repo's .gpu (its disk holds the builds);
  # here the shared ~/.cache/pyggspec/bench the other benchmarks use
  if [ "$BACKEND" = cuda ] && [ -z "${XDG_CACHE_HOME:-}" ]; then
    export XDG_CACHE_HOME="$ROOT/$GPU/cache"
  fi
  if [ "$BACKEND" = cuda ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  # The device image sets CC, CXX and CUDAHOSTCXX to /opt/gcc's wrappers of the same gcc,
  # which link libstdc++ statically: the first GPU run's libggml-cuda.so exported its own copy
  # (3415 std:: symbols), and a process that had the system libstdc++ loaded before libllama
  # (the oracle tests) mixed the two and segfaulted in llama_model::print_info; with the
  # system libstdc++ preloaded both tests passed. The system compilers link it as a shared
  # library, as every other library in the process does.
  if [ "$BACKEND" = cuda ] && [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
    export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  fi
}

check_shared_libstdcxx() {  # say so when a built ggml library carries its own libstdc++
  local lib n
  for lib in "$SITE"/llama_cpp/lib/libggml-cuda.so "$SITE"/llama_cpp/lib/libllama.so; do
    [ -f "$lib" ] || continue
    # std::__codecvt_utf8_base is defined by libstdc++ alone, never instantiated by users
    n=$(nm -D --defined-only "$lib" 2>/dev/null | grep -c '_ZNKSt19__codecvt_utf8_base' || true)
    if [ "${n:-0}" -gt 0 ]; then
      say "WARNING: $lib carries libstdc++ (linked statically; $n of its codecvt symbols exported): a process that loads it after the system libstdc++ can crash (the oracle tests did)"
    fi
  done
}

unpack_sources() {
  mkdir -p "$SRC"
  local f name
  for f in "llama-cpp-python-$LCP_VERSION" "llama.cpp-$NEW_TAG"; do
    name="$CARRY/$f.tar.xz"
    if [ "$f" = "llama.cpp-$NEW_TAG" ] && [ "$SKIP_NEW" = 1 ] && [ ! -f "$name" ]; then
      continue  # --skip-new: b11549's sources are not needed
    fi
    if [ ! -d "$SRC/$f" ]; then
      [ -f "$name" ] || die "$name missing: run 'scripts/gpu_check.sh prepare' here first (and carry .gpu/carry)"
      tar -xJf "$name" -C "$SRC" 2>/dev/null || "$PY" - "$name" "$SRC" <<'PYEOF'
import sys, tarfile  # no xz(1) on this machine: Python's lzma does it
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
PYEOF
    fi
  done
}

install_wheels() {
  [ "$BACKEND" = cuda ] || return 0
  mkdir -p "$SITE"
  compgen -G "$CARRY/whl/*.whl" >/dev/null || die "$CARRY/whl has no wheels: run 'scripts/gpu_check.sh prepare' here first"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$CARRY"/whl/*.whl
  "$PY" -c "import cffi, gguf, fastapi, uvicorn, openai, pydantic, diskcache, scikit_build_core; print('wheels ok')"
}

build_lcp_cuda() {
  # llama-cpp-python from the trimmed sdist, the CUDA + RPC backends (as install.sh adds RPC),
  # installed into .gpu/build/site; its build folder is kept so an interrupted build resumes.
  # The CPU backend with this CPU's ISA and AMX off, as build_llamacpp_tools.sh does (a VM
  # may report AMX without granting it: ggml's AMX repacking then crashes)
  local args gpu="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
  # GPU_CHECK_NO_CUDA=1: the same steps without CUDA (tests this script's plumbing off a GPU)
  [ "${GPU_CHECK_NO_CUDA:-}" = 1 ] && gpu=""
  args="-DGGML_RPC=on $gpu $(scripts/build_llamacpp_tools.sh --print-isa-flags) ${CMAKE_ARGS:-}"
  say "llama-cpp-python CMAKE_ARGS: $args"
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    "$PY" -m pip install -v --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target "$SITE" --config-settings=build-dir="$ROOT/$BUILD/lcp-cuda" "$LCP_SRC"
}

vulkan_compat_flags() {
  # as install.sh: Vulkan headers older than VK_EXT_layer_settings get native/vulkan_compat
  local core=/usr/include/vulkan/vulkan_core.h
  if [ -f "$core" ] && ! grep -q VK_EXT_layer_settings "$core" && [ -d native/vulkan_compat ]; then
    printf '%s' "-DCMAKE_CXX_FLAGS=-I$ROOT/native/vulkan_compat"
  fi
}

llama_cpp_site() {  # the folder holding llama_cpp (site-packages or .gpu/build/site)
  "$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llama_cpp'); print(pathlib.Path(list(s.submodule_search_locations)[0]).parent)"
}

build_old_server() {
  # llama-server of llama.cpp 0.3.36 linked against the very ggml libraries llama_cpp
  # installed (find_package(ggml) through LLAMA_USE_SYSTEM_GGML): the same kernels as
  # pyggspec, and no second ggml build
  local site ggml_dir
  site=$(llama_cpp_site)
  ggml_dir="$site/lib/cmake/ggml"
  [ -f "$ggml_dir/ggml-config.cmake" ] || die "$ggml_dir/ggml-config.cmake missing (llama_cpp at $site)"
  PYGGSPEC_LLAMACPP_SRC="$LCP_SRC/vendor/llama.cpp" PYGGSPEC_LLAMACPP_BUILD="$OLD_TOOLS" \
  PYGGSPEC_BUILD_JOBS=$JOBS \
  CMAKE_ARGS="-DLLAMA_USE_SYSTEM_GGML=ON -Dggml_DIR=$ggml_dir -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF" \
    "${NICE[@]}" scripts/build_llamacpp_tools.sh llama-server
}

build_new_server() {
  local args="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF"
  if [ "$BACKEND" = cuda ]; then
    [ "${GPU_CHECK_NO_CUDA:-}" = 1 ] || args+=" -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
  else
    args+=" -DGGML_VULKAN=on $(vulkan_compat_flags)"
  fi
  PYGGSPEC_LLAMACPP_SRC="$NEW_SRC" PYGGSPEC_LLAMACPP_BUILD="$NEW_TOOLS" \
  PYGGSPEC_BUILD_JOBS=$JOBS CMAKE_ARGS="$args" \
    "${NICE[@]}" scripts/build_llamacpp_tools.sh llama-server
}

check_vulkan_install() {
  local lib
  lib="$(llama_cpp_site)/llama_cpp/lib"
  compgen -G "$lib/libggml-vulkan*" >/dev/null || \
    die "the installed llama_cpp ($lib) has no Vulkan backend: run CMAKE_ARGS=-DGGML_VULKAN=on ./install.sh first"
}

build_core() {  # sources, wheels, llama-cpp-python, native binding
  python_env
  unpack_sources
  if ! done_ wheels; then
    timed wheels "$RESULTS/build_wheels.log" install_wheels
    stamp wheels
  fi
  if [ "$BACKEND" = cuda ]; then
    if ! done_ lcp; then
      command -v nvcc >/dev/null || [ "${GPU_CHECK_NO_CUDA:-}" = 1 ] || die "nvcc not found (CUDA toolkit): not a CUDA machine?"
      timed "llama-cpp-python $LCP_VERSION (CUDA $CUDA_ARCH, $JOBS jobs)" "$RESULTS/build_lcp.log" build_lcp_cuda
      check_shared_libstdcxx
      stamp lcp
    fi
  else
    check_vulkan_install
  fi
  if ! done_ native; then
    timed "native binding" "$RESULTS/build_native.log" "$PY" native/build.py
    "$PY" -m pyggspec devices | tee "$RESULTS/devices.txt"
    grep -q "^$DEVICE " "$RESULTS/devices.txt" || die "pyggspec devices does not list $DEVICE"
    stamp native
  fi
}

build_server() {  # llama-server 0.3.36 on llama-cpp-python's ggml
  if ! done_ old_server; then
    timed "llama-server $LCP_VERSION (system ggml)" "$RESULTS/build_server_$LCP_VERSION.log" build_old_server
    stamp old_server
  fi
}

build_base() { build_core; build_server; }  # sources ... llama-server 0.3.36

build_new() {
  if [ "$SKIP_NEW" = 1 ]; then say "llama-server $NEW_TAG: skipped (--skip-new)"; return 0; fi
  if ! done_ new_server; then
    timed "llama-server $NEW_TAG ($BACKEND, $JOBS jobs)" "$RESULTS/build_server_$NEW_TAG.log" build_new_server
    stamp new_server
  fi
}

step_build() { build_base; build_new; }

# ---------------------------------------------------------------------------------------
# test, bench
# ---------------------------------------------------------------------------------------
step_test() {
  python_env
  local rc=0 t0
  t0=$(date +%s)
  say "device tests: pytest -m device on $DEVICE"
  PYGGSPEC_TEST_DEVICE=$DEVICE PYGGSPEC_REQUIRE_DEVICE=1 \
    timeout "$TEST_TIMEOUT" "${NICE[@]}" "$PY" -m pytest -m device -p no:cacheprovider -v -rfE --tb=short tests \
    >"$RESULTS/tests.log" 2>&1 || rc=$?
  tail -n 15 "$RESULTS/tests.log" | sed 's/^/    /'
  echo "tests $(( $(date +%s) - t0 ))s rc=$rc" >>"$STATE/timings.txt"
  # pytest: 0 passed, 1 failures, 5 nothing collected; 124 timeout
  printf '{"rc": %d, "seconds": %d, "summary": %s}\n' "$rc" "$(( $(date +%s) - t0 ))" \
    "$(grep -E '(passed|failed|error|skipped|no tests ran|deselected)' "$RESULTS/tests.log" | tail -n 1 \
       | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().strip(" =\n")))')" \
    >"$RESULTS/tests.json"
  say "device tests: rc $rc in $(( $(date +%s) - t0 ))s"
}

step_bench() {
  python_env
  local deadline=0 t0 q=()
  if [ "${GPU_CHECK_WORKER:-}" = 1 ] && [ -f "$STATE/t0" ]; then  # the budget counts from the first call
    deadline=$(awk -v t0="$(cat "$STATE/t0")" -v b="$BUDGET" 'BEGIN {printf "%d", t0 + b * 60}')
  else
    deadline=$(awk -v t0="$(date +%s)" -v b="$BUDGET" 'BEGIN {printf "%d", t0 + b * 60}')
  fi
  [ "$QUICK" = 1 ] && q=(--quick)
  # shellcheck disable=SC2206  # a list of words on purpose
  [ -n "$SHAPES" ] && q+=(--shapes $SHAPES)
  q+=(--quant "$QUANT" --budget "$BUDGET")
  [ -n "$MTP_REPS" ] && q+=(--mtp-reps "$MTP_REPS")
  t0=$(date +%s)
  local builds=()
  [ -x "$OLD_TOOLS/bin/llama-server" ] && builds+=(--llama "$LCP_VERSION=$OLD_TOOLS")
  [ -x "$NEW_TOOLS/bin/llama-server" ] && builds+=(--llama "$NEW_TAG=$NEW_TOOLS")
  [ ${#builds[@]} -gt 0 ] || die "no llama-server built: run 'scripts/gpu_check.sh build' first"
  local dev=(--device "$DEVICE")
  # off a GPU (GPU_CHECK_NO_CUDA=1 --device CPU): both engines on the CPU, no offload flags
  # (llama-server takes no "-dev CPU")
  [ "${GPU_CHECK_NO_CUDA:-}" = 1 ] && [ "$DEVICE" = CPU ] && dev=(--device none --ngl 0)
  "${NICE[@]}" "$PY" scripts/gpu_check/bench.py --backend "$BACKEND" "${dev[@]}" \
    "${builds[@]}" --deadline "$deadline" --results "$RESULTS" --timings "$STATE/timings.txt" \
    --tests "$RESULTS/tests.json" "${q[@]}"
  echo "bench $(( $(date +%s) - t0 ))s" >>"$STATE/timings.txt"
}

step_run() { step_test || true; step_bench; }

copy_out() {
  [ -n "$OUTDIR" ] || return 0
  mkdir -p "$OUTDIR"
  local f
  for f in gpu_check.md gpu_check.json tests.log plan.txt; do
    [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUTDIR/"
  done
  [ -f "$STATE/worker.log" ] && cp "$STATE/worker.log" "$OUTDIR/worker.log"
  # build logs: only the tails (the device tool returns at most 8 files)
  : >"$OUTDIR/build_logs_tail.txt"
  for f in "$RESULTS"/build_*.log "$RESULTS"/models.log; do
    [ -f "$f" ] || continue
    { echo "==> $f"; tail -n 60 "$f"; } >>"$OUTDIR/build_logs_tail.txt"
  done
  [ -f "$STATE/timings.txt" ] && cp "$STATE/timings.txt" "$OUTDIR/timings.txt"
  return 0
}

# ---------------------------------------------------------------------------------------
# device: a detached worker, followed call after call
# ---------------------------------------------------------------------------------------
worker_alive() { [ -f "$STATE/worker.pid" ] && kill -0 "$(cat "$STATE/worker.pid")" 2>/dev/null; }
# a gpu_check worker on this machine that runs without its pid file (the file was lost): its
# pid, if any (the device machine holds one checkout; elsewhere two checkouts' workers match)
stray_worker() { pgrep -f -- "gpu_check.sh .*_worker" | grep -vx "$$" | head -n 1; }

start_models() {
  # the benchmark models are written by numpy on one core each: one process per model,
  # alongside the builds (bench.py would write them too, later and one at a time)
  local q=() shape agr
  [ "$QUICK" = 1 ] && q=(--quick)
  local shapes="${SHAPES:-27b 35b-a3b}"
  if [ "$QUICK" = 1 ]; then
    if [ "$BACKEND" = vulkan ]; then shapes="${SHAPES:-tiny}"; else shapes="${SHAPES:-0.8b}"; fi
  fi
  : >"$RESULTS/models.log"
  MODEL_PIDS=()
  local agrs
  df -h "$ROOT" | sed 's/^/    /'
  for shape in $shapes; do
    case "$shape" in
      # one file per large shape: the other agreement is its eh_proj rewritten (shapes.py)
      27b|35b-a3b|tiny-dense|tiny-moe) agrs=0.95 ;;
      *) agrs="0.95 0.70" ;;
    esac
    for agr in $agrs; do
      if [ "$QUICK" = 1 ] && [ "$agr" != 0.95 ]; then continue; fi
      nice -n 5 "$PY" scripts/gpu_check/bench.py --make-models --backend "$BACKEND" "${q[@]}" \
        --quant "$QUANT" --shapes "$shape" --agreements "$agr" >>"$RESULTS/models.log" 2>&1 &
      MODEL_PIDS+=($!)
    done
  done
  say "writing the benchmark models in the background (${#MODEL_PIDS[@]} processes, log: $RESULTS/models.log)"
}

wait_models() {
  local pid t0
  t0=$(date +%s)
  for pid in "${MODEL_PIDS[@]}"; do wait "$pid" || say "a model writer failed (see $RESULTS/models.log)"; done
  echo "models (waited) $(( $(date +%s) - t0 ))s" >>"$STATE/timings.txt"
  grep '^\[models\]' "$RESULTS/models.log" | sed 's/^/    /' || true
}

plan_text() {  # the time plan of one draw for these settings (bench.py --plan)
  local q=(--plan --backend "$BACKEND" --quant "$QUANT" --budget "$BUDGET")
  # shellcheck disable=SC2206  # a list of words on purpose
  [ -n "$SHAPES" ] && q+=(--shapes $SHAPES)
  [ "$SKIP_NEW" = 1 ] || q+=(--new-build)
  [ "$QUICK" = 1 ] && q+=(--quick)
  if [ "$SMALL" = 1 ] || { [ "$QUICK" = 1 ] && [ -z "$SHAPES" ]; }; then
    echo "(no time plan for the small shapes: their benchmarks skip by seconds per run)"
    return 0
  fi
  "$PY" scripts/gpu_check/bench.py "${q[@]}"
}

step_worker() {
  # sources and wheels; the models written alongside llama-cpp-python's build; b11549's
  # build alongside the tests; then the benchmarks
  local q=() rc=0
  [ "$QUICK" = 1 ] && q=(--quick)
  say "worker: backend $BACKEND, device $DEVICE, $JOBS jobs, budget $BUDGET min"
  export GPU_CHECK_WORKER=1
  python_env
  unpack_sources
  if ! done_ wheels; then
    timed wheels "$RESULTS/build_wheels.log" install_wheels
    stamp wheels
  fi
  start_models
  plan_text | tee "$RESULTS/plan.txt" | sed 's/^/    /'
  build_core
  local opts=(--backend "$BACKEND" --device "$DEVICE" --budget "$BUDGET" -j "$JOBS" --cuda-arch "$CUDA_ARCH" --quant "$QUANT" "${q[@]}")
  [ "$SKIP_NEW" = 1 ] && opts+=(--skip-new)
  [ -n "$SHAPES" ] && opts+=(--shapes "$SHAPES")
  # llama-server 0.3.36 (and b11549, unless --skip-new) build beside the device tests (they
  # need llama-cpp-python and the binding only); the benchmarks wait for both builds
  scripts/gpu_check.sh "${opts[@]}" _build_server &
  local srvpid=$!
  scripts/gpu_check.sh "${opts[@]}" _build_new &
  local newpid=$!
  step_test || true
  wait "$srvpid" || die "llama-server $LCP_VERSION did not build (see build_logs_tail.txt)"
  wait "$newpid" || rc=$?
  [ $rc -eq 0 ] || say "llama-server $NEW_TAG did not build (rc $rc): benchmarks use $LCP_VERSION only"
  wait_models
  step_bench
  touch "$STATE/finished"
  say "worker: finished"
}

step_device() {
  local t_call
  t_call=$(date +%s)
  if [ -f "$STATE/finished" ]; then
    say "already finished on this machine"
  elif worker_alive; then
    say "worker running (pid $(cat "$STATE/worker.pid")); following its log"
  elif [ -n "$(stray_worker)" ]; then
    stray_worker >"$STATE/worker.pid"
    say "worker running without its state (pid $(cat "$STATE/worker.pid")): following it, not starting another"
  else
    if [ -f "$STATE/worker.pid" ]; then
      say "worker gone without finishing: restarting it (finished stages are skipped)"
    else
      say "starting on a fresh machine: $(nproc) cores, $(free -g | awk '/^Mem/ {print $2}') GiB"
      command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
      [ -f "$STATE/t0" ] || date +%s >"$STATE/t0"
      # stage times of this run only (stages finished before keep their stamps, not times)
      if [ -f "$STATE/timings.txt" ]; then mv "$STATE/timings.txt" "$STATE/timings.prev.txt"; fi
    fi
    local q=()
    [ "$QUICK" = 1 ] && q=(--quick)
    [ -n "$SHAPES" ] && q+=(--shapes "$SHAPES")
    [ "$SKIP_NEW" = 1 ] && q+=(--skip-new)
    [ -n "$MTP_REPS" ] && q+=(--mtp-reps "$MTP_REPS")
    q+=(--quant "$QUANT")
    setsid nohup scripts/gpu_check.sh --backend "$BACKEND" --device "$DEVICE" --budget "$BUDGET" \
      --cuda-arch "$CUDA_ARCH" -j "$JOBS" --test-timeout "$TEST_TIMEOUT" "${q[@]}" _worker >>"$STATE/worker.log" 2>&1 </dev/null &
    echo $! >"$STATE/worker.pid"
  fi
  # follow the log until the worker ends or --follow seconds pass
  local shown=0 lines
  [ -f "$STATE/shown" ] && shown=$(cat "$STATE/shown")
  while :; do
    if [ -f "$STATE/worker.log" ]; then
      lines=$(wc -l <"$STATE/worker.log")
      if [ "$lines" -gt "$shown" ]; then
        sed -n "$((shown + 1)),${lines}p" "$STATE/worker.log"
        shown=$lines
        echo "$shown" >"$STATE/shown"
      fi
    fi
    if [ -f "$STATE/finished" ] || ! worker_alive; then break; fi
    if [ $(( $(date +%s) - t_call )) -ge "$FOLLOW" ]; then break; fi
    sleep 2
  done
  copy_out
  if [ -f "$STATE/finished" ]; then
    # (the table itself is in the worker's log above, and in gpu_check.md)
    say "gpu_check: FINISHED ($(( ($(date +%s) - $(cat "$STATE/t0")) / 60 )) min since the first call); results in ${OUTDIR:-$RESULTS}. Give the machine back now."
  elif worker_alive; then
    say "gpu_check: still running ($(( ($(date +%s) - $(cat "$STATE/t0")) / 60 )) min since the first call): make the same call again now"
  else
    say "gpu_check: the worker stopped without finishing (see worker.log): make the same call again to resume"
  fi
}

step_status() {
  ls -l "$STATE" 2>/dev/null || true
  [ -f "$STATE/timings.txt" ] && cat "$STATE/timings.txt"
  worker_alive && echo "worker running: pid $(cat "$STATE/worker.pid")"
  return 0
}

main() {
  case "$STEP" in
    prepare) step_prepare ;;
    build) step_build ;;
    test) step_test ;;
    bench) step_bench; copy_out ;;
    run) step_run; copy_out ;;
    device) step_device ;;
    status) step_status ;;
    _worker) step_worker ;;
    _build_new) python_env; build_new ;;
    _build_server) python_env; build_server ;;
    plan) python_env; plan_text ;;
  esac
}

# one line, read whole before it runs: bash reads scripts as it goes, and this file may be
# replaced while a long step runs (a device call re-sends the working tree)
main; exit $?
