// The coordination service: a synchronous gRPC server whose state sits under one
// mutex. Calls that wait (registration, blocking get, barrier, the event stream)
// wait on that mutex's conditions in short slices, so that a cancelled call (the
// client died) and a stopping service release them promptly.
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordination_internal.h"
#include "lockstep/coordination.h"
#include "proto/coordination.grpc.pb.h"

namespace lockstep {
namespace {

namespace pb = ::lockstep::coordination;

constexpr absl::Duration kPollSlice = absl::Milliseconds(200);
// How long a rank may be without an event stream (a client reconnecting, or
// one that cancels its stream right before its goodbye) before a fault-tolerant
// job counts it dead.
constexpr absl::Duration kStreamGrace = absl::Milliseconds(500);

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ", "); }

std::string Seconds(absl::Duration d) { return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d)); }

class Service final : public pb::Coordination::Service, public CoordinationService {
 public:
  Service(const CoordinationServiceOptions& options, bool in_process)
      : options_(options), in_process_(in_process), ranks_(options.world_size) {}

  ~Service() override {
    Shutdown(absl::ZeroDuration());
    // gRPC's Shutdown has waited for every handler; taking the mutex once more
    // orders their last accesses (made under it) before the members' destruction
    // for ThreadSanitizer too, which cannot see gRPC's own wait.
    absl::MutexLock lock(&mu_);
  }

