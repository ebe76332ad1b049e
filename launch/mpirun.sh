#!/usr/bin/env bash
# Starts a Lockstep program on N processes with Open MPI's mpirun, on this host or
# on several.
#
#   launch/mpirun.sh [-n N] [--hosts HOST:SLOTS,...] [--] PROGRAM [ARGS...]
#   launch/mpirun.sh -n 2 -- build/lockstep_train --config=configs/fashion_mnist_cnn.textproto
#   launch/mpirun.sh -n 8 --hosts node1:4,node2:4 -- build/lockstep_train --config=...
#
# Several hosts need passwordless ssh between them, the same program path and data
# on each, and Open MPI installed everywhere. Each rank reads its rank, world size
# and local rank from Open MPI's OMPI_COMM_WORLD_* variables; mpirun binds each rank
# to its cores, and each rank runs one libtorch thread per core it is bound to.
# The job token of the coordination service: LOCKSTEP_JOB_TOKEN if set, else 32
# fresh random bytes, passed to the ranks. With --hosts, the service runs on the
# first host at LOCKSTEP_COORDINATOR_PORT (default 29400; MASTER_ADDR/MASTER_PORT
# are set from them); on one host rank 0 picks a free loopback port itself.
# Environment passed through: MPIRUN_EXTRA_ARGS (extra mpirun flags).
set -euo pipefail

ranks=2
hosts=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--np) ranks=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "launch/mpirun.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then echo "launch/mpirun.sh: no program to run (see --help)" >&2; exit 2; fi
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]]; then echo "launch/mpirun.sh: -n needs a positive integer, got '$ranks'" >&2; exit 2; fi
command -v mpirun >/dev/null || { echo "launch/mpirun.sh: mpirun not found (install openmpi-bin)" >&2; exit 1; }

args=(-np "$ranks")
[[ $(id -u) -eq 0 ]] && args+=(--allow-run-as-root)
if [[ -n $hosts ]]; then
  args+=(--host "$hosts")
elif [[ $ranks -gt $(nproc) ]]; then
  args+=(--oversubscribe)
fi
# Every rank's stdout is a pseudo-terminal under mpirun; tell rank 0 what ours is.
if [[ -t 1 ]]; then export LOCKSTEP_STDOUT_IS_TERMINAL=1; else export LOCKSTEP_STDOUT_IS_TERMINAL=0; fi
args+=(-x LOCKSTEP_STDOUT_IS_TERMINAL)
if [[ -z ${LOCKSTEP_JOB_TOKEN:-} ]]; then
  LOCKSTEP_JOB_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  export LOCKSTEP_JOB_TOKEN
fi
args+=(-x LOCKSTEP_JOB_TOKEN)
if [[ -n $hosts ]]; then
  export MASTER_ADDR=${hosts%%[:,]*} MASTER_PORT=${LOCKSTEP_COORDINATOR_PORT:-29400}
  args+=(-x MASTER_ADDR -x MASTER_PORT)
  # Open MPI's daemons probe an idle connection to mpirun after 2 s and give up
  # after 3 unanswered probes (default: after 300 s + 9 x 20 s), so that mpirun ends
  # soon after a host becomes unreachable.
  export OMPI_MCA_oob_tcp_keepalive_time=${OMPI_MCA_oob_tcp_keepalive_time:-2}
  export OMPI_MCA_oob_tcp_keepalive_intvl=${OMPI_MCA_oob_tcp_keepalive_intvl:-1}
  export OMPI_MCA_oob_tcp_keepalive_probes=${OMPI_MCA_oob_tcp_keepalive_probes:-3}
fi
# Shared-memory transfers through CMA are refused in many containers; plain copies work everywhere.
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${MPIRUN_EXTRA_ARGS:-} "$@"
