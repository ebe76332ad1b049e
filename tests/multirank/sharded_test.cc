// Sharded data parallelism under mpirun -np 2, 3 and 4: after 5 steps, N ranks
// under each sharded strategy (ZeRO-1, 2 and 3) equal 1 process with the whole global batch, for
// SGD with momentum, Adam and AdamW, 1 and 3 microbatches, with and without
// clipping, with units whose sizes do not divide by N; each rank keeps 1/N of
// the optimizer state.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include <torch/optim/lbfgs.h>

#include "lockstep/errors.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/sharded_data_parallel.h"
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

using ShardedTest = testing::MpiRanksTest;

struct Case {
  PartitioningStrategy strategy;
  OptimizerOptions::Kind optimizer;
  int microbatches;
  double max_grad_norm;
  size_t unit_bytes;
};

std::string Name(const Case& c) {
  const char* optimizer = c.optimizer == OptimizerOptions::Kind::kSgd    ? "SGD"
                          : c.optimizer == OptimizerOptions::Kind::kAdam ? "Adam"
                                                                          : "AdamW";
  return PartitioningStrategyName(c.strategy) + " " + optimizer + " microbatches " + std::to_string(c.microbatches) +
         " clip " + std::to_string(c.max_grad_norm) + " unit_bytes " + std::to_string(c.unit_bytes);
}

OptimizerFactory Factory(OptimizerOptions::Kind kind) {
  OptimizerOptions o;
  o.kind = kind;
  o.learning_rate = kind == OptimizerOptions::Kind::kSgd ? 0.1 : 0.01;
  o.momentum = 0.9;
  o.weight_decay = kind == OptimizerOptions::Kind::kAdamW ? 0.1 : 0.0;
  return MakeOptimizerFactory(o);
}

// 31 examples, global batch 30: the second step has one example, so some ranks
// train on an empty shard.
constexpr int64_t kExamples = 31;
constexpr int64_t kGlobalBatch = 30;
constexpr int kSteps = 5;

struct RunResult {
  std::vector<at::Tensor> params;
  MetricMap last;
  PartitionedBytes bytes;
  int64_t elements = 0;
};

RunResult Train(const Case& c, Communicator* comm, int rank, int world, uint64_t init_seed) {
  BuiltModel model = TinyModel(init_seed);
  TrainState state = MakeTrainState(model.module, Factory(c.optimizer));
  TrainerOptions options;
  options.step.num_microbatches = c.microbatches;
  options.step.max_grad_norm = c.max_grad_norm;
  options.communicator = comm;
  options.partitioning = c.strategy;
  options.data_parallel.bucket_bytes = c.unit_bytes;
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
  if (ShardedDataParallel* sharded = trainer.sharded_data_parallel()) {
    result.bytes = sharded->bytes();  // between steps
    result.elements = sharded->num_elements();
    if (c.strategy == PartitioningStrategy::kFullySharded) {
      EXPECT_FALSE(sharded->gathered());
      sharded->GatherForEval();
    }
  }
  result.params = Snapshot(*state.model);
  return result;
}

TEST_F(ShardedTest, NRanksUpdateAsOneProcessWithTheWholeBatch) {
  for (PartitioningStrategy strategy : {PartitioningStrategy::kShardedOptimizerState,
                                        PartitioningStrategy::kShardedGradients, PartitioningStrategy::kFullySharded}) {
    for (OptimizerOptions::Kind opt :
         {OptimizerOptions::Kind::kSgd, OptimizerOptions::Kind::kAdam, OptimizerOptions::Kind::kAdamW}) {
      for (int microbatches : {1, 3}) {
        for (double clip : {0.0, 0.05}) {
          // One parameter per unit (sizes 4, 16, 64 and 1024 elements) and one unit.
          for (size_t unit_bytes : {size_t{1}, size_t{25} << 20}) {
            const Case c{strategy, opt, microbatches, clip, unit_bytes};
            SCOPED_TRACE(Name(c));
            const RunResult ours = Train(c, comm_.get(), rank_, size_, /*init_seed=*/100 + rank_);
            const RunResult reference = Train(c, nullptr, 0, 1, /*init_seed=*/100);
            EXPECT_LE(MaxRelativeDifference(ours.params, reference.params), 1e-5);
            EXPECT_GT(MaxRelativeDifference(Snapshot(*TinyModel(100).module), reference.params), 1e-3);
            EXPECT_NEAR(ours.last.at(kLoss), reference.last.at(kLoss), 1e-5);
            EXPECT_NEAR(ours.last.at(kGradientsL2Norm), reference.last.at(kGradientsL2Norm),
                        1e-5 * reference.last.at(kGradientsL2Norm));
            EXPECT_NEAR(ours.last.at(kWeightsL2Norm), reference.last.at(kWeightsL2Norm),
                        1e-5 * reference.last.at(kWeightsL2Norm));
            EXPECT_EQ(ours.last.at(kNumExamples), reference.last.at(kNumExamples));
          }
        }
      }
    }
  }
}

TEST_F(ShardedTest, EachRankKeepsItsShareOfTheOptimizerStateAndGradients) {
  for (PartitioningStrategy strategy : {PartitioningStrategy::kShardedOptimizerState,
                                        PartitioningStrategy::kShardedGradients, PartitioningStrategy::kFullySharded}) {
    SCOPED_TRACE(PartitioningStrategyName(strategy));
    const Case c{strategy, OptimizerOptions::Kind::kAdam, 1, 0.0, size_t{25} << 20};
    const RunResult ours = Train(c, comm_.get(), rank_, size_, 100);
    const int64_t elements = ours.elements;
    ASSERT_GT(elements, 0);
    const int64_t slice = (elements + size_ - 1) / size_;
    // Adam: two float32 moments per element of this rank's slice.
    EXPECT_EQ(ours.bytes.optimizer_state, 2 * 4 * slice);
    EXPECT_EQ(ours.bytes.parameters,
              strategy == PartitioningStrategy::kFullySharded ? 4 * slice : 4 * slice * size_);
    if (strategy != PartitioningStrategy::kShardedOptimizerState) {
      EXPECT_EQ(ours.bytes.gradients, 4 * slice);
    } else {
      EXPECT_EQ(ours.bytes.gradients, 4 * slice * size_);
    }
  }
}

TEST_F(ShardedTest, AnOptimizerThatIsNotElementWiseIsRefusedByName) {
  BuiltModel model = TinyModel(1);
  TrainState state;
  state.model = model.module;
  state.optimizer = std::make_shared<torch::optim::LBFGS>(model.module->parameters());
  TrainerOptions options;
  options.communicator = comm_.get();
  options.partitioning = PartitioningStrategy::kShardedGradients;
  try {
    Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_THAT(e.what(), HasSubstr("sharded_gradients"));
    EXPECT_THAT(e.what(), HasSubstr("Adam"));
  }
}

}  // namespace
}  // namespace lockstep
