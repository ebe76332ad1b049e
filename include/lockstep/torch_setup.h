// Process-wide libtorch settings for training on CPUs. Call once at start-up,
// before any other thread exists (threads inherit the floating-point mode).
//
// - Intra-op threads: `num_threads`, or when 0 one per core this process is bound
//   to; a process bound to every core of the host (an oversubscribed mpirun binds
//   none) takes its share, cores / ranks on this host (OMPI_COMM_WORLD_LOCAL_SIZE,
//   LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE): 3 ranks of 2 threads on 2 cores
//   took 0.2 s per step against 6 ms with 1 thread each. Debian's libtorch
//   otherwise asks OpenMP, which may report a single thread.
// - Denormal floats are flushed to zero (as torch.set_flush_denormal(True)): as a
//   classifier grows confident, softmax gradients underflow into denormals, and
//   x86 arithmetic on them is slow.
// - OpenBLAS (behind Debian's libblas.so.3) runs single-threaded: its pthread pool
//   and libtorch's OpenMP threads otherwise compete for the same cores, measured
//   here at 0.115 s per CNN step against 0.026 s without the competition.
// - glibc malloc keeps freed activations in the heap (mmap threshold 32 MiB, trim
//   threshold 1 GiB, and no mmap at all for blocks above it) instead of returning
//   them to the kernel after every step, which cost 0.10 s against 0.036 s per CNN
//   step in page faults, and 3-5x on an MLP with 64 MiB gradients.
#ifndef LOCKSTEP_TORCH_SETUP_H_
#define LOCKSTEP_TORCH_SETUP_H_

namespace lockstep {

// Returns the number of intra-op threads in effect.
int ConfigureTorchForTraining(int num_threads = 0);

}  // namespace lockstep

#endif  // LOCKSTEP_TORCH_SETUP_H_
