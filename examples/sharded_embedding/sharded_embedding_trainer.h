// A bag-of-tokens text classifier whose embedding table is split by columns over
// the model axis of a data x model mesh (lockstep/mesh.h; the lookup is
// column_sharded_embedding.h), and the BaseTrainer subclass that trains it with
// its own partitioned step. Every rank has its own examples of the global batch:
//
//   gather the model group's token ids      (all-gather over mesh->model(), int64)
//   this rank's columns for every example   -> all-gather -> this rank's rows, all columns
//   replicated dense layers, loss           (summed; divided by the global count below)
//   backward: dense layers locally; the embedding through an all-gather of the
//             output gradients, so each shard gets its columns' gradient for
//             the model group's examples
//   dense gradients, loss and example count summed over every rank (one all-reduce)
//   the shard's gradient summed over the data axis (one all-reduce, data > 1 only)
//   one optimizer update on every rank      (the shard's state is the shard's)
//
// Where the table goes is the partitioner's decision from the job's rules: its
// logical axes are {"vocab", "embed"}; "embed" over "model" splits its columns
// (the default), no rule for either keeps it whole (then the model axis must be
// 1: plain data parallelism). A rule splitting "vocab" is refused: this lookup
// splits columns only.
//
// With `check` set, every rank also trains the unsharded model (the full table and
// its own copy of the dense layers) on the whole global batch and records how far
// the sharded one drifts from it.
//
// SPMD rule: every rank builds the same model (from the same seed) and trainer,
// and calls Train and Eval with the same arguments. Not thread-safe.
#ifndef SHARDED_EMBEDDING_SHARDED_EMBEDDING_TRAINER_H_
#define SHARDED_EMBEDDING_SHARDED_EMBEDDING_TRAINER_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "column_sharded_embedding.h"
#include "lockstep/communicator.h"
#include "lockstep/mesh.h"
#include "lockstep/trainer.h"

namespace sharded_embedding {

// Embedding bag (column shard) -> Linear(dim, hidden) -> ReLU -> Linear(hidden, classes).
class BagClassifierImpl : public torch::nn::Module {
 public:
  // The table's parameter name and logical axes, for the partitioner.
  static constexpr char kTableName[] = "embedding_shard";
  static lockstep::LogicalAxes TableAxes() { return {"vocab", "embed"}; }

  // Keeps this rank's slice of `full_table` [vocab, dim] under `table_layout` (the
  // partitioner's layout of kTableName): columns [i * dim / parts, (i + 1) * dim /
  // parts) for model index i when the columns are split, the whole table when it
  // is replicated. The dense layers draw their initial values from libtorch's
  // default generator, so the same seed gives the same model on every rank and
  // for every mesh. Throws lockstep::InvalidArgumentError for a layout that splits
  // the rows or does not match the table's shape.
  BagClassifierImpl(const at::Tensor& full_table, const lockstep::ParameterLayout& table_layout, int model_index,
                    int64_t hidden_dim, int64_t num_classes);

  // Logits [n, classes] from full-width bag features [n, dim].
  at::Tensor Classify(const at::Tensor& features);
  std::vector<at::Tensor> DenseParameters() const;

  at::Tensor shard;  // [vocab, dim / model-axis parts]
  int64_t column_begin = 0;  // the first of the full table's columns it holds
  torch::nn::Linear hidden{nullptr};
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(BagClassifier);

// The unsharded model with the same initial values, for the check.
struct UnshardedReference;

struct ShardedEmbeddingOptions {
  // The most examples in one global batch (the data iterator's); the per-rank
  // padding of the all-gathers is ceil(global_batch_size / mesh size).
  int64_t global_batch_size = 64;
  lockstep::CollectiveOptions collective;
  // Train the unsharded model alongside and record the differences (see check()).
  bool check = false;
  // Builds the reference's optimizer; the same kind and settings as the state's.
  lockstep::OptimizerFactory optimizer_factory;
};

// The largest differences between the sharded model and the unsharded reference
// seen so far, on this rank.
struct CheckResult {
  int64_t steps = 0;
  double max_loss_diff = 0;   // |global loss - reference loss| before each update
  double max_table_diff = 0;  // max |shard - reference table columns| after each update
  double max_dense_diff = 0;  // max |dense parameter - reference's| after each update
};

class ShardedEmbeddingTrainer : public lockstep::BaseTrainer {
 public:
  // `state.model` must be a BagClassifier built from `partitioner`'s layout; the
  // table is split over mesh->model(), its gradient summed over mesh->data(), and
  // mesh->world() combines the metrics and agrees on halting (BaseTrainer's
  // set_mesh). Mesh and partitioner are borrowed and must outlive the trainer.
  // `full_table` is only used with options.check. Throws
  // lockstep::InvalidArgumentError for a mismatched model, mesh or options.
  ShardedEmbeddingTrainer(lockstep::TrainState& state, lockstep::Runtime runtime, const lockstep::DeviceMesh* mesh,
                          const lockstep::Partitioner* partitioner, ShardedEmbeddingOptions options,
                          const at::Tensor& full_table = {});
  ~ShardedEmbeddingTrainer() override;

  // Collective (one all-reduce): the largest differences over all ranks.
  CheckResult GlobalCheckResult();

  // With check: the differences recorded so far and the unsharded reference (its
  // parameters as tensors, its optimizer as libtorch's archive), so that a resumed
  // run goes on checking exactly as an uninterrupted one. Restore throws
  // lockstep::InvalidArgumentError for state saved with or without check when this
  // trainer has the other.
  lockstep::CustomState SaveCustomState() override;
  void RestoreCustomState(const lockstep::CustomState& state) override;

 protected:
  lockstep::MetricMap TrainStep(const lockstep::Batch& batch) override;
  lockstep::MetricSums EvalStep(const lockstep::Batch& batch) override;

 private:
  BagClassifierImpl& model();
  void CompareWithReference(double global_loss, double reference_loss);

  // Fixed after construction (the mesh is BaseTrainer's: mesh()).
  const ShardedEmbeddingOptions options_;
  c10::intrusive_ptr<ColumnShardGroup> group_;        // the lookup, over mesh->model()
  c10::intrusive_ptr<ColumnShardGroup> world_group_;  // the check's global batch, over mesh->world()

  std::unique_ptr<UnshardedReference> reference_;  // with options.check
  CheckResult check_;
};

}  // namespace sharded_embedding

#endif  // SHARDED_EMBEDDING_SHARDED_EMBEDDING_TRAINER_H_
