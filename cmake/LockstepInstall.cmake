# Install rules and the exported CMake package, so that another project can
#
#   find_package(Lockstep 0.1 REQUIRED)
#   target_link_libraries(my_trainer PRIVATE Lockstep::lockstep)
#
# Layout under the prefix (GNUInstallDirs):
#   include/lockstep/*.h          the public headers
#   include/proto/*.pb.h          protoc-generated headers the public ones include
#   lib/liblockstep_*.a           one static library per layer
#   lib/cmake/Lockstep/           LockstepConfig.cmake, LockstepConfigVersion.cmake,
#                                 LockstepTargets*.cmake, FindNCCL.cmake
#   bin/                          lockstep_train, lockstep_coordinator, lockstep_ckpt, lockstep_sample
#   share/lockstep/launch/        mpirun and Slurm launch scripts
#   share/lockstep/configs/       example training configs
#   share/lockstep/proto/         the .proto sources of the generated headers
#
# Targets: Lockstep::lockstep (everything), and one per layer, Lockstep::runtime,
# Lockstep::collectives, Lockstep::trainer, ... (the library name without
# "lockstep_"). Included from the top-level CMakeLists.txt after src/.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LOCKSTEP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Lockstep)
set(LOCKSTEP_INSTALL_LAUNCHDIR ${CMAKE_INSTALL_DATADIR}/lockstep/launch)
set(LOCKSTEP_INSTALL_BINDIR ${CMAKE_INSTALL_BINDIR})

# The generated headers are installed under include/proto, next to include/lockstep.
set_target_properties(lockstep_proto PROPERTIES EXPORT_NAME proto)
target_include_directories(lockstep_proto PUBLIC $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)

get_property(_lockstep_libraries GLOBAL PROPERTY LOCKSTEP_LIBRARIES)
list(PREPEND _lockstep_libraries lockstep_proto)

# The umbrella target: every layer, and the C++ standard the headers need.
add_library(lockstep INTERFACE)
target_link_libraries(lockstep INTERFACE ${_lockstep_libraries})
target_compile_features(lockstep INTERFACE cxx_std_17)
add_library(Lockstep::lockstep ALIAS lockstep)

install(TARGETS ${_lockstep_libraries} lockstep
        EXPORT LockstepTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})

# The binaries link shared libraries outside the system's search path (CUDA and
# NCCL under /usr/local/cuda): keep those directories in their installed RPATH.
# Directories inside the build tree are never added (only ones outside it are).
set(_lockstep_programs lockstep_train lockstep_coordinator lockstep_ckpt lockstep_sample)
set_target_properties(${_lockstep_programs} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ${_lockstep_programs} RUNTIME DESTINATION ${LOCKSTEP_INSTALL_BINDIR})

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/lockstep
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
# Every generated header, not only the ones a public header includes today, so
# that a new include of one cannot break the installed package.
install(DIRECTORY ${LOCKSTEP_PROTO_GEN_DIR}/proto
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.pb.h")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/proto/
        DESTINATION ${CMAKE_INSTALL_DATADIR}/lockstep/proto
        FILES_MATCHING PATTERN "*.proto")

# Launch scripts and configs are matched at install time, so a new script in
# launch/ is installed without re-running CMake.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/launch/
        DESTINATION ${LOCKSTEP_INSTALL_LAUNCHDIR}
        USE_SOURCE_PERMISSIONS
        FILES_MATCHING PATTERN "*.sh" PATTERN "*.sbatch")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/
        DESTINATION ${CMAKE_INSTALL_DATADIR}/lockstep/configs
        FILES_MATCHING PATTERN "*.textproto")

install(EXPORT LockstepTargets
        NAMESPACE Lockstep::
        DESTINATION ${LOCKSTEP_INSTALL_CMAKEDIR})

# What LockstepConfig.cmake needs to find the same dependencies again. Only
# locations outside this build are recorded (CUDA's root is a hint, not a must).
set(LOCKSTEP_CONFIG_WITH_MPI ${LOCKSTEP_WITH_MPI})
set(LOCKSTEP_CONFIG_WITH_NCCL ${LOCKSTEP_WITH_NCCL})
set(LOCKSTEP_CONFIG_WITH_DNNL ${LOCKSTEP_WITH_DNNL})
set(LOCKSTEP_CONFIG_CUDA_ROOT_HINT "")
if(LOCKSTEP_WITH_NCCL AND DEFINED CUDAToolkit_ROOT)
  set(LOCKSTEP_CONFIG_CUDA_ROOT_HINT ${CUDAToolkit_ROOT})
endif()
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/LockstepConfig.cmake.in
  ${PROJECT_BINARY_DIR}/package/LockstepConfig.cmake
  INSTALL_DESTINATION ${LOCKSTEP_INSTALL_CMAKEDIR}
  PATH_VARS LOCKSTEP_INSTALL_LAUNCHDIR LOCKSTEP_INSTALL_BINDIR)
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/package/LockstepConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
set(_lockstep_package_files
    ${PROJECT_BINARY_DIR}/package/LockstepConfig.cmake
    ${PROJECT_BINARY_DIR}/package/LockstepConfigVersion.cmake)
if(LOCKSTEP_WITH_NCCL)
  list(APPEND _lockstep_package_files ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake)
endif()
install(FILES ${_lockstep_package_files} DESTINATION ${LOCKSTEP_INSTALL_CMAKEDIR})
