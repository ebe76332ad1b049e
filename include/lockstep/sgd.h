// BlockedSgd: torch::optim::SGD with a step that moves less memory.
//
// It is a torch::optim::SGD: the same SGDOptions, the same per-parameter
// SGDParamState (momentum_buffer) under the same keys, so checkpoints, param
// groups and learning-rate changes work as with libtorch's. Only step() differs:
//
// - A contiguous float32 parameter (with dampening 0, or without momentum) is
//   updated in one pass (src/trainer/sgd_kernel.h): main memory sees each array
//   once per step, reading gradient, momentum and weights and writing momentum
//   and weights (libtorch's step makes three passes, eight array transfers), and
//   every multiply-add rounds once where libtorch's buf.mul_(momentum).add_(grad)
//   rounds twice, so results agree with torch::optim::SGD to the last bit or two
//   of each element. The same pass sums the squares of the gradients and of the
//   new weights: last_step_squares() gives the norms that a train step reports,
//   without two more passes over the model.
// - Other contiguous parameters are updated in blocks of `block_elements`
//   elements that stay in cache between libtorch's operations; with dampening != 0
//   those operations are libtorch's and the results are bitwise equal.
//   Non-contiguous tensors are updated whole, as libtorch does.
//
// Both paths cut the main-memory traffic that bounds a large model's optimizer
// step; see benchmarks/README.md for measured times.
#ifndef LOCKSTEP_SGD_H_
#define LOCKSTEP_SGD_H_

#include <torch/optim/sgd.h>

#include <cstdint>
#include <vector>

#include "lockstep/train_state.h"

namespace lockstep {

class BlockedSgd : public torch::optim::SGD, public ReportsStepSquares {
 public:
  // 64 Ki elements: three float32 blocks take 768 KiB, inside a server core's L2.
  static constexpr int64_t kDefaultBlockElements = int64_t{1} << 16;

  // Throws InvalidArgumentError when block_elements < 1; libtorch's checks of the
  // options (c10::Error) as torch::optim::SGD.
  BlockedSgd(std::vector<torch::Tensor> params, torch::optim::SGDOptions options,
             int64_t block_elements = kDefaultBlockElements);

  torch::Tensor step(LossClosure closure = nullptr) override;

  // The sums of squares of the gradients it applied and of the weights it left
  // (ReportsStepSquares); `complete` is false when some parameters were not
  // updated by the one-pass kernel (not float32, not contiguous, dampening != 0).
  const Squares& last_step_squares() const override { return last_step_squares_; }

 private:
  int64_t block_elements_;
  Squares last_step_squares_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_SGD_H_
