// The shared train step: microbatch accumulation equals the whole-batch update,
// clipping, metrics, and schedules; BlockedSgd against torch::optim::SGD.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "lockstep/errors.h"
#include "lockstep/schedule.h"
#include "lockstep/sgd.h"
#include "lockstep/step.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using testing::MaxRelativeDifference;
using testing::Snapshot;
using testing::TinyDataset;
using testing::TinyModel;

enum class Opt { kSgd, kAdam };

OptimizerFactory Factory(Opt opt) {
  OptimizerOptions o;
  o.kind = opt == Opt::kSgd ? OptimizerOptions::Kind::kSgd : OptimizerOptions::Kind::kAdam;
  o.learning_rate = opt == Opt::kSgd ? 0.1 : 0.01;
  o.momentum = 0.9;
  return MakeOptimizerFactory(o);
}

// The reference: a hand-written libtorch step on the whole batch, with the
// weighted mean loss sum(w * l) / sum(w).
std::vector<at::Tensor> ReferenceTrain(Opt opt, const std::vector<Batch>& batches) {
  BuiltModel model = TinyModel(/*seed=*/1);
  std::unique_ptr<torch::optim::Optimizer> optimizer = Factory(opt)(model.module->parameters());
  for (const Batch& batch : batches) {
    optimizer->zero_grad();
    const at::Tensor per_example =
        at::cross_entropy_loss(model.apply(*model.module, batch.inputs), batch.targets, {}, at::Reduction::None);
    const at::Tensor loss = batch.weights.defined() ? (per_example * batch.weights).sum() / batch.weights.sum()
                                                    : per_example.mean();
    loss.backward();
    optimizer->step();
  }
  return Snapshot(*model.module);
}

std::vector<at::Tensor> LockstepTrain(Opt opt, const std::vector<Batch>& batches, int microbatches) {
  BuiltModel model = TinyModel(/*seed=*/1);
  TrainState state = MakeTrainState(model.module, Factory(opt));
  StepOptions options;
  options.num_microbatches = microbatches;
  for (const Batch& batch : batches) RunTrainStep(state, batch, model.apply, CrossEntropyLoss(), options);
  EXPECT_EQ(state.step, static_cast<int64_t>(batches.size()));
  return Snapshot(*model.module);
}

std::vector<Batch> Batches(int64_t batch_size, int steps, bool weighted) {
  auto dataset = TinyDataset(batch_size * steps, /*seed=*/3);
  std::vector<Batch> batches;
  at::Generator gen = at::detail::createCPUGenerator(17);
  for (int s = 0; s < steps; ++s) {
    Batch b = dataset->Gather(at::arange(s * batch_size, (s + 1) * batch_size, at::kLong));
    if (weighted) b.weights = at::rand({batch_size}, gen, at::kFloat) * 3;
    batches.push_back(b);
  }
  return batches;
}

struct AccumulationCase {
  Opt opt;
  int64_t batch_size;
  int microbatches;
  bool weighted;
};

class AccumulationTest : public ::testing::TestWithParam<AccumulationCase> {};

TEST_P(AccumulationTest, MatchesTheWholeBatchUpdate) {
  const AccumulationCase c = GetParam();
  const std::vector<Batch> batches = Batches(c.batch_size, /*steps=*/5, c.weighted);
  const std::vector<at::Tensor> reference = ReferenceTrain(c.opt, batches);
  const std::vector<at::Tensor> ours = LockstepTrain(c.opt, batches, c.microbatches);
  EXPECT_LE(MaxRelativeDifference(ours, reference), 1e-5);
  // The comparison can fail: training moved the parameters away from the init.
  EXPECT_GT(MaxRelativeDifference(Snapshot(*TinyModel(1).module), reference), 1e-3);
}

std::string CaseName(const ::testing::TestParamInfo<AccumulationCase>& info) {
  const AccumulationCase& c = info.param;
  return std::string(c.opt == Opt::kSgd ? "Sgd" : "Adam") + "Batch" + std::to_string(c.batch_size) + "K" +
         std::to_string(c.microbatches) + (c.weighted ? "Weighted" : "");
}

