#!/usr/bin/env bash
# The fault suite (./dev.sh faults): each fault injected into real training jobs on
# this machine, then one table: fault, trials, survived, data lost, and the longest
# time from the fault to the clear error (or to the exit it calls for).
#
#   survived   every rank ended as it must: exit non-zero with a message that names
#              the cause (or 75 and an emergency checkpoint on a preemption
#              signal, or 0 after a resume), within its bound; no crash (a signal,
#              134), no hang, no process left behind, no silent exit 0
#   data lost  a checkpoint that was committed is no longer valid or was deleted,
#              or a resume did not continue from the newest valid one
#
# Environment: FAULT_TRIALS (default 3) trials of each process fault,
# FAULT_MUTATIONS (default 200) config mutations, FAULT_ONLY (a regex of fault
# names to run). Exits 1 when any trial did not survive or lost data.
# Usage: fault_suite.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_CKPT MPIRUN...
set -uo pipefail
source_dir=$1
train=$2
ckpt=$3
shift 3
mpirun=("$@")
trials=${FAULT_TRIALS:-3}
mutations=${FAULT_MUTATIONS:-200}
only=${FAULT_ONLY:-.}
work=$(mktemp -d)
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do umount "$m" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
host=$(hostname)
rows=()
problems=$work/problems.log
: > "$problems"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b + 0 > a + 0) ? b : a }'; }
# problem TRIAL_DIR TEXT: a trial that did not survive, with the tail of its logs.
problem() {
  { echo "== $current, trial $trial: $2"; for f in "$1"/*.log "$1"/out.*; do [[ -f $f ]] && { echo "-- $f"; tail -8 "$f"; }; done; } >> "$problems"
}
# row NAME TRIALS SURVIVED LOST WORST_SECONDS
row() { rows+=("$1|$2|$3|$4|${5:+$5 s}"); }
wanted() { [[ $1 =~ $only ]]; }
# Waits (at most $2 seconds) until pid $1 has exited; 1 if it has not.
wait_gone() { local i; for i in $(seq 1 $(($2 * 10))); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done; ! kill -0 "$1" 2>/dev/null; }
# A committed checkpoint is still valid: lockstep_ckpt verify exits 0, or nothing was committed yet.
checkpoints_intact() {
  local dir=$1/checkpoints
  [[ -e $dir/latest ]] || return 0
  "$ckpt" verify "$dir" > "$2" 2>&1
}

common="data.source=SYNTHETIC,model.name=mlp,eval_every_steps=0,summary_every_steps=5,progress=lines"

# --- kill -9 / SIGSTOP of a random rank of 3, the default 10 s heartbeat timeout ---
# Each rank runs in a shell that records its pid, exit code and exit time; mpirun
# runs with orte_enable_recovery so that Open MPI does not end the survivors
# itself: what is measured is Lockstep's own detection.
peer_fault() {  # peer_fault KILL|STOP
  local signal=$1 survived=0 lost=0 worst="" ranks=3 bound=25
  for trial in $(seq 1 "$trials"); do
    local dir=$work/peer_$signal.$trial ok=1
    mkdir -p "$dir"
    # shellcheck disable=SC2016
    local wrapper='r=$OMPI_COMM_WORLD_RANK; "$0" "$@" > "$D/out.$r" 2>&1 & p=$!; echo $p > "$D/pid.$r"; wait $p; c=$?;
                   echo "$c $(date +%s.%N)" > "$D/rc.$r"'
    D="$dir" "${mpirun[@]}" --mca orte_enable_recovery 1 -x D -np $ranks bash -c "$wrapper" "$train" \
      --set="$common,num_train_steps=1000000,data.global_batch_size=48,checkpoint.every_steps=20,output_dir=$dir/run" \
      > "$dir/mpirun.log" 2>&1 &
    local launcher=$!
    for _ in $(seq 1 900); do
      [[ $(grep -c '^Step .*train loss' "$dir/out.0" 2>/dev/null) -ge 2 ]] && break
      sleep 0.1
    done
    sleep "$((RANDOM % 3)).$((RANDOM % 10))"
    # Rank 0 (which hosts the coordination service) in the first trial, then random ones.
    local victim=$(( trial == 1 ? 0 : RANDOM % ranks ))
    [[ $trial -eq 2 ]] && victim=$(( 1 + RANDOM % (ranks - 1) ))
    local pids=() r
    for r in $(seq 0 $((ranks - 1))); do pids+=("$(cat "$dir/pid.$r" 2>/dev/null)"); done
    if [[ $(grep -c '^Step .*train loss' "$dir/out.0" 2>/dev/null) -lt 2 || -z ${pids[$victim]} ]]; then
      problem "$dir" "training did not start"
      kill -9 $launcher "${pids[@]}" 2>/dev/null
      wait $launcher 2>/dev/null
      continue
    fi
    local at
    at=$(now)
    kill -s "$signal" "${pids[$victim]}"
    for r in $(seq 0 $((ranks - 1))); do
      [[ $r -eq $victim ]] && continue
      if ! wait_gone "${pids[$r]}" $bound; then
        ok=0; problem "$dir" "rank $r still running $bound s after SIG$signal of rank $victim (a hang)"
        kill -9 "${pids[$r]}" 2>/dev/null
        continue
      fi
      local code=1 t="$at"
      [[ -f $dir/rc.$r ]] && read -r code t < "$dir/rc.$r"
      worst=$(max "$worst" "$(elapsed "$at" "$t")")
      if [[ $code -eq 0 || $code -ge 128 ]]; then ok=0; problem "$dir" "rank $r exited $code after rank $victim's SIG$signal"; fi
      if [[ $victim -eq 0 ]]; then
        grep -q "coordination service" "$dir/out.$r" || { ok=0; problem "$dir" "rank $r did not name the lost service (rank 0)"; }
      else
        grep -q "rank $victim (host $host, pid ${pids[$victim]})" "$dir/out.$r" ||
          { ok=0; problem "$dir" "rank $r did not name rank $victim (host $host, pid ${pids[$victim]})"; }
      fi
    done
    if [[ $signal == STOP ]]; then kill -9 "${pids[$victim]}" 2>/dev/null; kill -CONT "${pids[$victim]}" 2>/dev/null; fi
    wait_gone $launcher 20 || { ok=0; problem "$dir" "mpirun still running"; kill -9 $launcher; }
    wait $launcher 2>/dev/null
    for r in $(seq 0 $((ranks - 1))); do
      kill -0 "${pids[$r]}" 2>/dev/null && { ok=0; problem "$dir" "rank $r left behind"; kill -9 "${pids[$r]}"; }
    done
    checkpoints_intact "$dir/run" "$dir/verify.log" || { lost=$((lost + 1)); problem "$dir" "a committed checkpoint is not valid"; }
    survived=$((survived + ok))
  done
  row "$2" "$trials" "$survived" "$lost" "$worst"
}

# signal_running_job DIR FLAGS SIGNAL BOUND: starts a 2-rank job (log: DIR/first.log),
# waits for its first step and a random moment after it, sends SIGNAL to a random
# rank and waits (at most BOUND seconds) for mpirun to end. Sets job_pids,
# job_code (mpirun's exit code) and job_took (seconds from the signal to the
# exit); returns 1 when the job never ran or did not end within BOUND (both
# already recorded as problems).
signal_running_job() {
  local dir=$1 flags=$2 signal=$3 bound=$4
  "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir/run" > "$dir/first.log" 2>&1 &
  local launcher=$!
  for _ in $(seq 1 600); do grep -q '^Step ' "$dir/first.log" 2>/dev/null && break; sleep 0.05; done
  sleep "0.$((RANDOM % 10))$((RANDOM % 10))"
  job_pids=($(pgrep -P $launcher -f lockstep_train))
  if [[ ${#job_pids[@]} -ne 2 ]]; then
    problem "$dir" "the job was not running"; kill -9 $launcher "${job_pids[@]}" 2>/dev/null; wait $launcher; return 1
  fi
  local at late=0
  at=$(now)
  kill -s "$signal" "${job_pids[$((RANDOM % 2))]}"
  wait_gone $launcher "$bound" ||
    { late=1; problem "$dir" "still running $bound s after SIG$signal"; kill -9 "${job_pids[@]}" $launcher; }
  wait $launcher
  job_code=$?
  job_took=$(elapsed "$at" "$(now)")
  return $late
}

# --- SIGTERM / SIGUSR1 to a random rank at a random step, then resume ---
preemption() {
  # Long enough (about 10 s on 2 idle cores) that the signal, at most a second
  # after the first step, finds the job still running.
  local survived=0 lost=0 worst="" total=3000
  local flags="$common,num_train_steps=$total,model.hidden_units=256,checkpoint.every_steps=250"
  for trial in $(seq 1 "$trials"); do
    local dir=$work/preempt.$trial ok=1 signal=TERM
    (( trial % 2 == 0 )) && signal=USR1
    mkdir -p "$dir"
    signal_running_job "$dir" "$flags" "$signal" 60 || ok=0
    [[ ${#job_pids[@]} -eq 2 ]] || continue
    local code=$job_code
    worst=$(max "$worst" "$job_took")
    if [[ $code -ne 75 ]]; then ok=0; problem "$dir" "SIG$signal: exit $code, expected 75"; fi
    local saved
    saved=$(grep -o 'emergency checkpoint [^;]*' "$dir/first.log" | head -1 | awk '{ print $3 }')
    [[ -n $saved ]] || { ok=0; problem "$dir" "no emergency checkpoint named"; }
    checkpoints_intact "$dir/run" "$dir/verify.log" || { lost=$((lost + 1)); problem "$dir" "a committed checkpoint is not valid"; }
    "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir/run" > "$dir/resume.log" 2>&1 ||
      { ok=0; problem "$dir" "the resumed run failed"; }
    if [[ -n $saved ]] && ! grep -q "^Resumed from $saved:" "$dir/resume.log"; then
      lost=$((lost + 1)); problem "$dir" "the resume did not continue from the emergency checkpoint $saved"
    fi
    grep -q "^Done: $total steps" "$dir/resume.log" || { ok=0; problem "$dir" "the resumed run did not finish"; }
    survived=$((survived + ok))
  done
  row "SIGTERM/SIGUSR1 at a random step, resume" "$trials" "$survived" "$lost" "$worst"
}

# --- SIGKILL of a rank while checkpoints are being written ---
kill_during_save() {
  local survived=0 lost=0 worst="" total=300
  local flags="$common,num_train_steps=$total,model.hidden_units=512,data.global_batch_size=256"
  flags+=",checkpoint.every_steps=3,checkpoint.keep_last=2,coordination.heartbeat_timeout_seconds=3"
  for trial in $(seq 1 "$trials"); do
    local dir=$work/kill_save.$trial ok=1
    mkdir -p "$dir"
    signal_running_job "$dir" "$flags" KILL 30 || ok=0
    [[ ${#job_pids[@]} -eq 2 ]] || continue
    local code=$job_code
    worst=$(max "$worst" "$job_took")
    [[ $code -ne 0 ]] || { ok=0; problem "$dir" "exit 0 after a rank was killed"; }
    for p in "${job_pids[@]}"; do wait_gone "$p" 10 || { ok=0; problem "$dir" "pid $p left behind"; kill -9 "$p"; }; done
    checkpoints_intact "$dir/run" "$dir/verify.log" || { lost=$((lost + 1)); problem "$dir" "latest is not valid after the kill"; }
    local newest
    newest=$("$ckpt" latest "$dir/run/checkpoints" 2>/dev/null | xargs -r basename)
    "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir/run" > "$dir/resume.log" 2>&1 ||
      { ok=0; problem "$dir" "the resumed run failed"; }
    if [[ -n $newest ]] && ! grep -q "^Resumed from .*/$newest:" "$dir/resume.log"; then
      lost=$((lost + 1)); problem "$dir" "the resume did not continue from $newest"
    fi
    survived=$((survived + ok))
  done
  row "SIGKILL of a rank during saves (every 3 steps)" "$trials" "$survived" "$lost" "$worst"
}

# --- damaged checkpoints ---
damaged() {
  local base=$work/damaged_base
  local flags="$common,num_train_steps=30,checkpoint.every_steps=10,checkpoint.keep_last=3,checkpoint.async=false"
  "$train" --set="$flags,output_dir=$base" > "$work/damaged_base.log" 2>&1 ||
    { trial=0 current="damaged checkpoints" problem "$work" "the base run failed"; return; }
  local kind
  for kind in "flipped byte" "truncated shard" "missing shard" "missing manifest" "garbage latest"; do
    current="damaged checkpoint: $kind"
    wanted "$current" || continue
    trial=1
    local dir=$work/damaged.${kind// /_} ok=1 lost=0
    mkdir -p "$dir"
    cp -a "$base" "$dir/run"
    local newest=$dir/run/checkpoints/step_00000030 expect_resume=step_00000020
    case $kind in
      "flipped byte") printf '\xff' | dd of="$newest/shard_00000.pt" bs=1 seek=100 conv=notrunc status=none ;;
      "truncated shard") truncate -s 50 "$newest/shard_00000.pt" ;;
      "missing shard") rm "$newest/shard_00000.pt" ;;
      "missing manifest") rm "$newest/manifest.pb" ;;
      "garbage latest") head -c 300 /dev/urandom > "$dir/run/checkpoints/latest"; expect_resume=step_00000030 ;;
    esac
    local at code
    at=$(now)
    "$ckpt" verify "$dir/run/checkpoints" > "$dir/verify.log" 2>&1
    code=$?
    local took
    took=$(elapsed "$at" "$(now)")
    [[ $code -eq 1 ]] || { ok=0; problem "$dir" "lockstep_ckpt verify exited $code, expected 1"; }
    grep -q -E "NOT valid|INVALID" "$dir/verify.log" || { ok=0; problem "$dir" "verify names nothing invalid"; }
    "$train" --set="${flags/num_train_steps=30/num_train_steps=40},output_dir=$dir/run" > "$dir/resume.log" 2>&1 ||
      { ok=0; problem "$dir" "--resume=auto failed"; }
    grep -q "^Resumed from .*/$expect_resume:" "$dir/resume.log" ||
      { lost=1; problem "$dir" "did not resume from the newest valid checkpoint ($expect_resume)"; }
    if [[ $kind != "garbage latest" ]]; then
      grep -q "skipping checkpoint .*step_00000030" "$dir/resume.log" || { ok=0; problem "$dir" "the damaged checkpoint was not named"; }
      ls -d "$dir/run/checkpoints/step_00000030"* > /dev/null 2>&1 || { lost=1; problem "$dir" "the damaged checkpoint was deleted"; }
    fi
    [[ -d $dir/run/checkpoints/step_00000020 ]] || { lost=1; problem "$dir" "step 20 was deleted"; }
    row "$current" 1 "$ok" "$lost" "$took"
  done
}

