// Shared by the coordination service and client; not part of the public API.
#ifndef LOCKSTEP_SRC_COORDINATION_COORDINATION_INTERNAL_H_
#define LOCKSTEP_SRC_COORDINATION_COORDINATION_INTERNAL_H_

#include <memory>
#include <string>
#include <utility>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "lockstep/coordination.h"
#include "proto/coordination.pb.h"

namespace lockstep {

inline constexpr char kJobIdMetadata[] = "lockstep-job-id";
inline constexpr char kTokenMetadata[] = "lockstep-token";
// Trailing metadata of an ABORTED call: the failed rank, a serialized PeerInfo.
inline constexpr char kFailedPeerMetadata[] = "lockstep-failed-peer-bin";

// "host:port" or "[v6]:port" -> (host, port). Errors: INVALID_ARGUMENT naming it.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);
// Errors: NOT_FOUND naming `what` and the path.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what);

// A service with no listening port, reached only through `channel` (gRPC's
// in-process transport): for fuzzing the request handlers without a network.
struct InProcessCoordination {
  std::unique_ptr<CoordinationService> service;
  std::shared_ptr<grpc::Channel> channel;
};
absl::StatusOr<InProcessCoordination> StartInProcessCoordinationService(const CoordinationServiceOptions& options);

PeerInfo FromProto(const coordination::PeerInfo& peer);
coordination::PeerInfo ToProto(const PeerInfo& peer);

}  // namespace lockstep

#endif  // LOCKSTEP_SRC_COORDINATION_COORDINATION_INTERNAL_H_
