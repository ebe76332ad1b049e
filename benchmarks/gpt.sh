#!/usr/bin/env bash
# The language-model benchmark: the KJV job's GPT under Lockstep and under PyTorch
# (plain loop at 1 rank, DDP at 2), tokens/s, MFU and peak memory per rank, in the
# same run (benchmarks/gpt_benchmark.py --help).
#
#   benchmarks/gpt.sh                 # 3 rounds of 20 steps, about 3 minutes on 2 cores
#   benchmarks/gpt.sh --quick         # 2 steps, 1 round: checks that it runs
#
# Builds build/benchmarks/scaleout_benchmark first when a build directory exists
# (BUILD_DIR, default build; --no-build skips).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
build=1
args=()
for a in "$@"; do
  if [[ $a == --no-build ]]; then build=0; else args+=("$a"); fi
done
if [[ $build == 1 && -f $BUILD_DIR/build.ninja || $build == 1 && -f $BUILD_DIR/Makefile ]]; then
  cmake --build "$BUILD_DIR" --target scaleout_benchmark >&2
fi
exec /usr/bin/python3 benchmarks/gpt_benchmark.py --build-dir "$BUILD_DIR" "${args[@]+"${args[@]}"}"
