#!/usr/bin/env bash
# lockstep_train under mpirun: 2 ranks print the same summaries as 1 process with
# the same global batch (to 6 decimals), and ranks with different configs all
# fail at start-up with a message naming the rank.
# Usage: train_binary_test.sh LOCKSTEP_TRAIN MPIRUN...
set -euo pipefail
train=$1
shift
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

set_flags="data.source=SYNTHETIC,model.name=mlp,num_train_steps=40,eval_every_steps=20,summary_every_steps=10"
set_flags+=",data.global_batch_size=32,data.synthetic_train_examples=200,data.synthetic_eval_examples=90"
set_flags+=",num_microbatches=2,max_grad_norm=1,schedule.decay=COSINE,schedule.warmup_steps=5"

# Summary lines, values rounded to 6 decimals (summation order differs across ranks).
summaries() { grep -E '^Step +[0-9]+: ' "$1" | grep -v -E 'seconds_per_step|examples_per_second|steps_per_second|data_wait_fraction' |
              awk -F'|' '{ printf "%s| %.6f\n", $1, $2 }'; }

"$train" --set="$set_flags,output_dir=$work/one" > "$work/one.log" 2>&1
"${mpirun[@]}" -np 2 "$train" --set="$set_flags,output_dir=$work/two" > "$work/two.log" 2>&1
summaries "$work/one.log" > "$work/one.txt"
summaries "$work/two.log" > "$work/two.txt"
lines=$(wc -l < "$work/one.txt")
if [[ $lines -lt 20 ]]; then
  echo "FAIL: expected at least 20 summary lines from the single process, got $lines"; cat "$work/one.log"; exit 1
fi
if ! diff "$work/one.txt" "$work/two.txt"; then
  echo "FAIL: 2 ranks and 1 process disagree (above)"; cat "$work/two.log"; exit 1
fi
grep -q "2 rank(s) via mpirun, mpi backend" "$work/two.log" || { echo "FAIL: no 2-rank banner"; cat "$work/two.log"; exit 1; }
echo "OK: $lines summary lines identical on 1 process and 2 ranks"

# Rank 1 with another learning rate: every rank fails, naming rank 1.
set +e
"${mpirun[@]}" -np 1 "$train" --set="$set_flags,output_dir=$work/bad" : \
               -np 1 "$train" --set="$set_flags,output_dir=$work/bad,optimizer.learning_rate=0.5" > "$work/bad.log" 2>&1
status=$?
set -e
if [[ $status -eq 0 ]]; then echo "FAIL: mismatched configs exited 0"; cat "$work/bad.log"; exit 1; fi
for rank in 0 1; do
  # Each rank finds the difference itself, or hears it first from the other rank.
  if ! grep -q -E "rank $rank: (error: |stopped: rank [01] \(host .*\) failed: )data-parallel start-up check failed on rank [01]: rank 1 has a different config" "$work/bad.log"; then
    echo "FAIL: rank $rank did not report the mismatch"; cat "$work/bad.log"; exit 1
  fi
done
echo "OK: a config mismatch fails on both ranks (mpirun exit $status)"
