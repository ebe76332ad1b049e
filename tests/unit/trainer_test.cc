// BaseTrainer's loop, the default Trainer, the composable TrainLoop / EvalLoop and
// the metrics that they emit.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <optional>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "lockstep/errors.h"
#include "lockstep/metrics.h"
#include "lockstep/metrics_manager.h"
#include "lockstep/summary_writers.h"
#include "lockstep/train_loop.h"
#include "lockstep/trainer.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using testing::MaxRelativeDifference;
using testing::Snapshot;
using testing::TinyDataset;
using testing::TinyModel;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

OptimizerFactory Adam() {
  OptimizerOptions o;
  o.learning_rate = 0.01;
  return MakeOptimizerFactory(o);
}

ShardingOptions Sharding(int64_t batch, int64_t epochs = -1) {
  ShardingOptions o;
  o.global_batch_size = batch;
  o.seed = 1;
  o.num_epochs = epochs;
  return o;
}

// A user's trainer: counts its steps and records the step numbers it saw.
class CountingTrainer : public BaseTrainer {
 public:
  using BaseTrainer::BaseTrainer;
  std::vector<int64_t> seen_steps;
  bool skip_increment = false;

 protected:
  MetricMap TrainStep(const Batch& batch) override {
    seen_steps.push_back(state().step);
    if (!skip_increment) ++state().step;
    return {{kLoss, static_cast<double>(state().step)}, {kNumExamples, static_cast<double>(batch.size())}};
  }
  MetricSums EvalStep(const Batch& batch) override {
    MetricSums sums;
    sums.sums["count"] = static_cast<double>(batch.size());
    sums.weight = static_cast<double>(batch.size());
    return sums;
  }
};

TEST(BaseTrainerTest, RunsTheSubclassStepAndEmitsSummaries) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());
  trainer.set_summary_every_steps(4);
  std::vector<Summary> summaries;
  trainer.AddSummarySink([&](const Summary& s) { summaries.push_back(s); });
  ShardedBatchIterator data(TinyDataset(100), Sharding(10));
  trainer.Train(data, 10, /*start_step=*/3);
  EXPECT_EQ(state.step, 13);
  EXPECT_THAT(trainer.seen_steps, ElementsAre(3, 4, 5, 6, 7, 8, 9, 10, 11, 12));
  ASSERT_EQ(summaries.size(), 4u);  // at steps 4, 8, 12 and the final 13
  EXPECT_EQ(summaries[0].step, 4);
  EXPECT_EQ(summaries[1].step, 8);
  EXPECT_EQ(summaries[2].step, 12);
  EXPECT_EQ(summaries[3].step, 13);
  EXPECT_DOUBLE_EQ(summaries[3].metrics.at(kLoss), 13);
  EXPECT_DOUBLE_EQ(summaries[1].metrics.at(kLoss), (5 + 6 + 7 + 8) / 4.0);
  EXPECT_EQ(summaries[0].task, "train");
  // Continues from the caller's state.
  trainer.Train(data, 2);
  EXPECT_EQ(state.step, 15);
}

// An iterator that takes its time: each Next() sleeps before handing on a batch.
class SlowIterator : public BatchIterator {
 public:
  SlowIterator(BatchIterator& inner, absl::Duration delay) : inner_(inner), delay_(delay) {}
  std::optional<Batch> Next() override {
    absl::SleepFor(delay_);
    return inner_.Next();
  }

 private:
  BatchIterator& inner_;
  absl::Duration delay_;
};

TEST(BaseTrainerTest, SummariesReportTheShareOfStepTimeSpentWaitingForData) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());
  trainer.set_summary_every_steps(4);
  std::vector<Summary> summaries;
  trainer.AddSummarySink([&](const Summary& s) { summaries.push_back(s); });
  ShardedBatchIterator fast(TinyDataset(100), Sharding(10));
  SlowIterator slow(fast, absl::Milliseconds(20));
  // The step itself takes microseconds: nearly all of the period is the wait.
  trainer.Train(slow, 8);
  ASSERT_EQ(summaries.size(), 2u);
  for (const Summary& s : summaries) {
    ASSERT_TRUE(s.metrics.count(kDataWaitFraction)) << "step " << s.step;
    EXPECT_GT(s.metrics.at(kDataWaitFraction), 0.5) << "step " << s.step;
    EXPECT_LE(s.metrics.at(kDataWaitFraction), 1.0) << "step " << s.step;
  }
  // The next period counts only its own waits: an in-memory iterator waits for nothing
  // measurable next to a step that sleeps.
  class SleepyTrainer : public CountingTrainer {
   public:
    using CountingTrainer::CountingTrainer;

   protected:
    MetricMap TrainStep(const Batch& batch) override {
      absl::SleepFor(absl::Milliseconds(20));
      return CountingTrainer::TrainStep(batch);
    }
  };
  TrainState sleepy_state;
  SleepyTrainer sleepy(sleepy_state, Runtime::SingleProcess());
  sleepy.set_summary_every_steps(4);
  summaries.clear();
  sleepy.AddSummarySink([&](const Summary& s) { summaries.push_back(s); });
  sleepy.Train(fast, 4);
  ASSERT_EQ(summaries.size(), 1u);
  EXPECT_LT(summaries[0].metrics.at(kDataWaitFraction), 0.5);
}

