// A GPT-style decoder-only language model: token and position embeddings,
// pre-LayerNorm blocks of causal self-attention and an MLP, a final LayerNorm and
// an output head tied to the token embedding (logits = h @ wte^T).
//
//   x = wte[tokens] + wpe[0..T)            [B, T, width]   (then dropout)
//   per block: x = x + Attention(LN1(x));  x = x + Mlp(LN2(x))
//     Attention: qkv = Linear(width, 3 width); per head softmax(q k^T / sqrt(d),
//                causal) v; Linear(width, width); dropout
//     Mlp:       Linear(width, 4 width) -> GELU (exact) -> Linear(4 width, width); dropout
//   logits = LN_f(x) @ wte^T                [B, T, vocab]
//
// Parameter names (what checkpoints and the Python reference use): wte.weight,
// wpe.weight, blocks.<i>.{ln1,qkv,attn_proj,ln2,mlp_up,mlp_down}.{weight,bias},
// ln_f.{weight,bias}. Initialisation: linear and embedding weights N(0, 0.02),
// the two projections back into the residual stream N(0, 0.02 / sqrt(2 layers)),
// biases 0, LayerNorm weights 1 (seed libtorch first for reproducible ones).
//
// Not thread-safe (a torch::nn::Module); forward throws InvalidArgumentError for
// a sequence longer than context_length or tokens that are not int64 [B, T].
#ifndef LOCKSTEP_GPT_H_
#define LOCKSTEP_GPT_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/mesh.h"
#include "lockstep/metrics.h"
#include "lockstep/models.h"
#include "lockstep/step.h"
#include "lockstep/trainer.h"

namespace lockstep {

// Throws InvalidArgumentError naming the field: sizes must be positive, num_heads
// must divide width, dropout in [0, 1).
void CheckGptOptions(const GptOptions& options);

// Parameters the model has (the head is tied, so it adds none).
double CountGptParameters(const GptOptions& options);

// Training FLOPs per token for sequences of `sequence_length` tokens, as the PaLM
// paper counts them: 6 N + 12 L W T, N the parameters without the position table,
// L layers, W the width (heads x head size), T the sequence length.
double GptTrainingFlopsPerToken(const GptOptions& options, int64_t sequence_length);

// How a GPT is laid out on the model axis of a mesh (mesh.h, tensor_parallel.h).
// Its parameters' logical axes: wte [vocab, embed], wpe [length, embed], qkv
// [heads, embed] (three blocks: query, key, value rows) and its bias [heads],
// attn_proj [embed, heads], mlp_up [mlp, embed] and its bias [mlp], mlp_down
// [embed, mlp], every other bias and the LayerNorms [embed]. Where the partitioner
// splits "heads", each rank holds num_heads / M heads (qkv column-parallel,
// attn_proj row-parallel); "mlp", 4 width / M hidden units (mlp_up column,
// mlp_down row); "vocab", V / M rows of the tied embedding, the logits split the
// same way (LanguageModelLoss with the model axis takes them as they are).
struct GptParallelism {
  Communicator* model = nullptr;  // this rank's model-axis group; null: alone
  int model_index = 0;
  const Partitioner* partitioner = nullptr;  // null: everything replicated

  bool Splits(const std::string& logical_axis) const {
    return model != nullptr && partitioner != nullptr && partitioner->Splits(logical_axis);
  }
};

// The logical axes of a GPT parameter by its name (as named_parameters() gives
// it), and the number of blocks of its split dimension (3 for qkv). Throws
// InvalidArgumentError for a name the GPT does not have.
LogicalAxes GptLogicalAxes(const std::string& name, int* blocks = nullptr);
// Every parameter's layout under `partitioner`, in named_parameters() order.
// Throws InvalidArgumentError naming the parameter that the model axis does not
// divide (heads, hidden units, vocabulary), as the config check reports it.
std::vector<ParameterLayout> GptParameterLayouts(const GptOptions& options, const Partitioner& partitioner);

class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptOptions& options, const GptParallelism& parallel = {});
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t num_heads_;  // on this rank
  double dropout_;
  Communicator* heads_axis_ = nullptr;  // the model axis when heads are split
  Communicator* mlp_axis_ = nullptr;    // the model axis when the MLP is split
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, attn_proj_{nullptr}, mlp_up_{nullptr}, mlp_down_{nullptr};
};
TORCH_MODULE(GptBlock);

class GptImpl : public torch::nn::Module {
 public:
  // Initialises every parameter in full, as one process does (the same draws from
  // libtorch's generator), then keeps this rank's shards: a model split over a mesh
  // starts exactly where the single-process model starts. Throws
  // InvalidArgumentError for bad options, a layout the model axis does not
  // divide, or dropout with a split model (not supported).
  explicit GptImpl(const GptOptions& options, const GptParallelism& parallel = {});
  // tokens: int64 [B, T], T <= context_length. Returns logits [B, T, vocab_size],
  // or [B, T, vocab_size / M] (this rank's columns) when the vocabulary is split.
  at::Tensor forward(const at::Tensor& tokens);

  const GptOptions& options() const { return options_; }
  // The model axis when the vocabulary is split (null otherwise), and the first
  // vocabulary row this rank holds: what LanguageModelLoss needs for split logits.
  Communicator* vocab_axis() const { return vocab_axis_; }
  int64_t vocab_begin() const { return vocab_begin_; }
  // This rank's parameter layouts (all replicated without a partitioner).
  const std::vector<ParameterLayout>& layouts() const { return layouts_; }

 private:
  GptOptions options_;
  Communicator* vocab_axis_ = nullptr;
  int64_t vocab_begin_ = 0;
  std::vector<ParameterLayout> layouts_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
};
TORCH_MODULE(Gpt);

// A GPT split as `parallel` says, with its apply function (BuildModel's "gpt"
// without a mesh).
BuiltModel BuildGpt(const GptOptions& options, const GptParallelism& parallel = {});

// Summary metrics of a byte-level language model, for BaseTrainer::
// AddDerivedMetrics: bits_per_byte (the loss in nats / ln 2: a token is a byte),
// and for the train task tokens_per_second (all ranks': examples per second x
// sequence_length), tokens_per_second_per_rank and, when peak_flops_per_rank > 0,
// mfu (GptTrainingFlopsPerToken x tokens per second over peak_flops_per_rank x
// world_size).
DeriveMetricsFn LanguageModelMetrics(const GptOptions& options, int64_t sequence_length, int world_size,
                                     double peak_flops_per_rank);

// What a BaseTrainer of a GPT needs for those metrics, in one call: measures the
// float32 matrix-product peak on `device` on every rank of the trainer's
// communicator at once (MeasureAgreedMatmulFlops: rank 0's figure everywhere) and
// adds LanguageModelMetrics to the trainer. A collective. Returns the peak per rank.
double AddLanguageModelMetrics(BaseTrainer& trainer, const GptOptions& options, int64_t sequence_length,
                               const std::string& device = "cpu");

// The per-example loss of a language model: for outputs [B, T, V] (logits) and
// targets int64 [B, T], each example's mean cross-entropy over its T positions
// (nats per token), shape [B]. With `vocab_axis` (GptImpl::vocab_axis()), the
// logits are this rank's vocabulary columns from `vocab_begin` on, and the loss is
// the vocabulary-parallel cross-entropy: the same values, on every rank of the
// model axis, without gathering the logits.
LossFn LanguageModelLoss(Communicator* vocab_axis = nullptr, int64_t vocab_begin = 0);

}  // namespace lockstep

#endif  // LOCKSTEP_GPT_H_
