// Actions: decisions taken after each train summary period or evaluation, such as
// stopping early or stopping on NaN. User-defined actions subclass Action.
//
// In a multi-rank job every rank computes the same (reduced) summaries, but only
// rank 0 runs the actions; the trainer then broadcasts rank 0's decision, so that
// every rank stops after the same step. Actions run on the training thread.
#ifndef LOCKSTEP_ACTIONS_H_
#define LOCKSTEP_ACTIONS_H_

#include <cstdint>
#include <limits>
#include <string>

#include "lockstep/metrics.h"

namespace lockstep {

struct HaltDecision {
  bool halt = false;
  // Stopping because training went wrong (NaN), not because it is done.
  bool failure = false;
  std::string reason;
};

class Action {
 public:
  virtual ~Action() = default;
  // Sees every summary (train periods and each eval set) in order.
  virtual HaltDecision OnSummary(const Summary& summary) = 0;
  // What a resumed run needs to decide as this one would (checkpoints); stateless
  // actions keep the defaults.
  virtual std::string SaveState() const { return ""; }
  virtual void RestoreState(const std::string& /*state*/) {}
};

// Stops when `metric` of `task` has not improved for `patience` consecutive
// summaries of that task. An improvement beats the best value so far by more than
// max(atol, rtol * |best|): lower for kMin, higher for kMax.
class EarlyStoppingAction : public Action {
 public:
  enum class Mode { kMin, kMax };
  // Throws InvalidArgumentError for a negative patience or tolerance.
  EarlyStoppingAction(std::string task, std::string metric, Mode mode, int patience, double atol = 0.0,
                      double rtol = 0.0);
  HaltDecision OnSummary(const Summary& summary) override;
  std::string SaveState() const override;
  void RestoreState(const std::string& state) override;

 private:
  const std::string task_;
  const std::string metric_;
  const Mode mode_;
  const int patience_;
  const double atol_;
  const double rtol_;
  double best_;
  int64_t best_step_ = -1;
  int without_improvement_ = 0;
};

// Stops, as a failure, when `metric` of `task` is NaN or infinite.
class TerminateOnNanAction : public Action {
 public:
  TerminateOnNanAction(std::string task = "train", std::string metric = kLoss);
  HaltDecision OnSummary(const Summary& summary) override;

 private:
  const std::string task_;
  const std::string metric_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_ACTIONS_H_
