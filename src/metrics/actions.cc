#include "lockstep/actions.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lockstep/errors.h"

namespace lockstep {

EarlyStoppingAction::EarlyStoppingAction(std::string task, std::string metric, Mode mode, int patience, double atol,
                                         double rtol)
    : task_(std::move(task)),
      metric_(std::move(metric)),
      mode_(mode),
      patience_(patience),
      atol_(atol),
      rtol_(rtol),
      best_(mode == Mode::kMin ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity()) {
  if (patience_ < 0 || !(atol_ >= 0) || !(rtol_ >= 0)) {
    throw InvalidArgumentError("EarlyStoppingAction: patience, atol and rtol must be >= 0");
  }
}

HaltDecision EarlyStoppingAction::OnSummary(const Summary& summary) {
  if (summary.task != task_) return {};
  const auto it = summary.metrics.find(metric_);
  if (it == summary.metrics.end()) return {};
  const double value = it->second;
  const double margin = std::isfinite(best_) ? std::max(atol_, rtol_ * std::abs(best_)) : 0.0;
  const bool improved = mode_ == Mode::kMin ? value < best_ - margin : value > best_ + margin;
  if (improved) {
    best_ = value;
    best_step_ = summary.step;
    without_improvement_ = 0;
    return {};
  }
  if (++without_improvement_ <= patience_) return {};
  return {true, false,
          absl::StrCat("early stopping: ", task_, " ", metric_, " has not improved on ", best_, " (step ", best_step_,
                       ") for ", without_improvement_, " summaries")};
}

TerminateOnNanAction::TerminateOnNanAction(std::string task, std::string metric)
    : task_(std::move(task)), metric_(std::move(metric)) {}

HaltDecision TerminateOnNanAction::OnSummary(const Summary& summary) {
  if (summary.task != task_) return {};
  const auto it = summary.metrics.find(metric_);
  if (it == summary.metrics.end() || std::isfinite(it->second)) return {};
  return {true, true, absl::StrCat(task_, " ", metric_, " is ", it->second, " at step ", summary.step)};
}

std::string EarlyStoppingAction::SaveState() const {
  return absl::StrFormat("%a %d %d", best_, best_step_, without_improvement_);
}

void EarlyStoppingAction::RestoreState(const std::string& state) {
  if (state.empty()) return;
  double best = 0;
  long long best_step = 0;
  int without = 0;
  if (std::sscanf(state.c_str(), "%la %lld %d", &best, &best_step, &without) != 3) {
    throw InvalidArgumentError("early stopping state: cannot read '" + state + "'");
  }
  best_ = best;
  best_step_ = best_step;
  without_improvement_ = without;
}

}  // namespace lockstep
