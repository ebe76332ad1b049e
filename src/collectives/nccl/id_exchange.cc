// NCCL's unique id through the coordination service's key-value store. Built with
// or without NCCL: it only moves bytes.
#include <string>

#include "absl/strings/str_cat.h"
#include "lockstep/agreement.h"
#include "lockstep/coordination.h"
#include "lockstep/nccl_communicator.h"

namespace lockstep {

NcclIdExchange NcclIdOverCoordination(CoordinationClient& coordination, const std::string& name,
                                      absl::Duration timeout) {
  const std::string key = absl::StrCat("lockstep/nccl/", name, "/unique_id");
  NcclIdExchange exchange;
  exchange.rank = coordination.rank();
  exchange.world_size = coordination.world_size();
  exchange.publish = [&coordination, key, timeout](const std::string& id) {
    ThrowIfError(ShareFromChief(coordination, key, id, /*is_chief=*/true, timeout).status(),
                 "publishing the NCCL unique id");
  };
  exchange.fetch = [&coordination, key, timeout]() -> std::string {
    absl::StatusOr<std::string> id = ShareFromChief(coordination, key, "", /*is_chief=*/false, timeout);
    ThrowIfError(id.status(), "fetching the NCCL unique id from rank 0");
    return *id;
  };
  return exchange;
}

}  // namespace lockstep