TEST(BaseTrainerTest, StopsWhenTheDataRunsOut) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());
  ShardedBatchIterator data(TinyDataset(25), Sharding(10, /*epochs=*/1));
  trainer.Train(data, 100);
  EXPECT_EQ(state.step, 3);
}

TEST(BaseTrainerTest, AStepThatDoesNotAdvanceIsAnError) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());
  trainer.skip_increment = true;
  ShardedBatchIterator data(TinyDataset(25), Sharding(10));
  EXPECT_THAT([&] { trainer.Train(data, 1); }, ::testing::ThrowsMessage<Error>(HasSubstr("exactly one")));
}

TEST(BaseTrainerTest, OnlyRankZeroCallsSinks) {
  TrainState state;
  Runtime rank1;
  rank1.rank = 1;
  rank1.world_size = 2;
  CountingTrainer trainer(state, rank1);
  int calls = 0;
  trainer.AddSummarySink([&](const Summary&) { ++calls; });
  trainer.AddSummaryWriter([&](const Summary&) { ++calls; });
  ShardedBatchIterator data(TinyDataset(25), Sharding(10));
  trainer.Train(data, 3);
  trainer.CloseWriters();
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(calls, 0);
}

TEST(BaseTrainerTest, WritersRunOnTheWriterThreadInOrderAndCloseDrainsThem) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());
  trainer.set_summary_every_steps(2);
  const std::thread::id training_thread = std::this_thread::get_id();
  std::vector<int64_t> steps;
  bool on_other_thread = true;
  trainer.AddSummaryWriter([&](const Summary& s) {
    on_other_thread = on_other_thread && std::this_thread::get_id() != training_thread;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    steps.push_back(s.step);
  });
  ShardedBatchIterator data(TinyDataset(100), Sharding(10));
  trainer.Train(data, 6);
  trainer.CloseWriters();
  EXPECT_THAT(steps, ElementsAre(2, 4, 6));
  EXPECT_TRUE(on_other_thread);
  EXPECT_THROW(trainer.AddSummaryWriter([](const Summary&) {}), InvalidArgumentError);
  EXPECT_THROW(trainer.set_communicator(nullptr), InvalidArgumentError);
}

TEST(TrainerTest, LearnsAndTheCallerHoldsTheTrainedState) {
  BuiltModel model = TinyModel(1);
  TrainState state = MakeTrainState(model.module, Adam());
  const std::vector<at::Tensor> initial = Snapshot(*model.module);
  const at::Tensor first_weight = model.module->parameters().front();
  TrainerOptions options;
  options.summary_every_steps = 50;
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  std::vector<Summary> summaries;
  trainer.AddSummarySink([&](const Summary& s) { summaries.push_back(s); });

  auto train_set = TinyDataset(512, 1);
  auto test_set = TinyDataset(256, 2);
  ShardedBatchIterator train(train_set, Sharding(32));
  ShardingOptions eval = Sharding(64, /*epochs=*/1);
  eval.shuffle = false;
  ShardedBatchIterator before_it(test_set, eval);
  const double accuracy_before = trainer.Eval({{"test", &before_it}}).front().second.at(kAccuracy);

  const MetricMap last = trainer.Train(train, 150);
  EXPECT_EQ(state.step, 150);
  EXPECT_LT(last.at(kLoss), summaries.front().metrics.at(kLoss));
  ShardedBatchIterator test_it(test_set, eval);
  ShardedBatchIterator train_eval_it(train_set, eval);
  const auto results = trainer.Eval({{"test", &test_it}, {"train_eval", &train_eval_it}});
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].first, "test");
  EXPECT_EQ(results[0].second.at(kNumExamples), 256);
  EXPECT_GT(results[0].second.at(kAccuracy), accuracy_before + 0.2);
  EXPECT_GT(results[0].second.at(kAccuracy), 0.6);
  EXPECT_EQ(summaries.back().task, "train_eval");
  EXPECT_EQ(summaries.back().step, 150);
  // No stale copy: the caller's module object was trained in place.
  EXPECT_TRUE(first_weight.is_same(state.model->parameters().front()));
  EXPECT_GT(MaxRelativeDifference(Snapshot(*state.model), initial), 0.01);
}

