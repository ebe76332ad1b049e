// The GPT model (include/lockstep/gpt.h): shapes, causality, its parameter count
// and FLOPs, bad sizes refused, and parity with an independent PyTorch model of
// the same description (tests/system/gpt_reference.py), the llm.c way: the same
// initial weights (written here, loaded there) and the same batches give the same
// losses for 10 AdamW steps within 1e-4, through Lockstep's train step.
#include "lockstep/gpt.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "lockstep/attention.h"
#include "lockstep/errors.h"
#include "lockstep/linear.h"
#include "lockstep/metrics.h"
#include "lockstep/train_state.h"
#include "tests/testing/temp_dir.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;

GptOptions Small() {
  GptOptions o;
  o.vocab_size = 256;
  o.context_length = 16;
  o.num_layers = 2;
  o.num_heads = 2;
  o.width = 32;
  return o;
}

TEST(GptTest, LogitsHaveTheRightShapeAndTheParametersTheCountedNumber) {
  at::manual_seed(0);
  Gpt model(Small());
  const at::Tensor tokens = at::randint(256, {3, 10}, at::kLong);
  const at::Tensor logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 10, 256}));
  int64_t count = 0;
  for (const at::Tensor& p : model->parameters()) count += p.numel();
  EXPECT_EQ(static_cast<double>(count), CountGptParameters(Small()));
  // 6 N + 12 L W T, N without the position table.
  const double n = static_cast<double>(count - 16 * 32);
  EXPECT_DOUBLE_EQ(GptTrainingFlopsPerToken(Small(), 16), 6 * n + 12.0 * 2 * 32 * 16);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ::testing::Contains("blocks.1.attn_proj.weight"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains(HasSubstr("head"))));  // tied to wte
}

TEST(GptTest, APositionSeesNoLaterToken) {
  at::manual_seed(1);
  Gpt model(Small());
  at::Tensor tokens = at::randint(256, {2, 12}, at::kLong);
  const at::Tensor before = model->forward(tokens);
  tokens.index_put_({at::indexing::Slice(), 7}, (tokens.select(1, 7) + 1) % 256);
  const at::Tensor after = model->forward(tokens);
  EXPECT_TRUE(at::equal(before.narrow(1, 0, 7), after.narrow(1, 0, 7)));
  EXPECT_FALSE(at::allclose(before.narrow(1, 7, 5), after.narrow(1, 7, 5)));
}

TEST(GptTest, BadSizesAndInputsAreRefusedByName) {
  GptOptions o = Small();
  o.num_heads = 3;
  EXPECT_THAT([&] { Gpt m(o); }, ::testing::ThrowsMessage<InvalidArgumentError>(
                                     HasSubstr("num_heads (3) must divide width (32)")));
  o = Small();
  o.dropout = 1.0;
  EXPECT_THAT([&] { CheckGptOptions(o); }, ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("dropout")));
  o = Small();
  o.context_length = 0;
  EXPECT_THAT([&] { CheckGptOptions(o); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("context_length must be > 0")));
  Gpt model(Small());
  EXPECT_THAT([&] { model->forward(at::zeros({1, 17}, at::kLong)); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("longer than the model's context_length (16)")));
  EXPECT_THAT([&] { model->forward(at::zeros({1, 4}, at::kFloat)); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("int64 [batch, length]")));
  EXPECT_THAT([&] { LanguageModelLoss()(at::zeros({2, 4, 8}), at::zeros({2, 5}, at::kLong)); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("do not match")));
}

TEST(GptTest, LanguageModelLossIsEachExamplesMeanTokenCrossEntropy) {
  at::manual_seed(2);
  const at::Tensor logits = at::randn({3, 5, 11});
  const at::Tensor targets = at::randint(11, {3, 5}, at::kLong);
  const at::Tensor loss = LanguageModelLoss()(logits, targets);
  ASSERT_EQ(loss.sizes(), (std::vector<int64_t>{3}));
  for (int64_t b = 0; b < 3; ++b) {
    const double expected = at::cross_entropy_loss(logits[b], targets[b]).item<double>();
    EXPECT_NEAR(loss[b].item<double>(), expected, 1e-6);
  }
}

