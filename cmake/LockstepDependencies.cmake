# Every external dependency is found here, once, with find_package.
include(CMakeDependentOption)

find_package(Torch REQUIRED)
# TorchConfig lists c10 as an absolute library path next to its imported targets;
# use the imported target instead, so that the exported Lockstep package names
# targets that its own find_dependency(Torch) recreates, not paths of this machine.
set(_torch_libraries)
foreach(_lib IN LISTS TORCH_LIBRARIES)
  if(IS_ABSOLUTE "${_lib}")
    get_filename_component(_stem "${_lib}" NAME_WE)
    string(REGEX REPLACE "^lib" "" _stem "${_stem}")
    if(TARGET ${_stem})
      set(_lib ${_stem})
    endif()
  endif()
  list(APPEND _torch_libraries ${_lib})
endforeach()
set(TORCH_LIBRARIES ${_torch_libraries})
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(ZLIB REQUIRED)
find_package(Threads REQUIRED)
if(LOCKSTEP_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
endif()
if(LOCKSTEP_BUILD_BENCHMARKS)
  find_package(benchmark CONFIG REQUIRED)
endif()

# Optional backends: a build without them still trains on one process.
find_package(MPI COMPONENTS CXX)
option(LOCKSTEP_WITH_MPI "Build the MPI communicator (CPU tensors)" ${MPI_CXX_FOUND})
if(LOCKSTEP_WITH_MPI AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "LOCKSTEP_WITH_MPI=ON but no MPI C++ implementation was found; "
                      "install libopenmpi-dev or configure with -DLOCKSTEP_WITH_MPI=OFF")
endif()

if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
find_package(CUDAToolkit QUIET)
find_package(NCCL QUIET)
cmake_dependent_option(LOCKSTEP_WITH_NCCL "Build the NCCL communicator (CUDA tensors)" ON
                       "CUDAToolkit_FOUND;NCCL_FOUND" OFF)

# oneDNN (the fused CPU kernels of src/models: linear layers and causal
# attention on its sgemm): libdnnl, which libtorch links too; headers and CMake
# package from libdnnl-dev.
find_package(dnnl CONFIG QUIET)
option(LOCKSTEP_WITH_DNNL "Fused CPU linear and attention kernels on oneDNN's GEMM (else ATen ops)" ${dnnl_FOUND})
if(LOCKSTEP_WITH_DNNL AND NOT dnnl_FOUND)
  message(FATAL_ERROR "LOCKSTEP_WITH_DNNL=ON but oneDNN's CMake package was not found (install libdnnl-dev)")
endif()

# Gloo (CPU tensors without mpirun): libtorch's c10d ProcessGroupGloo, whose
# header needs Gloo's (libgloo-dev); libtorch links the same libgloo.
find_path(LOCKSTEP_GLOO_HEADER gloo/config.h)
find_path(LOCKSTEP_C10D_GLOO_HEADER torch/csrc/distributed/c10d/ProcessGroupGloo.hpp HINTS ${TORCH_INCLUDE_DIRS})
set(_have_gloo OFF)
if(LOCKSTEP_GLOO_HEADER AND LOCKSTEP_C10D_GLOO_HEADER)
  set(_have_gloo ON)
endif()
option(LOCKSTEP_WITH_GLOO "Build the Gloo communicator (CPU tensors, libtorch's c10d)" ${_have_gloo})
if(LOCKSTEP_WITH_GLOO AND NOT _have_gloo)
  message(FATAL_ERROR "LOCKSTEP_WITH_GLOO=ON but Gloo's headers (libgloo-dev) or libtorch's "
                      "c10d/ProcessGroupGloo.hpp were not found")
endif()

message(STATUS "Lockstep: torch ${Torch_VERSION}, protobuf ${Protobuf_VERSION}, gRPC ${gRPC_VERSION}")
message(STATUS "Lockstep: MPI backend ${LOCKSTEP_WITH_MPI}, Gloo backend ${LOCKSTEP_WITH_GLOO}, NCCL backend ${LOCKSTEP_WITH_NCCL}"
               " (CUDA ${CUDAToolkit_VERSION}, NCCL ${NCCL_VERSION})")
