// Megatron-style tensor parallelism over the model axis of a mesh (mesh.h).
//
// The two conjugate operators of Megatron-LM (Shoeybi et al., 2019):
//
//   CopyToModelParallel      f: identity forward, all-reduce (sum) of the gradient
//                            backward; where a replicated activation enters a
//                            split layer
//   ReduceFromModelParallel  g: all-reduce (sum) forward, identity backward; where
//                            the partial outputs of a split layer are combined
//
// and the layers built from them. A column-parallel linear holds rows
// [m n/M, (m+1) n/M) of the weight (its output features) and gives this rank's
// slice of the output; a row-parallel linear holds the matching columns, takes
// that slice, and all-reduces its partial products, then adds the (replicated)
// bias. An MLP or attention block is therefore f, column, local work, row, g: one
// all-reduce forward and one backward. The vocabulary-parallel embedding holds
// rows [m V/M, (m+1) V/M) of the table; the vocabulary-parallel cross-entropy
// takes logits split the same way and never gathers them (the max, the sum of
// exponentials and the target's logit are all-reduced: three small all-reduces of
// one value per token).
//
// Every function takes the model-axis communicator; null or a world of one makes
// it the plain single-process operation. Collectives run on the thread that calls
// forward or backward (libtorch's autograd runs CPU backward on the caller's
// thread), in the same order on every rank of the model axis.
#ifndef LOCKSTEP_TENSOR_PARALLEL_H_
#define LOCKSTEP_TENSOR_PARALLEL_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "lockstep/communicator.h"
#include "lockstep/mesh.h"

namespace lockstep {

at::Tensor CopyToModelParallel(const at::Tensor& x, Communicator* model);
at::Tensor ReduceFromModelParallel(const at::Tensor& x, Communicator* model);

// The products are Linear's (linear.h): oneDNN's GEMM for CPU float32, as in the
// unsplit model, else at::linear.
// y_local = f(x) weight_local^T + bias_local (bias may be undefined).
at::Tensor ColumnParallelLinear(const at::Tensor& x, const at::Tensor& weight_local, const at::Tensor& bias_local,
                                Communicator* model);
// y = g(x_local weight_local^T) + bias (bias replicated, may be undefined).
at::Tensor RowParallelLinear(const at::Tensor& x_local, const at::Tensor& weight_local, const at::Tensor& bias,
                             Communicator* model);

// Embeddings of `tokens` (int64, any shape) from a table split by rows: this rank
// holds rows [vocab_begin, vocab_begin + weight_local.size(0)). Tokens outside
// this rank's rows contribute zeros; the sum over the model axis (g) is every
// token's row. The result is replicated. Split, throws InvalidArgumentError for a
// token outside the whole vocabulary (model-axis size x local rows); alone, it is
// at::embedding, whose own check refuses such a token.
at::Tensor VocabParallelEmbedding(const at::Tensor& tokens, const at::Tensor& weight_local, int64_t vocab_begin,
                                  Communicator* model);

// Per-row cross-entropy of logits split by columns: logits_local [N, V/M] holds
// columns [vocab_begin, vocab_begin + V/M) of every row; targets [N] are global
// class indices. Returns [N], the same on every rank of the model axis, equal to
// at::cross_entropy_loss(full logits, targets, reduction none). Its gradient is
// softmax - one_hot on this rank's columns.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits_local, const at::Tensor& targets, int64_t vocab_begin,
                                     Communicator* model);

// This rank's shard of a full tensor under `layout` (a copy; the full tensor when
// replicated), and the inverse: the full tensor from every model-axis rank's
// shard (an all-gather over `model`; the shard itself when replicated).
at::Tensor ShardOf(const at::Tensor& full, const ParameterLayout& layout, int model_index);
at::Tensor GatherShards(const at::Tensor& local, const ParameterLayout& layout, Communicator* model);

}  // namespace lockstep

#endif  // LOCKSTEP_TENSOR_PARALLEL_H_
