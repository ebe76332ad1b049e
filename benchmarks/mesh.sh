#!/usr/bin/env bash
# The GPT of configs/kjv_gpt.textproto on 4 ranks as three meshes, side by side in
# one run: 4x1 (data parallel), 2x2 and 1x4 (data x model; tensor parallelism as
# DefaultTransformerRules split it), and 2x2 again with the optimizer's state
# sliced over the data axis (ZeRO-1, sharded_optimizer_state), at the same global
# batch. Prints a table of step time, tokens/s and the bytes of parameters and
# optimizer state per rank (against the replicated model's), and writes each
# run's JSON to --out.
#
#   benchmarks/mesh.sh [--no-build] [--quick] [--out DIR] [--global-batch N] [--steps N]
#
# Ranks are started with mpirun --oversubscribe: on a machine with fewer than 4
# cores the step times include the ranks' contention for cores, and a model axis
# pays for its all-reduces with waits on ranks that are not running. The bytes
# per rank do not depend on it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${BUILD_DIR:-build}
build=1 steps=20 rounds=2 warmup=3 global_batch=32 out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --no-build) build=0 ;;
    --quick) steps=2 rounds=1 warmup=1 global_batch=8 ;;
    --out) out=$2; shift ;;
    --global-batch) global_batch=$2; shift ;;
    --steps) steps=$2; shift ;;
    *) echo "mesh.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
if [[ $build == 1 && ( -f $BUILD_DIR/build.ninja || -f $BUILD_DIR/Makefile ) ]]; then
  cmake --build "$BUILD_DIR" --target scaleout_benchmark >&2
fi
binary=$BUILD_DIR/benchmarks/scaleout_benchmark
[[ -x $binary ]] || { echo "mesh.sh: $binary is not built" >&2; exit 1; }
if [[ -n $out ]]; then
  work=$out
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
mpirun=(mpirun --oversubscribe)
[[ $(id -u) == 0 ]] && mpirun+=(--allow-run-as-root)
runs=("1 replicated" "2 replicated" "4 replicated" "2 sharded_optimizer_state")
for run in "${runs[@]}"; do
  read -r model strategy <<< "$run"
  name=mesh_${model}_$strategy
  "${mpirun[@]}" -np 4 "$binary" --model=gpt --optimizer=adam --mesh_model="$model" --global_batch="$global_batch" \
    --partitioning="$strategy" --steps="$steps" --rounds="$rounds" --warmup_steps="$warmup" --breakdown_steps=0 \
    > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; echo "mesh.sh: the run with a model axis of $model, $strategy, failed" >&2; exit 1; }
  tail -1 "$work/$name.log" > "$work/$name.json"
done
/usr/bin/python3 - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
names = ["1_replicated", "2_replicated", "4_replicated", "2_sharded_optimizer_state"]
runs = [json.load(open(os.path.join(work, f"mesh_{n}.json"))) for n in names]
base = runs[0]
print(f"GPT ({base['parameters']:.0f} parameters), Adam, global batch {base['global_batch']:.0f} x "
      f"{base['tokens_per_example']:.0f} tokens, 4 ranks")
print("| mesh (data x model) | state | step ms | tokens/s | parameters per rank | optimizer state per rank |")
print("| --- | --- | --- | --- | --- | --- |")
for r in runs:
    step = max(r["step_ms_median_per_rank"])  # the slowest rank's
    tokens = r["global_batch"] * r["tokens_per_example"] / (step / 1e3)
    p = max(r["bytes_parameters_per_rank"]); o = max(r["bytes_optimizer_state_per_rank"])
    bp = max(base["bytes_parameters_per_rank"]); bo = max(base["bytes_optimizer_state_per_rank"])
    print(f"| {r['mesh_data']:.0f}x{r['mesh_model']:.0f} | {r['partitioning']} | {step:.1f} | {tokens:,.0f} | "
          f"{p / 2**20:.2f} MiB ({p / bp:.3f}) | {o / 2**20:.2f} MiB ({o / bo:.3f}) |")
PY
[[ -z $out ]] || echo "JSON: $work/mesh_*.json"
