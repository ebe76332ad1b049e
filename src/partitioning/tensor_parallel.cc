#include "lockstep/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lockstep/errors.h"
#include "lockstep/linear.h"

namespace lockstep {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool Alone(Communicator* model) { return model == nullptr || model->world_size() == 1; }

// The communicator travels through the autograd context as an integer: the
// context holds IValues, and the communicator outlives every graph built on it.
int64_t Handle(Communicator* model) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(model)); }
Communicator* FromHandle(const c10::IValue& value) {
  return reinterpret_cast<Communicator*>(static_cast<intptr_t>(value.toInt()));
}

at::Tensor AllReduced(const at::Tensor& x, Communicator* model) {
  at::Tensor out = x.contiguous().clone();
  model->AllReduce(out, ReduceOp::kSum);
  return out;
}

struct CopyToModel : public torch::autograd::Function<CopyToModel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t handle) {
    ctx->saved_data["model"] = handle;
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllReduced(grads[0], FromHandle(ctx->saved_data["model"])), at::Tensor()};
  }
};

struct ReduceFromModel : public torch::autograd::Function<ReduceFromModel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t handle) {
    (void)ctx;
    return AllReduced(x, FromHandle(handle));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

struct VocabCrossEntropy : public torch::autograd::Function<VocabCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_begin, int64_t handle) {
    Communicator* model = FromHandle(handle);
    const int64_t local = logits.size(1);
    // The row maximum over every rank's columns, for a stable exponent.
    at::Tensor max = std::get<0>(logits.max(1)).contiguous();
    model->AllReduce(max, ReduceOp::kMax);
    const at::Tensor shifted = logits - max.unsqueeze(1);
    const at::Tensor exp = shifted.exp();
    at::Tensor sum = exp.sum(1).contiguous();
    // The target's shifted logit, from the rank that holds its column.
    const at::Tensor mine = (targets >= vocab_begin) & (targets < vocab_begin + local);
    const at::Tensor index = (targets - vocab_begin).masked_fill(~mine, 0);
    at::Tensor picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0).contiguous();
    // One all-reduce for both sums: [sum of exponentials, target logit] per row.
    at::Tensor both = at::stack({sum, picked}).contiguous();
    model->AllReduce(both, ReduceOp::kSum);
    sum = both[0];
    picked = both[1];
    ctx->save_for_backward({exp / sum.unsqueeze(1), index, mine});
    return sum.log() - picked;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the full row, this rank's columns
    const at::Tensor& index = saved[1];
    const at::Tensor& mine = saved[2];
    grad.scatter_add_(1, index.unsqueeze(1), -mine.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grads[0].unsqueeze(1));
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor CopyToModelParallel(const at::Tensor& x, Communicator* model) {
  if (Alone(model)) return x;
  return CopyToModel::apply(x, Handle(model));
}

at::Tensor ReduceFromModelParallel(const at::Tensor& x, Communicator* model) {
  if (Alone(model)) return x;
  return ReduceFromModel::apply(x, Handle(model));
}

at::Tensor ColumnParallelLinear(const at::Tensor& x, const at::Tensor& weight_local, const at::Tensor& bias_local,
                                Communicator* model) {
  return Linear(CopyToModelParallel(x, model), weight_local, bias_local);
}

at::Tensor RowParallelLinear(const at::Tensor& x_local, const at::Tensor& weight_local, const at::Tensor& bias,
                             Communicator* model) {
  if (Alone(model)) return Linear(x_local, weight_local, bias);
  at::Tensor y = ReduceFromModelParallel(Linear(x_local, weight_local), model);
  return bias.defined() ? y + bias : y;
}

at::Tensor VocabParallelEmbedding(const at::Tensor& tokens, const at::Tensor& weight_local, int64_t vocab_begin,
                                  Communicator* model) {
  // Alone, at::embedding checks the tokens itself; split, a token outside every
  // rank's rows would be masked to zeros, so they are checked here (two host
  // syncs, on the split path only).
  if (Alone(model)) return at::embedding(weight_local, tokens);
  const int64_t local = weight_local.size(0);
  const int64_t vocab = local * model->world_size();
  if (tokens.numel() > 0) {
    const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
    if (lo < 0 || hi >= vocab) {
      throw InvalidArgumentError(absl::StrCat("embedding: token ", lo < 0 ? lo : hi, " outside the vocabulary of ",
                                              vocab));
    }
  }
  const at::Tensor mine = (tokens >= vocab_begin) & (tokens < vocab_begin + local);
  const at::Tensor index = (tokens - vocab_begin).masked_fill(~mine, 0);
  const at::Tensor rows = at::embedding(weight_local, index).masked_fill(~mine.unsqueeze(-1), 0);
  return ReduceFromModelParallel(rows, model);
}

at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits_local, const at::Tensor& targets, int64_t vocab_begin,
                                     Communicator* model) {
  if (logits_local.dim() != 2 || targets.dim() != 1 || logits_local.size(0) != targets.size(0)) {
    throw InvalidArgumentError(absl::StrCat("vocabulary-parallel cross-entropy: logits ",
                                            c10::str(logits_local.sizes()), " do not match targets ",
                                            c10::str(targets.sizes())));
  }
  if (Alone(model)) return at::cross_entropy_loss(logits_local, targets, {}, at::Reduction::None);
  return VocabCrossEntropy::apply(logits_local, targets, vocab_begin, Handle(model));
}

at::Tensor ShardOf(const at::Tensor& full, const ParameterLayout& layout, int model_index) {
  if (!layout.sharded()) return full.clone();
  const int64_t n = full.size(layout.split_dim);
  const int64_t block = n / layout.blocks, piece = block / layout.parts;
  std::vector<at::Tensor> pieces;
  for (int b = 0; b < layout.blocks; ++b) {
    pieces.push_back(full.narrow(layout.split_dim, b * block + model_index * piece, piece));
  }
  return at::cat(pieces, layout.split_dim).contiguous();
}

at::Tensor GatherShards(const at::Tensor& local, const ParameterLayout& layout, Communicator* model) {
  if (!layout.sharded() || Alone(model)) return local.clone();
  const int parts = model->world_size();
  // All-gather along dimension 0 of [split_dim first] copies, then put them back.
  const at::Tensor moved = local.movedim(layout.split_dim, 0).contiguous();
  at::Tensor gathered = at::empty({parts * moved.numel()}, moved.options());
  model->AllGather(gathered, moved.view(-1));
  std::vector<int64_t> shape = moved.sizes().vec();
  const int64_t piece = shape[0] / layout.blocks;  // rows of one block on one rank
  shape.insert(shape.begin(), parts);
  const at::Tensor by_rank = gathered.view(shape);  // [parts, blocks * piece, ...]
  std::vector<at::Tensor> rows;
  for (int b = 0; b < layout.blocks; ++b) {
    for (int r = 0; r < parts; ++r) rows.push_back(by_rank[r].narrow(0, b * piece, piece));
  }
  return at::cat(rows, 0).movedim(0, layout.split_dim).contiguous();
}

}  // namespace lockstep
