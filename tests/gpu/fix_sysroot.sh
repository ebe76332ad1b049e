#!/usr/bin/env bash
# Makes .gpu/sysroot (tests/gpu/make_sysroot.sh) usable where it landed:
#   tests/gpu/fix_sysroot.sh [SYSROOT]      (default: <repo root>/.gpu/sysroot)
# The exported CMake files of gRPC, absl and GTest compute their prefix from
# their own location and the libraries carry RUNPATH $ORIGIN, so normally this
# only checks. It repairs what a copy can lose (execute bits, libz.so's target)
# and rewrites any absolute /usr prefix left in a *.cmake file to the sysroot's.
# Prints one line per check; exit status 1 when protoc or grpc_cpp_plugin cannot run.
set -uo pipefail
SR=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.gpu/sysroot}
SR=$(cd "$SR" && pwd) || { echo "fix_sysroot: no sysroot at ${1:-.gpu/sysroot}"; exit 1; }
LIB=$SR/usr/lib/x86_64-linux-gnu
chmod +x "$SR"/usr/bin/* 2>/dev/null
# libz.so: the target's own zlib (zlib1g is on every Debian and Ubuntu).
if [[ ! -e $LIB/libz.so ]]; then
  for z in /lib/x86_64-linux-gnu/libz.so.1 /usr/lib/x86_64-linux-gnu/libz.so.1 /usr/lib64/libz.so.1 /lib64/libz.so.1; do
    if [[ -e $z ]]; then ln -sfn "$z" "$LIB/libz.so"; echo "fix_sysroot: libz.so -> $z"; break; fi
  done
fi
[[ -e $LIB/libz.so ]] || echo "fix_sysroot: WARNING: no libz.so.1 on this machine; FindZLIB will fail"
# Absolute /usr paths in the CMake files (none in Debian 12's, apart from the
# "/usr move" guards, which compare against /usr on purpose): rewrite others.
while IFS= read -r -d '' f; do
  if grep -Eq '"/usr/(include|lib/x86_64-linux-gnu/lib|bin/)' "$f"; then
    sed -i -E "s#\"/usr/(include|lib/x86_64-linux-gnu/lib|bin/)#\"$SR/usr/\\1#g" "$f"
    echo "fix_sysroot: rewrote absolute /usr paths in ${f#$SR/}"
  fi
done < <(find "$LIB/cmake" -name '*.cmake' -print0)
rc=0
if v=$(env -u LD_LIBRARY_PATH "$SR/usr/bin/protoc" --version 2>&1); then
  echo "fix_sysroot: protoc runs: $v"
else
  echo "fix_sysroot: protoc does not run: $v"; rc=1
fi
missing=$(env -u LD_LIBRARY_PATH ldd "$SR/usr/bin/grpc_cpp_plugin" "$LIB/libgrpc++.so.1.51" 2>&1 | grep 'not found' | sort -u)
if [[ -n $missing ]]; then
  echo "fix_sysroot: missing libraries:"; echo "$missing"; rc=1
else
  echo "fix_sysroot: grpc_cpp_plugin and libgrpc++ find all their libraries"
fi
exit $rc
