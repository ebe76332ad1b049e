#!/usr/bin/env bash
# Benchmarks are not tests, but they must keep working: runs the scale-out suite
# in its quick mode (a few steps of every model, at 1 and 2 ranks, Lockstep and,
# when /usr/bin/python3 has PyTorch, DDP) and checks that results.json has every
# number the full run reports and that the plots were written.
#
#   tests/system/scaleout_smoke_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

BUILD_DIR=$build_dir "$source_dir/benchmarks/scaleout.sh" --quick --no-build --out "$out" --ranks 1,2

/usr/bin/python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
r = json.load(open(os.path.join(out, "results.json")))
problems = []
def need(cond, what):
    if not cond:
        problems.append(what)
need(not r["errors"], f"errors: {r['errors']}")
try:
    import torch.distributed  # noqa: F401
    frameworks = ["lockstep", "ddp"]
except ImportError:
    frameworks = ["lockstep"]
entry_keys = ["step_ms", "examples_per_s", "efficiency", "comm_share", "max_rss_mib", "max_rss_mib_per_rank",
              "forward_ms", "backward_ms", "optimizer_ms"]
for model in ["small_mlp", "wide_mlp", "cnn"]:
    m = r["models"].get(model)
    need(m is not None, f"no results for {model}")
    if m is None:
        continue
    for fw in frameworks:
        for ranks in ["1", "2"]:
            e = m.get(fw, {}).get(ranks)
            need(e is not None, f"{model}: no {fw} run on {ranks} rank(s)")
            if e is None:
                continue
            for k in entry_keys:
                need(isinstance(e.get(k), (int, float, list)), f"{model} {fw} {ranks}: no '{k}'")
            need(e["step_ms"] > 0 and e["examples_per_s"] > 0, f"{model} {fw} {ranks}: non-positive timing")
            need(0 <= e["comm_share"] <= 1, f"{model} {fw} {ranks}: comm_share {e['comm_share']}")
            need(len(e["max_rss_mib_per_rank"]) == int(ranks), f"{model} {fw} {ranks}: RSS of every rank")
            if ranks == "2":
                need(e.get("nosync_step_ms", 0) > 0, f"{model} {fw} 2: no nosync step time")
    need(m["lockstep"]["2"].get("comm_wait_share") is not None, f"{model}: no measured comm wait")
    if "ddp" in frameworks:
        need("2" in m.get("step_time_ratio_lockstep_over_ddp", {}), f"{model}: no Lockstep/DDP ratio")
rows = r["collectives"].get("2", [])
need(len(rows) >= 3, "no all-reduce table on 2 ranks")
for row in rows:
    for k in ["bytes", "lockstep_s", "mpi_s", "lockstep_busbw_gbps", "mpi_busbw_gbps", "lockstep_algbw_gbps"]:
        need(k in row, f"all-reduce row without '{k}'")
c = r["cost_model"]
need(c is not None and c["alpha_us"] > 0 and c["bus_bandwidth_gbps"] > 0, "no fitted cost model")
for model in ["small_mlp", "wide_mlp", "cnn"]:
    ch = (c or {}).get("check", {}).get(model, {})
    need(ch.get("predicted_step_ms", 0) > 0 and ch.get("measured_step_ms", 0) > 0, f"{model}: no model check")
    curve = r["projection"]["models"].get(model, [])
    need(len(curve) >= 2 and all(0 < p["efficiency"] <= 1.0001 for p in curve), f"{model}: bad projection {curve}")
if "ddp" in frameworks:
    need(set(r["targets"].get("ddp", {})) == {"small_mlp", "wide_mlp", "cnn"}, "targets not evaluated")
for name in r["plots"]:
    text = open(os.path.join(out, name)).read()
    need(text.startswith("<svg") and text.rstrip().endswith("</svg>"), f"{name} is not an SVG")
need({"scaling_efficiency.svg", "breakdown_cnn.svg", "allreduce_2ranks.svg", "projection.svg"} <= set(r["plots"]),
     f"plots missing: {r['plots']}")
if problems:
    print("FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"OK: results.json complete, {len(r['plots'])} plots, quick run took {r['seconds']:.0f} s")
PY
