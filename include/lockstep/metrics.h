// Metrics: named scalar values per step, their summaries over a period, and the
// sinks that summaries go to.
//
// A Summary is what a train period or an evaluation produced; a SummarySink is any
// callable that takes one (StdoutLogger prints it; TensorBoard and JSONL writers
// follow). In a multi-rank job only rank 0 calls sinks. MetricsAccumulator is not
// thread-safe; it lives on the training thread.
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
inline constexpr char kSecondsPerStep[] = "seconds_per_step";
inline constexpr char kExamplesPerSecond[] = "examples_per_second";
inline constexpr char kStepsPerSecond[] = "steps_per_second";  // summaries only
// Examples in the step's global batch; used to weight means, not printed.
inline constexpr char kNumExamples[] = "num_examples";

struct Summary {
  std::string task;  // "train", or the name of an eval set
  int64_t step = 0;  // the number of optimizer steps taken when it was made
  MetricMap metrics;
};

using SummarySink = std::function<void(const Summary&)>;

// One line per metric, in the form `Step    100: train loss | 0.41230000`.
std::vector<std::string> FormatSummary(const Summary& summary);

// Prints each summary to a stdio stream (stdout by default), one line per metric.
struct StdoutLogger {
  std::FILE* stream = stdout;  // Not owned.
  void operator()(const Summary& summary) const;
};

// Averages per-step metrics over a summary period. loss and accuracy are weighted
// by the examples of each step; learning_rate, weights_l2norm and the per-weight
// rms and max keep the last value; examples_per_second and steps_per_second are
// totals over the total seconds of the steps; every other metric is the mean
// over steps.
class MetricsAccumulator {
 public:
  void Add(const MetricMap& step_metrics);
  bool empty() const { return steps_ == 0; }
  // The period's summary metrics; then starts a new period.
  MetricMap Flush();
  // The unfinished period, exactly (hex floats), for checkpoints; RestoreState
  // throws InvalidArgumentError on text SaveState did not write.
  std::string SaveState() const;
  void RestoreState(const std::string& text);

 private:
  int64_t steps_ = 0;
  double examples_ = 0;
  std::map<std::string, double> sums_;  // weighted by examples where that applies
  MetricMap last_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_METRICS_H_
