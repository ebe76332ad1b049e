#!/usr/bin/env bash
# Benchmarks are not tests, but they must keep working: runs the sharding
# benchmark in its quick mode (the small MLP, a few steps, at 1 and 2 ranks,
# every strategy, and PyTorch's ZeroRedundancyOptimizer when /usr/bin/python3
# has PyTorch) and checks that results.json has every number the full run
# reports. Nothing here depends on how fast anything ran.
#
#   tests/system/sharding_smoke_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

BUILD_DIR=$build_dir "$source_dir/benchmarks/sharding.sh" --quick --no-build --out "$out"

/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
r = json.load(open(os.path.join(sys.argv[1], "results.json")))
problems = []
def need(cond, what):
    if not cond:
        problems.append(what)
need(not r["errors"], f"errors: {r['errors']}")
strategies = r["settings"]["strategies"]
need({"replicated", "sharded_optimizer_state", "sharded_gradients"} <= set(strategies), f"strategies {strategies}")
keys = ["bytes_parameters", "bytes_gradients", "bytes_optimizer_state", "max_rss_mib", "step_ms",
        "bytes_parameters_ratio", "bytes_gradients_ratio", "bytes_optimizer_state_ratio", "step_time_ratio"]
rank_counts = [str(n) for n in r["settings"]["rank_counts"]]
need({"1", "2"} <= set(rank_counts), f"rank counts {rank_counts}")
for ranks in rank_counts:
    for s in strategies:
        e = r["ranks"].get(ranks, {}).get(s)
        need(e is not None, f"no {s} run on {ranks} rank(s)")
        if e is None:
            continue
        for k in keys:
            need(isinstance(e.get(k), (int, float)) and e[k] > 0, f"{s} on {ranks}: no positive '{k}'")
        need(len(e["bytes_optimizer_state_per_rank"]) == int(ranks), f"{s} on {ranks}: not every rank's bytes")
# The byte counts are exact, not timings: sharding the optimizer state on N ranks
# keeps about 1/N of it (units padded to a multiple of N).
for ranks in [n for n in rank_counts if n != "1"]:
    e = r["ranks"].get(ranks, {}).get("sharded_optimizer_state")
    if e:
        need(abs(e["bytes_optimizer_state_ratio"] * int(ranks) - 1) < 0.01,
             f"{ranks} ranks: optimizer state ratio {e['bytes_optimizer_state_ratio']}")
try:
    import torch.distributed  # noqa: F401
    z = r["ranks"].get("2", {}).get("torch_zero")
    need(z is not None and z.get("step_ms", 0) > 0 and z.get("bytes_optimizer_state", 0) > 0,
         "no ZeroRedundancyOptimizer run at 2 ranks")
    need(r["ranks"].get("2", {}).get("sharded_optimizer_state", {}).get("step_time_ratio_over_torch_zero"),
         "no ratio to ZeroRedundancyOptimizer")
except ImportError:
    pass
if problems:
    print("FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"OK: sharding results.json complete, strategies {','.join(strategies)}, quick run took {r['seconds']:.0f} s")
PY