INSTANTIATE_TEST_SUITE_P(
    KMicrobatches, AccumulationTest,
    ::testing::Values(AccumulationCase{Opt::kSgd, 42, 1, false}, AccumulationCase{Opt::kSgd, 42, 2, false},
                      AccumulationCase{Opt::kSgd, 42, 3, false}, AccumulationCase{Opt::kSgd, 42, 7, false},
                      AccumulationCase{Opt::kSgd, 23, 7, false},  // uneven: 4,4,3,3,3,3,3
                      AccumulationCase{Opt::kSgd, 23, 3, true}, AccumulationCase{Opt::kAdam, 42, 1, false},
                      AccumulationCase{Opt::kAdam, 42, 2, false}, AccumulationCase{Opt::kAdam, 42, 3, false},
                      AccumulationCase{Opt::kAdam, 42, 7, false}, AccumulationCase{Opt::kAdam, 23, 7, false},
                      AccumulationCase{Opt::kAdam, 23, 3, true}),
    CaseName);

TEST(AccumulationWeightsTest, WeightsChangeTheUpdate) {
  // Guards the weighted cases above: weights are not silently ignored.
  std::vector<Batch> weighted = Batches(23, 3, /*weighted=*/true);
  std::vector<Batch> plain = weighted;
  for (Batch& b : plain) b.weights = at::Tensor();
  EXPECT_GT(MaxRelativeDifference(LockstepTrain(Opt::kSgd, weighted, 3), LockstepTrain(Opt::kSgd, plain, 3)), 1e-4);
}

