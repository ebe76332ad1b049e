# Helpers shared by every Lockstep target.

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
# library per layer. NO_PCH for layers that do not touch libtorch.
function(lockstep_library name)
  cmake_parse_arguments(ARG "NO_PCH" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE lockstep_warnings ${ARG_PRIVATE_DEPS})
  if(NOT ARG_NO_PCH)
    lockstep_use_pch(${name})
  endif()
endfunction()

function(lockstep_use_pch target)
  if(LOCKSTEP_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM lockstep_pch)
  endif()
endfunction()
