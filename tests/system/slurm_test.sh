#!/usr/bin/env bash
# launch/slurm.sbatch on a real one-node Slurm cluster that this test starts and stops:
#  a) a 2-task training job (srun --mpi=pmix) runs to the end;
#  b) the same job, sent SIGUSR1 mid-run (scancel --signal=USR1, what --signal=USR1@120
#     does before the time limit): the ranks save an emergency checkpoint and exit 75,
#     the script requeues the job, Slurm starts it again, it resumes and finishes;
#  c) both end with bitwise-equal shards and print the same metric lines;
#  d) the job a again under plain srun (LOCKSTEP_SRUN_MPI=none: no PMIx, so no MPI):
#     the ranks take the Gloo backend and print job a's losses within 1e-5;
# and a failing program's exit code is the job's, without a requeue.
# Usage: slurm_test.sh SOURCE_DIR LOCKSTEP_TRAIN
#
# The cluster: munged, slurmctld and slurmd, all run as root in the foreground as
# children of this script, with their own munge key, config, ports (free loopback
# ports picked now), state, spool, logs and pid files in a temporary directory; the
# node is this host (its short name, at 127.0.0.1). They are stopped by PID on exit.
# Slurm holds a requeued job back for AuthInfo's cred_expire (120 s by default, a
# site's choice, not the script's): the config sets 10 s, and a scheduler pass every
# 2 s (sched_interval), so that the requeued job starts again within about 15 s.
# LOCKSTEP_KEEP_TEST_DIR=1 keeps the directory (logs, job output) for a look.
# Needs root, munge and slurm-wlm (slurmctld, slurmd, the mpi_pmix plugin); prints
# SKIP and exits 0 without them.
set -euo pipefail
source_dir=$1
train=$2
python=/usr/bin/python3
t0=$(date +%s)

skip() { echo "SKIP: $*"; exit 0; }
for tool in munged munge slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
  command -v "$tool" >/dev/null || skip "$tool not found (install munge, slurm-wlm, slurm-client)"
done
[[ $(id -u) -eq 0 ]] || skip "slurmd needs root"
source "$source_dir/tests/system/slurm_helpers.sh"  # job_field, wait_done, slurm_*
plugin_dir=$(slurm_plugin_dir) || skip "Slurm's mpi_pmix plugin not found"
[[ -x $train ]] || { echo "FAIL: $train is not executable"; exit 1; }

# A Slurm or launcher environment around this test must not reach its jobs.
while read -r name; do unset "$name"; done < <(compgen -e | grep -E '^(SLURM_|SBATCH_|SRUN_|SALLOC_|OMPI_COMM_WORLD_)' || true)
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE LOCKSTEP_JOB_TOKEN LOCKSTEP_JOB_TOKEN_FILE \
  LOCKSTEP_COORDINATOR_ADDR LOCKSTEP_COORDINATOR_PORT LOCKSTEP_TRAIN LOCKSTEP_MAX_REQUEUES

# munged wants every directory above its socket searchable by all, and none writable by others.
work=$(mktemp -d /tmp/lockstep_slurm.XXXXXX)
chmod 755 "$work"
mkdir -m 700 "$work/munge"
mkdir -m 755 "$work/run" "$work/log" "$work/state" "$work/spool" "$work/jobs"
pids=()  # daemons, stopped in reverse order

