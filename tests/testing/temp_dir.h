// A fresh directory under the system temp dir, removed with everything in it when
// the object goes away. Header-only; tests include it.
#ifndef LOCKSTEP_TESTS_TESTING_TEMP_DIR_H_
#define LOCKSTEP_TESTS_TESTING_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace lockstep::testing {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "lockstep_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace lockstep::testing

#endif  // LOCKSTEP_TESTS_TESTING_TEMP_DIR_H_
