#!/usr/bin/env bash
# Starting lockstep_train without mpirun (the Gloo backend):
#  1. launch/local.sh on 2 and 3 ranks prints the losses that mpirun with the MPI
#     backend prints, within 1e-5 relative, and says "via torchrun, gloo backend";
#  2. two processes started by hand with torchrun's variables (RANK, WORLD_SIZE,
#     LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and a job token) print exactly what
#     local.sh -n 2 printed; without the token they stop with a message naming
#     LOCKSTEP_JOB_TOKEN;
#  3. local.sh exits with the first failing rank's code (a config error: 2), and
#     forwards SIGTERM: every rank saves an emergency checkpoint at the same step
#     and exits 75, and so does local.sh; the same command resumes from it.
# Usage: launch_test.sh SOURCE_DIR LOCKSTEP_TRAIN MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
shift 2
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
local_sh=$source_dir/launch/local.sh
config=--config=$source_dir/configs/fashion_mnist_cnn.textproto
flags="num_train_steps=30,summary_every_steps=10,eval_every_steps=30,progress=lines,data.global_batch_size=126"
source "$source_dir/tests/system/loss_helpers.sh"  # loss_lines, compare_losses

# 1.
summary=""
for n in 2 3; do
  "${mpirun[@]}" -np "$n" "$train" "$config" --set="$flags,output_dir=$work/mpi$n" > "$work/mpi$n.log" 2>&1 ||
    { cat "$work/mpi$n.log"; fail "mpirun -np $n"; }
  "$local_sh" -n "$n" -- "$train" "$config" --set="$flags,output_dir=$work/local$n" > "$work/local$n.log" 2>&1 ||
    { cat "$work/local$n.log"; fail "launch/local.sh -n $n"; }
  grep -q "^lockstep_train: $n rank(s) via torchrun, gloo backend" "$work/local$n.log" ||
    { head -3 "$work/local$n.log"; fail "local.sh -n $n did not run on $n gloo ranks"; }
  grep -q "^lockstep_train: $n rank(s) via mpirun, mpi backend" "$work/mpi$n.log" || fail "mpirun -np $n: not MPI"
  result=$(compare_losses "$work/mpi$n.log" "$work/local$n.log" 3 1e-5) ||
    { cat "$work/local$n.log"; fail "local.sh -n $n against mpirun -np $n: $result"; }
  summary+="$n ranks: $result; "
done

# 2.
token=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for r in 0 1; do
  env -u OMPI_COMM_WORLD_RANK RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    LOCKSTEP_JOB_TOKEN=$token "$train" "$config" --set="$flags,output_dir=$work/hand" > "$work/hand$r.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { cat "$work/hand0.log" "$work/hand1.log"; fail "a hand-started rank failed"; }; done
diff <(loss_lines "$work/local2.log") <(loss_lines "$work/hand0.log") || fail "hand-started ranks differ from local.sh -n 2"
set +e
env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port LOCKSTEP_JOB_TOKEN= \
  timeout 60 "$train" "$config" --set="$flags,output_dir=$work/notoken" > "$work/notoken.log" 2>&1
code=$?
set -e
[[ $code -ne 0 ]] && grep -q "LOCKSTEP_JOB_TOKEN" "$work/notoken.log" ||
  { cat "$work/notoken.log"; fail "no job token: exit $code without a message naming LOCKSTEP_JOB_TOKEN"; }

# 3.
set +e
"$local_sh" -n 2 -- "$train" "$config" --set="$flags,data.global_batch_size=7,output_dir=$work/bad" > "$work/bad.log" 2>&1
code=$?
set -e
[[ $code -eq 2 ]] || { cat "$work/bad.log"; fail "a config error under local.sh: exit $code, expected 2"; }
grep -q "^launch/local.sh: rank [01] (pid [0-9]*) exited with 2" "$work/bad.log" || fail "local.sh did not name the failing rank"

long="num_train_steps=120,summary_every_steps=10,progress=lines,data.global_batch_size=126,checkpoint.every_steps=0"
"$local_sh" -n 2 -- "$train" "$config" --set="$long,output_dir=$work/pre" > "$work/pre.log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do grep -q "^Step \+20: train loss" "$work/pre.log" 2>/dev/null && break; sleep 0.1; done
kill -s TERM $launcher
set +e
wait $launcher
code=$?
set -e
[[ $code -eq 75 ]] || { cat "$work/pre.log"; fail "SIGTERM to local.sh: exit $code, expected 75"; }
step=$(sed -n 's/^Preempted ([^)]*): emergency checkpoint .*step_0*\([0-9]*\);.*/\1/p' "$work/pre.log")
[[ -n $step ]] || { cat "$work/pre.log"; fail "SIGTERM to local.sh: no emergency checkpoint line"; }
"$local_sh" -n 2 -- "$train" "$config" --set="$long,output_dir=$work/pre" > "$work/pre2.log" 2>&1 ||
  { cat "$work/pre2.log"; fail "resuming after SIGTERM"; }
grep -q "^Resumed from $work/pre/checkpoints/step_$(printf %08d "$step"): step $step, written by 2 rank(s)" \
  "$work/pre2.log" || { cat "$work/pre2.log"; fail "did not resume from step $step"; }

echo "OK: launch/local.sh matches mpirun: ${summary}hand-started torchrun-style ranks equal local.sh; no token named;" \
     "a config error exits 2; SIGTERM forwarded: emergency checkpoint at step $step on both ranks, exit 75, resumed"
