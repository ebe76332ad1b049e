#!/usr/bin/env bash
# Lockstep's scale-out benchmark, side by side with PyTorch DDP: per-step time,
# examples/s, scaling efficiency, communication share and peak memory for three
# models at 1, 2, ... ranks; all-reduce bandwidth; a cost model checked here and
# projected onto a cluster. Tables on stdout; results.json and SVG plots in --out.
#
#   benchmarks/scaleout.sh                      # the whole picture, a few minutes
#   benchmarks/scaleout.sh --quick              # a few steps of everything (CI)
#   benchmarks/scaleout.sh --hosts 16 --gpus-per-host 8 --network-gbps 50 --compute-speedup 200
#   benchmarks/scaleout.sh --help               # every flag
#
# Builds build/benchmarks/scaleout_benchmark first when a build directory exists
# (BUILD_DIR, default build; --no-build skips). Needs /usr/bin/python3 with
# PyTorch (python3-torch) for the DDP side; without it, Lockstep alone.
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
exec /usr/bin/python3 benchmarks/scaleout.py --build-dir "$BUILD_DIR" "${args[@]+"${args[@]}"}"
