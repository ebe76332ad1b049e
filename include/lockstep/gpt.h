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

class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const GptOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t num_heads_;
  double dropout_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, attn_proj_{nullptr}, mlp_up_{nullptr}, mlp_down_{nullptr};
};
TORCH_MODULE(GptBlock);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptOptions& options);
  // tokens: int64 [B, T], T <= context_length. Returns logits [B, T, vocab_size].
  at::Tensor forward(const at::Tensor& tokens);

  const GptOptions& options() const { return options_; }

 private:
  GptOptions options_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
};
TORCH_MODULE(Gpt);

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
// (nats per token), shape [B].
LossFn LanguageModelLoss();

}  // namespace lockstep

#endif  // LOCKSTEP_GPT_H_
