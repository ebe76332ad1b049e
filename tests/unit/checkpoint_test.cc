// CheckpointManager in one process: bitwise round trips for each optimizer, sync
// and async; corrupt, truncated, partial and unfinished checkpoints skipped and
// named; retention; config and world-size checks; Python's torch.load reading our
// shards with the same values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "lockstep/checkpoint.h"
#include "lockstep/trainer.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::TempDir;

struct TrainRun {
  BuiltModel model;
  TrainState state;
};

TrainRun MakeSetup(OptimizerOptions::Kind kind, uint64_t seed) {
  TrainRun s;
  s.model = testing::TinyModel(seed);
  OptimizerOptions o;
  o.kind = kind;
  o.learning_rate = 0.05;
  o.momentum = 0.9;
  s.state = MakeTrainState(s.model.module, MakeOptimizerFactory(o));
  return s;
}

void TrainSteps(TrainRun& s, ShardedBatchIterator& data, int steps) {
  TrainerOptions options;
  options.summary_every_steps = 1000;
  Trainer trainer(s.state, s.model.apply, CrossEntropyLoss(), options, Runtime::SingleProcess());
  trainer.Train(data, steps);
}

ShardedBatchIterator Data() {
  ShardingOptions o;
  o.global_batch_size = 16;
  o.seed = 3;
  return ShardedBatchIterator(testing::TinyDataset(96), o);
}

CheckpointOptions Options(const std::string& dir, bool async = false) {
  CheckpointOptions o;
  o.directory = dir;
  o.async = async;
  o.keep_last = 100;
  o.config_text = "model { name: \"mlp\" }\n";
  o.config_fingerprint = 1234;
  return o;
}

void ExpectSameTensors(const torch::nn::Module& a, const torch::nn::Module& b) {
  const auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i])) << "parameter " << i;
}

class RoundTripTest : public ::testing::TestWithParam<std::tuple<OptimizerOptions::Kind, bool>> {};

TEST_P(RoundTripTest, RestoredTrainingContinuesBitForBit) {
  const auto [kind, async] = GetParam();
  TempDir dir;
  TrainRun a = MakeSetup(kind, 1);
  ShardedBatchIterator data_a = Data();
  TrainSteps(a, data_a, 3);
  {
    CheckpointManager manager(Options(dir.path(), async), 0, 1, nullptr);
    manager.Save(a.state, ShardExtras{data_a.position(), ""}, {{"test/accuracy", 0.5}});
    manager.Wait();
  }
  TrainSteps(a, data_a, 4);  // the reference continues

  TrainRun b = MakeSetup(kind, 99);  // different initial parameters, no optimizer state
  ShardedBatchIterator data_b = Data();
  CheckpointManager manager(Options(dir.path()), 0, 1, nullptr);
  std::vector<std::string> skipped;
  std::optional<FoundCheckpoint> found = CheckpointManager::FindLatest(dir.path(), &skipped);
  ASSERT_TRUE(found.has_value());
  EXPECT_TRUE(skipped.empty());
  EXPECT_EQ(found->step, 3);
  const ShardExtras extras = manager.Restore(*found, b.state);
  EXPECT_EQ(b.state.step, 3);
  data_b.Restore(extras.data);
  TrainSteps(b, data_b, 4);
  EXPECT_EQ(b.state.step, 7);
  ExpectSameTensors(*a.state.model, *b.state.model);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, RoundTripTest,
                         ::testing::Combine(::testing::Values(OptimizerOptions::Kind::kSgd,
                                                              OptimizerOptions::Kind::kAdam,
                                                              OptimizerOptions::Kind::kAdamW),
                                            ::testing::Bool()));

TEST(CheckpointTest, AsyncSaveCopiesTheStateBeforeReturning) {
  TempDir dir;
  TrainRun a = MakeSetup(OptimizerOptions::Kind::kAdam, 1);
  ShardedBatchIterator data = Data();
  TrainSteps(a, data, 2);
  const std::vector<at::Tensor> saved = testing::Snapshot(*a.state.model);
  CheckpointManager manager(Options(dir.path(), /*async=*/true), 0, 1, nullptr);
  manager.Save(a.state, ShardExtras{data.position(), ""}, {});
  {
    at::NoGradGuard no_grad;  // training goes on changing the parameters in place
    for (at::Tensor& p : a.state.model->parameters()) p.add_(1.0);
  }
  manager.Wait();
  TrainRun b = MakeSetup(OptimizerOptions::Kind::kAdam, 5);
  manager.Restore(CheckpointManager::Validate(dir.file(CheckpointDirName(2))), b.state);
  const auto restored = b.state.model->parameters();
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(at::equal(saved[i], restored[i]));
}

