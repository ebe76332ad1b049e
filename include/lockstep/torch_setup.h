// Process-wide libtorch settings for training on CPUs. Call once at start-up,
// before any other thread exists (threads inherit the floating-point mode).
//
// - Intra-op threads: `num_threads`, or when 0 OMP_NUM_THREADS when it is set to
//   a positive number, or else one per core this process is bound to; a process
//   bound to every core of the host (an oversubscribed mpirun binds none) takes
//   its share, cores / ranks on this host (OMPI_COMM_WORLD_LOCAL_SIZE,
//   LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE), because ranks whose threads
//   outnumber the cores keep preempting each other. Debian's libtorch
//   otherwise asks OpenMP, which may report a single thread.
// - Denormal floats are flushed to zero (as torch.set_flush_denormal(True)): as a
//   classifier grows confident, softmax gradients underflow into denormals, and
//   x86 arithmetic on them is slow.
// - OpenBLAS (behind Debian's libblas.so.3) runs single-threaded: its pthread pool
//   and libtorch's OpenMP threads otherwise compete for the same cores.
// - glibc malloc keeps freed activations in the heap (mmap threshold 32 MiB, trim
//   threshold 1 GiB, and no mmap at all for blocks above it) instead of returning
//   them to the kernel after every step, so that steps do not pay again in page
//   faults for memory they just freed.
//
// Step times measured with and without the thread, OpenBLAS and malloc settings
// are in benchmarks/README.md.
#ifndef LOCKSTEP_TORCH_SETUP_H_
#define LOCKSTEP_TORCH_SETUP_H_

#include <cstdint>
#include <string>

namespace lockstep {

class Communicator;

// Returns the number of intra-op threads in effect.
int ConfigureTorchForTraining(int num_threads = 0);

// The float32 FLOP/s this process reaches on square matrix products of size n
// (2 n^3 per product) on `device` ("cpu" with its intra-op threads, or "cuda:N"),
// the best of repeated runs over at least `min_seconds`: the peak that model FLOPs
// utilisation (MFU) divides by. n <= 0 picks 512 on a CPU and 8192 on a GPU. Run
// it on every rank at once to measure what each gets while the others compute too.
// On a CPU it is the faster of libtorch's product and oneDNN's (cpu_gemm.h), which
// Lockstep's Linear and attention use.
double MeasureMatmulFlops(const std::string& device = "cpu", int64_t n = 0, double min_seconds = 0.5);

// MeasureMatmulFlops on every rank of `communicator` at once (null: this process
// alone), and rank 0's figure on every rank, so that every rank derives the same
// MFU. A collective.
double MeasureAgreedMatmulFlops(Communicator* communicator, const std::string& device = "cpu");

}  // namespace lockstep

#endif  // LOCKSTEP_TORCH_SETUP_H_
