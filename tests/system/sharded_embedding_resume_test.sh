#!/usr/bin/env bash
# examples/sharded_embedding on the job layer, 2 ranks under mpirun: a straight run
# against one sent SIGTERM at a random step and then started again. The SIGTERM run
# must stop on every rank at the same agreed step with an emergency checkpoint and
# exit 75; the second start must resume from it; and both runs must end with
# bitwise-equal shards (each rank's embedding columns, the dense layers, Adam's
# state, the RNG, the data position, and the --check reference kept as the
# trainer's custom state), the same summary lines and a passing --check.
#
# Usage: sharded_embedding_resume_test.sh SOURCE_DIR SHARDED_EMBEDDING MPIRUN...
# Prints "OK: ..." with the step of the preemption.
set -euo pipefail
source_dir=$1
program=$2
shift 2
mpirun=("$@")
python=/usr/bin/python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

steps=400
# --check drifts by float rounding over many steps; the test compares its figures between runs exactly.
flags=(--steps=$steps --summary_every_steps=20 --eval_every_steps=100 --checkpoint_every_steps=60 --check
       --check_tolerance=1e-2)
lines() { cat "$@" | grep -E '^Step +[0-9]+: ' | grep -v -E 'seconds_per_step|examples_per_second|steps_per_second|data_wait_fraction'; }

"${mpirun[@]}" -np 2 "$program" "${flags[@]}" --checkpoint_dir="$work/straight" > "$work/straight.log" 2>&1 ||
  { cat "$work/straight.log"; fail "straight run"; }
grep -q "^Check against the unsharded model over $steps steps: .*: PASS$" "$work/straight.log" ||
  { cat "$work/straight.log"; fail "straight run: the check failed"; }

"${mpirun[@]}" -np 2 "$program" "${flags[@]}" --checkpoint_dir="$work/resumed" > "$work/resumed.1.log" 2>&1 &
launcher=$!
# A random step: after the summary of a random step T (a multiple of 20 up to
# steps - 100), within the next few steps.
target=$((20 * (1 + RANDOM % ((steps - 100) / 20))))
for _ in $(seq 1 1200); do grep -q "^Step \+$target: train loss" "$work/resumed.1.log" 2>/dev/null && break; sleep 0.01; done
sleep "0.0$((RANDOM % 5))"
pids=($(pgrep -P $launcher -f sharded_embedding || true))
[[ ${#pids[@]} -eq 2 ]] || { kill -9 "${pids[@]}" 2>/dev/null; fail "expected 2 ranks under mpirun, found ${#pids[*]}"; }
victim=$((RANDOM % 2))  # the children's rank order is not known: either one is "a random rank"
kill -s TERM "${pids[$victim]}"
set +e
wait $launcher
code=$?
set -e
[[ $code -eq 75 ]] || { cat "$work/resumed.1.log"; fail "SIGTERM: exit $code, expected 75 (did it finish first?)"; }
step=$(sed -n 's/^Preempted ([^)]*): emergency checkpoint .*step_0*\([0-9]*\);.*/\1/p' "$work/resumed.1.log")
[[ -n $step ]] || { cat "$work/resumed.1.log"; fail "no emergency checkpoint line"; }

"${mpirun[@]}" -np 2 "$program" "${flags[@]}" --checkpoint_dir="$work/resumed" > "$work/resumed.2.log" 2>&1 ||
  { cat "$work/resumed.2.log"; fail "the resumed run"; }
grep -q "^Resumed from $work/resumed/step_$(printf %08d "$step"): step $step, written by 2 rank(s)" \
  "$work/resumed.2.log" || { cat "$work/resumed.2.log"; fail "did not resume from step $step"; }
grep -q "^Check against the unsharded model over $steps steps: .*: PASS$" "$work/resumed.2.log" ||
  { cat "$work/resumed.2.log"; fail "resumed run: the check failed"; }

lines "$work/straight.log" > "$work/straight.lines"
lines "$work/resumed.1.log" "$work/resumed.2.log" > "$work/resumed.lines"
diff "$work/straight.lines" "$work/resumed.lines" || fail "summary lines differ after SIGTERM at step $step + resume"
final=step_$(printf %08d $steps)
"$python" "$source_dir/tests/system/compare_checkpoints.py" "$work/straight/$final" "$work/resumed/$final" ||
  fail "the final shards differ after SIGTERM at step $step + resume"
check_line() { grep '^Check against' "$1"; }
[[ "$(check_line "$work/straight.log")" == "$(check_line "$work/resumed.2.log")" ]] ||
  fail "the check's differences are not the same: $(check_line "$work/straight.log") vs $(check_line "$work/resumed.2.log")"
echo "OK: SIGTERM to one of 2 ranks -> both stopped at step $step with an emergency checkpoint (exit 75);" \
     "resumed, $(wc -l < "$work/straight.lines") summary lines equal and both final shards bit-identical to the straight run"
