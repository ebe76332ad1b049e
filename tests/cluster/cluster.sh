#!/usr/bin/env bash
# A test cluster on this machine: K "hosts", each a Linux network namespace with
# its own hostname (a UTS namespace) and its own /etc/hosts, joined by a bridge that
# has no uplink. Host i is node<i> at 10.99.0.<i+1>/24, an address on that bridge
# alone: nothing outside the cluster is reachable from a host, nor a host from
# outside. Needs root, iproute2 (ip, tc) and util-linux (nsenter, unshare).
#
#   tests/cluster/cluster.sh up K DIR            build hosts node0..node<K-1>; state in DIR
#   tests/cluster/cluster.sh exec DIR HOST CMD.. run CMD on HOST (its network, hostname, /etc/hosts)
#   tests/cluster/cluster.sh cut DIR HOST        take HOST's link down (heal: bring it back up)
#   tests/cluster/cluster.sh heal DIR HOST
#   tests/cluster/cluster.sh limit DIR HOST RATE rate-limit HOST's link both ways (tc tbf; RATE as
#                                                tc writes it: 1gbit, 100mbit)
#   tests/cluster/cluster.sh kill-host DIR HOST  SIGKILL every process on HOST (a lost host)
#   tests/cluster/cluster.sh link-bytes DIR HOST the bytes HOST's link has carried, both ways
#   tests/cluster/cluster.sh down DIR            end every process on the hosts, remove all it built
#
# A test sources this file and calls cluster_up / cluster_exec / ... / cluster_down
# (the same commands as functions, DIR set once by cluster_up).
#
# How a host is made: a holder process (sleep) enters the network namespace, and
# `unshare --uts --mount` gives it its hostname, the cluster's hosts file bound
# over /etc/hosts and a private /var/tmp (node<i>.var-tmp in DIR); every command on the host then joins the holder's network, UTS
# and mount namespaces with nsenter. Open
# MPI reaches the hosts through DIR/agent, a launch agent in ssh's place
# (`--mca plm_rsh_agent DIR/agent`) that runs the daemon's command on the host named.
#
# Everything it builds is named in DIR (the namespaces, the bridge, each holder's
# PID), so `down` removes exactly that and nothing else; a test calls it from its
# EXIT trap. The processes on a host are found by network namespace (ip netns pids)
# and ended by PID.

cluster_subnet=10.99.0
cluster_dir=""

_cluster_fail() { echo "cluster: $*" >&2; return 1; }

