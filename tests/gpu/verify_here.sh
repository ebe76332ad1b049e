#!/usr/bin/env bash
# Checks .gpu/sysroot on this Debian 12 machine as the device will use it: in a
# private mount namespace (unshare -m, root) where the system's own gRPC,
# protobuf, abseil, re2, GoogleTest headers, CMake packages, pkg-config files and
# protoc / grpc_cpp_plugin are hidden, configures a fresh build of the repository
# with the same flags as tests/gpu/device_check.sh (against Debian's libtorch
# here), builds a few targets and reports where the dependencies came from.
#   tests/gpu/verify_here.sh [BUILD_DIR] [TARGET...]
# Default: /tmp/gpukit-build; lockstep_proto lockstep_coordination lockstep_coordinator
# coordination_test. Deletes nothing; remove BUILD_DIR afterwards.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
B=${1:-/tmp/gpukit-build}; shift || true
TARGETS=("$@"); [[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(lockstep_proto lockstep_coordination lockstep_coordinator coordination_test)
SR=$ROOT/.gpu/sysroot
[[ $(id -u) == 0 ]] || { echo "verify_here: needs root (unshare -m)" >&2; exit 1; }
exec unshare -m bash -s -- "$ROOT" "$B" "$SR" "${TARGETS[@]}" <<'INNER'
set -euo pipefail
ROOT=$1 B=$2 SR=$3; shift 3
empty=$(mktemp -d); fake=$(mktemp); printf '#!/bin/sh\necho hidden >&2; exit 1\n' >"$fake"; chmod +x "$fake"
trap 'rm -rf "$empty" "$fake"' EXIT
for d in /usr/include/absl /usr/include/grpc /usr/include/grpcpp /usr/include/grpc++ /usr/include/google/protobuf \
         /usr/include/gtest /usr/include/gmock /usr/include/re2 /usr/lib/x86_64-linux-gnu/cmake/grpc \
         /usr/lib/x86_64-linux-gnu/cmake/absl /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/x86_64-linux-gnu/pkgconfig \
         /usr/share/pkgconfig; do
  [[ -d $d ]] && mount --bind "$empty" "$d"
done
for f in /usr/bin/protoc /usr/bin/grpc_cpp_plugin; do [[ -e $f ]] && mount --bind "$fake" "$f"; done
echo "hidden: $(ls /usr/include/absl | wc -l) entries in /usr/include/absl; /usr/bin/protoc: $(/usr/bin/protoc --version 2>&1)"
"$ROOT/tests/gpu/fix_sysroot.sh" "$SR"
cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$SR/usr" -DCMAKE_PROJECT_INCLUDE="$ROOT/tests/gpu/preload.cmake" \
  -DProtobuf_PROTOC_EXECUTABLE="$SR/usr/bin/protoc" \
  -DLOCKSTEP_WITH_MPI=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DLOCKSTEP_BUILD_BENCHMARKS=OFF -DLOCKSTEP_USE_PCH=ON \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$ROOT/tests/gpu/no_werror.sh" >"$B.configure.log" 2>&1 || { tail -40 "$B.configure.log"; exit 1; }
grep -E '^-- (Found|Lockstep|tests/gpu)' "$B.configure.log"
echo "--- cache entries naming a dependency:"
grep -E '^(Protobuf_[A-Z_]*(LIBRARY|INCLUDE_DIR|EXECUTABLE)|gRPC_DIR|absl_DIR|GTest_DIR|re2_DIR|c-ares_(INCLUDE_DIR|LIBRARY)|OPENSSL_(INCLUDE_DIR|SSL_LIBRARY|CRYPTO_LIBRARY)|ZLIB_(INCLUDE_DIR|LIBRARY_RELEASE))[:=]' "$B/CMakeCache.txt"
ninja -C "$B" -j2 "$@" >"$B.build.log" 2>&1 || { tail -60 "$B.build.log"; exit 1; }
tail -3 "$B.build.log"
echo "--- include directories of the compile lines (compile_commands.json):"
grep -o -- '-isystem [^ ]*\|-I[^ ]*' "$B/compile_commands.json" | sort | uniq -c | sort -rn
echo "--- protoc / plugin used by the generator rules:"
grep -o "$SR/usr/bin/[a-z_]*" "$B/build.ninja" | sort | uniq -c
for exe in "$B/lockstep_coordinator" "$B/tests/unit/coordination_test"; do
  [[ -x $exe ]] || continue
  echo "--- ldd $exe (gRPC, protobuf, absl, re2, c-ares, ssl):"
  ldd "$exe" | grep -E 'grpc|protobuf|absl_(base|strings|synchronization)|re2|cares|libssl|libupb|not found' | sed 's/ (0x.*//'
done
INNER
