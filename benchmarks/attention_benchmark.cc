// The fused causal self-attention (lockstep/attention.h) against the same maths in
// ATen ops (CausalSelfAttentionComposite), forward and backward, at the shape of
// the KJV GPT's blocks (32 windows of 64 tokens, width 128, 4 heads), 1 intra-op
// thread, repetitions interleaved at random. Prints the ratio of the medians.
//
//   build/benchmarks/attention_benchmark [--benchmark_repetitions=N]
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
#include "lockstep/torch_setup.h"

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
    bench.SkipWithError("built without CBLAS (LOCKSTEP_WITH_CBLAS=OFF)");
    return;
  }
  ForwardBackward(bench, [](const at::Tensor& qkv, int64_t heads) { return CausalSelfAttention(qkv, heads); });
}

BENCHMARK(BM_Composite)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();
BENCHMARK(BM_Fused)->Unit(benchmark::kMillisecond)->MinTime(1.0)->UseRealTime();

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  lockstep::ConfigureTorchForTraining();
  if (!lockstep::InitializeBenchmarks(std::vector<char*>(argv, argv + argc),
                                     {"--benchmark_repetitions=5", "--benchmark_enable_random_interleaving=true"})) {
    return 2;
  }
  const std::map<std::string, double> m = lockstep::RunBenchmarksForMedians();
  if (m.count("BM_Fused") && m.count("BM_Composite")) {
    std::printf("\nfused / ATen composite attention, forward + backward (median of repetitions): %.4f\n",
                m.at("BM_Fused") / m.at("BM_Composite"));
  }
  return 0;
}
