#include "lockstep/train_state.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>

#include "lockstep/errors.h"
#include "lockstep/sgd.h"

namespace lockstep {
namespace {

void Require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgumentError("optimizer: " + what);
}

}  // namespace

OptimizerFactory MakeOptimizerFactory(const OptimizerOptions& o) {
  Require(o.learning_rate > 0 && std::isfinite(o.learning_rate), "learning_rate must be positive and finite");
  Require(o.weight_decay >= 0, "weight_decay must be >= 0");
  switch (o.kind) {
    case OptimizerOptions::Kind::kSgd:
      Require(o.momentum >= 0 && o.momentum < 1, "momentum must be in [0, 1)");
      Require(!o.nesterov || o.momentum > 0, "nesterov needs momentum > 0");
      return [o](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<BlockedSgd>(std::move(params), torch::optim::SGDOptions(o.learning_rate)
                                                                   .momentum(o.momentum)
                                                                   .nesterov(o.nesterov)
                                                                   .weight_decay(o.weight_decay));
      };
    case OptimizerOptions::Kind::kAdam:
    case OptimizerOptions::Kind::kAdamW:
      Require(o.beta1 >= 0 && o.beta1 < 1, "beta1 must be in [0, 1)");
      Require(o.beta2 >= 0 && o.beta2 < 1, "beta2 must be in [0, 1)");
      Require(o.epsilon > 0, "epsilon must be positive");
      if (o.kind == OptimizerOptions::Kind::kAdam) {
        return [o](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
          return std::make_unique<torch::optim::Adam>(
              std::move(params),
              torch::optim::AdamOptions(o.learning_rate).betas({o.beta1, o.beta2}).eps(o.epsilon).weight_decay(o.weight_decay));
        };
      }
      return [o](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<torch::optim::AdamW>(
            std::move(params),
            torch::optim::AdamWOptions(o.learning_rate).betas({o.beta1, o.beta2}).eps(o.epsilon).weight_decay(o.weight_decay));
      };
  }
  throw InvalidArgumentError("optimizer: unknown kind");
}

namespace {

// libtorch 1.x keys by the address written to a stream, 2.x by the address.
template <typename Key>
Key StateKeyOf(const void* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << impl;
    return text.str();
  } else {
    return static_cast<Key>(const_cast<void*>(impl));
  }
}

}  // namespace

OptimizerStateKeyType OptimizerStateKey(const torch::Tensor& parameter) {
  return StateKeyOf<OptimizerStateKeyType>(parameter.unsafeGetTensorImpl());
}

TrainState MakeTrainState(std::shared_ptr<torch::nn::Module> model, const OptimizerFactory& optimizer) {
  if (!model) throw InvalidArgumentError("MakeTrainState: no model");
  if (!optimizer) throw InvalidArgumentError("MakeTrainState: no optimizer factory");
  TrainState state;
  state.optimizer = optimizer(model->parameters());
  state.model = std::move(model);
  return state;
}

}  // namespace lockstep
