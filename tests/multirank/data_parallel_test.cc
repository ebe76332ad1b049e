// Data parallelism under mpirun -np 2 and 3: N ranks with per-rank shards update
// exactly as one process with the whole global batch; models that differ across
// ranks fail on every rank with a message.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>

#include "lockstep/data_parallel.h"
#include "lockstep/errors.h"
#include "lockstep/metrics_manager.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/trainer.h"
#include "tests/testing/mpi_ranks.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using testing::MaxRelativeDifference;
using testing::Snapshot;
using testing::TinyDataset;
using testing::TinyModel;
using ::testing::HasSubstr;

using DataParallelTest = testing::MpiRanksTest;

struct Case {
  OptimizerOptions::Kind optimizer;
  int microbatches;
  size_t bucket_bytes;
};

OptimizerFactory Factory(OptimizerOptions::Kind kind) {
  OptimizerOptions o;
  o.kind = kind;
  o.learning_rate = kind == OptimizerOptions::Kind::kSgd ? 0.1 : 0.01;
  return MakeOptimizerFactory(o);
}

struct RunResult {
  std::vector<at::Tensor> params;
  MetricMap last;
  int buckets = 0;
  int launched_during_backward = 0;
};

// 31 examples, global batch 30: the second step has one example, so some ranks
// train on an empty shard.
constexpr int64_t kExamples = 31;
constexpr int64_t kGlobalBatch = 30;
constexpr int kSteps = 3;  // the last step has a full batch again

RunResult Train(const Case& c, Communicator* comm, int rank, int world, uint64_t init_seed) {
  BuiltModel model = TinyModel(init_seed);
  TrainState state = MakeTrainState(model.module, Factory(c.optimizer));
  TrainerOptions options;
  options.step.num_microbatches = c.microbatches;
  options.step.max_grad_norm = 5.0;
  options.communicator = comm;
  options.data_parallel.bucket_bytes = c.bucket_bytes;
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  ShardingOptions sharding;
  sharding.global_batch_size = kGlobalBatch;
  sharding.rank = rank;
  sharding.world_size = world;
  sharding.seed = 3;
  ShardedBatchIterator data(TinyDataset(kExamples), sharding);
  RunResult result;
  for (int s = 0; s < kSteps; ++s) result.last = trainer.Train(data, 1);
  EXPECT_EQ(state.step, kSteps);
  result.params = Snapshot(*state.model);
  if (DataParallel* dp = trainer.data_parallel()) {
    // Rebuilt after the first step: still every parameter exactly once.
    std::vector<size_t> all;
    for (const auto& bucket : dp->bucketer().buckets()) all.insert(all.end(), bucket.begin(), bucket.end());
    std::sort(all.begin(), all.end());
    std::vector<size_t> expected(state.model->parameters().size());
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(all, expected);
    result.buckets = static_cast<int>(dp->bucketer().buckets().size());
    result.launched_during_backward = dp->bucketer().launched_during_backward();
  }
  return result;
}

TEST_F(DataParallelTest, NRanksUpdateExactlyAsOneRankWithTheWholeBatch) {
  const int num_params = static_cast<int>(TinyModel(1).module->parameters().size());
  for (OptimizerOptions::Kind opt : {OptimizerOptions::Kind::kSgd, OptimizerOptions::Kind::kAdam}) {
    for (int microbatches : {1, 3}) {
      for (size_t bucket_bytes : {size_t{1}, size_t{25} << 20}) {
        const Case c{opt, microbatches, bucket_bytes};
        SCOPED_TRACE(std::string(opt == OptimizerOptions::Kind::kSgd ? "SGD" : "Adam") + " microbatches " +
                     std::to_string(microbatches) + " bucket_bytes " + std::to_string(bucket_bytes));
        // Ranks start from different parameters: rank 0's are broadcast.
        const RunResult ours = Train(c, comm_.get(), rank_, size_, /*init_seed=*/100 + rank_);
        const RunResult reference = Train(c, nullptr, 0, 1, /*init_seed=*/100);
        EXPECT_LE(MaxRelativeDifference(ours.params, reference.params), 1e-5);
        EXPECT_GT(MaxRelativeDifference(Snapshot(*TinyModel(100).module), reference.params), 1e-3);
        EXPECT_NEAR(ours.last.at(kLoss), reference.last.at(kLoss), 1e-5);
        EXPECT_NEAR(ours.last.at(kGradientsL2Norm), reference.last.at(kGradientsL2Norm), 1e-4);
        EXPECT_EQ(ours.last.at(kNumExamples), reference.last.at(kNumExamples));
        EXPECT_EQ(ours.buckets, bucket_bytes == 1 ? num_params : 1);
        // The last step had a full shard on every rank: every bucket but possibly
        // none was started from an autograd hook, during backward.
        EXPECT_EQ(ours.launched_during_backward, ours.buckets);
      }
    }
  }
}