TEST(CheckpointTest, AnOverlappedCopyHoldsTheStateOfTheSaveOnceAwaited) {
  TempDir dir;
  TrainRun a = MakeSetup(OptimizerOptions::Kind::kAdam, 1);
  ShardedBatchIterator data = Data();
  TrainSteps(a, data, 2);
  const std::vector<at::Tensor> saved = testing::Snapshot(*a.state.model);
  CheckpointOptions options = Options(dir.path(), /*async=*/true);
  options.overlap_copy = true;
  CheckpointManager manager(options, 0, 1, nullptr);
  manager.Save(a.state, ShardExtras{data.position(), ""}, {});
  manager.AwaitSnapshot();  // from here the parameters may change
  {
    at::NoGradGuard no_grad;
    for (at::Tensor& p : a.state.model->parameters()) p.mul_(-3.0);
  }
  manager.Wait();
  TrainRun b = MakeSetup(OptimizerOptions::Kind::kAdam, 5);
  manager.Restore(CheckpointManager::Validate(dir.file(CheckpointDirName(2))), b.state);
  const auto restored = b.state.model->parameters();
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(at::equal(saved[i], restored[i]));
}

// Saves steps 1..n of a tiny model.
void SaveSteps(const std::string& dir, int n, CheckpointOptions options = {}) {
  if (options.directory.empty()) options = Options(dir);
  TrainRun s = MakeSetup(OptimizerOptions::Kind::kSgd, 1);
  ShardedBatchIterator data = Data();
  CheckpointManager manager(options, 0, 1, nullptr);
  for (int i = 0; i < n; ++i) {
    TrainSteps(s, data, 1);
    manager.Save(s.state, ShardExtras{data.position(), ""}, {{"test/accuracy", i + 1 == 3 ? 0.9 : 0.1}});
  }
  manager.Wait();
}

std::string Shard(const TempDir& dir, int step) { return dir.file(CheckpointDirName(step) + "/shard_00000.pt"); }

