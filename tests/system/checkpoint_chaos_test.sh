#!/usr/bin/env bash
# INJECTIONS (default 20) random SIGTERM and SIGKILL injections into a 2-rank
# training job that checkpoints every few steps (so many land during a save):
# after each one, "latest" names a valid checkpoint (lockstep_ckpt verify), a
# SIGTERM ends with exit 75 and an emergency checkpoint, and the job is started
# again with --resume=auto. Once the injections are done the job runs to the end,
# and its final state must be bitwise equal to an uninterrupted run's.
# Usage: checkpoint_chaos_test.sh SOURCE_DIR LOCKSTEP_TRAIN LOCKSTEP_CKPT MPIRUN...
set -euo pipefail
source_dir=$1
train=$2
ckpt=$3
shift 3
mpirun=("$@")
injections=${INJECTIONS:-20}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

total=300
flags="data.source=SYNTHETIC,model.name=mlp,model.hidden_units=512,data.global_batch_size=256"
flags+=",eval_every_steps=100,summary_every_steps=10,progress=lines,checkpoint.every_steps=4,checkpoint.keep_last=2"
flags+=",num_train_steps=$total,coordination.heartbeat_timeout_seconds=3"

"${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$work/straight" > "$work/straight.log" 2>&1 ||
  { cat "$work/straight.log"; fail "uninterrupted run"; }

dir="$work/chaos"
terms=0 kills=0 runs=0
for i in $(seq 1 "$injections"); do
  runs=$((runs + 1))
  "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir" > "$work/run$i.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 400); do
    grep -q -E '^(Step|Resumed)' "$work/run$i.log" 2>/dev/null && break
    kill -0 $launcher 2>/dev/null || break
    sleep 0.05
  done
  sleep "0.$((RANDOM % 10))$((RANDOM % 10))"
  pids=($(pgrep -P $launcher -f lockstep_train || true))
  signal=TERM
  ((RANDOM % 2)) && signal=KILL
  if [[ ${#pids[@]} -eq 2 ]]; then
    kill -s $signal "${pids[$((RANDOM % 2))]}" 2>/dev/null || true
  else
    signal=none  # it finished before the injection
  fi
  set +e
  wait $launcher
  code=$?
  set -e
  for p in "${pids[@]}"; do  # mpirun may return while its ranks are still being reaped
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then kill -9 "$p"; fail "rank pid $p left behind 10 s after injection $i"; fi
  done
  "$ckpt" verify "$dir/checkpoints" > "$work/verify$i.log" 2>&1 ||
    { cat "$work/verify$i.log" "$work/run$i.log"; fail "injection $i (SIG$signal): latest checkpoint is not valid"; }
  case $signal in
    TERM)
      terms=$((terms + 1))
      [[ $code -eq 75 || $code -eq 0 ]] || { cat "$work/run$i.log"; fail "SIGTERM: exit $code, expected 75"; } ;;
    KILL)
      kills=$((kills + 1))
      [[ $code -ne 0 ]] || fail "SIGKILL: exit 0" ;;
  esac
  echo "injection $i: SIG$signal, exit $code, $(tail -1 "$work/verify$i.log")"
  grep -q "^Done: $total steps" "$work/run$i.log" && break
done
# Run to the end.
for _ in 1 2 3; do
  grep -q "^Done: $total steps" "$work"/run*.log 2>/dev/null && break
  runs=$((runs + 1))
  "${mpirun[@]}" -np 2 "$train" --set="$flags,output_dir=$dir" > "$work/final$runs.log" 2>&1 ||
    { cat "$work/final$runs.log"; fail "final run"; }
  cp "$work/final$runs.log" "$work/run_final$runs.log"
  grep -q "^Done: $total steps" "$work/final$runs.log" && break
done
step_dir=$(printf 'step_%08d' $total)
/usr/bin/python3 "$source_dir/tests/system/compare_checkpoints.py" "$work/straight/checkpoints/$step_dir" \
  "$dir/checkpoints/$step_dir" || fail "final state differs from the uninterrupted run"
echo "OK: $terms SIGTERM and $kills SIGKILL injections over $runs starts; latest always valid; final state bit-identical"
