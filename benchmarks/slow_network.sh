#!/usr/bin/env bash
# Training over a slow network: Lockstep (flat, hierarchical, bf16/fp16, PowerSGD)
# side by side with PyTorch DDP over gloo (plain, fp16 and PowerSGD hooks) on the
# namespace cluster of tests/cluster/cluster.sh, its links rate-limited with tc tbf.
#
#   sudo benchmarks/slow_network.sh [BUILD_DIR]     (./dev.sh slow-network)
#
# Environment: RATES (default "1gbit 10gbit"), LAYOUTS (default "2x1 2x2"), MODEL
# (wide_mlp), BATCH (examples per rank, 32), STEPS (timed steps per phase, 8), RUNS
# (the names of the runs to make, as the table names them, default all),
# LOCKSTEP_FLAGS (more scaleout_benchmark flags for the Lockstep runs), OUT (a
# folder for the JSON lines, default BUILD_DIR/slow_network). For each rate, 2 hosts x
# 1 rank and 2 hosts x 2 ranks:
# - the all-reduce's bus bandwidth between the hosts (scaleout_benchmark
#   --mode=collectives, 16 MiB, MPI's and Lockstep's), against the link rate;
# - each framework's step time with and without communication (DDP's no_sync,
#   Lockstep's nosync phase: the same processes on the same cores), their ratio
#   (the scaling efficiency against no communication: this machine's 2 cores
#   make a 1-rank baseline meaningless for 4 ranks), and the bytes per step on
#   node1's link (both directions, counted by the kernel).
# Needs root; prints one table per rate and writes every result as a JSON line.
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$source_dir/build}
rates=${RATES:-"1gbit 10gbit"}
layouts=${LAYOUTS:-"2x1 2x2"}
for layout in $layouts; do
  [[ $layout == 2x1 || $layout == 2x2 ]] || { echo "slow_network: LAYOUTS: '$layout' is neither 2x1 nor 2x2" >&2; exit 2; }
done
has_layout() { [[ " $layouts " == *" $1 "* ]]; }
runs=${RUNS:-}
known="collectives lockstep-none lockstep-bf16 lockstep-fp16 lockstep-powersgd ddp-none ddp-fp16 ddp-powersgd"
known+=" lockstep-flat lockstep-hierarchical lockstep-flat-cyclic lockstep-flat-cyclic-rank-order"
known+=" lockstep-hierarchical-cyclic lockstep-flat-bf16 lockstep-hierarchical-bf16 lockstep-hierarchical-fp16"
known+=" lockstep-flat-powersgd"
for run in $runs; do
  [[ " $known " == *" $run "* ]] || { echo "slow_network: RUNS: no run is named '$run' (runs: $known)" >&2; exit 2; }
done
wanted() { [[ -z $runs || " $runs " == *" $1 "* ]]; }
model=${MODEL:-wide_mlp}
batch=${BATCH:-32}
steps=${STEPS:-8}
out=${OUT:-$build/slow_network}
python=/usr/bin/python3
[[ $(id -u) -eq 0 ]] || { echo "slow_network: needs root (network namespaces)" >&2; exit 1; }
[[ -x $build/benchmarks/scaleout_benchmark ]] || { echo "slow_network: no $build/benchmarks/scaleout_benchmark (build first)" >&2; exit 1; }
mkdir -p "$out"
results=$out/results.jsonl
: > "$results"

while read -r name; do unset "$name"; done < <(compgen -e | grep -E '^(SLURM_|OMPI_COMM_WORLD_|OMPI_MCA_oob)' || true)
work=$(mktemp -d /tmp/lockstep_slow_network.XXXXXX)
source "$source_dir/tests/cluster/cluster.sh"
trap 'cluster_down; rm -rf "$work"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
cluster_up 2 "$work/cluster"

