#!/usr/bin/env bash
# launch/mpirun.sh --hosts across the hosts of a namespace cluster (tests/cluster/cluster.sh):
#  1. 4 ranks on 2 hosts (2 per host), the coordination service on node0 reached over
#     the bridge with TLS: the Fashion-MNIST job prints the losses of 1 process within
#     1e-5; the ranks of a host share memory (Open MPI's vader segments of node0 and
#     node1 in /dev/shm), and the gradients cross the link (node1's link carries at
#     least one full gradient per step);
#     1b. the same 4 ranks placed cyclically (0 and 2 on node0), with the
#     hierarchical all-reduce: it finds the hosts by name (2 hosts x 2 ranks), the
#     losses are those of 1 process, and the link carries 1 to 3 gradients per step
#     (one each way);
#     1c. the same placement, flat: the ranks are all-reduced in host order (the
#     log says so), the losses are those of 1 process, and the link carries 1 to 3
#     gradients per step; 1d. with communication.order_by_host=false (launch
#     order), the same losses and more than 3 (Open MPI's all-reduce pairs
#     node0's ranks with node1's in its first, half-sized step: about 4);
#  2. 4 ranks on 4 hosts (1 per host): the same losses;
#  3. node1's link cut mid-run: every rank ends within heartbeat timeout + 5 s, those
#     on node0 naming a rank on node1 and its host, those on node1 the lost service on
#     node0; mpirun exits non-zero and no process is left on any host;
#  4. node1 lost mid-run (its link down, then every process on it killed): the ranks
#     on node0 end within heartbeat timeout + 5 s naming a rank on node1 and its host;
#     mpirun exits non-zero and no process is left.
# Prints the figures: each run's time, the bytes over node1's link, the seconds from
# the cut to the last rank's end and to the last process's.
# Usage: multihost_mpirun_test.sh SOURCE_DIR LOCKSTEP_TRAIN
# Needs root (network namespaces) and openssl; prints SKIP and exits 0 without them.
set -euo pipefail
source_dir=$1
train=$2
skip() { echo "SKIP: $*"; exit 0; }
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
for tool in ip tc nsenter unshare ping openssl mpirun; do
  command -v "$tool" >/dev/null || skip "$tool not found"
done
probe=lockstep-probe-$$
ip netns add "$probe" 2>/dev/null || skip "cannot create a network namespace here"
ip netns del "$probe"

# A launcher environment around this test must not reach its jobs.
while read -r name; do unset "$name"; done < <(compgen -e | grep -E '^(SLURM_|OMPI_COMM_WORLD_|OMPI_MCA_oob)' || true)
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE LOCKSTEP_JOB_TOKEN LOCKSTEP_JOB_TOKEN_FILE

