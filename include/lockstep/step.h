// The one implementation of a train step and an eval step, shared by Trainer and by
// the composable TrainLoop / EvalLoop.
//
// A train step takes this rank's shard of one global batch, splits it into
// `num_microbatches` microbatches (sizes differ by at most one when it does not
// divide evenly), runs forward and backward on each and accumulates the gradients,
// then clips and applies one optimizer update. Each microbatch's loss is the
// weighted sum of its per-example losses divided by the total weight of the whole
// batch, so the accumulated gradient equals the whole-batch gradient of the
// weighted mean loss, whatever k, however uneven the split and whatever the
// weights. Not thread-safe; models with batch statistics (BatchNorm) see
// microbatch statistics, as in every accumulation scheme.
#ifndef LOCKSTEP_STEP_H_
#define LOCKSTEP_STEP_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/data.h"
#include "lockstep/errors.h"
#include "lockstep/metrics.h"
#include "lockstep/schedule.h"
#include "lockstep/train_state.h"

namespace lockstep {

// Forward pass: model, inputs -> outputs.
using ApplyFn = std::function<at::Tensor(torch::nn::Module& model, const at::Tensor& inputs)>;
// Per-example loss: outputs, targets -> a 1-D tensor with one loss per example.
using LossFn = std::function<at::Tensor(const at::Tensor& outputs, const at::Tensor& targets)>;
// Per-example metrics for evaluation: name -> 1-D tensor with one value per example.
using MetricFn = std::function<std::map<std::string, at::Tensor>(const at::Tensor& outputs, const Batch& batch)>;

// Cross-entropy per example over logits [N, C] and int64 class targets [N].
LossFn CrossEntropyLoss();
// Eval metrics of a classifier: "loss" (the given per-example loss) and "accuracy".
MetricFn ClassificationMetrics(LossFn loss);

// An ApplyFn calling `forward(inputs)` on a module of type M (e.g. CnnImpl).
// Throws InvalidArgumentError when the module is not an M.
template <typename M>
ApplyFn ForwardOf() {
  return [](torch::nn::Module& module, const at::Tensor& inputs) -> at::Tensor {
    auto* typed = dynamic_cast<M*>(&module);
    if (typed == nullptr) throw InvalidArgumentError("ForwardOf: module " + module.name() + " is not of the expected type");
    return typed->forward(inputs);
  };
}

class Communicator;
class DataParallel;
class ShardedDataParallel;
class Timeline;

struct StepOptions {
  // The batch is split into min(num_microbatches, examples on this rank) parts.
  int num_microbatches = 1;
  // Clip the global L2 norm of the gradients to this value; 0 disables clipping.
  double max_grad_norm = 0.0;
  // Sets every parameter group's learning rate before each step; without one the
  // optimizer's own learning rate is used unchanged.
  std::optional<LrSchedule> schedule;
  // Data parallelism across ranks; null trains this process alone. With it, the
  // loss is normalised by the total example weight of the global batch, gradients
  // are summed across ranks (bucketed, during the last microbatch's backward); the
  // step's metrics stay this rank's (MetricsManager combines them). Not owned.
  DataParallel* data_parallel = nullptr;
  // Sharded data parallelism (lockstep/sharded_data_parallel.h) instead: the
  // same loss normalisation; gradients reduced to this rank's slices, the norm
  // and clipping over all slices, the optimizer on this rank's slices and the
  // parameters all-gathered. At most one of the two. Not owned.
  ShardedDataParallel* sharded = nullptr;
  // Tensor parallelism (tensor_parallel.h): the parameters flagged in
  // `split_over_model` (one flag per state.model->parameters(), in order) are
  // shards over this model axis. The gradient and weight norms, and clipping, then
  // sum the squares of the split parameters over the axis and count the
  // replicated ones once: the norms of the whole model. Null: no model axis.
  Communicator* model_axis = nullptr;
  std::vector<bool> split_over_model;
  // Also report, per parameter tensor, "weights/<name>/rms", "weights/<name>/max"
  // (largest magnitude) and "weights/<name>/update_ratio" (||update|| / ||before||).
  // Costs a copy of the parameters per step.
  bool weight_metrics = false;
  // Called right before the optimizer changes the parameters; an asynchronous
  // checkpoint copying the previous step's state waits here (CheckpointManager::
  // AwaitSnapshot), so that its copy overlaps this step's forward and backward.
  std::function<void()> before_update;
  // Records forward, backward, the gradient exchange and the optimizer of the
  // steps it records (lockstep/timeline.h). Not owned; null: none.
  Timeline* timeline = nullptr;
};

// Runs one optimizer step on `state` (and increments state.step). The batch is
// moved to the device of the model's parameters when it is elsewhere. Returns the
// step's metrics: loss and accuracy (when outputs are [N, C] logits and targets
// are integer classes) over this rank's examples, weighted as the batch says, and
// num_examples (their total weight: the count when unweighted), none of the three
// for a rank with an empty shard but num_examples = 0; learning_rate,
// gradients_l2norm (before clipping) and weights_l2norm (after the update), the
// same on every rank. Timing is MetricsManager's. Throws
// InvalidArgumentError for an empty batch (allowed on a data-parallel rank whose
// shard is empty), a bad option, or a loss that is not one value per example.
MetricMap RunTrainStep(TrainState& state, const Batch& batch, const ApplyFn& apply, const LossFn& loss,
                       const StepOptions& options);

// Evaluates one batch without gradients, in eval mode, and returns its sums.
MetricSums RunEvalStep(torch::nn::Module& model, const Batch& batch, const ApplyFn& apply, const MetricFn& metrics);

// The L2 norm over all the given tensors together.
double GlobalL2Norm(const std::vector<at::Tensor>& tensors);

}  // namespace lockstep

#endif  // LOCKSTEP_STEP_H_
