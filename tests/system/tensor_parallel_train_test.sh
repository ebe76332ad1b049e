#!/usr/bin/env bash
# lockstep_train on a data x model mesh, end to end, on the KJV:
#  1. A small GPT trains 8 steps on 1 process, on 4 ranks as 2x2 (data x model)
#     and on 2 ranks as 1x2; every train and test loss agrees to 1e-5 relative,
#     and the start-up table shows the split parameters at half their bytes.
#  2. The 2x2 run's checkpoint at step 4 resumes on 4 ranks as 4x1 and on 1
#     process: consolidated, what they load is bit-identical to what 2x2 saved,
#     and each continues to step 8 within 1e-5 of the 2x2 run (all but the
#     attention key bias, whose gradient is rounding noise: see
#     compare_consolidated.py).
#  3. Heads that the model axis does not divide: a config error naming the
#     parameter, exit 2, on every rank.
#  4. ZeRO-2 (partitioning.strategy sharded_gradients) over the data axis of the
#     2x2 mesh: losses as 1 process; its checkpoint (whole tensors) loads on 1
#     process bit for bit, and the replicated 2x2 checkpoint loads into it bit for
#     bit and continues to step 8 within 1e-5 of the replicated run.
# Skipped (exit 0, "SKIP") without the bible reader or Python PyTorch.
# Usage: tensor_parallel_train_test.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_CKPT MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
ckpt=$3
shift 3
mpirun=("$@")
python=/usr/bin/python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
if ! command -v bible > /dev/null; then echo "SKIP: no bible reader (apt-get install bible-kjv bible-kjv-text)"; exit 0; fi
"$python" -c 'import torch' 2>/dev/null || { echo "SKIP: no Python PyTorch (python3-torch) at $python"; exit 0; }
"$python" "$source_dir/data/prepare_kjv.py" "$work/kjv" > /dev/null || fail "data/prepare_kjv.py"

flags="model.num_layers=2,model.num_heads=4,model.width=32,model.context_length=32,data.token_dir=$work/kjv"
flags+=",data.global_batch_size=8,data.eval_batch_size=256,summary_every_steps=2,eval_every_steps=4"
flags+=",progress=lines,optimizer.learning_rate=0.003,max_grad_norm=0.5,checkpoint.every_steps=4"
config="--config=$source_dir/configs/kjv_gpt.textproto"
source "$source_dir/tests/system/checkpoint_helpers.sh"  # step_dir, consolidated
launch() {  # launch RANKS MESH_MODEL OUTPUT_DIR STEPS LOG [lockstep_train flags...]
  local ranks=$1 model=$2 dir=$3 steps=$4 log=$5
  shift 5
  local cmd=("$train" "$config"
             --set="$flags,partitioning.mesh.model=$model,num_train_steps=$steps,output_dir=$dir${extra:-}" "$@")
  if [[ $ranks -gt 1 ]]; then cmd=("${mpirun[@]}" -np "$ranks" "${cmd[@]}"); fi
  "${cmd[@]}" > "$log" 2>&1 || { cat "$log"; fail "$ranks rank(s), model axis $model, to step $steps (see above)"; }
}
source "$source_dir/tests/system/loss_helpers.sh"  # loss_lines, compare_losses
same_losses() {  # same_losses A.log B.log WHAT
  local result
  result=$(compare_losses "$1" "$2" 5 1e-5) || { cat "$2"; fail "$3 disagrees with 1 process: $result"; }
  echo "OK: $3: $result of 1 process"
}

# 1.
launch 1 1 "$work/one" 8 "$work/one.log"
launch 4 2 "$work/two_by_two" 8 "$work/two_by_two.log"
launch 2 2 "$work/one_by_two" 8 "$work/one_by_two.log"
same_losses "$work/one.log" "$work/two_by_two.log" "2x2"
same_losses "$work/one.log" "$work/one_by_two.log" "1x2"
grep -q "^Mesh 2x2 (data x model); parameter layouts:" "$work/two_by_two.log" || fail "no start-up table"
grep -q -E "^blocks.0.qkv.weight +\[96, 32\] -> \[48, 32\] split on heads over model +6144$" "$work/two_by_two.log" ||
  { cat "$work/two_by_two.log"; fail "the table does not show qkv split over the model axis"; }
