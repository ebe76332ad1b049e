// The NCCL communicator, for CUDA tensors on one GPU per rank.
//
// Built when CMake finds the CUDA toolkit and NCCL (LOCKSTEP_WITH_NCCL). Rank 0
// creates the NCCL unique id and publishes it; the other ranks fetch it (through
// the coordination service's key-value store in lockstep_train). Collectives are enqueued on the
// communicator's own CUDA stream after the work already queued on the device's
// default stream; Work::Wait polls a CUDA event with the call's deadline, and on
// timeout or an asynchronous NCCL error aborts the NCCL communicator, which is
// then broken. Every CUDA and NCCL return code passes one check macro.
#ifndef LOCKSTEP_NCCL_COMMUNICATOR_H_
#define LOCKSTEP_NCCL_COMMUNICATOR_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "lockstep/communicator.h"

namespace lockstep {

class CoordinationClient;

// How the ranks agree on NCCL's unique id (an opaque byte string): rank 0
// publishes it, every other rank fetches it. Both may throw.
struct NcclIdExchange {
  int rank = 0;
  int world_size = 1;
  std::function<void(const std::string& id)> publish;  // called on rank 0
  std::function<std::string()> fetch;                  // called on the others
};

// Through the coordination service's key-value store, under
// "lockstep/nccl/<name>/unique_id"; fetching waits up to `timeout`.
// Errors (thrown): CoordinationError naming the key.
NcclIdExchange NcclIdOverCoordination(CoordinationClient& coordination, const std::string& name,
                                      absl::Duration timeout);

// Every rank calls it with an exchange for the same name. `device` is this rank's
// CUDA device index (usually its local rank). Errors: CollectiveError naming the
// problem when there is no CUDA device (or not that many), or when NCCL fails to
// initialise.
std::unique_ptr<Communicator> MakeNcclCommunicator(const NcclIdExchange& exchange, int device);

// Whether this build has the NCCL backend.
bool HaveNccl();

}  // namespace lockstep

#endif  // LOCKSTEP_NCCL_COMMUNICATOR_H_
