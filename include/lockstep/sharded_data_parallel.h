// Sharded data parallelism (ZeRO stages 1, 2 and 3): each rank trains on its
// shard of the global batch, as in DataParallel, but keeps the optimizer state
// (and, sharding gradients, the summed gradients; fully sharded, the parameters
// between steps) for its own slice of the parameters.
//
// Layout. The parameters of each optimizer parameter group are grouped, in
// reverse registration order (roughly the order backward produces gradients),
// into units of at most `unit_bytes` (a new unit also when the dtype changes).
// A unit's parameters live in one flat buffer, padded with zeros to a multiple of
// the world size N: the model's parameters are views of it (set_data), so the
// model runs unchanged. Rank r owns elements [r * m, (r + 1) * m) of every unit,
// m = padded size / N. The optimizer's parameter groups are rebuilt over those
// slices, so its state exists for 1/N of the parameters on each rank.
//
// A step: backward accumulates into a flat gradient buffer per unit (the
// parameters' .grad are views of it; kept from step to step for sharded optimizer
// state, allocated for the step and freed after it when gradients are sharded);
// once armed for the last microbatch, a
// unit's reduction starts as soon as all its gradients are final:
//   kShardedOptimizerState: an all-reduce of the unit; the rank keeps its slice;
//   kShardedGradients:      a reduce-scatter: the rank receives only its slice.
// Then the global gradient norm comes from the slices (one all-reduce of one
// number), clipping scales the slices, the optimizer updates this rank's slices,
// and each unit's new parameters are all-gathered into its flat buffer.
//
// kFullySharded keeps, between steps, only this rank's slice of each unit's
// parameters (its own tensor: the optimizer's parameter); the flat buffers'
// storage is released, so the model's parameters keep their shapes but hold no
// data. Gather() all-gathers every unit (launched together, in the order the
// forward pass uses them) before the first forward of a step; once a unit's
// gradients are final in the last backward its reduce-scatter starts and its
// gathered parameters are released, so the backward pass frees memory as it
// goes. The update runs on the slices and needs no all-gather. (libtorch's C++
// modules have no forward hooks, so a unit is not gathered just before its own
// forward: the whole model is gathered for the forward passes of a step.)
// Evaluation gathers too (GatherForEval); the next step gathers afresh.
//
// Only optimizers that update each element from that element's own state
// (torch::optim SGD, Adam, AdamW, RMSprop, Adagrad and BlockedSgd) give the same
// result on slices; the constructor refuses others (LBFGS) by name.
//
// SPMD rule: every rank constructs it with the same model and optimizer, and
// runs the same steps. Not thread-safe: one training thread.
#ifndef LOCKSTEP_SHARDED_DATA_PARALLEL_H_
#define LOCKSTEP_SHARDED_DATA_PARALLEL_H_

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/communicator.h"
#include "lockstep/data_parallel.h"
#include "lockstep/train_state.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace lockstep {

// How a data-parallel job partitions its state; the ZeRO stage in brackets.
enum class PartitioningStrategy {
  kReplicated,             // every rank holds everything (plain data parallelism)
  kShardedOptimizerState,  // [ZeRO-1] optimizer state split over ranks
  kShardedGradients,       // [ZeRO-2] optimizer state and summed gradients split
  kFullySharded,           // [ZeRO-3] and the parameters at rest, gathered for each step
};

// "replicated", "sharded_optimizer_state", "sharded_gradients", "fully_sharded".
std::string PartitioningStrategyName(PartitioningStrategy strategy);
// The strategy of that name; nullopt for another.
std::optional<PartitioningStrategy> ParsePartitioningStrategy(const std::string& name);

struct ShardedDataParallelOptions {
  PartitioningStrategy strategy = PartitioningStrategy::kShardedOptimizerState;
  size_t unit_bytes = size_t{25} << 20;
  // Timeout, start-up check through the coordination service, name: as for DataParallel.
  DataParallelOptions data_parallel;
  // Tensor parallelism beside the data axis (mesh.h): the model's parameters are
  // this model index's shards, those flagged (one flag per model.parameters(),
  // in order) split over `model_axis`. The gradient and weight norms then add the
  // split parameters' squares over the model axis too (the others are the same on
  // every rank of it), so clipping sees the whole model's norm. Null or a group
  // of one: none. Not with kFullySharded (the constructor refuses it).
  Communicator* model_axis = nullptr;
  std::vector<bool> split_over_model;
};

// Bytes this rank holds, by kind, between steps.
struct PartitionedBytes {
  int64_t parameters = 0;       // the flat parameter buffers (padding included)
  int64_t gradients = 0;        // gradient buffers kept between steps
  int64_t optimizer_state = 0;  // tensors in the optimizer's state
};

class ShardedDataParallel {
 public:
  // A collective. Checks that every rank has the same model and fingerprint (as
  // DataParallel does) and broadcasts rank 0's parameters and buffers, then lays
  // the parameters out in units and rebuilds `optimizer`'s parameter groups over
  // this rank's slices (the optimizer must have no state yet). `model` and
  // `optimizer` are borrowed and must outlive this object.
  // Errors: InvalidArgumentError for kReplicated, an optimizer that is not
  // element-wise or already has state, a model that differs across ranks;
  // CollectiveError from the communicator.
  ShardedDataParallel(Communicator* communicator, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                      const std::string& fingerprint, const ShardedDataParallelOptions& options);
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  // Zeroes the gradient buffers: the start of a step (the optimizer's own
  // zero_grad reaches only this rank's slices). Fully sharded: gathers the
  // parameters first (Gather).
  void ZeroGrad();
  // Fully sharded: all-gathers every unit's parameters from the ranks' slices,
  // so that the model's parameters hold the current values; a no-op otherwise.
  void Gather();
  // Fully sharded: gathers unless already gathered (evaluation between steps).
  void GatherForEval();
  // Fully sharded: releases the gathered parameters (the model's parameters
  // then hold no data until the next Gather).
  void Release();
  // Whether the model's parameters hold current values (always, unless fully sharded).
  bool gathered() const;
  // The next backward pass starts each unit's reduction once its gradients are final.
  void Arm();
  // Starts the reductions that have not started and waits for all of them; this
  // rank's slices then hold the summed gradients. Errors: those of Work::Wait.
  void Finish();

  struct StepResult {
    double gradients_l2norm = 0;  // over all ranks' slices, before clipping
    double weights_l2norm = 0;    // over all ranks' slices, after the update
  };
  // Clips the global norm to `max_grad_norm` (0: no clipping), calls
  // `before_update` (may be empty), runs the optimizer on this rank's slices and
  // all-gathers the updated parameters.
  StepResult Step(double max_grad_norm, const std::function<void()>& before_update);

  PartitioningStrategy strategy() const;
  int rank() const;
  int world_size() const;
  // Number of units, and of parameter elements (without padding) in all of them.
  int num_units() const;
  int64_t num_elements() const;
  PartitionedBytes bytes() const;
  // The layout, for checkpoints (TrainState::layout; Trainer sets it).
  std::shared_ptr<const ShardedLayout> layout() const;
  // Seconds the training thread has spent blocked on communication since construction.
  double communication_wait_seconds() const;
  // Sums a float64 CPU tensor in place across ranks (the global batch weight).
  std::shared_ptr<Work> AllReduceSumAsync(const at::Tensor& values);
  void Wait(Work& work);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_SHARDED_DATA_PARALLEL_H_
