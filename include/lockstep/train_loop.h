// TrainLoop and EvalLoop: the composable form of training, beside Trainer.
//
//   TrainLoop loop{init, TrainTask{apply, optimizer, loss, data}, /*n_steps_per_checkpoint=*/100,
//                  /*n_steps=*/1000};
//   EvalLoop eval{EvalTask{apply, metrics, data}, /*n_steps=*/0};
//   for (auto& checkpoint : loop) {
//     StdoutLogger{}(eval(checkpoint));
//   }
//
// A TrainLoop is a range: begin() builds the train state with `init` and the
// optimizer factory, and each increment trains n_steps_per_checkpoint more steps
// (fewer for the last one) with the same step implementation as Trainer, yielding a
// Checkpoint. The checkpoint's state is the live train state, not a copy: the
// next iteration goes on training it. Iterating a loop twice starts over from init.
// Not thread-safe. Summary sinks are plain callables (SummarySink in metrics.h).
#ifndef LOCKSTEP_TRAIN_LOOP_H_
#define LOCKSTEP_TRAIN_LOOP_H_

#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <string>

#include "lockstep/data.h"
#include "lockstep/metrics.h"
#include "lockstep/step.h"
#include "lockstep/train_state.h"

namespace lockstep {

using InitFn = std::function<std::shared_ptr<torch::nn::Module>()>;

struct TrainTask {
  ApplyFn apply;
  OptimizerFactory optimizer;
  LossFn loss;
  std::shared_ptr<BatchIterator> data;
  StepOptions options = {};
};

// The train state at a step, and the metrics of the steps since the previous one.
struct Checkpoint {
  TrainState state;
  int64_t step = 0;
  MetricMap metrics;
};

struct TrainLoop {
  InitFn init;
  TrainTask task;
  int64_t n_steps_per_checkpoint = 1;
  int64_t n_steps = 0;

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Checkpoint;
    using difference_type = std::ptrdiff_t;
    using pointer = Checkpoint*;
    using reference = Checkpoint&;

    Iterator() = default;  // the end
    Checkpoint& operator*() const { return run_->checkpoint; }
    Checkpoint* operator->() const { return &run_->checkpoint; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const { return done() == other.done(); }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    friend struct TrainLoop;
    struct Run {
      const TrainLoop* loop;  // Not owned.
      Checkpoint checkpoint;
      bool done = false;
    };
    explicit Iterator(const TrainLoop* loop);
    void Advance();
    bool done() const { return !run_ || run_->done; }
    std::shared_ptr<Run> run_;
  };

  // Throws InvalidArgumentError for a missing component or non-positive step counts.
  Iterator begin() const { return Iterator(this); }
  Iterator end() const { return Iterator(); }
};

struct EvalTask {
  ApplyFn apply;
  MetricFn metrics;
  // Makes a fresh iterator over the eval data for each evaluation.
  std::function<std::unique_ptr<BatchIterator>()> data;
  std::string name = "eval";
};

struct EvalLoop {
  EvalTask task;
  // Batches per evaluation; 0 evaluates until the data is exhausted.
  int64_t n_steps = 0;

  // Evaluates the checkpoint's model; the summary is stamped with its step.
  Summary operator()(const Checkpoint& checkpoint) const;
};

}  // namespace lockstep

#endif  // LOCKSTEP_TRAIN_LOOP_H_
