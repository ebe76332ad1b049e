#include "lockstep/sharded_data_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <cmath>
#include <utility>

#include "lockstep/errors.h"
#include "gradient_readiness.h"

namespace lockstep {

std::string PartitioningStrategyName(PartitioningStrategy strategy) {
  switch (strategy) {
    case PartitioningStrategy::kReplicated:
      return "replicated";
    case PartitioningStrategy::kShardedOptimizerState:
      return "sharded_optimizer_state";
    case PartitioningStrategy::kShardedGradients:
      return "sharded_gradients";
    case PartitioningStrategy::kFullySharded:
      return "fully_sharded";
  }
  return "unknown";
}

std::optional<PartitioningStrategy> ParsePartitioningStrategy(const std::string& name) {
  for (PartitioningStrategy s : {PartitioningStrategy::kReplicated, PartitioningStrategy::kShardedOptimizerState,
                                 PartitioningStrategy::kShardedGradients, PartitioningStrategy::kFullySharded}) {
    if (PartitioningStrategyName(s) == name) return s;
  }
  return std::nullopt;
}

namespace {

bool IsElementWise(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr ||
         dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr;
}

int64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// Elements [offset, offset + n) of a flat tensor as a plain tensor on its
// storage, not an autograd view: optimizers detach_() and zero_() gradients, which
// libtorch refuses on views.
at::Tensor PlainSlice(const at::Tensor& flat, int64_t offset, int64_t n) { return internal::PlainView(flat, offset, {n}); }

// A fully sharded unit's gathered parameters: the storage is released between
// steps and allocated again (same size, same allocator) for the next gather; the
// model's parameters stay views of it throughout.
void ReleaseStorage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, flat.device()));
  storage->set_nbytes(0);
}
void AllocateStorage(const at::Tensor& flat) {
  c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(flat.numel()) * flat.element_size();
  if (storage->nbytes() == nbytes) return;
  c10::Allocator* allocator = storage->allocator() != nullptr ? storage->allocator() : c10::GetAllocator(flat.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

// The square of a tensor's L2 norm (libtorch's norm, without a float64 copy).
double SquaredNorm(const at::Tensor& t) {
  const double norm = t.norm(2).item<double>();
  return norm * norm;
}

// The bytes of one parameter's state in the element-wise optimizers.
int64_t OptimizerStateBytes(const torch::optim::OptimizerParamState& state) {
  using namespace torch::optim;  // NOLINT: the state types below
  if (const auto* s = dynamic_cast<const SGDParamState*>(&state)) return Bytes(s->momentum_buffer());
  if (const auto* s = dynamic_cast<const AdamParamState*>(&state)) {
    return Bytes(s->exp_avg()) + Bytes(s->exp_avg_sq()) + Bytes(s->max_exp_avg_sq());
  }
  if (const auto* s = dynamic_cast<const AdamWParamState*>(&state)) {
    return Bytes(s->exp_avg()) + Bytes(s->exp_avg_sq()) + Bytes(s->max_exp_avg_sq());
  }
  if (const auto* s = dynamic_cast<const RMSpropParamState*>(&state)) {
    return Bytes(s->square_avg()) + Bytes(s->momentum_buffer()) + Bytes(s->grad_avg());
  }
  if (const auto* s = dynamic_cast<const AdagradParamState*>(&state)) return Bytes(s->sum());
  return 0;
}

}  // namespace

struct ShardedDataParallel::State {
  struct Unit {
    std::vector<size_t> params;  // indices into `parameters`
    std::vector<int64_t> offsets;
    int64_t numel = 0;   // without padding
    int64_t padded = 0;  // a multiple of the world size
    int64_t slice = 0;   // padded / world size
    at::Tensor flat_param;
    at::Tensor flat_grad;   // kShardedGradients: only while a step runs
    at::Tensor shard;       // this rank's slice of flat_param (fully sharded: its own tensor): the optimizer's parameter
    at::Tensor shard_grad;  // this rank's slice of the summed gradients
    std::shared_ptr<Work> work;
    bool params_released = false;  // fully sharded, between steps
  };

  Communicator* communicator = nullptr;  // Not owned.
  torch::optim::Optimizer* optimizer = nullptr;  // Not owned.
  ShardedDataParallelOptions options;
  std::vector<at::Tensor> parameters;
  std::vector<size_t> unit_of;
  std::vector<at::Tensor> views;  // parameter -> its slice of its unit's flat_grad
  std::vector<Unit> units;
  std::shared_ptr<ShardedLayout> layout;
  std::unique_ptr<internal::GradientReadiness> readiness;  // starts units' reductions from autograd hooks
  bool gathered = true;  // fully sharded: the flat buffers hold current parameters
  double wait_seconds = 0;

  int rank() const { return communicator->rank(); }
  int world() const { return communicator->world_size(); }
  bool sharded_gradients() const { return options.strategy != PartitioningStrategy::kShardedOptimizerState; }
  bool fully_sharded() const { return options.strategy == PartitioningStrategy::kFullySharded; }

  void Gather() {
    // Launched together, the unit the forward pass uses first (the last one) first.
    std::vector<std::shared_ptr<Work>> works;
    for (auto unit = units.rbegin(); unit != units.rend(); ++unit) {
      AllocateStorage(unit->flat_param);
      unit->params_released = false;
      works.push_back(communicator->AllGatherAsync(unit->flat_param, unit->shard, options.data_parallel.collective));
    }
    for (auto& work : works) WaitFor(*work);
    gathered = true;
  }

  // A fully sharded unit's gathered parameters go back to the allocator.
  void ReleaseParameters(Unit& unit) {
    if (unit.params_released) return;
    ReleaseStorage(unit.flat_param);
    unit.params_released = true;
  }

  void Release() {
    for (Unit& unit : units) ReleaseParameters(unit);
    gathered = false;
  }

  // Gradient buffers and the parameters' .grad as views of them.
  void AllocateGradients(Unit& unit) {
    at::NoGradGuard no_grad;
    const at::TensorOptions grad_options = unit.flat_param.options();
    if (sharded_gradients()) {
      // Allocated for each step and freed after it (the allocator keeps the memory
      // for the next one, so no page is faulted in again).
      unit.flat_grad = at::empty({unit.padded}, grad_options);
      unit.flat_grad.narrow(0, unit.numel, unit.padded - unit.numel).zero_();  // the views cover the rest
    } else {
      // Kept: all-reduced where the communicator reduces fastest (shared memory on one host).
      unit.flat_grad = communicator->AllocateCollectiveBuffer(unit.padded, grad_options, options.data_parallel.collective)
                           .zero_();
      unit.shard_grad = PlainSlice(unit.flat_grad, rank() * unit.slice, unit.slice);
    }
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const size_t p = unit.params[k];
      at::Tensor view = internal::PlainView(unit.flat_grad, unit.offsets[k], parameters[p].sizes());
      views[p] = view;
      if (parameters[p].requires_grad()) parameters[p].mutable_grad() = view;
    }
  }

  bool GradIsView(size_t p) const { return internal::GradIs(parameters[p], views[p]); }

  void EnsureGradients() {
    for (Unit& unit : units) {
      if (!unit.flat_grad.defined()) AllocateGradients(unit);
    }
  }

  void Launch(size_t u) {
    Unit& unit = units[u];
    for (size_t p : unit.params) internal::CopyGradInto(parameters[p], views[p]);
    const CollectiveOptions& collective = options.data_parallel.collective;
    if (sharded_gradients()) {
      unit.work = communicator->ReduceScatterAsync(unit.shard_grad, unit.flat_grad, ReduceOp::kSum, collective);
      // Its backward is done: the gathered parameters are not needed until the next step.
      if (fully_sharded()) ReleaseParameters(unit);
    } else {
      unit.work = communicator->AllReduceAsync(unit.flat_grad, ReduceOp::kSum, collective);
    }
  }


  void WaitFor(Work& work) {
    const auto start = std::chrono::steady_clock::now();
    work.Wait();
    wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // This rank's squares of a unit's slice (its shard or shard_grad): of the
  // elements of parameters split over the model axis, and of the others.
  std::pair<double, double> SliceSquares(const Unit& unit, const at::Tensor& slice) const {
    if (!has_model_axis()) return {0.0, SquaredNorm(slice)};
    double split = 0, others = 0;
    const int64_t begin = static_cast<int64_t>(rank()) * unit.slice;
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const int64_t first = std::max(begin, unit.offsets[k]);
      const int64_t last = std::min(begin + unit.slice, unit.offsets[k] + parameters[unit.params[k]].numel());
      if (first >= last) continue;
      const double squares = SquaredNorm(slice.narrow(0, first - begin, last - first));
      (options.split_over_model[unit.params[k]] ? split : others) += squares;
    }
    return {split, others};
  }

  bool has_model_axis() const { return options.model_axis != nullptr && options.model_axis->world_size() > 1; }

  // The L2 norm over every rank of squares summed by SliceSquares.
  double MeshNorm(std::pair<double, double> squares) {
    if (!has_model_axis()) return std::sqrt(SumOverRanks(squares.first + squares.second));
    at::Tensor values = at::tensor({squares.first, squares.second}, at::kDouble);
    const auto start = std::chrono::steady_clock::now();
    communicator->AllReduce(values, ReduceOp::kSum, options.data_parallel.collective);
    at::Tensor split = values.narrow(0, 0, 1).clone();
    options.model_axis->AllReduce(split, ReduceOp::kSum, options.data_parallel.collective);
    wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::sqrt(split.item<double>() + values[1].item<double>());
  }

  // Sum over ranks of one local number.
  double SumOverRanks(double local) {
    at::Tensor value = at::tensor({local}, at::kDouble);
    const auto start = std::chrono::steady_clock::now();
    communicator->AllReduce(value, ReduceOp::kSum, options.data_parallel.collective);
    wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return value.item<double>();
  }
};