TEST_F(DataParallelTest, GradientsLiveInTheBucketBuffersAndReplacedOnesStillCount) {
  BuiltModel model = TinyModel(1);
  std::vector<at::Tensor> params = model.module->parameters();
  ASSERT_GE(params.size(), 3u);
  GradientBucketer bucketer(comm_.get(), params, DataParallelOptions{});  // one bucket
  ASSERT_EQ(bucketer.buckets().size(), 1u);
  const double sum = size_ * (size_ + 1) / 2.0;  // every rank adds rank + 1
  for (at::Tensor& p : params) p.mutable_grad() = at::full_like(p, rank_ + 1);
  bucketer.Arm();
  bucketer.Finish();
  const void* storage = params[0].grad().storage().data();
  for (const at::Tensor& p : params) {
    EXPECT_EQ(p.grad().storage().data(), storage) << "every gradient is a slice of the one bucket";
    EXPECT_TRUE(at::allclose(p.grad(), at::full_like(p, sum)));
  }
  // An optimizer's zero_grad keeps them there; a gradient replaced by a new tensor
  // or set to none is copied in (none counts as zero) and pointed back.
  MakeOptimizerFactory(OptimizerOptions{})(params)->zero_grad();
  params[0].mutable_grad() = at::full_like(params[0], 1.0);
  params[1].mutable_grad() = at::Tensor();
  bucketer.Arm();
  bucketer.Finish();
  EXPECT_TRUE(at::allclose(params[0].grad(), at::full_like(params[0], size_)));
  EXPECT_TRUE(at::allclose(params[1].grad(), at::zeros_like(params[1])));
  EXPECT_TRUE(at::allclose(params[2].grad(), at::zeros_like(params[2])));
  for (const at::Tensor& p : params) EXPECT_EQ(p.grad().storage().data(), params[0].grad().storage().data());
}

TEST_F(DataParallelTest, EvalIsReducedOverRanks) {
  BuiltModel model = TinyModel(7);
  TrainState state = MakeTrainState(model.module, Factory(OptimizerOptions::Kind::kAdam));
  TrainerOptions options;
  options.communicator = comm_.get();
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  ShardingOptions sharding;
  sharding.global_batch_size = 40;
  sharding.rank = rank_;
  sharding.world_size = size_;
  sharding.shuffle = false;
  sharding.num_epochs = 1;
  ShardedBatchIterator shard(TinyDataset(203, 9), sharding);
  const MetricMap ours = trainer.Eval({{"test", &shard}}).front().second;

  TrainState alone = MakeTrainState(TinyModel(7).module, Factory(OptimizerOptions::Kind::kAdam));
  const TrainerOptions defaults;
  Trainer single(alone, model.apply, CrossEntropyLoss(), defaults);
  sharding.rank = 0;
  sharding.world_size = 1;
  ShardedBatchIterator whole(TinyDataset(203, 9), sharding);
  const MetricMap reference = single.Eval({{"test", &whole}}).front().second;
  EXPECT_EQ(ours.at(kNumExamples), 203);
  EXPECT_NEAR(ours.at(kAccuracy), reference.at(kAccuracy), 1e-12);
  EXPECT_NEAR(ours.at(kLoss), reference.at(kLoss), 1e-6);
}

