#!/usr/bin/env bash
# Lockstep on the GPU machine, in one command from the repository root:
#
#   bash tests/gpu/device_check.sh
#
# with `.gpu` (tests/gpu/make_sysroot.sh: Debian 12's gRPC, protobuf, abseil,
# GoogleTest) and `build/data/kjv` (data/prepare_kjv.py) carried along. It
#   1. records the machine: GPU, torch / CUDA / NCCL / cuDNN versions, tools;
#   2. configures a fresh build against the CUDA libtorch of python3's torch
#      (torch.utils.cmake_prefix_path), the sysroot, CUDA in /usr/local/cuda and
#      the NCCL of the nvidia-nccl pip package that libtorch loads, without MPI;
#   3. builds lockstep_train, lockstep_sample, gpt_test and nccl_test with
#      ninja -k 0, so that every compile error shows in one go (-Werror is taken
#      off by tests/gpu/no_werror.sh, so that a newer compiler's warnings are
#      listed rather than fatal; LOCKSTEP_GPU_WERROR=1 keeps it);
#   4. runs, each on its own whatever the others did: nccl_test and gpt_test;
#      lockstep_train on configs/kjv_gpt.textproto on cuda:0 with the 1-process
#      default (no communicator) and with backend nccl (a 1-rank NCCL
#      communicator), then lockstep_sample on the NCCL run; the PyTorch reference
#      of the same GPT on cuda:0 (tests/system/gpt_reference.py train --device cuda:0).
# Everything is logged under $OUT (7 files, no folders): summary.txt, env.txt,
# build.log, tests.log, train_single.log, train_nccl.log, torch_ref.log; the last
# lines on stdout are the summary and the compile errors.
#
# Every stage runs under timeout, inside an overall budget (LOCKSTEP_GPU_BUDGET
# seconds, default 480). Knobs: LOCKSTEP_GPU_STEPS (training steps, default 1000),
# LOCKSTEP_GPU_JOBS (default: nproc), LOCKSTEP_GPU_BUILD (build dir, default
# /tmp/lockstep-gpu-build), LOCKSTEP_GPU_TARGETS (default: the four above),
# LOCKSTEP_GPU_WERROR=1, PYTHON (default python3), CUDA_HOME (default /usr/local/cuda).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-/tmp/lockstep-gpu-out}
mkdir -p "$OUT"
B=${LOCKSTEP_GPU_BUILD:-/tmp/lockstep-gpu-build}
RUNS=/tmp/lockstep-gpu-runs
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
SR=$ROOT/.gpu/sysroot
STEPS=${LOCKSTEP_GPU_STEPS:-1000}
JOBS=${LOCKSTEP_GPU_JOBS:-$(nproc)}
BUDGET=${LOCKSTEP_GPU_BUDGET:-480}
DEADLINE=$((SECONDS + BUDGET))
SUMMARY=$OUT/summary.txt
export ROOT OUT B RUNS PY CUDA_HOME SR STEPS JOBS
export PATH=$CUDA_HOME/bin:$PATH TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - SECONDS)); }
# stage NAME MAX_SECONDS LOG COMMAND...: runs COMMAND under timeout (MAX_SECONDS,
# or what is left of the budget, less RESERVE seconds kept for later stages),
# appending its output to LOG and to stdout; records rc and time in summary.txt.
RESERVE=0
stage() {
  local name=$1 max=$2 log=$3
  shift 3
  local t=$(( $(left) - RESERVE ))
  (( t > max )) && t=$max
  if (( t < 10 )); then
    note "$(printf '%-22s SKIPPED (budget: %ds left)' "$name" "$(left)")"
    return 125
  fi
  local start=$SECONDS rc
  echo "=== $name (timeout ${t}s): $*" | tee -a "$log"
  if declare -F "$1" >/dev/null; then  # a function of this script: in a child bash (exported below)
    timeout -k 10 "$t" bash -c 'set -uo pipefail; "$@"' _ "$@" 2>&1 | tee -a "$log"
  else
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$log"
  fi
  rc=${PIPESTATUS[0]}
  note "$(printf '%-22s rc=%-3s %4ds%s' "$name" "$rc" $((SECONDS - start)) "$( ((rc == 124 || rc == 137)) && echo ' TIMED OUT')")"
  return "$rc"
}

