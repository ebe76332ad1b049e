#include "lockstep/step.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <optional>
#include <string>

#include "lockstep/communicator.h"
#include "lockstep/data_parallel.h"
#include "lockstep/sharded_data_parallel.h"
#include "lockstep/errors.h"
#include "lockstep/timeline.h"

namespace lockstep {
namespace {

bool IsClassification(const at::Tensor& outputs, const at::Tensor& targets) {
  return outputs.dim() == 2 && targets.dim() == 1 && !at::isFloatingType(targets.scalar_type()) &&
         targets.scalar_type() != at::kBool;
}

void CheckPerExample(const at::Tensor& values, int64_t n, const std::string& what) {
  if (values.dim() != 1 || values.size(0) != n) {
    throw InvalidArgumentError(what + " must give one value per example: expected shape [" + std::to_string(n) +
                               "], got " + c10::str(values.sizes()));
  }
}

std::vector<at::Tensor> Gradients(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

// The batch on the device of the parameters (a no-op when it is there).
Batch OnDeviceOf(const std::vector<at::Tensor>& params, const Batch& batch) {
  if (params.empty() || !batch.inputs.defined() || batch.inputs.device() == params.front().device()) return batch;
  const at::Device device = params.front().device();
  return Batch{batch.inputs.to(device), batch.targets.to(device),
               batch.weights.defined() ? batch.weights.to(device) : at::Tensor()};
}

}  // namespace

LossFn CrossEntropyLoss() {
  return [](const at::Tensor& logits, const at::Tensor& targets) {
    return at::cross_entropy_loss(logits, targets, /*weight=*/{}, at::Reduction::None);
  };
}

MetricFn ClassificationMetrics(LossFn loss) {
  return [loss = std::move(loss)](const at::Tensor& outputs, const Batch& batch) {
    std::map<std::string, at::Tensor> values;
    values[kLoss] = loss(outputs, batch.targets);
    if (IsClassification(outputs, batch.targets)) {
      values[kAccuracy] = outputs.argmax(1).eq(batch.targets).to(at::kFloat);
    }
    return values;
  };
}

double GlobalL2Norm(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return 0.0;
  std::vector<at::Tensor> norms;
  norms.reserve(tensors.size());
  for (const at::Tensor& t : tensors) norms.push_back(t.detach().norm(2).to(at::kDouble));
  return at::stack(norms).norm(2).item<double>();
}

// The L2 norm of tensors of which those flagged are shards over `model_axis`:
// their squares summed over the axis, the others' counted once.
double MeshL2Norm(const std::vector<at::Tensor>& tensors, const std::vector<bool>& split, Communicator* model_axis) {
  at::Tensor squares = at::zeros({2}, at::kDouble);  // [split, replicated]
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    const at::Tensor sq = tensors[i].detach().to(at::kDouble).pow(2).sum().cpu();
    squares[split[i] ? 0 : 1] += sq;
  }
  at::Tensor split_squares = squares.narrow(0, 0, 1).contiguous();
  model_axis->AllReduce(split_squares, ReduceOp::kSum);
  return std::sqrt(split_squares.item<double>() + squares[1].item<double>());
}

MetricMap RunTrainStep(TrainState& state, const Batch& host_batch, const ApplyFn& apply, const LossFn& loss,
                       const StepOptions& options) {
  if (!state.model || !state.optimizer) throw InvalidArgumentError("train step: the state has no model or optimizer");
  const std::vector<at::Tensor> params = state.model->parameters();
  const Batch batch = OnDeviceOf(params, host_batch);
  if (options.num_microbatches < 1) {
    throw InvalidArgumentError("train step: num_microbatches must be >= 1, got " +
                               std::to_string(options.num_microbatches));
  }
  DataParallel* const data_parallel = options.data_parallel;
  ShardedDataParallel* const sharded = options.sharded;
  if (data_parallel != nullptr && sharded != nullptr) {
    throw InvalidArgumentError("train step: data_parallel and sharded are exclusive");
  }
  const bool distributed = data_parallel != nullptr || sharded != nullptr;
  const int64_t n = batch.size();
  if (n == 0 && !distributed) throw InvalidArgumentError("train step: empty batch");
  if ((n > 0 && batch.targets.size(0) != n) || (batch.weights.defined() && !(batch.weights.dim() == 1 && batch.weights.size(0) == n))) {
    throw InvalidArgumentError("train step: inputs, targets and weights disagree on the number of examples");
  }

  torch::optim::Optimizer& optimizer = *state.optimizer;
  double learning_rate = optimizer.param_groups().at(0).options().get_lr();
  if (options.schedule) {
    learning_rate = (*options.schedule)(state.step);
    for (auto& group : optimizer.param_groups()) group.options().set_lr(learning_rate);
  }

  state.model->train();
  if (sharded != nullptr) sharded->ZeroGrad();
  optimizer.zero_grad();
  const bool weighted = batch.weights.defined();
  const double local_weight = weighted ? batch.weights.sum().item<double>() : static_cast<double>(n);
  double total_weight = local_weight;
  // Data-parallel: the loss is normalised by the weight of the global batch, summed
  // over ranks while the first microbatch's forward runs.
  at::Tensor global_weight;
  std::shared_ptr<Work> global_weight_work;
  if (distributed) {
    global_weight = at::tensor({total_weight}, at::kDouble);
    global_weight_work = data_parallel != nullptr ? data_parallel->AllReduceSumAsync(global_weight)
                                                  : sharded->AllReduceSumAsync(global_weight);
  }
  auto await_total_weight = [&] {
    if (global_weight_work) {
      if (data_parallel != nullptr) {
        data_parallel->Wait(*global_weight_work);
      } else {
        sharded->Wait(*global_weight_work);
      }
      global_weight_work.reset();
      total_weight = global_weight.item<double>();
    }
    if (!(total_weight > 0)) throw InvalidArgumentError("train step: example weights must sum to a positive value");
  };

  // k microbatches whose sizes differ by at most one.
  const int64_t k = std::min<int64_t>(options.num_microbatches, n);
  at::Tensor loss_sum;
  at::Tensor correct_sum;
  int64_t offset = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t size = n / k + (i < n % k ? 1 : 0);
    const at::Tensor inputs = batch.inputs.narrow(0, offset, size);
    const at::Tensor targets = batch.targets.narrow(0, offset, size);
    std::optional<TimelineSpan> forward_span(std::in_place, options.timeline, "forward");
    const at::Tensor outputs = apply(*state.model, inputs);
    const at::Tensor per_example = loss(outputs, targets);
    CheckPerExample(per_example, size, "the loss");
    at::Tensor weights;
    if (weighted) weights = batch.weights.narrow(0, offset, size).to(per_example.scalar_type());
    const at::Tensor summed = weighted ? per_example.mul(weights).sum() : per_example.sum();
    forward_span.reset();
    if (i == 0) {
      const TimelineSpan span(options.timeline, "wait for the global batch weight");
      await_total_weight();
    }
    // Only the last microbatch's backward communicates.
    if (data_parallel != nullptr && i == k - 1) data_parallel->bucketer().Arm();
    if (sharded != nullptr && i == k - 1) sharded->Arm();
    {
      const TimelineSpan span(options.timeline, "backward");
      summed.div(total_weight).backward();
    }

    const at::Tensor detached = summed.detach();
    loss_sum = loss_sum.defined() ? loss_sum.add(detached) : detached;
    if (IsClassification(outputs, targets)) {
      at::Tensor correct = outputs.detach().argmax(1).eq(targets).to(at::kFloat);
      correct = weighted ? correct.mul(weights).sum() : correct.sum();
      correct_sum = correct_sum.defined() ? correct_sum.add(correct) : correct;
    }
    offset += size;
  }
  await_total_weight();  // a rank with an empty shard ran no microbatch

