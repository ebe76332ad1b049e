#!/usr/bin/env bash
# Lockstep's developer entry point. Each command installs what is missing (Debian
# packages, as root or through sudo), configures and builds incrementally, then runs:
#
#   ./dev.sh train [lockstep_train flags]  the main job: a CNN on Fashion-MNIST, 2 ranks under mpirun
#   ./dev.sh train-lm [flags]              the second main job: a GPT on the King James Bible, 2 ranks
#                                          (prepares build/data/kjv first when it is missing)
#   ./dev.sh test  [ctest flags]           the whole test suite
#   ./dev.sh bench [benchmark flags]       Trainer vs hand-written step benchmark
#   ./dev.sh scaleout [flags]              scale-out suite vs PyTorch DDP (benchmarks/scaleout.sh --help)
#   ./dev.sh slow-network                  hooks and the hierarchy vs DDP on rate-limited namespace hosts
#                                          (benchmarks/slow_network.sh; root)
#   ./dev.sh build                         install and build only
#   ./dev.sh asan  [ctest flags]           unit and multi-rank tests under AddressSanitizer + UBSan (build-asan/)
#   ./dev.sh tsan  [ctest flags]           the same under ThreadSanitizer (build-tsan/)
#   ./dev.sh fuzz  [SECONDS [TARGET...]]   each libFuzzer target for SECONDS (default 60; build-fuzz/, Clang)
#   ./dev.sh faults                        the fault suite: faults injected into real jobs, one table
#   ./dev.sh ft-trials [KILLS [STOPS]]     fault tolerance: KILLS kill -9 and STOPS SIGSTOP trials on 3
#                                          ranks (default 10 and 5; CI runs 3 and 1)
#   ./dev.sh multihost-slurm [HOSTS]       launch/slurm.sbatch on a Slurm cluster of HOSTS network-namespace
#                                          hosts (default 4; CI runs 2): losses, SIGUSR1, a lost host (root)
#
# Environment: BUILD_DIR (default: build), LOCKSTEP_RANKS (default: 2) for train,
# LOCKSTEP_SKIP_INSTALL=1 to skip apt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

BUILD_DIR=${BUILD_DIR:-build}
PACKAGES=(
  cmake ninja-build g++ pkg-config zlib1g-dev
  libtorch-dev libopenblas0-pthread libdnnl-dev
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc libabsl-dev
  libopenmpi-dev openmpi-bin libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev python3-protobuf
  dataset-fashion-mnist python3-torch
  slurm-wlm munge
  bible-kjv bible-kjv-text
  iproute2 iputils-ping util-linux openssl bc
)
FUZZ_PACKAGES=(clang libclang-rt-dev)

log() { printf '[dev.sh] %s\n' "$*" >&2; }

