#!/usr/bin/env bash
# Lockstep's sharding benchmark: per rank, the bytes of parameters, gradients and
# optimizer state, peak memory and step time of each partitioning strategy
# (replicated, ZeRO-1, ZeRO-2, fully sharded when built) against replicated at
# 1, 2 and 4 ranks, and against PyTorch's ZeroRedundancyOptimizer at 2 ranks.
# Table on stdout; results.json in --out (default BUILD_DIR/sharding).
#
#   benchmarks/sharding.sh                      # the wide MLP with Adam, a few minutes
#   benchmarks/sharding.sh --quick              # the small MLP, a few steps, 1 and 2 ranks (CI)
#   benchmarks/sharding.sh --strategies replicated,sharded_gradients --ranks 2,4
#   benchmarks/sharding.sh --help               # every flag
#
# Builds build/benchmarks/scaleout_benchmark first when a build directory exists
# (BUILD_DIR, default build; --no-build skips). Needs /usr/bin/python3; with
# PyTorch (python3-torch) it also runs the ZeroRedundancyOptimizer side.
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
exec /usr/bin/python3 benchmarks/sharding.py --build-dir "$BUILD_DIR" "${args[@]+"${args[@]}"}"