  {
    const TimelineSpan span(options.timeline, "finish gradient exchange");
    if (data_parallel != nullptr) data_parallel->bucketer().Finish();
    if (sharded != nullptr) sharded->Finish();
  }
  std::optional<TimelineSpan> optimizer_span(std::in_place, options.timeline, "norms and optimizer");

  // The gradient norm is the clipping's when clipping; else, like the weight norm
  // after the update, it comes from the optimizer's own pass (ReportsStepSquares) when that
  // covered every parameter, and from two more passes otherwise.
  double grad_norm = 0.0;
  double weights_norm = -1.0;  // computed below unless the sharded step reports it
  const bool clipped = options.max_grad_norm > 0;
  Communicator* const model_axis =
      options.model_axis != nullptr && options.model_axis->world_size() > 1 ? options.model_axis : nullptr;
  if (model_axis != nullptr && options.split_over_model.size() != params.size()) {
    throw InvalidArgumentError("train step: split_over_model has " + std::to_string(options.split_over_model.size()) +
                               " flags for " + std::to_string(params.size()) + " parameters");
  }
  // An optimizer that sums squares in its own step saves two passes for the norms
  // (of this rank's tensors alone: not with a model axis).
  const auto* sgd = sharded != nullptr || model_axis != nullptr
                        ? nullptr
                        : dynamic_cast<const ReportsStepSquares*>(&optimizer);
  if (sharded != nullptr) {
    // The norm, clipping and update are the sharded layer's (over all slices).
  } else if (model_axis != nullptr) {
    grad_norm = MeshL2Norm(Gradients(params), options.split_over_model, model_axis);
    // As clip_grad_norm_ does, over the whole model's norm.
    const double coefficient = options.max_grad_norm / (grad_norm + 1e-6);
    if (clipped && coefficient < 1) {
      at::NoGradGuard no_grad;
      for (const at::Tensor& p : params) {
        if (p.grad().defined()) p.grad().mul_(coefficient);
      }
    }
  } else if (clipped) {
    grad_norm = torch::nn::utils::clip_grad_norm_(params, options.max_grad_norm);
  } else if (sgd == nullptr) {
    grad_norm = GlobalL2Norm(Gradients(params));  // before an optimizer that might change them
  }
  std::vector<std::pair<std::string, at::Tensor>> before;
  if (options.weight_metrics) {
    for (const auto& item : state.model->named_parameters()) before.emplace_back(item.key(), item.value().detach().clone());
  }
  if (sharded != nullptr) {
    const ShardedDataParallel::StepResult step = sharded->Step(options.max_grad_norm, options.before_update);
    grad_norm = step.gradients_l2norm;
    weights_norm = step.weights_l2norm;
  } else {
    if (options.before_update) options.before_update();
    optimizer.step();
  }
  ++state.step;
  optimizer_span.reset();
  bool one_pass_norms = sgd != nullptr && sgd->last_step_squares().complete &&
                        sgd->last_step_squares().tensors == static_cast<int64_t>(params.size());
  if (one_pass_norms) {
    int64_t elements = 0;
    for (const at::Tensor& p : params) elements += p.numel();
    one_pass_norms = elements == sgd->last_step_squares().elements;
  }
  if (!clipped && sgd != nullptr) {
    // The optimizer's step leaves the gradients as they were: after it is as good as before.
    grad_norm = one_pass_norms ? std::sqrt(sgd->last_step_squares().gradients) : GlobalL2Norm(Gradients(params));
  }

