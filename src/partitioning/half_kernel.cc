#include "half_kernel.h"

#include <algorithm>
#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace lockstep::internal {
namespace {

constexpr int64_t kBlock = 2048;  // elements summed across the parts while in cache

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bfloat16 is float32's upper half: add just under half of the dropped part's
// unit, plus one when the kept part is odd (ties to even), and keep the top 16
// bits. A NaN's payload could round into infinity, so NaN is written as itself.
[[gnu::always_inline]] inline uint16_t ToBFloat16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded;
}

[[gnu::always_inline]] inline float FromBFloat16(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

[[gnu::always_inline]] inline void RoundBFloat16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToBFloat16(src[i]);
}

template <typename Widen>
[[gnu::always_inline]] inline void Sum(const uint16_t* const* parts, int count, float* __restrict out, int64_t n,
                                       Widen widen) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    float* __restrict o = out + start;
    const uint16_t* __restrict first = parts[0] + start;
    for (int64_t i = 0; i < len; ++i) o[i] = widen(first[i]);
    for (int r = 1; r < count; ++r) {
      const uint16_t* __restrict p = parts[r] + start;
      for (int64_t i = 0; i < len; ++i) o[i] += widen(p[i]);
    }
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define LOCKSTEP_HALF_F16C 1
// IEEE half with F16C's vcvtps2ph / vcvtph2ps, eight at a time: they round to
// nearest, ties to even, as libtorch does, and widen exactly.
__attribute__((target("avx2,f16c"))) void RoundHalfF16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("avx2,f16c"))) inline __m256 Widen8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,f16c"))) void SumHalfF16c(const uint16_t* const* parts, int count, float* out,
                                                      int64_t n) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start), vector_len = len / 8 * 8;
    float* o = out + start;
    for (int64_t i = 0; i < vector_len; i += 8) _mm256_storeu_ps(o + i, Widen8(parts[0] + start + i));
    for (int r = 1; r < count; ++r) {
      const uint16_t* p = parts[r] + start;
      for (int64_t i = 0; i < vector_len; i += 8) {
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i), Widen8(p + i)));
      }
    }
    for (int64_t i = vector_len; i < len; ++i) {
      o[i] = _cvtsh_ss(parts[0][start + i]);
      for (int r = 1; r < count; ++r) o[i] += _cvtsh_ss(parts[r][start + i]);
    }
  }
}

__attribute__((target("avx2"))) void RoundBFloat16Avx2(const float* src, uint16_t* dst, int64_t n) {
  RoundBFloat16(src, dst, n);
}

__attribute__((target("avx2"))) void SumBFloat16Avx2(const uint16_t* const* parts, int count, float* out,
                                                     int64_t n) {
  Sum(parts, count, out, n, FromBFloat16);
}

// Asked once per process.
bool UseF16c() {
  static const bool f16c = [] {
    __builtin_cpu_init();
    // Clang's __builtin_cpu_supports does not know "f16c": ask CPUID leaf 1 (ECX).
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  }();
  return f16c;
}
#endif

}  // namespace

bool HaveHalfKernel(HalfFormat format) {
  if (format == HalfFormat::kBFloat16) return true;
#ifdef LOCKSTEP_HALF_F16C
  return UseF16c();
#else
  return false;
#endif
}

void RoundToHalf(HalfFormat format, const float* src, uint16_t* dst, int64_t n) {
#ifdef LOCKSTEP_HALF_F16C
  if (UseF16c()) return format == HalfFormat::kBFloat16 ? RoundBFloat16Avx2(src, dst, n) : RoundHalfF16c(src, dst, n);
#endif
  RoundBFloat16(src, dst, n);  // HaveHalfKernel keeps half away from here
}

void SumHalves(HalfFormat format, const uint16_t* const* parts, int count, float* out, int64_t n) {
#ifdef LOCKSTEP_HALF_F16C
  if (UseF16c()) return format == HalfFormat::kBFloat16 ? SumBFloat16Avx2(parts, count, out, n)
                                                   : SumHalfF16c(parts, count, out, n);
#endif
  Sum(parts, count, out, n, FromBFloat16);
}

}  // namespace lockstep::internal
