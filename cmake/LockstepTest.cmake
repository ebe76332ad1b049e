# lockstep_add_test(NAME [NO_PCH] SOURCES... DEPS... [LABELS...] [TIMEOUT s]): one GoogleTest
# binary registered with ctest as one test per test case.
include(GoogleTest)
function(lockstep_add_test name)
  cmake_parse_arguments(ARG "NO_PCH" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} lockstep_warnings GTest::gtest GTest::gmock GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_definitions(${name} PRIVATE
    LOCKSTEP_SOURCE_DIR="${PROJECT_SOURCE_DIR}" LOCKSTEP_BINARY_DIR="${PROJECT_BINARY_DIR}")
  if(NOT ARG_NO_PCH)
    lockstep_use_pch(${name})
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
                       PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
endfunction()
