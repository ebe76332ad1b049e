#!/usr/bin/env bash
# examples/sharded_embedding on data x model meshes: the same job as 1 process,
# 1x2 (the table's columns over both ranks), 2x1 (the table whole, plain data
# parallelism) and 2x2 (columns over the model axis, the shard's gradient summed
# over the data axis; 4 oversubscribed ranks). Each run checks itself against the
# unsharded model on the whole global batch (--check), and every run's loss
# summaries must equal the 1-process run's within TOLERANCE. Then the refusals:
# rules that split the rows, rules that leave the table whole on a model axis, a
# model axis that does not divide the world or the table's columns (exit 2, a
# message naming the problem), and a 2x2 checkpoint resumed on a 1x2 mesh (refused,
# naming both partitionings).
#
# Usage: sharded_embedding_mesh_test.sh SHARDED_EMBEDDING MPIRUN...
# Prints "OK: ..." with the largest loss difference.
set -euo pipefail
program=$1
shift
mpirun=("$@")
TOLERANCE=${TOLERANCE:-1e-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

steps=100
flags=(--steps=$steps --summary_every_steps=20 --eval_every_steps=50 --check --check_tolerance="$TOLERANCE")
run() {  # NAME NP [FLAGS...]: a run that must succeed and pass its check
  local name=$1 np=$2
  shift 2
  local cmd=("$program")
  [[ $np -gt 1 ]] && cmd=("${mpirun[@]}" -np "$np" "$program")
  "${cmd[@]}" "${flags[@]}" "$@" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; fail "$name: exit $?"; }
  grep -q "^Check against the unsharded model over $steps steps: .*: PASS$" "$work/$name.log" ||
    { cat "$work/$name.log"; fail "$name: the check against the unsharded model failed"; }
}
run single 1
run 1x2 2
run 2x1 2 --mesh_model=1
run 2x2 4 --mesh_model=2
grep -q "mesh 2x2 (data x model); embedding table 1000 x 32 in 2 column shard(s) of 1000 x 16" "$work/2x2.log" ||
  { head -5 "$work/2x2.log"; fail "2x2: the start-up line does not describe the mesh and the split"; }
grep -q "embedding table 1000 x 32 in 1 column shard(s) of 1000 x 32" "$work/2x1.log" ||
  { head -5 "$work/2x1.log"; fail "2x1: the table should be whole"; }
grep -q "^embedding_shard .*over model" "$work/2x2.log" || { head -8 "$work/2x2.log"; fail "2x2: no layout table"; }

extract() { grep -E '^Step +[0-9]+: (train|test) loss \|' "$1" | sed -E 's/^Step +([0-9]+): ([a-z]+) loss \| /\1 \2 /'; }
extract "$work/single.log" > "$work/single.loss"
worst=0
for mesh in 1x2 2x1 2x2; do
  extract "$work/$mesh.log" > "$work/$mesh.loss"
  [[ $(wc -l < "$work/$mesh.loss") -eq $(wc -l < "$work/single.loss") ]] ||
    fail "$mesh printed $(wc -l < "$work/$mesh.loss") loss summaries, 1 process $(wc -l < "$work/single.loss")"
  d=$(paste -d ' ' "$work/single.loss" "$work/$mesh.loss" | awk -v tol="$TOLERANCE" '
    $1 != $4 || $2 != $5 { print "mismatched summaries: " $0 > "/dev/stderr"; exit 1 }
    { d = $3 - $6; if (d < 0) d = -d; if (d > max) max = d }
    END { if (NR == 0 || max > tol) { print "max |loss diff| " max " > " tol > "/dev/stderr"; exit 1 } printf "%.2g", max }') ||
    fail "$mesh: the losses differ from 1 process"
  worst=$(awk -v a="$worst" -v b="$d" 'BEGIN { print (b > a ? b : a) }')
done

refuse() {  # NAME NP PATTERN FLAGS...: exit 2 with a message matching PATTERN
  local name=$1 np=$2 pattern=$3
  shift 3
  set +e
  "${mpirun[@]}" -np "$np" "$program" --steps=2 "$@" > "$work/$name.log" 2>&1
  local code=$?
  set -e
  [[ $code -eq 2 ]] || { cat "$work/$name.log"; fail "$name: exit $code, expected 2"; }
  grep -q -E -e "$pattern" "$work/$name.log" || { cat "$work/$name.log"; fail "$name: no message matching '$pattern'"; }
}
refuse rows 2 "split the rows \('vocab'\) of embedding_shard" --rules=vocab:model
refuse whole 2 "leave embedding_shard whole on a model axis of 2" --rules=embed:
refuse axis 2 "--mesh_model=3 must divide the number of ranks \(2\)" --mesh_model=3
refuse columns 2 "embedding_shard" --embedding_dim=31
refuse mesh_axis 2 "data" --rules=embed:data

# A 2x2 checkpoint holds 2 column shards, each twice: a 1x2 mesh must refuse it.
"${mpirun[@]}" -np 4 "$program" --steps=10 --mesh_model=2 --checkpoint_dir="$work/ckpt" > "$work/save.log" 2>&1 ||
  { cat "$work/save.log"; fail "the 2x2 run with checkpoints"; }
set +e
"${mpirun[@]}" -np 2 "$program" --steps=20 --checkpoint_dir="$work/ckpt" > "$work/load.log" 2>&1
code=$?
set -e
[[ $code -ne 0 ]] || { cat "$work/load.log"; fail "a 1x2 run resumed a 2x2 checkpoint"; }
grep -q "sharded_embedding_columns_2x2" "$work/load.log" ||
  { cat "$work/load.log"; fail "the refusal does not name the checkpoint's partitioning"; }

echo "OK: 1x2, 2x1 and 2x2 meshes pass --check and match 1 process over $(wc -l < "$work/single.loss") loss" \
     "summaries (max |loss diff| $worst, tolerance $TOLERANCE); rows split, whole table on a model axis, bad axis" \
     "sizes and a data-axis rule refused (exit 2); a 2x2 checkpoint refused on 1x2 (exit $code)"
