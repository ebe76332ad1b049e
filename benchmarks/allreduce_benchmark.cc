// All-reduce bandwidth of the MPI communicator against raw MPI_Allreduce, measured
// in the same run, for several message sizes and chunk sizes. Run under mpirun:
//
//   launch/mpirun.sh -n 2 -- build/benchmarks/allreduce_benchmark
//
// Every rank runs the same fixed iteration counts (collectives must match); only
// rank 0 reports. bytes_per_second is the message size over the time per call.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <cstdio>
#include <map>
#include <memory>

#include "lockstep/mpi_communicator.h"

namespace lockstep {
namespace {

// One communicator per chunk size. main() releases them before it returns: MPI
// is finalised at exit, and a communicator freed after that aborts the process.
std::map<int64_t, std::unique_ptr<Communicator>>& Comms() {
  static auto* comms = new std::map<int64_t, std::unique_ptr<Communicator>>;
  return *comms;
}

std::unique_ptr<Communicator>& Comm(int64_t chunk_bytes) {
  auto& comm = Comms()[chunk_bytes];
  if (!comm) {
    MpiOptions options;
    options.chunk_bytes = static_cast<size_t>(chunk_bytes);
    comm = MakeMpiCommunicator(options);
  }
  return comm;
}

int64_t Iterations(int64_t bytes) { return bytes <= (4 << 20) ? 40 : (bytes <= (64 << 20) ? 8 : 4); }

void BM_RawMpiAllreduce(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  at::Tensor t = at::ones({bytes / 4}, at::kFloat);
  for (auto _ : state) {
    MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_LockstepAllReduce(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  Communicator& comm = *Comm(state.range(1));
  at::Tensor t = at::ones({bytes / 4}, at::kFloat);
  for (auto _ : state) comm.AllReduce(t, ReduceOp::kSum);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void Register() {
  for (int64_t bytes : {int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20, int64_t{256} << 20}) {
    benchmark::RegisterBenchmark("BM_RawMpiAllreduce", BM_RawMpiAllreduce)
        ->Arg(bytes)->Iterations(Iterations(bytes))->UseRealTime()->Unit(benchmark::kMillisecond);
    for (int64_t chunk : {int64_t{256} << 10, int64_t{1} << 20, int64_t{4} << 20, int64_t{1} << 30}) {
      benchmark::RegisterBenchmark("BM_LockstepAllReduce", BM_LockstepAllReduce)
          ->Args({bytes, chunk})->Iterations(Iterations(bytes))->UseRealTime()->Unit(benchmark::kMillisecond);
    }
  }
}

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  // Flags first: --help and a bad flag end the process before MPI starts.
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  auto& first = lockstep::Comm(1 << 20);  // initialises MPI
  lockstep::Register();
  if (first->rank() == 0) {
    std::printf("ranks: %d; args: message bytes[/chunk bytes]; chunk 1 GiB = not chunked\n", first->world_size());
    benchmark::RunSpecifiedBenchmarks();
  } else {
    lockstep::SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  lockstep::Comms().clear();
  return 0;
}
