// Metrics: named scalar values per step, their summaries over a period, and the
// sinks that summaries go to.
//
// A Summary is what a train period or an evaluation produced; a SummarySink is any
// callable that takes one (StdoutLogger prints it; TensorBoard and JSONL writers
// follow). In a multi-rank job only rank 0 calls sinks; MetricsManager
// (metrics_manager.h) combines ranks' metrics first.
#ifndef LOCKSTEP_METRICS_H_
#define LOCKSTEP_METRICS_H_

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace lockstep {

// Metric name -> value, ordered by name so that output is stable.
using MetricMap = std::map<std::string, double>;

// Names of the per-step train metrics.
inline constexpr char kLoss[] = "loss";
inline constexpr char kAccuracy[] = "accuracy";
inline constexpr char kLearningRate[] = "learning_rate";
inline constexpr char kGradientsL2Norm[] = "gradients_l2norm";
inline constexpr char kWeightsL2Norm[] = "weights_l2norm";
// Summaries only, from MetricsManager's timer over the period (the slowest rank's).
inline constexpr char kSecondsPerStep[] = "seconds_per_step";
inline constexpr char kExamplesPerSecond[] = "examples_per_second";
inline constexpr char kStepsPerSecond[] = "steps_per_second";
// Train summaries: the share of rank 0's step time spent waiting for the data
// iterator's next batch (BaseTrainer::Train times every Next()).
inline constexpr char kDataWaitFraction[] = "data_wait_fraction";
// Examples behind a value (this rank's, per step; all ranks', in summaries); weights
// means, not printed.
inline constexpr char kNumExamples[] = "num_examples";

struct Summary {
  std::string task;  // "train", or the name of an eval set
  int64_t step = 0;  // the number of optimizer steps taken when it was made
  MetricMap metrics;
};

using SummarySink = std::function<void(const Summary&)>;
// Adds metrics to a task's combined summary metrics (BaseTrainer::AddDerivedMetrics).
using DeriveMetricsFn = std::function<void(const std::string& task, MetricMap& metrics)>;

// Weighted sums of per-example metrics over some batches (an evaluation),
// and the total weight. Means() adds num_examples = the weight.
struct MetricSums {
  std::map<std::string, double> sums;
  double weight = 0.0;

  void Merge(const MetricSums& other);
  MetricMap Means() const;
};

// One line per metric, in the form `Step    100: train loss | 0.41230000`.
std::vector<std::string> FormatSummary(const Summary& summary);

// Prints each summary to a stdio stream (stdout by default), one line per metric.
struct StdoutLogger {
  std::FILE* stream = stdout;  // Not owned.
  void operator()(const Summary& summary) const;
};

// How a metric combines over the steps of a summary period and across ranks.
enum class MetricReduction {
  kWeightedMean,  // mean weighted by each step's num_examples (loss, accuracy)
  kMean,          // mean over the steps (and ranks) that reported it
  kSum,           // total (num_examples)
  kMax,           // largest value
  kLast,          // the period's last value, rank 0's: for values every rank shares
                  // (learning_rate, gradient and weight norms after the all-reduce)
};

// loss, accuracy: kWeightedMean; num_examples: kSum; learning_rate,
// gradients_l2norm, weights_l2norm and the per-weight weights/<name>/{rms,max,
// update_ratio}: kLast; anything else: kMean.
MetricReduction DefaultReduction(const std::string& name);

// Accumulates one rank's metrics over a summary period: per metric a value (a
// weighted sum, sum, max or last value, as its reduction says) and a weight (the
// examples or steps behind it), so that periods of several ranks can be combined
// (MetricsManager does that) before Finalize turns them into summary values.
// Not thread-safe; it lives on the training thread.
class MetricsAccumulator {
 public:
  struct Entry {
    MetricReduction reduction = MetricReduction::kMean;
    double value = 0;   // sum of value x weight, sum, max or last value
    double weight = 0;  // examples (kWeightedMean) or steps (the others)
  };
  using Entries = std::map<std::string, Entry>;

  // Overrides DefaultReduction for `name` from now on.
  void SetReduction(const std::string& name, MetricReduction reduction) { reductions_[name] = reduction; }
  MetricReduction reduction(const std::string& name) const;

  // One train step's metrics; its examples are its num_examples (1 without).
  void Add(const MetricMap& step_metrics);
  // Weighted sums of per-example metrics over `weight` examples (an eval batch):
  // every metric is a kWeightedMean, and num_examples grows by `weight`.
  void AddSums(const std::map<std::string, double>& sums, double weight);

  bool empty() const { return steps_ == 0; }
  int64_t steps() const { return steps_; }
  const Entries& entries() const { return entries_; }

  // Summary values of (possibly combined) entries: means divide by their weight
  // (0 when it is 0); sums, maxima and last values are taken as they are.
  static MetricMap Finalize(const Entries& entries);
  // Finalize(entries()), then starts a new period.
  MetricMap Flush();
  void Clear();

  // The unfinished period, exactly (hex floats), for checkpoints; RestoreState
  // throws InvalidArgumentError on text SaveState did not write.
  std::string SaveState() const;
  void RestoreState(const std::string& text);

 private:
  Entry& EntryFor(const std::string& name);

  std::map<std::string, MetricReduction> reductions_;
  int64_t steps_ = 0;
  Entries entries_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_METRICS_H_
