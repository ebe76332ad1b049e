// The coordination client: one gRPC channel, a heartbeat thread and an event
// thread that holds a server stream open. The first failure either thread learns
// of (a dead peer, a reported error, the service gone) is kept and handed to
// on_event once.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordination_internal.h"
#include "lockstep/coordination.h"
#include "lockstep/host.h"
#include "proto/coordination.grpc.pb.h"

namespace lockstep {
namespace {

namespace pb = ::lockstep::coordination;

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

class Client final : public CoordinationClient {
 public:
  explicit Client(CoordinationClientOptions options) : options_(std::move(options)) {}

  ~Client() override {
    (void)Goodbye();
    StopThreads();
  }

  absl::Status Connect() {
    if (options_.rank < 0 || options_.rank >= options_.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", options_.rank, " of a world of ", options_.world_size));
    }
    if (options_.token.empty()) return absl::InvalidArgumentError("the job token is empty");
    if (auto split = SplitHostPort(options_.address); !split.ok()) return split.status();
    if (options_.host.empty()) options_.host = HostName();
    if (options_.pid == 0) options_.pid = getpid();
    if (options_.incarnation == 0) {
      std::random_device entropy;
      options_.incarnation = (uint64_t{entropy()} << 32) | entropy();
    }
    if (options_.heartbeat_interval <= absl::ZeroDuration()) {
      options_.heartbeat_interval = std::max(options_.heartbeat_timeout / 10, absl::Milliseconds(100));
    }

    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (options_.tls.enabled()) {
      grpc::SslCredentialsOptions ssl;
      if (!options_.tls.ca_file.empty()) {
        absl::StatusOr<std::string> ca = ReadWholeFile(options_.tls.ca_file, "TLS CA");
        if (!ca.ok()) return ca.status();
        ssl.pem_root_certs = *ca;
      }
      credentials = grpc::SslCredentials(ssl);
    }
    grpc::ChannelArguments args;
    // Reconnect quickly: rank 0 may start its service after the others dial it.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetMaxReceiveMessageSize(64 << 20);
    channel_ = grpc::CreateCustomChannel(options_.address, credentials, args);
    stub_ = pb::Coordination::NewStub(channel_);

    pb::RegisterRequest request;
    *request.mutable_peer() = ToProto(PeerInfo{options_.rank, options_.host, options_.pid, options_.incarnation});
    request.set_world_size(options_.world_size);
    request.set_timeout_ms(absl::ToInt64Milliseconds(options_.register_timeout));
    pb::RegisterResponse response;
    grpc::ClientContext context;
    Prepare(context, options_.register_timeout + absl::Seconds(2));
    context.set_wait_for_ready(true);
    grpc::Status status = stub_->Register(&context, request, &response);
    if (!status.ok()) {
      absl::Status s = FromGrpc(status);
      if (s.code() == absl::StatusCode::kDeadlineExceeded && s.message().find("register") == std::string::npos) {
        return absl::DeadlineExceededError(absl::StrCat("no coordination service answered at ", options_.address,
                                                        " within ", absl::FormatDuration(options_.register_timeout)));
      }
      return s;
    }
    for (const pb::PeerInfo& peer : response.roster()) roster_.push_back(FromProto(peer));
    {
      absl::MutexLock lock(&mu_);
      connected_ = true;
    }
    heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
    watch_thread_ = std::thread([this] { WatchLoop(); });
    return absl::OkStatus();
  }

  const std::vector<PeerInfo>& roster() const override { return roster_; }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

  absl::Status Set(const std::string& key, const std::string& value, bool overwrite) override {
    pb::SetRequest request;
    request.mutable_kv()->set_key(key);
    request.mutable_kv()->set_value(value);
    request.set_overwrite(overwrite);
    pb::SetResponse response;
    return Call(&Stub::Set, request, response, options_.rpc_timeout);
  }

  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    pb::GetRequest request;
    request.set_key(key);
    request.set_timeout_ms(std::max<int64_t>(absl::ToInt64Milliseconds(timeout), 1));
    pb::GetResponse response;
    if (absl::Status s = Call(&Stub::Get, request, response, timeout + options_.rpc_timeout); !s.ok()) return s;
    if (!response.found()) return absl::DeadlineExceededError(absl::StrCat("key '", key, "' was not set"));
    return response.value();
  }