TEST(CheckpointTest, CorruptTruncatedAndPartialCheckpointsAreSkippedAndNamed) {
  TempDir dir;
  SaveSteps(dir.path(), 5);
  // step 5: a flipped byte in the middle of the shard
  {
    std::fstream f(Shard(dir, 5), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(Shard(dir, 5)) / 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(-1, std::ios::cur);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  // step 4: truncated
  fs::resize_file(Shard(dir, 4), fs::file_size(Shard(dir, 4)) - 100);
  // step 3: no manifest (as if the save never committed)
  fs::remove(dir.file(CheckpointDirName(3) + "/manifest.pb"));
  // step 6: an unfinished save
  fs::create_directories(dir.file(".tmp_" + CheckpointDirName(6)));

  std::vector<std::string> skipped;
  std::optional<FoundCheckpoint> found = CheckpointManager::FindLatest(dir.path(), &skipped);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 2);
  ASSERT_EQ(skipped.size(), 4u) << ::testing::PrintToString(skipped);
  EXPECT_THAT(skipped[0], HasSubstr("step_00000005/shard_00000.pt: CRC32C"));
  EXPECT_THAT(skipped[0], HasSubstr("(corrupt)"));
  EXPECT_THAT(skipped[1], HasSubstr("step_00000004/shard_00000.pt:"));
  EXPECT_THAT(skipped[1], HasSubstr("(truncated)"));
  EXPECT_THAT(skipped[2], HasSubstr("step_00000003/manifest.pb: missing"));
  EXPECT_THAT(skipped[3], HasSubstr(".tmp_step_00000006: an unfinished save"));

  // A damaged manifest.
  {
    std::fstream f(dir.file(CheckpointDirName(2) + "/manifest.pb"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.write("XX", 2);
  }
  EXPECT_THAT([&] { CheckpointManager::Validate(dir.file(CheckpointDirName(2))); },
              ::testing::ThrowsMessage<CheckpointError>(HasSubstr("step_00000002/manifest.pb")));
  skipped.clear();
  found = CheckpointManager::FindLatest(dir.path(), &skipped);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 1);
  // Restoring a shard that changed after validation fails too.
  TrainRun s = MakeSetup(OptimizerOptions::Kind::kSgd, 1);
  CheckpointManager manager(Options(dir.path()), 0, 1, nullptr);
  const FoundCheckpoint damaged = CheckpointManager::ReadManifestOnly(dir.file(CheckpointDirName(5)));
  EXPECT_THAT([&] { manager.Restore(damaged, s.state); },
              ::testing::ThrowsMessage<CheckpointError>(HasSubstr("does not match its manifest")));
}

// The `latest` file names a step directory of its own checkpoints directory, or is
// refused naming what it holds (fuzz/checkpoint_latest_fuzzer checks the same).
TEST(CheckpointTest, LatestNamesOnlyAStepDirectoryOfItsDirectory) {
  TempDir dir;
  EXPECT_EQ(CheckpointManager::ReadLatest(dir.path()), std::nullopt);
  auto write_latest = [&](const std::string& text) { std::ofstream(dir.file("latest"), std::ios::binary) << text; };
  write_latest("step_00000010\n");
  EXPECT_EQ(CheckpointManager::ReadLatest(dir.path()), dir.file("step_00000010"));
  const std::vector<std::string> bad_names = {"../step_00000010", "/etc", "step_", "step_1/../..",
                                              "step_-3", "", "\x01\x02", std::string(300, 'x')};
  for (const std::string& bad : bad_names) {
    write_latest(bad);
    EXPECT_THAT([&] { CheckpointManager::ReadLatest(dir.path()); },
                ::testing::ThrowsMessage<CheckpointError>(HasSubstr("latest"))) << bad;
  }
}

// A manifest naming '..' or a directory as a shard is refused as a CheckpointError
// (it was a std::filesystem error that nothing caught, found by
// fuzz/checkpoint_manifest_fuzzer's kind of input).
TEST(CheckpointTest, AShardThatIsNotAPlainFileIsRefused) {
  TempDir dir;
  SaveSteps(dir.path(), 1);
  const std::string step = dir.file(CheckpointDirName(1));
  fs::remove(step + "/shard_00000.pt");
  fs::create_directory(step + "/shard_00000.pt");
  EXPECT_THAT([&] { CheckpointManager::Validate(step); },
              ::testing::ThrowsMessage<CheckpointError>(HasSubstr("shard_00000.pt: not a file")));
}

TEST(CheckpointTest, KeepsTheLastKTheBestMAndPinned) {
  TempDir dir;
  CheckpointOptions options = Options(dir.path());
  options.keep_last = 2;
  options.keep_best = 1;
  options.best_metric = "test/accuracy";
  options.best_max = true;
  // Accuracy 0.9 at step 3, 0.1 elsewhere.
  SaveSteps(dir.path(), 2, options);
  fs::create_directories(dir.file(CheckpointDirName(1)));
  std::ofstream(dir.file(CheckpointDirName(1) + "/PINNED")) << "kept by hand\n";
  SaveSteps(dir.path(), 7, options);  // steps 1..7 again (same names: already committed ones stay)
  std::vector<std::string> left;
  for (const auto& item : fs::directory_iterator(dir.path())) left.push_back(item.path().filename().string());
  std::sort(left.begin(), left.end());
  // 6 and 7 (the last two), 3 (the best accuracy), 1 (pinned).
  EXPECT_THAT(left, ::testing::Contains("step_00000007"));
  EXPECT_THAT(left, ::testing::Contains("step_00000006"));
  EXPECT_THAT(left, ::testing::Contains("step_00000003"));
  EXPECT_THAT(left, ::testing::Contains("step_00000001"));
  EXPECT_THAT(left, ::testing::Contains("latest"));
  EXPECT_EQ(std::count_if(left.begin(), left.end(), [](const std::string& n) { return n.rfind("step_", 0) == 0; }), 4)
      << ::testing::PrintToString(left);
  std::ifstream latest(dir.file("latest"));
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step_00000007");
}

TEST(CheckpointTest, ADifferentConfigIsRefusedNamingTheDifference) {
  TempDir dir;
  SaveSteps(dir.path(), 1);
  CheckpointOptions other = Options(dir.path());
  other.config_text = "model { name: \"cnn\" }\n";
  other.config_fingerprint = 999;
  CheckpointManager manager(other, 0, 1, nullptr);
  TrainRun s = MakeSetup(OptimizerOptions::Kind::kSgd, 1);
  EXPECT_THAT([&] { manager.Restore(CheckpointManager::Validate(dir.file(CheckpointDirName(1))), s.state); },
              ::testing::ThrowsMessage<CheckpointError>(
                  HasSubstr("checkpoint has 'model { name: \"mlp\" }', this run has 'model { name: \"cnn\" }'")));
}

TEST(CheckpointTest, AnyWorldSizeLoadsAReplicatedCheckpointAndAPerRankLayoutOnlyItsOwn) {
  TempDir dir;
  SaveSteps(dir.path(), 1);  // world of 1, replicated
  TrainRun s = MakeSetup(OptimizerOptions::Kind::kSgd, 5);
  const FoundCheckpoint found = CheckpointManager::Validate(dir.file(CheckpointDirName(1)));
  CheckpointOptions options = Options(dir.path());
  CheckpointManager on_three(options, 2, 3, nullptr);  // rank 2 of 3 loads rank 0's replica
  EXPECT_NO_THROW(on_three.Restore(found, s.state));
  EXPECT_EQ(s.state.step, 1);
  TempDir other;
  CheckpointOptions sharded_options = Options(other.path());
  // A BaseTrainer's own layout (no table of pieces, as examples/sharded_embedding
  // writes): each rank's shard is its own state, loadable on the same world size
  // under the same partitioning, refused elsewhere and by consolidation.
  sharded_options.partitioning = "someone_elses_layout";
  SaveSteps(other.path(), 1, sharded_options);
  const FoundCheckpoint per_rank = CheckpointManager::Validate(other.file(CheckpointDirName(1)));
  s.state.step = 0;
  CheckpointManager same(sharded_options, 0, 1, nullptr);
  EXPECT_NO_THROW(same.Restore(per_rank, s.state));
  EXPECT_EQ(s.state.step, 1);
  CheckpointManager sharded(sharded_options, 0, 2, nullptr);
  EXPECT_THAT([&] { sharded.Restore(per_rank, s.state); },
              ::testing::ThrowsMessage<CheckpointError>(
                  HasSubstr("written by 1 ranks with partitioning 'someone_elses_layout' (per-rank state, no table "
                            "of its pieces), which cannot load on 2 ranks with partitioning 'someone_elses_layout'")));
  CheckpointManager replicated(Options(other.path()), 0, 1, nullptr);
  EXPECT_THAT([&] { replicated.Restore(per_rank, s.state); },
              ::testing::ThrowsMessage<CheckpointError>(HasSubstr("with partitioning 'data_parallel_replicated'")));
  EXPECT_THAT([&] { ConsolidateCheckpoint(per_rank.path, other.file("whole.pt")); },
              ::testing::ThrowsMessage<CheckpointError>(HasSubstr("cannot be consolidated")));
  EXPECT_THAT([&] { sharded.Save(s.state, ShardExtras{}, {}); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("need the coordination service")));
}

TEST(CheckpointTest, PythonTorchLoadReadsTheSameValues) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no Python PyTorch (python3-torch) at /usr/bin/python3";
  }
  TempDir dir;
  TrainRun s = MakeSetup(OptimizerOptions::Kind::kAdam, 1);
  ShardedBatchIterator data = Data();
  TrainSteps(s, data, 3);
  CheckpointManager manager(Options(dir.path()), 0, 1, nullptr);
  manager.Save(s.state, ShardExtras{data.position(), "trainer state text"}, {});
  const std::string shard = Shard(dir, 3);
  const std::string copy = dir.file("python_copy.pt");
  const std::string command = std::string("/usr/bin/python3 ") + LOCKSTEP_SOURCE_DIR +
                              "/tests/system/torch_load_roundtrip.py " + shard + " " + copy;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return torch::jit::pickle_load(bytes).toGenericDict();
  };
  const c10::impl::GenericDict ours = read(shard);
  const c10::impl::GenericDict theirs = read(copy);
  ASSERT_EQ(ours.size(), theirs.size());
  int tensors = 0;
  for (const auto& entry : ours) {
    auto other = theirs.find(entry.key());
    ASSERT_NE(other, theirs.end()) << entry.key().toStringRef();
    if (entry.value().isTensor()) {
      ++tensors;
      EXPECT_TRUE(at::equal(entry.value().toTensor(), other->value().toTensor())) << entry.key().toStringRef();
    } else {
      EXPECT_EQ(entry.value(), other->value()) << entry.key().toStringRef();
    }
  }
  EXPECT_GE(tensors, 4 + 8 + 1);  // 4 parameters, their Adam moments, the RNG state
  // And the values are the model's.
  for (const auto& item : s.state.model->named_parameters()) {
    EXPECT_TRUE(at::equal(theirs.at("model/" + item.key()).toTensor(), item.value())) << item.key();
  }
}

}  // namespace
}  // namespace lockstep
