// TrainState: what training changes — the model's parameters and buffers, the
// optimizer and its state, and the number of optimizer steps taken.
//
// A TrainState is a handle: copying it shares the module and optimizer (as torch
// modules do). The caller owns the state it passes to a trainer; after training, the
// caller's own state holds the trained parameters and step, with no stale copy.
// Not thread-safe: one training thread at a time.
#ifndef LOCKSTEP_TRAIN_STATE_H_
#define LOCKSTEP_TRAIN_STATE_H_

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace lockstep {

struct TrainState {
  std::shared_ptr<torch::nn::Module> model;
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  int64_t step = 0;
};

// Builds an optimizer over the given parameters. Users may bring their own.
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> parameters)>;

struct OptimizerOptions {
  enum class Kind { kSgd, kAdam, kAdamW };
  Kind kind = Kind::kAdam;
  double learning_rate = 1e-3;
  double momentum = 0.9;  // kSgd
  bool nesterov = false;  // kSgd
  double weight_decay = 0.0;
  double beta1 = 0.9;  // kAdam, kAdamW
  double beta2 = 0.999;
  double epsilon = 1e-8;
};

// A factory for SGD with momentum (BlockedSgd, a torch::optim::SGD with a
// cache-blocked step: lockstep/sgd.h), Adam or AdamW from torch::optim.
// Throws InvalidArgumentError naming a bad option.
OptimizerFactory MakeOptimizerFactory(const OptimizerOptions& options);

// The key under which torch::optim optimizers keep a parameter's state in
// Optimizer::state() (its TensorImpl's address, as text).
std::string OptimizerStateKey(const torch::Tensor& parameter);

// Builds a train state at step 0: the module, and an optimizer over its parameters.
TrainState MakeTrainState(std::shared_ptr<torch::nn::Module> model, const OptimizerFactory& optimizer);

}  // namespace lockstep

#endif  // LOCKSTEP_TRAIN_STATE_H_
