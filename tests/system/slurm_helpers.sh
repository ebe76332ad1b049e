# Helpers of the Slurm tests: tests/system/slurm_test.sh (one node, this host) and
# tests/cluster/multihost_slurm_test.sh (one node per namespace host). Source it.
# Slurm's client commands run as "${slurm_client[@]}" COMMAND: set slurm_client to
# the prefix that reaches slurmctld (empty, the default, runs them here).
slurm_client=()

# slurm_plugin_dir: the directory of Slurm's plugins that holds mpi_pmix (none: 1).
slurm_plugin_dir() {
  local dir
  for dir in /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib/aarch64-linux-gnu/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
    [[ -e $dir/mpi_pmix.so ]] && { echo "$dir"; return 0; }
  done
  return 1
}

# slurm_start_munged WORK: munged in the foreground (in the background of this
# shell), with a fresh key in WORK/munge and its socket at WORK/run/munge.sock;
# sets munged_pid and munge_socket. 1 when it does not answer within 5 s. munged
# wants every directory above its socket searchable by all and none writable by
# others: WORK 755, WORK/munge 700, WORK/run and WORK/log 755.
slurm_start_munged() {
  local work=$1
  dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$work/munge/munge.key"
  munge_socket=$work/run/munge.sock
  munged -F --key-file="$work/munge/munge.key" --socket="$munge_socket" --pid-file="$work/run/munged.pid" \
    --log-file="$work/log/munged.log" --seed-file="$work/munge/munged.seed" > "$work/log/munged.stdout.log" 2>&1 &
  munged_pid=$!
  for _ in $(seq 1 50); do [[ -S $munge_socket ]] && break; sleep 0.1; done
  munge -n -S "$munge_socket" | unmunge -S "$munge_socket" > /dev/null
}

# slurm_conf_common WORK PLUGIN_DIR: the slurm.conf lines both tests share (munge
# at WORK/run/munge.sock, state and logs under WORK, no accounting, requeue on,
# a 2 s scheduler, a requeued job held back 10 s). The caller adds the cluster's
# name, hosts, ports, spool and pid files, nodes and partition. Side effect: it
# also creates an empty WORK/plugstack.conf, which PlugStackConfig names (no SPANK
# plugins; without it, Slurm reads the system's /etc/slurm/plugstack.conf).
slurm_conf_common() {
  local work=$1 plugin_dir=$2
  cat <<EOF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/run/munge.sock,cred_expire=10
PluginDir=$plugin_dir
PlugStackConfig=$work/plugstack.conf
StateSaveLocation=$work/state
SlurmctldPidFile=$work/run/slurmctld.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
InactiveLimit=0
EOF
  : > "$work/plugstack.conf"
}

# job_field JOB FIELD: FIELD's value in `scontrol show job JOB` (empty if none).
job_field() {
  local out
  out=$("${slurm_client[@]}" scontrol show job "$1" 2>/dev/null) || true
  if [[ $out =~ (^|[[:space:]])$2=([^[:space:]]*) ]]; then echo "${BASH_REMATCH[2]}"; fi
}

# wait_done JOB SECONDS: until the job has ended; s is its final state ("still X
# after N s" when it has not). Not in a subshell, so that a signal to the test is
# handled within half a second.
wait_done() {
  local deadline=$(($(date +%s) + $2))
  while :; do
    s=$(job_field "$1" JobState)
    case $s in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) return ;; esac
    [[ $(date +%s) -lt $deadline ]] || { s="still ${s:-unknown} after $2 s"; return; }
    sleep 0.5
  done
}