grep -q -E "^Parameters per rank: .*; the split ones: [0-9]+ of [0-9]+ \(0\.500\)$" "$work/two_by_two.log" ||
  fail "the split parameters are not half their bytes per rank"

# 2.
saved=$(consolidated "$work/two_by_two" 4)
reference8=$(consolidated "$work/two_by_two" 8)
for case in "4 1 four_by_one" "1 1 alone"; do
  read -r ranks model name <<< "$case"
  dir="$work/$name"
  launch "$ranks" "$model" "$dir" 4 "$dir.log" --resume="$(step_dir "$work/two_by_two" 4)"
  grep -q "Resumed from $(step_dir "$work/two_by_two" 4): step 4, written by 4 rank(s)" "$dir.log" ||
    { cat "$dir.log"; fail "$name: did not resume"; }
  "$python" "$source_dir/tests/system/compare_consolidated.py" "$saved" "$(consolidated "$dir" 4)" ||
    fail "$name: what it loaded is not what 2x2 saved"
  launch "$ranks" "$model" "$dir" 8 "$dir.8.log"
  grep -q "Resumed from $(step_dir "$dir" 4)" "$dir.8.log" || fail "$name: did not resume its own checkpoint"
  # (The key bias's gradient is rounding noise that Adam amplifies: compare_consolidated.py says why.)
  "$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 --without-key-bias \
    "$(consolidated "$dir" 8)" "$reference8" ||
    fail "$name continued differently from 2x2"
  echo "OK: saved on 2x2, resumed as $name: bit-identical, and steps 5-8 within 1e-5"
done

# 4. (before 3, which ends the script's successes) ZeRO-2 over the data axis of
# the 2x2 mesh: the same losses as 1 process; its checkpoint holds whole tensors
# (replicated) that 1 process loads bit for bit; the replicated 2x2 checkpoint
# loads into it bit for bit and it continues as the replicated 2x2 run did.
extra=",partitioning.strategy=sharded_gradients"
launch 4 2 "$work/zero" 8 "$work/zero.log"
same_losses "$work/one.log" "$work/zero.log" "2x2 with sharded_gradients"
grep -q "sharded_gradients" "$work/zero.log" || { cat "$work/zero.log"; fail "the ZeRO run does not say its strategy"; }
zero4=$(consolidated "$work/zero" 4)
"$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 --without-key-bias "$zero4" "$saved" ||
  fail "2x2 with sharded_gradients saved other values than 2x2 replicated at step 4"
extra=""
launch 1 1 "$work/zero_alone" 4 "$work/zero_alone.log" --resume="$(step_dir "$work/zero" 4)"
"$python" "$source_dir/tests/system/compare_consolidated.py" "$zero4" "$(consolidated "$work/zero_alone" 4)" ||
  fail "1 process did not load what 2x2 with sharded_gradients saved"
extra=",partitioning.strategy=sharded_gradients"
launch 4 2 "$work/zero_resumed" 4 "$work/zero_resumed.log" --resume="$(step_dir "$work/two_by_two" 4)"
"$python" "$source_dir/tests/system/compare_consolidated.py" "$saved" "$(consolidated "$work/zero_resumed" 4)" ||
  fail "2x2 with sharded_gradients did not load what 2x2 replicated saved"
launch 4 2 "$work/zero_resumed" 8 "$work/zero_resumed.8.log"
"$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 --without-key-bias \
  "$(consolidated "$work/zero_resumed" 8)" "$reference8" || fail "2x2 with sharded_gradients continued differently"
extra=""
echo "OK: ZeRO-2 over the data axis of 2x2 trains as 1 process, saves whole tensors, loads a replicated checkpoint"

# 3.
set +e
"${mpirun[@]}" -np 3 "$train" "$config" --set="$flags,partitioning.mesh.model=3,num_train_steps=2,output_dir=$work/bad" \
  > "$work/bad.log" 2>&1
code=$?
set -e
[[ $code -ne 0 ]] || fail "a model axis of 3 for 4 heads was accepted"
grep -q "blocks.0.qkv.weight': 4 heads do not divide over the model axis of 3 ranks" "$work/bad.log" ||
  { cat "$work/bad.log"; fail "the error does not name the parameter"; }
grep -q "exited with status 2\|exit code: *2\|Exit code: *2" "$work/bad.log" || { cat "$work/bad.log"; fail "not exit 2"; }
echo "OK: tensor parallelism trains as 1 process and reshards across meshes"
