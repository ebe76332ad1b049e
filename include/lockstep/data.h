// Data: batches, in-memory datasets, the IDX reader for (Fashion-)MNIST, a
// deterministic synthetic dataset, and the sharded batch iterator.
//
// A ShardedBatchIterator yields this rank's share of each global batch. Each epoch
// is a permutation of the dataset drawn from (seed, epoch) alone, so every rank
// computes the same one without talking to the others; the permutation is cut into
// global batches of `global_batch_size` consecutive examples, and each global batch
// is split into `world_size` contiguous, nearly equal slices, one per rank. Across
// ranks every example of an epoch is therefore seen exactly once, and every rank
// takes the same number of steps per epoch (the last global batch may be smaller,
// and with more ranks than examples in it some ranks get an empty slice).
//
// Iterators are not thread-safe; datasets are immutable and may be shared.
#ifndef LOCKSTEP_DATA_H_
#define LOCKSTEP_DATA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lockstep {

// One (micro)batch: inputs, targets and optional per-example weights (undefined
// means every example weighs 1). Dimension 0 indexes examples in all three.
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
  at::Tensor weights;

  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

// Examples held in memory. inputs[i] and targets[i] form example i.
struct TensorDataset {
  at::Tensor inputs;
  at::Tensor targets;

  int64_t size() const { return inputs.size(0); }
  // Gathers the examples at `indices` (an int64 tensor) into a batch.
  Batch Gather(const at::Tensor& indices) const;
};

// Reads one IDX file (the MNIST format: big-endian header, then raw values),
// gzip-compressed or not. Returns a tensor of the stored type and shape.
// Throws DataError naming the file on a missing file, a bad magic number, an
// unknown type code or a truncated body.
at::Tensor ReadIdxFile(const std::string& path);

enum class Split { kTrain, kTest };

// Loads a Fashion-MNIST (or MNIST) split from `dir`: images as float32
// [N, 1, 28, 28] normalised to zero mean and unit variance (Fashion-MNIST's
// statistics), labels as int64 [N]. Accepts the .gz files or uncompressed ones.
// Throws DataError naming the missing or malformed file.
TensorDataset LoadFashionMnist(const std::string& dir, Split split);

// A deterministic synthetic classification dataset: `num_examples` images of
// shape [channels, height, width] with standard-normal pixels drawn from `seed`,
// labelled by a fixed random linear teacher (also drawn from `seed`) so that the
// task is learnable. The same arguments always give the same tensors.
struct SyntheticOptions {
  int64_t num_examples = 1024;
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t num_classes = 10;
  uint64_t seed = 0;
  // The teacher is drawn from this seed, so that train and eval splits made with
  // different `seed`s share one labelling rule.
  uint64_t teacher_seed = 0;
};
TensorDataset MakeSyntheticDataset(const SyntheticOptions& options);

// Where an iterator stands: the epoch and the index of the next global batch in it.
struct IteratorPosition {
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;

  bool operator==(const IteratorPosition& o) const {
    return epoch == o.epoch && batch_in_epoch == o.batch_in_epoch;
  }
};

// A source of batches. Next() returns nullopt when the data is exhausted.
class BatchIterator {
 public:
  virtual ~BatchIterator() = default;
  virtual std::optional<Batch> Next() = 0;

  // Iterators whose position can go into a checkpoint override both (the job
  // layer refuses to checkpoint train data that cannot). Default: nullopt, and
  // RestorePosition throws InvalidArgumentError.
  virtual std::optional<IteratorPosition> SavePosition() const { return std::nullopt; }
  virtual void RestorePosition(const IteratorPosition& position);
};

struct ShardingOptions {
  int64_t global_batch_size = 128;  // over all ranks together
  int rank = 0;
  int world_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  // Skip the last, smaller global batch of each epoch.
  bool drop_remainder = false;
  // Stop after this many epochs; -1 runs forever (training), 1 is one pass (eval).
  int64_t num_epochs = -1;
};

class ShardedBatchIterator final : public BatchIterator {
 public:
  // Throws InvalidArgumentError for a non-positive batch size, a rank outside
  // [0, world_size) or an empty dataset.
  ShardedBatchIterator(std::shared_ptr<const TensorDataset> dataset, ShardingOptions options);

  std::optional<Batch> Next() override;

  // The indices (into the dataset) of this rank's slice of the next batch, without
  // advancing. Empty when exhausted.
  std::vector<int64_t> PeekIndices();

  // Save and restore the position; Restore also works on a fresh iterator built
  // with the same dataset and options, and continues exactly where Save stood.
  IteratorPosition position() const { return position_; }
  // Throws InvalidArgumentError for a position outside the epoch.
  void Restore(const IteratorPosition& position);
  std::optional<IteratorPosition> SavePosition() const override { return position_; }
  void RestorePosition(const IteratorPosition& position) override { Restore(position); }

  int64_t batches_per_epoch() const;

  // This rank's share of global batch `batch_in_epoch`, as [begin, end) offsets
  // into the epoch's permutation. Exposed for tests and the data-parallel layer.
  static std::pair<int64_t, int64_t> ShardRange(int64_t dataset_size, int64_t global_batch_size,
                                                int64_t batch_in_epoch, int rank, int world_size);

 private:
  const at::Tensor& EpochOrder();
  bool Exhausted() const;

  // Fixed after construction.
  const std::shared_ptr<const TensorDataset> dataset_;
  const ShardingOptions options_;

  IteratorPosition position_;
  at::Tensor order_;  // permutation of the epoch in order_epoch_
  int64_t order_epoch_ = -1;
};

}  // namespace lockstep

#endif  // LOCKSTEP_DATA_H_
