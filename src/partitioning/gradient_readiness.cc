#include "gradient_readiness.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace lockstep::internal {

at::Tensor PlainView(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor view = at::empty({0}, flat.options());
  view.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return view;
}

bool GradIs(const at::Tensor& param, const at::Tensor& view) {
  const at::Tensor& grad = param.grad();
  return grad.defined() && view.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes();
}

void CopyGradInto(const at::Tensor& param, const at::Tensor& view) {
  if (GradIs(param, view)) return;
  at::NoGradGuard no_grad;
  const at::Tensor& grad = param.grad();
  if (grad.defined()) {
    view.copy_(grad);
  } else {
    view.zero_();  // no gradient counts as zero
  }
}

void PointGradAt(at::Tensor& param, const at::Tensor& view) {
  if (GradIs(param, view)) return;
  CopyGradInto(param, view);
  param.mutable_grad() = view;
}

struct GradientReadiness::State {
  std::vector<bool> trainable;
  std::function<void(size_t)> launch;
  std::function<void(size_t)> observe;
  std::vector<size_t> group_of;
  std::vector<std::vector<size_t>> groups;
  std::vector<int> pending;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks;
  bool armed = false;
  size_t next = 0;
  int launched_during_backward = 0;

  void LaunchReady() {
    while (next < groups.size() && pending[next] == 0) {
      launch(next++);
      ++launched_during_backward;
    }
  }

  void OnGradientFinal(size_t p) {
    if (!armed) return;
    if (--pending[group_of[p]] == 0) LaunchReady();
    if (observe) observe(p);
  }
};

GradientReadiness::GradientReadiness(const std::vector<at::Tensor>& parameters, std::function<void(size_t)> launch,
                                     std::function<void(size_t)> observe)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.launch = std::move(launch);
  s.observe = std::move(observe);
  s.group_of.assign(parameters.size(), 0);
  // A post hook on a gradient accumulator runs once this pass's gradient has
  // been added to .grad.
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < parameters.size(); ++i) {
    s.trainable.push_back(parameters[i].requires_grad());
    if (!parameters[i].requires_grad()) continue;
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(parameters[i]);
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto state = weak.lock()) state->OnGradientFinal(i);
          return outputs;
        }));
    s.hooks.emplace_back(std::move(accumulator), key);
  }
}

GradientReadiness::~GradientReadiness() {
  for (auto& [node, key] : state_->hooks) node->del_post_hook(key);
}

void GradientReadiness::SetGroups(const std::vector<std::vector<size_t>>& groups) {
  State& s = *state_;
  s.groups = groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t p : groups[g]) s.group_of.at(p) = g;
  }
  s.pending.assign(groups.size(), 0);
}

void GradientReadiness::Arm() {
  State& s = *state_;
  for (size_t g = 0; g < s.groups.size(); ++g) {
    s.pending[g] = 0;
    for (size_t p : s.groups[g]) s.pending[g] += s.trainable[p] ? 1 : 0;
  }
  s.next = 0;
  s.launched_during_backward = 0;
  s.armed = true;
  s.LaunchReady();  // groups without trainable parameters
}

void GradientReadiness::LaunchRest() {
  State& s = *state_;
  s.armed = false;
  while (s.next < s.groups.size()) s.launch(s.next++);
}

bool GradientReadiness::armed() const { return state_->armed; }
int GradientReadiness::launched_during_backward() const { return state_->launched_during_backward; }

}  // namespace lockstep::internal