# --- a full disk, a read-only output directory ---
storage() {
  if [[ $(id -u) -ne 0 ]]; then row "full disk / read-only output (needs root: not run)" 0 0 0 ""; return; fi
  local flags="$common,model.name=cnn,num_train_steps=60,checkpoint.every_steps=20"
  current="full disk (6 MiB tmpfs, 2 ranks)"
  if wanted "$current"; then
    trial=1
    local dir=$work/full ok=1 lost=0
    mkdir -p "$dir/mnt"
    mount -t tmpfs -o size=6m tmpfs "$dir/mnt" && mounts+=("$dir/mnt")
    local at code
    at=$(now)
    "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir/mnt/run" > "$dir/run.log" 2>&1
    code=$?
    local took
    took=$(elapsed "$at" "$(now)")
    [[ $code -ne 0 && $code -lt 128 && $code -ne 134 ]] || { ok=0; problem "$dir" "exit $code"; }
    grep -q "No space left on device" "$dir/run.log" || { ok=0; problem "$dir" "the cause is not named"; }
    grep -q -E "terminate called|signal 6|Aborted" "$dir/run.log" && { ok=0; problem "$dir" "a rank aborted"; }
    checkpoints_intact "$dir/mnt/run" "$dir/verify.log" || { lost=1; problem "$dir" "a committed checkpoint is not valid"; }
    row "$current" 1 "$ok" "$lost" "$took"
  fi
  current="read-only output directory"
  if wanted "$current"; then
    local survived=0 lost=0 worst=""
    # 1: a read-only file system from the start; 2: the checkpoints directory made
    # immutable mid-run (chattr +i: even root cannot write there; a read-only
    # remount is refused while the run has files open for writing).
    for trial in 1 2; do
      local dir=$work/readonly.$trial ok=1
      mkdir -p "$dir/mnt"
      mount -t tmpfs -o size=64m tmpfs "$dir/mnt" && mounts+=("$dir/mnt")
      local at code
      if [[ $trial -eq 1 ]]; then
        mount -o remount,ro "$dir/mnt"
        at=$(now)
        "$train" --set="$flags,output_dir=$dir/mnt/run" > "$dir/run.log" 2>&1
        code=$?
      else
        "$train" --set="${flags/num_train_steps=60/num_train_steps=100000},output_dir=$dir/mnt/run" > "$dir/run.log" 2>&1 &
        local pid=$!
        for _ in $(seq 1 600); do [[ -e $dir/mnt/run/checkpoints/latest ]] && break; sleep 0.05; done
        chattr +i "$dir/mnt/run/checkpoints"
        at=$(now)
        wait_gone $pid 120 || { ok=0; problem "$dir" "still running 120 s after chattr +i"; kill -9 $pid; }
        chattr -i "$dir/mnt/run/checkpoints"
        wait $pid
        code=$?
      fi
      worst=$(max "$worst" "$(elapsed "$at" "$(now)")")
      [[ $code -ne 0 && $code -lt 128 ]] || { ok=0; problem "$dir" "exit $code"; }
      local cause="Read-only file system"
      [[ $trial -eq 2 ]] && cause="Operation not permitted"
      grep -q "$cause" "$dir/run.log" || { ok=0; problem "$dir" "the cause ($cause) is not named"; }
      grep -q -E "terminate called|Aborted" "$dir/run.log" && { ok=0; problem "$dir" "aborted"; }
      checkpoints_intact "$dir/mnt/run" "$dir/verify.log" || { lost=$((lost + 1)); problem "$dir" "a committed checkpoint is not valid"; }
      survived=$((survived + ok))
    done
    row "$current (read-only mount; immutable mid-run)" 2 "$survived" "$lost" "$worst"
  fi
}

