// BaseTrainer and Trainer: the train / eval loop over partitioned steps.
//
// BaseTrainer owns the loop: it pulls batches, calls the partitioned TrainStep that
// a subclass overrides, keeps state.step, and feeds one MetricsManager per task
// (train and each eval set) that combines each summary period over the ranks of
// its communicator; rank 0 hands summaries to the sinks (training thread) and the
// writers (background thread), and runs the actions. Trainer is the default
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
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/actions.h"
#include "lockstep/communicator.h"
#include "lockstep/data.h"
#include "lockstep/data_parallel.h"
#include "lockstep/mesh.h"
#include "lockstep/metrics.h"
#include "lockstep/metrics_manager.h"
#include "lockstep/runtime.h"
#include "lockstep/sharded_data_parallel.h"
#include "lockstep/step.h"
#include "lockstep/timeline.h"
#include "lockstep/train_state.h"

namespace lockstep {

// Named eval sets for BaseTrainer::Eval. Not owned.
using NamedBatchIterators = std::vector<std::pair<std::string, BatchIterator*>>;

class BaseTrainer {
 public:
  // `state` is borrowed and must outlive the trainer. Not owned.
  BaseTrainer(TrainState& state, Runtime runtime);
  virtual ~BaseTrainer();  // closes the writers; an error there is only logged
  BaseTrainer(const BaseTrainer&) = delete;
  BaseTrainer& operator=(const BaseTrainer&) = delete;

  // The ranks that train together: metrics and eval sums are combined over them and
  // rank 0's halting decision is shared with them. Null or a world of one: this
  // process alone. Set it before the first Train or Eval. Not owned.
  void set_communicator(Communicator* communicator, CollectiveOptions options = {});
  // A fault-tolerant job whose world changed (a rank left, lockstep/job.h):
  // `communicator` spans the ranks that remain. A collective over them. Drops
  // the metrics managers, whose unfinished periods the job then restores from its
  // snapshot of the last step, and rebinds. A subclass that holds the
  // communicator itself overrides it, calls this first, and rebinds its own
  // parts (Trainer rebuilds its data parallelism); the default refuses a trainer
  // on a mesh. Not owned.
  virtual void ChangeCommunicator(Communicator* communicator);
  // For a subclass that lays its model out on a data x model mesh (mesh.h): the
  // mesh and the partitioner of the job's rules, both borrowed (they must outlive
  // the trainer). Sets the communicator to mesh->world(), so metrics and halting
  // span every rank; the step itself sums gradients over mesh->data() and splits
  // its layers over mesh->model(). Set it before the first Train or Eval. Throws
  // InvalidArgumentError for a null mesh, or a partitioner of another mesh shape.
  void set_mesh(const DeviceMesh* mesh, const Partitioner* partitioner, CollectiveOptions options = {});
  // Null unless set_mesh was called.
  const DeviceMesh* mesh() const { return mesh_; }
  const Partitioner* partitioner() const { return partitioner_; }

  // Runs `num_steps` train steps on batches from `data`, starting at `start_step`
  // (default: state.step). Every `summary_every_steps` steps, and after the last
  // one, a "train" summary goes to the sinks. Returns the metrics of the last
  // summary period. Stops early, without error, when `data` is exhausted or an
  // action halts training (see halt()).
  // Throws InvalidArgumentError for a negative num_steps or start_step.
  MetricMap Train(BatchIterator& data, int64_t num_steps, std::optional<int64_t> start_step = std::nullopt);

  // Evaluates each named set until its iterator is exhausted and sends one summary
  // per set to the sinks. Returns set name -> metric means over all ranks.
  std::vector<std::pair<std::string, MetricMap>> Eval(const NamedBatchIterators& sets);

  // Rank 0 only (other ranks ignore them). A sink runs on the training thread when
  // a summary is made (a progress bar, a test's recorder); a writer runs on the
  // background writer thread, in order (files, stdout). Add writers before the
  // first Train or Eval; an InvalidArgumentError says so otherwise.
  void AddSummarySink(SummarySink sink) { sinks_.push_back(std::move(sink)); }
  void AddSummaryWriter(SummarySink writer);
  // Writes everything queued and stops the writer thread; rethrows the first
  // error a writer threw. Idempotent; later summaries reach the sinks only.
  void CloseWriters();
  // How a metric combines over steps and ranks, for every task (see metrics.h).
  void SetMetricReduction(const std::string& name, MetricReduction reduction);
  // Adds metrics computed from each task's combined summary (after the rates,
  // before sinks, writers and actions see it), on every rank: bits per byte and
  // tokens per second from the loss and examples per second, say. Must be
  // deterministic in the summary for actions to agree; a value from this rank
  // alone (its data wait, say) is rank 0's in what is written.
  void AddDerivedMetrics(DeriveMetricsFn derive) { derivers_.push_back(std::move(derive)); }
  // Runs after every summary; a halt stops Train after the current step on every
  // rank (the decision is rank 0's, shared with every rank).
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
  // This rank's unfinished summary period and the actions' state, for checkpoints,
  // so that a resumed run prints and decides exactly as an uninterrupted one.
  // RestoreTrainerState throws InvalidArgumentError on text it did not write.
  std::string SaveTrainerState();
  void RestoreTrainerState(const std::string& state);

  // A subclass's own state for checkpoints: what the model, the optimizer and the
  // step do not hold (a reference model, a generator of its own, counters). The
  // job layer saves it with every checkpoint and restores it on resume, after the
  // train state. Default: nothing. RestoreCustomState may throw
  // InvalidArgumentError for state it cannot take (the job stops with it).
  virtual CustomState SaveCustomState() { return {}; }
  virtual void RestoreCustomState(const CustomState& state) { (void)state; }

