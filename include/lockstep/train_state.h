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
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lockstep {

// How a sharded partitioning (lockstep/sharded_data_parallel.h) lays the
// parameters out over ranks, for checkpoints: the parameters of each unit are
// packed, row-major and in `members` order, into one flat buffer of
// world_size * slice elements (zero padding at the end); rank r keeps elements
// [r * slice, (r + 1) * slice) of it, and the optimizer's u-th parameter is that
// slice of unit u, `shard`. A checkpoint saves each rank's pieces of each
// parameter and of its optimizer state, so it loads under any layout.
struct ShardedLayout {
  std::string strategy;  // PartitioningStrategyName, recorded in the manifest
  int rank = 0;
  int world_size = 1;
  // The model's parameters hold every element on every rank (false when fully
  // sharded: then only the shards hold them between steps).
  bool parameters_whole = true;
  struct Member {
    std::string name;  // in the model's named_parameters()
    std::vector<int64_t> shape;
    int64_t offset = 0;  // in the unit's flat buffer
    int64_t numel = 0;
  };
  struct Unit {
    std::vector<Member> members;
    int64_t slice = 0;
    at::Tensor shard;  // this rank's slice of the unit's parameters (1-D, `slice` elements)
  };
  std::vector<Unit> units;  // in the order of the optimizer's parameters
};

struct TrainState {
  std::shared_ptr<torch::nn::Module> model;
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  int64_t step = 0;
  // Set by a sharded partitioning: the optimizer's parameters are then the units'
  // slices, not the model's parameters. Null: both whole on every rank.
  std::shared_ptr<const ShardedLayout> layout;
};

// State that a BaseTrainer subclass keeps in checkpoints besides the model, the
// optimizer and the step: named tensors ("custom/tensor/<name>" in a shard) and
// named bytes ("custom/bytes/<name>", as uint8 tensors). Each rank saves and gets
// back its own.
struct CustomState {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> bytes;
};

// Optional interface of an optimizer whose step() also sums the squares of the
// gradients it applied and of the weights it left (BlockedSgd does, in its one
// pass over the model). The train step asks for it and, when the sums cover every
// parameter, takes its gradients_l2norm and weights_l2norm from them instead of
// two more passes over the model; otherwise it computes the norms itself.
class ReportsStepSquares {
 public:
  // What the last step() saw, over the `tensors` parameters (`elements` values)
  // that had a gradient. `complete` is false when some of them were left out of
  // the sums.
  struct Squares {
    double gradients = 0;
    double weights = 0;
    int64_t tensors = 0;
    int64_t elements = 0;
    bool complete = false;
  };
  virtual ~ReportsStepSquares() = default;
  virtual const Squares& last_step_squares() const = 0;
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

// The key type of Optimizer::state(): the TensorImpl's address as text in
// libtorch 1.x, the address itself in 2.x.
using OptimizerStateKeyType = std::remove_cv_t<
    std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>>::key_type;

// The key under which torch::optim optimizers keep a parameter's state in
// Optimizer::state().
OptimizerStateKeyType OptimizerStateKey(const torch::Tensor& parameter);

// Builds a train state at step 0: the module, and an optimizer over its parameters.
TrainState MakeTrainState(std::shared_ptr<torch::nn::Module> model, const OptimizerFactory& optimizer);

}  // namespace lockstep

#endif  // LOCKSTEP_TRAIN_STATE_H_