  absl::StatusOr<std::optional<std::string>> TryGet(const std::string& key) override {
    pb::GetRequest request;
    request.set_key(key);
    pb::GetResponse response;
    if (absl::Status s = Call(&Stub::Get, request, response, options_.rpc_timeout); !s.ok()) return s;
    if (!response.found()) return std::optional<std::string>();
    return std::optional<std::string>(response.value());
  }

  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> List(const std::string& prefix) override {
    pb::ListRequest request;
    request.set_prefix(prefix);
    pb::ListResponse response;
    if (absl::Status s = Call(&Stub::List, request, response, options_.rpc_timeout); !s.ok()) return s;
    std::vector<std::pair<std::string, std::string>> out;
    for (const pb::KeyValue& kv : response.kvs()) out.emplace_back(kv.key(), kv.value());
    return out;
  }

  absl::StatusOr<bool> Delete(const std::string& key) override {
    pb::DeleteRequest request;
    request.set_key(key);
    pb::DeleteResponse response;
    if (absl::Status s = Call(&Stub::Delete, request, response, options_.rpc_timeout); !s.ok()) return s;
    return response.deleted();
  }

  absl::Status Barrier(const std::string& name, absl::Duration timeout) override {
    pb::BarrierRequest request;
    request.set_name(name);
    request.set_rank(options_.rank);
    request.set_timeout_ms(std::max<int64_t>(absl::ToInt64Milliseconds(timeout), 0));
    pb::BarrierResponse response;
    return Call(&Stub::Barrier, request, response, timeout + options_.rpc_timeout);
  }

  absl::Status ReportError(const std::string& message) override {
    pb::ErrorReport request;
    request.set_rank(options_.rank);
    request.set_incarnation(options_.incarnation);
    request.set_message(message);
    pb::ErrorReportResponse response;
    return Call(&Stub::ReportError, request, response, options_.rpc_timeout);
  }

  absl::Status ReportPreemption(const std::string& reason) override {
    pb::PreemptionNotice request;
    request.set_rank(options_.rank);
    request.set_incarnation(options_.incarnation);
    request.set_reason(reason);
    pb::PreemptionNoticeResponse response;
    return Call(&Stub::ReportPreemption, request, response, options_.rpc_timeout);
  }

  void SetStep(int64_t step) override { step_.store(step, std::memory_order_relaxed); }

  std::optional<CoordinationEvent> failure() const override {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

  absl::Status Goodbye() override {
    bool service_lost = false;
    {
      absl::MutexLock lock(&mu_);
      if (said_goodbye_ || !connected_) return absl::OkStatus();
      said_goodbye_ = true;
      service_lost = failure_ && failure_->kind == CoordinationEvent::Kind::kCoordinatorLost;
    }
    StopThreads();
    // A service that stopped answering would not hear it either: the call would
    // only wait out its deadline, and a rank stopping after a failure has a grace
    // period to keep.
    if (service_lost) return absl::OkStatus();
    pb::GoodbyeRequest request;
    request.set_rank(options_.rank);
    request.set_incarnation(options_.incarnation);
    pb::GoodbyeResponse response;
    return Call(&Stub::Goodbye, request, response, absl::Seconds(2));
  }

 private:
  using Stub = pb::Coordination::Stub;

  void Prepare(grpc::ClientContext& context, absl::Duration timeout) const {
    context.set_deadline(Deadline(timeout));
    context.AddMetadata(kJobIdMetadata, options_.job_id);
    context.AddMetadata(kTokenMetadata, options_.token);
  }

  // One unary call with the job's metadata, due within `timeout`. ABORTED means
  // the job failed (the service says how): recorded as this client's failure
  // before the call returns, whichever of the call and the event stream hears
  // of it first.
  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response& response, absl::Duration timeout) {
    grpc::ClientContext context;
    Prepare(context, timeout);
    absl::Status status = FromGrpc((stub_.get()->*method)(&context, request, &response));
    if (status.code() == absl::StatusCode::kAborted) {
      CoordinationEvent event;
      event.kind = CoordinationEvent::Kind::kPeerFailed;
      event.message = std::string(status.message());
      const auto& trailing = context.GetServerTrailingMetadata();
      if (auto it = trailing.find(kFailedPeerMetadata); it != trailing.end()) {
        pb::PeerInfo peer;
        if (peer.ParseFromArray(it->second.data(), static_cast<int>(it->second.size()))) event.peer = FromProto(peer);
      }
      Fail(event);
    }
    return status;
  }

