// Tensor parallelism on a data x model mesh under mpirun: on 2 ranks as 1x2 and
// 2x1, on 4 as 2x2, 1x4 and 4x1, the GPT split by DefaultTransformerRules
// (heads, MLP columns and vocabulary over the model axis) trains 5 AdamW steps
// with clipping and ends with the parameters, loss, norms and eval loss of 1
// process with the same global batches, within 1e-5 relative; each rank holds
// 1/M of the split parameters. The same with the optimizer's state sliced over
// the data axis (ZeRO-1 and ZeRO-2), on 2x2.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/errors.h"
#include "lockstep/gpt.h"
#include "lockstep/mesh.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/tensor_parallel.h"
#include "lockstep/trainer.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using testing::MaxRelativeDifference;

constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kLength = 16;
constexpr int kSteps = 5;

GptOptions SmallGpt() {
  GptOptions o;
  o.vocab_size = 64;
  o.context_length = kLength;
  o.num_layers = 2;
  o.num_heads = 4;
  o.width = 32;
  return o;
}

// Global batch `step`: random tokens, the targets shifted by one.
Batch GlobalBatch(int step) {
  at::Generator gen = at::detail::createCPUGenerator(1000 + step);
  const at::Tensor window = at::randint(0, SmallGpt().vocab_size, {kGlobalBatch, kLength + 1}, gen, at::kLong);
  return Batch{window.narrow(1, 0, kLength).contiguous(), window.narrow(1, 1, kLength).contiguous(), {}};
}

// This data rank's rows of each global batch, in order.
class SliceIterator : public BatchIterator {
 public:
  SliceIterator(int index, int parts, int first_step) : index_(index), parts_(parts), step_(first_step) {}
  std::optional<Batch> Next() override {
    const Batch global = GlobalBatch(step_++);
    const int64_t rows = kGlobalBatch / parts_;
    return Batch{global.inputs.narrow(0, index_ * rows, rows), global.targets.narrow(0, index_ * rows, rows), {}};
  }

 private:
  int index_, parts_, step_;
};

OptimizerFactory AdamW() {
  OptimizerOptions o;
  o.kind = OptimizerOptions::Kind::kAdamW;
  o.learning_rate = 1e-2;
  o.weight_decay = 0.1;
  return MakeOptimizerFactory(o);
}

ApplyFn ApplyGpt() {
  return [](torch::nn::Module& m, const at::Tensor& x) { return static_cast<GptImpl&>(m).forward(x); };
}

struct RunResult {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // whole, gathered over the model axis
  MetricMap last;
  double eval_loss = 0;
  int64_t bytes_per_rank = 0;
  int64_t split_bytes_per_rank = 0, split_bytes = 0;
  bool sharded_state = false;  // the optimizer's state was sliced over the data axis
};

// Parameters, loss, norms and eval loss of `ours` against 1 process.
void ExpectSameTraining(const RunResult& ours, const RunResult& reference) {
  ASSERT_EQ(ours.names, reference.names);
  for (size_t i = 0; i < ours.params.size(); ++i) {
    at::Tensor mine = ours.params[i], theirs = reference.params[i];
    if (ours.names[i].find("qkv.bias") != std::string::npos) {
      // The key bias adds the same amount to every score of a query, which
      // softmax ignores: its gradient is zero but for rounding, and AdamW turns
      // rounding into full-size steps of either sign. Query and value biases
      // are compared; the key third is not.
      const int64_t w = mine.size(0) / 3;
      mine = at::cat({mine.narrow(0, 0, w), mine.narrow(0, 2 * w, w)});
      theirs = at::cat({theirs.narrow(0, 0, w), theirs.narrow(0, 2 * w, w)});
    }
    EXPECT_LE(MaxRelativeDifference({mine}, {theirs}), 1e-5) << ours.names[i];
  }
  EXPECT_NEAR(ours.last.at(kLoss), reference.last.at(kLoss), 1e-5 * reference.last.at(kLoss));
  EXPECT_NEAR(ours.last.at(kGradientsL2Norm), reference.last.at(kGradientsL2Norm),
              1e-5 * reference.last.at(kGradientsL2Norm));
  EXPECT_NEAR(ours.last.at(kWeightsL2Norm), reference.last.at(kWeightsL2Norm),
              1e-5 * reference.last.at(kWeightsL2Norm));
  // Examples are counted once per data replica, not once per model-axis rank.
  EXPECT_EQ(ours.last.at(kNumExamples), reference.last.at(kNumExamples));
  EXPECT_NEAR(ours.eval_loss, reference.eval_loss, 1e-5 * reference.eval_loss);
}