TEST(TrainerTest, RejectsAnIncompleteState) {
  TrainState empty;
  BuiltModel model = TinyModel(1);
  TrainerOptions defaults;
  EXPECT_THROW(Trainer(empty, model.apply, CrossEntropyLoss(), defaults), InvalidArgumentError);
  TrainState state = MakeTrainState(model.module, Adam());
  TrainerOptions bad;
  bad.summary_every_steps = 0;
  EXPECT_THROW(Trainer(state, model.apply, CrossEntropyLoss(), bad), InvalidArgumentError);
}

// TrainLoop and Trainer share one step implementation: the same init, data and
// options give the same parameters.
TEST(TrainLoopTest, YieldsCheckpointsAndMatchesTheTrainer) {
  auto dataset = TinyDataset(200, 4);
  StepOptions step_options;
  step_options.num_microbatches = 3;
  step_options.max_grad_norm = 1.0;
  TrainLoop loop{[] { return TinyModel(9).module; },
                 TrainTask{TinyModel(9).apply, Adam(), CrossEntropyLoss(),
                           std::make_shared<ShardedBatchIterator>(dataset, Sharding(16)), step_options},
                 /*n_steps_per_checkpoint=*/3, /*n_steps=*/10};
  EvalLoop eval{EvalTask{TinyModel(9).apply, ClassificationMetrics(CrossEntropyLoss()),
                         [&] { return std::make_unique<ShardedBatchIterator>(dataset, Sharding(50, 1)); }, "holdout"},
                /*n_steps=*/2};
  std::vector<int64_t> steps;
  std::vector<Summary> summaries;
  TrainState final_state;
  for (auto& checkpoint : loop) {
    steps.push_back(checkpoint.step);
    EXPECT_EQ(checkpoint.state.step, checkpoint.step);
    EXPECT_TRUE(checkpoint.metrics.count(kLoss));
    summaries.push_back(eval(checkpoint));
    final_state = checkpoint.state;
  }
  EXPECT_THAT(steps, ElementsAre(3, 6, 9, 10));
  ASSERT_EQ(summaries.size(), 4u);
  EXPECT_EQ(summaries.back().task, "holdout");
  EXPECT_EQ(summaries.back().step, 10);
  EXPECT_EQ(summaries.back().metrics.at(kNumExamples), 100);  // n_steps=2 batches of 50

  BuiltModel model = TinyModel(9);
  TrainState state = MakeTrainState(model.module, Adam());
  TrainerOptions options;
  options.step = step_options;
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  ShardedBatchIterator data(dataset, Sharding(16));
  trainer.Train(data, 10);
  EXPECT_EQ(MaxRelativeDifference(Snapshot(*final_state.model), Snapshot(*state.model)), 0.0);
}

TEST(TrainLoopTest, RejectsMissingParts) {
  TrainLoop loop{nullptr, TrainTask{}, 1, 1};
  EXPECT_THROW(loop.begin(), InvalidArgumentError);
}

TEST(MetricsTest, SummaryLinesHaveTheDocumentedForm) {
  Summary s{"train", 100, {{kLoss, 0.4123}, {kAccuracy, 0.875}, {kNumExamples, 128}}};
  EXPECT_THAT(FormatSummary(s), ElementsAre("Step    100: train accuracy | 0.87500000",
                                            "Step    100: train loss | 0.41230000"));
}

