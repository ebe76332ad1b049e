// Lockstep's CPU kernels against libtorch's, forward and backward, at the shapes
// of the KJV GPT's blocks (32 windows of 64 tokens, width 128, 4 heads), 1
// intra-op thread, repetitions interleaved at random; prints the ratios of the
// medians:
// - the fused causal self-attention (lockstep/attention.h) against the same maths
//   in ATen ops (CausalSelfAttentionComposite);
// - Linear (lockstep/linear.h, oneDNN's products) against at::linear (the system
//   BLAS), width to 4 width, as the MLP's first layer;
// - HalfPrecisionHook's work on a CPU (src/partitioning/half_kernel.h): rounding a
//   bucket of the wide MLP's 25.2 M float32 gradients to bf16 / fp16, and summing
//   two ranks' 16-bit values into float32, against libtorch's casts and mixed-dtype
//   add_ (what the hook ran before).
//
//   build/benchmarks/cpu_kernels_benchmark [--benchmark_repetitions=N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/autograd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "benchmarks/median_reporter.h"
#include "lockstep/attention.h"
#include "lockstep/linear.h"
#include "lockstep/torch_setup.h"
#include "src/partitioning/half_kernel.h"

namespace lockstep {
namespace {

constexpr int64_t kBatch = 32, kLength = 64, kWidth = 128, kHeads = 4;

template <typename Attention>
void ForwardBackward(benchmark::State& bench, Attention attention) {
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor qkv = at::randn({kBatch, kLength, 3 * kWidth}).requires_grad_(true);
  const at::Tensor upstream = at::randn({kBatch, kLength, kWidth});
  for (auto _ : bench) {
    const at::Tensor out = attention(qkv, kHeads);
    const auto grads = torch::autograd::grad({out}, {qkv}, {upstream});
    benchmark::DoNotOptimize(grads[0].data_ptr());
  }
  bench.SetItemsProcessed(bench.iterations() * kBatch * kLength);
}

void BM_Composite(benchmark::State& bench) {
  ForwardBackward(bench, [](const at::Tensor& qkv, int64_t heads) { return CausalSelfAttentionComposite(qkv, heads); });
}

void BM_Fused(benchmark::State& bench) {
  if (!FusedCausalSelfAttentionApplies(at::zeros({1, 1, 3}))) {
    bench.SkipWithError("built without oneDNN (LOCKSTEP_WITH_DNNL=OFF)");
    return;
  }
  ForwardBackward(bench, [](const at::Tensor& qkv, int64_t heads) { return CausalSelfAttention(qkv, heads); });
}

template <typename LinearFn>
void LinearForwardBackward(benchmark::State& bench, LinearFn linear) {
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor x = at::randn({kBatch, kLength, kWidth}).requires_grad_(true);
  const at::Tensor w = at::randn({4 * kWidth, kWidth}).requires_grad_(true);
  const at::Tensor b = at::randn({4 * kWidth}).requires_grad_(true);
  const at::Tensor upstream = at::randn({kBatch, kLength, 4 * kWidth});
  for (auto _ : bench) {
    const at::Tensor out = linear(x, w, b);
    const auto grads = torch::autograd::grad({out}, {x, w, b}, {upstream});
    benchmark::DoNotOptimize(grads[0].data_ptr());
  }
  bench.SetItemsProcessed(bench.iterations() * kBatch * kLength);
}

void BM_AtenLinear(benchmark::State& bench) {
  LinearForwardBackward(bench, [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    return at::linear(x, w, b);
  });
}

void BM_Linear(benchmark::State& bench) {
  if (!FusedLinearApplies(at::zeros({1}), at::zeros({1, 1}))) {
    bench.SkipWithError("built without oneDNN (LOCKSTEP_WITH_DNNL=OFF)");
    return;
  }
  LinearForwardBackward(bench, [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    return Linear(x, w, b);
  });
}

// The 16-bit round trip of one bucket on 2 ranks: this rank's values rounded, then
// its and the peer's (here the same) widened and summed in float32, rank order.
constexpr int64_t kBucket = 25175040;  // the wide MLP's parameters

template <at::ScalarType kDtype>
void BM_AtenHalf(benchmark::State& bench) {
  at::set_num_threads(1);
  const at::Tensor buffer = at::randn({kBucket}), sum = at::empty({kBucket});
  for (auto _ : bench) {
    const at::Tensor compressed = buffer.to(kDtype);
    sum.copy_(compressed);
    sum.add_(compressed);
    benchmark::DoNotOptimize(sum.data_ptr());
  }
}

template <at::ScalarType kDtype>
void BM_Half(benchmark::State& bench) {
  const internal::HalfFormat format =
      kDtype == at::kBFloat16 ? internal::HalfFormat::kBFloat16 : internal::HalfFormat::kHalf;
  if (!internal::HaveHalfKernel(format)) {
    bench.SkipWithError("no half kernel on this CPU (needs F16C)");
    return;
  }
  const at::Tensor buffer = at::randn({kBucket}), sum = at::empty({kBucket});
  for (auto _ : bench) {
    const at::Tensor compressed = at::empty({kBucket}, at::kHalf);
    auto* bits = reinterpret_cast<uint16_t*>(compressed.data_ptr());
    internal::RoundToHalf(format, buffer.data_ptr<float>(), bits, kBucket);
    const uint16_t* parts[2] = {bits, bits};
    internal::SumHalves(format, parts, 2, sum.data_ptr<float>(), kBucket);
    benchmark::DoNotOptimize(sum.data_ptr());
  }
}

BENCHMARK(BM_Composite)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_Fused)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_AtenLinear)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_Linear)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_AtenHalf<at::kBFloat16>)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_Half<at::kBFloat16>)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_AtenHalf<at::kHalf>)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_Half<at::kHalf>)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  lockstep::ConfigureTorchForTraining();
  if (!lockstep::InitializeBenchmarks(std::vector<char*>(argv, argv + argc),
                                     {"--benchmark_repetitions=5", "--benchmark_enable_random_interleaving=true"})) {
    return 2;
  }
  const std::map<std::string, double> m = lockstep::RunBenchmarksForMedians();
  std::printf("\n");
  lockstep::PrintMedianRatio(m, "BM_Fused", "BM_Composite", "fused / ATen composite attention, forward + backward");
  lockstep::PrintMedianRatio(m, "BM_Linear", "BM_AtenLinear", "Linear (oneDNN) / at::linear, forward + backward");
  lockstep::PrintMedianRatio(m, "BM_Half<at::kBFloat16>", "BM_AtenHalf<at::kBFloat16>",
                             "bf16 hook's round + 2-rank sum, vectorised / libtorch");
  lockstep::PrintMedianRatio(m, "BM_Half<at::kHalf>", "BM_AtenHalf<at::kHalf>",
                             "fp16 hook's round + 2-rank sum, vectorised / libtorch");
  return 0;
}
