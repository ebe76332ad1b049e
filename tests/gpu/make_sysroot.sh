#!/usr/bin/env bash
# Builds .gpu/sysroot: Debian 12's gRPC, protobuf, abseil, GoogleTest and their
# runtime dependencies, unpacked (dpkg -x, not installed) so that a machine without
# them (the GPU device: Ubuntu 24.04-like, no network) can configure and link
# Lockstep against them. Run here, on Debian 12, from the repository root:
#
#   tests/gpu/make_sysroot.sh            # writes .gpu/sysroot and .gpu/MANIFEST
#
# .gpu/ is ignored (.git/info/exclude); pass it in the device run's `carry`.
# What makes the tree relocatable (checked by tests/gpu/fix_sysroot.sh there):
# - the exported CMake files of gRPC, absl and GTest compute their prefix from
#   their own location already; protobuf and c-ares are found by CMake's find
#   modules through CMAKE_PREFIX_PATH; re2 gets a small re2Config.cmake here
#   (gRPC's Findre2 would otherwise ask pkg-config, whose .pc files say /usr);
# - every shared library gets RUNPATH $ORIGIN and protoc / grpc_cpp_plugin
#   $ORIGIN/../lib/x86_64-linux-gnu (patchelf), so they run, and binaries linked
#   against them load their dependencies, without LD_LIBRARY_PATH;
# - pkg-config files, docs, man pages, sources and static libraries are dropped,
#   except GoogleTest's (it ships only static ones); libz.so points at the
#   target's own /lib/x86_64-linux-gnu/libz.so.1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DEST=${1:-.gpu}
PACKAGES=(
  libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29 protobuf-compiler-grpc
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
  libabsl-dev libabsl20220623
  libre2-9 libre2-dev libc-ares2 libc-ares-dev libssl3 libssl-dev
  libgtest-dev libgmock-dev googletest zlib1g-dev
)
command -v patchelf >/dev/null || { echo "make_sysroot: needs patchelf (apt-get install patchelf)" >&2; exit 1; }
debs=$(mktemp -d /tmp/gpukit-debs.XXXXXX)
trap 'rm -rf "$debs"' EXIT
(cd "$debs" && apt-get download "${PACKAGES[@]}" >/dev/null 2>&1) || {
  echo "make_sysroot: apt-get download failed (run apt-get update first)" >&2; exit 1; }
rm -rf "$DEST/sysroot"
mkdir -p "$DEST/sysroot"
SR=$(cd "$DEST/sysroot" && pwd)
: >"$DEST/MANIFEST"
for deb in "$debs"/*.deb; do
  dpkg -x "$deb" "$SR"
  dpkg-deb -f "$deb" Package Version | paste -sd' ' >>"$DEST/MANIFEST"
done
LIB=$SR/usr/lib/x86_64-linux-gnu

# Prune what a build does not read.
rm -rf "${SR:?}/usr/share" "${SR:?}/usr/src" "$LIB/pkgconfig" "$LIB/engines-3" "$LIB/ossl-modules" "${SR:?}/etc" "${SR:?}/lib"
find "$LIB" -maxdepth 1 -name '*.a' ! -name 'libgtest*.a' ! -name 'libgmock*.a' -delete
# zlib1g-dev's libz.so is an absolute link into this machine's zlib; the target has
# its own libz.so.1 (any Ubuntu or Debian has zlib1g).
ln -sfn /lib/x86_64-linux-gnu/libz.so.1 "$LIB/libz.so"

# RUNPATHs: a library finds its siblings, protoc and the plugins their libraries.
find "$LIB" -maxdepth 1 -type f -name '*.so.*' -print0 | while IFS= read -r -d '' so; do
  patchelf --set-rpath '$ORIGIN' "$so"
done
for exe in "$SR"/usr/bin/*; do
  patchelf --set-rpath '$ORIGIN/../lib/x86_64-linux-gnu' "$exe"
done

# re2: a config file so that gRPC's Findre2 (find_package(re2 CONFIG) first) needs
# no pkg-config.
mkdir -p "$LIB/cmake/re2"
cat >"$LIB/cmake/re2/re2Config.cmake" <<'EOF'
# Written by tests/gpu/make_sysroot.sh: Debian 12's re2 ships only a .pc file.
get_filename_component(_re2_prefix "${CMAKE_CURRENT_LIST_DIR}/../../../.." ABSOLUTE)
if(NOT TARGET re2::re2)
  add_library(re2::re2 SHARED IMPORTED)
  set_target_properties(re2::re2 PROPERTIES
    IMPORTED_LOCATION "${_re2_prefix}/lib/x86_64-linux-gnu/libre2.so.9"
    IMPORTED_SONAME "libre2.so.9"
    INTERFACE_INCLUDE_DIRECTORIES "${_re2_prefix}/include")
endif()
set(re2_FOUND TRUE)
set(re2_VERSION 9.0.0)
unset(_re2_prefix)
EOF

# Sanity: the tools run from here with no LD_LIBRARY_PATH.
env -u LD_LIBRARY_PATH "$SR/usr/bin/protoc" --version
if env -u LD_LIBRARY_PATH ldd "$SR/usr/bin/grpc_cpp_plugin" | grep -F "$SR" >/dev/null; then
  echo "grpc_cpp_plugin: loads its libraries from the sysroot"
fi
du -sh "$SR"