# --- random mutations of the main config ---
config_mutations() {
  local dir=$work/mutations
  mkdir -p "$dir"
  /usr/bin/python3 "$source_dir/tests/faults/mutate_config.py" "$source_dir/configs/fashion_mnist_cnn.textproto" \
    "$dir" "$mutations" "${FAULT_SEED:-$RANDOM}" || { row "config mutations (generator failed)" 0 0 0 ""; return; }
  # One process each, two at a time; a few steps on a small slice, at most 120 s.
  local overrides="num_train_steps=3,eval_every_steps=0,summary_every_steps=1,progress=lines,checkpoint.every_steps=0"
  find "$dir" -name 'mutant_*.textproto' | sort | xargs -P 2 -I{} bash -c '
    f={}; start=$(date +%s.%N)
    timeout -s KILL 120 "$0" --config="$f" --set="$1,output_dir=${f%.textproto}.out" > "${f%.textproto}.log" 2>&1
    echo "$? $(awk -v a="$start" -v b="$(date +%s.%N)" "BEGIN { printf \"%.1f\", b - a }")" > "${f%.textproto}.rc"' \
    "$train" "$overrides"
  local survived=0 total=0 worst="" rc
  for rc in "$dir"/mutant_*.rc; do
    total=$((total + 1))
    local code took log=${rc%.rc}.log
    read -r code took < "$rc"
    trial=$(basename "${rc%.rc}")
    if [[ $code -eq 0 ]]; then
      survived=$((survived + 1))  # still a valid config: it trained
    elif [[ $code -eq 137 ]]; then
      problem "$dir" "$(basename "${rc%.rc}"): a hang (killed after 120 s); $(head -c 300 "${rc%.rc}.textproto" | tr '\n' ' ')"
    elif [[ $code -ge 128 ]]; then
      problem "$dir" "$(basename "${rc%.rc}"): a crash (exit $code): $(tail -3 "$log" | tr '\n' ' ')"
    elif [[ $(grep -c -v '^\s*$' "$log") -eq 0 ]]; then
      problem "$dir" "$(basename "${rc%.rc}"): exit $code without a message"
    elif grep -q -E "terminate called|Exception raised from|Aborted" "$log"; then
      problem "$dir" "$(basename "${rc%.rc}"): exit $code with a raw exception: $(tail -2 "$log" | tr '\n' ' ')"
    else
      survived=$((survived + 1))
      [[ $code -ne 0 ]] && worst=$(max "$worst" "$took")
    fi
  done
  row "config mutations (exit 0, or an error message)" "$total" "$survived" 0 "$worst"
}

current="kill -9 of a random rank (3 ranks, 10 s heartbeat timeout)"; wanted "$current" && peer_fault KILL "$current"
current="SIGSTOP of a random rank (3 ranks, 10 s heartbeat timeout)"; wanted "$current" && peer_fault STOP "$current"
current="SIGTERM/SIGUSR1 at a random step"; wanted "$current" && preemption
current="SIGKILL during saves"; wanted "$current" && kill_during_save
damaged
storage
current="config mutations"; wanted "$current" && config_mutations

printf '\n%-66s %7s %9s %10s %s\n' "fault" "trials" "survived" "data lost" "longest time to the clear error / exit"
bad=0
for r in "${rows[@]}"; do
  IFS='|' read -r name n ok lost t <<< "$r"
  printf '%-66s %7s %9s %10s %s\n' "$name" "$n" "$ok" "$lost" "${t:--}"
  [[ $ok -ne $n || $lost -ne 0 ]] && bad=1
done
if [[ -s $problems ]]; then
  echo
  echo "Problems:"
  cat "$problems"
fi
[[ $bad -eq 0 && ! -s $problems ]] || { echo "FAIL: the fault suite found problems"; exit 1; }
echo "OK: every fault survived, no data lost"