note "device_check: $(date -u +%FT%TZ), repo $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ', modified')), budget ${BUDGET}s, $JOBS jobs"

# --- 1. the machine ---------------------------------------------------------------
machine() {
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PY" - <<'EOF'
import os, torch
print("python3", os.path.realpath(__import__("sys").executable), "torch", torch.__version__, "CUDA", torch.version.cuda,
      "cuDNN", torch.backends.cudnn.version(), "cxx11 ABI", torch._C._GLIBCXX_USE_CXX11_ABI)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      "capability", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else "-")
print("NCCL (torch)", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
print("cmake prefix", torch.utils.cmake_prefix_path)
print("TF32 matmul", torch.backends.cuda.matmul.allow_tf32, "float32 matmul precision", torch.get_float32_matmul_precision())
EOF
  nvcc --version | tail -2
  for tool in c++ g++ cmake ninja; do echo "$tool: $(command -v $tool) $($tool --version 2>&1 | head -1)"; done
  ldd --version | head -1
  echo "/usr/bin/python3: $(/usr/bin/python3 --version 2>&1) $(/usr/bin/python3 -c 'import torch; print("imports torch", torch.__version__)' 2>&1 | tail -1)"
  local tdir
  tdir=$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')
  echo "--- torch at $tdir"
  ls "$tdir/include" | tr '\n' ' '; echo
  [[ -d $tdir/include/google/protobuf ]] && echo "NOTE: torch ships google/protobuf headers"
  echo "protobuf symbols exported by libtorch_cpu.so: $(nm -D --defined-only "$tdir/lib/libtorch_cpu.so" 2>/dev/null | grep -c '_ZN6google8protobuf')"
  echo "--- Caffe2Config.cmake / TorchConfig.cmake lines on protobuf, cuDNN, CUDA, C++ standard:"
  grep -n -i -E 'protobuf|cudnn|cusparselt|cudss|nvshmem|cxx_std|CXX_STANDARD|_GLIBCXX' \
    "$tdir/share/cmake/Caffe2/Caffe2Config.cmake" "$tdir/share/cmake/Torch/TorchConfig.cmake" | head -40
  echo "--- libtorch_cuda.so needs:"; ldd "$tdir/lib/libtorch_cuda.so" | grep -E 'nccl|cudart|cudnn|not found'
  echo "--- nvidia packages: $(cd "$(dirname "$tdir")/nvidia" 2>/dev/null && echo */)"
  echo "--- MPI: $(command -v mpirun mpicxx 2>/dev/null | tr '\n' ' ')"
}
export -f machine
stage "machine" 60 "$OUT/env.txt" machine

