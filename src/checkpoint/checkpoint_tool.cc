// lockstep_ckpt: inspects checkpoint directories.
//
//   lockstep_ckpt verify DIR    checks every checkpoint under DIR (manifest,
//                                     every shard's size and CRC32C) and what
//                                     "latest" points to; exit 0 when "latest"
//                                     (if any) is valid, 1 otherwise
//   lockstep_ckpt latest DIR    prints the newest valid checkpoint's path
//                                     (what --resume=auto takes); exit 1 if none
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "lockstep/checkpoint.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "verify" && std::string(argv[1]) != "latest")) {
    std::fprintf(stderr, "usage: lockstep_ckpt verify|latest DIR\n");
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
  int valid = 0, invalid = 0;
  std::vector<fs::path> entries;
  for (const auto& item : fs::directory_iterator(dir)) {
    if (item.is_directory()) entries.push_back(item.path());
  }
  std::sort(entries.begin(), entries.end());
  for (const fs::path& path : entries) {
    try {
      const lockstep::FoundCheckpoint found = lockstep::CheckpointManager::Validate(path.string());
      std::printf("ok       %s (step %lld, %d rank(s))\n", path.c_str(), static_cast<long long>(found.step),
                  found.world_size);
      ++valid;
    } catch (const lockstep::CheckpointError& e) {
      std::printf("INVALID  %s\n", e.what());
      ++invalid;
    }
  }
  const fs::path latest = fs::path(dir) / "latest";
  if (!fs::exists(latest)) {
    std::printf("no 'latest' yet; %d valid, %d invalid\n", valid, invalid);
    return 0;
  }
  std::ifstream in(latest);
  std::string name;
  std::getline(in, name);
  name = std::string(absl::StripAsciiWhitespace(name));
  try {
    lockstep::CheckpointManager::Validate((fs::path(dir) / name).string());
  } catch (const lockstep::CheckpointError& e) {
    std::printf("latest -> %s is NOT valid: %s\n", name.c_str(), e.what());
    return 1;
  }
  std::printf("latest -> %s (valid); %d valid, %d invalid\n", name.c_str(), valid, invalid);
  return 0;
}
