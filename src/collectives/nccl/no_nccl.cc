// The NCCL entry points of a build without CUDA or NCCL.
#include "lockstep/nccl_communicator.h"

namespace lockstep {

std::unique_ptr<Communicator> MakeNcclCommunicator(const NcclIdExchange& exchange, int) {
  throw CollectiveError("rank " + std::to_string(exchange.rank) +
                        ": this build has no NCCL backend (configure where the CUDA toolkit and NCCL are found)");
}

bool HaveNccl() { return false; }

}  // namespace lockstep