TEST(MetricsTest, AccumulatorCombinesEachMetricAsItsReductionSays) {
  MetricsAccumulator acc;
  acc.SetReduction("queue_depth", MetricReduction::kMax);
  acc.SetReduction("tokens", MetricReduction::kSum);
  acc.Add({{kLoss, 1.0}, {kNumExamples, 10}, {kLearningRate, 0.1}, {kGradientsL2Norm, 2}, {"other", 5},
           {"queue_depth", 7}, {"tokens", 100}});
  acc.Add({{kLoss, 4.0}, {kNumExamples, 30}, {kLearningRate, 0.2}, {kGradientsL2Norm, 4}, {"other", 1},
           {"queue_depth", 3}, {"tokens", 50}});
  EXPECT_EQ(acc.steps(), 2);
  const MetricMap m = acc.Flush();
  EXPECT_DOUBLE_EQ(m.at(kLoss), (10 * 1.0 + 30 * 4.0) / 40);  // weighted by examples
  EXPECT_DOUBLE_EQ(m.at(kNumExamples), 40);                     // summed
  EXPECT_DOUBLE_EQ(m.at(kLearningRate), 0.2);                   // last
  EXPECT_DOUBLE_EQ(m.at(kGradientsL2Norm), 4);                  // last
  EXPECT_DOUBLE_EQ(m.at("other"), 3.0);                         // mean over steps
  EXPECT_DOUBLE_EQ(m.at("queue_depth"), 7);
  EXPECT_DOUBLE_EQ(m.at("tokens"), 150);
  EXPECT_TRUE(acc.empty());
}

TEST(MetricsTest, AccumulatorStateRoundTripsExactlyAndRejectsGarbage) {
  MetricsAccumulator acc;
  acc.Add({{kLoss, 0.1}, {kNumExamples, 3}, {kLearningRate, 1.0 / 3}});
  MetricsAccumulator restored;
  restored.RestoreState(acc.SaveState());
  EXPECT_EQ(restored.SaveState(), acc.SaveState());
  EXPECT_EQ(restored.Flush(), acc.Flush());
  EXPECT_THROW(restored.RestoreState("entry loss nonsense 1 2\n"), InvalidArgumentError);
  EXPECT_THROW(restored.RestoreState("sum loss 0x1p+0\n"), InvalidArgumentError);
}

TEST(MetricsManagerTest, TimesThePeriodAndQueuesToTheWriterThread) {
  std::vector<Summary> written;
  auto writer = std::make_shared<AsyncSummaryWriter>(
      std::vector<SummarySink>{[&](const Summary& s) { written.push_back(s); }});
  MetricsManager::Options options;
  options.task = "train";
  options.writer = writer;
  MetricsManager manager(options);
  manager.AddStep({{kLoss, 1.0}, {kNumExamples, 8}});  // not timed: the timer is stopped
  manager.StartTimer();
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  manager.AddStep({{kLoss, 3.0}, {kNumExamples, 8}});
  manager.StopTimer();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // not counted
  const Summary s = manager.Flush(2);
  EXPECT_EQ(s.task, "train");
  EXPECT_EQ(s.step, 2);
  EXPECT_DOUBLE_EQ(s.metrics.at(kLoss), 2.0);
  EXPECT_GE(s.metrics.at(kSecondsPerStep), 0.03);
  EXPECT_LT(s.metrics.at(kSecondsPerStep), 0.08) << "time while stopped must not count";
  EXPECT_NEAR(s.metrics.at(kStepsPerSecond), 1 / s.metrics.at(kSecondsPerStep), 1e-9);
  EXPECT_NEAR(s.metrics.at(kExamplesPerSecond), 8 * s.metrics.at(kStepsPerSecond), 1e-9);
  EXPECT_TRUE(manager.empty());
  manager.Close();
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0].metrics, s.metrics);
}

TEST(MetricsManagerTest, EvalSumsBecomeMeansOverAllExamples) {
  MetricsManager manager(MetricsManager::Options{});
  manager.AddSums(MetricSums{{{kLoss, 6.0}, {kAccuracy, 3.0}}, 4.0});
  manager.AddSums(MetricSums{{{kLoss, 2.0}, {kAccuracy, 1.0}}, 4.0});
  const Summary s = manager.Flush(10);
  EXPECT_DOUBLE_EQ(s.metrics.at(kLoss), 1.0);
  EXPECT_DOUBLE_EQ(s.metrics.at(kAccuracy), 0.5);
  EXPECT_DOUBLE_EQ(s.metrics.at(kNumExamples), 8);
}

