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

#include "lockstep/metrics.h"

namespace lockstep {

// Train summaries redraw one line in place: a bar, step / total, ETA, loss and
// accuracy; other summaries (evaluations) are printed as plain lines below it.
class ProgressBar {
 public:
  ProgressBar(int64_t total_steps, std::FILE* stream = stdout);  // Not owned.
  void operator()(const Summary& summary);
  // Ends the bar's line.
  void Finish();
  // The bar line for a step, without the leading carriage return (for tests).
  std::string Line(int64_t step, double seconds_elapsed, const MetricMap& metrics) const;

 private:
  const int64_t total_steps_;
  std::FILE* const stream_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  int64_t first_step_ = -1;
  bool line_open_ = false;
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