# --- 2./3. configure and build -----------------------------------------------------
configure_and_build() {
  echo "--- sysroot"; bash "$ROOT/tests/gpu/fix_sysroot.sh" "$SR" || return 3
  local torch_cmake nv
  torch_cmake=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 3
  nv=$("$PY" "$ROOT/tests/gpu/nvidia_prefix.py" /tmp/lockstep-nvprefix) || return 3
  echo "--- NVIDIA pip packages:"; echo "$nv"
  local NVIDIA_PREFIX='' NCCL_INCLUDE_DIR='' NCCL_LIBRARY='' CUDNN_INCLUDE_PATH='' CUDNN_LIBRARY_PATH=''
  local CUSPARSELT_INCLUDE_PATH='' CUSPARSELT_LIBRARY_PATH='' CUDSS_INCLUDE_PATH='' CUDSS_LIBRARY_PATH=''
  # shellcheck disable=SC2034  # set by the eval below, printed above
  local NVSHMEM_INCLUDE_DIR='' NVSHMEM_HOST_LIBRARY=''
  eval "$nv"
  local args=(-S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=$SR/usr;$torch_cmake;$NVIDIA_PREFIX"
    "-DCMAKE_PROJECT_INCLUDE=$ROOT/tests/gpu/preload.cmake"
    "-DProtobuf_PROTOC_EXECUTABLE=$SR/usr/bin/protoc"
    -DLOCKSTEP_WITH_MPI=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DLOCKSTEP_BUILD_BENCHMARKS=OFF
    -DLOCKSTEP_BUILD_TESTS=ON -DLOCKSTEP_USE_PCH=ON
    "-DCUDAToolkit_ROOT=$CUDA_HOME" "-DCMAKE_CUDA_COMPILER=$CUDA_HOME/bin/nvcc"
    "-DPython_EXECUTABLE=$(command -v "$PY")" "-DPYTHON_EXECUTABLE=$(command -v "$PY")")
  [[ -n $NCCL_INCLUDE_DIR ]] && args+=("-DNCCL_INCLUDE_DIR=$NCCL_INCLUDE_DIR" "-DNCCL_ROOT=$(dirname "$NCCL_INCLUDE_DIR")")
  [[ -n $NCCL_LIBRARY ]] && args+=("-DNCCL_LIBRARY=$NCCL_LIBRARY")
  [[ -n $CUDNN_INCLUDE_PATH ]] && args+=("-DCUDNN_INCLUDE_PATH=$CUDNN_INCLUDE_PATH" "-DCUDNN_INCLUDE_DIR=$CUDNN_INCLUDE_PATH")
  [[ -n $CUDNN_LIBRARY_PATH ]] && args+=("-DCUDNN_LIBRARY_PATH=$CUDNN_LIBRARY_PATH" "-DCUDNN_LIBRARY=$CUDNN_LIBRARY_PATH")
  [[ -n $CUSPARSELT_INCLUDE_PATH ]] && args+=("-DCUSPARSELT_INCLUDE_PATH=$CUSPARSELT_INCLUDE_PATH")
  [[ -n $CUSPARSELT_LIBRARY_PATH ]] && args+=("-DCUSPARSELT_LIBRARY_PATH=$CUSPARSELT_LIBRARY_PATH")
  [[ -n $CUDSS_INCLUDE_PATH ]] && args+=("-DCUDSS_INCLUDE_PATH=$CUDSS_INCLUDE_PATH")
  [[ -n $CUDSS_LIBRARY_PATH ]] && args+=("-DCUDSS_LIBRARY_PATH=$CUDSS_LIBRARY_PATH")
  [[ ${LOCKSTEP_GPU_WERROR:-0} == 1 ]] || args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=/bin/sh;$ROOT/tests/gpu/no_werror.sh")
  rm -rf "$B"
  echo "--- cmake ${args[*]}"
  local start=$SECONDS
  if ! cmake "${args[@]}"; then
    echo "--- configure FAILED; the end of CMake's own log:"
    tail -60 "$B/CMakeFiles/CMakeConfigureLog.yaml" 2>/dev/null || tail -60 "$B/CMakeFiles/CMakeError.log" 2>/dev/null
    return 2
  fi
  echo "--- configured in $((SECONDS - start)) s; the cache on the dependencies:"
  grep -E '^(Torch_DIR|Caffe2_DIR|CUDAToolkit_[A-Z_]*DIR|CMAKE_CUDA_COMPILER|NCCL_[A-Z_]*|CUDNN_[A-Z_]*|Protobuf_(INCLUDE_DIR|LIBRARY_RELEASE|PROTOC_EXECUTABLE)|gRPC_DIR|absl_DIR|GTest_DIR|LOCKSTEP_WITH_[A-Z]*)[:=]' "$B/CMakeCache.txt"
  start=$SECONDS
  # shellcheck disable=SC2086  # a list of target names
  ninja -C "$B" -k 0 -j "$JOBS" ${LOCKSTEP_GPU_TARGETS:-lockstep_train lockstep_sample gpt_test nccl_test}
  local rc=$?
  echo "--- ninja rc=$rc after $((SECONDS - start)) s"
  return $rc
}
export -f configure_and_build
# The runs after the build need about 150 s; keep them.
RESERVE=150 stage "configure+build" 420 "$OUT/build.log" configure_and_build
build_rc=$?
RESERVE=0

