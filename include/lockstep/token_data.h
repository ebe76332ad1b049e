// Token data for language models: a flat file of tokens, memory-mapped; an
// iterator of fixed-length windows whose every position follows from (seed,
// epoch, batch, example) alone; and a prefetcher that prepares the next batches
// on a background thread while the step runs.
//
// A window of T + 1 tokens starting at s gives one example: inputs tokens
// [s, s + T), targets [s + 1, s + T + 1), both int64 [T]. Training windows start
// at positions drawn from a hash of (seed, epoch, batch in epoch, example in the
// global batch), so every rank derives its own slice of every global batch (the
// same contiguous slices as ShardedBatchIterator's) without talking to the others,
// and the position (epoch, batch in epoch) is global: it resumes on any world
// size. An epoch of training has as many global batches as cover the tokens once
// (at least one). Evaluation windows are consecutive and do not overlap: window i
// starts at i * T, one pass.
//
// TokenFile is immutable and may be shared; iterators are not thread-safe.
// PrefetchingIterator owns its inner iterator and a thread that alone touches it.
#ifndef LOCKSTEP_TOKEN_DATA_H_
#define LOCKSTEP_TOKEN_DATA_H_

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "lockstep/data.h"

namespace lockstep {

// A read-only memory map of a file of uint8 tokens (bytes as tokens: vocabulary 256).
class TokenFile {
 public:
  // Throws DataError naming the file when it is missing, unreadable or empty.
  static std::shared_ptr<const TokenFile> Open(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  TokenFile(std::string path, const uint8_t* data, int64_t size) : path_(std::move(path)), data_(data), size_(size) {}
  const std::string path_;
  const uint8_t* const data_;
  const int64_t size_;
};

struct TokenWindowOptions {
  int64_t sequence_length = 64;  // T
  int64_t global_batch_size = 32;
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
  // true: training windows at hashed positions; false: consecutive evaluation windows.
  bool random_windows = true;
  // Stop after this many epochs; -1 runs forever (training), 1 is one pass (eval).
  int64_t num_epochs = -1;
};

class TokenWindowIterator final : public BatchIterator {
 public:
  // Throws InvalidArgumentError for a non-positive length or batch, a rank outside
  // [0, world_size), or a file shorter than one window of T + 1 tokens.
  TokenWindowIterator(std::shared_ptr<const TokenFile> tokens, TokenWindowOptions options);

  std::optional<Batch> Next() override;
  std::optional<IteratorPosition> SavePosition() const override { return position_; }
  // Throws InvalidArgumentError for a position outside the epoch.
  void RestorePosition(const IteratorPosition& position) override;

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // The non-overlapping windows of `sequence_length` + 1 tokens (each window's
  // last token is the next one's first) that a file of `tokens` tokens holds.
  // Throws InvalidArgumentError when `sequence_length` is not positive.
  static int64_t Windows(int64_t tokens, int64_t sequence_length);
  // The first token of global example `example` of global batch `batch` of `epoch`.
  int64_t WindowStart(int64_t epoch, int64_t batch, int64_t example) const;

 private:
  const std::shared_ptr<const TokenFile> tokens_;
  const TokenWindowOptions options_;
  int64_t windows_ = 0;  // evaluation: non-overlapping windows in the file
  int64_t batches_per_epoch_ = 0;
  IteratorPosition position_;
};

// Runs `inner` on a background thread, `depth` batches ahead. Next() hands them
// out in order; SavePosition() is the position after the last batch handed out
// (not after the ones prepared), so checkpoints are exact. RestorePosition stops
// the thread, restores `inner` and starts again. An exception of `inner` reaches
// the caller from the Next() that would have returned that batch.
class PrefetchingIterator final : public BatchIterator {
 public:
  // Throws InvalidArgumentError when depth < 1 or `inner` cannot save its position.
  PrefetchingIterator(std::unique_ptr<BatchIterator> inner, int depth = 2);
  ~PrefetchingIterator() override;

  std::optional<Batch> Next() override;
  std::optional<IteratorPosition> SavePosition() const override { return position_; }
  void RestorePosition(const IteratorPosition& position) override;

  // Seconds Next() has waited for the background thread, in all.
  double wait_seconds() const { return wait_seconds_; }

 private:
  struct Item {
    std::optional<Batch> batch;  // nullopt: the end
    IteratorPosition after;
    std::exception_ptr error;
  };
  void Start();
  void Stop();
  void Work();
  bool RoomOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || ready_.size() < depth_; }
  bool HasReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.empty(); }

  const std::unique_ptr<BatchIterator> inner_;
  const size_t depth_;
  IteratorPosition position_;
  double wait_seconds_ = 0;

  absl::Mutex mu_;
  std::deque<Item> ready_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_TOKEN_DATA_H_
