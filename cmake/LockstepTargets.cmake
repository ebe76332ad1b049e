# Helpers shared by every Lockstep target.
include(GNUInstallDirs)

# __FILE__ (in the check macros' messages, in absl flags' help) names files
# relative to the source and build roots, so that the installed libraries and
# binaries carry no path of the tree they were built in. Debug info keeps full
# paths, for debuggers.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  add_compile_options("-fmacro-prefix-map=${PROJECT_SOURCE_DIR}/=" "-fmacro-prefix-map=${PROJECT_BINARY_DIR}/=")
endif()

# ThreadSanitizer cannot see Debian's abseil mutex (built without TSan): every
# executable is linked with the absl::Mutex entry points our code calls wrapped by
# cmake/sanitizers/tsan_absl_mutex.cc, which annotates each lock and unlock.
macro(_lockstep_tsan_absl_mutex)
  file(STRINGS "${absl_DIR}/../../../../include/absl/base/options.h" _absl_ns
       REGEX "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME ")
  if(NOT _absl_ns)
    file(STRINGS "/usr/include/absl/base/options.h" _absl_ns REGEX "^#define ABSL_OPTION_INLINE_NAMESPACE_NAME ")
  endif()
  string(REGEX REPLACE ".* ([A-Za-z0-9_]+)$" "\\1" _absl_ns "${_absl_ns}")
  if(NOT _absl_ns)
    message(FATAL_ERROR "LOCKSTEP_SANITIZE=thread needs abseil's inline namespace (absl/base/options.h)")
  endif()
  string(LENGTH "${_absl_ns}" _len)
  set(_m "_ZN4absl${_len}${_absl_ns}5Mutex")
  set(_c "ERKNS0_9ConditionE")
  set(_absl_mutex_symbols
    Lock=${_m}4LockEv Unlock=${_m}6UnlockEv TryLock=${_m}7TryLockEv
    ReaderLock=${_m}10ReaderLockEv ReaderUnlock=${_m}12ReaderUnlockEv
    LockWhen=${_m}8LockWhen${_c}
    LockWhenWithTimeout=${_m}19LockWhenWithTimeout${_c}NS0_8DurationE
    LockWhenWithDeadline=${_m}20LockWhenWithDeadline${_c}NS0_4TimeE
    Await=${_m}5Await${_c}
    AwaitWithTimeout=${_m}16AwaitWithTimeout${_c}NS0_8DurationE
    AwaitWithDeadline=${_m}17AwaitWithDeadline${_c}NS0_4TimeE)
  add_library(lockstep_tsan_absl_mutex STATIC "${PROJECT_SOURCE_DIR}/cmake/sanitizers/tsan_absl_mutex.cc")
  target_link_libraries(lockstep_tsan_absl_mutex PUBLIC absl::synchronization)
  foreach(_pair IN LISTS _absl_mutex_symbols)
    string(REPLACE "=" ";" _pair "${_pair}")
    list(GET _pair 0 _name)
    list(GET _pair 1 _symbol)
    target_compile_definitions(lockstep_tsan_absl_mutex PRIVATE LOCKSTEP_ABSL_${_name}=${_symbol})
    # --undefined: the wrappers are linked in even where only a shared library
    # (gRPC) calls the mutex, which --wrap redirects too.
    add_link_options("LINKER:--wrap=${_symbol}" "LINKER:--undefined=__wrap_${_symbol}")
  endforeach()
  link_libraries($<BUILD_INTERFACE:lockstep_tsan_absl_mutex>)
endmacro()

