#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "lockstep/data.h"
#include "lockstep/errors.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;

using testing::TempDir;

std::string IdxBytes(uint8_t type, const std::vector<uint32_t>& shape, const std::string& body) {
  std::string bytes = {0, 0, static_cast<char>(type), static_cast<char>(shape.size())};
  for (uint32_t d : shape) {
    for (int s = 24; s >= 0; s -= 8) bytes.push_back(static_cast<char>((d >> s) & 0xFF));
  }
  return bytes + body;
}

void WriteGz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

void WritePlain(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(IdxReaderTest, ReadsGzippedUint8) {
  TempDir dir;
  std::string body;
  for (int i = 0; i < 2 * 3 * 4; ++i) body.push_back(static_cast<char>(i * 10));
  WriteGz(dir.file("a.gz"), IdxBytes(0x08, {2, 3, 4}, body));
  const at::Tensor t = ReadIdxFile(dir.file("a.gz"));
  EXPECT_EQ(t.scalar_type(), at::kByte);
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(t[1][2][3].item<int>(), 23 * 10);
  EXPECT_EQ(t[0][0][1].item<int>(), 10);
}

TEST(IdxReaderTest, ReadsUncompressedBigEndianInt32) {
  TempDir dir;
  const std::string body = {0, 0, 1, 2, static_cast<char>(0xFF), static_cast<char>(0xFF), static_cast<char>(0xFF),
                            static_cast<char>(0xFE)};
  WritePlain(dir.file("b"), IdxBytes(0x0C, {2}, body));
  const at::Tensor t = ReadIdxFile(dir.file("b"));
  EXPECT_EQ(t.scalar_type(), at::kInt);
  EXPECT_EQ(t[0].item<int>(), 258);
  EXPECT_EQ(t[1].item<int>(), -2);
}

TEST(IdxReaderTest, RejectsMalformedFiles) {
  TempDir dir;
  WritePlain(dir.file("magic"), std::string("\x01\x00\x08\x01\x00\x00\x00\x01x", 9));
  WriteGz(dir.file("short.gz"), IdxBytes(0x08, {10}, "abc"));
  WriteGz(dir.file("type.gz"), IdxBytes(0x07, {1}, "a"));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("magic")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("bad magic number")));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("short.gz")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("header says")));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("type.gz")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("unknown type code 7")));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("missing.gz")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("missing.gz")));
}

// Found by fuzz/idx_fuzzer: a header whose dimensions multiply past 2^64 once
// wrapped around to the file's size; no values at all copied into a null pointer.
TEST(IdxReaderTest, HeadersThatOverflowOrHoldNoValues) {
  TempDir dir;
  // 2^32-1 x 2^32-1 x 2^32-1 x 2 values wraps around; so does 2^33 x 2^31 bytes.
  WritePlain(dir.file("overflow"), IdxBytes(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 2}, "ab"));
  WritePlain(dir.file("wraps"), IdxBytes(0x0E, {0x80000000u, 0x80000000u, 4}, ""));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("overflow")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("4294967295x4294967295x4294967295x2 values")));
  EXPECT_THAT([&] { ReadIdxFile(dir.file("wraps")); }, ::testing::ThrowsMessage<DataError>(HasSubstr("header says")));
  WritePlain(dir.file("empty"), IdxBytes(0x0D, {3, 0}, ""));
  const at::Tensor t = ReadIdxFile(dir.file("empty"));
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(t.scalar_type(), at::kFloat);
}

TEST(FashionMnistTest, LoadsBothSplitsFromTheDebianPackage) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(dir + "/t10k-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed at " << dir;
  }
  const TensorDataset test = LoadFashionMnist(dir, Split::kTest);
  EXPECT_EQ(test.inputs.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(test.targets.sizes(), (std::vector<int64_t>{10000}));
  EXPECT_EQ(test.targets.min().item<int64_t>(), 0);
  EXPECT_EQ(test.targets.max().item<int64_t>(), 9);
  // Normalised with the training-set statistics: close to zero mean, unit variance.
  EXPECT_NEAR(test.inputs.mean().item<double>(), 0.0, 0.05);
  EXPECT_NEAR(test.inputs.std().item<double>(), 1.0, 0.05);
  EXPECT_EQ(test.targets.bincount().min().item<int64_t>(), 1000);  // balanced classes
}

TEST(FashionMnistTest, MissingFolderNamesTheFile) {
  EXPECT_THAT([] { LoadFashionMnist("/nonexistent/fmnist", Split::kTrain); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("/nonexistent/fmnist/train-images-idx3-ubyte.gz")));
}

TEST(SyntheticDatasetTest, IsDeterministicAndLearnable) {
  SyntheticOptions o;
  o.num_examples = 64;
  o.seed = 3;
  const TensorDataset a = MakeSyntheticDataset(o);
  const TensorDataset b = MakeSyntheticDataset(o);
  EXPECT_TRUE(a.inputs.equal(b.inputs));
  EXPECT_TRUE(a.targets.equal(b.targets));
  o.seed = 4;
  const TensorDataset c = MakeSyntheticDataset(o);
  EXPECT_FALSE(a.inputs.equal(c.inputs));
  EXPECT_LT(a.targets.min().item<int64_t>(), a.targets.max().item<int64_t>());  // not a constant label
}

