// The 16-bit conversions behind HalfPrecisionHook (src/partitioning/half_kernel.h)
// against libtorch's own casts, bit for bit, on special values and on random bit
// patterns (every class of float: zeros, subnormals, normals, infinities, NaNs).
#include "src/partitioning/half_kernel.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace lockstep::internal {
namespace {

std::vector<float> Inputs() {
  const float inf = std::numeric_limits<float>::infinity();
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  };
  std::vector<float> v = {0.f, -0.f, 1.f, -1.f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), 65504.f, 65519.f, 65520.f, -65520.f,
                          6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f, 1e-9f,
                          1.00390625f,   // exactly between two bfloat16 values, the lower one even
                          1.01171875f,   // exactly between two bfloat16 values, the upper one even
                          1.00048828125f,  // exactly between two halves, the lower one even
                          1.00146484375f,  // exactly between two halves, the upper one even
                          from_bits(0x7F800001u), from_bits(0xFFFFFFFFu), from_bits(0x7F7FFFFFu)};
  std::mt19937 bits(7);
  for (int i = 0; i < 200000; ++i) v.push_back(from_bits(static_cast<uint32_t>(bits())));
  std::mt19937 values(8);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int i = 0; i < 100001; ++i) v.push_back(normal(values));
  return v;
}

// Bits as libtorch rounds them; NaN as one pattern per format, since half's NaN
// payload may differ and does not matter.
std::vector<uint16_t> Canonical(const at::Tensor& sixteen_bits) {
  const at::Tensor raw = sixteen_bits.view(at::kShort).contiguous();
  const at::Tensor nan = at::isnan(sixteen_bits.to(at::kFloat));
  std::vector<uint16_t> out(raw.numel());
  const auto* r = reinterpret_cast<const uint16_t*>(raw.data_ptr());
  const bool* is_nan = nan.data_ptr<bool>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = is_nan[i] ? 0x7FFF : r[i];
  return out;
}

struct Case {
  HalfFormat format;
  at::ScalarType dtype;
};

class HalfKernelTest : public ::testing::TestWithParam<Case> {};

TEST_P(HalfKernelTest, RoundsAsLibtorchDoes) {
  const Case c = GetParam();
  if (!HaveHalfKernel(c.format)) GTEST_SKIP() << "no half kernel on this CPU (needs F16C); libtorch's casts run";
  std::vector<float> in = Inputs();
  const auto n = static_cast<int64_t>(in.size());
  const at::Tensor source = at::from_blob(in.data(), {n}, at::kFloat);
  at::Tensor ours = at::empty({n}, at::TensorOptions().dtype(c.dtype));
  RoundToHalf(c.format, in.data(), reinterpret_cast<uint16_t*>(ours.data_ptr()), n);
  const std::vector<uint16_t> expected = Canonical(source.to(c.dtype)), got = Canonical(ours);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (expected[i] != got[i] && mismatches++ < 5) {
      ADD_FAILURE() << "input " << in[i] << " (#" << i << "): libtorch 0x" << std::hex << expected[i] << ", ours 0x"
                    << got[i];
    }
  }
  EXPECT_EQ(mismatches, 0);
  // bfloat16's NaN is libtorch's own pattern, bit for bit.
  if (c.format == HalfFormat::kBFloat16) {
    uint16_t nan = 0;
    const float quiet = std::numeric_limits<float>::quiet_NaN();
    RoundToHalf(c.format, &quiet, &nan, 1);
    EXPECT_EQ(nan, 0x7FC0);
  }
}

TEST_P(HalfKernelTest, SumsTheWidenedPartsInOrderAsLibtorchDoes) {
  const Case c = GetParam();
  if (!HaveHalfKernel(c.format)) GTEST_SKIP() << "no half kernel on this CPU (needs F16C); libtorch's casts run";
  std::vector<float> in = Inputs();
  const auto n = static_cast<int64_t>(in.size()) / 3;  // three parts; n is not a multiple of 8
  const at::Tensor parts = at::from_blob(in.data(), {3, n}, at::kFloat).to(c.dtype);
  for (int count = 1; count <= 3; ++count) {
    SCOPED_TRACE(count);
    std::vector<const uint16_t*> pointers;
    for (int r = 0; r < count; ++r) pointers.push_back(reinterpret_cast<const uint16_t*>(parts[r].data_ptr()));
    at::Tensor ours = at::empty({n}, at::kFloat);
    SumHalves(c.format, pointers.data(), count, ours.data_ptr<float>(), n);
    at::Tensor expected = parts[0].to(at::kFloat);
    for (int r = 1; r < count; ++r) expected.add_(parts[r].to(at::kFloat));
    const at::Tensor both_nan = at::isnan(ours) & at::isnan(expected);
    EXPECT_TRUE(at::equal(at::isnan(ours), at::isnan(expected)));
    EXPECT_TRUE(at::equal(ours.masked_fill(both_nan, 0), expected.masked_fill(both_nan, 0)));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, HalfKernelTest,
                         ::testing::Values(Case{HalfFormat::kBFloat16, at::kBFloat16}, Case{HalfFormat::kHalf, at::kHalf}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.format == HalfFormat::kBFloat16 ? "BFloat16" : "Half");
                         });

}  // namespace
}  // namespace lockstep::internal
