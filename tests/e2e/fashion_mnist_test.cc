// End to end: the default CNN trained by the Trainer on real Fashion-MNIST (the
// Debian package dataset-fashion-mnist) reaches at least 0.85 test accuracy.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "lockstep/data.h"
#include "lockstep/models.h"
#include "lockstep/torch_setup.h"
#include "lockstep/trainer.h"

namespace lockstep {
namespace {

constexpr char kDataDir[] = "/usr/share/datasets/fashion-mnist";

TEST(FashionMnistEndToEndTest, DefaultCnnReachesAtLeast85PercentTestAccuracy) {
  if (!std::filesystem::exists(std::string(kDataDir) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed at " << kDataDir;
  }
  ConfigureTorchForTraining();
  auto train = std::make_shared<const TensorDataset>(LoadFashionMnist(kDataDir, Split::kTrain));
  auto test = std::make_shared<const TensorDataset>(LoadFashionMnist(kDataDir, Split::kTest));

  at::manual_seed(0);
  BuiltModel model = BuildModel(ModelOptions{});
  OptimizerOptions adam;
  adam.learning_rate = 2e-3;
  TrainState state = MakeTrainState(model.module, MakeOptimizerFactory(adam));
  constexpr int64_t kSteps = 500;  // about one epoch at batch 128
  TrainerOptions options;
  options.summary_every_steps = 100;
  LrSchedule schedule;
  schedule.peak = adam.learning_rate;
  schedule.decay = LrSchedule::Decay::kCosine;
  schedule.warmup_steps = 50;
  schedule.decay_steps = kSteps - 50;
  schedule.final_fraction = 0.05;
  options.step.schedule = schedule;
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  trainer.AddSummarySink(StdoutLogger{});

  ShardingOptions sharding;
  sharding.global_batch_size = 128;
  sharding.seed = 1;
  ShardedBatchIterator train_data(train, sharding);
  trainer.Train(train_data, kSteps);
  ASSERT_EQ(state.step, kSteps);

  ShardingOptions eval;
  eval.global_batch_size = 250;
  eval.shuffle = false;
  eval.num_epochs = 1;
  ShardedBatchIterator test_data(test, eval);
  const MetricMap result = trainer.Eval({{"test", &test_data}}).front().second;
  EXPECT_EQ(result.at(kNumExamples), 10000);
  EXPECT_GE(result.at(kAccuracy), 0.85);
}

}  // namespace
}  // namespace lockstep