# cluster_up K DIR: hosts node0..node<K-1>.
cluster_up() {
  local k=$1 dir=$2 i
  [[ $k =~ ^[1-9][0-9]?$ && $k -le 32 ]] || { _cluster_fail "up: K must be 1..32, not '$k'"; return 1; }
  [[ $(id -u) -eq 0 ]] || { _cluster_fail "up: needs root (network namespaces)"; return 1; }
  for tool in ip tc nsenter unshare; do
    command -v "$tool" >/dev/null || { _cluster_fail "up: $tool not found (install iproute2, util-linux)"; return 1; }
  done
  mkdir -p "$dir" || return 1
  cluster_dir=$(cd "$dir" && pwd)
  local tag
  tag=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
  echo "$tag" > "$cluster_dir/tag"
  echo "$k" > "$cluster_dir/size"
  local bridge=lk${tag}br
  ip link add "$bridge" type bridge || { _cluster_fail "up: cannot create bridge $bridge"; return 1; }
  echo "$bridge" > "$cluster_dir/bridge"
  ip link set "$bridge" up
  {
    echo "127.0.0.1 localhost"
    for ((i = 0; i < k; i++)); do echo "$cluster_subnet.$((i + 1)) node$i"; done
  } > "$cluster_dir/hosts"
  for ((i = 0; i < k; i++)); do
    local ns=lockstep-$tag-node$i veth=lk${tag}v$i
    ip netns add "$ns" || { _cluster_fail "up: ip netns add $ns"; return 1; }
    echo "$ns" >> "$cluster_dir/namespaces"
    ip link add "$veth" type veth peer name eth0 netns "$ns" || { _cluster_fail "up: veth for node$i"; return 1; }
    ip link set "$veth" master "$bridge"
    ip link set "$veth" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$cluster_subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    # TCP gives up on an unanswered connection after about 13 s rather than 15
    # minutes (tcp_retries2 15, the kernel's default): an Open MPI daemon on a host
    # whose link is cut notices that its mpirun is gone and exits. A site that runs
    # mpirun across hosts sets the same (Slurm ends its steps itself).
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_retries2=5
    # The holder: in the network namespace, with the hostname node<i>, the
    # cluster's /etc/hosts and a /var/tmp of its own (bind mounts in a mount
    # namespace of its own; the rest of the file system, /tmp, /sys and its cgroups
    # included, is the machine's, as a shared file system would be), until `down`.
    mkdir -p "$cluster_dir/node$i.var-tmp"
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave -- \
      /bin/sh -c 'mount --bind "$2" /etc/hosts && mount --bind "$3" /var/tmp && hostname "$1" && exec sleep infinity' \
      sh "node$i" "$cluster_dir/hosts" "$cluster_dir/node$i.var-tmp" < /dev/null > /dev/null 2>&1 &
    echo $! > "$cluster_dir/node$i.pid"
    disown $! 2>/dev/null || true  # no "Killed" from the caller's shell when a test kills a host
  done
  # Every holder has set its hostname and sees every other host.
  for ((i = 0; i < k; i++)); do
    local tries
    for ((tries = 0; tries < 100; tries++)); do
      [[ $(cluster_exec "node$i" hostname 2>/dev/null) == "node$i" ]] && break
      sleep 0.05
    done
    [[ $tries -lt 100 ]] || { _cluster_fail "up: node$i did not come up"; return 1; }
  done
  for ((i = 1; i < k; i++)); do
    local tries
    for ((tries = 0; tries < 50; tries++)); do
      cluster_exec node0 ping -c 1 -W 1 "node$i" > /dev/null 2>&1 && break
      sleep 0.1
    done
    [[ $tries -lt 50 ]] || { _cluster_fail "up: node0 cannot reach node$i"; return 1; }
  done
  cat > "$cluster_dir/agent" <<EOF
#!/bin/sh
# Open MPI's launch agent for the cluster in $cluster_dir: agent [OPTIONS] HOST COMMAND...
# (as ssh is called: the command's words are joined and run by a shell on HOST).
# Like an ssh client, the agent stays on the calling host while the command runs on
# HOST, and it learns of the command's end only while HOST's link is up: when the
# command is killed on a host whose link is down (a host that lost power), the agent
# waits, as ssh would, until its caller gives up on it (or is gone). Signals to the
# agent go to the command.
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
case "\$host" in node[0-9]*) ;; *) echo "agent: no host '\$host' in $cluster_dir" >&2; exit 255 ;; esac
[ -f "$cluster_dir/\$host.pid" ] || { echo "agent: no host '\$host' in $cluster_dir" >&2; exit 255; }
caller=\$PPID
nsenter --target "\$(cat "$cluster_dir/\$host.pid")" --net --uts --mount --wd="\$PWD" -- /bin/sh -c "\$*" <&0 &
child=\$!
trap 'kill -TERM \$child 2>/dev/null || exit 143' TERM INT HUP
code=0
while kill -0 \$child 2>/dev/null; do wait \$child; code=\$?; done
while ! ip -n "lockstep-$tag-\$host" link show eth0 2>/dev/null | grep -q '[<,]UP[,>]'; do
  kill -0 \$caller 2>/dev/null || exit 255
  sleep 0.5
done
exit \$code
EOF
  chmod +x "$cluster_dir/agent"
}

_cluster_use() {  # _cluster_use DIR: the cluster the next command acts on
  cluster_dir=$(cd "$1" 2>/dev/null && pwd) || { _cluster_fail "no cluster directory '$1'"; return 1; }
  [[ -f $cluster_dir/tag ]] || { _cluster_fail "'$1' holds no cluster"; return 1; }
}

_cluster_ns() {  # _cluster_ns HOST: the namespace of node<i>
  local host=$1
  [[ $host =~ ^node([0-9]+)$ && -f $cluster_dir/$host.pid ]] || { _cluster_fail "no host '$host'"; return 1; }
  echo "lockstep-$(cat "$cluster_dir/tag")-$host"
}

# cluster_exec HOST CMD...: CMD on HOST, in the foreground.
cluster_exec() {
  local host=$1 pid
  shift
  _cluster_ns "$host" > /dev/null || return 1
  pid=$(cat "$cluster_dir/$host.pid")
  kill -0 "$pid" 2>/dev/null || { _cluster_fail "$host is down (its holder, PID $pid, is gone)"; return 1; }
  nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- "$@"
}