install_packages() {
  [[ "${LOCKSTEP_SKIP_INSTALL:-0}" == 1 ]] && return 0
  local missing=()
  for pkg in "${PACKAGES[@]}" "$@"; do
    if [[ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null)" != installed ]]; then
      missing+=("$pkg")
    fi
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { log "need root to install: ${missing[*]}"; exit 1; }
    sudo=(sudo)
  fi
  log "installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}

build() {
  install_packages
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
  fi
  cmake --build "$BUILD_DIR"
}

command=${1:-}
[[ $# -gt 0 ]] && shift
case "$command" in
  build)
    build ;;
  train)
    build
    exec launch/mpirun.sh -n "${LOCKSTEP_RANKS:-2}" -- \
      "$BUILD_DIR/lockstep_train" --config=configs/fashion_mnist_cnn.textproto "$@" ;;
  train-lm)
    build
    if [[ ! -f build/data/kjv/train.bin || ! -f build/data/kjv/eval.bin ]]; then
      /usr/bin/python3 data/prepare_kjv.py build/data/kjv
    fi
    exec launch/mpirun.sh -n "${LOCKSTEP_RANKS:-2}" -- \
      "$BUILD_DIR/lockstep_train" --config=configs/kjv_gpt.textproto "$@" ;;  # data.token_dir: build/data/kjv
  slow-network)
    build
    exec benchmarks/slow_network.sh "$BUILD_DIR" ;;
  test)
    build
    exec ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 -j 2 "$@" ;;
  asan | tsan)
    install_packages
    dir=build-$command
    kind=address
    [[ $command == tsan ]] && kind=thread
    if [[ ! -f "$dir/build.ninja" ]]; then
      # -O1 -g1 (line tables, so reports still name file and line): the build takes
      # about half the time of -O2 -g, which keeps CI inside its 90 minutes.
      cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOCKSTEP_SANITIZE=$kind \
            -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DLOCKSTEP_BUILD_BENCHMARKS=OFF
    fi
    cmake --build "$dir"
    supp=$PWD/cmake/sanitizers
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
    # The fast unwinder: the multi-rank tests keep Open MPI's components loaded, so
    # their leaks carry the module names lsan.supp matches (tests/multirank/CMakeLists.txt).
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
    # One intra-op thread under TSan: libtorch's kernels would otherwise run on
    # libgomp's threads, whose barriers (in an uninstrumented library) TSan cannot
    # see, so every parallel kernel would be reported as a race.
    [[ $command == tsan ]] && export OMP_NUM_THREADS=1
    # The unit and multi-rank tests; not the installed-package build, the Slurm
    # cluster, the namespace cluster, the end-to-end training run or the benchmark
    # smoke run.
    export INJECTIONS=${INJECTIONS:-5}  # the chaos test: 5 injections, not 20 (slow under ASan)
    # The fault-tolerance test: one kill and one SIGSTOP trial, not 3 and 1.
    export KILL_TRIALS=${KILL_TRIALS:-1} STOP_TRIALS=${STOP_TRIALS:-1}
    # The peer-failure test: 3 kill -9 rounds, not 10 (the 3 split rounds stay).
    export ROUNDS=${ROUNDS:-3}
    exec ctest --test-dir "$dir" --output-on-failure --timeout 1800 -j 2 -LE 'install|slurm|cluster|e2e|bench_smoke' "$@" ;;
  fuzz)
    # Every target runs its regression inputs (inputs that once failed), then
    # fuzzes for SECONDS from its seed corpus; new inputs it finds go to
    # build-fuzz/corpus/<target>, a failing input to build-fuzz/findings/.
    install_packages "${FUZZ_PACKAGES[@]}"
    seconds=${1:-60}
    [[ $# -gt 0 ]] && shift
    [[ "$seconds" =~ ^[0-9]+$ ]] || { log "fuzz: SECONDS must be a whole number, not '$seconds'"; exit 2; }
    dir=build-fuzz
    if [[ ! -f "$dir/build.ninja" ]]; then
      cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
            -DLOCKSTEP_BUILD_FUZZERS=ON -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_BENCHMARKS=OFF
    fi
    cmake --build "$dir" --target lockstep_fuzzers
    targets=("$@")
    [[ ${#targets[@]} -eq 0 ]] && targets=(config checkpoint_manifest checkpoint_latest checkpoint_shard idx coordination)
    supp=$PWD/cmake/sanitizers
    export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1"
    # LeakSanitizer takes one file: the ASan lane's suppressions and the fuzzers' own.
    cat "$supp/lsan.supp" "$supp/lsan_fuzz.supp" > "$dir/lsan.supp"
    export LSAN_OPTIONS="suppressions=$PWD/$dir/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
    failed=()
    for target in "${targets[@]}"; do
      binary=$dir/fuzz/${target}_fuzzer
      [[ -x "$binary" ]] || { log "fuzz: no target '$target'"; exit 2; }
      mkdir -p "$dir/corpus/$target" "$dir/findings"
      regressions=(fuzz/regressions/"$target"/*)
      if [[ -e "${regressions[0]}" ]]; then
        log "fuzz $target: ${#regressions[@]} regression inputs"
        "$binary" "${regressions[@]}" >"$dir/findings/$target.regressions.log" 2>&1 || {
          tail -30 "$dir/findings/$target.regressions.log"; failed+=("$target (a regression input)"); continue; }
      fi
      log "fuzz $target: ${seconds} s"
      if ! "$binary" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=6144 -print_final_stats=1 \
           -artifact_prefix="$dir/findings/$target-" "$dir/corpus/$target" "fuzz/corpus/$target" \
           >"$dir/findings/$target.log" 2>&1; then
        tail -40 "$dir/findings/$target.log"
        failed+=("$target")
      fi
      grep -E '^stat::number_of_executed_units|^Done [0-9]+ runs' "$dir/findings/$target.log" | tail -1 | sed "s/^/[dev.sh] $target: /" >&2 || true
    done
    if [[ ${#failed[@]} -gt 0 ]]; then
      log "fuzz: findings in ${failed[*]} (inputs in $dir/findings/)"
      exit 1
    fi
    log "fuzz: no findings" ;;
  faults)
    build
    mpirun_cmd=(mpirun --oversubscribe)
    [[ $(id -u) -eq 0 ]] && mpirun_cmd+=(--allow-run-as-root)
    exec tests/faults/fault_suite.sh "$PWD" "$BUILD_DIR/lockstep_train" "$BUILD_DIR/lockstep_ckpt" "${mpirun_cmd[@]}" ;;
  ft-trials)
    build
    KILL_TRIALS=${1:-10} STOP_TRIALS=${2:-5} exec tests/system/fault_tolerance_test.sh "$PWD" \
      "$BUILD_DIR/lockstep_train" "$BUILD_DIR/lockstep_ckpt" ;;
  multihost-slurm)
    build
    exec tests/cluster/multihost_slurm_test.sh "$PWD" "$BUILD_DIR/lockstep_train" "${1:-4}" ;;
  bench)
    build
    exec "$BUILD_DIR/benchmarks/trainer_step_benchmark" "$@" ;;
  scaleout)
    build
    BUILD_DIR=$BUILD_DIR exec benchmarks/scaleout.sh --no-build "$@" ;;
  *)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    [[ -z "$command" ]] && exit 2
    log "unknown command '$command'"; exit 2 ;;
esac
