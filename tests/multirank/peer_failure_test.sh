#!/usr/bin/env bash
# kill -9 of a random rank at a random step, ROUNDS times (default 10): every
# survivor exits non-zero within heartbeat timeout + 5 s with a message naming the
# dead rank (and its host), and no process is left behind.
#
# Then, as root where unshare(1) works, SPLIT_ROUNDS more (default 3) in which
# the victim hangs (SIGSTOP) instead, and the gradients are all-reduced on a
# group split from the world: each rank runs in a UTS namespace of its own with a
# made-up host name, ranks 0 and 2 on one "host" and rank 1 on another, so the
# flat all-reduce runs with the ranks in host order on a communicator of MPI's
# own (communication.hierarchical=true asks for the MPI_THREAD_MULTIPLE that
# needs; with 3 ranks on 2 hosts the hierarchy itself stays off). There the
# survivors must stop because the job aborted the world and, with it, the split
# group: none may end through the peer_failure_grace exit ("still running ...
# after a peer failed"), neither while blocked nor while shutting down. The
# victims go in turn, rank 0 first: a hung rank 0 also hangs the coordination
# service, which a survivor must then not wait on as it leaves.
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
# A hung rank is found by its missed heartbeats alone, and a hung rank 0's
# service still holds the connections, so the others hear of it only from
# heartbeats unanswered past the timeout; they then leave without saying goodbye
# to it. The survivors exited 3.8-4.0 s after SIGSTOP of rank 0 in three rounds
# here, 2.9-4.2 s after that of rank 1 or 2 (under ASan 5.2 s and 3.7-5.0 s;
# before they stopped saying goodbye to a hung service, 5.8-6.0 s for rank 0).
# What catches a rank held up is the grace-exit check, not this bound.
hung_bound=$((timeout_s + 7))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
host=$(hostname)

set_flags="data.source=SYNTHETIC,model.name=mlp,num_train_steps=1000000,eval_every_steps=0,summary_every_steps=25"
set_flags+=",data.global_batch_size=48,progress=lines,collective_timeout_seconds=600"
set_flags+=",coordination.heartbeat_timeout_seconds=$timeout_s"

fail() { echo "FAIL (round $round): $*"; for f in "$dir"/out.*; do echo "--- $f"; tail -5 "$f"; done; exit 1; }

