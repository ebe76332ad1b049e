#include "column_sharded_embedding.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "lockstep/errors.h"

namespace sharded_embedding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Mean over each bag of the rows of `table` (float [vocab, width]) at `ids`
// (int64 [n, bag]), without autograd: [n, width].
at::Tensor BagMeanNoGrad(const at::Tensor& table, const at::Tensor& ids) {
  const int64_t n = ids.size(0);
  const int64_t bag = ids.size(1);
  return table.index_select(0, ids.reshape({-1})).view({n, bag, table.size(1)}).mean(1);
}

// forward: this rank's column slice of every global example's bag mean, then one
// all-gather, then this rank's rows with every rank's columns.
// backward: one all-gather of the output gradient, this rank's columns of it,
// scattered into the shard's rows.
class ShardedBagMeanFunction : public torch::autograd::Function<ShardedBagMeanFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard, const at::Tensor& global_ids,
                            const c10::intrusive_ptr<ColumnShardGroup>& group) {
    const int64_t world = group->world_size;
    const int64_t rows = group->rows_per_rank;
    const int64_t width = shard.size(1);
    if (global_ids.size(0) != world * rows) {
      throw lockstep::InvalidArgumentError("ShardedBagMean: expected " + std::to_string(world * rows) +
                                           " global rows, got " + std::to_string(global_ids.size(0)));
    }
    const at::Tensor lookup_ids = global_ids.clamp_min(0);  // padding rows read row 0
    at::Tensor partial = BagMeanNoGrad(shard, lookup_ids).contiguous();  // [world * rows, width]
    at::Tensor gathered = at::empty({world, world * rows, width}, partial.options());
    group->communicator->AllGather(gathered, partial, group->options);
    // Rank s's columns of this rank's rows sit in gathered[s, rank * rows : (rank + 1) * rows].
    at::Tensor mine = gathered.slice(1, group->rank * rows, (group->rank + 1) * rows);  // [world, rows, width]
    at::Tensor out = mine.permute({1, 0, 2}).reshape({rows, world * width});

    ctx->save_for_backward({lookup_ids});
    ctx->saved_data["group"] = at::IValue::make_capsule(group);
    ctx->saved_data["vocab"] = shard.size(0);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor lookup_ids = ctx->get_saved_variables()[0];
    auto group = c10::static_intrusive_pointer_cast<ColumnShardGroup>(ctx->saved_data["group"].toCapsule());
    const int64_t vocab = ctx->saved_data["vocab"].toInt();
    const int64_t world = group->world_size;
    const int64_t rows = group->rows_per_rank;
    const at::Tensor grad_out = grad_outputs[0].contiguous();  // [rows, world * width]
    const int64_t width = grad_out.size(1) / world;

    at::Tensor gathered = at::empty({world * rows, world * width}, grad_out.options());
    group->communicator->AllGather(gathered, grad_out, group->options);
    // The gradient of this rank's columns for every global example: [world * rows, width].
    at::Tensor grad_partial = gathered.slice(1, group->rank * width, (group->rank + 1) * width);
    const int64_t bag = lookup_ids.size(1);
    at::Tensor per_token = (grad_partial / static_cast<double>(bag)).unsqueeze(1).expand({world * rows, bag, width});
    at::Tensor grad_shard = at::zeros({vocab, width}, grad_out.options());
    grad_shard.index_add_(0, lookup_ids.reshape({-1}), per_token.reshape({-1, width}));
    return {grad_shard, at::Tensor(), at::Tensor()};
  }
};

void CheckIds(const at::Tensor& ids, const char* what) {
  if (ids.dim() != 2 || ids.scalar_type() != at::kLong) {
    throw lockstep::InvalidArgumentError(std::string(what) + ": token ids must be int64 [n, bag]");
  }
}

}  // namespace

GlobalBatch GatherGlobalBatch(const ColumnShardGroup& group, const at::Tensor& ids, const at::Tensor& targets) {
  CheckIds(ids, "GatherGlobalBatch");
  const int64_t n = ids.size(0);
  const int64_t bag = ids.size(1);
  if (n > group.rows_per_rank || targets.dim() != 1 || targets.size(0) != n) {
    throw lockstep::InvalidArgumentError("GatherGlobalBatch: " + std::to_string(n) + " examples with " +
                                         std::to_string(targets.numel()) + " targets on rank " +
                                         std::to_string(group.rank) + ", at most " +
                                         std::to_string(group.rows_per_rank) + " per rank");
  }
  // One all-gather for both: [rows_per_rank, bag + 1], the target in the last column.
  at::Tensor packed = at::full({group.rows_per_rank, bag + 1}, -1, at::kLong);
  packed.slice(0, 0, n).slice(1, 0, bag).copy_(ids);
  packed.slice(0, 0, n).select(1, bag).copy_(targets);
  at::Tensor gathered = at::empty({group.world_size * group.rows_per_rank, bag + 1}, at::kLong);
  group.communicator->AllGather(gathered, packed, group.options);

  GlobalBatch global;
  global.ids = gathered.slice(1, 0, bag);
  global.targets = gathered.select(1, bag).contiguous();
  global.valid = global.targets.ge(0);
  global.num_examples = global.valid.sum().item<int64_t>();
  return global;
}

at::Tensor ShardedBagMean(const at::Tensor& shard, const at::Tensor& global_ids,
                          const c10::intrusive_ptr<ColumnShardGroup>& group) {
  CheckIds(global_ids, "ShardedBagMean");
  return ShardedBagMeanFunction::apply(shard, global_ids, group);
}

at::Tensor BagMean(const at::Tensor& table, const at::Tensor& ids) {
  CheckIds(ids, "BagMean");
  const int64_t n = ids.size(0);
  const int64_t bag = ids.size(1);
  return table.index_select(0, ids.reshape({-1})).view({n, bag, table.size(1)}).mean(1);
}

}  // namespace sharded_embedding
