#include "lockstep/torch_setup.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "lockstep/agreement.h"
#include "lockstep/communicator.h"
#include "lockstep/cpu_gemm.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

int AvailableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// Ranks of this job on this host, from the launcher; 1 when unknown.
int LocalRanks() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* value = std::getenv(name)) {
      const int n = std::atoi(value);
      if (n > 0) return n;
    }
  }
  return 1;
}

// Threads per rank when the config leaves it open: the cores this process is bound
// to; when it is not bound (every core of the host, as under an oversubscribed
// mpirun), its share of them, since OpenMP threads of several ranks spinning on the
// same cores cost 100x (0.2 s against 2 ms per step measured with 3 ranks on 2 cores).
int DefaultThreads() {
  // OpenMP's own variable, when set, as libtorch and PyTorch honour it.
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long threads = std::strtol(omp, &end, 10);
    if (end != omp && *end == '\0' && threads > 0 && threads <= 4096) return static_cast<int>(threads);
  }
  const int cores = AvailableCores();
  const int host_cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores < host_cores) return cores;
  return std::max(1, cores / LocalRanks());
}

// libtorch parallelises operators over its OpenMP threads; OpenBLAS built with
// pthreads would start its own pool on the same cores inside each matrix product.
// Found at run time, so that any BLAS (or none) behind libblas.so.3 works.
void MakeOpenBlasSingleThreaded() {
  using SetThreads = void (*)(int);
  using Shutdown = int (*)();
  if (void* symbol = dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) reinterpret_cast<SetThreads>(symbol)(1);
  // The idle pool still costs time (3.5x per step here) until it is shut down;
  // with one thread OpenBLAS never restarts it.
  if (void* symbol = dlsym(RTLD_DEFAULT, "blas_thread_shutdown_")) reinterpret_cast<Shutdown>(symbol)();
}

// Every step allocates and frees activations of several MiB. With glibc's default
// thresholds these are mmapped and unmapped (or trimmed off the heap) each time, and
// the kernel zero-fills fresh pages on every step: measured at 0.10 s per CNN step
// against 0.036 s with the memory kept in the heap. The mmap threshold cannot go
// above 32 MiB, so larger blocks (a 4096x4096 weight's gradient is 64 MiB) are
// kept in the heap by not using mmap at all: measured at 0.46-0.72 s against
// 0.13 s per step of a 25M-parameter MLP (benchmarks/scaleout.sh), 0.88-1.05 s
// against 0.38 s on 2 ranks.
void KeepActivationsInTheHeap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed value on 64-bit
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_MMAP_MAX, 0);  // threads' arenas fall back to the main heap for big blocks
}

}  // namespace

int ConfigureTorchForTraining(int num_threads) {
  at::globalContext().setFlushDenormal(true);
  MakeOpenBlasSingleThreaded();
  KeepActivationsInTheHeap();
  const int threads = num_threads > 0 ? num_threads : DefaultThreads();
  if (threads > 0) at::set_num_threads(threads);
  return at::get_num_threads();
}

namespace {

// The best FLOP/s of `product` (one n x n x n product) over repeated runs of at
// least `min_seconds`; `per_timing` products between two calls of `sync`.
template <typename Product, typename Sync>
double BestFlops(int64_t n, double min_seconds, int per_timing, const Product& product, const Sync& sync) {
  product();  // warm-up: threads started, pages touched, kernels chosen
  sync();
  const auto begin = std::chrono::steady_clock::now();
  double best = 0;
  for (int runs = 0; runs < 1000; ++runs) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < per_timing; ++i) product();
    sync();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0) best = std::max(best, per_timing * 2.0 * static_cast<double>(n) * n * n / seconds);
    if (runs >= 3 && std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() >= min_seconds) {
      break;
    }
  }
  return best;
}

}  // namespace

double MeasureMatmulFlops(const std::string& device, int64_t n, double min_seconds) {
  at::NoGradGuard no_grad;
  const at::Device where(device);
  if (n <= 0) n = where.is_cpu() ? 512 : 8192;
  const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat).device(where);
  const at::Tensor a = at::randn({n, n}, options), b = at::randn({n, n}, options);
  at::Tensor c = at::empty({n, n}, options);
  // Waits for the device's queued work: item() copies a value back.
  auto sync = [&] {
    if (!where.is_cpu()) (void)c[0][0].item<float>();
  };
  // A GPU queues products asynchronously: time a batch of them between waits.
  const int per_timing = where.is_cpu() ? 1 : 10;
  // On a CPU, Lockstep's own products (cpu_gemm.h) may be faster than libtorch's
  // BLAS: the peak is the faster of the two, each timed for half of min_seconds
  // (so that start-up pays for the measurement once, not twice).
  const bool own = where.is_cpu() && HaveCpuGemm();
  const double seconds = own ? min_seconds / 2 : min_seconds;
  double best = BestFlops(n, seconds, per_timing, [&] { at::mm_out(c, a, b); }, sync);
  if (own) {
    const float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    float* pc = c.data_ptr<float>();
    best = std::max(best, BestFlops(
                              n, seconds, 1, [&] { CpuGemm(false, false, n, n, n, 1.f, pa, n, pb, n, 0.f, pc, n); },
                              [] {}));
  }
  return best;
}

double MeasureAgreedMatmulFlops(Communicator* communicator, const std::string& device) {
  std::string peak = absl::StrFormat("%.17g", MeasureMatmulFlops(device));
  if (communicator != nullptr && communicator->world_size() > 1) peak = BroadcastString(*communicator, peak);
  double flops = 0;
  if (!absl::SimpleAtod(peak, &flops)) throw Error("MeasureAgreedMatmulFlops: rank 0 sent '" + peak + "'");
  return flops;
}

}  // namespace lockstep
