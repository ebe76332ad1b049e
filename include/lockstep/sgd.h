// BlockedSgd: torch::optim::SGD with a step that moves less memory.
//
// It is a torch::optim::SGD: the same SGDOptions, the same per-parameter
// SGDParamState (momentum_buffer) under the same keys, so checkpoints, param
// groups and learning-rate changes work as with libtorch's. Only step() differs:
//
// - Each parameter is updated in blocks of `block_elements` consecutive elements.
//   A block's gradient, momentum buffer and weights stay in the core's cache
//   from the momentum update to the weight update, so main memory sees each array
//   once per step: read gradient, momentum and weights, write momentum and weights
//   (libtorch's step makes three passes, eight array transfers).
// - With dampening 0 the momentum update buf = momentum * buf + grad is one
//   multiply-add (at::add_out), which rounds once where libtorch's
//   buf.mul_(momentum).add_(grad) rounds twice: results agree with
//   torch::optim::SGD to the last bit or two of each element. With dampening != 0
//   the operations are libtorch's and the results are bitwise equal.
//
// On the 25M-parameter wide MLP of benchmarks/scaleout.sh with momentum, one
// core: the optimizer step of its breakdown took 60 ms with torch::optim::SGD and
// 32 ms with this (50 and 36 ms in a loop over the same tensors alone).
// Non-contiguous tensors are updated whole, as libtorch does.
#ifndef LOCKSTEP_SGD_H_
#define LOCKSTEP_SGD_H_

#include <torch/optim/sgd.h>

#include <cstdint>
#include <vector>

namespace lockstep {

class BlockedSgd : public torch::optim::SGD {
 public:
  // 64 Ki elements: three float32 blocks take 768 KiB, inside a server core's L2.
  static constexpr int64_t kDefaultBlockElements = int64_t{1} << 16;

  // Throws InvalidArgumentError when block_elements < 1; libtorch's checks of the
  // options (c10::Error) as torch::optim::SGD.
  BlockedSgd(std::vector<torch::Tensor> params, torch::optim::SGDOptions options,
             int64_t block_elements = kDefaultBlockElements);

  torch::Tensor step(LossClosure closure = nullptr) override;

 private:
  int64_t block_elements_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_SGD_H_