common=(--model="$model" --batch_per_rank="$batch" --steps="$steps" --rounds=2 --warmup_steps=3 --breakdown_steps=2 --threads=1)
# LOCKSTEP_FLAGS: more scaleout_benchmark flags for every Lockstep run (--bucket_mb=8, say).
read -r -a extra_flags <<< "${LOCKSTEP_FLAGS:-}"
common+=("${extra_flags[@]}")
# mpirun_hosts HOSTS NP PROGRAM ARGS...: from node0, over eth0 only. Ranks fill
# each host in turn (0 and 1 on node0), unless MAP_BY=node places them cyclically
# (0 and 2 on node0), as Slurm's --distribution=cyclic does.
mpirun_hosts() {
  local hosts=$1 np=$2
  shift 2
  cluster_exec node0 env OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1 \
    mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$work/cluster/agent" \
    --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 --bind-to none ${MAP_BY:+--map-by "$MAP_BY"} \
    -np "$np" --host "$hosts" "$@"
}

# record RATE LAYOUT NAME BYTES_BEFORE JSON_FILE: one JSON line with the link's bytes.
record() {
  local rate=$1 layout=$2 name=$3 before=$4 file=$5
  local after
  after=$(cluster_link_bytes node1)
  "$python" - "$rate" "$layout" "$name" "$((after - before))" "$file" "$steps" >> "$results" <<'EOF'
import json, sys
rate, layout, name, link_bytes, path, steps = sys.argv[1:7]
with open(path) as f:
    lines = [l for l in f if l.startswith("{")]
if not lines:
    sys.exit(f"slow_network: {name} at {rate}, {layout}: no result in {path}")
r = json.loads(lines[-1])
r.update({"rate": rate, "layout": layout, "name": name, "link_bytes": int(link_bytes)})
print(json.dumps(r))
EOF
}

lockstep_train() {  # RATE LAYOUT HOSTS NP NAME FLAGS...
  local rate=$1 layout=$2 hosts=$3 np=$4 name=$5
  shift 5
  wanted "$name" || return 0
  local before file=$work/$name-$layout-$rate.json
  before=$(cluster_link_bytes node1)
  mpirun_hosts "$hosts" "$np" "$build/benchmarks/scaleout_benchmark" "${common[@]}" "$@" > "$file" 2> "$file.err" ||
    { cat "$file.err" >&2; echo "slow_network: $name failed" >&2; exit 1; }
  record "$rate" "$layout" "$name" "$before" "$file"
}

ddp_port=29500
ddp_train() {  # RATE LAYOUT PER_HOST NAME FLAGS...: PyTorch DDP, ranks started on each host
  local rate=$1 layout=$2 per_host=$3 name=$4
  shift 4
  wanted "$name" || return 0
  ddp_port=$((ddp_port + 1))  # a fresh rendezvous port per run
  local before file=$work/$name-$layout-$rate.json pids=() world=$((2 * per_host)) r h
  before=$(cluster_link_bytes node1)
  for h in 0 1; do
    for ((l = 0; l < per_host; l++)); do
      r=$((h * per_host + l))
      cluster_exec node$h timeout 600 env GLOO_SOCKET_IFNAME=eth0 "$python" "$source_dir/benchmarks/ddp_benchmark.py" \
        --ranks "$world" --rank "$r" --local-rank "$l" --init-method "tcp://10.99.0.1:$ddp_port" --model "$model" --batch-per-rank "$batch" \
        --steps "$steps" --rounds 2 --warmup-steps 3 --breakdown-steps 2 --threads 1 --bind none "$@" \
        > "$file.$r" 2> "$file.$r.err" &
      pids+=($!)
    done
  done
  local failed=""
  for r in "${!pids[@]}"; do
    if ! wait "${pids[$r]}"; then
      # PyTorch's failure is a result too: the row says what it printed.
      [[ -n $failed ]] || failed=$(grep -m1 -E "Error|error|what\(\)" "$file.$r.err" || tail -1 "$file.$r.err")
      for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
    fi
  done
  if [[ -n $failed ]]; then
    echo "slow_network: $name failed: $failed" >&2
    "$python" -c 'import json, sys; print(json.dumps(dict(zip(["rate", "layout", "name", "error"], sys.argv[1:]))))' \
      "$rate" "$layout" "$name" "$failed" >> "$results"
    return 0
  fi
  cp "$file.0" "$file"
  record "$rate" "$layout" "$name" "$before" "$file"
}

