#!/usr/bin/env bash
# A real 2-rank lockstep_train run writes TensorBoard events, metrics.jsonl and SVG
# plots on rank 0 only; an independent Python reader decodes the events (checksums
# verified) and finds every tag, step and value of metrics.jsonl.
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
/usr/bin/python3 "$source_dir/tests/system/read_tensorboard_events.py" "$source_dir" "$work/run"
