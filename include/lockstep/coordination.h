// Coordination: a gRPC service that the ranks of one job share, and a client per
// rank. The service runs inside rank 0 by default, or standalone
// (lockstep_coordinator) for jobs that must outlive rank 0.
//
// What it gives the job:
//   - registration: each rank says who it is (rank, host, pid, incarnation);
//     registration returns once every rank has registered, with the roster.
//   - failure detection: each client sends a heartbeat every heartbeat_interval;
//     a rank that misses them for heartbeat_timeout is declared dead, and every
//     other rank learns it at once through its event stream (on_event). A client
//     that loses the service itself (rank 0 died) for heartbeat_timeout, or whose
//     event stream breaks while the service does not answer, declares it lost.
//   - a key-value store (set, blocking get with a timeout, try-get, list by
//     prefix, delete) and named barriers with timeouts that name the missing ranks.
//   - error reports and preemption notices, broadcast to every rank.
//   - orderly shutdown: each rank says goodbye; the service stops once every live
//     rank has.
//
// Security: every call carries the job id and token as gRPC metadata; the service
// compares them in constant time and refuses anything else with UNAUTHENTICATED
// (and logs the refusal). Without TLS the token travels in clear text: use TLS
// (TlsOptions) on networks you do not trust. The service binds to the address it
// is given, not to every interface, unless asked (bind_all).
//
// Errors are absl::Status; each method lists the codes it returns. Every method
// may also return UNAUTHENTICATED (wrong job id or token), UNAVAILABLE (service
// unreachable) and ABORTED (the job already failed; the message says why).
// ToException() turns a status into the trainer's exceptions at one boundary.
#ifndef LOCKSTEP_COORDINATION_H_
#define LOCKSTEP_COORDINATION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lockstep/errors.h"

namespace lockstep {

struct TlsOptions {
  // Service side: PEM certificate chain and private key. Both or neither.
  std::string cert_file;
  std::string key_file;
  // Client side: PEM root certificates that the service's certificate must chain
  // to. Empty with a service certificate configured: the system roots.
  std::string ca_file;
  bool enabled() const { return !cert_file.empty() || !ca_file.empty(); }
};

struct CoordinationServiceOptions {
  // host:port to listen on; port 0 picks a free one (see CoordinationService::port).
  std::string address = "127.0.0.1:0";
  // Listen on every interface at address's port instead of address's host.
  bool bind_all = false;
  std::string job_id;
  std::string token;  // must not be empty
  int world_size = 1;
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  TlsOptions tls;
  // Bounds on what one client may ask for.
  int64_t max_message_bytes = 4 << 20;
  int64_t max_key_bytes = 1024;
  int64_t max_value_bytes = 1 << 20;
  int64_t max_keys = 100000;
  absl::Duration max_wait = absl::Hours(24);  // longest blocking get / barrier / registration
  bool log_refusals = true;  // refused calls on stderr
  // Fault-tolerant jobs: a rank that dies (its heartbeats stop, or its connection
  // closes without a goodbye) leaves the job instead of failing it, as long as
  // `min_ranks` ranks remain. Each change of membership starts an epoch: the
  // service sets "lockstep/ft/epoch" to the epoch's number and
  // "lockstep/ft/epoch/<n>" to its ranks ("0,2"), epoch 0 being the whole world
  // once it has registered, and sends a kMemberLeft event. Barriers then wait for
  // the live ranks only, and a removed rank's heartbeats are refused (ABORTED).
  // A new process that registers in a dead rank's place (a replacement) starts
  // the next epoch with it, and a kMemberJoined event goes out. A blocking get
  // that waits across a change of epoch ends with FAILED_PRECONDITION (its key
  // may be one that a rank now gone was to set).
  bool fault_tolerant = false;
  int min_ranks = 1;
};

// Keys of the fault-tolerant membership (CoordinationServiceOptions::fault_tolerant).
inline constexpr char kEpochKey[] = "lockstep/ft/epoch";
std::string EpochMembersKey(int64_t epoch);  // "lockstep/ft/epoch/<epoch>"

class CoordinationService {
 public:
  // Starts serving. Errors: INVALID_ARGUMENT (empty token, world size < 1,
  // malformed address, unreadable TLS files), UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<CoordinationService>> Start(const CoordinationServiceOptions& options);
  virtual ~CoordinationService() = default;

