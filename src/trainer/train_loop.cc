#include "lockstep/train_loop.h"

#include "lockstep/metrics_manager.h"

#include <algorithm>
#include <optional>

#include "lockstep/errors.h"

namespace lockstep {

TrainLoop::Iterator::Iterator(const TrainLoop* loop) {
  if (!loop->init || !loop->task.apply || !loop->task.optimizer || !loop->task.loss || !loop->task.data) {
    throw InvalidArgumentError("TrainLoop: init, apply, optimizer, loss and data are all required");
  }
  if (loop->n_steps_per_checkpoint <= 0 || loop->n_steps <= 0) {
    throw InvalidArgumentError("TrainLoop: n_steps_per_checkpoint and n_steps must be positive");
  }
  if (loop->task.options.schedule) loop->task.options.schedule->Validate();
  run_ = std::make_shared<Run>();
  run_->loop = loop;
  run_->checkpoint.state = MakeTrainState(loop->init(), loop->task.optimizer);
  Advance();
}

TrainLoop::Iterator& TrainLoop::Iterator::operator++() {
  Advance();
  return *this;
}

void TrainLoop::Iterator::Advance() {
  if (done()) return;
  const TrainLoop& loop = *run_->loop;
  TrainState& state = run_->checkpoint.state;
  const int64_t steps = std::min(loop.n_steps_per_checkpoint, loop.n_steps - state.step);
  MetricsManager period(MetricsManager::Options{});
  period.StartTimer();
  for (int64_t i = 0; i < steps; ++i) {
    std::optional<Batch> batch = loop.task.data->Next();
    if (!batch) break;
    period.AddStep(RunTrainStep(state, *batch, loop.task.apply, loop.task.loss, loop.task.options));
  }
  if (period.empty()) {
    run_->done = true;
    return;
  }
  run_->checkpoint.step = state.step;
  run_->checkpoint.metrics = period.Flush(state.step).metrics;
}

Summary EvalLoop::operator()(const Checkpoint& checkpoint) const {
  if (!task.apply || !task.metrics || !task.data) throw InvalidArgumentError("EvalLoop: apply, metrics and data are required");
  if (!checkpoint.state.model) throw InvalidArgumentError("EvalLoop: the checkpoint has no model");
  std::unique_ptr<BatchIterator> data = task.data();
  MetricSums total;
  for (int64_t i = 0; n_steps == 0 || i < n_steps; ++i) {
    std::optional<Batch> batch = data->Next();
    if (!batch) break;
    total.Merge(RunEvalStep(*checkpoint.state.model, *batch, task.apply, task.metrics));
  }
  return Summary{task.name, checkpoint.step, total.Means()};
}

}  // namespace lockstep
