// A [vocab, dim] embedding table split by columns over the ranks of a group (the
// model axis of a mesh, or a whole job), and the mean-of-bag lookup over it as a
// differentiable, communicating op.
//
// Rank r of the group's N holds columns [r * dim / N, (r + 1) * dim / N) of every
// row. A lookup works on the ids of every example of the group (each rank's
// examples, gathered first, see GatherGlobalBatch): each rank averages its column
// slice over the bag of every one of them, and one all-gather gives each rank its
// own examples with all `dim` columns. Backward is the transpose: one all-gather
// of the output gradients gives each rank the gradient of its columns for every
// example of the group, which it scatters into the rows of its shard. The result equals the unsharded
// table's lookup and gradient exactly (up to float rounding in the dense layers).
//
// SPMD rule: every rank calls GatherGlobalBatch and ShardedBagMean (and runs the
// backward of its result) in the same order, with the same `rows_per_rank`.
// Not thread-safe; the communicator is borrowed for the life of the group.
#ifndef SHARDED_EMBEDDING_COLUMN_SHARDED_EMBEDDING_H_
#define SHARDED_EMBEDDING_COLUMN_SHARDED_EMBEDDING_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>

#include "lockstep/communicator.h"

namespace sharded_embedding {

// Who takes part in a sharded lookup. Held by the autograd graph until backward
// has run, hence a CustomClassHolder (an IValue capsule in the autograd context).
struct ColumnShardGroup : torch::CustomClassHolder {
  ColumnShardGroup(lockstep::Communicator* communicator, int64_t rows_per_rank, lockstep::CollectiveOptions options)
      : communicator(communicator),
        rank(communicator->rank()),
        world_size(communicator->world_size()),
        rows_per_rank(rows_per_rank),
        options(options) {}

  lockstep::Communicator* communicator;  // Not owned.
  int rank;
  int world_size;
  // Every rank's slice of a global batch is padded to this many examples, so that
  // the all-gathers see equal sizes: ceil(global batch size / world size).
  int64_t rows_per_rank;
  lockstep::CollectiveOptions options;
};

// The global batch, as every rank sees it after GatherGlobalBatch.
struct GlobalBatch {
  at::Tensor ids;      // int64 [world_size * rows_per_rank, bag]; padding rows are -1
  at::Tensor targets;  // int64 [world_size * rows_per_rank]; padding rows are -1
  at::Tensor valid;    // bool  [world_size * rows_per_rank]
  int64_t num_examples = 0;  // real (unpadded) examples over all ranks
};

// All-gathers every rank's token ids [n, bag] and targets [n] (n <= rows_per_rank).
// Rank r's examples are rows [r * rows_per_rank, r * rows_per_rank + n).
// Errors: lockstep::InvalidArgumentError for n > rows_per_rank or bad shapes;
// lockstep::CollectiveError / CollectiveTimeoutError from the all-gather.
GlobalBatch GatherGlobalBatch(const ColumnShardGroup& group, const at::Tensor& ids, const at::Tensor& targets);

// This rank's `rows_per_rank` rows of the global batch, each the mean over its bag
// of the full-width embedding: float [rows_per_rank, dim]. `shard` is this rank's
// [vocab, dim / world_size] slice of the table and receives its gradient.
// `global_ids` comes from GatherGlobalBatch; padding ids are looked up as id 0 and
// their rows must be dropped by the caller (their gradient is then zero).
at::Tensor ShardedBagMean(const at::Tensor& shard, const at::Tensor& global_ids,
                          const c10::intrusive_ptr<ColumnShardGroup>& group);

// The unsharded reference: mean over each bag of `table` rows, [n, dim].
at::Tensor BagMean(const at::Tensor& table, const at::Tensor& ids);

}  // namespace sharded_embedding

#endif  // SHARDED_EMBEDDING_COLUMN_SHARDED_EMBEDDING_H_
