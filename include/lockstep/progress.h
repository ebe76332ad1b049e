// Rank 0's view of a run: a progress bar on a terminal, and SVG plots of the
// curves at the end, for users without TensorBoard. Both are SummarySinks; neither
// is thread-safe (use them from one thread, e.g. AsyncSummaryWriter's).
#ifndef LOCKSTEP_PROGRESS_H_
#define LOCKSTEP_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "lockstep/metrics.h"

namespace lockstep {

// Train summaries redraw one line in place: a bar, step / total, ETA, loss and
// accuracy; other summaries (evaluations) are printed as plain lines below it.
class ProgressBar {
 public:
  ProgressBar(int64_t total_steps, std::FILE* stream = stdout);  // Not owned.
  // A summary: train summaries redraw the bar; others print their lines below it.
  void operator()(const Summary& summary);
  // Continuous updates (TrainerConfig.progress_updates: step): called by the
  // training thread after every step; redraws with the last train summary's
  // metrics, at most every `min_interval`, so a fast loop pays one clock read.
  void Step(int64_t step);
  // Ends the bar's line.
  void Finish();
  // The bar line for a step, without the leading carriage return (for tests).
  std::string Line(int64_t step, double seconds_elapsed, const MetricMap& metrics) const;

  std::chrono::milliseconds min_interval{100};

 private:
  void Draw(int64_t step, const MetricMap& metrics) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t total_steps_;
  std::FILE* const stream_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  absl::Mutex mu_;  // the writer thread (summaries) and the training thread (Step)
  int64_t first_step_ ABSL_GUARDED_BY(mu_) = -1;
  bool line_open_ ABSL_GUARDED_BY(mu_) = false;
  MetricMap last_metrics_ ABSL_GUARDED_BY(mu_);
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::chrono::steady_clock::time_point last_draw_ ABSL_GUARDED_BY(mu_);
};

// Records every summary and writes SVG line charts of the curves.
class CurvePlotter {
 public:
  void operator()(const Summary& summary);
  // Writes loss.svg, accuracy.svg, learning_rate.svg and examples_per_second.svg
  // (those with data) into `dir`; returns the paths written. Throws Error naming a
  // file it cannot write.
  std::vector<std::string> WritePlots(const std::string& dir) const;

 private:
  // metric -> task -> (step, value)
  std::map<std::string, std::map<std::string, std::vector<std::pair<int64_t, double>>>> curves_;
};

// True when `stream` is a terminal.
bool IsTerminal(std::FILE* stream);

}  // namespace lockstep

#endif  // LOCKSTEP_PROGRESS_H_