# --- 4. the checks -------------------------------------------------------------------
have() { [[ -x $1 ]] || { note "$(printf '%-22s not built: %s' "$2" "${1#"$B"/}")"; return 1; }; }
if have "$B/tests/unit/nccl_test" nccl_test; then
  stage "nccl_test" 60 "$OUT/tests.log" "$B/tests/unit/nccl_test"
fi
if have "$B/tests/unit/gpt_test" gpt_test; then
  # gpt_test compares with PyTorch through /usr/bin/python3; python3's packages let
  # it import torch when both are the same Python (else that case is skipped).
  site=$("$PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} stage "gpt_test" 150 "$OUT/tests.log" "$B/tests/unit/gpt_test" \
    ${LOCKSTEP_GPU_GPT_FILTER:+"--gtest_filter=$LOCKSTEP_GPU_GPT_FILTER"}
fi

train() {  # train LABEL BACKEND
  local dir=$RUNS/$1
  rm -rf "$dir"
  "$B/lockstep_train" --config=configs/kjv_gpt.textproto --resume=none \
    "--set=device=cuda:0,backend=$2,num_train_steps=$STEPS,eval_every_steps=$((STEPS / 2)),summary_every_steps=100,output_dir=$dir,progress=lines,checkpoint.every_steps=$((STEPS / 2))"
  local rc=$?
  echo "--- $dir: $(ls "$dir" 2>/dev/null | tr '\n' ' ')"
  return $rc
}
export -f train
if have "$B/lockstep_train" lockstep_train; then
  [[ -f build/data/kjv/train.bin ]] || note "WARNING: build/data/kjv/train.bin missing (carry build/data/kjv)"
  stage "train cuda, 1 process" 120 "$OUT/train_single.log" train single auto
  stage "train cuda, nccl" 120 "$OUT/train_nccl.log" train nccl nccl
  # The NCCL run's checkpoint halfway (CUDA parameters, saved to the host)
  # resumes on the GPU in another output_dir and trains to the end.
  resume() {
    "$B/lockstep_train" --config=configs/kjv_gpt.textproto \
      "--resume=$RUNS/nccl/checkpoints/step_$(printf %08d $((STEPS / 2)))" \
      "--set=device=cuda:0,backend=nccl,num_train_steps=$STEPS,eval_every_steps=$((STEPS / 2)),summary_every_steps=100,output_dir=$RUNS/resumed,progress=lines,checkpoint.every_steps=$((STEPS / 2))"
  }
  export -f resume
  stage "resume cuda, nccl" 90 "$OUT/train_nccl.log" resume
  if have "$B/lockstep_sample" lockstep_sample && [[ -d $RUNS/nccl ]]; then
    stage "sample (nccl run)" 60 "$OUT/train_nccl.log" "$B/lockstep_sample" "--run=$RUNS/nccl" \
      "--prompt=And God said" --tokens=200 --seed=1
  fi
fi
stage "torch reference" 150 "$OUT/torch_ref.log" "$PY" tests/system/gpt_reference.py train --device cuda:0 \
  --steps "$STEPS" --eval-every 0 --token-dir build/data/kjv

# --- the digest ------------------------------------------------------------------------
{
  echo "--- figures:"
  for f in train_single train_nccl; do
    [[ -f $OUT/$f.log ]] || continue
    grep -E '^lockstep_train:|^Language model:|^Done:|^Resumed|^lockstep_sample' "$OUT/$f.log" | sed "s/^/$f: /"
    grep -E 'train (tokens_per_second|seconds_per_step|mfu|data_wait_fraction) ' "$OUT/$f.log" | tail -4 | sed "s/^/$f: /"
  done
  [[ -f $OUT/torch_ref.log ]] && grep -E '^reference:|test loss' "$OUT/torch_ref.log" | sed 's/^/torch_ref: /'
  [[ -f $OUT/tests.log ]] && grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/tests.log" | sed 's/^/tests: /'
  if [[ -f $OUT/build.log ]]; then
    echo "--- build: $(grep -c ': error:' "$OUT/build.log") error lines, $(grep -c ': warning:' "$OUT/build.log") warning lines, $(grep -c '^FAILED:' "$OUT/build.log") failed edges (build rc $build_rc)"
    echo "--- errors (first 60, unique):"
    grep -E ': error:|: fatal error:|undefined reference|CMake Error|^FAILED:' "$OUT/build.log" | awk '!seen[$0]++' | cut -c1-400 | head -60
    echo "--- warnings in Lockstep's own files (first 30, unique):"
    grep -E '(src|include|tests)/[^ ]*: warning:' "$OUT/build.log" | grep -v '/sysroot/' | awk '!seen[$0]++' | cut -c1-300 | head -30
  fi
} >>"$SUMMARY"
echo "=================== SUMMARY ($OUT/summary.txt) ==================="
cat "$SUMMARY"
exit 0
