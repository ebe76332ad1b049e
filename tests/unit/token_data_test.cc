// Token data (include/lockstep/token_data.h): the memory-mapped file, windows
// whose positions follow from (seed, epoch, batch, example) so that N ranks
// together see exactly the global batch of 1 process and a saved position
// resumes on another world size, consecutive evaluation windows, the prefetcher's
// order, exact positions and errors, and bad input named.
#include "lockstep/token_data.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/errors.h"
#include "tests/testing/temp_dir.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;

std::string WriteTokens(const testing::TempDir& dir, const std::string& text, const std::string& name = "tokens.bin") {
  const std::string path = dir.path() + "/" + name;
  std::ofstream out(path, std::ios::binary);
  out << text;
  return path;
}

std::string Text(int n) {
  std::string text;
  for (int i = 0; i < n; ++i) text.push_back(static_cast<char>('a' + (i * 7 + i / 26) % 26));
  return text;
}

TokenWindowOptions Options(int rank, int world) {
  TokenWindowOptions o;
  o.sequence_length = 8;
  o.global_batch_size = 6;
  o.rank = rank;
  o.world_size = world;
  o.seed = 5;
  return o;
}

TEST(TokenDataTest, AWindowIsInputsAndTheNextTokensAsTargets) {
  testing::TempDir dir;
  const std::string text = Text(1000);
  auto file = TokenFile::Open(WriteTokens(dir, text));
  EXPECT_EQ(file->size(), 1000);
  TokenWindowIterator it(file, Options(0, 1));
  EXPECT_EQ(it.batches_per_epoch(), (999 / 8) / 6);
  const Batch b = *it.Next();
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{6, 8}));
  ASSERT_EQ(b.targets.sizes(), (std::vector<int64_t>{6, 8}));
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t start = it.WindowStart(0, 0, i);
    ASSERT_LE(start + 9, 1000);
    for (int64_t k = 0; k < 8; ++k) {
      EXPECT_EQ(b.inputs[i][k].item<int64_t>(), static_cast<uint8_t>(text[start + k]));
      EXPECT_EQ(b.targets[i][k].item<int64_t>(), static_cast<uint8_t>(text[start + k + 1]));
    }
  }
}

TEST(TokenDataTest, RanksTogetherSeeTheGlobalBatchAndResumeOnAnotherWorldSize) {
  testing::TempDir dir;
  auto file = TokenFile::Open(WriteTokens(dir, Text(600)));  // 74 windows: epochs of 12 batches
  TokenWindowIterator one(file, Options(0, 1));
  ASSERT_EQ(one.batches_per_epoch(), 12);
  std::vector<at::Tensor> whole;
  for (int s = 0; s < 30; ++s) whole.push_back(one.Next()->inputs);  // into the third epoch
  for (int world : {2, 3, 4}) {
    std::vector<std::unique_ptr<TokenWindowIterator>> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<TokenWindowIterator>(file, Options(r, world)));
    for (int s = 0; s < 30; ++s) {
      if (s == 13) {  // save on `world` ranks, resume on 5
        const IteratorPosition at = *ranks[0]->SavePosition();
        ranks.clear();
        for (int r = 0; r < 5; ++r) {
          ranks.push_back(std::make_unique<TokenWindowIterator>(file, Options(r, 5)));
          ranks.back()->RestorePosition(at);
        }
      }
      std::vector<at::Tensor> parts;
      for (auto& r : ranks) parts.push_back(r->Next()->inputs);
      EXPECT_TRUE(at::equal(at::cat(parts), whole[s])) << world << " ranks, step " << s;
    }
  }
  // Another seed, other windows.
  TokenWindowOptions other = Options(0, 1);
  other.seed = 6;
  TokenWindowIterator reseeded(file, other);
  EXPECT_FALSE(at::equal(reseeded.Next()->inputs, whole[0]));
}