work=$(mktemp -d /tmp/lockstep_multihost.XXXXXX)
source "$source_dir/tests/cluster/cluster.sh"
source "$source_dir/tests/system/loss_helpers.sh"  # compare_losses
finish() {
  cluster_down
  if [[ -n ${LOCKSTEP_KEEP_TEST_DIR:-} ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
t0=$(date +%s.%N)
say() { printf '[%.1f s] %s\n' "$(echo "$(date +%s.%N) - $t0" | bc)" "$*"; }
fail() { echo "FAIL: $*"; exit 1; }
now() { date +%s.%N; }
seconds() { echo "scale=2; ($2 - $1) / 1" | bc; }

cluster_up 4 "$work/cluster" || fail "could not build the cluster"
tag=$(cat "$work/cluster/tag")
say "cluster: 4 hosts (node0..node3, 10.99.0.1-4) on bridge lk${tag}br"

config=--config=$source_dir/configs/fashion_mnist_cnn.textproto
steps=30
flags="num_train_steps=$steps,summary_every_steps=10,eval_every_steps=30,progress=lines,data.global_batch_size=124"
mpirun_on_node0() {  # mpirun_on_node0 HOSTS OUTDIR LOG [FLAGS]: 4 ranks from node0 (MAP_BY=node: cyclic)
  local hosts=$1 out=$2 log=$3 extra=${4:-}
  cluster_exec node0 env MPIRUN_EXTRA_ARGS="--mca plm_rsh_agent $work/cluster/agent --output-filename $out/ranks${MAP_BY:+ --map-by $MAP_BY --display-map}" \
    LOCKSTEP_COORDINATOR_PORT=29400 "$source_dir/launch/mpirun.sh" -n 4 --hosts "$hosts" -- \
    "$train" "$config" --set="$flags,output_dir=$out$extra" > "$log" 2>&1
}

# The reference: 1 process.
"$train" "$config" --set="$flags,output_dir=$work/one" > "$work/one.log" 2>&1 || { cat "$work/one.log"; fail "1 process"; }

# 1. 2 hosts x 2 ranks, TLS. The certificate names node0, where the service runs.
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=node0 -addext subjectAltName=DNS:node0 \
  -keyout "$work/key.pem" -out "$work/cert.pem" > /dev/null 2>&1 || fail "openssl could not make a certificate"
tls=",coordination.tls_cert_file=$work/cert.pem,coordination.tls_key_file=$work/key.pem"
before=$(cluster_link_bytes node1)
: > "$work/shm.txt"
( for _ in $(seq 1 300); do ls /dev/shm >> "$work/shm.txt" 2>/dev/null; sleep 0.1; done ) &
watcher=$!
start=$(now)
mpirun_on_node0 node0:2,node1:2 "$work/two" "$work/two.log" "$tls" || { cat "$work/two.log"; fail "2 hosts x 2 ranks"; }
two_seconds=$(seconds "$start" "$(now)")
kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null || true
bytes=$(( $(cluster_link_bytes node1) - before ))
grep -q "^Coordination: job '.*' at node0:29400 (hosted by rank 0, TLS)" "$work/two.log" ||
  { head -5 "$work/two.log"; fail "the service was not at node0:29400 with TLS"; }
grep -q "^lockstep_train: 4 rank(s) via mpirun, mpi backend" "$work/two.log" || fail "2 hosts: not 4 MPI ranks"
result=$(compare_losses "$work/one.log" "$work/two.log" 3 1e-5) || { cat "$work/two.log"; fail "2 hosts x 2 ranks against 1 process: $result"; }
for host in node0 node1; do
  grep -q "^vader_segment\.$host\." "$work/shm.txt" || fail "no shared-memory (vader) segment of $host's ranks in /dev/shm"
done
# Any all-reduce moves at least one gradient (421642 floats) over the link each step.
floor=$(( steps * 421642 * 4 ))
(( bytes >= floor )) || fail "node1's link carried $bytes bytes, less than one gradient per step ($floor)"
say "2 hosts x 2 ranks (TLS): $result; ${two_seconds} s; node1's link carried $((bytes / 1000000)) MB" \
    "($(echo "scale=2; $bytes / $floor" | bc) gradients per step)"

# cyclic_run NAME LABEL SET PATTERN LOW HIGH: 2 hosts x 2 ranks placed
# cyclically (ranks 0 and 2 on node0), SET appended to the job's --set. Rank 0's "Communication:
# gradient buckets: ..." line matches the glob PATTERN, the losses are those of 1
# process, and node1's link carries at least LOW and (unless HIGH is empty) fewer
# than HIGH gradients per step.
cyclic_run() {
  # (not "flags": mpirun_on_node0 reads the global one)
  local name=$1 label=$2 set_extra=$3 pattern=$4 low=$5 high=$6 before bytes said result per_step
  before=$(cluster_link_bytes node1)
  MAP_BY=node mpirun_on_node0 node0:2,node1:2 "$work/$name" "$work/$name.log" "$set_extra" ||
    { cat "$work/$name.log"; fail "2 hosts x 2 ranks, $label"; }
  bytes=$(( $(cluster_link_bytes node1) - before ))
  said=$(sed -n 's/^Communication: gradient buckets: //p' "$work/$name.log" | head -1)
  # shellcheck disable=SC2053  # the pattern is a glob
  [[ $said == $pattern ]] || fail "$label: rank 0 said '$said', not '$pattern'"
  result=$(compare_losses "$work/one.log" "$work/$name.log" 3 1e-5) ||
    { cat "$work/$name.log"; fail "2 hosts x 2 ranks, $label, against 1 process: $result"; }
  per_step=$(echo "scale=2; $bytes / $floor" | bc)
  (( bytes >= low * floor )) && { [[ -z $high ]] || (( bytes < high * floor )); } ||
    fail "$label: node1's link carried $per_step gradients per step, not from $low to ${high:-any more}"
  say "2 hosts x 2 ranks, $label: $result; node1's link carried $((bytes / 1000000)) MB ($per_step gradients per step)"
}

# 1b. The hierarchical all-reduce finds the hosts by host name, not by rank
# order, and the link carries one gradient's worth each way a step.
cyclic_run cyclic "cyclic, hierarchical" ",communication.hierarchical=true" \
  "float32 all-reduce; hierarchical all-reduce: 2 hosts x 2 ranks*" 1 3
# mpirun's job map (--display-map, printed more than once): the ranks it put on node0.
on_node0=$(awk '/Data for node:/ { node = $4 } /^ *=+ *$/ && node != "" { exit }
  /Process rank:/ && node == "node0" { for (i = 1; i < NF; i++) if ($i == "rank:") printf "%s ", $(i + 1) }' "$work/cyclic.log")
[[ $on_node0 == "0 2 " ]] || fail "cyclic: mpirun put ranks '${on_node0}' on node0, not 0 and 2"
# 1c and 1d. Flat: in host order (the default) as little; in launch order Open
# MPI's all-reduce pairs node0's ranks with node1's in its first, half-sized
# step, and the link carries about twice that.
cyclic_run cyclic_flat "cyclic, flat in host order" "" \
  "float32 all-reduce; flat all-reduce, ranks in host order (the launcher interleaved the hosts: rank -> host 0 1 0 1)" 1 3
cyclic_run cyclic_rank_order "cyclic, flat in launch order" ",communication.order_by_host=false" \
  "float32 all-reduce; flat" 3 ""

# 2. 4 hosts x 1 rank.
start=$(now)
mpirun_on_node0 node0:1,node1:1,node2:1,node3:1 "$work/four" "$work/four.log" || { cat "$work/four.log"; fail "4 hosts"; }
four_seconds=$(seconds "$start" "$(now)")
result4=$(compare_losses "$work/one.log" "$work/four.log" 3 1e-5) || { cat "$work/four.log"; fail "4 hosts against 1 process: $result4"; }
say "4 hosts x 1 rank: $result4; ${four_seconds} s"

# 3 and 4: a fault on node1 mid-run (heartbeat timeout 3 s), 2 hosts x 2 ranks.
#   cut:  node1's link goes down; its processes live on, cut off.
#   lose: node1 is lost as if its power failed: the link goes down first (so no
#         FIN or RST leaves it), then every process on it is killed.
# Every rank that can still run ends within heartbeat timeout + 5 s, those on node0
# naming a rank on node1 and its host; no process is left on any host; mpirun fails.
hb=3
trains() {  # the lockstep_train processes left on the cluster's hosts
  local h p
  for h in node0 node1; do
    for p in $(cluster_pids "$h" 2>/dev/null); do [[ $(ps -o comm= -p "$p" 2>/dev/null) == lockstep_train ]] && echo "$p"; done
  done
  return 0
}
fault_leg() {  # fault_leg cut|lose: sets ranks_end, all_end, code
  local kind=$1 out=$work/$1 runner fault_at left
  (code=0
   # Cut off from mpirun, node1's Open MPI daemon ends its ranks once its TCP
   # keepalive gives up (about 5 s with launch/mpirun.sh's settings); on a loaded
   # machine that can come before the ranks' own 3 s heartbeat timeout, and they
   # die unheard. The cut leg gives the daemons longer, so that what it checks is
   # the ranks' own detection and what they say of it.
   [[ $kind == cut ]] && export OMPI_MCA_oob_tcp_keepalive_time=10
   mpirun_on_node0 node0:2,node1:2 "$out" "$out.log" \
     ",num_train_steps=100000,coordination.heartbeat_timeout_seconds=$hb" || code=$?
   echo "$code" > "$out.rc") &
  runner=$!
  for _ in $(seq 1 600); do
    [[ $(grep -c "^Step" "$out.log" 2>/dev/null) -ge 18 ]] && break
    [[ -e $out.rc ]] && { cat "$out.log"; fail "$kind: the job ended early"; }
    sleep 0.1
  done
  [[ $(grep -c "^Step" "$out.log") -ge 18 ]] || fail "$kind: the job did not reach step 20 in 60 s"
  [[ $(trains | wc -l) -eq 4 ]] || fail "$kind: expected 4 ranks running before the fault"
  fault_at=$(now)
  cluster_cut node1
  [[ $kind == lose ]] && cluster_kill_host node1
  ranks_end="" all_end=""
  for _ in $(seq 1 600); do
    if [[ -z $ranks_end && -z $(trains) ]]; then ranks_end=$(seconds "$fault_at" "$(now)"); fi
    if [[ -n $ranks_end ]]; then
      left=$( (cluster_pids node0; cluster_pids node1) 2>/dev/null | { grep -vx -e "$(cat "$work/cluster/node0.pid")" \
              -e "$(cat "$work/cluster/node1.pid")" || true; } | wc -l)
      if [[ $left -eq 0 && -e $out.rc ]]; then all_end=$(seconds "$fault_at" "$(now)"); break; fi
    fi
    sleep 0.1
  done
  wait "$runner" || true
  [[ -n $ranks_end ]] || fail "$kind: ranks still running 60 s after the fault: $(trains | tr '\n' ' ')"
  [[ -n $all_end ]] || { for h in node0 node1; do cluster_pids "$h" | xargs -r ps -o pid,cmd -p; done
                         fail "$kind: processes left 60 s after the fault"; }
  (( $(echo "$ranks_end <= $hb + 5" | bc) )) || fail "$kind: the ranks ended ${ranks_end} s after the fault, over $hb + 5 s"
  code=$(cat "$out.rc")
  [[ $code -ne 0 ]] || fail "$kind: mpirun exited 0 after the fault"
  for r in 0 1; do
    grep -qE "rank $r: stopped: rank [23] \(host node1, pid [0-9]+\) is dead: no heartbeat" "$out/ranks/1/rank.$r/stderr" ||
      { cat "$out/ranks/1/rank.$r/stderr"; fail "$kind: rank $r (node0) did not name the rank and host it lost"; }
  done
}
fault_leg cut
for r in 2 3; do
  grep -qE "rank $r: stopped: lost the coordination service at node0:29400" "$work/cut/ranks/1/rank.$r/stderr" ||
    { cat "$work/cut/ranks/1/rank.$r/stderr"; fail "cut: rank $r (node1) did not name the service it lost"; }
done
cut_end=$ranks_end
say "link cut: every rank ended ${ranks_end} s after the cut (heartbeat timeout $hb s), every process" \
    "${all_end} s after; mpirun exit $code; $(grep -ohE 'rank [23] \(host node1[^)]*\) is dead' "$work/cut/ranks/1/rank.0/stderr" | head -1)"
cluster_heal node1
fault_leg lose
say "host lost: the ranks on node0 ended ${ranks_end} s after node1 went (heartbeat timeout $hb s), every" \
    "process ${all_end} s after; mpirun exit $code; $(grep -ohE 'rank [23] \(host node1[^)]*\) is dead' "$work/lose/ranks/1/rank.0/stderr" | head -1)"
echo "OK: several hosts: 2x2 (TLS), 2x2 cyclic (hierarchical) and 4x1 match 1 process; a cut link ends every rank in ${cut_end} s, a lost host in ${ranks_end} s"