for rate in $rates; do
  cluster_limit node0 "$rate"
  cluster_limit node1 "$rate"
  echo "== $rate =="
  if has_layout 2x1 && wanted collectives; then
    # Bus bandwidth between the hosts, 2 x 1.
    before=$(cluster_link_bytes node1)
    mpirun_hosts node0:1,node1:1 2 "$build/benchmarks/scaleout_benchmark" --mode=collectives --sizes=16777216 \
      > "$work/coll-$rate.json" 2> "$work/coll-$rate.err" || { cat "$work/coll-$rate.err" >&2; exit 1; }
    record "$rate" 2x1 collectives "$before" "$work/coll-$rate.json"
  fi
  if has_layout 2x1; then
    for hook in none bf16 fp16 powersgd; do
      lockstep_train "$rate" 2x1 node0:1,node1:1 2 "lockstep-$hook" --comm_hook=$hook
    done
    ddp_train "$rate" 2x1 1 ddp-none --hook none
    ddp_train "$rate" 2x1 1 ddp-fp16 --hook fp16
    # DDP's PowerSGD hook aborts in Debian's gloo when several buckets are in flight
    # (gloo::EnforceNotMet ... op.preamble.length <= op.nbytes); with the whole
    # model in one bucket it runs.
    ddp_train "$rate" 2x1 1 ddp-powersgd --hook powersgd --bucket-mb 200
  fi
  if has_layout 2x2; then
    # Flat and hierarchical: uncompressed with the ranks placed in blocks and
    # cyclically (flat in host order, the default, and in launch order), then
    # with the 16-bit hooks and PowerSGD (which needs whole buckets, so flat);
    # DDP plain and with its hooks, ranks in blocks.
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-flat
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-hierarchical --hierarchical
    MAP_BY=node lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-flat-cyclic
    MAP_BY=node lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-flat-cyclic-rank-order --order_by_host=false
    MAP_BY=node lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-hierarchical-cyclic --hierarchical
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-flat-bf16 --comm_hook=bf16
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-hierarchical-bf16 --hierarchical --comm_hook=bf16
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-hierarchical-fp16 --hierarchical --comm_hook=fp16
    lockstep_train "$rate" 2x2 node0:2,node1:2 4 lockstep-flat-powersgd --comm_hook=powersgd
    ddp_train "$rate" 2x2 2 ddp-none --hook none
    ddp_train "$rate" 2x2 2 ddp-fp16 --hook fp16
    ddp_train "$rate" 2x2 2 ddp-powersgd --hook powersgd --bucket-mb 200
  fi
done

"$python" - "$results" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")
for rate in dict.fromkeys(r["rate"] for r in rows):
    bits = float(rate.replace("gbit", "e9").replace("mbit", "e6"))
    print(f"\n### {rate}\n")
    for r in rows:
        if r["rate"] == rate and r["name"] == "collectives":
            for row in r["allreduce"]:
                # 2 ranks: the bus bandwidth of an all-reduce is bytes / time.
                for key, label in (("mpi_s", "MPI_Allreduce"), ("lockstep_plain_s", "Lockstep (MPI backend)"),
                                   ("gloo_s", "Gloo")):
                    if key in row and row[key] > 0:
                        bus = row["bytes"] / row[key] * 8
                        print(f"- all-reduce of {row['bytes'] >> 20} MiB, {label}: bus bandwidth "
                              f"{bus / 1e9:.2f} Gbit/s = {bus / bits:.2f}x the link")
    print("\n| layout | run | step ms | no-comm step ms | efficiency | MB per step on node1's link |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["rate"] != rate or r["name"] == "collectives":
            continue
        if "error" in r:
            print(f"| {r['layout']} | {r['name']} | failed: {r['error'][:120]} | | | |")
            continue
        step = max(r["step_ms_median_per_rank"])
        nosync = max(r["nosync_step_ms_median_per_rank"])
        # Synchronised steps: warm-up and timed (nosync steps send nothing). The
        # start-up broadcast of the parameters (one model's worth) is taken off.
        sync_steps = len(r["step_ms"]) + 3
        per_step = max(0, r["link_bytes"] - r["gradient_bytes"]) / sync_steps
        print(f"| {r['layout']} | {r['name']} | {step:.0f} | {nosync:.0f} | {nosync / step:.2f} | "
              f"{per_step / 1e6:.0f} |")
EOF
