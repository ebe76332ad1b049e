#!/usr/bin/env bash
# Checkpoints that reshard, through lockstep_train under mpirun (synthetic data,
# an MLP whose parameter counts do not divide by 3 or 4, Adam, small units):
#  1. 4 ranks under STRATEGY_4 train 4 steps and save; `lockstep_ckpt consolidate`
#     writes it as one file.
#  2. Resumed from it (--resume=PATH) on 3 ranks (sharded optimizer state), 2
#     (replicated) and 1 process, each saves the same step in its own directory:
#     consolidated, parameters, optimizer state, step and data position are
#     bit-identical to what the 4 ranks saved.
#  3. Each continues to step 8 and agrees with the 4 ranks' own continuation
#     within 1e-5 relative (sums over other numbers of ranks round differently).
#  4. SIGTERM to a random rank of a 3-rank job under STRATEGY_3 at a random step s:
#     exit 75 with an emergency checkpoint, bit-identical (consolidated) to a
#     straight 3-rank run to step s; it resumes on 2 ranks and finishes. (Not
#     compared with a straight 2-rank run at the end: over hundreds of Adam steps
#     the rounding of 2 against 3 ranks grows to percents, as it does between
#     straight runs on 1, 2 and 3 ranks.)
# Usage: reshard_test.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_CKPT MPIRUN...
# Environment: STRATEGY_4, STRATEGY_3 (default fully_sharded).
set -euo pipefail
source_dir=$1
train=$2
ckpt=$3
shift 3
mpirun=("$@")
python=/usr/bin/python3
strategy4=${STRATEGY_4:-fully_sharded}
strategy3=${STRATEGY_3:-fully_sharded}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
"$python" -c 'import torch' 2>/dev/null || { echo "SKIP: no Python PyTorch (python3-torch) at $python"; exit 0; }

flags="data.source=SYNTHETIC,model.name=mlp,model.hidden_units=37,data.global_batch_size=24,optimizer.kind=ADAM"
flags+=",eval_every_steps=0,summary_every_steps=2,progress=lines,bucket_mb=0.02,num_microbatches=2,max_grad_norm=0.5"
source "$source_dir/tests/system/checkpoint_helpers.sh"  # step_dir, consolidated
launch() {  # launch RANKS STRATEGY OUTPUT_DIR STEPS LOG [lockstep_train flags...]
  local ranks=$1 strategy=$2 dir=$3 steps=$4 log=$5
  shift 5
  local cmd=("$train" --set="$flags,partitioning.strategy=$strategy,num_train_steps=$steps,output_dir=$dir" "$@")
  if [[ $ranks -gt 1 ]]; then cmd=("${mpirun[@]}" -np "$ranks" "${cmd[@]}"); fi
  "${cmd[@]}" > "$log" 2>&1 || { cat "$log"; fail "$ranks rank(s) $strategy to step $steps (see above)"; }
}

# 1.
launch 4 "$strategy4" "$work/four" 4 "$work/four.log"
saved=$(consolidated "$work/four" 4)
# Each rank saved only its pieces: rank 1's shard holds part of the first layer.
"$python" - "$(step_dir "$work/four" 4)/shard_00001.pt" <<'PY' || fail "rank 1's shard is not a quarter of the model"
import sys, torch
shard = torch.load(sys.argv[1])
w = shard["model/layers.1.weight"]
assert w.dim() == 1 and 0 < w.numel() < 37 * 784, (w.shape,)
PY
# 2. and 3.
launch 4 "$strategy4" "$work/four" 8 "$work/four8.log"
reference8=$(consolidated "$work/four" 8)
for case in "3 sharded_optimizer_state" "2 replicated" "1 replicated"; do
  read -r ranks strategy <<< "$case"
  dir="$work/on$ranks"
  launch "$ranks" "$strategy" "$dir" 4 "$dir.log" --resume="$(step_dir "$work/four" 4)"
  grep -q "Resumed from $(step_dir "$work/four" 4): step 4, written by 4 rank(s)" "$dir.log" || { cat "$dir.log"; fail "$ranks: did not resume"; }
  "$python" "$source_dir/tests/system/compare_consolidated.py" "$saved" "$(consolidated "$dir" 4)" \
    || fail "resharded onto $ranks rank(s) ($strategy): not what 4 ranks saved"
  launch "$ranks" "$strategy" "$dir" 8 "$dir.8.log"
  grep -q "Resumed from $(step_dir "$dir" 4)" "$dir.8.log" || fail "$ranks: did not resume its own checkpoint"
  "$python" "$source_dir/tests/system/compare_consolidated.py" --rtol 1e-5 "$(consolidated "$dir" 8)" "$reference8" \
    || fail "$ranks rank(s) ($strategy) continued differently from 4 ranks"
  echo "OK: saved on 4 ($strategy4), resumed on $ranks ($strategy): bit-identical, and steps 5-8 within 1e-5"
done

# 4.
total=300
flags="${flags/model.hidden_units=37/model.hidden_units=1500}"  # steps long enough to be interrupted
dir="$work/preempted"
"${mpirun[@]}" -np 3 "$train" --set="$flags,partitioning.strategy=$strategy3,num_train_steps=$total,output_dir=$dir" \
  > "$dir.1.log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do grep -q '^Step .*train loss' "$dir.1.log" 2>/dev/null && break; sleep 0.05; done
sleep "0.$((RANDOM % 10))"
pids=($(pgrep -P $launcher -f lockstep_train || true))
[[ ${#pids[@]} -eq 3 ]] || fail "expected 3 ranks under mpirun, found ${#pids[*]}"
kill -s TERM "${pids[$((RANDOM % 3))]}"
set +e
wait $launcher
code=$?
set -e
[[ $code -eq 75 ]] || { cat "$dir.1.log"; fail "SIGTERM: exit $code, expected 75 (did it finish first?)"; }
step=$(sed -n 's/.*emergency checkpoint .*step_0*\([0-9]*\);.*/\1/p' "$dir.1.log")
[[ -n $step ]] || { cat "$dir.1.log"; fail "no emergency checkpoint line"; }
launch 3 "$strategy3" "$work/straight" "$step" "$work/straight.log"
"$python" "$source_dir/tests/system/compare_consolidated.py" "$(consolidated "$dir" "$step")" \
  "$(consolidated "$work/straight" "$step")" || fail "the emergency checkpoint is not the state of a straight run"
launch 2 fully_sharded "$dir" $total "$dir.2.log"
grep -q "Resumed from $(step_dir "$dir" "$step"): step $step, written by 3 rank(s)" "$dir.2.log" \
  || { cat "$dir.2.log"; fail "did not resume the emergency checkpoint on 2 ranks"; }
grep -q "^Done: $total steps" "$dir.2.log" || { cat "$dir.2.log"; fail "the resumed run did not finish"; }
echo "OK: SIGTERM to a 3-rank $strategy3 job at step $step (its checkpoint bit-identical to a straight run's), resumed on 2 ranks and finished"
