// Helpers shared by the fuzz targets: a scratch directory per process, files
// written whole, and a check that stops the fuzzer with a message when a property
// does not hold (a finding, like a crash).
#ifndef LOCKSTEP_FUZZ_FUZZ_UTIL_H_
#define LOCKSTEP_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace lockstep::fuzz {

// A directory of this process's own under $TMPDIR, made on first use and removed at exit.
inline const std::filesystem::path& ScratchDir() {
  static const std::filesystem::path dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/lockstep_fuzz_XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    static const std::string made = pattern;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(made, ignored);
    });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

inline void WriteWholeFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// A property of the code under test failed: print it and abort, so that libFuzzer
// keeps the input as a crash.
#define LOCKSTEP_FUZZ_CHECK(condition, what)                                      \
  do {                                                                            \
    if (!(condition)) {                                                           \
      std::fprintf(stderr, "fuzz property failed: %s: %s\n", #condition, (what)); \
      std::abort();                                                               \
    }                                                                             \
  } while (0)

}  // namespace lockstep::fuzz

#endif  // LOCKSTEP_FUZZ_FUZZ_UTIL_H_
