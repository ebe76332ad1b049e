#!/bin/sh
# CMAKE_CXX_COMPILER_LAUNCHER: runs the compiler with every argument but -Werror,
# so that a newer compiler's new warnings are reported (in the log) without
# stopping the build. tests/gpu/device_check.sh uses it unless LOCKSTEP_GPU_WERROR=1.
for arg do
  shift
  [ "$arg" = "-Werror" ] || set -- "$@" "$arg"
done
exec "$@"
