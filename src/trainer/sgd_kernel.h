// The fused float32 SGD update behind BlockedSgd (lockstep/sgd.h): one pass over
// a parameter's weights, gradient and momentum buffer that also sums the squares
// of the gradient and of the new weights. Plain C++ (no libtorch), so that it
// compiles in a moment and the compiler vectorises it.
#ifndef LOCKSTEP_SRC_TRAINER_SGD_KERNEL_H_
#define LOCKSTEP_SRC_TRAINER_SGD_KERNEL_H_

#include <cstdint>

namespace lockstep::internal {

struct SgdKernelArgs {
  float* weights = nullptr;
  const float* gradient = nullptr;
  float* momentum_buffer = nullptr;  // null when momentum is 0
  int64_t size = 0;
  float learning_rate = 0;
  float momentum = 0;
  float weight_decay = 0;
  bool nesterov = false;
  bool first = false;  // the momentum buffer is new: it takes the (decayed) gradient
};

struct SgdKernelSquares {
  double gradient = 0;  // sum of gradient[i]^2, as read
  double weights = 0;   // sum of weights[i]^2, after the update
};

// Per element, with every multiply-add rounded once (std::fma):
//   d = gradient + weight_decay * weights
//   buf = first ? d : momentum * buf + d             (when momentum != 0)
//   u = nesterov ? d + momentum * buf : buf          (d when momentum == 0)
//   weights = weights - learning_rate * u
// The results do not depend on the CPU's vector width (the AVX2 build and the
// portable one give the same bits); the two sums of squares may differ in the last
// bits, as they are added lane by lane (in float within 1024-element blocks, in
// double across blocks). Arrays must not overlap.
SgdKernelSquares FusedSgdUpdate(const SgdKernelArgs& args);

}  // namespace lockstep::internal

#endif  // LOCKSTEP_SRC_TRAINER_SGD_KERNEL_H_