RunResult TrainGpt(const DeviceMesh* mesh, const Partitioner* partitioner,
                   PartitioningStrategy strategy = PartitioningStrategy::kReplicated) {
  torch::manual_seed(7);
  GptParallelism parallel;
  if (mesh != nullptr) parallel = {mesh->model(), mesh->model_index(), partitioner};
  auto model = std::make_shared<GptImpl>(SmallGpt(), parallel);
  TrainState state = MakeTrainState(model, AdamW());
  TrainerOptions options;
  options.step.max_grad_norm = 0.5;  // engages: the first steps' norms are above it
  options.mesh = mesh;
  options.parameter_layouts = model->layouts();
  options.summary_every_steps = kSteps;
  options.partitioning = strategy;
  Trainer trainer(state, ApplyGpt(), LanguageModelLoss(model->vocab_axis(), model->vocab_begin()), options);
  const int data_index = mesh != nullptr ? mesh->data_index() : 0;
  const int data_parts = mesh != nullptr ? mesh->shape().data : 1;
  SliceIterator data(data_index, data_parts, 0);
  RunResult result;
  result.last = trainer.Train(data, kSteps);
  EXPECT_EQ(state.step, kSteps);
  result.sharded_state = state.layout != nullptr;
  // Eval: the loss of a held-out global batch, combined over the ranks.
  struct Once : BatchIterator {
    explicit Once(Batch b) : batch(std::move(b)) {}
    std::optional<Batch> Next() override {
      if (done) return std::nullopt;
      done = true;
      return batch;
    }
    Batch batch;
    bool done = false;
  };
  SliceIterator held_out(data_index, data_parts, 100);
  Once once(*held_out.Next());
  result.eval_loss = trainer.Eval({{"held_out", &once}}).at(0).second.at(kLoss);
  for (const ParameterLayout& layout : model->layouts()) {
    result.bytes_per_rank += layout.bytes_per_rank();
    if (layout.sharded()) {
      result.split_bytes_per_rank += layout.bytes_per_rank();
      result.split_bytes += layout.global_numel() * layout.element_size;
    }
  }
  auto named = model->named_parameters();
  for (const ParameterLayout& layout : model->layouts()) {
    const at::Tensor local = named[layout.name].detach();
    // Each rank holds its shard's shape.
    EXPECT_EQ(local.sizes().vec(), layout.local_shape()) << layout.name;
    result.names.push_back(layout.name);
    result.params.push_back(GatherShards(local, layout, mesh != nullptr ? mesh->model() : nullptr));
  }
  return result;
}

class TensorParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MpiOptions o;
    o.thread_multiple = true;  // the mesh's axis communicators run side by side
    world_ = MakeMpiCommunicator(o);
    ASSERT_GE(world_->world_size(), 2) << "run under mpirun with at least 2 ranks";
  }
  std::vector<MeshShape> Shapes() const {
    if (world_->world_size() == 4) return {{2, 2}, {1, 4}, {4, 1}};
    return {{1, world_->world_size()}, {world_->world_size(), 1}};
  }
  std::unique_ptr<Communicator> world_;
};

TEST_F(TensorParallelTest, EveryMeshShapeTrainsAsOneProcess) {
  const RunResult reference = TrainGpt(nullptr, nullptr);
  // The run moved the parameters: equality below is not equality with the start.
  torch::manual_seed(7);
  const GptImpl initial(SmallGpt());
  EXPECT_GT(MaxRelativeDifference(initial.parameters(), reference.params), 1e-3);
  for (const MeshShape& shape : Shapes()) {
    SCOPED_TRACE(DescribeMesh(shape));
    std::unique_ptr<DeviceMesh> mesh = DeviceMesh::Create(world_.get(), shape);
    const Partitioner partitioner(DefaultTransformerRules(), shape);
    const RunResult ours = TrainGpt(mesh.get(), &partitioner);
    ExpectSameTraining(ours, reference);
    // The split parameters: exactly 1/M of their bytes on each rank.
    if (shape.model > 1) {
      EXPECT_EQ(ours.split_bytes_per_rank * shape.model, ours.split_bytes);
    } else {
      EXPECT_EQ(ours.split_bytes, 0);
    }
    if (world_->rank() == 0) {
      std::printf("%s: parameters per rank %lld of %lld bytes; split ones %lld of %lld\n",
                  DescribeMesh(shape).c_str(), static_cast<long long>(ours.bytes_per_rank),
                  static_cast<long long>(reference.bytes_per_rank), static_cast<long long>(ours.split_bytes_per_rank),
                  static_cast<long long>(ours.split_bytes));
    }
  }
}

