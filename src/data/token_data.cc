#include "lockstep/token_data.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

uint64_t Mix(uint64_t x) {  // SplitMix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void RequirePositiveLength(int64_t sequence_length) {
  if (sequence_length <= 0) throw InvalidArgumentError("token windows: sequence_length must be positive");
}

}  // namespace

std::shared_ptr<const TokenFile> TokenFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(absl::StrCat("cannot open token file '", path, "': ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(absl::StrCat("token file '", path, "' is not a regular file"));
  }
  if (st.st_size == 0) {
    ::close(fd);
    throw DataError(absl::StrCat("token file '", path, "' is empty"));
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    throw DataError(absl::StrCat("cannot map token file '", path, "': ", std::strerror(mmap_errno)));
  }
  return std::shared_ptr<const TokenFile>(
      new TokenFile(path, static_cast<const uint8_t*>(map), static_cast<int64_t>(st.st_size)));
}

TokenFile::~TokenFile() { ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_)); }

int64_t TokenWindowIterator::Windows(int64_t tokens, int64_t sequence_length) {
  RequirePositiveLength(sequence_length);
  return (tokens - 1) / sequence_length;
}

TokenWindowIterator::TokenWindowIterator(std::shared_ptr<const TokenFile> tokens, TokenWindowOptions options)
    : tokens_(std::move(tokens)), options_(options) {
  const TokenWindowOptions& o = options_;
  RequirePositiveLength(o.sequence_length);  // checked first: the message names the field a config got wrong
  if (o.global_batch_size <= 0) throw InvalidArgumentError("token windows: global_batch_size must be positive");
  if (o.world_size <= 0 || o.rank < 0 || o.rank >= o.world_size) {
    throw InvalidArgumentError(absl::StrCat("token windows: rank ", o.rank, " outside a world of ", o.world_size));
  }
  if (tokens_ == nullptr || tokens_->size() < o.sequence_length + 1) {
    throw InvalidArgumentError(absl::StrCat("token windows: '", tokens_ ? tokens_->path() : "", "' has ",
                                            tokens_ ? tokens_->size() : 0, " tokens, fewer than one window of ",
                                            o.sequence_length + 1));
  }
  windows_ = Windows(tokens_->size(), o.sequence_length);
  batches_per_epoch_ = o.random_windows ? std::max<int64_t>(1, windows_ / o.global_batch_size)
                                        : (windows_ + o.global_batch_size - 1) / o.global_batch_size;
}

int64_t TokenWindowIterator::WindowStart(int64_t epoch, int64_t batch, int64_t example) const {
  if (!options_.random_windows) return (batch * options_.global_batch_size + example) * options_.sequence_length;
  uint64_t h = Mix(options_.seed);
  h = Mix(h ^ static_cast<uint64_t>(epoch));
  h = Mix(h ^ static_cast<uint64_t>(batch));
  h = Mix(h ^ static_cast<uint64_t>(example));
  const uint64_t starts = static_cast<uint64_t>(tokens_->size() - options_.sequence_length);  // s + T + 1 <= size
  return static_cast<int64_t>(h % starts);
}

std::optional<Batch> TokenWindowIterator::Next() {
  if (options_.num_epochs >= 0 && position_.epoch >= options_.num_epochs) return std::nullopt;
  // The examples of this global batch, and this rank's contiguous slice of them.
  const int64_t in_batch =
      options_.random_windows
          ? options_.global_batch_size
          : std::min(options_.global_batch_size, windows_ - position_.batch_in_epoch * options_.global_batch_size);
  const auto [begin, end] = ShardedBatchIterator::ShardRange(in_batch, in_batch, 0, options_.rank, options_.world_size);
  const int64_t n = end - begin, t = options_.sequence_length;
  at::Tensor windows = at::empty({n, t + 1}, at::kLong);
  int64_t* out = windows.data_ptr<int64_t>();
  const uint8_t* tokens = tokens_->data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = WindowStart(position_.epoch, position_.batch_in_epoch, begin + i);
    for (int64_t k = 0; k <= t; ++k) out[i * (t + 1) + k] = tokens[start + k];
  }
  if (++position_.batch_in_epoch >= batches_per_epoch_) {
    ++position_.epoch;
    position_.batch_in_epoch = 0;
  }
  return Batch{windows.narrow(1, 0, t).contiguous(), windows.narrow(1, 1, t).contiguous(), {}};
}

void TokenWindowIterator::RestorePosition(const IteratorPosition& position) {
  if (position.epoch < 0 || position.batch_in_epoch < 0 || position.batch_in_epoch >= batches_per_epoch_) {
    throw InvalidArgumentError(absl::StrCat("token windows: position (epoch ", position.epoch, ", batch ",
                                            position.batch_in_epoch, ") is outside an epoch of ",
                                            batches_per_epoch_, " batches"));
  }
  position_ = position;
}

PrefetchingIterator::PrefetchingIterator(std::unique_ptr<BatchIterator> inner, int depth)
    : inner_(std::move(inner)), depth_(static_cast<size_t>(depth)) {
  if (depth < 1) throw InvalidArgumentError("PrefetchingIterator: depth must be >= 1");
  std::optional<IteratorPosition> start = inner_ ? inner_->SavePosition() : std::nullopt;
  if (!start) throw InvalidArgumentError("PrefetchingIterator: the inner iterator cannot save its position");
  position_ = *start;
  Start();
}

PrefetchingIterator::~PrefetchingIterator() { Stop(); }

void PrefetchingIterator::Start() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = false;
    ready_.clear();
  }
  worker_ = std::thread([this] { Work(); });
}

void PrefetchingIterator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (worker_.joinable()) worker_.join();
}

void PrefetchingIterator::Work() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PrefetchingIterator::RoomOrStopping));
      if (stopping_) return;
    }
    Item item;
    try {
      item.batch = inner_->Next();
      item.after = inner_->SavePosition().value_or(IteratorPosition{});
    } catch (...) {
      item.error = std::current_exception();
    }
    const bool last = !item.batch.has_value() || item.error != nullptr;
    {
      absl::MutexLock lock(&mu_);
      ready_.push_back(std::move(item));
    }
    if (last) return;
  }
}

std::optional<Batch> PrefetchingIterator::Next() {
  const auto start = std::chrono::steady_clock::now();
  Item item;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &PrefetchingIterator::HasReady));
    item = ready_.front();
    // The end and an error stay in place: every later call sees them too.
    if (item.batch.has_value() && item.error == nullptr) ready_.pop_front();
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (item.error) std::rethrow_exception(item.error);
  if (item.batch) position_ = item.after;
  return item.batch;
}

void PrefetchingIterator::RestorePosition(const IteratorPosition& position) {
  Stop();
  try {
    inner_->RestorePosition(position);
  } catch (...) {
    inner_->RestorePosition(position_);  // back where the caller stood: what was prepared is gone
    Start();
    throw;
  }
  position_ = position;
  Start();
}

}  // namespace lockstep
