#!/usr/bin/env bash
# The language-model job end to end: the KJV prepared by data/prepare_kjv.py (from
# Debian's bible reader), a small GPT trained by lockstep_train on 1 process and on
# 2 ranks under mpirun with the same global batch: every train and test loss agrees
# to 1e-5 relative, the language-model metrics are there, and the loss falls;
# lockstep_sample loads the 2-rank run's checkpoint and prints the same text for
# the same seed, and refuses a run that is not a GPT.
# Skipped (exit 0, "SKIP") when the bible reader is missing.
# Usage: language_model_test.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_SAMPLE MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
sample=$3
shift 3
mpirun=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

if ! command -v bible > /dev/null; then echo "SKIP: no bible reader (apt-get install bible-kjv bible-kjv-text)"; exit 0; fi
/usr/bin/python3 "$source_dir/data/prepare_kjv.py" "$work/kjv" || fail "data/prepare_kjv.py"

flags="model.num_layers=2,model.num_heads=2,model.width=32,model.context_length=32,data.token_dir=$work/kjv"
flags+=",data.global_batch_size=8,data.eval_batch_size=256,num_train_steps=40,summary_every_steps=10"
flags+=",eval_every_steps=20,num_microbatches=2,progress=lines,optimizer.learning_rate=0.003"
config="--config=$source_dir/configs/kjv_gpt.textproto"

"$train" "$config" --set="$flags,output_dir=$work/one" > "$work/one.log" 2>&1 || { cat "$work/one.log"; fail "1 process"; }
"${mpirun[@]}" -np 2 "$train" "$config" --set="$flags,output_dir=$work/two" > "$work/two.log" 2>&1 ||
  { cat "$work/two.log"; fail "2 ranks"; }

# "Step N: train|test loss|bits_per_byte" lines of both runs, compared to 1e-5 relative.
source "$source_dir/tests/system/loss_helpers.sh"  # loss_lines, compare_losses
result=$(compare_losses "$work/one.log" "$work/two.log" 12 1e-5 "loss|bits_per_byte") ||
  { cat "$work/two.log"; fail "2 ranks and 1 process disagree: $result"; }
echo "OK: 2 ranks against 1 process: $result"

for metric in bits_per_byte tokens_per_second tokens_per_second_per_rank mfu data_wait_fraction; do
  grep -q -E "^Step +20: train $metric \| [0-9.]+$" "$work/two.log" || { cat "$work/two.log"; fail "no train $metric"; }
done
grep -q "2 rank(s) via mpirun" "$work/two.log" || fail "no 2-rank banner"
first=$(grep -E '^Step +10: train loss ' "$work/one.log" | awk -F'|' '{print $2}')
last=$(grep -E '^Step +40: test loss ' "$work/one.log" | awk -F'|' '{print $2}')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' || fail "the loss did not fall: $first -> $last"
grep -q "Done: 40 steps" "$work/two.log" || fail "no Done line"
echo "OK: test loss $first -> $last; metrics present"

# The sampler: the same seed, the same text, which continues the prompt.
"$sample" --run="$work/two" --prompt="And God said" --tokens=60 --seed=3 > "$work/sample1.txt" 2> "$work/sample.err" ||
  { cat "$work/sample.err"; fail "lockstep_sample"; }
"$sample" --run="$work/two" --prompt="And God said" --tokens=60 --seed=3 > "$work/sample2.txt" 2>> "$work/sample.err"
cmp -s "$work/sample1.txt" "$work/sample2.txt" || fail "the same seed gave different text"
head -c 12 "$work/sample1.txt" | grep -q "^And God said$" || fail "the sample does not start with the prompt"
[[ $(wc -c < "$work/sample1.txt") -eq 73 ]] || fail "expected 12 + 60 bytes and a newline, got $(wc -c < "$work/sample1.txt")"
grep -q "step_00000040 (step 40, written by 2 rank(s))" "$work/sample.err" || { cat "$work/sample.err"; fail "not the last checkpoint"; }
"$sample" --run="$work/two" --prompt="And God said" --tokens=60 --seed=4 > "$work/sample3.txt" 2>/dev/null
cmp -s "$work/sample1.txt" "$work/sample3.txt" && fail "another seed gave the same text"
# A later start with other settings rewrites config.textproto; the sampler builds
# the model the checkpoint's manifest records.
sed -i -E 's/^num_train_steps: .*/num_train_steps: 99/; s/^  decay_steps: .*/  decay_steps: 77/' "$work/two/config.textproto"
"$sample" --run="$work/two" --prompt="And God said" --tokens=60 --seed=3 > "$work/sample4.txt" 2>> "$work/sample.err" ||
  { cat "$work/sample.err"; fail "lockstep_sample after config.textproto changed"; }
cmp -s "$work/sample1.txt" "$work/sample4.txt" || fail "the sample changed with config.textproto"
"$train" --set="data.source=SYNTHETIC,model.name=mlp,num_train_steps=2,output_dir=$work/mlp" > /dev/null 2>&1
set +e
"$sample" --run="$work/mlp" > /dev/null 2> "$work/mlp.err"
status=$?
set -e
[[ $status -eq 2 ]] && grep -q "not gpt" "$work/mlp.err" || { cat "$work/mlp.err"; fail "an MLP run: exit $status"; }
echo "OK: lockstep_sample: $(tr '\n' ' ' < "$work/sample1.txt")"

# A global batch of more windows than the train tokens hold is refused by name.
set +e
"$train" "$config" --set="$flags,data.global_batch_size=2147483647,output_dir=$work/huge" > "$work/huge.log" 2>&1
status=$?
set -e
[[ $status -eq 1 ]] && grep -q -E "data.global_batch_size=2147483647 is larger than the train set, which holds [0-9]+ windows of 32 tokens" "$work/huge.log" ||
  { cat "$work/huge.log"; fail "a global batch larger than the train windows: exit $status"; }
echo "OK: $(grep -o 'data.global_batch_size=2147483647.*' "$work/huge.log")"
