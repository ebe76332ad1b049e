// Fuzzes loading a shard whose manifest entry matches it (CheckpointManager::Restore
// after Validate): the shard's content is what a different program, a hand-made
// file or a damaged-but-rechecksummed copy could hold. The input is the shard file;
// the harness writes a manifest whose size and CRC32C match it, for a small MLP with
// Adam. Properties: any shard is restored or refused with a CheckpointError or an
// InvalidArgumentError naming the problem; never a crash or another exception.
//
// LOCKSTEP_FUZZ_WRITE_SEED=<file>: writes a valid shard of this model there, and its
// manifest file to <file>.manifest, and exits (how the seeds of this target and of
// checkpoint_manifest_fuzzer were made).
#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "fuzz_util.h"
#include "lockstep/checkpoint.h"
#include "lockstep/errors.h"
#include "lockstep/hashing.h"
#include "lockstep/models.h"
#include "proto/checkpoint.pb.h"

namespace fs = std::filesystem;

namespace {

struct Fixture {
  lockstep::TrainState state;
  std::unique_ptr<lockstep::CheckpointManager> manager;
  lockstep::checkpoint::Manifest manifest;  // of a real save; the shard entry is rewritten per input
  fs::path step_dir;
  std::string shard_name;
};

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

Fixture& GetFixture() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    at::manual_seed(1);
    lockstep::ModelOptions model;
    model.name = "mlp";
    model.height = 4;
    model.width = 4;
    model.hidden_units = 8;
    model.num_classes = 3;
    f->state.model = lockstep::BuildModel(model).module;
    f->state.optimizer =
        std::make_shared<torch::optim::Adam>(f->state.model->parameters(), torch::optim::AdamOptions(0.01));
    lockstep::CheckpointOptions options;
    options.directory = (lockstep::fuzz::ScratchDir() / "checkpoints").string();
    options.async = false;
    options.config_text = "fuzz";
    options.config_fingerprint = 7;
    f->manager = std::make_unique<lockstep::CheckpointManager>(options, /*rank=*/0, /*world_size=*/1, nullptr);
    f->state.step = 5;
    f->manager->Save(f->state, lockstep::ShardExtras{}, {});
    const std::optional<lockstep::FoundCheckpoint> found =
        lockstep::CheckpointManager::FindLatest(options.directory, nullptr);
    if (!found) {
      std::fprintf(stderr, "fuzz harness: the fixture's own checkpoint is not valid\n");
      std::abort();
    }
    f->manifest = *found->manifest;
    f->step_dir = found->path;
    f->shard_name = f->manifest.shards(0).path();
    if (const char* seed = std::getenv("LOCKSTEP_FUZZ_WRITE_SEED")) {
      lockstep::fuzz::WriteWholeFile(seed, ReadBytes(f->step_dir / f->shard_name));
      lockstep::fuzz::WriteWholeFile(std::string(seed) + ".manifest", ReadBytes(f->step_dir / "manifest.pb"));
      std::_Exit(0);  // not exit(): libFuzzer counts that as a finding
    }
    return f;
  }();
  return *fixture;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = GetFixture();
  const std::string shard(reinterpret_cast<const char*>(data), size);
  lockstep::fuzz::WriteWholeFile(f.step_dir / f.shard_name, shard);
  auto manifest = std::make_shared<lockstep::checkpoint::Manifest>(f.manifest);
  manifest->mutable_shards(0)->set_bytes(static_cast<int64_t>(size));
  manifest->mutable_shards(0)->set_crc32c(lockstep::Crc32c(shard.data(), shard.size()));
  const lockstep::FoundCheckpoint found{f.step_dir.string(), manifest->step(), 1, manifest};
  try {
    (void)f.manager->Restore(found, f.state);
  } catch (const lockstep::CheckpointError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "a CheckpointError without a message");
  } catch (const lockstep::InvalidArgumentError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "an InvalidArgumentError without a message");
  }
  return 0;
}
