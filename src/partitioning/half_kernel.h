// The 16-bit conversions behind HalfPrecisionHook (lockstep/comm_hooks.h): float32
// gradients rounded to bfloat16 or IEEE half before they travel, and the 16-bit
// values of every rank widened and summed into float32 after. Plain C++ (no
// libtorch), so that the compiler vectorises it; on one core it takes about half
// the time of libtorch's cast and mixed-dtype add_ (benchmarks/cpu_kernels_benchmark.cc
// times both).
#ifndef LOCKSTEP_SRC_PARTITIONING_HALF_KERNEL_H_
#define LOCKSTEP_SRC_PARTITIONING_HALF_KERNEL_H_

#include <cstdint>

namespace lockstep::internal {

enum class HalfFormat { kBFloat16, kHalf };

// bfloat16 always; IEEE half on x86-64 with F16C (vcvtps2ph / vcvtph2ps). Where
// this is false the caller converts with libtorch instead.
bool HaveHalfKernel(HalfFormat format);

// dst[i] = src[i] rounded to the nearest 16-bit value, ties to even: the bits
// at::Tensor::to(kBFloat16 / kHalf) gives. Half overflows to infinity and keeps
// subnormals; every NaN stays a quiet NaN (bfloat16: 0x7FC0, as libtorch writes it).
void RoundToHalf(HalfFormat format, const float* src, uint16_t* dst, int64_t n);

// out[i] = parts[0][i] + parts[1][i] + ... + parts[count - 1][i], each part widened
// to float32 exactly and added in that order in float32, so every rank that sums
// the same parts gets the same bits. count >= 1; out may not overlap the parts.
// Both need HaveHalfKernel(format).
void SumHalves(HalfFormat format, const uint16_t* const* parts, int count, float* out, int64_t n);

}  // namespace lockstep::internal

#endif  // LOCKSTEP_SRC_PARTITIONING_HALF_KERNEL_H_
