// What replicated and sharded data parallelism share in a backward pass (internal
// to src/partitioning): parameters' gradients that live in flat communication
// buffers, and the start of each group's reduction as soon as its gradients are
// final, groups in index order on every rank.
#ifndef LOCKSTEP_SRC_PARTITIONING_GRADIENT_READINESS_H_
#define LOCKSTEP_SRC_PARTITIONING_GRADIENT_READINESS_H_

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace lockstep::internal {

// A plain tensor of `sizes` (contiguous) on `flat`'s storage from element
// `offset` of `flat`: not an autograd view, so that optimizers may detach_() and
// zero_() it as they do any gradient.
at::Tensor PlainView(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes);

// Whether `param`'s .grad is `view` (the same memory and shape).
bool GradIs(const at::Tensor& param, const at::Tensor& view);

// Makes `param`'s .grad `view`, keeping the gradient's value (zero when it has
// none). Only copies when something replaced it: a zero_grad that sets gradients
// to none, a hook, or the first backward.
void PointGradAt(at::Tensor& param, const at::Tensor& view);

// Copies `param`'s gradient into `view` unless it already is `view` (zero when
// it has none): a gradient replaced since Arm still counts.
void CopyGradInto(const at::Tensor& param, const at::Tensor& view);

// Autograd post hooks on each trainable parameter's gradient accumulator. Once
// armed for a backward pass, the group of each parameter whose gradient became
// final loses one pending gradient; `launch(g)` is called for every group whose
// gradients are all final and whose predecessors have been launched, so groups
// start in index order whatever order the hooks fire in (the SPMD rule). Not
// thread-safe: autograd runs CPU hooks on the training thread.
class GradientReadiness {
 public:
  // `observe(p)`, when set, is told of every parameter whose gradient became
  // final in an armed pass, in that order (after `launch` may have run).
  GradientReadiness(const std::vector<at::Tensor>& parameters, std::function<void(size_t group)> launch,
                    std::function<void(size_t parameter)> observe = {});
  ~GradientReadiness();  // removes the hooks
  GradientReadiness(const GradientReadiness&) = delete;
  GradientReadiness& operator=(const GradientReadiness&) = delete;

  // Group g holds groups[g] (parameter indices); each parameter in one group.
  void SetGroups(const std::vector<std::vector<size_t>>& groups);
  // Counts each group's trainable parameters and launches the groups that have
  // none; the next backward pass launches the rest as they become final.
  void Arm();
  // Disarms and launches every group not launched yet, in order.
  void LaunchRest();
  bool armed() const;
  // Groups launched between Arm and LaunchRest (from hooks, or having nothing to wait for).
  int launched_during_backward() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace lockstep::internal

#endif  // LOCKSTEP_SRC_PARTITIONING_GRADIENT_READINESS_H_