  // Called by BeforeUpdate(), right before a step changes the parameters or the
  // optimizer state: an asynchronous checkpoint copying them waits there
  // (CheckpointManager::AwaitSnapshot; the job layer sets it).
  void set_before_update(std::function<void()> hook) { before_update_ = std::move(hook); }

  // Records the chosen steps of Train (the data wait here; the step's phases
  // and buckets in Trainer) on `timeline`, which writes a Chrome trace
  // (lockstep/timeline.h). Borrowed; null: none.
  void set_timeline(Timeline* timeline) { timeline_ = timeline; }
  Timeline* timeline() const { return timeline_; }

  TrainState& state() { return state_; }
  const Runtime& runtime() const { return runtime_; }
  // The ranks this trainer's steps and metrics span; null for one process.
  Communicator* communicator() const { return communicator_; }

 protected:
  // One partitioned train step on this rank's shard of a global batch. Must apply
  // exactly one optimizer update and increment state().step. Returns this rank's
  // metrics (its loss over its examples, num_examples = its examples); BaseTrainer
  // combines them over ranks once per summary period.
  virtual MetricMap TrainStep(const Batch& batch) = 0;
  // Metric sums of one eval batch of this rank's shard; combined over ranks.
  virtual MetricSums EvalStep(const Batch& batch) = 0;

  // A TrainStep that updates parameters or optimizer state itself (not through
  // Trainer's step) calls this right before it does.
  void BeforeUpdate() {
    if (before_update_) before_update_();
  }

  const CollectiveOptions& collective_options() const { return collective_; }
  // The task's manager, made on first use.
  MetricsManager& metrics_manager(const std::string& task);

 private:
  // Hands the summary to the sinks and actions (rank 0), then agrees on halting.
  void Emit(const Summary& summary);
  // Shares rank 0's decision with every rank.
  HaltDecision AgreeOnHalt(const HaltDecision& rank0_decision);

  TrainState& state_;  // Not owned.
  const Runtime runtime_;
  Communicator* communicator_ = nullptr;  // Not owned.
  const DeviceMesh* mesh_ = nullptr;        // Not owned.
  const Partitioner* partitioner_ = nullptr;  // Not owned.
  CollectiveOptions collective_;
  int64_t summary_every_steps_ = 100;
  std::vector<SummarySink> sinks_;
  std::vector<DeriveMetricsFn> derivers_;
  // Seconds Train spent in the iterator's Next() over the steps of the summary
  // period under way (training thread only): data_wait_fraction in summaries.
  double data_wait_seconds_ = 0;
  int64_t data_wait_steps_ = 0;
  std::vector<SummarySink> writer_sinks_;
  std::shared_ptr<AsyncSummaryWriter> writer_;  // rank 0, made with the first manager
  std::map<std::string, MetricReduction> reductions_;
  std::map<std::string, std::unique_ptr<MetricsManager>> managers_;
  std::vector<std::unique_ptr<Action>> actions_;
  HaltDecision halt_;
  std::function<bool(int64_t)> stop_check_;
  Timeline* timeline_ = nullptr;  // Not owned.
  bool stopped_by_check_ = false;
  std::function<void()> before_update_;
};

struct TrainerOptions {
  StepOptions step;
  int64_t summary_every_steps = 100;
  // Metrics for Eval; default: ClassificationMetrics(loss).
  MetricFn eval_metrics;
  // Ranks to train with, data-parallel; null or a world of 1 trains alone. Not owned.
  Communicator* communicator = nullptr;
  DataParallelOptions data_parallel;
  // How the ranks partition the train state (lockstep/sharded_data_parallel.h);
  // the sharded strategies group parameters in units of data_parallel.bucket_bytes.
  PartitioningStrategy partitioning = PartitioningStrategy::kReplicated;
  // What else must agree across ranks (the resolved config, say); checked at start.
  std::string fingerprint;
  // A data x model mesh (mesh.h), for a model that splits itself over
  // mesh->model() (tensor_parallel.h). Data parallelism then runs over
  // mesh->data(), metrics and halting decisions over mesh->world() (the model-axis
  // replicas of a metric count once), and `communicator` must be null or
  // mesh->world(). `parameter_layouts` (the partitioner's, by parameter name)
  // says which parameters are model-axis shards, for the norms and clipping.
  // Replicated data parallelism only, so far: a sharded strategy with a model
  // axis of more than one rank is an InvalidArgumentError. Not owned.
  const DeviceMesh* mesh = nullptr;
  std::vector<ParameterLayout> parameter_layouts;
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

  // Null when training alone or with a sharded strategy.
  DataParallel* data_parallel() { return data_parallel_.get(); }
  // Null when training alone or replicated.
  ShardedDataParallel* sharded_data_parallel() { return sharded_.get(); }

  // Replicated data parallelism without a mesh only: a new DataParallel over
  // `communicator` (its start-up check and broadcast of rank 0's parameters).
  // Throws InvalidArgumentError for a sharded strategy or a mesh.
  void ChangeCommunicator(Communicator* communicator) override;

 protected:
  MetricMap TrainStep(const Batch& batch) override;
  MetricSums EvalStep(const Batch& batch) override;

 private:
  const ApplyFn apply_;
  const LossFn loss_;
  TrainerOptions options_;
  std::unique_ptr<DataParallel> data_parallel_;
  std::unique_ptr<ShardedDataParallel> sharded_;
  // A model-axis replica (mesh model index > 0): its metrics carry no weight.
  bool model_replica_ = false;
};

}  // namespace lockstep

#endif  // LOCKSTEP_TRAINER_H_