TEST(MetricsManagerTest, StateKeepsTheUnfinishedPeriod) {
  MetricsManager a(MetricsManager::Options{});
  a.AddStep({{kLoss, 0.7}, {kNumExamples, 2}});
  MetricsManager b(MetricsManager::Options{});
  b.RestoreState(a.SaveState());
  b.AddStep({{kLoss, 0.1}, {kNumExamples, 2}});
  EXPECT_THAT(b.SaveState(), ::testing::StartsWith("steps 2\nentry loss weighted_mean "));
  EXPECT_THAT(b.SaveState(), ::testing::Not(HasSubstr("second")))
      << "no timing, so that two runs' checkpoints compare equal";
  EXPECT_DOUBLE_EQ(b.Flush(2).metrics.at(kLoss), 0.4);
  EXPECT_THROW(b.RestoreState("seconds 1\n"), InvalidArgumentError);
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

Summary LossAt(int64_t step, double loss, const std::string& task = "test") { return Summary{task, step, {{kLoss, loss}}}; }

TEST(EarlyStoppingActionTest, StopsAfterPatienceSummariesWithoutImprovement) {
  EarlyStoppingAction action("test", kLoss, EarlyStoppingAction::Mode::kMin, /*patience=*/2);
  EXPECT_FALSE(action.OnSummary(LossAt(1, 5.0)).halt);
  EXPECT_FALSE(action.OnSummary(LossAt(2, 4.0)).halt);               // best
  EXPECT_FALSE(action.OnSummary(LossAt(3, 1.0, "train")).halt);      // another task: ignored
  EXPECT_FALSE(action.OnSummary(LossAt(4, 4.5)).halt);               // 1 without improvement
  EXPECT_FALSE(action.OnSummary(LossAt(5, 4.2)).halt);               // 2
  const HaltDecision d = action.OnSummary(LossAt(6, 4.1));           // 3 > patience
  EXPECT_TRUE(d.halt);
  EXPECT_FALSE(d.failure);
  EXPECT_THAT(d.reason, HasSubstr("test loss has not improved on 4 (step 2) for 3 summaries"));
}

TEST(EarlyStoppingActionTest, ToleranceAndMaxMode) {
  EarlyStoppingAction action("test", kAccuracy, EarlyStoppingAction::Mode::kMax, /*patience=*/0, /*atol=*/0.01);
  EXPECT_FALSE(action.OnSummary(Summary{"test", 1, {{kAccuracy, 0.80}}}).halt);
  EXPECT_FALSE(action.OnSummary(Summary{"test", 2, {{kAccuracy, 0.82}}}).halt);  // +0.02 > atol
  EXPECT_TRUE(action.OnSummary(Summary{"test", 3, {{kAccuracy, 0.825}}}).halt);  // +0.005 is not enough
  EXPECT_THROW(EarlyStoppingAction("t", "m", EarlyStoppingAction::Mode::kMin, -1), InvalidArgumentError);
}

TEST(TerminateOnNanActionTest, StopsAsAFailureOnNanOrInfinity) {
  TerminateOnNanAction action;
  EXPECT_FALSE(action.OnSummary(LossAt(1, 2.0, "train")).halt);
  EXPECT_FALSE(action.OnSummary(LossAt(2, NAN, "test")).halt);  // watches train only
  const HaltDecision d = action.OnSummary(LossAt(3, INFINITY, "train"));
  EXPECT_TRUE(d.halt);
  EXPECT_TRUE(d.failure);
  EXPECT_THAT(d.reason, HasSubstr("train loss is inf at step 3"));
}

TEST(BaseTrainerTest, AnActionStopsTrainingAtTheRightStep) {
  TrainState state;
  CountingTrainer trainer(state, Runtime::SingleProcess());  // loss = step after the step
  trainer.set_summary_every_steps(1);
  trainer.AddAction(std::make_unique<EarlyStoppingAction>("train", kLoss, EarlyStoppingAction::Mode::kMin, 2));
  ShardedBatchIterator data(TinyDataset(100), Sharding(10));
  trainer.Train(data, 100);
  EXPECT_EQ(state.step, 4);  // best at step 1, then 3 summaries without improvement
  EXPECT_TRUE(trainer.halt().halt);
  trainer.Train(data, 10);
  EXPECT_EQ(state.step, 4) << "a halted trainer does not train on";
}

TEST(ModelsTest, MlpHiddenLayersGiveTheListedWidths) {
  ModelOptions o;
  o.name = "mlp";
  o.hidden_layers = {256, 256};
  BuiltModel model = BuildModel(o);
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& p : model.module->parameters()) shapes.push_back(p.sizes().vec());
  EXPECT_THAT(shapes, ElementsAre(ElementsAre(256, 784), ElementsAre(256), ElementsAre(256, 256), ElementsAre(256),
                                  ElementsAre(10, 256), ElementsAre(10)));
  EXPECT_EQ(CountTrainableWeights(*model.module), 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
  EXPECT_EQ(model.apply(*model.module, at::zeros({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));

  o.hidden_layers.clear();  // one layer of hidden_units, as before
  EXPECT_EQ(BuildModel(o).module->parameters().size(), 4u);
  o.hidden_layers = {8, 0};
  EXPECT_THROW(BuildModel(o), InvalidArgumentError);
}

}  // namespace
}  // namespace lockstep