// ZeRO-1 and ZeRO-2 over the data axis beside the model axis: the optimizer's
// state of each model index's shards is sliced over its data replicas, the norms
// add the split parameters over the model axis, and training equals 1 process.
TEST_F(TensorParallelTest, ShardedStateOverTheDataAxisComposesWithTheModelAxis) {
  const RunResult reference = TrainGpt(nullptr, nullptr);
  const MeshShape shape = world_->world_size() == 4 ? MeshShape{2, 2} : MeshShape{world_->world_size(), 1};
  for (PartitioningStrategy strategy :
       {PartitioningStrategy::kShardedOptimizerState, PartitioningStrategy::kShardedGradients}) {
    SCOPED_TRACE(DescribeMesh(shape) + " " + PartitioningStrategyName(strategy));
    std::unique_ptr<DeviceMesh> mesh = DeviceMesh::Create(world_.get(), shape);
    const Partitioner partitioner(DefaultTransformerRules(), shape);
    const RunResult ours = TrainGpt(mesh.get(), &partitioner, strategy);
    EXPECT_TRUE(ours.sharded_state);
    ExpectSameTraining(ours, reference);
  }
  // Fully sharded parameters beside a model axis: refused, naming what works.
  if (shape.model > 1) {
    std::unique_ptr<DeviceMesh> mesh = DeviceMesh::Create(world_.get(), shape);
    const Partitioner partitioner(DefaultTransformerRules(), shape);
    EXPECT_THAT([&] { TrainGpt(mesh.get(), &partitioner, PartitioningStrategy::kFullySharded); },
                ::testing::ThrowsMessage<InvalidArgumentError>(::testing::HasSubstr("sharded_gradients")));
  }
}

TEST_F(TensorParallelTest, TheVocabularyParallelLossEqualsCrossEntropyOfTheWholeLogits) {
  const int m = world_->world_size();
  std::unique_ptr<DeviceMesh> mesh = DeviceMesh::Create(world_.get(), {1, m});
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor logits = at::randn({6, 8 * m}, gen).mul(4);
  const at::Tensor targets = at::randint(0, 8 * m, {6}, gen, at::kLong);
  const at::Tensor whole = logits.clone().requires_grad_(true);
  const at::Tensor expected = at::cross_entropy_loss(whole, targets, {}, at::Reduction::None);
  expected.sum().backward();
  const int index = mesh->model_index();
  const at::Tensor local = logits.narrow(1, index * 8, 8).clone().requires_grad_(true);
  const at::Tensor loss = VocabParallelCrossEntropy(local, targets, index * 8, mesh->model());
  EXPECT_TRUE(at::allclose(loss, expected.detach(), 1e-6, 1e-6)) << loss << expected;
  loss.sum().backward();
  EXPECT_TRUE(at::allclose(local.grad(), whole.grad().narrow(1, index * 8, 8), 1e-6, 1e-6));
}

TEST_F(TensorParallelTest, SplitGivesGroupsOfTheirOwn) {
  const int n = world_->world_size();
  std::unique_ptr<Communicator> halves = world_->Split(world_->rank() % 2, world_->rank());
  EXPECT_EQ(halves->world_size(), (n + 1 - world_->rank() % 2) / 2);
  at::Tensor x = at::full({3}, static_cast<float>(world_->rank() + 1));
  halves->AllReduce(x, ReduceOp::kSum);
  float expected = 0;
  for (int r = world_->rank() % 2; r < n; r += 2) expected += static_cast<float>(r + 1);
  EXPECT_FLOAT_EQ(x[0].item<float>(), expected);
  try {
    world_->Split(-1, 0);
    FAIL() << "expected InvalidArgumentError";
  } catch (const InvalidArgumentError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("color"));
  }
}

}  // namespace
}  // namespace lockstep
