#include "lockstep/models.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include <string>
#include <vector>

#include "lockstep/errors.h"
#include "lockstep/gpt.h"

namespace lockstep {
namespace {

void CheckSizes(const ModelOptions& o) {
  if (o.in_channels <= 0 || o.height <= 0 || o.width <= 0 || o.hidden_units <= 0 || o.num_classes < 2) {
    throw InvalidArgumentError("model '" + o.name + "': sizes must be positive and num_classes >= 2");
  }
  if (!(o.dropout >= 0 && o.dropout < 1)) {
    throw InvalidArgumentError("model '" + o.name + "': dropout must be in [0, 1), got " + std::to_string(o.dropout));
  }
  for (const int64_t width : o.hidden_layers) {
    if (width <= 0) throw InvalidArgumentError("model '" + o.name + "': hidden layer widths must be positive");
  }
}

// Hidden layers of the given widths (each linear -> ReLU -> [dropout]), then the
// classifier.
void AddHead(torch::nn::Sequential& layers, int64_t features, const std::vector<int64_t>& hidden,
             const ModelOptions& o) {
  for (const int64_t width : hidden) {
    layers->push_back(torch::nn::Linear(features, width));
    layers->push_back(torch::nn::ReLU());
    if (o.dropout > 0) layers->push_back(torch::nn::Dropout(o.dropout));
    features = width;
  }
  layers->push_back(torch::nn::Linear(features, o.num_classes));
}

}  // namespace

CnnImpl::CnnImpl(const ModelOptions& o) {
  CheckSizes(o);
  if (o.height % 4 != 0 || o.width % 4 != 0) {
    throw InvalidArgumentError("model 'cnn': height and width must be divisible by 4");
  }
  using torch::nn::Conv2dOptions;
  layers_->push_back(torch::nn::Conv2d(Conv2dOptions(o.in_channels, 32, 3).padding(1)));
  layers_->push_back(torch::nn::ReLU());
  layers_->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
  layers_->push_back(torch::nn::Conv2d(Conv2dOptions(32, 64, 3).padding(1)));
  layers_->push_back(torch::nn::ReLU());
  layers_->push_back(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)));
  layers_->push_back(torch::nn::Flatten());
  AddHead(layers_, 64 * (o.height / 4) * (o.width / 4), {o.hidden_units}, o);
  register_module("layers", layers_);
}

at::Tensor CnnImpl::forward(const at::Tensor& x) { return layers_->forward(x); }

MlpImpl::MlpImpl(const ModelOptions& o) {
  CheckSizes(o);
  layers_->push_back(torch::nn::Flatten());
  const std::vector<int64_t> hidden = o.hidden_layers.empty() ? std::vector<int64_t>{o.hidden_units} : o.hidden_layers;
  AddHead(layers_, o.in_channels * o.height * o.width, hidden, o);
  register_module("layers", layers_);
}

at::Tensor MlpImpl::forward(const at::Tensor& x) { return layers_->forward(x); }

BuiltModel BuildModel(const ModelOptions& options) {
  if (options.name == "cnn") return {std::make_shared<CnnImpl>(options), ForwardOf<CnnImpl>()};
  if (options.name == "mlp") return {std::make_shared<MlpImpl>(options), ForwardOf<MlpImpl>()};
  if (options.name == "gpt") return {std::make_shared<GptImpl>(options.gpt), ForwardOf<GptImpl>()};
  throw InvalidArgumentError("unknown model '" + options.name + "' (known: cnn, mlp, gpt)");
}

double CountModelParameters(const ModelOptions& o) {
  if (o.name == "gpt") return CountGptParameters(o.gpt);
  auto linear = [](double in, double out) { return in * out + out; };
  double count = 0;
  double features = 0;
  std::vector<int64_t> hidden = {o.hidden_units};
  if (o.name == "cnn") {
    count += linear(9.0 * o.in_channels, 32) + linear(9.0 * 32, 64);
    features = 64.0 * (o.height / 4) * (o.width / 4);
  } else if (o.name == "mlp") {
    features = static_cast<double>(o.in_channels) * o.height * o.width;
    if (!o.hidden_layers.empty()) hidden = o.hidden_layers;
  } else {
    throw InvalidArgumentError("unknown model '" + o.name + "' (known: cnn, mlp, gpt)");
  }
  for (const int64_t width : hidden) {
    count += linear(features, static_cast<double>(width));
    features = static_cast<double>(width);
  }
  return count + linear(features, o.num_classes);
}

int64_t CountTrainableWeights(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const at::Tensor& p : module.parameters()) {
    if (p.requires_grad()) count += p.numel();
  }
  return count;
}

}  // namespace lockstep