  virtual int port() const = 0;
  // Failure of the job as the service sees it; empty while healthy.
  virtual std::string failure() const = 0;
  // Waits until every registered rank has said goodbye or died (at most
  // `drain`), tells the watchers, then stops. Idempotent; the destructor calls it
  // with no drain.
  virtual void Shutdown(absl::Duration drain) = 0;
  // Blocks until Shutdown or, if `until_all_gone`, until every rank of a world
  // that registered completely has said goodbye or died (standalone coordinator).
  virtual void Wait(bool until_all_gone) = 0;
};

struct PeerInfo {
  int rank = -1;
  std::string host;
  int64_t pid = 0;
  uint64_t incarnation = 0;
};

// Names a peer in messages: "rank 1 (host node7, pid 4242)".
std::string DescribePeer(const PeerInfo& peer);

struct CoordinationEvent {
  // kMemberLeft: a fault-tolerant job lost `peer` and goes on without it;
  // kMemberJoined: a new process took the place of a rank that had left.
  enum class Kind { kPeerFailed, kCoordinatorLost, kPreemptionNotice, kShutdown, kMemberLeft, kMemberJoined };
  Kind kind = Kind::kPeerFailed;
  PeerInfo peer;        // the rank concerned (rank 0 for kCoordinatorLost when hosted there)
  std::string message;  // complete: names the rank, its host and what happened
};

struct CoordinationClientOptions {
  std::string address;  // host:port of the service
  std::string job_id;
  std::string token;
  int rank = 0;
  int world_size = 1;
  std::string host;  // default: this machine's host name
  int64_t pid = 0;   // default: this process
  uint64_t incarnation = 0;  // default: random
  // Default heartbeat_interval: heartbeat_timeout / 10, at least 100 ms.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  absl::Duration register_timeout = absl::Minutes(5);
  absl::Duration rpc_timeout = absl::Seconds(30);  // calls that do not wait by design
  TlsOptions tls;
  // Where the service runs, for messages when it is lost (e.g. "rank 0 (host a)").
  std::string service_owner = "the coordination service";
  // Called for every event, first failure included: on the client's own threads,
  // or on the thread of a call that learnt of the job's failure first (ABORTED),
  // so that failure() holds it by the time that call returns. Must not call back
  // into the client's blocking methods.
  std::function<void(const CoordinationEvent&)> on_event;
};

class CoordinationClient {
 public:
  // Registers and waits until every rank has, then starts heartbeats and the event
  // stream. Errors: INVALID_ARGUMENT (bad options), ALREADY_EXISTS (the rank is
  // held by another live process), FAILED_PRECONDITION (the world size differs
  // from the service's or another rank's), DEADLINE_EXCEEDED (ranks missing after
  // register_timeout; the message lists them), UNAUTHENTICATED, UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<CoordinationClient>> Connect(const CoordinationClientOptions& options);
  virtual ~CoordinationClient() = default;  // says goodbye if Goodbye was not called

  virtual const std::vector<PeerInfo>& roster() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Errors: INVALID_ARGUMENT (key or value over the limits, empty key),
  // ALREADY_EXISTS (overwrite false and the key exists), RESOURCE_EXHAUSTED (the
  // store holds max_keys keys, or the request is over max_message_bytes).
  virtual absl::Status Set(const std::string& key, const std::string& value, bool overwrite = true) = 0;
  // Waits up to `timeout` for the key. Errors: DEADLINE_EXCEEDED (not set in
  // time; the message names the key), INVALID_ARGUMENT.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // Does not wait: nullopt when absent. Errors: INVALID_ARGUMENT.
  virtual absl::StatusOr<std::optional<std::string>> TryGet(const std::string& key) = 0;
  // Every key starting with `prefix`, sorted by key.
  virtual absl::StatusOr<std::vector<std::pair<std::string, std::string>>> List(const std::string& prefix) = 0;
  // Returns whether the key was there.
  virtual absl::StatusOr<bool> Delete(const std::string& key) = 0;

  // Waits until every rank has arrived at the barrier `name` as often as this
  // rank has (a name may be reused). Errors: DEADLINE_EXCEEDED naming the ranks
  // that did not arrive within `timeout`, INVALID_ARGUMENT.
  virtual absl::Status Barrier(const std::string& name, absl::Duration timeout) = 0;

  // Tells every rank that this one failed with `message`; the job fails.
  virtual absl::Status ReportError(const std::string& message) = 0;
  // Tells every rank that this one received a preemption notice (`reason`).
  virtual absl::Status ReportPreemption(const std::string& reason) = 0;

  // The rank's current step, sent with heartbeats (diagnostics only).
  virtual void SetStep(int64_t step) = 0;
  // The first failure this client learnt of (a dead peer, a reported error, the
  // service lost); nullopt while healthy.
  virtual std::optional<CoordinationEvent> failure() const = 0;

  // Stops heartbeats and tells the service this rank is done (unless the service
  // is already known lost: then it only stops the heartbeats). Idempotent.
  virtual absl::Status Goodbye() = 0;
};

// Where the service is, resolved from, in order: `configured` (config or flag),
// MASTER_ADDR + MASTER_PORT, the first host of SLURM_JOB_NODELIST (port:
// `default_port`). Empty when none is set. Errors: INVALID_ARGUMENT naming the
// variable (no port, malformed node list).
absl::StatusOr<std::string> ResolveCoordinatorAddress(const std::string& configured, int default_port);
// The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07".
absl::StatusOr<std::string> FirstSlurmHost(const std::string& nodelist);
// The job token: LOCKSTEP_JOB_TOKEN, else the contents of `token_file` or
// LOCKSTEP_JOB_TOKEN_FILE (trailing whitespace removed). Empty when none is set.
// Errors: NOT_FOUND / PERMISSION_DENIED naming an unreadable file,
// INVALID_ARGUMENT for an empty file.
absl::StatusOr<std::string> ResolveJobToken(const std::string& token_file);
// 32 random bytes from the system's entropy source, as 64 hex digits.
std::string GenerateJobToken();
// Equal contents, in time that depends on the lengths only.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

// The coordination layer failed: the service is unreachable, refused a call, or
// the job failed elsewhere.
class CoordinationError : public Error {
 public:
  using Error::Error;
};
// The boundary between absl::Status and the trainer's exceptions: throws
// CoordinationError (InvalidArgumentError for INVALID_ARGUMENT) with `context`
// and the status message; returns when the status is OK.
void ThrowIfError(const absl::Status& status, const std::string& context);

}  // namespace lockstep

#endif  // LOCKSTEP_COORDINATION_H_
