// Fixtures for unit tests: a small, deterministic classification problem and
// helpers to compare parameters. Header-only; tests include it.
#ifndef LOCKSTEP_TESTS_TESTING_TINY_PROBLEM_H_
#define LOCKSTEP_TESTS_TESTING_TINY_PROBLEM_H_

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "lockstep/data.h"
#include "lockstep/models.h"
#include "lockstep/train_state.h"

namespace lockstep::testing {

// 8x8 single-channel images, 4 classes, learnable labels.
inline std::shared_ptr<const TensorDataset> TinyDataset(int64_t n, uint64_t seed = 7) {
  SyntheticOptions o;
  o.num_examples = n;
  o.height = 8;
  o.width = 8;
  o.num_classes = 4;
  o.seed = seed;
  o.teacher_seed = 1;
  return std::make_shared<const TensorDataset>(MakeSyntheticDataset(o));
}

inline ModelOptions TinyModelOptions(const std::string& name = "mlp") {
  ModelOptions o;
  o.name = name;
  o.height = 8;
  o.width = 8;
  o.hidden_units = 16;
  o.num_classes = 4;
  return o;
}

// A fresh model whose parameters depend only on `seed`.
inline BuiltModel TinyModel(uint64_t seed, const std::string& name = "mlp") {
  at::manual_seed(seed);
  return BuildModel(TinyModelOptions(name));
}

// ||a - b|| / ||b|| for each parameter pair; the largest.
inline double MaxRelativeDifference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double diff = (a[i] - b[i]).norm().item<double>();
    const double ref = b[i].norm().item<double>();
    worst = std::max(worst, ref > 0 ? diff / ref : diff);
  }
  return worst;
}

inline std::vector<at::Tensor> Snapshot(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : module.parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace lockstep::testing

#endif  // LOCKSTEP_TESTS_TESTING_TINY_PROBLEM_H_
