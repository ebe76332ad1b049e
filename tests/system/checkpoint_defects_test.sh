#!/usr/bin/env bash
# Checkpoint defects a new user ran into, each checked end to end:
#  1. lockstep_ckpt verify: exit 0 only when everything it checked is valid; it
#     takes a checkpoints directory or one step directory; nothing to check is 1.
#  2. --resume=auto with checkpoints that are all damaged refuses to start over
#     (exit 1, naming each); --resume=none starts afresh and no damaged checkpoint
#     is deleted (a save to a damaged step moves it aside).
#  3. A model too large for memory is one line naming model.hidden_units and the
#     bytes, not libtorch's allocator text.
#  4. A full disk (a 6 MiB tmpfs, as root) during checkpoints, async and sync, on
#     2 ranks: every rank stops with a message naming the file and "No space left
#     on device", none aborts (134) or prints "terminate called"; with room again,
#     the next run's first save removes the unfinished .tmp_step_* it left.
# Usage: checkpoint_defects_test.sh LOCKSTEP_TRAIN LOCKSTEP_CKPT MPIRUN...
set -euo pipefail
train=$1
ckpt=$2
shift 2
mpirun=("$@")
work=$(mktemp -d)
mounted=""
cleanup() { [[ -n $mounted ]] && umount "$mounted" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
expect_exit() {  # expect_exit CODE LOG COMMAND...
  local want=$1 log=$2
  shift 2
  set +e
  "$@" > "$log" 2>&1
  local got=$?
  set -e
  [[ $got -eq $want ]] || { cat "$log"; fail "exit $got, expected $want: $*"; }
}
flip_byte() { printf '\xff' | dd of="$1" bs=1 seek=$(($(stat -c %s "$1") / 2)) conv=notrunc status=none; }

flags="data.source=SYNTHETIC,model.name=mlp,num_train_steps=30,eval_every_steps=10,summary_every_steps=10"
flags+=",checkpoint.every_steps=10,checkpoint.keep_last=2,progress=lines"

# 1. verify.
"$train" --set="$flags,output_dir=$work/a" > "$work/a.log" 2>&1 || { cat "$work/a.log"; fail "training run"; }
dir=$work/a/checkpoints
expect_exit 0 "$work/v1.log" "$ckpt" verify "$dir"
expect_exit 0 "$work/v2.log" "$ckpt" verify "$dir/step_00000030"
expect_exit 0 "$work/help.log" "$ckpt" --help
grep -q "exit codes" "$work/help.log" || fail "--help does not list the exit codes"
flip_byte "$dir/step_00000030/shard_00000.pt"
expect_exit 1 "$work/v3.log" "$ckpt" verify "$dir"
grep -q "INVALID .*step_00000030/shard_00000.pt.*corrupt" "$work/v3.log" || { cat "$work/v3.log"; fail "not named"; }
expect_exit 1 "$work/v4.log" "$ckpt" verify "$dir/step_00000030"
mkdir "$work/empty"
expect_exit 1 "$work/v5.log" "$ckpt" verify "$work/empty"
expect_exit 2 "$work/v6.log" "$ckpt" verify "$work/nonexistent"
echo "OK: lockstep_ckpt verify exits 0 when valid, 1 on a flipped byte (directory or step), 1 with nothing to check"

# 2. Every checkpoint damaged.
for step_dir in "$dir"/step_*; do flip_byte "$step_dir/shard_00000.pt"; done
names=$(cd "$dir" && ls -d step_*)
damaged=$(echo "$names" | wc -l)
expect_exit 1 "$work/r1.log" "$train" --set="$flags,output_dir=$work/a"
grep -q "no valid checkpoint in $dir, but $damaged damaged one(s)" "$work/r1.log" || { cat "$work/r1.log"; fail "refusal not clear"; }
grep -q "\-\-resume=none" "$work/r1.log" || fail "the refusal does not say how to start afresh"
grep -q "^Step " "$work/r1.log" && fail "trained although every checkpoint is damaged"
expect_exit 0 "$work/r2.log" "$train" --set="$flags,output_dir=$work/a" --resume=none
for name in $names; do  # each damaged one is set aside by the new save of its step, never deleted
  ls -d "$dir/$name.damaged."* > /dev/null 2>&1 || fail "damaged $name was deleted"
done
expect_exit 0 "$work/v7.log" "$ckpt" verify "$dir"
echo "OK: $damaged damaged checkpoints: --resume=auto refuses (exit 1, each named); --resume=none trains and deletes none"

# 3. Too large for memory.
expect_exit 1 "$work/oom.log" "$train" --set="data.source=SYNTHETIC,model.hidden_units=2000000000,output_dir=$work/oom"
grep -q "model.hidden_units=2000000000 .* GB" "$work/oom.log" || { cat "$work/oom.log"; fail "no clear line"; }
grep -q -i "DefaultCPUAllocator" "$work/oom.log" && fail "libtorch's allocator text"
echo "OK: model.hidden_units=2000000000: $(grep -o 'need [^,]*' "$work/oom.log")"

# 4. A full disk.
if [[ $(id -u) -ne 0 ]]; then echo "OK: (full disk: needs root for a tmpfs, not run)"; exit 0; fi
mkdir "$work/small"
mount -t tmpfs -o size=6m tmpfs "$work/small" 2>/dev/null || { echo "OK: (full disk: cannot mount a tmpfs here, not run)"; exit 0; }
mounted=$work/small
big="data.source=SYNTHETIC,model.name=cnn,num_train_steps=60,eval_every_steps=60,summary_every_steps=20"
big+=",checkpoint.every_steps=20,progress=lines"
for async in true false; do
  out=$work/small/run_$async
  set +e
  "${mpirun[@]}" -np 2 "$train" --set="$big,checkpoint.async=$async,output_dir=$out" > "$work/full_$async.log" 2>&1
  code=$?
  set -e
  [[ $code -ne 0 ]] || { cat "$work/full_$async.log"; fail "async=$async: a full disk exited 0"; }
  grep -q "No space left on device" "$work/full_$async.log" || { cat "$work/full_$async.log"; fail "async=$async: cause not named"; }
  grep -q "cannot write '.*$out/checkpoints/.tmp_step_00000020/shard_0000[01].pt'" "$work/full_$async.log" ||
    { cat "$work/full_$async.log"; fail "async=$async: file not named"; }
  if grep -q -E "terminate called|exit code: +134|signal 6|Aborted" "$work/full_$async.log"; then
    cat "$work/full_$async.log"; fail "async=$async: a rank aborted"
  fi
  rm -rf "$out/events.out.tfevents"* "$out"/*.jsonl  # room for the next case; the .tmp_step_* stays
done
ls -d "$work/small/run_false/checkpoints/.tmp_step_"* > /dev/null || fail "no unfinished save left to clean up"
mount -o remount,size=64m "$work/small"
"${mpirun[@]}" -np 2 "$train" --set="$big,output_dir=$work/small/run_false" > "$work/room.log" 2>&1 ||
  { cat "$work/room.log"; fail "with room again"; }
if ls -d "$work/small/run_false/checkpoints/.tmp_step_"* > /dev/null 2>&1; then fail "the unfinished save was not removed"; fi
echo "OK: a full disk (6 MiB tmpfs, 2 ranks, async and sync): exit $code, the shard and 'No space left on device' named, no abort; the next save removed the unfinished one"
