#!/usr/bin/env bash
# Bit-identical resume and preemption on 2 ranks under mpirun:
#  1. 2N steps straight vs N steps, stop, resume for N more: the same metric lines
#     and bitwise-equal parameters and optimizer state on both ranks;
#     (and the same on 1 process, without mpirun);
#  2. SIGTERM (twice) or SIGUSR1 to a random rank at a random step: every rank saves an
#     emergency checkpoint at the same step and exits 75; the next start resumes
#     and ends bitwise-equal to the straight run, with the same metric lines.
# Usage: checkpoint_resume_test.sh SOURCE_DIR LOCKSTEP_TRAIN MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
shift 2
mpirun=("$@")
python=/usr/bin/python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

flags="data.source=SYNTHETIC,model.name=mlp,model.hidden_units=512,data.global_batch_size=256,model.dropout=0.1"
flags+=",eval_every_steps=50,summary_every_steps=10,progress=lines,checkpoint.every_steps=25"
total=400

run() {  # run OUTPUT_DIR STEPS LOG
  "${mpirun[@]}" -np 2 "$train" --set="$flags,num_train_steps=$2,output_dir=$1" > "$3" 2>&1
}
lines() { cat "$@" | grep -E '^Step +[0-9]+: ' | grep -v -E 'seconds_per_step|examples_per_second|steps_per_second|data_wait_fraction'; }
same_state() {  # same_state DIR_A DIR_B STEP: both ranks' shards equal, model and optimizer and RNG
  "$python" "$source_dir/tests/system/compare_checkpoints.py" "$1/checkpoints/step_$(printf %08d "$3")" \
    "$2/checkpoints/step_$(printf %08d "$3")"
}
fail() { echo "FAIL: $*"; exit 1; }

run "$work/a" $total "$work/a.log" || { cat "$work/a.log"; fail "straight run"; }
lines "$work/a.log" > "$work/a.lines"
[[ $(wc -l < "$work/a.lines") -gt 100 ]] || fail "too few summary lines"

# 1. Stop at N, resume for N more.
run "$work/b" $((total / 2)) "$work/b1.log" || { cat "$work/b1.log"; fail "first half"; }
run "$work/b" $total "$work/b2.log" || { cat "$work/b2.log"; fail "second half"; }
grep -q "Resumed from $work/b/checkpoints/step_$(printf %08d $((total / 2)))" "$work/b2.log" || fail "did not resume"
lines "$work/b1.log" "$work/b2.log" > "$work/b.lines"
diff "$work/a.lines" "$work/b.lines" || fail "metric lines differ after stop + resume"
same_state "$work/a" "$work/b" $total || fail "state differs after stop + resume"
echo "OK: stop at $((total / 2)) + resume: $(wc -l < "$work/a.lines") metric lines and both shards bit-identical"

# The same on one process.
"$train" --set="$flags,num_train_steps=$total,output_dir=$work/one" > "$work/one.log" 2>&1 || fail "1 process"
"$train" --set="$flags,num_train_steps=$((total / 2)),output_dir=$work/one_b" > "$work/one_b1.log" 2>&1
"$train" --set="$flags,num_train_steps=$total,output_dir=$work/one_b" > "$work/one_b2.log" 2>&1
lines "$work/one.log" > "$work/one.lines"
lines "$work/one_b1.log" "$work/one_b2.log" > "$work/one_b.lines"
diff "$work/one.lines" "$work/one_b.lines" || fail "1 process: metric lines differ after stop + resume"
same_state "$work/one" "$work/one_b" $total || fail "1 process: state differs after stop + resume"
echo "OK: 1 process, stop + resume: same metric lines, bit-identical shard"

# 2. Preemption at a random step.
for signal in TERM USR1; do
  dir="$work/c_$signal"
  "${mpirun[@]}" -np 2 "$train" --set="$flags,num_train_steps=$total,output_dir=$dir" > "$dir.1.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 300); do grep -q '^Step .*train loss' "$dir.1.log" 2>/dev/null && break; sleep 0.05; done
  sleep "0.$((RANDOM % 10))$((RANDOM % 10))"
  victim=$((RANDOM % 2))
  pids=($(pgrep -P $launcher -f lockstep_train || true))
  [[ ${#pids[@]} -eq 2 ]] || fail "expected 2 ranks under mpirun, found ${#pids[*]}"
  # Rank order of the children is not known; either one is "a random rank".
  kill -s "$signal" "${pids[$victim]}"
  if [[ $signal == TERM ]]; then sleep 0.05; kill -s TERM "${pids[$victim]}" 2>/dev/null || true; fi  # a second signal
  set +e
  wait $launcher
  code=$?
  set -e
  [[ $code -eq 75 ]] || { cat "$dir.1.log"; fail "SIG$signal: exit $code, expected 75"; }
  step=$(sed -n 's/.*emergency checkpoint .*step_0*\([0-9]*\);.*/\1/p' "$dir.1.log")
  [[ -n $step ]] || { cat "$dir.1.log"; fail "no emergency checkpoint line"; }
  run "$dir" $total "$dir.2.log" || { cat "$dir.2.log"; fail "resume after SIG$signal"; }
  grep -q "Resumed from $dir/checkpoints/step_$(printf %08d "$step")" "$dir.2.log" || fail "did not resume from $step"
  lines "$dir.1.log" "$dir.2.log" > "$dir.lines"
  diff "$work/a.lines" "$dir.lines" || fail "metric lines differ after SIG$signal at step $step"
  same_state "$work/a" "$dir" $total || fail "state differs after SIG$signal at step $step"
  echo "OK: SIG$signal to one rank -> emergency checkpoint at step $step on both ranks, exit 75, resumed bit-identical"
done
