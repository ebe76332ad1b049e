// y = x W^T + b (as at::linear) with its own backward; on CPU float32 the three
// products (forward, input gradient, weight gradient) run on oneDNN's GEMM, whose
// run-time generated kernels use the CPU's widest vector instructions, where
// libtorch would call the system BLAS (lockstep/cpu_gemm.h says why that
// matters). Other devices and dtypes, and builds without oneDNN, call at::linear.
//
//   input [..., in], weight [out, in], bias [out] or undefined -> [..., out]
//
// Throws InvalidArgumentError for shapes that do not fit.
#ifndef LOCKSTEP_LINEAR_H_
#define LOCKSTEP_LINEAR_H_

#include <ATen/core/Tensor.h>

namespace lockstep {

at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

// Whether Linear takes the oneDNN path for these tensors.
bool FusedLinearApplies(const at::Tensor& input, const at::Tensor& weight);

}  // namespace lockstep

#endif  // LOCKSTEP_LINEAR_H_
