#!/usr/bin/env bash
# The installed package, end to end: installs a Lockstep build into a fresh prefix,
# builds examples/sharded_embedding from a copy outside the source tree against
# that prefix alone, and runs it on 2 ranks under mpirun and on 1 process.
#
#   tests/system/example_project_test.sh SOURCE_DIR BINARY_DIR [MPIEXEC]
#
# Checks:
#   - no installed file names the source or build tree (debug info aside), and the
#     exported targets carry no warning flags and no precompiled-header target;
#   - the example's build files name neither tree either;
#   - the 2-rank run's sharded model matches the unsharded one trained alongside
#     (--check), its train and test losses match the 1-process run's within
#     $TOLERANCE, and the train loss falls.
# Prints "OK: ..." with what it checked and how long each part took.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 SOURCE_DIR BINARY_DIR [MPIEXEC]" >&2
  exit 2
fi
src_dir=$(cd "$1" && pwd -P)
bin_dir=$(cd "$2" && pwd -P)
mpiexec=${3:-mpirun}
TOLERANCE=${TOLERANCE:-1e-4}
steps=200

tmp=$(mktemp -d "${TMPDIR:-/tmp}/lockstep_example.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# 1. Install.
t=$(now)
cmake --install "$bin_dir" --prefix "$tmp/prefix" > "$tmp/install.log" || { cat "$tmp/install.log" >&2; fail "cmake --install"; }
install_s=$(elapsed "$t")
num_files=$(find "$tmp/prefix" -type f | wc -l)
for f in lib/cmake/Lockstep/LockstepConfig.cmake lib/cmake/Lockstep/LockstepConfigVersion.cmake \
         lib/cmake/Lockstep/LockstepTargets.cmake include/lockstep/trainer.h include/proto/config.pb.h \
         bin/lockstep_train bin/lockstep_coordinator bin/lockstep_ckpt share/lockstep/launch/mpirun.sh; do
  [[ -e "$tmp/prefix/$f" ]] || fail "not installed: $f"
done

# 2. No path into the trees. Binaries and archives are checked without their debug
# sections (which name the sources on purpose); everything else as it is.
leaks=()
while IFS= read -r -d '' f; do
  probe=$f
  case "$(head -c 7 "$f" | tr -d '\000')" in
    $'\x7fELF'* | '!<arch>'*)
      probe="$tmp/stripped"
      cp "$f" "$probe"
      strip --strip-debug "$probe" 2>/dev/null || true ;;
  esac
  if grep -q -F -e "$src_dir" -e "$bin_dir" "$probe"; then leaks+=("${f#"$tmp/prefix/"}"); fi
