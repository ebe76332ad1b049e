# CMAKE_PROJECT_INCLUDE for builds against pip's libtorch (tests/gpu/device_check.sh).
# A wheel's Caffe2Config.cmake, when libtorch carries its own protobuf
# (CAFFE2_LINK_LOCAL_PROTOBUF), defines protobuf::libprotobuf as an empty alias
# unless that target exists already; found after Torch, our protobuf would then
# link nothing. Finding it here, right after project() and before
# find_package(Torch), keeps the real one.
find_package(Protobuf REQUIRED)
message(STATUS "tests/gpu/preload.cmake: protobuf ${Protobuf_VERSION} from ${Protobuf_INCLUDE_DIR}, "
               "protoc ${Protobuf_PROTOC_EXECUTABLE}")