TEST(TrainStepTest, ReportsMetricsAccumulatedOverMicrobatches) {
  BuiltModel model = TinyModel(2);
  TrainState state = MakeTrainState(model.module, Factory(Opt::kSgd));
  const Batch batch = Batches(30, 1, /*weighted=*/false).front();
  // Expected loss and accuracy from a plain forward pass before the update.
  const at::Tensor logits = model.apply(*model.module, batch.inputs).detach();
  const double loss = at::cross_entropy_loss(logits, batch.targets).item<double>();
  const double accuracy = logits.argmax(1).eq(batch.targets).to(at::kDouble).mean().item<double>();
  const double weights_before = GlobalL2Norm(model.module->parameters());

  StepOptions options;
  options.num_microbatches = 4;
  const MetricMap m = RunTrainStep(state, batch, model.apply, CrossEntropyLoss(), options);
  EXPECT_NEAR(m.at(kLoss), loss, 1e-6);
  EXPECT_NEAR(m.at(kAccuracy), accuracy, 1e-9);
  EXPECT_DOUBLE_EQ(m.at(kLearningRate), 0.1);
  // Both norms come from BlockedSgd's pass over the model: they match norms taken
  // in float64 afterwards (SGD leaves the gradients as they were).
  double grad_squares = 0, weight_squares = 0;
  for (const at::Tensor& p : model.module->parameters()) {
    grad_squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    weight_squares += p.detach().to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_GT(m.at(kGradientsL2Norm), 0);
  EXPECT_NEAR(m.at(kGradientsL2Norm), std::sqrt(grad_squares), 1e-6 * std::sqrt(grad_squares));
  EXPECT_NEAR(m.at(kWeightsL2Norm), std::sqrt(weight_squares), 1e-6 * std::sqrt(weight_squares));
  EXPECT_NE(m.at(kWeightsL2Norm), weights_before);
  EXPECT_EQ(m.count(kSecondsPerStep), 0u) << "timing is MetricsManager's";
  EXPECT_EQ(m.at(kNumExamples), 30);
}

TEST(TrainStepTest, ClipsTheGlobalGradientNorm) {
  const Batch batch = Batches(16, 1, /*weighted=*/false).front();
  OptimizerOptions sgd;
  sgd.kind = OptimizerOptions::Kind::kSgd;
  sgd.learning_rate = 1.0;
  sgd.momentum = 0.0;

  // Unclipped: the step moves the parameters by exactly lr * gradient.
  BuiltModel free_model = TinyModel(4);
  TrainState free_state = MakeTrainState(free_model.module, MakeOptimizerFactory(sgd));
  const std::vector<at::Tensor> before = Snapshot(*free_model.module);
  const MetricMap free = RunTrainStep(free_state, batch, free_model.apply, CrossEntropyLoss(), StepOptions{});
  std::vector<at::Tensor> update;
  const std::vector<at::Tensor> after = Snapshot(*free_model.module);
  for (size_t i = 0; i < before.size(); ++i) update.push_back(before[i] - after[i]);
  EXPECT_NEAR(GlobalL2Norm(update), free.at(kGradientsL2Norm), 1e-5);

  // Clipped to a tenth of that norm: the update shrinks to max_grad_norm, and the
  // metric still reports the norm before clipping.
  const double max_norm = free.at(kGradientsL2Norm) / 10;
  BuiltModel clipped_model = TinyModel(4);
  TrainState clipped_state = MakeTrainState(clipped_model.module, MakeOptimizerFactory(sgd));
  StepOptions options;
  options.max_grad_norm = max_norm;
  const MetricMap clipped = RunTrainStep(clipped_state, batch, clipped_model.apply, CrossEntropyLoss(), options);
  EXPECT_NEAR(clipped.at(kGradientsL2Norm), free.at(kGradientsL2Norm), 1e-6);
  std::vector<at::Tensor> clipped_update;
  const std::vector<at::Tensor> clipped_after = Snapshot(*clipped_model.module);
  for (size_t i = 0; i < before.size(); ++i) clipped_update.push_back(before[i] - clipped_after[i]);
  EXPECT_NEAR(GlobalL2Norm(clipped_update), max_norm, 1e-4 * max_norm);
  // Direction unchanged.
  for (size_t i = 0; i < update.size(); ++i) {
    EXPECT_TRUE(at::allclose(clipped_update[i] * 10, update[i], 1e-3, 1e-6));
  }

  // A bound above the norm leaves the update alone.
  BuiltModel loose_model = TinyModel(4);
  TrainState loose_state = MakeTrainState(loose_model.module, MakeOptimizerFactory(sgd));
  options.max_grad_norm = free.at(kGradientsL2Norm) * 2;
  RunTrainStep(loose_state, batch, loose_model.apply, CrossEntropyLoss(), options);
  EXPECT_LE(MaxRelativeDifference(Snapshot(*loose_model.module), after), 1e-7);
}

TEST(TrainStepTest, AppliesTheScheduleToEveryParameterGroup) {
  BuiltModel model = TinyModel(5);
  TrainState state = MakeTrainState(model.module, Factory(Opt::kAdam));
  StepOptions options;
  LrSchedule schedule;
  schedule.peak = 0.5;
  schedule.warmup_steps = 4;
  options.schedule = schedule;
  const Batch batch = Batches(8, 1, false).front();
  const MetricMap first = RunTrainStep(state, batch, model.apply, CrossEntropyLoss(), options);
  EXPECT_DOUBLE_EQ(first.at(kLearningRate), 0.5 * 1 / 4);
  const MetricMap second = RunTrainStep(state, batch, model.apply, CrossEntropyLoss(), options);
  EXPECT_DOUBLE_EQ(second.at(kLearningRate), 0.5 * 2 / 4);
  for (auto& group : state.optimizer->param_groups()) EXPECT_DOUBLE_EQ(group.options().get_lr(), 0.25);
}

TEST(TrainStepTest, RejectsBadInput) {
  BuiltModel model = TinyModel(6);
  TrainState state = MakeTrainState(model.module, Factory(Opt::kSgd));
  Batch batch = Batches(8, 1, false).front();
  StepOptions zero;
  zero.num_microbatches = 0;
  EXPECT_THROW(RunTrainStep(state, batch, model.apply, CrossEntropyLoss(), zero), InvalidArgumentError);
  // A loss that reduces to a scalar instead of one value per example.
  const LossFn mean_loss = [](const at::Tensor& o, const at::Tensor& t) { return at::cross_entropy_loss(o, t); };
  EXPECT_THAT([&] { RunTrainStep(state, batch, model.apply, mean_loss, StepOptions{}); },
              ::testing::ThrowsMessage<InvalidArgumentError>(::testing::HasSubstr("one value per example")));
  EXPECT_EQ(state.step, 0) << "a failed step must not count";
  Batch empty{batch.inputs.narrow(0, 0, 0), batch.targets.narrow(0, 0, 0), at::Tensor()};
  EXPECT_THROW(RunTrainStep(state, empty, model.apply, CrossEntropyLoss(), StepOptions{}), InvalidArgumentError);
}

TEST(LrScheduleTest, ConstantAndWarmup) {
  LrSchedule s;
  s.peak = 2.0;
  EXPECT_DOUBLE_EQ(s(0), 2.0);
  EXPECT_DOUBLE_EQ(s(1000), 2.0);
  s.warmup_steps = 10;
  EXPECT_DOUBLE_EQ(s(0), 0.2);
  EXPECT_DOUBLE_EQ(s(4), 1.0);
  EXPECT_DOUBLE_EQ(s(9), 2.0);
  EXPECT_DOUBLE_EQ(s(10), 2.0);
}

TEST(LrScheduleTest, CosineDecaysToTheFinalFraction) {
  LrSchedule s;
  s.peak = 1.0;
  s.decay = LrSchedule::Decay::kCosine;
  s.warmup_steps = 10;
  s.decay_steps = 100;
  s.final_fraction = 0.1;
  EXPECT_DOUBLE_EQ(s(10), 1.0);
  EXPECT_NEAR(s(60), 0.1 + 0.9 * 0.5, 1e-12);  // halfway
  EXPECT_NEAR(s(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI / 4)), 1e-12);
  EXPECT_NEAR(s(110), 0.1, 1e-12);
  EXPECT_NEAR(s(5000), 0.1, 1e-12);
  for (int64_t step = 10; step < 110; ++step) EXPECT_GE(s(step), s(step + 1));
}

