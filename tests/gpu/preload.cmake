# CMAKE_PROJECT_INCLUDE for builds against pip's libtorch (tests/gpu/device_check.sh).
# A wheel's Caffe2Config.cmake, when libtorch carries its own protobuf
# (CAFFE2_LINK_LOCAL_PROTOBUF), defines protobuf::libprotobuf as an empty alias
# unless that target exists already; found after Torch, our protobuf would then
# link nothing. Finding it here, right after project() and before
# find_package(Torch), keeps the real one.
find_package(Protobuf REQUIRED)
message(STATUS "tests/gpu/preload.cmake: protobuf ${Protobuf_VERSION} from ${Protobuf_INCLUDE_DIR}, "
               "protoc ${Protobuf_PROTOC_EXECUTABLE}")
# pip's libtorch ships protobuf headers of its own (an older protobuf) in its
# include folder; a target that reaches libtorch's include folder before the
# sysroot's (lockstep_checkpoint, through lockstep_trainer) would compile our
# generated code against them. The sysroot's headers go first everywhere.
get_filename_component(_lockstep_sysroot_include "${CMAKE_CURRENT_LIST_DIR}/../../.gpu/sysroot/usr/include" ABSOLUTE)
if(EXISTS "${_lockstep_sysroot_include}/google/protobuf")
  include_directories(BEFORE SYSTEM "${_lockstep_sysroot_include}")
endif()