# run_round ROUND MODE: MODE plain, or split (made-up host names, see above).
run_round() {
  round=$1
  local mode=$2 flags=$set_flags limit=$bound
  dir="$work/$round"
  mkdir -p "$dir"
  # Each rank runs in a shell that records its pid, exit code and exit time. In
  # split rounds, unshare and the inner shell exec: the pid is still the rank's.
  # shellcheck disable=SC2016
  local command='"$0" "$@"'
  if [[ $mode == split ]]; then
    # shellcheck disable=SC2016
    command='unshare --uts bash -c '"'"'hostname "lockstep-peer-host-$(($1 % 2))" && shift && exec "$@"'"'"' '
    command+='rank "$r" "$0" "$@"'
    flags+=",communication.hierarchical=true"
    limit=$hung_bound
  fi
  # shellcheck disable=SC2016
  local wrapper='r=$OMPI_COMM_WORLD_RANK; '"$command"' > "$D/out.$r" 2>&1 & p=$!; echo $p > "$D/pid.$r"; wait $p;
                 c=$?; echo "$c $(date +%s.%N)" > "$D/rc.$r"'
  D="$dir" "${mpirun[@]}" --mca orte_enable_recovery 1 -x D -np $ranks bash -c "$wrapper" "$train" \
    --set="$flags,output_dir=$dir/run" > "$dir/mpirun.log" 2>&1 &
  local launcher=$!
  # Wait until training runs (rank 0 has printed a few summaries).
  for _ in $(seq 1 600); do
    [[ -f $dir/out.0 ]] && [[ $(grep -c '^Step .*train loss' "$dir/out.0" || true) -ge 2 ]] && break
    sleep 0.1
  done
  [[ $(grep -c '^Step .*train loss' "$dir/out.0" 2>/dev/null || true) -ge 2 ]] || fail "training did not start"
  if [[ $mode == split ]]; then
    grep -q "flat all-reduce, ranks in host order (the launcher interleaved the hosts: rank -> host 0 1 0)" \
      "$dir/out.0" || fail "the gradients are not all-reduced on the host-ordered group"
  fi
  sleep "$((RANDOM % 3)).$((RANDOM % 10))"  # a random step
  local victim=$((RANDOM % ranks)) victim_host=$host
  if [[ $mode == split ]]; then
    victim=$(((round - rounds - 1) % ranks))  # each rank in turn, rank 0 (the service's host) first
    victim_host=lockstep-peer-host-$((victim % 2))
  fi
  local victim_pid pids=() r
  victim_pid=$(cat "$dir/pid.$victim")
  for r in $(seq 0 $((ranks - 1))); do pids+=("$(cat "$dir/pid.$r")"); done
  local step killed_at
  step=$(grep '^Step .*train loss' "$dir/out.0" | tail -1 | awk '{ print $2 }' | tr -d :)
  killed_at=$(date +%s.%N)
  if [[ $mode == split ]]; then
    # A hung rank, which MPI cannot see (a killed one's sockets close, and MPI's
    # own error would end the wait): only the heartbeats tell, and only the abort
    # ends a wait in the group. Once the survivors are gone, the victim goes too.
    kill -STOP "$victim_pid"
    for _ in $(seq 1 $((limit * 10 + 100))); do
      local left=0
      for r in $(seq 0 $((ranks - 1))); do [[ $r -eq $victim || -f $dir/rc.$r ]] || left=1; done
      [[ $left -eq 0 ]] && break
      sleep 0.1
    done
    kill -9 "$victim_pid"
    kill -CONT "$victim_pid" 2>/dev/null || true
  else
    kill -9 "$victim_pid"
  fi
  # mpirun ends once every rank has.
  for _ in $(seq 1 $((bound * 10 + 100))); do kill -0 $launcher 2>/dev/null || break; sleep 0.1; done
  if kill -0 $launcher 2>/dev/null; then kill -9 $launcher; fail "mpirun still running $((bound + 10)) s after the kill"; fi
  wait $launcher || true
  for r in $(seq 0 $((ranks - 1))); do
    if kill -0 "${pids[$r]}" 2>/dev/null; then kill -9 "${pids[$r]}"; fail "rank $r (pid ${pids[$r]}) was left behind"; fi
    [[ $r -eq $victim ]] && continue
    [[ -f $dir/rc.$r ]] || fail "rank $r recorded no exit"
    local code at took
    read -r code at < "$dir/rc.$r"
    [[ $code -ne 0 ]] || fail "survivor rank $r exited 0"
    took=$(awk -v a="$at" -v b="$killed_at" 'BEGIN { printf "%.1f", a - b }')
    awk -v t="$took" -v b="$limit" 'BEGIN { exit !(t <= b) }' || fail "rank $r exited $took s after the signal (bound $limit s)"
    if [[ $victim -eq 0 ]]; then
      grep -q "lost the coordination service at .* (hosted by rank 0)" "$dir/out.$r" || fail "rank $r did not name the lost rank 0"
    else
      grep -q "rank $victim (host $victim_host, pid $victim_pid) is dead: no heartbeat" "$dir/out.$r" ||
        fail "rank $r did not name rank $victim (host $victim_host, pid $victim_pid)"
    fi
    if [[ $mode == split ]] && grep -q "after a peer failed; exiting" "$dir/out.$r"; then
      # "stopped:" comes from the training thread once its collective has failed.
      grep -q "rank $r: stopped:" "$dir/out.$r" &&
        fail "rank $r stopped training but was still shutting down when the grace period ended"
      fail "rank $r was still blocked when the grace period ended: the abort did not reach the split group"
    fi
    echo "round $round ($mode): $([[ $mode == split ]] && echo stopped || echo killed) rank $victim after step $step;" \
      "rank $r exited $code after $took s"
  done
}

for round in $(seq 1 "$rounds"); do run_round "$round" plain; done
split_rounds=${SPLIT_ROUNDS:-3}
if [[ $(id -u) -ne 0 ]] || ! unshare --uts true 2>/dev/null; then
  echo "split rounds skipped: made-up host names need root and unshare --uts"
  split_rounds=0
fi
for round in $(seq $((rounds + 1)) $((rounds + split_rounds))); do run_round "$round" split; done
echo "OK: $rounds rounds (every survivor stopped within $bound s) and $split_rounds on a split group (within" \
  "$hung_bound s, none through the grace exit), each naming the dead rank"
