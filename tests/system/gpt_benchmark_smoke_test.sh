#!/usr/bin/env bash
# Benchmarks are not tests, but they must keep working: runs the GPT benchmark in
# its quick mode (2 steps, 1 round, Lockstep at 1 and 2 ranks and, when
# /usr/bin/python3 has PyTorch, its plain loop and DDP) and checks that
# results.json has every number the full run reports. Nothing here depends on how
# fast anything ran.
#
#   tests/system/gpt_benchmark_smoke_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

BUILD_DIR=$build_dir "$source_dir/benchmarks/gpt.sh" --quick --no-build --out "$out"

/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
r = json.load(open(os.path.join(sys.argv[1], "results.json")))
problems = []
def need(cond, what):
    if not cond:
        problems.append(what)
need(not r["errors"], f"errors: {r['errors']}")
need(r["flops_per_token"] and r["flops_per_token"] > 1e6, f"flops per token {r['flops_per_token']}")
runs = {(e["framework"], e["ranks"]): e for e in r["runs"]}
wanted = [("lockstep", 1), ("lockstep", 2)]
try:
    import torch.distributed  # noqa: F401
    wanted += [("torch_plain", 1), ("ddp", 2)]
except ImportError:
    pass
for key in wanted:
    e = runs.get(key)
    need(e is not None, f"no {key} run")
    if e is None:
        continue
    for k in ["step_ms", "tokens_per_second", "tokens_per_second_per_rank", "mfu", "peak_rss_mib"]:
        need(isinstance(e.get(k), (int, float)) and e[k] > 0, f"{key}: no positive '{k}'")
    need(e.get("mfu") is None or e["mfu"] < 1.5, f"{key}: MFU {e.get('mfu')} is not a fraction of a peak")
need(len({e["parameters"] for e in r["runs"]}) == 1, "the frameworks' models differ")
if ("torch_plain", 1) in wanted:
    need(runs.get(("lockstep", 1), {}).get("step_time_over_torch"), "no ratio to PyTorch's plain loop")
    need(runs.get(("lockstep", 2), {}).get("step_time_over_torch"), "no ratio to DDP")
if problems:
    print("FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"OK: GPT benchmark results.json complete ({len(r['runs'])} runs), quick run took {r['seconds']:.0f} s")
PY
