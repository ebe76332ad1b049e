# Shell helpers for the tests that compare the loss summaries of two runs; sourced.
#   loss_lines LOG [METRICS]
#                      the "Step N: train|test loss | x" lines of a run's log, spaces
#                      squeezed; METRICS, an extended regex, picks others ("loss|bits_per_byte")
#   compare_losses A.log B.log MIN_LINES TOLERANCE [METRICS]
#                      the same summaries in both, at least MIN_LINES of them, each value
#                      of B within TOLERANCE relative of A's. Prints "N loss lines within W
#                      relative" and returns 0, or prints what differs and returns 1.
loss_lines() { grep -E "^Step +[0-9]+: (train|test) (${2:-loss}) " "$1" | sed -E 's/ +/ /g'; }
compare_losses() {
  paste -d'|' <(loss_lines "$1" "${5:-loss}") <(loss_lines "$2" "${5:-loss}") | awk -F'|' -v min="$3" -v tol="$4" '
    $1 == "" || $3 == "" { print "the runs printed different numbers of loss lines"; bad = 1; exit 1 }
    $1 != $3 { print "line " NR ": " $1 "against " $3; bad = 1; next }
    { x = $2 + 0; y = $4 + 0; d = x - y; if (d < 0) d = -d; s = x < 0 ? -x : x;
      r = s > 0 ? d / s : d;
      if (r > tol) { printf "%s: %.8f against %.8f\n", $1, y, x; bad = 1 }
      if (r > worst) worst = r }
    END { if (bad) exit 1
          if (NR < min) { printf "%d loss lines, fewer than %d\n", NR, min; exit 1 }
          printf "%d loss lines within %.2g relative", NR, worst }'
}
