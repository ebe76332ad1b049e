// Fuzzes the `latest` file of a checkpoints directory (CheckpointManager::ReadLatest,
// what lockstep_ckpt verify reads). The input is the file's content. Properties:
// any content is a step directory of this checkpoints directory, or a
// CheckpointError with a message; never a path elsewhere, a crash or another
// exception.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "fuzz_util.h"
#include "lockstep/checkpoint.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path root = lockstep::fuzz::ScratchDir() / "checkpoints";
  fs::create_directories(root);
  lockstep::fuzz::WriteWholeFile(root / "latest", std::string(reinterpret_cast<const char*>(data), size));
  try {
    const std::optional<std::string> latest = lockstep::CheckpointManager::ReadLatest(root.string());
    LOCKSTEP_FUZZ_CHECK(latest.has_value(), "an existing latest file read as absent");
    const fs::path path(*latest);
    LOCKSTEP_FUZZ_CHECK(path.parent_path() == root, latest->c_str());
    const std::string name = path.filename().string();
    LOCKSTEP_FUZZ_CHECK(name.rfind("step_", 0) == 0 && name.find_first_not_of("0123456789", 5) == std::string::npos,
                        latest->c_str());
  } catch (const lockstep::CheckpointError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "a CheckpointError without a message");
  }
  return 0;
}