// The fused attention against the same maths in ATen ops, values and gradients,
// on sizes that are not powers of two (7 tokens, 3 heads of 5).
TEST(GptTest, FusedAttentionMatchesTheCompositeAndItsGradient) {
  if (!FusedCausalSelfAttentionApplies(at::zeros({1, 1, 3}))) {
    GTEST_SKIP() << "built without oneDNN (LOCKSTEP_WITH_DNNL=OFF): the fused path is not built";
  }
  at::manual_seed(3);
  const at::Tensor input = at::randn({4, 7, 45});
  const at::Tensor fused_in = input.clone().requires_grad_(true);
  const at::Tensor composite_in = input.clone().requires_grad_(true);
  const at::Tensor fused = CausalSelfAttention(fused_in, 3);
  const at::Tensor composite = CausalSelfAttentionComposite(composite_in, 3);
  ASSERT_EQ(fused.sizes(), (std::vector<int64_t>{4, 7, 15}));
  EXPECT_LT((fused - composite).abs().max().item<double>(), 1e-6);
  const at::Tensor upstream = at::randn({4, 7, 15});
  (fused * upstream).sum().backward();
  (composite * upstream).sum().backward();
  EXPECT_LT((fused_in.grad() - composite_in.grad()).abs().max().item<double>(), 1e-6);
  // Causal: the first position's output is its own value, whatever follows.
  EXPECT_TRUE(at::allclose(fused.select(1, 0), input.select(1, 0).narrow(1, 30, 15)));
  // A non-contiguous input (a transposed view) gives the same.
  const at::Tensor strided = input.transpose(0, 1).contiguous().transpose(0, 1);
  ASSERT_FALSE(strided.is_contiguous());
  EXPECT_TRUE(at::allclose(CausalSelfAttention(strided, 3), fused.detach()));
  EXPECT_THAT([&] { CausalSelfAttention(at::zeros({2, 3, 45}), 2); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("2 heads do not divide the width 15")));
  EXPECT_THAT([&] { CausalSelfAttention(at::zeros({2, 44}), 2); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("[batch, length, 3 width]")));
}

// Linear (linear.h) against at::linear, values and every gradient, 3-D input,
// with and without a bias.
TEST(GptTest, LinearMatchesAtenLinearAndItsGradients) {
  if (!FusedLinearApplies(at::zeros({1}), at::zeros({1, 1}))) {
    GTEST_SKIP() << "built without oneDNN (LOCKSTEP_WITH_DNNL=OFF): Linear is at::linear";
  }
  at::manual_seed(4);
  for (const bool with_bias : {true, false}) {
    const at::Tensor x = at::randn({3, 5, 24}), w = at::randn({40, 24}), b = at::randn({40});
    std::vector<at::Tensor> ours = {x.clone().requires_grad_(true), w.clone().requires_grad_(true),
                                    b.clone().requires_grad_(true)};
    std::vector<at::Tensor> theirs = {x.clone().requires_grad_(true), w.clone().requires_grad_(true),
                                      b.clone().requires_grad_(true)};
    const at::Tensor y = Linear(ours[0], ours[1], with_bias ? ours[2] : at::Tensor());
    const at::Tensor expected = at::linear(theirs[0], theirs[1], with_bias ? theirs[2] : at::Tensor());
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 40}));
    EXPECT_LT((y - expected).abs().max().item<double>(), 1e-4) << "bias " << with_bias;
    const at::Tensor upstream = at::randn({3, 5, 40});
    (y * upstream).sum().backward();
    (expected * upstream).sum().backward();
    for (int i = 0; i < (with_bias ? 3 : 2); ++i) {
      EXPECT_LT((ours[i].grad() - theirs[i].grad()).abs().max().item<double>(), 1e-4) << "input " << i;
    }
    if (!with_bias) {
      EXPECT_FALSE(ours[2].grad().defined());
    }
  }
  EXPECT_THAT([&] { Linear(at::zeros({2, 7}), at::zeros({4, 8})); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("do not fit")));
  EXPECT_THAT([&] { Linear(at::zeros({2, 8}), at::zeros({4, 8}), at::zeros({3})); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("bias [3]")));
}

c10::impl::GenericDict ReadTorchSave(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) throw std::runtime_error("cannot read " + path);
  return torch::jit::pickle_load(bytes).toGenericDict();
}