TEST(LrScheduleTest, RsqrtDecay) {
  LrSchedule s;
  s.peak = 1.0;
  s.decay = LrSchedule::Decay::kRsqrt;
  s.warmup_steps = 100;
  EXPECT_DOUBLE_EQ(s(49), 0.5);  // still warming up
  EXPECT_DOUBLE_EQ(s(99), 1.0);
  EXPECT_DOUBLE_EQ(s(399), 0.5);  // sqrt(100 / 400)
  EXPECT_DOUBLE_EQ(s(9999), 0.1);
}

TEST(LrScheduleTest, RejectsBadFields) {
  LrSchedule s;
  s.decay = LrSchedule::Decay::kCosine;
  EXPECT_THAT([&] { s.Validate(); }, ::testing::ThrowsMessage<InvalidArgumentError>(::testing::HasSubstr("decay_steps")));
  s.decay_steps = 10;
  s.final_fraction = 2;
  EXPECT_THAT([&] { s.Validate(); },
              ::testing::ThrowsMessage<InvalidArgumentError>(::testing::HasSubstr("final_fraction")));
  s.final_fraction = 0;
  s.peak = -1;
  EXPECT_THROW(s.Validate(), InvalidArgumentError);
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

TEST(TrainStepTest, PerParameterWeightMetrics) {
  BuiltModel model = TinyModel(8);
  TrainState state = MakeTrainState(model.module, Factory(Opt::kSgd));
  const std::vector<at::Tensor> before = Snapshot(*model.module);
  StepOptions options;
  options.weight_metrics = true;
  const MetricMap m = RunTrainStep(state, Batches(16, 1, false).front(), model.apply, CrossEntropyLoss(), options);
  const auto named = model.module->named_parameters();
  ASSERT_TRUE(named.contains("layers.1.weight"));
  const at::Tensor w = named["layers.1.weight"].detach();
  EXPECT_NEAR(m.at("weights/layers.1.weight/rms"), w.pow(2).mean().sqrt().item<double>(), 1e-7);
  EXPECT_NEAR(m.at("weights/layers.1.weight/max"), w.abs().max().item<double>(), 1e-7);
  EXPECT_NEAR(m.at("weights/layers.1.weight/update_ratio"),
              (w - before[0]).norm().item<double>() / before[0].norm().item<double>(), 1e-6);
  EXPECT_GT(m.at("weights/layers.1.weight/update_ratio"), 0);
  EXPECT_EQ(m.count("weights/layers.3.bias/rms"), 1u);
}

struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
  int64_t block;
  bool bitwise;  // dampening != 0 or no momentum: libtorch's own operations
};

class BlockedSgdTest : public ::testing::TestWithParam<SgdCase> {};