done < <(find "$tmp/prefix" -type f -print0)
rm -f "$tmp/stripped"
if [[ ${#leaks[@]} -gt 0 ]]; then
  for f in "${leaks[@]}"; do
    echo "  $f:" >&2
    strings "$tmp/prefix/$f" | grep -F -e "$src_dir" -e "$bin_dir" | sort -u | head -5 | sed 's/^/    /' >&2
  done
  fail "${#leaks[@]} installed file(s) name $src_dir or $bin_dir"
fi
if grep -n -E -e '-Werror|lockstep_pch|lockstep_warnings|PRECOMPILE' "$tmp/prefix"/lib/cmake/Lockstep/*.cmake; then
  fail "the exported package carries build-only flags or targets"
fi

# 3. Build the example from a copy, against the prefix alone.
cp -r "$src_dir/examples/sharded_embedding" "$tmp/src"
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
t=$(now)
cmake -S "$tmp/src" -B "$tmp/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF > "$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log" >&2; fail "configuring the example against the installed package"; }
configure_s=$(elapsed "$t")
grep -q "Lockstep_DIR:PATH=$tmp/prefix/" "$tmp/build/CMakeCache.txt" ||
  fail "find_package(Lockstep) did not use the installed package: $(grep Lockstep_DIR "$tmp/build/CMakeCache.txt")"
t=$(now)
cmake --build "$tmp/build" -j "$(nproc)" > "$tmp/build.log" 2>&1 || { tail -50 "$tmp/build.log" >&2; fail "building the example"; }
build_s=$(elapsed "$t")
if grep -r -l -F -e "$src_dir" -e "$bin_dir" "$tmp/build" --include='*.ninja' --include='Makefile' --include='*.make' \
     --include='*.txt' --include='*.cmake' > "$tmp/refs"; then
  fail "the example's build refers to the Lockstep trees: $(tr '\n' ' ' < "$tmp/refs")"
fi
program=$tmp/build/sharded_embedding

# 4. Run: 2 ranks under mpirun, then 1 process, same seed; both check themselves
# against the unsharded model.
flags=(--steps=$steps --summary_every_steps=20 --check --check_tolerance="$TOLERANCE")
mpi_flags=(-np 2)
[[ $(id -u) -eq 0 ]] && mpi_flags+=(--allow-run-as-root)
mpi_flags+=(--oversubscribe)
cd "$tmp"
t=$(now)
"$mpiexec" "${mpi_flags[@]}" "$program" "${flags[@]}" > "$tmp/np2.log" 2>&1 || { cat "$tmp/np2.log" >&2; fail "the 2-rank run"; }
np2_s=$(elapsed "$t")
t=$(now)
"$program" "${flags[@]}" > "$tmp/np1.log" 2>&1 || { cat "$tmp/np1.log" >&2; fail "the 1-process run"; }
np1_s=$(elapsed "$t")
grep -q "^sharded_embedding: 2 rank(s) (mpirun, mpi backend)" "$tmp/np2.log" || { cat "$tmp/np2.log" >&2; fail "the 2-rank run did not run on 2 MPI ranks"; }
grep -q "^sharded_embedding: 1 rank(s)" "$tmp/np1.log" || fail "the 1-process run did not run on 1 rank"
for log in np2 np1; do
  grep -q "^Check against the unsharded model over $steps steps: .*: PASS$" "$tmp/$log.log" ||
    { cat "$tmp/$log.log" >&2; fail "$log: the sharded model does not match the unsharded one"; }
done

# Losses: same summaries, same values within TOLERANCE; the train loss falls.
extract() { grep -E '^Step +[0-9]+: (train|test) loss \|' "$1" | sed -E 's/^Step +([0-9]+): ([a-z]+) loss \| /\1 \2 /'; }
extract "$tmp/np2.log" > "$tmp/np2.loss"
extract "$tmp/np1.log" > "$tmp/np1.loss"
num_losses=$(wc -l < "$tmp/np1.loss")
[[ $num_losses -eq $((steps / 20 + 1)) ]] || fail "expected $((steps / 20 + 1)) loss summaries at 1 rank, got $num_losses"
comparison=$(paste -d ' ' "$tmp/np1.loss" "$tmp/np2.loss" | awk -v tol="$TOLERANCE" '
  NF != 6 || $1 != $4 || $2 != $5 { print "mismatched summaries: " $0; bad = 1; next }
  { d = $3 - $6; if (d < 0) d = -d; if (d > max) max = d; if (d > tol) { print "step " $1 " " $2 " loss " $3 " (1 rank) vs " $6 " (2 ranks)"; bad = 1 } }
  $2 == "train" { if (first == "") first = $3; last = $3 }
  END { if (NR == 0) { print "no losses"; bad = 1 }
        if (!bad && !(last < 0.8 * first)) { print "train loss did not fall: " first " -> " last; bad = 1 }
        if (!bad) printf "max |loss diff| %.2g, train loss %s -> %s", max, first, last; exit bad }') ||
  { echo "$comparison" >&2; fail "2 ranks do not match 1 process"; }
[[ $(wc -l < "$tmp/np2.loss") -eq $num_losses ]] || fail "the runs printed different numbers of summaries"
check2=$(grep '^Check against' "$tmp/np2.log" | sed -E 's/.*steps: (.*) \(tolerance.*/\1/')
test_acc=$(grep -E '^Done:' "$tmp/np2.log" | sed -E 's/.*test accuracy ([0-9.]+).*/\1/')

echo "OK: installed $num_files files (${install_s} s) with no path into $src_dir or $bin_dir;" \
     "the example built from a copy against the prefix alone (configure ${configure_s} s, build ${build_s} s);" \
     "2 ranks under mpirun (${np2_s} s) match the unsharded model ($check2) and 1 process (${np1_s} s) over" \
     "$num_losses loss summaries ($comparison, tolerance $TOLERANCE); test accuracy $test_acc"