TEST(GptTest, TrainsAsPyTorchDoesFromTheSameWeightsAndBatches) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (python3-torch): no reference to compare with";
  }
  constexpr int kSteps = 10;
  const GptOptions o = Small();
  at::manual_seed(3);
  auto model = std::make_shared<GptImpl>(o);
  OptimizerOptions adamw;
  adamw.kind = OptimizerOptions::Kind::kAdamW;
  adamw.learning_rate = 3e-3;
  adamw.weight_decay = 0.1;
  adamw.beta2 = 0.99;
  TrainState state = MakeTrainState(model, MakeOptimizerFactory(adamw));

  // Batches: windows of a fixed byte string, as the token pipeline cuts them.
  std::string text;
  for (int i = 0; i < 40; ++i) text += "In the beginning God created the heaven and the earth. ";
  const at::Tensor bytes = at::from_blob(text.data(), {static_cast<int64_t>(text.size())}, at::kByte).to(at::kLong);
  c10::impl::GenericDict saved{c10::StringType::get(), c10::AnyType::get()};
  std::vector<Batch> batches;
  for (int s = 0; s < kSteps; ++s) {
    const at::Tensor starts = at::randint(bytes.numel() - o.context_length - 1, {4}, at::kLong);
    std::vector<at::Tensor> windows;
    for (int64_t b = 0; b < 4; ++b) windows.push_back(bytes.narrow(0, starts[b].item<int64_t>(), o.context_length + 1));
    const at::Tensor w = at::stack(windows);
    batches.push_back(Batch{w.narrow(1, 0, o.context_length).contiguous(), w.narrow(1, 1, o.context_length).contiguous(), {}});
    saved.insert("inputs/" + std::to_string(s), batches.back().inputs);
    saved.insert("targets/" + std::to_string(s), batches.back().targets);
  }
  for (const auto& item : model->named_parameters()) saved.insert("model/" + item.key(), item.value().detach().clone());
  saved.insert("config/vocab_size", at::scalar_tensor(o.vocab_size, at::kLong));
  saved.insert("config/context_length", at::scalar_tensor(o.context_length, at::kLong));
  saved.insert("config/num_layers", at::scalar_tensor(o.num_layers, at::kLong));
  saved.insert("config/num_heads", at::scalar_tensor(o.num_heads, at::kLong));
  saved.insert("config/width", at::scalar_tensor(o.width, at::kLong));
  saved.insert("adamw/lr", at::scalar_tensor(adamw.learning_rate, at::kDouble));
  saved.insert("adamw/beta1", at::scalar_tensor(adamw.beta1, at::kDouble));
  saved.insert("adamw/beta2", at::scalar_tensor(adamw.beta2, at::kDouble));
  saved.insert("adamw/eps", at::scalar_tensor(adamw.epsilon, at::kDouble));
  saved.insert("adamw/weight_decay", at::scalar_tensor(adamw.weight_decay, at::kDouble));
  testing::TempDir dir;
  const std::string in_path = dir.path() + "/gpt_in.pt", out_path = dir.path() + "/gpt_out.pt";
  {
    const std::vector<char> data = torch::jit::pickle_save(c10::IValue(saved));
    std::ofstream out(in_path, std::ios::binary);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    ASSERT_TRUE(out.good());
  }
  const std::string command = std::string("/usr/bin/python3 ") + LOCKSTEP_SOURCE_DIR +
                              "/tests/system/gpt_reference.py parity " + in_path + " " + out_path;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const c10::impl::GenericDict theirs = ReadTorchSave(out_path);
  const at::Tensor their_losses = theirs.at("losses").toTensor();
  ASSERT_EQ(their_losses.numel(), kSteps);

  StepOptions step;
  std::vector<double> ours;
  for (const Batch& b : batches) ours.push_back(RunTrainStep(state, b, ForwardOf<GptImpl>(), LanguageModelLoss(), step).at(kLoss));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(ours[s], their_losses[s].item<double>(), 1e-4) << "step " << s;
  }
  // Not vacuous: the model learned in those 10 steps.
  EXPECT_LT(ours.back(), ours.front() - 0.5);
  for (const auto& item : model->named_parameters()) {
    const at::Tensor their = theirs.at("final/" + item.key()).toTensor();
    EXPECT_LE((item.value() - their).abs().max().item<double>(), 1e-4) << item.key();
  }
}

}  // namespace
}  // namespace lockstep
