#!/usr/bin/env bash
# Fault tolerance (fault_tolerance { enabled: true }): lockstep_train on 3 ranks
# started by launch/local.sh (Gloo), the Fashion-MNIST CNN.
#  1. kill -9 of a random non-zero rank at a random step, KILL_TRIALS times: the
#     other two finish every step; their final parameters equal, to 1e-5, those
#     of a run that switched to 2 ranks at the step they went on from (3 ranks
#     to that step's checkpoint, then 2 ranks resuming it); the time from the
#     kill to the next completed step is reported;
#  2. SIGSTOP of a random non-zero rank, STOP_TRIALS times (heartbeat timeout
#     2 s): the same, and the stopped rank, continued, stops with exit 4;
#  3. a replacement: after a kill -9, a process started by hand in the dead rank's
#     place joins, takes rank 0's state and the world is 3 again; the final
#     parameters equal those of a run with that membership history (3 ranks,
#     then 2 resuming a checkpoint, then 3 resuming theirs);
#  4. rank 0, which hosts the coordination service, killed: the others stop
#     with exit 4 and the message they print without fault tolerance;
#  5. fewer ranks than min_ranks left: the job fails (exit 4) and says so;
#  6. fault tolerance with a sharded strategy is a config error (exit 2).
# Usage: fault_tolerance_test.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_CKPT
# Environment: KILL_TRIALS (default 3), STOP_TRIALS (default 1), SEED (random).
set -euo pipefail
source_dir=$1
train=$2
ckpt=$3
python=/usr/bin/python3
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
source "$source_dir/tests/system/checkpoint_helpers.sh"  # step_dir, consolidated
kill_trials=${KILL_TRIALS:-3}
stop_trials=${STOP_TRIALS:-1}
seed=${SEED:-$RANDOM}
RANDOM=$seed
echo "trials: $kill_trials kill -9, $stop_trials SIGSTOP (SEED=$seed)"
total=40
config=--config=$source_dir/configs/fashion_mnist_cnn.textproto
flags="num_train_steps=$total,summary_every_steps=10,eval_every_steps=0,progress=lines,data.global_batch_size=126"
flags+=",checkpoint.every_steps=0,fault_tolerance.enabled=true,fault_tolerance.min_ranks=2"
compgen -G "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte*" > /dev/null ||
  { echo "SKIP: no Fashion-MNIST (apt-get install dataset-fashion-mnist)"; exit 0; }

