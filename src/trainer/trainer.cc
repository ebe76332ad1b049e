#include "lockstep/trainer.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lockstep/agreement.h"
#include "lockstep/errors.h"
#include "lockstep/summary_writers.h"

namespace lockstep {

BaseTrainer::BaseTrainer(TrainState& state, Runtime runtime) : state_(state), runtime_(std::move(runtime)) {}

BaseTrainer::~BaseTrainer() {
  try {
    CloseWriters();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep: a summary writer failed: %s\n", e.what());
  }
}

void BaseTrainer::set_communicator(Communicator* communicator, CollectiveOptions options) {
  if (!managers_.empty()) throw InvalidArgumentError("set_communicator: call it before the first Train or Eval");
  communicator_ = communicator;
  collective_ = options;
}

void BaseTrainer::ChangeCommunicator(Communicator* communicator) {
  if (mesh_ != nullptr) throw InvalidArgumentError("ChangeCommunicator: a trainer on a mesh cannot change its world");
  managers_.clear();
  communicator_ = communicator;
}

void BaseTrainer::set_mesh(const DeviceMesh* mesh, const Partitioner* partitioner, CollectiveOptions options) {
  if (mesh == nullptr || partitioner == nullptr) throw InvalidArgumentError("set_mesh: the mesh and partitioner are required");
  if (partitioner->shape().data != mesh->shape().data || partitioner->shape().model != mesh->shape().model) {
    throw InvalidArgumentError("set_mesh: the partitioner is for a " + DescribeMesh(partitioner->shape()) +
                               " mesh, the mesh is " + DescribeMesh(mesh->shape()));
  }
  set_communicator(mesh->world(), options);
  mesh_ = mesh;
  partitioner_ = partitioner;
}

void BaseTrainer::AddSummaryWriter(SummarySink writer) {
  if (!managers_.empty()) throw InvalidArgumentError("AddSummaryWriter: add writers before the first Train or Eval");
  writer_sinks_.push_back(std::move(writer));
}

void BaseTrainer::CloseWriters() {
  if (writer_) writer_->Close();
}

void BaseTrainer::SetMetricReduction(const std::string& name, MetricReduction reduction) {
  reductions_[name] = reduction;
  for (auto& [task, manager] : managers_) manager->SetReduction(name, reduction);
}

MetricsManager& BaseTrainer::metrics_manager(const std::string& task) {
  std::unique_ptr<MetricsManager>& manager = managers_[task];
  if (!manager) {
    if (runtime_.is_chief() && !writer_sinks_.empty() && !writer_) {
      writer_ = std::make_shared<AsyncSummaryWriter>(writer_sinks_);
    }
    MetricsManager::Options options;
    options.task = task;
    options.communicator = communicator_;
    options.collective = collective_;
    if (runtime_.is_chief()) options.writer = writer_;
    options.derive = [this](const std::string& name, MetricMap& metrics) {
      if (name == "train") {
        auto per_step = metrics.find(kSecondsPerStep);
        if (data_wait_steps_ > 0 && per_step != metrics.end() && per_step->second > 0) {
          metrics[kDataWaitFraction] =
              std::min(1.0, data_wait_seconds_ / static_cast<double>(data_wait_steps_) / per_step->second);
        }
        data_wait_seconds_ = 0;
        data_wait_steps_ = 0;
      }
      for (const DeriveMetricsFn& derive : derivers_) derive(name, metrics);
    };
    manager = std::make_unique<MetricsManager>(std::move(options));
    for (const auto& [name, reduction] : reductions_) manager->SetReduction(name, reduction);
  }
  return *manager;
}

void BaseTrainer::set_summary_every_steps(int64_t steps) {
  if (steps <= 0) throw InvalidArgumentError("summary_every_steps must be positive, got " + std::to_string(steps));
  summary_every_steps_ = steps;
}

void BaseTrainer::Emit(const Summary& summary) {
  HaltDecision decision;
  if (runtime_.is_chief()) {
    for (const SummarySink& sink : sinks_) sink(summary);
    for (const auto& action : actions_) {
      HaltDecision d = action->OnSummary(summary);
      if (d.halt && !decision.halt) decision = std::move(d);
    }
  }
  if (actions_.empty()) return;  // every rank has the same actions (SPMD)
  decision = AgreeOnHalt(decision);
  if (decision.halt && !halt_.halt) halt_ = decision;
}

HaltDecision BaseTrainer::AgreeOnHalt(const HaltDecision& rank0_decision) {
  if (communicator_ == nullptr || communicator_->world_size() == 1) return rank0_decision;
  // [halt, failure] then the reason, from rank 0.
  at::Tensor head = at::tensor({static_cast<int64_t>(rank0_decision.halt), static_cast<int64_t>(rank0_decision.failure)},
                               at::kLong);
  communicator_->Broadcast(head, 0, collective_);
  HaltDecision decision;
  decision.halt = head[0].item<int64_t>() != 0;
  decision.failure = head[1].item<int64_t>() != 0;
  if (decision.halt) decision.reason = BroadcastString(*communicator_, rank0_decision.reason, 0, collective_);
  return decision;
}

MetricMap BaseTrainer::Train(BatchIterator& data, int64_t num_steps, std::optional<int64_t> start_step) {
  if (num_steps < 0) throw InvalidArgumentError("Train: num_steps must be >= 0, got " + std::to_string(num_steps));
  if (start_step) {
    if (*start_step < 0) throw InvalidArgumentError("Train: start_step must be >= 0");
    state_.step = *start_step;
  }
  MetricsManager& period = metrics_manager("train");
  period.StartTimer();
  struct StopTimer {
    MetricsManager& m;
    ~StopTimer() { m.StopTimer(); }
  } stop_timer{period};
  MetricMap last;
  stopped_by_check_ = false;
  auto flush = [&] {
    Summary summary = period.Flush(state_.step);
    last = summary.metrics;
    Emit(summary);
  };
  for (int64_t i = 0; i < num_steps && !halt_.halt; ++i) {
    if (timeline_ != nullptr) timeline_->BeginStep(state_.step + 1);
    const auto wait_start = std::chrono::steady_clock::now();
    std::optional<Batch> batch = data.Next();
    if (!batch) break;
    const auto wait_end = std::chrono::steady_clock::now();
    data_wait_seconds_ += std::chrono::duration<double>(wait_end - wait_start).count();
    ++data_wait_steps_;
    if (timeline_ != nullptr) timeline_->Add("data wait", wait_start, wait_end);
    const int64_t before = state_.step;
    period.AddStep(TrainStep(*batch));
    if (timeline_ != nullptr) timeline_->EndStep();
    if (state_.step != before + 1) {
      throw Error("TrainStep must advance state.step by exactly one (went from " + std::to_string(before) + " to " +
                  std::to_string(state_.step) + ")");
    }
    if (state_.step % summary_every_steps_ == 0) flush();
    if (halt_.halt) break;
    if (stop_check_ && stop_check_(state_.step)) {
      stopped_by_check_ = true;
      return last;  // the unfinished period stays for the checkpoint
    }
  }
  if (!period.empty()) flush();
  return last;
}

std::vector<std::pair<std::string, MetricMap>> BaseTrainer::Eval(const NamedBatchIterators& sets) {
  std::vector<std::pair<std::string, MetricMap>> results;
  for (const auto& [name, iterator] : sets) {
    if (iterator == nullptr) throw InvalidArgumentError("Eval: no iterator for eval set '" + name + "'");
    if (name == "train") throw InvalidArgumentError("Eval: 'train' is the train task's name; name the eval set otherwise");
    MetricsManager& period = metrics_manager(name);
    period.StartTimer();
    while (std::optional<Batch> batch = iterator->Next()) period.AddSums(EvalStep(*batch));
    period.StopTimer();
    Summary summary = period.Flush(state_.step);
    Emit(summary);
    results.emplace_back(name, std::move(summary.metrics));
  }
  return results;
}

Trainer::Trainer(TrainState& state, ApplyFn apply, LossFn loss, TrainerOptions options, Runtime runtime)
    : BaseTrainer(state, std::move(runtime)),
      apply_(std::move(apply)),
      loss_(std::move(loss)),
      options_([&] {
        if (!options.eval_metrics) options.eval_metrics = ClassificationMetrics(loss_);
        return std::move(options);
      }()) {
  if (!state.model || !state.optimizer) throw InvalidArgumentError("Trainer: the state has no model or optimizer");
  if (!apply_ || !loss_) throw InvalidArgumentError("Trainer: apply and loss functions are required");
  if (options_.step.num_microbatches < 1) {
    throw InvalidArgumentError("Trainer: num_microbatches must be >= 1, got " +
                               std::to_string(options_.step.num_microbatches));
  }
  if (options_.step.max_grad_norm < 0) throw InvalidArgumentError("Trainer: max_grad_norm must be >= 0");
  if (options_.step.schedule) options_.step.schedule->Validate();
  set_summary_every_steps(options_.summary_every_steps);
  options_.step.before_update = [this, caller = std::move(options_.step.before_update)] {
    if (caller) caller();
    BeforeUpdate();
  };
  // With a mesh: data parallelism over its data axis, metrics over the world.
  Communicator* const world = options_.mesh != nullptr ? options_.mesh->world() : options_.communicator;
  Communicator* const data_axis = options_.mesh != nullptr ? options_.mesh->data() : options_.communicator;
  if (options_.mesh != nullptr) {
    if (options_.communicator != nullptr && options_.communicator != options_.mesh->world()) {
      throw InvalidArgumentError("Trainer: with a mesh, communicator must be null or the mesh's world");
    }
    Communicator* const model_axis = options_.mesh->model();
    if (model_axis->world_size() > 1) {
      if (options_.partitioning == PartitioningStrategy::kFullySharded) {
        throw InvalidArgumentError(
            "Trainer: partitioning strategy fully_sharded with a model axis of more than one rank is not supported; "
            "use sharded_optimizer_state or sharded_gradients (ZeRO-1/2 over the data axis) with a mesh");
      }
      std::map<std::string, bool> split;
      for (const ParameterLayout& layout : options_.parameter_layouts) split[layout.name] = layout.sharded();
      for (const auto& item : state.model->named_parameters()) {
        auto it = split.find(item.key());
        if (it == split.end()) {
          throw InvalidArgumentError("Trainer: parameter_layouts has no layout for parameter '" + item.key() +
                                     "' (a mesh with a model axis needs one for every parameter)");
        }
        options_.step.split_over_model.push_back(it->second);
      }
      options_.step.model_axis = model_axis;
      model_replica_ = options_.mesh->model_index() > 0;
    }
  }
  if (data_axis != nullptr && data_axis->world_size() > 1) {
    if (options_.partitioning == PartitioningStrategy::kReplicated) {
      data_parallel_ = std::make_unique<DataParallel>(data_axis, *state.model, options_.fingerprint,
                                                      options_.data_parallel);
      options_.step.data_parallel = data_parallel_.get();
    } else {
      if (options_.partitioning == PartitioningStrategy::kFullySharded && options_.step.weight_metrics) {
        throw InvalidArgumentError(
            "Trainer: weight_metrics reads every parameter after the update, which fully_sharded does not keep; "
            "use sharded_gradients or turn weight_metrics off");
      }
      ShardedDataParallelOptions sharding;
      sharding.strategy = options_.partitioning;
      sharding.unit_bytes = options_.data_parallel.bucket_bytes;
      sharding.data_parallel = options_.data_parallel;
      sharding.model_axis = options_.step.model_axis;
      sharding.split_over_model = options_.step.split_over_model;
      sharded_ = std::make_unique<ShardedDataParallel>(data_axis, *state.model, *state.optimizer,
                                                       options_.fingerprint, sharding);
      options_.step.sharded = sharded_.get();
      state.layout = sharded_->layout();
    }
  }
  set_communicator(world, options_.data_parallel.collective);
}

void Trainer::ChangeCommunicator(Communicator* communicator) {
  if (sharded_ || options_.partitioning != PartitioningStrategy::kReplicated || options_.mesh != nullptr) {
    throw InvalidArgumentError("Trainer: only replicated data parallelism without a mesh can change its world");
  }
  BaseTrainer::ChangeCommunicator(communicator);
  options_.step.data_parallel = nullptr;
  data_parallel_.reset();  // its hooks go with it
  options_.communicator = communicator;
  // The start-up check goes over the new communicator: the coordination
  // client's store still counts the ranks that left.
  options_.data_parallel.coordination = nullptr;
  if (communicator != nullptr && communicator->world_size() > 1) {
    data_parallel_ =
        std::make_unique<DataParallel>(communicator, *state().model, options_.fingerprint, options_.data_parallel);
    options_.step.data_parallel = data_parallel_.get();
  }
}

MetricMap Trainer::TrainStep(const Batch& batch) {
  // The timeline is lent for this step only: whoever owns it (TrainingJob::Run
  // lends one for a run) may destroy it once the step is over, so no copy of
  // the pointer is kept past it.
  struct LendTimeline {
    Trainer& trainer;
    explicit LendTimeline(Trainer& t) : trainer(t) { Set(trainer.timeline()); }
    ~LendTimeline() { Set(nullptr); }
    void Set(Timeline* timeline) {
      trainer.options_.step.timeline = timeline;
      if (trainer.data_parallel_) trainer.data_parallel_->bucketer().set_timeline(timeline);
    }
  } lend(*this);
  MetricMap metrics = RunTrainStep(state(), batch, apply_, loss_, options_.step);
  // Every rank of a model-axis group computed the same values from the same
  // examples: the group's first rank speaks for it.
  if (model_replica_) metrics[kNumExamples] = 0;
  return metrics;
}

MetricSums Trainer::EvalStep(const Batch& batch) {
  if (sharded_) sharded_->GatherForEval();  // fully sharded: the parameters are released between steps
  MetricSums sums = RunEvalStep(*state().model, batch, apply_, options_.eval_metrics);
  if (model_replica_) sums = MetricSums{};
  return sums;
}

// "<length>:<bytes>" for the period, then for each action in order.
std::string BaseTrainer::SaveTrainerState() {
  std::vector<std::string> parts = {metrics_manager("train").SaveState()};
  for (const auto& action : actions_) parts.push_back(action->SaveState());
  std::string out;
  for (const std::string& part : parts) out += std::to_string(part.size()) + ":" + part;
  return out;
}

void BaseTrainer::RestoreTrainerState(const std::string& state) {
  std::vector<std::string> parts;
  size_t at = 0;
  while (at < state.size()) {
    const size_t colon = state.find(':', at);
    if (colon == std::string::npos) throw InvalidArgumentError("trainer state: malformed");
    const std::string length_text = state.substr(at, colon - at);
    char* end = nullptr;
    const unsigned long long length = std::strtoull(length_text.c_str(), &end, 10);
    if (length_text.empty() || *end != '\0' || colon + 1 + length > state.size()) {
      throw InvalidArgumentError("trainer state: malformed");
    }
    parts.push_back(state.substr(colon + 1, length));
    at = colon + 1 + length;
  }
  if (parts.empty()) throw InvalidArgumentError("trainer state: empty");
  if (parts.size() != actions_.size() + 1) {
    throw InvalidArgumentError("trainer state: saved with " + std::to_string(parts.size() - 1) +
                               " actions, this trainer has " + std::to_string(actions_.size()));
  }
  metrics_manager("train").RestoreState(parts[0]);
  for (size_t i = 0; i < actions_.size(); ++i) actions_[i]->RestoreState(parts[i + 1]);
}

}  // namespace lockstep