# Sanitizer builds (./dev.sh asan, ./dev.sh tsan): every target of the tree,
# the precompiled header included, is instrumented; libtorch, Open MPI and gRPC
# are not (Debian's builds), so findings inside them are suppressed by
# cmake/sanitizers/*.supp, each with its reason.
if(LOCKSTEP_SANITIZE STREQUAL "address")
  set(_sanitize -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(LOCKSTEP_SANITIZE STREQUAL "thread")
  set(_sanitize -fsanitize=thread -fno-omit-frame-pointer)
elseif(NOT LOCKSTEP_SANITIZE STREQUAL "")
  message(FATAL_ERROR "LOCKSTEP_SANITIZE must be empty, 'address' or 'thread', not '${LOCKSTEP_SANITIZE}'")
endif()
if(_sanitize)
  add_compile_options(${_sanitize})
  add_link_options(${_sanitize})
  if(LOCKSTEP_SANITIZE STREQUAL "thread")
    _lockstep_tsan_absl_mutex()
    # TSan does not model std::atomic_thread_fence; the one use (the MPI
    # communicator's shared-memory all-reduce) orders memory between processes,
    # which TSan does not see either.
    add_compile_options(-Wno-tsan)
  endif()
  # GCC 12's maybe-uninitialized analysis misfires on libstdc++'s <regex> and
  # <functional> under -fsanitize (its instrumentation confuses the analysis).
  add_compile_options(-Wno-maybe-uninitialized)
endif()

# Fuzzing builds (./dev.sh fuzz): Clang's libFuzzer needs coverage instrumentation
# in the code under test; ASan + UBSan turn a bad read or undefined behaviour into
# a finding. Only the fuzz targets link libFuzzer's main.
if(LOCKSTEP_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "LOCKSTEP_BUILD_FUZZERS needs Clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(_sanitize)
    message(FATAL_ERROR "LOCKSTEP_BUILD_FUZZERS brings its own sanitizers; leave LOCKSTEP_SANITIZE empty")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()

# Our own code builds with -Wall -Wextra -Werror. Generated code does not take this.
add_library(lockstep_warnings INTERFACE)
target_compile_options(lockstep_warnings INTERFACE -Wall -Wextra -Werror)
# Every target compiles with -pthread (gRPC asks for it), so that the precompiled
# header below, built with it too, stays valid for all of them (_REENTRANT).
target_compile_options(lockstep_warnings INTERFACE -pthread)

# Headers that nearly every translation unit that touches libtorch includes. They
# are compiled once into a precompiled header that the other targets reuse; this
# is what keeps a clean build on two cores short.
add_library(lockstep_pch OBJECT "${PROJECT_SOURCE_DIR}/cmake/pch.cc")
target_link_libraries(lockstep_pch PUBLIC ${TORCH_LIBRARIES})
target_compile_options(lockstep_pch PRIVATE -pthread)
if(LOCKSTEP_USE_PCH)
  target_precompile_headers(lockstep_pch PUBLIC
    <ATen/ATen.h>
    <torch/nn/module.h>
    <torch/nn/modules/conv.h>
    <torch/nn/modules/linear.h>
    <torch/optim/optimizer.h>
    <torch/optim/adam.h>
    <torch/optim/sgd.h>)
endif()

# lockstep_library(NAME [NO_PCH] SOURCES... DEPS... PRIVATE_DEPS...): one static
# library per layer. NO_PCH for layers that do not touch libtorch. Every library
# made here is installed and exported as Lockstep::<NAME without "lockstep_">
# (see LockstepInstall.cmake) and linked by the umbrella target Lockstep::lockstep.
# The warning flags and the precompiled header are build-tree only: a static
# library exports its private dependencies as link-only, and they must not reach
# the users of the installed package.
function(lockstep_library name)
  cmake_parse_arguments(ARG "NO_PCH" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE $<BUILD_INTERFACE:lockstep_warnings> ${ARG_PRIVATE_DEPS})
  string(REGEX REPLACE "^lockstep_" "" _export_name ${name})
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${_export_name})
  set_property(GLOBAL APPEND PROPERTY LOCKSTEP_LIBRARIES ${name})
  if(NOT ARG_NO_PCH)
    lockstep_use_pch(${name})
  endif()
endfunction()

function(lockstep_use_pch target)
  if(LOCKSTEP_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM lockstep_pch)
  endif()
endfunction()