TEST(TokenDataTest, EvaluationWindowsAreConsecutiveAndEndAfterOnePass) {
  testing::TempDir dir;
  const std::string text = Text(100);  // 99 / 8 = 12 windows: batches of 6 and 6
  auto file = TokenFile::Open(WriteTokens(dir, text));
  TokenWindowOptions o = Options(1, 2);
  o.random_windows = false;
  o.num_epochs = 1;
  TokenWindowIterator it(file, o);
  EXPECT_EQ(it.batches_per_epoch(), 2);
  const Batch first = *it.Next();  // rank 1: windows 3, 4, 5
  ASSERT_EQ(first.inputs.size(0), 3);
  EXPECT_EQ(first.inputs[0][0].item<int64_t>(), static_cast<uint8_t>(text[24]));
  EXPECT_EQ(first.targets[2][7].item<int64_t>(), static_cast<uint8_t>(text[48]));
  ASSERT_TRUE(it.Next().has_value());
  EXPECT_FALSE(it.Next().has_value());
}

TEST(TokenDataTest, ThePrefetcherGivesTheSameBatchesAndExactPositions) {
  testing::TempDir dir;
  auto file = TokenFile::Open(WriteTokens(dir, Text(2000)));
  TokenWindowIterator plain(file, Options(1, 2));
  PrefetchingIterator ahead(std::make_unique<TokenWindowIterator>(file, Options(1, 2)), 3);
  for (int s = 0; s < 10; ++s) {
    EXPECT_TRUE(at::equal(ahead.Next()->inputs, plain.Next()->inputs)) << s;
    EXPECT_EQ(*ahead.SavePosition(), *plain.SavePosition()) << s;  // not the prepared ones' position
  }
  const IteratorPosition at{0, 3};
  ahead.RestorePosition(at);
  plain.RestorePosition(at);
  EXPECT_TRUE(at::equal(ahead.Next()->inputs, plain.Next()->inputs));
  EXPECT_THAT([&] { ahead.RestorePosition(IteratorPosition{0, 1000}); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("outside an epoch")));
  // Still where it stood.
  EXPECT_TRUE(at::equal(ahead.Next()->inputs, plain.Next()->inputs));
  EXPECT_GE(ahead.wait_seconds(), 0.0);
}

TEST(TokenDataTest, ThePrefetcherEndsAndPassesOnErrors) {
  testing::TempDir dir;
  auto file = TokenFile::Open(WriteTokens(dir, Text(100)));
  TokenWindowOptions o = Options(0, 1);
  o.random_windows = false;
  o.num_epochs = 1;
  PrefetchingIterator ahead(std::make_unique<TokenWindowIterator>(file, o));
  EXPECT_TRUE(ahead.Next().has_value());
  EXPECT_TRUE(ahead.Next().has_value());
  EXPECT_FALSE(ahead.Next().has_value());
  EXPECT_FALSE(ahead.Next().has_value());

  class Failing : public BatchIterator {
   public:
    std::optional<Batch> Next() override { throw DataError("disk gone"); }
    std::optional<IteratorPosition> SavePosition() const override { return IteratorPosition{}; }
  };
  PrefetchingIterator failing(std::make_unique<Failing>());
  EXPECT_THAT([&] { failing.Next(); }, ::testing::ThrowsMessage<DataError>(HasSubstr("disk gone")));
  EXPECT_THAT([&] { failing.Next(); }, ::testing::ThrowsMessage<DataError>(HasSubstr("disk gone")));

  class NoPosition : public BatchIterator {
   public:
    std::optional<Batch> Next() override { return std::nullopt; }
  };
  EXPECT_THAT([&] { PrefetchingIterator p(std::make_unique<NoPosition>()); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("cannot save its position")));
}

TEST(TokenDataTest, BadInputIsNamed) {
  testing::TempDir dir;
  EXPECT_THAT([&] { TokenFile::Open(dir.path() + "/missing.bin"); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("missing.bin")));
  EXPECT_THAT([&] { TokenFile::Open(WriteTokens(dir, "", "empty.bin")); },
              ::testing::ThrowsMessage<DataError>(HasSubstr("empty")));
  auto file = TokenFile::Open(WriteTokens(dir, "short", "short.bin"));
  EXPECT_THAT([&] { TokenWindowIterator it(file, Options(0, 1)); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("fewer than one window of 9")));
  auto ok = TokenFile::Open(WriteTokens(dir, Text(100), "ok.bin"));
  EXPECT_THAT([&] { TokenWindowIterator it(ok, Options(2, 2)); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("rank 2 outside a world of 2")));
  EXPECT_EQ(TokenWindowIterator::Windows(101, 10), 10);
  EXPECT_THAT([] { TokenWindowIterator::Windows(101, 0); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("sequence_length must be positive")));
}

}  // namespace
}  // namespace lockstep
