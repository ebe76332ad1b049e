#!/usr/bin/env bash
# A real 2-rank lockstep_train run writes TensorBoard events, metrics.jsonl and SVG
# plots on rank 0 only; an independent Python reader decodes the events (checksums
# verified) and finds every tag, step and value of metrics.jsonl. A second run with
# trace_steps writes each rank's Chrome trace of exactly those steps, with every
# phase and the gradient bucket's all-reduce inside each step, which
# tools/timeline_svg.py draws.
# Usage: tensorboard_events_test.sh SOURCE_DIR LOCKSTEP_TRAIN MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$@" -np 2 "$train" --set="data.source=SYNTHETIC,model.name=mlp,num_train_steps=40,eval_every_steps=20,summary_every_steps=10,data.global_batch_size=32,data.synthetic_train_examples=256,data.synthetic_eval_examples=64,output_dir=$work/run" > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
files=$(ls "$work/run" | sort | tr '\n' ' ')
case "$files" in
  "accuracy.svg checkpoints config.textproto events.out.tfevents."*" examples_per_second.svg learning_rate.svg loss.svg metrics.jsonl ") ;;
  *) echo "FAIL: unexpected files in the output dir (one set, rank 0's, expected): $files"; exit 1 ;;
esac
# Checkpoints are every rank's (one shard each); nothing else is.
shards=$(ls "$work/run/checkpoints/step_00000040" | sort | tr '\n' ' ')
case "$shards" in
  "manifest.pb shard_00000.pt shard_00001.pt ") ;;
  *) echo "FAIL: unexpected checkpoint files: $shards"; exit 1 ;;
esac
for plot in "$work"/run/*.svg; do
  /usr/bin/python3 -c 'import sys, xml.etree.ElementTree as ET; ET.parse(sys.argv[1])' "$plot" ||
    { echo "FAIL: $plot is not well-formed SVG"; exit 1; }
done

# The timeline: each rank's trace holds steps 2 and 4 only, and inside each the
# data wait, forward, backward, the bucket's all-reduce and the optimizer.
"$@" -np 2 "$train" --set="data.source=SYNTHETIC,model.name=mlp,num_train_steps=6,eval_every_steps=0,data.global_batch_size=32,data.synthetic_train_examples=256,data.synthetic_eval_examples=64,output_dir=$work/traced,trace_steps=2,trace_steps=4" > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
/usr/bin/python3 - "$work/traced/trace" <<'PY'
import json, os, sys
trace_dir = sys.argv[1]
files = sorted(os.listdir(trace_dir))
if files != ["rank_0.json", "rank_1.json"]:
    sys.exit(f"FAIL: trace files {files}, expected rank_0.json and rank_1.json")
for name in files:
    with open(os.path.join(trace_dir, name)) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    steps = sorted((e for e in spans if e["name"].startswith("step ")), key=lambda e: e["ts"])
    if [e["name"] for e in steps] != ["step 2", "step 4"]:
        sys.exit(f"FAIL: {name} traces {[e['name'] for e in steps]}, expected step 2 and step 4")
    for step in steps:
        inside = {e["name"] for e in spans
                  if e is not step and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]}
        for phase in ("data wait", "forward", "backward", "bucket 0 all-reduce", "norms and optimizer"):
            if phase not in inside:
                sys.exit(f"FAIL: {name}: no '{phase}' inside {step['name']} (found {sorted(inside)})")
print("trace OK:", ", ".join(files))
PY
# tools/timeline_svg.py draws a traced step of both ranks as well-formed SVG with
# the bucket's span, and refuses a step that was not traced.
/usr/bin/python3 "$source_dir/tools/timeline_svg.py" "$work"/traced/trace/rank_*.json --step 4 -o "$work/step4.svg"
/usr/bin/python3 -c 'import sys, xml.etree.ElementTree as ET; ET.parse(sys.argv[1])' "$work/step4.svg" ||
  { echo "FAIL: timeline_svg.py wrote malformed SVG"; exit 1; }
for want in "rank 0" "rank 1" "bucket 0 all-reduce"; do
  grep -q "$want" "$work/step4.svg" || { echo "FAIL: the drawn step has no '$want'"; exit 1; }
done
if /usr/bin/python3 "$source_dir/tools/timeline_svg.py" "$work"/traced/trace/rank_*.json --step 3 -o "$work/step3.svg" \
     2> "$work/svg.err"; then
  echo "FAIL: timeline_svg.py drew step 3, which was not traced"; exit 1
fi
grep -q "step 3 is not traced; traced: \[2, 4\]" "$work/svg.err" || { cat "$work/svg.err"; echo "FAIL: no clear message"; exit 1; }
# Last: its "OK: N scalars" line is what ctest looks for (PASS_REGULAR_EXPRESSION,
# which ignores the exit status), so every other check must come before it.
/usr/bin/python3 "$source_dir/tests/system/read_tensorboard_events.py" "$source_dir" "$work/run"
