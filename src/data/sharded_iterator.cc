#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "lockstep/data.h"
#include "lockstep/errors.h"

namespace lockstep {

void BatchIterator::RestorePosition(const IteratorPosition& position) {
  (void)position;
  throw InvalidArgumentError("this batch iterator cannot restore a saved position");
}

ShardedBatchIterator::ShardedBatchIterator(std::shared_ptr<const TensorDataset> dataset,
                                           ShardingOptions options)
    : dataset_(std::move(dataset)), options_(options) {
  if (!dataset_ || dataset_->size() == 0) throw InvalidArgumentError("ShardedBatchIterator: empty dataset");
  if (options_.global_batch_size <= 0) {
    throw InvalidArgumentError("ShardedBatchIterator: global_batch_size must be positive, got " +
                               std::to_string(options_.global_batch_size));
  }
  if (options_.world_size <= 0 || options_.rank < 0 || options_.rank >= options_.world_size) {
    throw InvalidArgumentError("ShardedBatchIterator: rank " + std::to_string(options_.rank) +
                               " is outside a world of " + std::to_string(options_.world_size));
  }
  if (options_.drop_remainder && dataset_->size() < options_.global_batch_size) {
    throw InvalidArgumentError("ShardedBatchIterator: drop_remainder with a dataset of " +
                               std::to_string(dataset_->size()) + " examples, smaller than one batch");
  }
}

int64_t ShardedBatchIterator::batches_per_epoch() const {
  const int64_t n = dataset_->size();
  const int64_t b = options_.global_batch_size;
  return options_.drop_remainder ? n / b : (n + b - 1) / b;
}

std::pair<int64_t, int64_t> ShardedBatchIterator::ShardRange(int64_t dataset_size, int64_t global_batch_size,
                                                             int64_t batch_in_epoch, int rank, int world_size) {
  const int64_t begin = batch_in_epoch * global_batch_size;
  const int64_t size = std::max<int64_t>(0, std::min(global_batch_size, dataset_size - begin));
  return {begin + size * rank / world_size, begin + size * (rank + 1) / world_size};
}

const at::Tensor& ShardedBatchIterator::EpochOrder() {
  if (order_epoch_ != position_.epoch) {
    if (options_.shuffle) {
      // The permutation depends on (seed, epoch) only, so every rank draws the same one.
      at::Generator gen = at::detail::createCPUGenerator(options_.seed * 1000003ULL +
                                                         static_cast<uint64_t>(position_.epoch));
      order_ = at::randperm(dataset_->size(), gen, at::kLong);
    } else {
      order_ = at::arange(dataset_->size(), at::kLong);
    }
    order_epoch_ = position_.epoch;
  }
  return order_;
}

bool ShardedBatchIterator::Exhausted() const {
  return options_.num_epochs >= 0 && position_.epoch >= options_.num_epochs;
}

std::vector<int64_t> ShardedBatchIterator::PeekIndices() {
  if (Exhausted()) return {};
  const auto [begin, end] = ShardRange(dataset_->size(), options_.global_batch_size, position_.batch_in_epoch,
                                       options_.rank, options_.world_size);
  const at::Tensor slice = EpochOrder().slice(0, begin, end);
  return std::vector<int64_t>(slice.data_ptr<int64_t>(), slice.data_ptr<int64_t>() + slice.numel());
}

std::optional<Batch> ShardedBatchIterator::Next() {
  if (Exhausted()) return std::nullopt;
  const auto [begin, end] = ShardRange(dataset_->size(), options_.global_batch_size, position_.batch_in_epoch,
                                       options_.rank, options_.world_size);
  Batch batch = dataset_->Gather(EpochOrder().slice(0, begin, end));
  if (++position_.batch_in_epoch >= batches_per_epoch()) {
    position_.batch_in_epoch = 0;
    ++position_.epoch;
  }
  return batch;
}

void ShardedBatchIterator::Restore(const IteratorPosition& position) {
  if (position.epoch < 0 || position.batch_in_epoch < 0 || position.batch_in_epoch >= batches_per_epoch()) {
    throw InvalidArgumentError("ShardedBatchIterator: cannot restore to epoch " + std::to_string(position.epoch) +
                               ", batch " + std::to_string(position.batch_in_epoch) + " of " +
                               std::to_string(batches_per_epoch()));
  }
  position_ = position;
}

}  // namespace lockstep