  // This rank's values; MetricsManager combines ranks once per summary period. A
  // rank whose shard was empty reports no loss.
  MetricMap metrics;
  if (loss_sum.defined() && local_weight > 0) {
    metrics[kLoss] = loss_sum.item<double>() / local_weight;
    if (correct_sum.defined()) metrics[kAccuracy] = correct_sum.item<double>() / local_weight;
  }
  metrics[kLearningRate] = learning_rate;
  metrics[kGradientsL2Norm] = grad_norm;
  metrics[kWeightsL2Norm] = weights_norm >= 0 ? weights_norm
                            : model_axis != nullptr ? MeshL2Norm(params, options.split_over_model, model_axis)
                            : one_pass_norms ? std::sqrt(sgd->last_step_squares().weights)
                                             : GlobalL2Norm(params);
  metrics[kNumExamples] = local_weight;
  if (options.weight_metrics) {
    const auto named = state.model->named_parameters();
    for (const auto& [name, old_value] : before) {
      const at::Tensor now = named[name].detach();
      metrics["weights/" + name + "/rms"] = now.pow(2).mean().sqrt().item<double>();
      metrics["weights/" + name + "/max"] = now.abs().max().item<double>();
      const double norm = old_value.norm().item<double>();
      metrics["weights/" + name + "/update_ratio"] = norm > 0 ? (now - old_value).norm().item<double>() / norm : 0.0;
    }
  }
  return metrics;
}

MetricSums RunEvalStep(torch::nn::Module& model, const Batch& host_batch, const ApplyFn& apply,
                       const MetricFn& metrics) {
  MetricSums out;
  const Batch batch = OnDeviceOf(model.parameters(), host_batch);
  const int64_t n = batch.size();
  if (n == 0) return out;
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const at::Tensor outputs = apply(model, batch.inputs);
  const bool weighted = batch.weights.defined();
  for (auto& [name, values] : metrics(outputs, batch)) {
    CheckPerExample(values, n, "eval metric '" + name + "'");
    const at::Tensor v = values.to(at::kDouble);
    out.sums[name] = (weighted ? v.mul(batch.weights.to(at::kDouble)).sum() : v.sum()).item<double>();
  }
  out.weight = weighted ? batch.weights.sum().item<double>() : static_cast<double>(n);
  model.train(was_training);
  return out;
}

}  // namespace lockstep