start() {  # start NAME RANKS EXTRA_SET [ARGS...]: runs local.sh in the background; sets launcher
  local name=$1 ranks=$2 extra=$3
  shift 3
  "$source_dir/launch/local.sh" -n "$ranks" --keep-going -- "$train" "$config" \
    --set="$flags,output_dir=$work/$name$extra" "$@" > "$work/$name.log" 2>&1 &
  launcher=$!
  pids+=("$launcher")
}
finish() {  # finish NAME SECONDS: waits for the launcher; sets code
  local deadline=$(($(date +%s) + $2))
  while kill -0 "$launcher" 2> /dev/null; do
    [[ $(date +%s) -lt $deadline ]] || { cat "$work/$1.log"; fail "$1: still running after $2 s"; }
    sleep 0.1
  done
  set +e
  wait "$launcher"
  code=$?
  set -e
}
rank_pid() {  # rank_pid RANK: the pid of that rank under the launcher
  local p
  for p in $(pgrep -P "$launcher"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "RANK=$1"; then echo "$p"; return; fi
  done
}
wait_step() {  # wait_step NAME STEP: until rank 0 has printed the train summary of STEP
  # (Generous: a step takes seconds under ThreadSanitizer on a loaded machine.)
  local deadline=$(($(date +%s) + 300))
  until grep -q -E "^Step +$2: train loss" "$work/$1.log"; do
    [[ $(date +%s) -lt $deadline ]] || { cat "$work/$1.log"; fail "$1: no train summary of step $2 within 300 s"; }
    sleep 0.02
  done
}

# The reference: 3 ranks with a checkpoint after every step.
start reference 3 ",checkpoint.every_steps=1,checkpoint.keep_last=$total"
finish reference 600
[[ $code -eq 0 ]] || { cat "$work/reference.log"; fail "the 3-rank reference run exited with $code"; }
grep -q "Fault tolerance: on" "$work/reference.log" || fail "the reference run does not say fault tolerance is on"

# trial NAME SIGNAL: one failure of a random non-zero rank after a random step;
# checks the run against the reference switched to 2 ranks where it went on.
times=""
trial() {
  local name=$1 signal=$2 extra=""
  local victim=$((1 + RANDOM % 2)) at=$((4 + RANDOM % 24))
  # A summary every step, so that the failure lands at the step asked for.
  extra=",summary_every_steps=1"
  [[ $signal == STOP ]] && extra+=",coordination.heartbeat_timeout_seconds=2"
  start "$name" 3 "$extra"
  wait_step "$name" "$at"
  local pid
  pid=$(rank_pid "$victim")
  [[ -n $pid ]] || fail "$name: no process for rank $victim"
  local t_fail
  t_fail=$(date +%s.%N)
  kill -s "$signal" "$pid"
  if [[ $signal == STOP ]]; then
    local deadline=$(($(date +%s) + 600))
    until grep -q "^Done: $total steps" "$work/$name.log"; do
      [[ $(date +%s) -lt $deadline ]] || { cat "$work/$name.log"; fail "$name: not done 600 s after SIGSTOP"; }
      sleep 0.1
    done
    kill -CONT "$pid"
  fi
  finish "$name" 600
  local log=$work/$name.log
  [[ $code -eq 0 ]] || { cat "$log"; fail "$name: local.sh exited with $code (rank 0's code)"; }
  grep -q "^Done: $total steps" "$log" || { cat "$log"; fail "$name: the survivors did not finish all $total steps"; }
  local expected=137
  [[ $signal == STOP ]] && expected=4
  grep -q "launch/local.sh: rank $victim (pid $pid) exited with $expected" "$log" ||
    { cat "$log"; fail "$name: rank $victim did not exit with $expected"; }
  local from
  from=$(sed -n "s/^Membership: rank(s) $victim left after step [0-9]*; epoch 1: 2 rank(s) ([0-9, ]*) go on from step \([0-9]*\);.*/\1/p" "$log")
  [[ -n $from ]] || { cat "$log"; fail "$name: no membership line for rank $victim"; }
  local t_done
  t_done=$(sed -n 's/^Recovered: step [0-9]* completed .* (unix time \([0-9.]*\))$/\1/p' "$log")
  [[ -n $t_done ]] || { cat "$log"; fail "$name: no Recovered line"; }
  local seconds
  seconds=$(awk -v a="$t_fail" -v b="$t_done" 'BEGIN { printf "%.2f", b - a }')
  grep -q -E "^Step +$total: train world_size \| 2\.0+$" "$log" || fail "$name: the world size metric is not 2 at the end"
  # The reference switched to 2 ranks at step $from.
  "$source_dir/launch/local.sh" -n 2 -- "$train" "$config" --set="$flags,output_dir=$work/$name.switched" \
    --resume="$(step_dir "$work/reference" "$from")" > "$work/$name.switched.log" 2>&1 ||
    { cat "$work/$name.switched.log"; fail "$name: the reference resumed on 2 ranks from step $from"; }
  local compared
  compared=$("$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 \
    "$(consolidated "$work/$name" "$total")" "$(consolidated "$work/$name.switched" "$total")") ||
    { echo "$compared"; fail "$name: the final parameters differ from the run that switched to 2 ranks at step $from"; }
  echo "OK: $name: SIG$signal to rank $victim after step $at; 2 ranks went on from step $from; next step done" \
    "$seconds s after the signal; final parameters: $compared"
  times+="$seconds "
  rm -rf "$work/$name" "$work/$name.switched"
}

for ((i = 1; i <= kill_trials; ++i)); do trial "kill$i" KILL; done
kill_times=$times
times=""
for ((i = 1; i <= stop_trials; ++i)); do trial "stop$i" STOP; done
stop_times=$times

# 3. A replacement joins. Larger batches (slower steps) leave it time to start;
# its own reference, with the same flags.
flags_join=${flags/data.global_batch_size=126/data.global_batch_size=504},summary_every_steps=1
run_local() {  # run_local NAME RANKS SET [ARGS...]: a reference run in the foreground
  local name=$1 ranks=$2 set=$3
  shift 3
  "$source_dir/launch/local.sh" -n "$ranks" -- "$train" "$config" --set="$set,output_dir=$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { local c=$?; cat "$work/$name.log"; fail "$name: exit $c"; }
}
victim=$((1 + RANDOM % 2))
at=$((3 + RANDOM % 6))
MASTER_PORT=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOCKSTEP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export MASTER_PORT LOCKSTEP_JOB_TOKEN
"$source_dir/launch/local.sh" -n 3 --keep-going -- "$train" "$config" --set="$flags_join,output_dir=$work/join" \
  > "$work/join.log" 2>&1 &
launcher=$!
pids+=("$launcher")
wait_step join "$at"
kill -9 "$(rank_pid "$victim")"
deadline=$(($(date +%s) + 120))
until grep -q "^Membership: rank(s) $victim left" "$work/join.log"; do
  [[ $(date +%s) -lt $deadline ]] || { cat "$work/join.log"; fail "join: rank $victim's death not handled in 120 s"; }
  sleep 0.05
done
t_join=$(date +%s.%N)
RANK=$victim LOCAL_RANK=$victim WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 \
  "$train" "$config" --set="$flags_join,output_dir=$work/join" > "$work/joiner.log" 2>&1 ||
  { c=$?; cat "$work/joiner.log" "$work/join.log"; fail "join: the replacement rank $victim exited with $c"; }
finish join 600
unset MASTER_PORT LOCKSTEP_JOB_TOKEN
[[ $code -eq 0 ]] || { cat "$work/join.log"; fail "join: local.sh exited with $code"; }
grep -q "^Joined the job in epoch 2 as rank $victim of 3" "$work/joiner.log" ||
  { cat "$work/joiner.log"; fail "join: the replacement did not say it joined"; }
left_from=$(sed -n "s/^Membership: rank(s) $victim left after step [0-9]*; .* go on from step \([0-9]*\);.*/\1/p" "$work/join.log")
join_from=$(sed -n "s/^Membership: rank(s) $victim joined after step [0-9]*; epoch 2: 3 rank(s) (0, 1, 2) go on from step \([0-9]*\);.*/\1/p" "$work/join.log")
[[ -n $left_from && -n $join_from ]] || { cat "$work/join.log"; fail "join: no membership lines for the leave and the join"; }
grep -q -E "^Step +$total: train world_size \| 3\.0+$" "$work/join.log" || fail "join: the world size is not 3 at the end"
t_grown=$(sed -n 's/^Recovered: step [0-9]* completed .* (unix time \([0-9.]*\))$/\1/p' "$work/join.log" | tail -n 1)
join_seconds=$(awk -v a="$t_join" -v b="$t_grown" 'BEGIN { printf "%.2f", b - a }')
run_local join_ref3 3 "$flags_join,checkpoint.every_steps=1,checkpoint.keep_last=$total"
run_local join_ref2 2 "$flags_join,checkpoint.every_steps=1,checkpoint.keep_last=$total" \
  --resume="$(step_dir "$work/join_ref3" "$left_from")"
run_local join_ref3again 3 "$flags_join" --resume="$(step_dir "$work/join_ref2" "$join_from")"
compared=$("$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 \
  "$(consolidated "$work/join" "$total")" "$(consolidated "$work/join_ref3again" "$total")") ||
  { echo "$compared"; fail "join: the final parameters differ from 3 -> 2 (step $left_from) -> 3 (step $join_from)"; }
echo "OK: join: rank $victim killed after step $at, 2 ranks from step $left_from, its replacement joined and 3" \
  "ranks went on from step $join_from ($join_seconds s from its start to the next step); final parameters: $compared"
rm -rf "$work"/join*

# 4. Rank 0 killed: the others end as without fault tolerance.
start rank0 3 ",coordination.heartbeat_timeout_seconds=2,summary_every_steps=1"
wait_step rank0 5
kill -9 "$(rank_pid 0)"
finish rank0 60
[[ $code -eq 137 ]] || { cat "$work/rank0.log"; fail "rank0: local.sh exited with $code, not rank 0's 137"; }
for r in 1 2; do
  grep -q -E "launch/local.sh: rank $r \(pid [0-9]+\) exited with 4" "$work/rank0.log" ||
    { cat "$work/rank0.log"; fail "rank0: rank $r did not stop with exit 4"; }
done
grep -q "lost the coordination service" "$work/rank0.log" || { cat "$work/rank0.log"; fail "rank0: no 'lost the coordination service'"; }
echo "OK: rank 0 killed: ranks 1 and 2 stopped with exit 4, naming the lost coordination service"

# 5. Below min_ranks.
flags_min=$flags
flags=${flags/fault_tolerance.min_ranks=2/fault_tolerance.min_ranks=3}
start below 3 ",summary_every_steps=1"
wait_step below 5
kill -9 "$(rank_pid 2)"
finish below 60
flags=$flags_min
[[ $code -eq 4 ]] || { cat "$work/below.log"; fail "below min_ranks: local.sh exited with $code, not 4"; }
grep -q "fewer than min_ranks 3" "$work/below.log" || { cat "$work/below.log"; fail "below min_ranks: no message"; }
echo "OK: 2 ranks left of min_ranks 3: the job failed with exit 4, saying so"

# 6. A config error.
set +e
"$source_dir/launch/local.sh" -n 2 -- "$train" "$config" \
  --set="$flags,partitioning.strategy=sharded_gradients,output_dir=$work/bad" > "$work/bad.log" 2>&1
code=$?
set -e
[[ $code -eq 2 ]] || { cat "$work/bad.log"; fail "fault tolerance with sharded_gradients: exit $code, not 2"; }
grep -q "partitioning.strategy' must be replicated with fault_tolerance" "$work/bad.log" ||
  { cat "$work/bad.log"; fail "fault tolerance with sharded_gradients: no clear message"; }
echo "OK: fault tolerance with a sharded strategy is refused (exit 2)"

echo "OK: fault tolerance: $kill_trials kill -9 trial(s), next step done after (s): ${kill_times% };" \
  "$stop_trials SIGSTOP trial(s) (heartbeat timeout 2 s): ${stop_times% }; the survivors' final parameters" \
  "equal the switched reference within 1e-5; a replacement joined in $join_seconds s and the run equals 3 -> 2 -> 3;" \
  "rank 0's death and too few ranks end the job (exit 4)"
