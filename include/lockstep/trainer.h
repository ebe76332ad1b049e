// BaseTrainer and Trainer: the train / eval loop over partitioned steps.
//
// BaseTrainer owns the loop: it pulls batches, calls the partitioned TrainStep that
// a subclass overrides, keeps state.step, averages metrics over each summary
// period and hands summaries to the sinks (on rank 0 only). Trainer is the default
// subclass: microbatched gradient accumulation, global-norm clipping and an LR
// schedule, through the step implementation in step.h that TrainLoop shares.
//
// SPMD rule: every rank constructs the same trainer and calls Train and Eval with
// the same arguments in the same order; each rank passes its own shard of the data.
//
// The trainer borrows the TrainState: the caller keeps it, and after Train it
// holds the trained parameters, optimizer state and step. Not thread-safe.
//
//   CONSTRUCTED --Train()--> TRAINING --returns--> IDLE --Train()/Eval()--> ...
//   Any step that throws leaves the state at the last completed step.
#ifndef LOCKSTEP_TRAINER_H_
#define LOCKSTEP_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/actions.h"
#include "lockstep/communicator.h"
#include "lockstep/data.h"
#include "lockstep/data_parallel.h"
#include "lockstep/metrics.h"
#include "lockstep/runtime.h"
#include "lockstep/step.h"
#include "lockstep/train_state.h"

namespace lockstep {

// Named eval sets for BaseTrainer::Eval. Not owned.
using NamedBatchIterators = std::vector<std::pair<std::string, BatchIterator*>>;

class BaseTrainer {
 public:
  // `state` is borrowed and must outlive the trainer. Not owned.
  BaseTrainer(TrainState& state, Runtime runtime);
  virtual ~BaseTrainer() = default;
  BaseTrainer(const BaseTrainer&) = delete;
  BaseTrainer& operator=(const BaseTrainer&) = delete;

  // Runs `num_steps` train steps on batches from `data`, starting at `start_step`
  // (default: state.step). Every `summary_every_steps` steps, and after the last
  // one, a "train" summary goes to the sinks. Returns the metrics of the last
  // summary period. Stops early, without error, when `data` is exhausted or an
  // action halts training (see halt()).
  // Throws InvalidArgumentError for a negative num_steps or start_step.
  MetricMap Train(BatchIterator& data, int64_t num_steps, std::optional<int64_t> start_step = std::nullopt);

  // Evaluates each named set until its iterator is exhausted and sends one summary
  // per set to the sinks. Returns set name -> metric means.
  std::vector<std::pair<std::string, MetricMap>> Eval(const NamedBatchIterators& sets);

  void AddSummarySink(SummarySink sink) { sinks_.push_back(std::move(sink)); }
  // Runs after every summary; a halt stops Train after the current step on every
  // rank (the decision is rank 0's, shared through AgreeOnHalt).
  void AddAction(std::unique_ptr<Action> action) { actions_.push_back(std::move(action)); }
  // Why training stopped early, if an action stopped it.
  const HaltDecision& halt() const { return halt_; }
  void set_summary_every_steps(int64_t steps);

  // Called after every train step with the new state.step; returning true stops
  // Train at once, keeping the unfinished summary period for the next Train (or a
  // checkpoint) instead of summarising it. The preemption path uses it.
  void set_stop_check(std::function<bool(int64_t step)> check) { stop_check_ = std::move(check); }
  // Whether the last Train call ended through the stop check.
  bool stopped_by_check() const { return stopped_by_check_; }
  // The unfinished summary period and the actions' state, for checkpoints, so that
  // a resumed run prints and decides exactly as an uninterrupted one.
  // RestoreTrainerState throws InvalidArgumentError on text it did not write.
  std::string SaveTrainerState() const;
  void RestoreTrainerState(const std::string& state);

  TrainState& state() { return state_; }
  const Runtime& runtime() const { return runtime_; }

 protected:
  // One partitioned train step on this rank's shard of a global batch. Must apply
  // exactly one optimizer update and increment state().step. Returns its metrics.
  virtual MetricMap TrainStep(const Batch& batch) = 0;
  // Metric sums of one eval batch of this rank's shard.
  virtual MetricSums EvalStep(const Batch& batch) = 0;
  // Combines one eval set's sums over ranks (default: this rank's alone).
  virtual void ReduceEvalSums(MetricSums& /*sums*/) {}

  // Shares rank 0's decision with every rank (default: a world of one).
  virtual HaltDecision AgreeOnHalt(const HaltDecision& rank0_decision) { return rank0_decision; }

  // Hands the summary to the sinks and actions (rank 0), then agrees on halting.
  void Emit(const Summary& summary);

 private:
  TrainState& state_;  // Not owned.
  const Runtime runtime_;
  int64_t summary_every_steps_ = 100;
  std::vector<SummarySink> sinks_;
  std::vector<std::unique_ptr<Action>> actions_;
  HaltDecision halt_;
  MetricsAccumulator period_;  // the train summary period in progress
  std::function<bool(int64_t)> stop_check_;
  bool stopped_by_check_ = false;
};

struct TrainerOptions {
  StepOptions step;
  int64_t summary_every_steps = 100;
  // Metrics for Eval; default: ClassificationMetrics(loss).
  MetricFn eval_metrics;
  // Ranks to train with, data-parallel; null or a world of 1 trains alone. Not owned.
  Communicator* communicator = nullptr;
  DataParallelOptions data_parallel;
  // What else must agree across ranks (the resolved config, say); checked at start.
  std::string fingerprint;
};

// The default trainer. Components are replaceable: any module with an ApplyFn, any
// per-example loss, any optimizer in the state.
class Trainer : public BaseTrainer {
 public:
  // Throws InvalidArgumentError for a state without model or optimizer, or bad
  // options. With a communicator of more than one rank this is a collective: see
  // DataParallel for the start-up check and the broadcast of rank 0's parameters.
  Trainer(TrainState& state, ApplyFn apply, LossFn loss, TrainerOptions options,
          Runtime runtime = Runtime::SingleProcess());

  // Null when training alone.
  DataParallel* data_parallel() { return data_parallel_.get(); }

 protected:
  MetricMap TrainStep(const Batch& batch) override;
  MetricSums EvalStep(const Batch& batch) override;
  void ReduceEvalSums(MetricSums& sums) override;
  HaltDecision AgreeOnHalt(const HaltDecision& rank0_decision) override;

 private:
  const ApplyFn apply_;
  const LossFn loss_;
  TrainerOptions options_;
  std::unique_ptr<DataParallel> data_parallel_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_TRAINER_H_