ShardedDataParallel::ShardedDataParallel(Communicator* communicator, torch::nn::Module& model,
                                         torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                                         const ShardedDataParallelOptions& options)
    : state_(std::make_shared<State>()) {
  if (communicator == nullptr) throw InvalidArgumentError("ShardedDataParallel: no communicator");
  if (options.strategy == PartitioningStrategy::kReplicated) {
    throw InvalidArgumentError("ShardedDataParallel: the replicated strategy is DataParallel's");
  }
  if (!IsElementWise(optimizer)) {
    throw InvalidArgumentError(
        "partitioning strategy " + PartitioningStrategyName(options.strategy) +
        " needs an optimizer that updates each parameter element from its own state (SGD, Adam, AdamW, RMSprop, "
        "Adagrad); this one is not");
  }
  if (!optimizer.state().empty()) {
    throw InvalidArgumentError("ShardedDataParallel: the optimizer already has state; shard it before its first step");
  }
  if (options.unit_bytes == 0) throw InvalidArgumentError("ShardedDataParallel: unit_bytes must be positive");
  if (options.model_axis != nullptr && options.model_axis->world_size() > 1) {
    if (options.strategy == PartitioningStrategy::kFullySharded) {
      throw InvalidArgumentError(
          "partitioning strategy fully_sharded with a model axis of more than one rank is not supported; use "
          "sharded_optimizer_state or sharded_gradients over the data axis of a mesh");
    }
    const size_t num_parameters = model.parameters().size();
    if (options.split_over_model.size() != num_parameters) {
      throw InvalidArgumentError("ShardedDataParallel: split_over_model has " +
                                 std::to_string(options.split_over_model.size()) + " flags for " +
                                 std::to_string(num_parameters) + " parameters");
    }
  }
  CheckModelsAgreeAndBroadcast(communicator, model, fingerprint, options.data_parallel);

  State& s = *state_;
  s.communicator = communicator;
  s.optimizer = &optimizer;
  s.options = options;
  s.parameters = model.parameters();
  s.unit_of.assign(s.parameters.size(), 0);
  s.views.resize(s.parameters.size());
  std::map<const void*, size_t> index_of;
  for (size_t i = 0; i < s.parameters.size(); ++i) index_of[s.parameters[i].unsafeGetTensorImpl()] = i;

  const int world = s.world();
  at::NoGradGuard no_grad;
  // Units per parameter group, in reverse order; the group's parameters become
  // this rank's slices of its units.
  for (auto& group : optimizer.param_groups()) {
    std::vector<size_t> members;
    for (const at::Tensor& p : group.params()) {
      auto it = index_of.find(p.unsafeGetTensorImpl());
      if (it == index_of.end()) {
        throw InvalidArgumentError("ShardedDataParallel: the optimizer has a parameter that is not the model's");
      }
      members.push_back(it->second);
    }
    const size_t first_unit = s.units.size();
    size_t bytes = 0;
    for (auto it = members.rbegin(); it != members.rend(); ++it) {
      const at::Tensor& p = s.parameters[*it];
      const size_t size = p.numel() * p.element_size();
      const bool dtype_change = s.units.size() > first_unit &&
                                s.parameters[s.units.back().params.front()].scalar_type() != p.scalar_type();
      if (s.units.size() == first_unit || dtype_change || (bytes > 0 && bytes + size > options.unit_bytes)) {
        s.units.emplace_back();
        bytes = 0;
      }
      State::Unit& unit = s.units.back();
      unit.params.push_back(*it);
      unit.offsets.push_back(unit.numel);
      unit.numel += p.numel();
      s.unit_of[*it] = s.units.size() - 1;
      bytes += size;
    }
    std::vector<at::Tensor> shards;
    for (size_t u = first_unit; u < s.units.size(); ++u) {
      State::Unit& unit = s.units[u];
      unit.slice = (unit.numel + world - 1) / world;
      unit.padded = unit.slice * world;
      const at::Tensor& first = s.parameters[unit.params.front()];
      // Whole parameters are kept in a collective buffer, all-gathered in place
      // (shared memory on one host); fully sharded ones come and go with each step.
      const at::TensorOptions param_options = first.options().requires_grad(false);
      unit.flat_param = s.fully_sharded() ? at::zeros({unit.padded}, param_options)
                                          : communicator->AllocateCollectiveBuffer(unit.padded, param_options,
                                                                                   options.data_parallel.collective)
                                                .zero_();
      for (size_t k = 0; k < unit.params.size(); ++k) {
        at::Tensor& p = s.parameters[unit.params[k]];
        at::Tensor view = unit.flat_param.narrow(0, unit.offsets[k], p.numel()).view(p.sizes());
        view.copy_(p.detach());
        p.set_data(view);
      }
      if (s.fully_sharded()) {
        unit.shard = unit.flat_param.narrow(0, s.rank() * unit.slice, unit.slice).clone();
      } else {
        unit.shard = PlainSlice(unit.flat_param, s.rank() * unit.slice, unit.slice);
      }
      if (s.sharded_gradients()) unit.shard_grad = at::zeros({unit.slice}, unit.flat_param.options());
      shards.push_back(unit.shard);
    }
    group.params() = std::move(shards);
  }
  s.EnsureGradients();

  auto layout = std::make_shared<ShardedLayout>();
  layout->strategy = PartitioningStrategyName(options.strategy);
  layout->rank = s.rank();
  layout->world_size = world;
  const auto named = model.named_parameters();
  for (const State::Unit& unit : s.units) {
    ShardedLayout::Unit& out = layout->units.emplace_back();
    out.slice = unit.slice;
    out.shard = unit.shard;
    for (size_t k = 0; k < unit.params.size(); ++k) {
      const at::Tensor& p = s.parameters[unit.params[k]];
      out.members.push_back({named[unit.params[k]].key(), p.sizes().vec(), unit.offsets[k], p.numel()});
    }
  }
  layout->parameters_whole = !s.fully_sharded();
  s.layout = std::move(layout);
  if (s.fully_sharded()) s.Release();

  State* state = &s;  // the readiness is the state's, so it never outlives it
  s.readiness = std::make_unique<internal::GradientReadiness>(s.parameters, [state](size_t u) { state->Launch(u); });
  std::vector<std::vector<size_t>> groups;
  for (const State::Unit& unit : s.units) groups.push_back(unit.params);
  s.readiness->SetGroups(groups);
}