cluster_cut() { cluster_exec "$1" ip link set eth0 down; }
cluster_heal() { cluster_exec "$1" ip link set eth0 up; }

# cluster_limit HOST RATE: token bucket on both ends of HOST's link.
cluster_limit() {
  local host=$1 rate=$2 ns tag i
  ns=$(_cluster_ns "$host") || return 1
  tag=$(cat "$cluster_dir/tag")
  i=${host#node}
  ip -n "$ns" link set eth0 txqueuelen 10000 2> /dev/null
  tc -n "$ns" qdisc replace dev eth0 root tbf rate "$rate" burst 1mb latency 100ms || return 1
  tc qdisc replace dev "lk${tag}v$i" root tbf rate "$rate" burst 1mb latency 100ms
}

# cluster_link_bytes HOST: the bytes HOST's link has carried, both directions (the
# kernel's counters on the bridge's end of it).
cluster_link_bytes() {
  local stats
  stats=/sys/class/net/lk$(cat "$cluster_dir/tag")v${1#node}/statistics
  [[ -d $stats ]] || { _cluster_fail "no link of host '$1'"; return 1; }
  echo $(( $(cat "$stats/rx_bytes") + $(cat "$stats/tx_bytes") ))
}

# cluster_pids HOST: every process in HOST's network namespace.
cluster_pids() {
  local ns
  ns=$(_cluster_ns "$1") || return 1
  ip netns pids "$ns"
}

# cluster_kill_host HOST: SIGKILL to every process on HOST, its holder too.
cluster_kill_host() {
  local pid
  for pid in $(cluster_pids "$1"); do kill -KILL "$pid" 2>/dev/null; done
  return 0
}

cluster_down() {
  [[ -n $cluster_dir && -f $cluster_dir/tag ]] || return 0
  local -
  set +e  # remove all that is there, whatever fails
  local ns pid round
  if [[ -f $cluster_dir/namespaces ]]; then
    # TERM first, then KILL what is left, by PID, namespace by namespace.
    for round in TERM KILL; do
      while read -r ns; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -"$round" "$pid" 2>/dev/null; done
      done < "$cluster_dir/namespaces"
      [[ $round == TERM ]] && sleep 0.5
    done
    while read -r ns; do
      for _ in $(seq 1 50); do [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] && break; sleep 0.1; done
      ip netns del "$ns" 2>/dev/null
      # A namespace lingers while its sockets close: its veth goes now.
      ip link del "lk$(cat "$cluster_dir/tag")v${ns##*-node}" 2>/dev/null
    done < "$cluster_dir/namespaces"
  fi
  [[ -f $cluster_dir/bridge ]] && ip link del "$(cat "$cluster_dir/bridge")" 2>/dev/null
  rm -f "$cluster_dir"/tag "$cluster_dir"/size "$cluster_dir"/bridge "$cluster_dir"/namespaces \
        "$cluster_dir"/node*.pid "$cluster_dir"/agent "$cluster_dir"/hosts
  rm -rf "$cluster_dir"/node*.var-tmp
  return 0
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -uo pipefail
  command=${1:-}
  [[ $# -gt 0 ]] && shift
  case "$command" in
    up) [[ $# -eq 2 ]] || { echo "usage: cluster.sh up K DIR" >&2; exit 2; }
        cluster_up "$1" "$2" || { cluster_down; exit 1; } ;;
    exec) [[ $# -ge 3 ]] || { echo "usage: cluster.sh exec DIR HOST CMD..." >&2; exit 2; }
          _cluster_use "$1" || exit 2; shift; cluster_exec "$@"; exit $? ;;
    cut|heal|kill-host|pids|link-bytes)
          [[ $# -eq 2 ]] || { echo "usage: cluster.sh $command DIR HOST" >&2; exit 2; }
          _cluster_use "$1" || exit 2
          "cluster_${command//-/_}" "$2" ;;
    limit) [[ $# -eq 3 ]] || { echo "usage: cluster.sh limit DIR HOST RATE" >&2; exit 2; }
           _cluster_use "$1" || exit 2; cluster_limit "$2" "$3" ;;
    down) [[ $# -eq 1 ]] || { echo "usage: cluster.sh down DIR" >&2; exit 2; }
          _cluster_use "$1" || exit 0; cluster_down ;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) echo "cluster.sh: unknown command '$command' (see --help)" >&2; exit 2 ;;
  esac
fi
