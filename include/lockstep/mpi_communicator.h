// The MPI communicator, for CPU tensors (Open MPI under mpirun, or srun --mpi=pmix).
//
// Every collective runs on a worker thread of the communicator that owns all MPI
// calls after initialisation (MPI_THREAD_SERIALIZED), so that communication goes
// on while the calling thread computes: the worker issues non-blocking MPI calls
// and drives them to completion, with the call's deadline. An all-reduce,
// all-gather or broadcast larger than `chunk_bytes` is split into chunks with up to
// `chunks_in_flight` outstanding at a time, because MPI's all-reduce over shared
// memory moves messages of about a megabyte at a far higher rate than very large
// ones (see benchmarks/README.md for measured rates).
// bfloat16 and float16 are reduced in float32 (MPI has no such types).
//
// MPI is initialised by the first communicator in the process and finalised at
// exit, unless a collective failed (finalising with a dead peer would hang).
// Before MPI_Init it sets two Open MPI parameters unless the environment already
// has them: OMPI_MCA_coll_libnbc_iallreduce_algorithm=3 (reduce-scatter +
// all-gather instead of the binomial tree libnbc takes for in-place all-reduces
// on fewer than 4 ranks) and OMPI_MCA_btl_vader_max_send_size=131072 (larger
// shared-memory fragments).
//
// When every rank runs on one host, AllocateCollectiveBuffer (gradient buckets)
// puts each rank's buffer in POSIX shared memory (shm_open, pages reserved with
// posix_fallocate) that every rank maps. An all-reduce (sum or average) of
// exactly such a buffer then skips MPI's copies: after a barrier, rank r adds up
// slice r of every rank's buffer and writes the result into all of them, and a
// second barrier ends the call. Each rank reads and writes the buffer's size once
// in all (MPI's shared-memory all-reduce copies every byte through its own
// segments several times), so such an all-reduce moves much less memory (see
// benchmarks/README.md for measured times). Sums are taken in rank order, so
// results are the same on every rank and in every run. If shared memory cannot be
// had (a small /dev/shm in a container, say), a rank that could not says why on
// stderr and every rank uses plain buffers through MPI; ranks on several hosts
// always do.
// Shared pages count in the resident size of every process that touches them.
#ifndef LOCKSTEP_MPI_COMMUNICATOR_H_
#define LOCKSTEP_MPI_COMMUNICATOR_H_

#include <cstddef>
#include <memory>

#include "lockstep/communicator.h"

namespace lockstep {

struct MpiOptions {
  size_t chunk_bytes = size_t{1} << 20;
  int chunks_in_flight = 4;
  // AllocateCollectiveBuffer in shared memory when every rank is on one host
  // (see above); false: plain tensors, every all-reduce through MPI.
  bool shared_memory_buffers = true;
  // Initialise MPI with MPI_THREAD_MULTIPLE rather than MPI_THREAD_SERIALIZED.
  // Split into groups smaller than the world needs it: each such group is a
  // communicator with a worker thread of its own, and the workers call MPI at
  // once. Read by the first communicator of the process, which initialises MPI.
  bool thread_multiple = false;
};

// A communicator over a duplicate of MPI_COMM_WORLD. Throws CollectiveError when
// MPI cannot be initialised with at least MPI_THREAD_SERIALIZED. Split groups
// (MPI_Comm_split) have the same options; they need MPI_THREAD_MULTIPLE.
std::unique_ptr<Communicator> MakeMpiCommunicator(const MpiOptions& options = {});

}  // namespace lockstep

#endif  // LOCKSTEP_MPI_COMMUNICATOR_H_