ShardedDataParallel::~ShardedDataParallel() = default;

void ShardedDataParallel::Gather() {
  if (state_->fully_sharded()) state_->Gather();
}

void ShardedDataParallel::GatherForEval() {
  if (state_->fully_sharded() && !state_->gathered) state_->Gather();
}

void ShardedDataParallel::Release() {
  if (state_->fully_sharded()) state_->Release();
}

bool ShardedDataParallel::gathered() const { return state_->gathered; }

void ShardedDataParallel::ZeroGrad() {
  State& s = *state_;
  // The slices may have changed since the last gather (an update, a restored checkpoint).
  if (s.fully_sharded()) s.Gather();
  s.EnsureGradients();
  at::NoGradGuard no_grad;
  for (State::Unit& unit : s.units) {
    unit.flat_grad.zero_();
    for (size_t p : unit.params) {
      if (s.parameters[p].requires_grad() && !s.GradIsView(p)) s.parameters[p].mutable_grad() = s.views[p];
    }
  }
}

void ShardedDataParallel::Arm() {
  State& s = *state_;
  s.EnsureGradients();
  {
    at::NoGradGuard no_grad;
    for (size_t p = 0; p < s.parameters.size(); ++p) {
      if (s.parameters[p].requires_grad()) internal::PointGradAt(s.parameters[p], s.views[p]);
    }
  }
  for (State::Unit& unit : s.units) unit.work.reset();
  s.readiness->Arm();
}

