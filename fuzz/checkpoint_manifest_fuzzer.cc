// Fuzzes what the checkpoint reader trusts from disk before it loads a shard: the
// manifest file and the shard files it lists, as CheckpointManager::Validate,
// FindLatest and ReadManifestOnly read them (what --resume=auto and lockstep_ckpt
// verify do).
//
// The first byte picks how the rest is used: odd, the rest is the manifest file as
// it is on disk (a ManifestFile: the manifest bytes and their CRC32C); even, the rest
// is the inner Manifest, wrapped with a correct CRC by this harness so that the
// checks behind the checksum are reached too. Every shard the manifest names that
// is a plain file name gets a small file. Properties: any input is a valid
// checkpoint or a CheckpointError with a message, never a crash or another
// exception; a valid one is exactly what the manifest says; nothing outside the
// step directory is read as a shard.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "lockstep/checkpoint.h"
#include "lockstep/hashing.h"
#include "proto/checkpoint.pb.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool raw = (data[0] & 1) != 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);

  const fs::path root = lockstep::fuzz::ScratchDir() / "checkpoints";
  const fs::path step = root / "step_00000010";
  std::error_code ignored;
  fs::remove_all(root, ignored);
  fs::create_directories(step);

  std::string file_bytes = rest;
  lockstep::checkpoint::Manifest inner;
  if (!raw) {
    lockstep::checkpoint::ManifestFile file;
    file.set_manifest(rest);
    file.set_crc32c(lockstep::Crc32c(rest.data(), rest.size()));
    file_bytes = file.SerializeAsString();
    if (inner.ParseFromString(rest)) {
      // Shards with plain names get a file: "abc" (the fuzzer may match its size and CRC).
      int made = 0;
      for (const auto& shard : inner.shards()) {
        const std::string& name = shard.path();
        if (name.empty() || name.size() > 64 || name == "." || name == ".." || name == "manifest.pb" ||
            name.find_first_of(std::string("/\0", 2)) != std::string::npos || ++made > 4) {
          continue;
        }
        lockstep::fuzz::WriteWholeFile(step / name, "abc");
      }
    }
  }
  lockstep::fuzz::WriteWholeFile(step / "manifest.pb", file_bytes);

  try {
    const lockstep::FoundCheckpoint found = lockstep::CheckpointManager::Validate(step.string());
    LOCKSTEP_FUZZ_CHECK(found.manifest != nullptr, "a valid checkpoint without a manifest");
    LOCKSTEP_FUZZ_CHECK(found.world_size >= 1 && found.manifest->shards_size() == found.world_size,
                        "a valid checkpoint whose shards do not match its world size");
    for (const auto& shard : found.manifest->shards()) {
      const fs::path file = step / shard.path();
      LOCKSTEP_FUZZ_CHECK(file.parent_path() == step && fs::is_regular_file(file),
                          "a shard outside the step directory passed validation");
    }
  } catch (const lockstep::CheckpointError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "a CheckpointError without a message");
  }
  try {
    (void)lockstep::CheckpointManager::ReadManifestOnly(step.string());
  } catch (const lockstep::CheckpointError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "a CheckpointError without a message");
  }
  std::vector<std::string> skipped;
  const auto latest = lockstep::CheckpointManager::FindLatest(root.string(), &skipped);
  LOCKSTEP_FUZZ_CHECK(latest.has_value() || !skipped.empty(), "a damaged checkpoint skipped without a reason");
  return 0;
}
