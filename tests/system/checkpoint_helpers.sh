# Shell helpers for the tests that resume and compare checkpoints; sourced, with
# $ckpt (lockstep_ckpt) set and a fail function defined by the caller.
#   step_dir OUTPUT_DIR STEP       the step directory of a run's checkpoint
#   consolidated OUTPUT_DIR STEP   `lockstep_ckpt consolidate`s it; prints the file
step_dir() { echo "$1/checkpoints/step_$(printf %08d "$2")"; }
consolidated() {
  "$ckpt" consolidate "$(step_dir "$1" "$2")" "$1/step_$2.pt" > /dev/null || fail "consolidate $1 step $2"
  echo "$1/step_$2.pt"
}