void ShardedDataParallel::Finish() {
  State& s = *state_;
  if (!s.readiness->armed()) Arm();
  s.readiness->LaunchRest();
  for (State::Unit& unit : s.units) s.WaitFor(*unit.work);
  at::NoGradGuard no_grad;
  for (State::Unit& unit : s.units) {
    unit.shard.mutable_grad() = unit.shard_grad;
    if (s.sharded_gradients()) {
      // Only this rank's slice of the sums stays between steps.
      for (size_t p : unit.params) {
        s.parameters[p].mutable_grad() = at::Tensor();
        s.views[p] = at::Tensor();
      }
      unit.flat_grad = at::Tensor();
    }
  }
  if (s.fully_sharded()) s.Release();  // every unit's, its backward done
}

ShardedDataParallel::StepResult ShardedDataParallel::Step(double max_grad_norm,
                                                          const std::function<void()>& before_update) {
  State& s = *state_;
  if (max_grad_norm < 0) throw InvalidArgumentError("ShardedDataParallel::Step: max_grad_norm must be >= 0");
  StepResult result;
  at::NoGradGuard no_grad;
  std::pair<double, double> squares;
  for (const State::Unit& unit : s.units) {
    const auto [split, others] = s.SliceSquares(unit, unit.shard_grad);
    squares.first += split;
    squares.second += others;
  }
  result.gradients_l2norm = s.MeshNorm(squares);
  if (max_grad_norm > 0) {
    // As torch::nn::utils::clip_grad_norm_ does.
    const double coefficient = max_grad_norm / (result.gradients_l2norm + 1e-6);
    if (coefficient < 1) {
      for (State::Unit& unit : s.units) unit.shard_grad.mul_(coefficient);
    }
  }
  if (before_update) before_update();
  s.optimizer->step();
  std::vector<std::shared_ptr<Work>> works;
  std::pair<double, double> weights;
  for (State::Unit& unit : s.units) {
    const auto [split, others] = s.SliceSquares(unit, unit.shard);
    weights.first += split;
    weights.second += others;
    if (s.fully_sharded()) continue;  // gathered at the next step
    // In place: the shard is this rank's slice of the flat buffer.
    works.push_back(s.communicator->AllGatherAsync(unit.flat_param, unit.shard, s.options.data_parallel.collective));
  }
  if (s.fully_sharded()) s.Release();  // already, unless a unit had no gradient to wait for
  result.weights_l2norm = s.MeshNorm(weights);
  for (auto& work : works) s.WaitFor(*work);
  return result;
}

