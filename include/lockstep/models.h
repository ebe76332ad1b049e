// Models that ship with Lockstep: the small CNN of the Fashion-MNIST job, an
// MLP, and a GPT-style language model (lockstep/gpt.h). Users bring their own torch::nn::Module with an ApplyFn instead.
#ifndef LOCKSTEP_MODELS_H_
#define LOCKSTEP_MODELS_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/step.h"

namespace lockstep {

// The GPT-style language model's sizes (lockstep/gpt.h).
struct GptOptions {
  int64_t vocab_size = 256;     // bytes as tokens
  int64_t context_length = 64;  // the longest sequence: rows of the position table
  int64_t num_layers = 4;
  int64_t num_heads = 4;
  int64_t width = 128;  // the residual stream; num_heads must divide it
  double dropout = 0.0;
};

struct ModelOptions {
  std::string name = "cnn";  // "cnn", "mlp" or "gpt"
  int64_t in_channels = 1;
  int64_t height = 28;
  int64_t width = 28;
  int64_t hidden_units = 128;
  // MLP only: the widths of its hidden layers, in order. Empty means one hidden
  // layer of `hidden_units` (the CNN always has one, of `hidden_units`).
  std::vector<int64_t> hidden_layers;
  int64_t num_classes = 10;
  double dropout = 0.0;
  GptOptions gpt;  // "gpt" only (its dropout is gpt.dropout)
};

// conv3x3(32) -> ReLU -> maxpool2 -> conv3x3(64) -> ReLU -> maxpool2 ->
// linear(hidden) -> ReLU -> [dropout] -> linear(num_classes). Height and width must
// be divisible by 4.
class CnnImpl : public torch::nn::Module {
 public:
  explicit CnnImpl(const ModelOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Sequential layers_;
};

// flatten -> (linear(hidden) -> ReLU -> [dropout]) per hidden layer ->
// linear(num_classes). The hidden widths are `hidden_layers`, or one layer of
// `hidden_units` when that is empty: {256, 256} on 28x28 inputs is 784-256-256-10.
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelOptions& options);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Sequential layers_;
};

struct BuiltModel {
  std::shared_ptr<torch::nn::Module> module;
  ApplyFn apply;
};

// Builds the named model with freshly initialised parameters (seed libtorch first
// for reproducible ones). Throws InvalidArgumentError naming an unknown model or a
// bad size.
BuiltModel BuildModel(const ModelOptions& options);

// Number of trainable scalars (parameters with requires_grad).
int64_t CountTrainableWeights(const torch::nn::Module& module);

// The parameters BuildModel(options) would make, counted without building it (as
// a double: a bad config can ask for more than an int64 holds). Throws
// InvalidArgumentError for an unknown model name.
double CountModelParameters(const ModelOptions& options);

}  // namespace lockstep

#endif  // LOCKSTEP_MODELS_H_
