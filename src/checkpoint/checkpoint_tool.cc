// lockstep_ckpt: inspects checkpoint directories.
//
//   lockstep_ckpt verify DIR    DIR is a checkpoints directory: checks every step
//                               directory in it (manifest, every shard's size and
//                               CRC32C) and what "latest" points to; or DIR is one
//                               step directory: checks it
//   lockstep_ckpt latest DIR    prints the newest valid checkpoint's path (what
//                               --resume=auto takes)
//   lockstep_ckpt consolidate STEP_DIR OUT.pt
//                               writes one file that torch.load reads as a
//                               plain dict, whole tensors however the
//                               checkpoint was split over ranks
//
// Exit codes: 0 every checkpoint checked is valid (verify) / one was found
// (latest); 1 a checkpoint checked is invalid, "latest" names an invalid one, or
// there was nothing to check (verify) / none is valid (latest) / the checkpoint is
// invalid or OUT cannot be written (consolidate); 2 bad usage or DIR is not a
// directory.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "lockstep/checkpoint.h"

namespace fs = std::filesystem;

namespace {

constexpr char kUsage[] =
    "usage: lockstep_ckpt verify|latest DIR | consolidate STEP_DIR OUT.pt\n"
    "  verify DIR  check every checkpoint in a checkpoints directory (and its 'latest'), or one step directory\n"
    "  latest DIR  print the newest valid checkpoint's path (what --resume=auto takes)\n"
    "  consolidate STEP_DIR OUT.pt  write one file torch.load reads as a plain dict (whole tensors)\n"
    "exit codes: 0 all valid (verify) / found (latest); 1 something invalid, nothing to check, or none valid;\n"
    "            2 bad usage or DIR is not a directory\n";

bool Check(const fs::path& path) {
  try {
    const lockstep::FoundCheckpoint found = lockstep::CheckpointManager::Validate(path.string());
    std::printf("ok       %s (step %lld, %d rank(s))\n", path.c_str(), static_cast<long long>(found.step),
                found.world_size);
    return true;
  } catch (const lockstep::CheckpointError& e) {
    std::printf("INVALID  %s\n", e.what());
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (argc == 4 && std::string(argv[1]) == "consolidate") {
    if (!fs::is_directory(argv[2])) {
      std::fprintf(stderr, "lockstep_ckpt: '%s' is not a directory\n", argv[2]);
      return 2;
    }
    try {
      lockstep::ConsolidateCheckpoint(argv[2], argv[3]);
    } catch (const lockstep::CheckpointError& e) {
      std::fprintf(stderr, "lockstep_ckpt: %s\n", e.what());
      return 1;
    }
    std::printf("wrote %s\n", argv[3]);
    return 0;
  }
  if (argc != 3 || (std::string(argv[1]) != "verify" && std::string(argv[1]) != "latest")) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const std::string command = argv[1];
  const std::string dir = argv[2];
  if (!fs::is_directory(dir)) {
    std::fprintf(stderr, "lockstep_ckpt: '%s' is not a directory\n", dir.c_str());
    return 2;
  }
  if (command == "latest") {
    std::vector<std::string> skipped;
    auto found = lockstep::CheckpointManager::FindLatest(dir, &skipped);
    for (const std::string& s : skipped) std::fprintf(stderr, "skipped %s\n", s.c_str());
    if (!found) {
      std::fprintf(stderr, "lockstep_ckpt: no valid checkpoint under %s\n", dir.c_str());
      return 1;
    }
    std::printf("%s\n", found->path.c_str());
    return 0;
  }
  // One step directory (it has a manifest, or is named like one).
  const std::string base = fs::path(dir).lexically_normal().filename().string();
  if (fs::exists(fs::path(dir) / "manifest.pb") || base.rfind("step_", 0) == 0) {
    const bool ok = Check(dir);
    std::printf("%s\n", ok ? "1 valid" : "0 valid, 1 invalid");
    return ok ? 0 : 1;
  }
  int valid = 0, invalid = 0, unfinished = 0;
  std::vector<fs::path> entries;
  for (const auto& item : fs::directory_iterator(dir)) {
    if (item.is_directory()) entries.push_back(item.path());
  }
  std::sort(entries.begin(), entries.end());
  for (const fs::path& path : entries) {
    const std::string name = path.filename().string();
    if (name.rfind(".tmp_", 0) == 0) {
      std::printf("ignored  %s (an unfinished save, never loaded; the next save removes it)\n", path.c_str());
      ++unfinished;
      continue;
    }
    if (name.find(".damaged.") != std::string::npos) {
      std::printf("ignored  %s (a damaged checkpoint a later save set aside)\n", path.c_str());
      continue;
    }
    if (name.rfind("step_", 0) != 0) {
      std::printf("ignored  %s (not a step directory)\n", path.c_str());
      continue;
    }
    (Check(path) ? valid : invalid)++;
  }
  bool latest_ok = true;
  std::string latest_text = "no 'latest' yet";
  try {
    if (const std::optional<std::string> latest = lockstep::CheckpointManager::ReadLatest(dir)) {
      const std::string name = fs::path(*latest).filename().string();
      try {
        lockstep::CheckpointManager::Validate(*latest);
        latest_text = "latest -> " + name + " (valid)";
      } catch (const lockstep::CheckpointError& e) {
        std::printf("latest -> %s is NOT valid: %s\n", name.c_str(), e.what());
        latest_text = "latest -> " + name + " (NOT valid)";
        latest_ok = false;
      }
    }
  } catch (const lockstep::CheckpointError& e) {
    std::printf("latest is NOT valid: %s\n", e.what());
    latest_text = "latest (NOT valid)";
    latest_ok = false;
  }
  std::printf("%s; %d valid, %d invalid, %d unfinished\n", latest_text.c_str(), valid, invalid, unfinished);
  if (valid + invalid == 0) {
    std::fprintf(stderr, "lockstep_ckpt: no checkpoint to check in %s\n", dir.c_str());
    return 1;
  }
  return invalid == 0 && latest_ok ? 0 : 1;
}