// Four steps on parameters of several shapes (one not contiguous, one smaller
// than a block, one not a multiple of it) with the same gradients: the weights
// and momentum buffers of BlockedSgd equal torch::optim::SGD's, bit for bit where
// the operations are libtorch's, within float rounding where the momentum update
// is fused.
TEST_P(BlockedSgdTest, MatchesLibtorchSgd) {
  const SgdCase c = GetParam();
  at::manual_seed(3);
  const std::vector<at::Tensor> initial = {at::randn({13, 17}), at::randn({5}), at::randn({6, 4}).t(), at::randn({300})};
  auto make = [&] {
    std::vector<at::Tensor> params;
    for (const at::Tensor& t : initial) params.push_back(t.clone(at::MemoryFormat::Preserve).requires_grad_());
    return params;
  };
  std::vector<at::Tensor> ours = make();
  std::vector<at::Tensor> theirs = make();
  ASSERT_FALSE(ours[2].is_contiguous());
  const auto options = torch::optim::SGDOptions(0.05)
                           .momentum(c.momentum)
                           .dampening(c.dampening)
                           .weight_decay(c.weight_decay)
                           .nesterov(c.nesterov);
  BlockedSgd blocked(ours, options, c.block);
  torch::optim::SGD reference(theirs, options);
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < ours.size(); ++i) {
      const at::Tensor grad = at::randn(initial[i].sizes());
      ours[i].mutable_grad() = grad.clone();
      theirs[i].mutable_grad() = grad.clone();
    }
    blocked.step();
    reference.step();
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    const auto check = [&](const at::Tensor& a, const at::Tensor& b) {
      if (c.bitwise) {
        EXPECT_TRUE(at::equal(a, b)) << (a - b).abs().max().item<double>();
      } else {
        EXPECT_TRUE(at::allclose(a, b, /*rtol=*/1e-6, /*atol=*/1e-6)) << (a - b).abs().max().item<double>();
      }
    };
    EXPECT_FALSE(at::equal(ours[i].detach(), initial[i]));
    check(ours[i].detach(), theirs[i].detach());
    if (c.momentum != 0) {
      const auto& a = static_cast<torch::optim::SGDParamState&>(*blocked.state().at(OptimizerStateKey(ours[i])));
      const auto& b = static_cast<torch::optim::SGDParamState&>(*reference.state().at(OptimizerStateKey(theirs[i])));
      check(a.momentum_buffer(), b.momentum_buffer());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Options, BlockedSgdTest,
                         ::testing::Values(SgdCase{0.9, 0.1, 0.01, false, 7, true},
                                           SgdCase{0.9, 0.1, 0.0, false, BlockedSgd::kDefaultBlockElements, true},
                                           SgdCase{0.0, 0.0, 0.01, false, 7, false},
                                           SgdCase{0.0, 0.0, 0.0, false, 7, false},
                                           SgdCase{0.9, 0.0, 0.0, false, 7, false},
                                           SgdCase{0.9, 0.0, 0.01, true, 64, false},
                                           SgdCase{0.9, 0.0, 0.0, true, 64, false}));

// The one-pass kernel's sums of squares: the gradients it read and the weights it
// left, against float64 sums; `complete` only when every parameter went through it.
TEST(BlockedSgdTest, ReportsTheSquaresOfGradientsAndNewWeights) {
  at::manual_seed(5);
  // 5000 elements: several 1024-element blocks and a ragged tail.
  std::vector<at::Tensor> params = {at::randn({50, 100}).requires_grad_(), at::randn({3}).requires_grad_(),
                                    at::randn({4}).requires_grad_()};
  for (const at::Tensor& p : params) p.mutable_grad() = at::randn(p.sizes());
  params[2].mutable_grad() = at::Tensor();  // no gradient: not updated, not counted
  BlockedSgd sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  for (int step = 0; step < 2; ++step) {
    sgd.step();
    double grads = 0, weights = 0;
    for (size_t i = 0; i < 2; ++i) {
      grads += params[i].grad().to(at::kDouble).pow(2).sum().item<double>();
      weights += params[i].detach().to(at::kDouble).pow(2).sum().item<double>();
    }
    const BlockedSgd::Squares& s = sgd.last_step_squares();
    EXPECT_TRUE(s.complete);
    EXPECT_EQ(s.tensors, 2);
    EXPECT_EQ(s.elements, 5003);
    EXPECT_NEAR(s.gradients, grads, 1e-6 * grads);
    EXPECT_NEAR(s.weights, weights, 1e-6 * weights);
  }

  // A non-contiguous parameter goes through libtorch's operations.
  std::vector<at::Tensor> strided = {at::randn({6, 4}).t().requires_grad_(), at::randn({5}).requires_grad_()};
  for (const at::Tensor& p : strided) p.mutable_grad() = at::randn(p.sizes());
  BlockedSgd mixed(strided, torch::optim::SGDOptions(0.1).momentum(0.9));
  mixed.step();
  EXPECT_FALSE(mixed.last_step_squares().complete);
  EXPECT_EQ(mixed.last_step_squares().tensors, 2);

  // So does every parameter when dampening is not 0.
  BlockedSgd damped(params, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.5));
  damped.step();
  EXPECT_FALSE(damped.last_step_squares().complete);
}

TEST(BlockedSgdTest, FactoryMakesItAndRejectsABadBlock) {
  OptimizerOptions o;
  o.kind = OptimizerOptions::Kind::kSgd;
  std::vector<at::Tensor> params = {at::zeros({3}).requires_grad_()};
  EXPECT_NE(dynamic_cast<BlockedSgd*>(MakeOptimizerFactory(o)(params).get()), nullptr);
  EXPECT_THROW(BlockedSgd(params, torch::optim::SGDOptions(0.1), 0), InvalidArgumentError);
}

}  // namespace
}  // namespace lockstep
