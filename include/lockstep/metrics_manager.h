// MetricsManager: one per task (train, and each named eval set). It accumulates
// this rank's metrics over a summary period, combines the period over ranks when
// it is flushed (each metric as its MetricReduction says: weighted mean, mean,
// sum, max, or rank 0's last value), times the period, and on rank 0 queues the
// summary to the background writer thread, so that the training thread never
// waits on I/O.
//
//   MetricsManager::Options options;
//   options.task = "train";
//   options.communicator = comm;                     // combine over these ranks
//   options.writer = writer;                         // rank 0 only
//   MetricsManager train(options);
//   train.StartTimer();
//   for (...) train.AddStep(step_metrics);         // this rank's values
//   Summary s = train.Flush(state.step);            // collective; same on every rank
//
// The timer counts only while started (BaseTrainer starts it for the duration of
// Train or Eval), and gives each summary seconds_per_step, steps_per_second and
// examples_per_second over the period: the slowest rank's seconds, all ranks'
// examples. Metric names may differ between ranks (a rank with an empty shard has
// no loss): the union is combined, a rank without a metric contributing nothing.
// Not thread-safe: it lives on the training thread.
#ifndef LOCKSTEP_METRICS_MANAGER_H_
#define LOCKSTEP_METRICS_MANAGER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "lockstep/communicator.h"
#include "lockstep/metrics.h"

namespace lockstep {

class AsyncSummaryWriter;

class MetricsManager {
 public:
  struct Options {
    std::string task = "train";
    // The ranks whose metrics are combined; null or a world of one: this process
    // alone. Not owned.
    Communicator* communicator = nullptr;
    CollectiveOptions collective;
    // Rank 0's writer thread; each Flush queues its summary there. Null on the other
    // ranks (nothing is written) or to write nothing.
    std::shared_ptr<AsyncSummaryWriter> writer;
    // Adds metrics to each combined summary, after the rates and before the writer.
    DeriveMetricsFn derive;
  };

  explicit MetricsManager(Options options);

  const std::string& task() const { return options_.task; }
  // Overrides DefaultReduction for a metric; every rank must set the same.
  void SetReduction(const std::string& name, MetricReduction reduction) { period_.SetReduction(name, reduction); }

  void StartTimer();
  void StopTimer();

  // One train step's metrics, as computed on this rank.
  void AddStep(const MetricMap& step_metrics);
  // One eval batch's sums, as computed on this rank.
  void AddSums(const MetricSums& sums);
  bool empty() const { return period_.empty(); }

  // Combines the period over ranks, adds the timer's rates, hands the summary to
  // the writer (if any) and starts a new period. A collective: every rank calls it
  // at the same point, and every rank gets the same summary. Throws Error when ranks
  // gave one metric different reductions, CollectiveError when a peer fails.
  Summary Flush(int64_t step);

  // Drains the writer thread (shared by a trainer's managers: closing one closes
  // it for all) and rethrows a writer's error. Idempotent.
  void Close();

  // The unfinished period, exactly, for checkpoints (deterministic: no timing; a
  // restored period's rates cover the steps after the restore). RestoreState throws
  // InvalidArgumentError on text SaveState did not write.
  std::string SaveState() const;
  void RestoreState(const std::string& text);

 private:
  double ElapsedSeconds() const;
  struct Timing {
    double seconds = 0;   // the slowest rank's
    double steps = 0;     // steps added since the period's timing began
    double examples = 0;  // all ranks' examples of those steps
  };
  // The period's entries combined over ranks, and its timing.
  MetricsAccumulator::Entries Combine(Timing& timing);

  Options options_;
  MetricsAccumulator period_;
  double seconds_ = 0;  // timed seconds of the period before running_since_
  int64_t timed_steps_ = 0;
  double timed_examples_ = 0;
  std::optional<std::chrono::steady_clock::time_point> running_since_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_METRICS_MANAGER_H_
