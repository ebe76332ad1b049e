#include "sgd_kernel.h"

#include <algorithm>
#include <cmath>

namespace lockstep::internal {
namespace {

constexpr int kLanes = 16;             // independent partial sums: the loop vectorises
constexpr int64_t kBlock = 1024;       // elements summed in float before the double total

template <bool kMomentum, bool kFirst, bool kNesterov, bool kDecay>
[[gnu::always_inline]] inline void Element(float* __restrict w, const float* __restrict g, float* __restrict buf,
                                           int64_t i, float lr, float mu, float wd, float& g_sq, float& w_sq) {
  const float grad = g[i];
  const float weight = w[i];
  const float d = kDecay ? std::fma(wd, weight, grad) : grad;
  float u = d;
  if constexpr (kMomentum) {
    const float b = kFirst ? d : std::fma(mu, buf[i], d);
    buf[i] = b;
    u = kNesterov ? std::fma(mu, b, d) : b;
  }
  const float updated = std::fma(-lr, u, weight);
  w[i] = updated;
  g_sq += grad * grad;
  w_sq += updated * updated;
}

template <bool kMomentum, bool kFirst, bool kNesterov, bool kDecay>
[[gnu::always_inline]] inline SgdKernelSquares Loop(const SgdKernelArgs& a) {
  float* __restrict w = a.weights;
  const float* __restrict g = a.gradient;
  float* __restrict buf = a.momentum_buffer;
  const float lr = a.learning_rate, mu = a.momentum, wd = a.weight_decay;
  SgdKernelSquares total;
  for (int64_t start = 0; start < a.size; start += kBlock) {
    const int64_t end = std::min(a.size, start + kBlock);
    float g_sq[kLanes] = {};
    float w_sq[kLanes] = {};
    int64_t i = start;
    for (; i + kLanes <= end; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        Element<kMomentum, kFirst, kNesterov, kDecay>(w, g, buf, i + j, lr, mu, wd, g_sq[j], w_sq[j]);
      }
    }
    for (int j = 0; i < end; ++i, ++j) {
      Element<kMomentum, kFirst, kNesterov, kDecay>(w, g, buf, i, lr, mu, wd, g_sq[j], w_sq[j]);
    }
    double block_g = 0, block_w = 0;
    for (int j = 0; j < kLanes; ++j) {
      block_g += g_sq[j];
      block_w += w_sq[j];
    }
    total.gradient += block_g;
    total.weights += block_w;
  }
  return total;
}

template <bool kMomentum, bool kFirst>
[[gnu::always_inline]] inline SgdKernelSquares ByDecay(const SgdKernelArgs& a) {
  if (a.nesterov) {
    return a.weight_decay != 0 ? Loop<kMomentum, kFirst, true, true>(a) : Loop<kMomentum, kFirst, true, false>(a);
  }
  return a.weight_decay != 0 ? Loop<kMomentum, kFirst, false, true>(a) : Loop<kMomentum, kFirst, false, false>(a);
}

[[gnu::always_inline]] inline SgdKernelSquares Dispatch(const SgdKernelArgs& a) {
  if (a.momentum_buffer == nullptr) {
    return a.weight_decay != 0 ? Loop<false, false, false, true>(a) : Loop<false, false, false, false>(a);
  }
  return a.first ? ByDecay<true, true>(a) : ByDecay<true, false>(a);
}

#if defined(__GNUC__) && defined(__x86_64__)
// The same code built for AVX2 with hardware FMA (without it std::fma is a library
// call per element), chosen at run time.
__attribute__((target("avx2,fma"))) SgdKernelSquares DispatchAvx2(const SgdKernelArgs& a) { return Dispatch(a); }

bool HaveAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

}  // namespace

SgdKernelSquares FusedSgdUpdate(const SgdKernelArgs& args) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool avx2 = HaveAvx2Fma();
  if (avx2) return DispatchAvx2(args);
#endif
  return Dispatch(args);
}

}  // namespace lockstep::internal
