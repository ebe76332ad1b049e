// Gloo's rendezvous store over the coordination service's key-value store. Built
// with or without Gloo: it only moves bytes.
#include <chrono>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "lockstep/coordination.h"
#include "lockstep/gloo_communicator.h"

namespace lockstep {

std::string GlooHostname(const CoordinationClient& coordination, const std::string& this_host) {
  for (const PeerInfo& peer : coordination.roster()) {
    if (peer.host != this_host) return this_host;
  }
  return "127.0.0.1";
}

GlooStoreFunctions GlooStoreOverCoordination(CoordinationClient& coordination, const std::string& name) {
  const std::string prefix = absl::StrCat("lockstep/gloo/", name, "/");
  GlooStoreFunctions f;
  f.set = [&coordination, prefix](const std::string& key, const std::string& value) {
    const absl::Status status = coordination.Set(prefix + key, value, /*overwrite=*/true);
    if (!status.ok()) throw CollectiveError(absl::StrCat("gloo rendezvous: setting '", prefix, key, "': ", status.ToString()));
  };
  f.get = [&coordination, prefix](const std::string& key, std::chrono::milliseconds timeout) {
    absl::StatusOr<std::string> value = coordination.Get(prefix + key, absl::FromChrono(timeout));
    if (value.ok()) return *value;
    const std::string message =
        absl::StrCat("gloo rendezvous: waiting for '", prefix, key, "': ", value.status().ToString());
    if (absl::IsDeadlineExceeded(value.status())) throw CollectiveTimeoutError(message);
    throw CollectiveError(message);
  };
  f.try_get = [&coordination, prefix](const std::string& key) -> std::optional<std::string> {
    absl::StatusOr<std::optional<std::string>> value = coordination.TryGet(prefix + key);
    if (!value.ok()) {
      throw CollectiveError(absl::StrCat("gloo rendezvous: reading '", prefix, key, "': ", value.status().ToString()));
    }
    return *value;
  };
  f.erase = [&coordination, prefix](const std::string& key) {
    absl::StatusOr<bool> erased = coordination.Delete(prefix + key);
    if (!erased.ok()) {
      throw CollectiveError(absl::StrCat("gloo rendezvous: deleting '", prefix, key, "': ", erased.status().ToString()));
    }
    return *erased;
  };
  return f;
}

}  // namespace lockstep