  void StopThreads() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      if (watch_context_) watch_context_->TryCancel();
    }
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    if (watch_thread_.joinable()) watch_thread_.join();
  }

  bool Stopping() const {
    absl::MutexLock lock(&mu_);
    return stopping_;
  }

  // Keeps the first failure and hands it to on_event; later ones are dropped.
  void Fail(CoordinationEvent event) {
    {
      absl::MutexLock lock(&mu_);
      if (failure_ || stopping_) return;
      failure_ = event;
    }
    if (options_.on_event) options_.on_event(event);
  }

  CoordinationEvent ServiceLost(const std::string& why) const {
    CoordinationEvent event;
    event.kind = CoordinationEvent::Kind::kCoordinatorLost;
    event.peer = roster_.empty() ? PeerInfo{} : roster_.front();
    event.message = absl::StrCat("lost the coordination service at ", options_.address, " (", options_.service_owner,
                                 "): ", why);
    return event;
  }

  absl::Status SendHeartbeat(absl::Duration timeout) {
    pb::HeartbeatRequest request;
    request.set_rank(options_.rank);
    request.set_incarnation(options_.incarnation);
    request.set_step(step_.load(std::memory_order_relaxed));
    pb::HeartbeatResponse response;
    return Call(&Stub::Heartbeat, request, response, timeout);
  }

  void HeartbeatLoop() {
    absl::Time last_ok = absl::Now();
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        auto stop = [this] { return stopping_; };
        mu_.AwaitWithTimeout(absl::Condition(&stop), options_.heartbeat_interval);
        if (stopping_) return;
      }
      const absl::Status status = SendHeartbeat(std::max(options_.heartbeat_interval, absl::Seconds(1)));
      if (status.ok()) {
        last_ok = absl::Now();
      } else if (status.code() == absl::StatusCode::kAborted) {
        // The job failed; Call has recorded it.
      } else if (absl::Now() - last_ok > options_.heartbeat_timeout) {
        Fail(ServiceLost(absl::StrFormat("no answer for %.1f s (%s)", absl::ToDoubleSeconds(absl::Now() - last_ok),
                                         status.message())));
        // Nothing more to tell a service that no longer answers; ending here also
        // keeps Goodbye from joining a heartbeat still waiting on it.
        return;
      }
    }
  }

  void WatchLoop() {
    int64_t after = 0;
    while (!Stopping()) {
      auto context = std::make_shared<grpc::ClientContext>();
      Prepare(*context, absl::Hours(24 * 365));
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        watch_context_ = context;
      }
      pb::WatchRequest request;
      request.set_rank(options_.rank);
      request.set_after_sequence(after);
      std::unique_ptr<grpc::ClientReader<pb::Event>> reader = stub_->WatchEvents(context.get(), request);
      pb::Event event;
      bool shutdown = false;
      while (reader->Read(&event)) {
        after = std::max(after, event.sequence());
        Deliver(event);
        if (event.kind() == pb::Event::SHUTDOWN) shutdown = true;
      }
      const grpc::Status status = reader->Finish();
      {
        absl::MutexLock lock(&mu_);
        watch_context_.reset();
      }
      if (shutdown || Stopping()) return;
      // The stream broke. If the service still answers, reconnect; if it does not,
      // its host is most likely gone: say so now rather than after the timeout.
      const absl::Status probe = SendHeartbeat(absl::Seconds(2));
      if (probe.code() == absl::StatusCode::kUnavailable || probe.code() == absl::StatusCode::kDeadlineExceeded) {
        Fail(ServiceLost(absl::StrCat("its connection closed (", status.error_message(), ") and it no longer answers")));
        return;
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  }

  void Deliver(const pb::Event& event) {
    CoordinationEvent out;
    out.peer = FromProto(event.peer());
    out.message = event.message();
    switch (event.kind()) {
      case pb::Event::PEER_FAILED:
        out.kind = CoordinationEvent::Kind::kPeerFailed;
        Fail(out);
        return;
      case pb::Event::PREEMPTION_NOTICE:
        out.kind = CoordinationEvent::Kind::kPreemptionNotice;
        break;
      case pb::Event::SHUTDOWN:
        out.kind = CoordinationEvent::Kind::kShutdown;
        break;
      case pb::Event::MEMBER_LEFT:
        out.kind = CoordinationEvent::Kind::kMemberLeft;
        break;
      case pb::Event::MEMBER_JOINED:
        out.kind = CoordinationEvent::Kind::kMemberJoined;
        break;
      default:
        return;
    }
    if (options_.on_event && !Stopping()) options_.on_event(out);
  }

  CoordinationClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Coordination::Stub> stub_;
  std::vector<PeerInfo> roster_;
  std::atomic<int64_t> step_{-1};
  std::thread heartbeat_thread_;
  std::thread watch_thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool said_goodbye_ ABSL_GUARDED_BY(mu_) = false;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<CoordinationEvent> failure_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<grpc::ClientContext> watch_context_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinationClient>> CoordinationClient::Connect(
    const CoordinationClientOptions& options) {
  auto client = std::make_unique<Client>(options);
  if (absl::Status s = client->Connect(); !s.ok()) return s;
  return client;
}

}  // namespace lockstep