say() { echo "[$(($(date +%s) - t0)) s] $*"; }
show_logs() {
  for f in "$work"/jobs/*.out "$work"/log/*.log; do
    [[ -e $f ]] || continue
    echo "----- $f (last 60 lines)"
    tail -n 60 "$f"
  done
  echo "----- squeue"
  squeue -a 2>&1 || true
}
fail() { echo "FAIL: $*"; show_logs; exit 1; }

stop_cluster() {
  set +e
  if [[ ${#pids[@]} -ge 2 ]] && kill -0 "${pids[1]}" 2>/dev/null; then  # slurmctld is up: end the jobs
    mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
    if [[ ${#jobs[@]} -gt 0 ]]; then
      scancel --full "${jobs[@]}" 2>/dev/null
      for _ in $(seq 1 60); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
      # Steps that outlive that (slurmstepd does not stop with slurmd): by PID, from Slurm.
      for job in "${jobs[@]}"; do
        for pid in $(scontrol listpids "$job" 2>/dev/null | awk 'NR > 1 {print $1}'); do kill -KILL "$pid" 2>/dev/null; done
      done
    fi
  fi
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 1 50); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "${pids[i]}" 2>/dev/null
    wait "${pids[i]}" 2>/dev/null
  done
  if [[ -n ${LOCKSTEP_KEEP_TEST_DIR:-} ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_ports() {  # free_ports N: N loopback ports free now
  "$python" -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
read -r ctld_port slurmd_port port_a port_b port_d < <(free_ports 5)

# munge: a fresh key, its own socket.
started=0
slurm_start_munged "$work" && started=1
pids+=("$munged_pid")
[[ $started -eq 1 ]] || fail "munged does not answer on $munge_socket"

# Slurm: this host as the only node, 2 CPUs at least so that 2 tasks fit.
node=$(hostname -s)
cpus=$(nproc)
[[ $cpus -ge 2 ]] || cpus=2
export SLURM_CONF=$work/slurm.conf
{
slurm_conf_common "$work" "$plugin_dir"
cat <<EOF
ClusterName=lockstep-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmdSpoolDir=$work/spool
SlurmdPidFile=$work/run/slurmd.pid
SlurmdLogFile=$work/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
} > "$SLURM_CONF"
slurmctld -D -i -f "$SLURM_CONF" > "$work/log/slurmctld.stdout.log" 2>&1 &
pids+=($!)
slurmd -D -N "$node" -f "$SLURM_CONF" > "$work/log/slurmd.stdout.log" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 1 120); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  [[ $state == idle ]] && break
  kill -0 "${pids[1]}" 2>/dev/null || fail "slurmctld exited"
  kill -0 "${pids[2]}" 2>/dev/null || fail "slurmd exited"
  sleep 0.5
done
[[ $state == idle ]] || fail "node $node not idle after 60 s (state '$state')"
say "cluster up: $(slurmctld -V), node $node ($cpus CPUs), slurmctld port $ctld_port, slurmd port $slurmd_port"

# The coordinator goes to the first host of the allocation, by name, unless that
# name does not resolve here.
coordinator_host=$node
if ! getent hosts "$node" > /dev/null; then
  export LOCKSTEP_COORDINATOR_ADDR=127.0.0.1
  coordinator_host=127.0.0.1
  say "host name $node does not resolve; coordinator at LOCKSTEP_COORDINATOR_ADDR=127.0.0.1"
fi
# The jobs run a copy: a rebuild of the binary while this test runs does not reach them.
cp "$train" "$work/lockstep_train"
train=$work/lockstep_train

flags="data.source=SYNTHETIC,model.name=mlp,model.hidden_units=512,data.global_batch_size=256,model.dropout=0.1"
flags+=",eval_every_steps=50,summary_every_steps=10,progress=lines,checkpoint.every_steps=25"
total=300
cd "$work/jobs"

submit() {  # submit NAME PORT [SRUN_MPI]: the job's id
  sbatch --parsable --job-name="lockstep_$1" --nodes=1 --ntasks=2 --ntasks-per-node=2 --output="$work/jobs/$1.out" \
    --export=ALL,LOCKSTEP_COORDINATOR_PORT="$2",LOCKSTEP_SRUN_MPI="${3:-pmix}" "$source_dir/launch/slurm.sbatch" \
    -- "$train" --set="$flags,num_train_steps=$total,output_dir=$work/$1"
}
lines() { cat "$@" | grep -E '^Step +[0-9]+: ' | grep -v -E 'seconds_per_step|examples_per_second|steps_per_second|data_wait_fraction'; }

# A failing program: its exit code is the job's, and the job is not requeued.
job_f=$(sbatch --parsable --job-name=lockstep_fail --ntasks=2 --output="$work/jobs/fail.out" \
  "$source_dir/launch/slurm.sbatch" -- /bin/sh -c 'exit 7') || fail "sbatch refused the failing job"
wait_done "$job_f" 60
[[ $s == FAILED && $(job_field "$job_f" ExitCode) == 7:0 && $(job_field "$job_f" Restarts) == 0 ]] ||
  fail "failing job ($job_f): $s, exit $(job_field "$job_f" ExitCode), restarts $(job_field "$job_f" Restarts); expected FAILED, 7:0, 0"
say "failing program ($job_f): FAILED with exit code 7, not requeued"

# a) Straight through.
ta=$(date +%s)
job_a=$(submit a "$port_a") || fail "sbatch refused job a"
wait_done "$job_a" 240
[[ $s == COMPLETED && $(job_field "$job_a" ExitCode) == 0:0 ]] || fail "job a ($job_a): $s, exit $(job_field "$job_a" ExitCode)"
grep -q "^Done: $total steps" a.out || fail "job a: no 'Done: $total steps' line"
grep -q "2 rank(s) via slurm" a.out || fail "job a: the ranks did not come from Slurm's variables"
grep -q "at $coordinator_host:$port_a " a.out || fail "job a: coordinator not at $coordinator_host:$port_a"
time_a=$(($(date +%s) - ta))
say "job a ($job_a): $total steps on 2 tasks, COMPLETED in $time_a s"

# b) SIGUSR1 mid-run: emergency checkpoint, exit 75, requeue, resume.
tb=$(date +%s)
job_b=$(submit b "$port_b") || fail "sbatch refused job b"
deadline=$(($(date +%s) + 120))
until [[ $(sed -n 's/^Step \+\([0-9]\+\): train loss.*/\1/p' b.out 2>/dev/null | tail -n 1) -ge 60 ]] 2>/dev/null; do
  [[ $(date +%s) -lt $deadline ]] || fail "job b ($job_b): no train summary at step 60 or later within 120 s"
  sleep 0.2
done
scancel --signal=USR1 "$job_b" || fail "scancel --signal=USR1 $job_b"
ts=$(date +%s)
say "job b ($job_b): SIGUSR1 after step $(sed -n 's/^Step \+\([0-9]\+\): train loss.*/\1/p' b.out | tail -n 1)"
deadline=$(($(date +%s) + 60))
until [[ $(job_field "$job_b" Restarts) -ge 1 ]]; do
  [[ $(date +%s) -lt $deadline ]] || fail "job b ($job_b): not requeued within 60 s of SIGUSR1"
  sleep 0.2
done
say "job b: requeued ($(job_field "$job_b" JobState), reason $(job_field "$job_b" Reason), eligible $(job_field "$job_b" EligibleTime))"
deadline=$(($(date +%s) + 120))
until grep -q "^slurm.sbatch: job $job_b, start 2," b.out; do
  [[ $(date +%s) -lt $deadline ]] || fail "job b ($job_b): requeued but not started again within 120 s"
  sleep 0.5
done
t_restart=$(date +%s)
wait_done "$job_b" 240
[[ $s == COMPLETED && $(job_field "$job_b" ExitCode) == 0:0 ]] || fail "job b ($job_b): $s, exit $(job_field "$job_b" ExitCode)"
time_b=$(($(date +%s) - tb))
[[ $(job_field "$job_b" Restarts) == 1 ]] || fail "job b: Restarts=$(job_field "$job_b" Restarts), expected 1"
step=$(sed -n 's/.*emergency checkpoint .*step_0*\([0-9]*\);.*/\1/p' b.out | head -n 1)
[[ -n $step ]] || fail "job b: no emergency checkpoint line"
grep -q "^Preempted (SIGUSR1): emergency checkpoint" b.out || fail "job b: not preempted by SIGUSR1"
grep -q "Exited with exit code 75" b.out || fail "job b: the tasks did not exit 75"
grep -q "^slurm.sbatch: preempted: emergency checkpoint taken (exit 75); requeueing job $job_b" b.out ||
  fail "job b: the script did not requeue"
grep -q "Resumed from $work/b/checkpoints/step_$(printf %08d "$step")" b.out || fail "job b: did not resume from step $step"
[[ $(grep -c "^Done: $total steps" b.out) -eq 1 ]] || fail "job b: not exactly one 'Done: $total steps' line"
say "job b: emergency checkpoint at step $step, requeued, restarted $((t_restart - ts)) s after the signal, COMPLETED"

# c) The same end state and the same metric lines.
final=$(printf %08d $total)
"$python" "$source_dir/tests/system/compare_checkpoints.py" "$work/a/checkpoints/step_$final" \
  "$work/b/checkpoints/step_$final" || fail "step $total: shards of job a and job b differ"
lines a.out > a.lines
lines b.out > b.lines
[[ $(wc -l < a.lines) -gt 100 ]] || fail "too few metric lines in job a"
diff a.lines b.lines > lines.diff || { cat lines.diff; fail "metric lines differ between job a and the requeued job b"; }

# d) Plain srun: no PMIx, so the ranks take the Gloo backend; job a's losses.
source "$source_dir/tests/system/loss_helpers.sh"  # compare_losses
td=$(date +%s)
job_d=$(submit d "$port_d" none) || fail "sbatch refused job d"
wait_done "$job_d" 240
[[ $s == COMPLETED && $(job_field "$job_d" ExitCode) == 0:0 ]] || { cat d.out; fail "job d ($job_d): $s, exit $(job_field "$job_d" ExitCode)"; }
grep -q "2 rank(s) via slurm, gloo backend" d.out || { head -5 d.out; fail "job d: plain srun did not give 2 Slurm ranks on Gloo"; }
result_d=$(compare_losses a.out d.out 30 1e-5) || { cat d.out; fail "job d (plain srun, Gloo) against job a (pmix, MPI): $result_d"; }
time_d=$(($(date +%s) - td))
say "job d ($job_d): plain srun, Gloo: $result_d of job a, COMPLETED in $time_d s"

echo "OK: Slurm $(slurmctld -V | awk '{print $2}') sbatch launch/slurm.sbatch, srun --mpi=pmix on 2 tasks:" \
  "exit 7 passed on, not requeued;" \
  "straight job $total steps in $time_a s; SIGUSR1 job: emergency checkpoint at step $step, exit 75, requeued" \
  "(Restarts=1, started again $((t_restart - ts)) s after the signal), resumed, done in $time_b s;" \
  "$(wc -l < a.lines) metric lines equal and both shards bit-identical;" \
  "plain srun (Gloo): $result_d of srun --mpi=pmix (MPI) in $time_d s; total $(($(date +%s) - t0)) s"
