// The NCCL communicator, for CUDA tensors on one GPU per rank.
//
// Built when CMake finds the CUDA toolkit and NCCL (LOCKSTEP_WITH_NCCL). Rank 0
// creates the NCCL unique id and the bootstrap communicator (MPI today, the
// coordination service later) broadcasts it. Collectives are enqueued on the
// communicator's own CUDA stream after the work already queued on the device's
// default stream; Work::Wait polls a CUDA event with the call's deadline, and on
// timeout or an asynchronous NCCL error aborts the NCCL communicator, which is
// then broken. Every CUDA and NCCL return code passes one check macro.
#ifndef LOCKSTEP_NCCL_COMMUNICATOR_H_
#define LOCKSTEP_NCCL_COMMUNICATOR_H_

#include <memory>

#include "lockstep/communicator.h"

namespace lockstep {

// Collective over `bootstrap` (every rank calls it, in the same order).
// `device` is this rank's CUDA device index (usually its local rank).
// Errors: CollectiveError naming the problem when there is no CUDA device (or not
// that many), or when NCCL fails to initialise.
std::unique_ptr<Communicator> MakeNcclCommunicator(Communicator& bootstrap, int device);

// Whether this build has the NCCL backend.
bool HaveNccl();

}  // namespace lockstep

#endif  // LOCKSTEP_NCCL_COMMUNICATOR_H_