  absl::Status Start() {
    if (in_process_) {
      grpc::ServerBuilder builder;
      builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
      builder.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
      builder.RegisterService(this);
      server_ = builder.BuildAndStart();
      if (!server_) return absl::InternalError("coordination service: cannot start an in-process server");
      monitor_ = std::thread([this] { MonitorHeartbeats(); });
      return absl::OkStatus();
    }
    auto split = SplitHostPort(options_.address);
    if (!split.ok()) return split.status();
    const std::string listen = options_.bind_all ? absl::StrCat("0.0.0.0:", split->second) : options_.address;
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (!options_.tls.cert_file.empty() || !options_.tls.key_file.empty()) {
      if (options_.tls.cert_file.empty() || options_.tls.key_file.empty()) {
        return absl::InvalidArgumentError("TLS needs both a certificate file and a key file");
      }
      absl::StatusOr<std::string> cert = ReadWholeFile(options_.tls.cert_file, "TLS certificate");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadWholeFile(options_.tls.key_file, "TLS key");
      if (!key.ok()) return key.status();
      grpc::SslServerCredentialsOptions ssl;
      ssl.pem_key_cert_pairs.push_back({*key, *cert});
      credentials = grpc::SslServerCredentials(ssl);
    }
    grpc::ServerBuilder builder;
    builder.AddListeningPort(listen, credentials, &port_);
    // A port is one job's: without this, gRPC's SO_REUSEPORT lets a second service
    // bind the same port and take some of the first one's connections.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) {
      return absl::UnavailableError(absl::StrCat("coordination service: cannot listen on ", listen,
                                                 " (address in use, or not an address of this host?)"));
    }
    monitor_ = std::thread([this] { MonitorHeartbeats(); });
    return absl::OkStatus();
  }

  int port() const override { return port_; }

  std::shared_ptr<grpc::Channel> InProcessChannel() {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
    args.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
    return server_->InProcessChannel(args);
  }

  std::string failure() const override {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

  void Shutdown(absl::Duration drain) override {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      const absl::Time deadline = absl::Now() + drain;
      // Wait for every live rank to say goodbye, so that none loses the service
      // while it still needs it.
      while (!AllGoneLocked() && absl::Now() < deadline) {
        auto all_gone = [this] { return AllGoneLocked(); };
        mu_.AwaitWithDeadline(absl::Condition(&all_gone), std::min(deadline, absl::Now() + kPollSlice));
      }
      stopping_ = true;
      PushEventLocked(pb::Event::SHUTDOWN, PeerInfo{}, "the coordination service is shutting down");
    }
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    if (monitor_.joinable()) monitor_.join();
  }

  void Wait(bool until_all_gone) override {
    absl::MutexLock lock(&mu_);
    auto done = [this, until_all_gone] {
      return stopping_ || (until_all_gone && world_complete_ && AllGoneLocked());
    };
    mu_.Await(absl::Condition(&done));
  }

  // --- RPCs ---

  grpc::Status Register(grpc::ServerContext* context, const pb::RegisterRequest* request,
                        pb::RegisterResponse* response) override {
    if (auto s = Authenticate(context, "Register"); !s.ok()) return ToGrpc(s);
    const pb::PeerInfo& peer = request->peer();
    if (request->world_size() != options_.world_size) {
      return ToGrpc(absl::FailedPreconditionError(
          absl::StrFormat("rank %d (host %s, pid %d) says the world has %d ranks; this job has %d", peer.rank(),
                          peer.host(), peer.pid(), request->world_size(), options_.world_size)));
    }
    if (auto s = CheckRank(peer.rank()); !s.ok()) return ToGrpc(s);
    const absl::Duration timeout = ClampWait(request->timeout_ms());
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return AbortedLocked(context);
    RankState& slot = ranks_[peer.rank()];
    const absl::Time now = absl::Now();
    if (slot.registered && !slot.gone && !slot.dead && slot.info.incarnation != peer.incarnation() &&
        now - slot.last_heartbeat < options_.heartbeat_timeout) {
      return ToGrpc(absl::AlreadyExistsError(absl::StrCat("rank ", peer.rank(), " is held by a live process, ",
                                                          DescribePeer(slot.info), "; refused ",
                                                          DescribePeer(FromProto(peer)))));
    }
    // A fault-tolerant job takes a new process in the place of a rank that left.
    const bool rejoin = options_.fault_tolerant && world_complete_ && slot.dead;
    slot.info = FromProto(peer);
    slot.registered = true;
    slot.gone = slot.dead = false;
    slot.last_heartbeat = now;
    slot.removal.clear();
    if (rejoin) {
      PublishEpochLocked();
      const std::string joined = absl::StrCat(DescribePeer(slot.info), " joined in the place of a rank that left; ranks ",
                                              RankList(LiveRanksLocked()), " (epoch ", epoch_, ")");
      std::fprintf(stderr, "coordination service: %s\n", joined.c_str());
      PushEventLocked(pb::Event::MEMBER_JOINED, slot.info, joined);
    }
    if (AllRegisteredLocked() && !world_complete_) {
      world_complete_ = true;
      for (RankState& r : ranks_) r.last_heartbeat = now;  // the clock starts for everyone at once
      if (options_.fault_tolerant) PublishEpochLocked();
    }
    const absl::Time deadline = now + timeout;
    auto ready = [this] { return world_complete_ || stopping_ || !failure_.empty(); };
    while (!ready()) {
      if (context->IsCancelled()) {
        slot.registered = false;  // the caller went away before the world was complete
        return grpc::Status(grpc::StatusCode::CANCELLED, "registration cancelled by the client");
      }
      if (absl::Now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < options_.world_size; ++r) {
          if (!ranks_[r].registered) missing.push_back(r);
        }
        return ToGrpc(absl::DeadlineExceededError(absl::StrFormat(
            "%s of %d did not register within %s", (missing.size() == 1 ? "rank " : "ranks ") + RankList(missing),
            options_.world_size, Seconds(timeout))));
      }
      mu_.AwaitWithDeadline(absl::Condition(&ready), std::min(deadline, absl::Now() + kPollSlice));
    }
    if (!failure_.empty()) return AbortedLocked(context);
    if (stopping_) return ToGrpc(absl::UnavailableError("the coordination service is shutting down"));
    for (const RankState& r : ranks_) *response->add_roster() = ToProto(r.info);
    response->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(options_.heartbeat_timeout));
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* context, const pb::HeartbeatRequest* request,
                         pb::HeartbeatResponse*) override {
    if (auto s = Authenticate(context, "Heartbeat"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    RankState& slot = ranks_[request->rank()];
    if (auto s = CheckRegisteredLocked(context, "heartbeat", request->rank(), request->incarnation()); !s.ok()) {
      return ToGrpc(s);
    }
    if (!failure_.empty()) return AbortedLocked(context);
    if (slot.dead) {
      // Only in a fault-tolerant job does a dead rank's slot outlive the job's failure.
      return ToGrpc(absl::AbortedError(absl::StrCat(DescribePeer(slot.info), " was removed from the job: ",
                                                    slot.removal)));
    }
    slot.last_heartbeat = absl::Now();
    slot.step = request->step();
    return grpc::Status::OK;
  }

  grpc::Status Set(grpc::ServerContext* context, const pb::SetRequest* request, pb::SetResponse*) override {
    if (auto s = Authenticate(context, "Set"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckKey(request->kv().key()); !s.ok()) return ToGrpc(s);
    if (static_cast<int64_t>(request->kv().value().size()) > options_.max_value_bytes) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrFormat("value of key '%s' has %d bytes; the limit is %d",
                                                               request->kv().key(), request->kv().value().size(),
                                                               options_.max_value_bytes)));
    }
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return AbortedLocked(context);
    auto it = kv_.find(request->kv().key());
    if (it != kv_.end()) {
      if (!request->overwrite()) {
        return ToGrpc(absl::AlreadyExistsError(absl::StrCat("key '", request->kv().key(), "' is already set")));
      }
      it->second = request->kv().value();
      return grpc::Status::OK;
    }
    if (static_cast<int64_t>(kv_.size()) >= options_.max_keys) {
      return ToGrpc(absl::ResourceExhaustedError(
          absl::StrCat("the key-value store holds ", kv_.size(), " keys, its limit; delete some first")));
    }
    kv_.emplace(request->kv().key(), request->kv().value());
    return grpc::Status::OK;
  }

  grpc::Status Get(grpc::ServerContext* context, const pb::GetRequest* request, pb::GetResponse* response) override {
    if (auto s = Authenticate(context, "Get"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckKey(request->key()); !s.ok()) return ToGrpc(s);
    const absl::Duration timeout = ClampWait(request->timeout_ms());
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + timeout;
    // In a fault-tolerant job a wait ends when the membership changes: the key
    // may be one that a rank now gone was to set (a checkpoint's shard report).
    const int64_t start_epoch = epoch_;
    auto ready = [this, request, start_epoch] {
      return kv_.count(request->key()) > 0 || stopping_ || !failure_.empty() || epoch_ != start_epoch;
    };
    while (!ready() && request->timeout_ms() > 0) {
      if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "get cancelled by the client");
      if (absl::Now() >= deadline) {
        return ToGrpc(absl::DeadlineExceededError(
            absl::StrCat("key '", request->key(), "' was not set within ", Seconds(timeout))));
      }
      mu_.AwaitWithDeadline(absl::Condition(&ready), std::min(deadline, absl::Now() + kPollSlice));
    }
    if (!failure_.empty()) return AbortedLocked(context);
    auto it = kv_.find(request->key());
    if (it != kv_.end()) {
      response->set_found(true);
      response->set_value(it->second);
    } else if (stopping_) {
      return ToGrpc(absl::UnavailableError("the coordination service is shutting down"));
    } else if (epoch_ != start_epoch && request->timeout_ms() > 0) {
      return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
          "the job's membership changed (epoch ", epoch_, ") while waiting for key '", request->key(), "'")));
    }
    return grpc::Status::OK;
  }

  grpc::Status List(grpc::ServerContext* context, const pb::ListRequest* request, pb::ListResponse* response) override {
    if (auto s = Authenticate(context, "List"); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return AbortedLocked(context);
    int64_t bytes = 0;
    for (auto it = kv_.lower_bound(request->prefix()); it != kv_.end() && it->first.rfind(request->prefix(), 0) == 0;
         ++it) {
      bytes += static_cast<int64_t>(it->first.size() + it->second.size() + 8);
      if (bytes > options_.max_message_bytes) {
        return ToGrpc(absl::ResourceExhaustedError(absl::StrCat("the keys under '", request->prefix(), "' exceed ",
                                                                options_.max_message_bytes,
                                                                " bytes; list a narrower prefix")));
      }
      pb::KeyValue* kv = response->add_kvs();
      kv->set_key(it->first);
      kv->set_value(it->second);
    }
    return grpc::Status::OK;
  }

  grpc::Status Delete(grpc::ServerContext* context, const pb::DeleteRequest* request,
                      pb::DeleteResponse* response) override {
    if (auto s = Authenticate(context, "Delete"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckKey(request->key()); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return AbortedLocked(context);
    response->set_deleted(kv_.erase(request->key()) > 0);
    return grpc::Status::OK;
  }

  grpc::Status Barrier(grpc::ServerContext* context, const pb::BarrierRequest* request,
                       pb::BarrierResponse*) override {
    if (auto s = Authenticate(context, "Barrier"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    if (request->name().empty() || static_cast<int64_t>(request->name().size()) > options_.max_key_bytes) {
      return ToGrpc(absl::InvalidArgumentError("a barrier name must have 1 to max_key_bytes bytes"));
    }
    const absl::Duration timeout = ClampWait(request->timeout_ms());
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return AbortedLocked(context);
    auto [it, inserted] = barriers_.try_emplace(request->name());
    if (inserted && static_cast<int64_t>(barriers_.size()) > options_.max_keys) {
      barriers_.erase(it);
      return ToGrpc(absl::ResourceExhaustedError("too many distinct barrier names"));
    }
    std::vector<int64_t>& arrivals = it->second;
    if (arrivals.empty()) arrivals.assign(options_.world_size, 0);
    const int64_t generation = ++arrivals[request->rank()];
    // In a fault-tolerant job the ranks that left do not count.
    auto complete = [this, &arrivals, generation] {
      for (size_t r = 0; r < arrivals.size(); ++r) {
        if (arrivals[r] < generation && !ranks_[r].dead) return false;
      }
      return true;
    };
    auto ready = [&] { return complete() || stopping_ || !failure_.empty(); };
    const absl::Time deadline = absl::Now() + timeout;
    while (!ready()) {
      if (context->IsCancelled()) {
        --arrivals[request->rank()];
        return grpc::Status(grpc::StatusCode::CANCELLED, "barrier cancelled by the client");
      }
      if (absl::Now() >= deadline) {
        std::vector<int> missing;
        for (int r = 0; r < options_.world_size; ++r) {
          if (arrivals[r] < generation && !ranks_[r].dead) missing.push_back(r);
        }
        return ToGrpc(absl::DeadlineExceededError(absl::StrFormat(
            "barrier '%s': %s of %d did not arrive within %s", request->name(),
            (missing.size() == 1 ? "rank " : "ranks ") + RankList(missing), options_.world_size, Seconds(timeout))));
      }
      mu_.AwaitWithDeadline(absl::Condition(&ready), std::min(deadline, absl::Now() + kPollSlice));
    }
    if (!failure_.empty()) return AbortedLocked(context);
    if (!complete()) return ToGrpc(absl::UnavailableError("the coordination service is shutting down"));
    return grpc::Status::OK;
  }

  grpc::Status ReportError(grpc::ServerContext* context, const pb::ErrorReport* request,
                           pb::ErrorReportResponse*) override {
    if (auto s = Authenticate(context, "ReportError"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    if (auto s = CheckRegisteredLocked(context, "error report", request->rank(), request->incarnation()); !s.ok()) {
      return ToGrpc(s);
    }
    const PeerInfo& peer = ranks_[request->rank()].info;
    FailLocked(peer, absl::StrCat(DescribePeer(peer), " failed: ", request->message().substr(0, 4096)));
    return grpc::Status::OK;
  }

  grpc::Status ReportPreemption(grpc::ServerContext* context, const pb::PreemptionNotice* request,
                                pb::PreemptionNoticeResponse*) override {
    if (auto s = Authenticate(context, "ReportPreemption"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    if (auto s = CheckRegisteredLocked(context, "preemption notice", request->rank(), request->incarnation()); !s.ok()) {
      return ToGrpc(s);
    }
    const PeerInfo& peer = ranks_[request->rank()].info;
    PushEventLocked(pb::Event::PREEMPTION_NOTICE, peer,
                    absl::StrCat(DescribePeer(peer), " received a preemption notice (",
                                 request->reason().substr(0, 256), ")"));
    return grpc::Status::OK;
  }

  grpc::Status WatchEvents(grpc::ServerContext* context, const pb::WatchRequest* request,
                           grpc::ServerWriter<pb::Event>* writer) override {
    if (auto s = Authenticate(context, "WatchEvents"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    // A fault-tolerant job reads a watcher's stream that closes without a goodbye
    // as the rank's death (a killed process), well before its heartbeats lapse.
    {
      absl::MutexLock lock(&mu_);
      RankState& slot = ranks_[request->rank()];
      ++slot.watchers;
      slot.stream_lost.reset();
    }
    struct StreamEnd {
      Service* service;
      int rank;
      ~StreamEnd() {
        absl::MutexLock lock(&service->mu_);
        RankState& slot = service->ranks_[rank];
        if (--slot.watchers == 0) slot.stream_lost = absl::Now();
      }
    } stream_end{this, request->rank()};
    int64_t next = std::max<int64_t>(request->after_sequence(), 0);
    while (true) {
      std::vector<pb::Event> batch;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this, next] { return static_cast<int64_t>(events_.size()) > next; };
        mu_.AwaitWithTimeout(absl::Condition(&ready), kPollSlice);
        batch.assign(events_.begin() + std::min<int64_t>(next, events_.size()), events_.end());
        next = static_cast<int64_t>(events_.size());
      }
      for (const pb::Event& event : batch) {
        if (!writer->Write(event)) return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
        if (event.kind() == pb::Event::SHUTDOWN) return grpc::Status::OK;
      }
      if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
    }
  }

  grpc::Status Goodbye(grpc::ServerContext* context, const pb::GoodbyeRequest* request,
                       pb::GoodbyeResponse*) override {
    if (auto s = Authenticate(context, "Goodbye"); !s.ok()) return ToGrpc(s);
    if (auto s = CheckRank(request->rank()); !s.ok()) return ToGrpc(s);
    absl::MutexLock lock(&mu_);
    if (auto s = CheckRegisteredLocked(context, "goodbye", request->rank(), request->incarnation()); !s.ok()) {
      return ToGrpc(s);
    }
    ranks_[request->rank()].gone = true;
    return grpc::Status::OK;
  }

 private:
  struct RankState {
    PeerInfo info;
    bool registered = false;
    bool gone = false;  // said goodbye
    bool dead = false;  // missed its heartbeats
    absl::Time last_heartbeat;
    int64_t step = -1;
    int watchers = 0;  // open event streams
    std::optional<absl::Time> stream_lost;  // when its last event stream closed
    std::string removal;  // fault-tolerant jobs: why the rank was removed
  };

  absl::Status Authenticate(grpc::ServerContext* context, const char* method) {
    const auto& metadata = context->client_metadata();
    auto value = [&metadata](const char* key) -> std::optional<std::string> {
      auto it = metadata.find(key);
      if (it == metadata.end()) return std::nullopt;
      return std::string(it->second.data(), it->second.size());
    };
    const std::optional<std::string> job = value(kJobIdMetadata);
    const std::optional<std::string> token = value(kTokenMetadata);
    const char* problem = nullptr;
    if (!job || !token) {
      problem = "no job id or token";
    } else if (!ConstantTimeEquals(*job, options_.job_id)) {
      problem = "wrong job id";
    } else if (!ConstantTimeEquals(*token, options_.token)) {
      problem = "wrong job token";
    }
    if (problem == nullptr) return absl::OkStatus();
    if (options_.log_refusals) {
      std::fprintf(stderr, "coordination service: refused %s from %s: %s\n", method, context->peer().c_str(), problem);
    }
    return absl::UnauthenticatedError(absl::StrCat("coordination service refused the call: ", problem));
  }

  // A per-rank call must come from the incarnation that registered the rank; any
  // other caller (a stale process, a client that never registered) is refused and
  // logged, and changes nothing.
  absl::Status CheckRegisteredLocked(grpc::ServerContext* context, const char* what, int rank, uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const RankState& slot = ranks_[rank];
    if (slot.registered && slot.info.incarnation == incarnation) return absl::OkStatus();
    const std::string why =
        absl::StrCat(what, " for rank ", rank, " from incarnation ", incarnation, ", which is not the registered one",
                     slot.registered ? " (" + DescribePeer(slot.info) + ")" : " (the rank has not registered)");
    if (options_.log_refusals) {
      std::fprintf(stderr, "coordination service: refused %s from %s\n", why.c_str(), context->peer().c_str());
    }
    return absl::FailedPreconditionError(why);
  }

  absl::Status CheckRank(int rank) const {
    if (rank < 0 || rank >= options_.world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, " is outside this job's world of ", options_.world_size));
    }
    return absl::OkStatus();
  }

  absl::Status CheckKey(const std::string& key) const {
    if (key.empty()) return absl::InvalidArgumentError("empty key");
    if (static_cast<int64_t>(key.size()) > options_.max_key_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("key of ", key.size(), " bytes; the limit is ", options_.max_key_bytes));
    }
    return absl::OkStatus();
  }

  absl::Duration ClampWait(int64_t timeout_ms) const {
    return std::clamp(absl::Milliseconds(std::max<int64_t>(timeout_ms, 0)), absl::ZeroDuration(), options_.max_wait);
  }

  bool AllRegisteredLocked() const {
    return std::all_of(ranks_.begin(), ranks_.end(), [](const RankState& r) { return r.registered; });
  }
  bool AllGoneLocked() const {
    return std::all_of(ranks_.begin(), ranks_.end(),
                       [](const RankState& r) { return !r.registered || r.gone || r.dead; });
  }

  void PushEventLocked(pb::Event::Kind kind, const PeerInfo& peer, const std::string& message) {
    pb::Event& event = events_.emplace_back();
    event.set_kind(kind);
    *event.mutable_peer() = ToProto(peer);
    event.set_message(message);
    event.set_sequence(static_cast<int64_t>(events_.size()));
  }

  // ABORTED with the job's failure, and the failed rank in the trailing metadata
  // (kFailedPeerMetadata), so that a client that hears of it from a call knows who
  // failed as well as one that hears of it from the event stream.
  grpc::Status AbortedLocked(grpc::ServerContext* context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    context->AddTrailingMetadata(kFailedPeerMetadata, ToProto(failed_peer_).SerializeAsString());
    return ToGrpc(absl::AbortedError(failure_));
  }

  void FailLocked(const PeerInfo& peer, const std::string& message) {
    if (!failure_.empty()) return;  // the first failure is the one that matters
    failure_ = message;
    failed_peer_ = peer;
    std::fprintf(stderr, "coordination service: %s\n", message.c_str());
    PushEventLocked(pb::Event::PEER_FAILED, peer, message);
  }

  // A rank found dead: the job fails, or, when fault-tolerant and enough ranks
  // remain, goes on without it in a new epoch.
  void DeclareDeadLocked(RankState& r, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    r.dead = true;
    r.removal = why;
    const std::string message = absl::StrCat(DescribePeer(r.info), " is dead: ", why);
    if (!options_.fault_tolerant || !failure_.empty()) {
      FailLocked(r.info, message);
      return;
    }
    const std::vector<int> live = LiveRanksLocked();
    if (static_cast<int>(live.size()) < options_.min_ranks) {
      FailLocked(r.info, absl::StrCat(message, "; ", live.size(), " rank(s) left, fewer than min_ranks ",
                                      options_.min_ranks));
      return;
    }
    PublishEpochLocked();
    const std::string left = absl::StrCat(message, "; the job goes on with ranks ", RankList(live), " (epoch ", epoch_,
                                          ")");
    std::fprintf(stderr, "coordination service: %s\n", left.c_str());
    PushEventLocked(pb::Event::MEMBER_LEFT, r.info, left);
  }

  std::vector<int> LiveRanksLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<int> live;
    for (int i = 0; i < options_.world_size; ++i) {
      if (!ranks_[i].dead) live.push_back(i);
    }
    return live;
  }

  // Starts the next epoch (the first: 0) with the live ranks.
  void PublishEpochLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (world_epochs_ > 0) ++epoch_;
    ++world_epochs_;
    std::vector<std::string> names;
    for (int r : LiveRanksLocked()) names.push_back(std::to_string(r));
    kv_[EpochMembersKey(epoch_)] = absl::StrJoin(names, ",");
    kv_[kEpochKey] = std::to_string(epoch_);
  }

  void MonitorHeartbeats() {
    const absl::Duration tick = std::clamp(options_.heartbeat_timeout / 20, absl::Milliseconds(10), kPollSlice);
    absl::MutexLock lock(&mu_);
    while (!stopping_) {
      auto stop = [this] { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), tick);
      if (stopping_ || !world_complete_) continue;
      const absl::Time now = absl::Now();
      for (RankState& r : ranks_) {
        if (!r.registered || r.gone || r.dead) continue;
        const std::string seen = r.step >= 0 ? absl::StrCat(" (last seen at step ", r.step, ")") : "";
        if (now - r.last_heartbeat > options_.heartbeat_timeout) {
          DeclareDeadLocked(r, absl::StrCat("no heartbeat for ", Seconds(now - r.last_heartbeat), seen));
        } else if (options_.fault_tolerant && r.watchers == 0 && r.stream_lost &&
                   now - *r.stream_lost > kStreamGrace) {
          DeclareDeadLocked(r, absl::StrCat("its connection closed without a goodbye (the process exited or was "
                                            "killed)", seen));
        }
      }
    }
  }

  const CoordinationServiceOptions options_;
  const bool in_process_;  // no listening port: reached through InProcessChannel() only
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::thread monitor_;

  mutable absl::Mutex mu_;
  std::vector<RankState> ranks_ ABSL_GUARDED_BY(mu_);
  bool world_complete_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string failure_ ABSL_GUARDED_BY(mu_);
  PeerInfo failed_peer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<int64_t>> barriers_ ABSL_GUARDED_BY(mu_);
  std::vector<pb::Event> events_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;        // fault-tolerant jobs: the current membership's number
  int64_t world_epochs_ ABSL_GUARDED_BY(mu_) = 0;  // epochs published so far
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinationService>> CoordinationService::Start(
    const CoordinationServiceOptions& options) {
  if (options.token.empty()) return absl::InvalidArgumentError("coordination service: the job token is empty");
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("coordination service: world size ", options.world_size));
  }
  if (options.heartbeat_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordination service: heartbeat timeout must be positive");
  }
  if (options.fault_tolerant && (options.min_ranks < 1 || options.min_ranks > options.world_size)) {
    return absl::InvalidArgumentError(absl::StrCat("coordination service: min_ranks must be in [1, ", options.world_size,
                                                   "], got ", options.min_ranks));
  }
  auto service = std::make_unique<Service>(options, /*in_process=*/false);
  if (absl::Status s = service->Start(); !s.ok()) return s;
  return service;
}

absl::StatusOr<InProcessCoordination> StartInProcessCoordinationService(const CoordinationServiceOptions& options) {
  if (options.token.empty()) return absl::InvalidArgumentError("coordination service: the job token is empty");
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("coordination service: world size ", options.world_size));
  }
  auto service = std::make_unique<Service>(options, /*in_process=*/true);
  if (absl::Status s = service->Start(); !s.ok()) return s;
  InProcessCoordination result;
  result.channel = service->InProcessChannel();
  result.service = std::move(service);
  return result;
}

}  // namespace lockstep
