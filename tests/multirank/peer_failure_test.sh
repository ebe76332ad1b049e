#!/usr/bin/env bash
# kill -9 of a random rank at a random step, ROUNDS times (default 10): every
# survivor exits non-zero within heartbeat timeout + 5 s with a message naming the
# dead rank (and its host), and no process is left behind.
#
# mpirun runs with orte_enable_recovery so that Open MPI does not kill the
# survivors itself when a rank dies: what is measured is Lockstep's own detection,
# as under launchers that do not (srun without --kill-on-bad-exit, a hung rank).
# Each rank runs inside a small shell that records its pid, exit code and time.
# Usage: peer_failure_test.sh LOCKSTEP_TRAIN MPIRUN...
set -euo pipefail
train=$1
shift
mpirun=("$@")
rounds=${ROUNDS:-10}
ranks=3
timeout_s=3  # coordination.heartbeat_timeout_seconds
bound=$((timeout_s + 5))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
host=$(hostname)

set_flags="data.source=SYNTHETIC,model.name=mlp,num_train_steps=1000000,eval_every_steps=0,summary_every_steps=25"
set_flags+=",data.global_batch_size=48,progress=lines,collective_timeout_seconds=600"
set_flags+=",coordination.heartbeat_timeout_seconds=$timeout_s"

fail() { echo "FAIL (round $round): $*"; for f in "$dir"/out.*; do echo "--- $f"; tail -5 "$f"; done; exit 1; }

for round in $(seq 1 "$rounds"); do
  dir="$work/$round"
  mkdir -p "$dir"
  # shellcheck disable=SC2016
  wrapper='r=$OMPI_COMM_WORLD_RANK; "$0" "$@" > "$D/out.$r" 2>&1 & p=$!; echo $p > "$D/pid.$r"; wait $p; c=$?;
           echo "$c $(date +%s.%N)" > "$D/rc.$r"'
  D="$dir" "${mpirun[@]}" --mca orte_enable_recovery 1 -x D -np $ranks \
    bash -c "$wrapper" "$train" --set="$set_flags,output_dir=$dir/run" > "$dir/mpirun.log" 2>&1 &
  launcher=$!
  # Wait until training runs (rank 0 has printed a few summaries).
  for _ in $(seq 1 600); do
    [[ -f $dir/out.0 ]] && [[ $(grep -c '^Step .*train loss' "$dir/out.0" || true) -ge 2 ]] && break
    sleep 0.1
  done
  [[ $(grep -c '^Step .*train loss' "$dir/out.0" 2>/dev/null || true) -ge 2 ]] || fail "training did not start"
  sleep "$((RANDOM % 3)).$((RANDOM % 10))"  # a random step
  victim=$((RANDOM % ranks))
  victim_pid=$(cat "$dir/pid.$victim")
  pids=()
  for r in $(seq 0 $((ranks - 1))); do pids+=("$(cat "$dir/pid.$r")"); done
  step=$(grep '^Step .*train loss' "$dir/out.0" | tail -1 | awk '{ print $2 }' | tr -d :)
  killed_at=$(date +%s.%N)
  kill -9 "$victim_pid"
  # mpirun ends once every rank has.
  for _ in $(seq 1 $((bound * 10 + 100))); do kill -0 $launcher 2>/dev/null || break; sleep 0.1; done
  if kill -0 $launcher 2>/dev/null; then kill -9 $launcher; fail "mpirun still running $((bound + 10)) s after the kill"; fi
  wait $launcher || true
  for r in $(seq 0 $((ranks - 1))); do
    if kill -0 "${pids[$r]}" 2>/dev/null; then kill -9 "${pids[$r]}"; fail "rank $r (pid ${pids[$r]}) was left behind"; fi
    [[ $r -eq $victim ]] && continue
    [[ -f $dir/rc.$r ]] || fail "rank $r recorded no exit"
    read -r code at < "$dir/rc.$r"
    [[ $code -ne 0 ]] || fail "survivor rank $r exited 0"
    took=$(awk -v a="$at" -v b="$killed_at" 'BEGIN { printf "%.1f", a - b }')
    awk -v t="$took" -v b="$bound" 'BEGIN { exit !(t <= b) }' || fail "rank $r exited $took s after the kill (bound $bound s)"
    if [[ $victim -eq 0 ]]; then
      grep -q "lost the coordination service at .* (hosted by rank 0)" "$dir/out.$r" || fail "rank $r did not name the lost rank 0"
    else
      grep -q "rank $victim (host $host, pid $victim_pid) is dead: no heartbeat" "$dir/out.$r" ||
        fail "rank $r did not name rank $victim (host $host, pid $victim_pid)"
    fi
    echo "round $round: killed rank $victim after step $step; rank $r exited $code after $took s"
  done
done
echo "OK: $rounds rounds; every survivor stopped within $bound s naming the dead rank"