PartitioningStrategy ShardedDataParallel::strategy() const { return state_->options.strategy; }
int ShardedDataParallel::rank() const { return state_->rank(); }
int ShardedDataParallel::world_size() const { return state_->world(); }
int ShardedDataParallel::num_units() const { return static_cast<int>(state_->units.size()); }

int64_t ShardedDataParallel::num_elements() const {
  int64_t n = 0;
  for (const State::Unit& unit : state_->units) n += unit.numel;
  return n;
}

PartitionedBytes ShardedDataParallel::bytes() const {
  PartitionedBytes b;
  for (const State::Unit& unit : state_->units) {
    b.parameters += state_->fully_sharded() ? Bytes(unit.shard) + (unit.params_released ? 0 : Bytes(unit.flat_param))
                                            : Bytes(unit.flat_param);
    b.gradients += Bytes(unit.flat_grad) + (state_->sharded_gradients() ? Bytes(unit.shard_grad) : 0);
  }
  for (const auto& [key, param_state] : state_->optimizer->state()) {
    (void)key;
    b.optimizer_state += OptimizerStateBytes(*param_state);
  }
  return b;
}

std::shared_ptr<const ShardedLayout> ShardedDataParallel::layout() const { return state_->layout; }

double ShardedDataParallel::communication_wait_seconds() const { return state_->wait_seconds; }

std::shared_ptr<Work> ShardedDataParallel::AllReduceSumAsync(const at::Tensor& values) {
  return state_->communicator->AllReduceAsync(values, ReduceOp::kSum, state_->options.data_parallel.collective);
}

void ShardedDataParallel::Wait(Work& work) { state_->WaitFor(work); }

}  // namespace lockstep
