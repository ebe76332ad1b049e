// How long the training thread stops for a checkpoint: an asynchronous save
// (copy in memory, write in the background) against a synchronous save of the same
// state (serialise, write, fsync, commit), measured in the same run.
//
//   build/benchmarks/checkpoint_benchmark [--benchmark_filter=...] [--megabytes=N]
//
// The state is an MLP whose parameters take --megabytes (default 128) with SGD
// momentum (as much again), written to a temporary directory on the same disk as
// the current directory. Three ways to save, each against the synchronous save:
//   - async, copy at the save: the pause is the Save() call (the write it leaves
//     to the background is waited for outside the timed region);
//   - async, copy overlapped with the next step (what lockstep_train does): a
//     forward and backward of the model with a save started before it and its
//     snapshot awaited after it, minus the same step without a save, measured in
//     the same run: what the save adds to the training thread's step, contention
//     for cores and memory included.
#include <benchmark/benchmark.h>
#include <stdlib.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/median_reporter.h"
#include "lockstep/checkpoint.h"
#include "lockstep/torch_setup.h"

namespace lockstep {
namespace {

int64_t megabytes = 128;

struct BigState {
  TrainState state;
  torch::nn::Sequential model;
  at::Tensor input;
  std::string dir;
  BigState() {
    // width x width layers of float32 until the parameters reach `megabytes`.
    const int64_t width = 2048;
    const int64_t layers = std::max<int64_t>(1, (megabytes << 20) / (width * width * 4));
    for (int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(width, width));
    state.model = model.ptr();
    state.optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    // One step, so that the optimizer holds its momentum buffers.
    input = torch::randn({64, width});
    model->forward(input).sum().backward();
    state.optimizer->step();
    state.step = 1;
    std::string pattern = (std::filesystem::current_path() / "checkpoint_bench_XXXXXX").string();
    dir = mkdtemp(pattern.data());
  }
  ~BigState() { std::filesystem::remove_all(dir); }
  // One forward and backward pass: the next training step's work.
  void ForwardBackward() {
    state.optimizer->zero_grad();
    model->forward(input).sum().backward();
  }
  int64_t bytes() const {
    int64_t total = 0;
    for (const auto& p : state.model->parameters()) total += p.numel() * 4;
    return 2 * total;  // parameters and momentum
  }
};

BigState& State() {
  static BigState state;
  return state;
}

CheckpointOptions Options(bool async) {
  CheckpointOptions o;
  o.directory = State().dir;
  o.async = async;
  o.keep_last = 1;
  return o;
}

void BM_SyncSave(benchmark::State& bench) {
  BigState& big = State();
  CheckpointManager manager(Options(false), 0, 1, nullptr);
  for (auto _ : bench) {
    ++big.state.step;
    manager.Save(big.state, ShardExtras{}, {});
  }
  bench.SetBytesProcessed(bench.iterations() * big.bytes());
}

void BM_AsyncSavePause(benchmark::State& bench) {
  BigState& big = State();
  CheckpointManager manager(Options(true), 0, 1, nullptr);
  for (auto _ : bench) {
    ++big.state.step;
    manager.Save(big.state, ShardExtras{}, {});
    bench.PauseTiming();
    manager.Wait();  // the background write is not the training thread's time
    bench.ResumeTiming();
  }
  bench.SetBytesProcessed(bench.iterations() * big.bytes());
}

void BM_StepAlone(benchmark::State& bench) {
  BigState& big = State();
  for (auto _ : bench) big.ForwardBackward();
}

void BM_StepWithOverlappedSave(benchmark::State& bench) {
  BigState& big = State();
  CheckpointOptions options = Options(true);
  options.overlap_copy = true;
  CheckpointManager manager(options, 0, 1, nullptr);
  for (auto _ : bench) {
    ++big.state.step;
    manager.Save(big.state, ShardExtras{}, {});
    big.ForwardBackward();
    manager.AwaitSnapshot();  // before the optimizer would change the parameters
    bench.PauseTiming();
    manager.Wait();
    bench.ResumeTiming();
  }
}

BENCHMARK(BM_StepAlone)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_StepWithOverlappedSave)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_SyncSave)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();
BENCHMARK(BM_AsyncSavePause)->Unit(benchmark::kMillisecond)->Iterations(5)->UseRealTime();

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  lockstep::ConfigureTorchForTraining();
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--megabytes=", 12) == 0) {
      lockstep::megabytes = std::atoll(argv[i] + 12);
    } else {
      args.push_back(argv[i]);
    }
  }
  if (!lockstep::InitializeBenchmarks(args, {"--benchmark_repetitions=3"})) return 2;
  std::printf("State: %.1f MB (parameters and SGD momentum)\n", lockstep::State().bytes() / 1e6);
  const std::map<std::string, double> m = lockstep::RunBenchmarksForMedians();
  if (m.count("BM_AsyncSavePause") && m.count("BM_SyncSave")) {
    std::printf("\nAsync save, copy at the save: pause / sync save time (medians): %.4f\n",
                m.at("BM_AsyncSavePause") / m.at("BM_SyncSave"));
  }
  if (m.count("BM_StepWithOverlappedSave") && m.count("BM_StepAlone") && m.count("BM_SyncSave")) {
    const double added = m.at("BM_StepWithOverlappedSave") - m.at("BM_StepAlone");
    std::printf("Async save, copy overlapped with the next step: time added to the step %.1f ms "
                "(step alone %.1f ms) / sync save time: %.4f\n",
                added, m.at("BM_StepAlone"), added / m.at("BM_SyncSave"));
  }
  return 0;
}
