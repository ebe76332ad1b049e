#!/usr/bin/env bash
# Starts a Lockstep program on N processes on this host without mpirun, the way
# torchrun does: each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
# MASTER_ADDR and MASTER_PORT, and the job's ranks meet through the coordination
# service that rank 0 starts there (on loopback); on CPU they then use the Gloo
# backend (backend "auto").
#
#   launch/local.sh [-n N] [--port PORT] [--keep-going] [--] PROGRAM [ARGS...]
#   launch/local.sh -n 3 -- build/lockstep_train --config=configs/fashion_mnist_cnn.textproto
#
# The job token: LOCKSTEP_JOB_TOKEN if set, else 32 fresh random bytes. The port:
# --port, else MASTER_PORT if set, else a free one. SIGTERM, SIGINT and SIGUSR1
# are forwarded to every rank (a preemption notice reaches all of them). Exits
# with the exit code of the first rank that failed, or 0 when all succeeded;
# with --keep-going (a fault-tolerant job, which goes on without the ranks that
# die), with rank 0's, and each rank that fails is named on stderr.
set -uo pipefail
me=launch/local.sh
ranks=2
port=${MASTER_PORT:-}
keep_going=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--np) ranks=${2:-}; shift 2 || { echo "$me: -n needs a value" >&2; exit 2; } ;;
    --port) port=${2:-}; shift 2 || { echo "$me: --port needs a value" >&2; exit 2; } ;;
    --keep-going) keep_going=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "$me: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then echo "$me: no program to run (see --help)" >&2; exit 2; fi
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]]; then echo "$me: -n needs a positive integer, got '$ranks'" >&2; exit 2; fi
if [[ -n $port ]] && ! [[ $port =~ ^[0-9]+$ && $port -ge 1 && $port -le 65535 ]]; then
  echo "$me: the port must be an integer in 1..65535, got '$port'" >&2
  exit 2
fi
if [[ -z $port ]]; then
  # A port the kernel just handed out on loopback (free a moment ago).
  for python in python3 /usr/bin/python3; do
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
           2> /dev/null) && break
  done
  [[ -n $port ]] || port=$((20000 + RANDOM % 30000))
fi
if [[ -z ${LOCKSTEP_JOB_TOKEN:-} ]]; then
  LOCKSTEP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
fi
export LOCKSTEP_JOB_TOKEN MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$ranks LOCAL_WORLD_SIZE=$ranks
# Launcher variables that would contradict ours (this script run inside an mpirun
# or Slurm step) are not passed on.
unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK SLURM_PROCID SLURM_STEP_ID SLURM_STEPID

pids=()
for ((r = 0; r < ranks; ++r)); do
  RANK=$r LOCAL_RANK=$r "$@" &
  pids+=($!)
done
forward() {
  for pid in "${pids[@]}"; do kill -s "$1" "$pid" 2> /dev/null; done
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1

first_failure=0
rank0_code=0
running=("${pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  finished=""
  wait -n -p finished "${running[@]}"
  code=$?
  # A forwarded signal interrupts wait without a rank having exited.
  [[ -z ${finished:-} ]] && continue
  still=()
  for pid in "${running[@]}"; do [[ $pid != "$finished" ]] && still+=("$pid"); done
  running=("${still[@]}")
  if [[ $finished == "${pids[0]}" ]]; then rank0_code=$code; fi
  if [[ $code -ne 0 && ($first_failure -eq 0 || $keep_going -eq 1) ]]; then
    [[ $first_failure -eq 0 ]] && first_failure=$code
    for ((r = 0; r < ranks; ++r)); do
      [[ ${pids[$r]} == "$finished" ]] && echo "$me: rank $r (pid $finished) exited with $code" >&2
    done
  fi
done
if [[ $keep_going -eq 1 ]]; then exit "$rank0_code"; fi
exit "$first_failure"