// Every example of an epoch appears exactly once across all ranks, and every rank
// takes the same number of steps.
TEST(ShardedBatchIteratorTest, EachExampleExactlyOncePerEpochForWorldSizes1To5) {
  for (const int64_t n : {37, 40, 3}) {
    const auto dataset = testing::TinyDataset(n);
    for (int world = 1; world <= 5; ++world) {
      for (const int64_t batch : {int64_t{8}, int64_t{5}}) {
        std::map<int64_t, int> seen;
        std::set<int64_t> steps_per_rank;
        for (int rank = 0; rank < world; ++rank) {
          ShardingOptions o;
          o.global_batch_size = batch;
          o.rank = rank;
          o.world_size = world;
          o.seed = 11;
          o.num_epochs = 1;
          ShardedBatchIterator it(dataset, o);
          int64_t steps = 0;
          while (true) {
            const std::vector<int64_t> indices = it.PeekIndices();
            std::optional<Batch> b = it.Next();
            if (!b) break;
            ASSERT_EQ(b->size(), static_cast<int64_t>(indices.size()));
            for (int64_t i : indices) ++seen[i];
            ++steps;
          }
          steps_per_rank.insert(steps);
        }
        SCOPED_TRACE("n=" + std::to_string(n) + " world=" + std::to_string(world) + " batch=" + std::to_string(batch));
        EXPECT_EQ(static_cast<int64_t>(seen.size()), n);
        for (const auto& [index, count] : seen) EXPECT_EQ(count, 1) << "example " << index;
        EXPECT_EQ(steps_per_rank.size(), 1u) << "ranks disagree on steps per epoch";
      }
    }
  }
}

TEST(ShardedBatchIteratorTest, ShuffleDependsOnSeedAndEpochOnly) {
  const auto dataset = testing::TinyDataset(50);
  ShardingOptions o;
  o.global_batch_size = 50;
  o.seed = 5;
  ShardedBatchIterator a(dataset, o);
  ShardedBatchIterator b(dataset, o);
  const std::vector<int64_t> a0 = a.PeekIndices();
  EXPECT_EQ(a0, b.PeekIndices());
  a.Next();
  EXPECT_NE(a0, a.PeekIndices()) << "epoch 1 should be a different permutation";
  o.seed = 6;
  ShardedBatchIterator c(dataset, o);
  EXPECT_NE(a0, c.PeekIndices());
  o.shuffle = false;
  ShardedBatchIterator d(dataset, o);
  std::vector<int64_t> in_order(50);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(d.PeekIndices(), in_order);
}

TEST(ShardedBatchIteratorTest, RestoredPositionContinuesExactly) {
  const auto dataset = testing::TinyDataset(29);
  ShardingOptions o;
  o.global_batch_size = 6;
  o.rank = 1;
  o.world_size = 2;
  o.seed = 9;
  ShardedBatchIterator original(dataset, o);
  for (int i = 0; i < 7; ++i) original.Next();  // into the second epoch
  const IteratorPosition saved = original.position();
  EXPECT_EQ(saved, (IteratorPosition{1, 2}));
  ShardedBatchIterator restored(dataset, o);
  restored.Restore(saved);
  for (int i = 0; i < 12; ++i) {
    std::optional<Batch> a = original.Next();
    std::optional<Batch> b = restored.Next();
    ASSERT_TRUE(a && b);
    EXPECT_TRUE(a->inputs.equal(b->inputs)) << "batch " << i;
    EXPECT_TRUE(a->targets.equal(b->targets)) << "batch " << i;
  }
  EXPECT_EQ(original.position(), restored.position());
  EXPECT_THROW(restored.Restore(IteratorPosition{0, 5}), InvalidArgumentError);
}

TEST(ShardedBatchIteratorTest, RejectsBadOptions) {
  const auto dataset = testing::TinyDataset(10);
  ShardingOptions o;
  o.global_batch_size = 0;
  EXPECT_THROW(ShardedBatchIterator(dataset, o), InvalidArgumentError);
  o.global_batch_size = 4;
  o.rank = 2;
  o.world_size = 2;
  EXPECT_THROW(ShardedBatchIterator(dataset, o), InvalidArgumentError);
}

TEST(ShardedBatchIteratorTest, DropRemainderSkipsTheShortBatch) {
  const auto dataset = testing::TinyDataset(10);
  ShardingOptions o;
  o.global_batch_size = 4;
  o.drop_remainder = true;
  o.num_epochs = 1;
  ShardedBatchIterator it(dataset, o);
  int batches = 0;
  while (std::optional<Batch> b = it.Next()) {
    EXPECT_EQ(b->size(), 4);
    ++batches;
  }
  EXPECT_EQ(batches, 2);
}

}  // namespace
}  // namespace lockstep