TEST_F(DataParallelTest, MetricsManagerCombinesEachMetricOverRanks) {
  MetricsManager::Options options;
  options.communicator = comm_.get();
  MetricsManager manager(options);
  manager.SetReduction("peak_memory", MetricReduction::kMax);
  manager.SetReduction("tokens", MetricReduction::kSum);
  manager.StartTimer();
  const double r = rank_;
  for (int step = 0; step < 2; ++step) {
    MetricMap m = {{kLoss, r + step}, {kNumExamples, r + 1}, {kLearningRate, 0.5 - r},
                   {"peak_memory", 10 * r + step}, {"tokens", 3}, {"other", r}};
    if (rank_ == 1) m["only_on_rank_1"] = 7;  // the union is combined
    manager.AddStep(m);
  }
  const Summary s = manager.Flush(2);
  double loss = 0, examples = 0, other = 0;
  for (int q = 0; q < size_; ++q) {
    loss += (q + 1) * (q + (q + 1));  // two steps of loss q and q + 1, weighted by q + 1
    examples += 2 * (q + 1);
    other += q;
  }
  EXPECT_DOUBLE_EQ(s.metrics.at(kLoss), loss / examples);
  EXPECT_DOUBLE_EQ(s.metrics.at(kNumExamples), examples);
  EXPECT_DOUBLE_EQ(s.metrics.at(kLearningRate), 0.5) << "rank 0's";
  EXPECT_DOUBLE_EQ(s.metrics.at("peak_memory"), 10 * (size_ - 1) + 1);
  EXPECT_DOUBLE_EQ(s.metrics.at("tokens"), 3 * 2 * size_);
  EXPECT_DOUBLE_EQ(s.metrics.at("other"), other / size_);
  EXPECT_DOUBLE_EQ(s.metrics.at("only_on_rank_1"), 7);
  EXPECT_GT(s.metrics.at(kSecondsPerStep), 0);
  // Every rank's summary is the same, timing included (the slowest rank's).
  at::Tensor mine = at::tensor({s.metrics.at(kSecondsPerStep), s.metrics.at(kLoss)}, at::kDouble);
  at::Tensor largest = mine.clone();
  comm_->AllReduce(largest, ReduceOp::kMax);
  EXPECT_TRUE(at::equal(mine, largest));

  // Ranks that disagree on how a metric combines are told so, on every rank.
  manager.SetReduction("contested", rank_ == 0 ? MetricReduction::kMean : MetricReduction::kMax);
  manager.AddStep({{"contested", 1.0}});
  EXPECT_THAT([&] { manager.Flush(3); }, ::testing::ThrowsMessage<Error>(HasSubstr("'contested'")));
}

TEST_F(DataParallelTest, AMismatchedModelFailsOnEveryRank) {
  ModelOptions model_options = testing::TinyModelOptions();
  if (rank_ == size_ - 1) model_options.hidden_units = 17;  // the odd one out
  BuiltModel model = BuildModel(model_options);
  TrainState state = MakeTrainState(model.module, Factory(OptimizerOptions::Kind::kSgd));
  TrainerOptions options;
  options.communicator = comm_.get();
  const std::string expected = "rank " + std::to_string(size_ - 1) + " has a different model";
  EXPECT_THAT([&] { Trainer(state, model.apply, CrossEntropyLoss(), options); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr(expected)));
}

TEST_F(DataParallelTest, AMismatchedConfigFailsOnEveryRank) {
  BuiltModel model = TinyModel(1);
  TrainState state = MakeTrainState(model.module, Factory(OptimizerOptions::Kind::kSgd));
  TrainerOptions options;
  options.communicator = comm_.get();
  options.fingerprint = rank_ == 1 ? "learning_rate: 0.2" : "learning_rate: 0.1";
  EXPECT_THAT([&] { Trainer(state, model.apply, CrossEntropyLoss(), options); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("rank 1 has a different config")));
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// A NaN loss on one rank only (the last) at step 3: the global loss is NaN, rank 0
// decides to stop, and every rank stops after the same step.
TEST_F(DataParallelTest, ANanOnOneRankStopsEveryRankCleanly) {
  BuiltModel model = TinyModel(3);
  TrainState state = MakeTrainState(model.module, Factory(OptimizerOptions::Kind::kSgd));
  TrainerOptions options;
  options.communicator = comm_.get();
  options.summary_every_steps = 1;
  const int poisoned_rank = size_ - 1;
  LossFn loss = [&state, this, poisoned_rank](const at::Tensor& outputs, const at::Tensor& targets) {
    at::Tensor per_example = CrossEntropyLoss()(outputs, targets);
    if (rank_ == poisoned_rank && state.step == 2) per_example = per_example * NAN;
    return per_example;
  };
  Trainer trainer(state, model.apply, loss, options, Runtime{rank_, size_, 0, "", "mpirun"});
  trainer.AddAction(std::make_unique<TerminateOnNanAction>());
  ShardingOptions sharding;
  sharding.global_batch_size = 12;
  sharding.rank = rank_;
  sharding.world_size = size_;
  ShardedBatchIterator data(TinyDataset(120), sharding);
  trainer.Train(data, 10);
  EXPECT_EQ(state.step, 3);
  EXPECT_TRUE(trainer.halt().halt);
  EXPECT_TRUE(trainer.halt().failure);
  EXPECT_THAT(trainer.halt().reason, HasSubstr("train loss is nan at step 3"));
  comm_->Barrier();  // nobody is left behind in a collective
}

}  // namespace
}  // namespace lockstep
