#include "lockstep/job.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <signal.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "lockstep/agreement.h"
#include "lockstep/checkpoint.h"
#include "lockstep/data.h"
#include "lockstep/gloo_communicator.h"
#include "lockstep/nccl_communicator.h"
#include "lockstep/optimizer_state_codec.h"
#include "lockstep/timeline.h"
#include "lockstep/trainer.h"
#if LOCKSTEP_HAVE_MPI
#include "lockstep/mpi_communicator.h"
#endif

namespace lockstep {

int ExitCodeFor(StopReason reason) {
  switch (reason) {
    case StopReason::kDone:
    case StopReason::kHalted:
      return 0;
    case StopReason::kDiverged:
      return kExitDiverged;
    case StopReason::kPeerFailed:
      return kExitPeerFailed;
    case StopReason::kPreempted:
      return kExitPreempted;
  }
  return kExitFailure;
}

const char* StopReasonName(StopReason reason) {
  switch (reason) {
    case StopReason::kDone:
      return "done";
    case StopReason::kHalted:
      return "halted";
    case StopReason::kDiverged:
      return "diverged";
    case StopReason::kPeerFailed:
      return "peer failed";
    case StopReason::kPreempted:
      return "preempted";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// PreemptionSyncPoint

namespace {

// The object that SIGTERM and SIGUSR1 are routed to; a lock-free atomic, so the
// handler's load is async-signal-safe.
std::atomic<PreemptionSyncPoint*> signal_target{nullptr};
static_assert(std::atomic<PreemptionSyncPoint*>::is_always_lock_free);
static_assert(std::atomic<int>::is_always_lock_free);
struct sigaction previous_sigterm {};
struct sigaction previous_sigusr1 {};

const char* SignalName(int signal) {
  return signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "a preemption signal";
}

}  // namespace

void DeliverPreemptionSignal(int signal) {
  if (PreemptionSyncPoint* target = signal_target.load()) target->signal_.store(signal);
}

namespace {
extern "C" void OnPreemptionSignal(int signal) { DeliverPreemptionSignal(signal); }
}  // namespace

PreemptionSyncPoint::PreemptionSyncPoint(CoordinationClient* client, std::string key_prefix)
    : client_(client), key_prefix_(std::move(key_prefix)) {}

PreemptionSyncPoint::~PreemptionSyncPoint() { UninstallSignalHandlers(); }

void PreemptionSyncPoint::InstallSignalHandlers() {
  PreemptionSyncPoint* expected = nullptr;
  if (!signal_target.compare_exchange_strong(expected, this)) {
    if (expected == this) return;
    throw Error("another PreemptionSyncPoint already receives SIGTERM and SIGUSR1 in this process");
  }
  struct sigaction action {};
  action.sa_handler = OnPreemptionSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, &previous_sigterm);
  sigaction(SIGUSR1, &action, &previous_sigusr1);
}

void PreemptionSyncPoint::ReleaseSignalHandlers() {
  PreemptionSyncPoint* expected = this;
  signal_target.compare_exchange_strong(expected, nullptr);
}

void PreemptionSyncPoint::UninstallSignalHandlers() {
  PreemptionSyncPoint* expected = this;
  if (!signal_target.compare_exchange_strong(expected, nullptr)) return;
  sigaction(SIGTERM, &previous_sigterm, nullptr);
  sigaction(SIGUSR1, &previous_sigusr1, nullptr);
}

void PreemptionSyncPoint::Notify(int signal) { signal_.store(signal == 0 ? SIGTERM : signal); }

void PreemptionSyncPoint::NotifyPeer() { peer_notice_.store(true); }

bool PreemptionSyncPoint::ShouldStop(int64_t step) {
  if (agreed_) {
    if (step > *agreed_) {
      throw Error(absl::StrCat("preemption: this rank is at step ", step, ", past the agreed step ", *agreed_));
    }
    return step == *agreed_;
  }
  if (!notified()) return false;
  if (client_ == nullptr) {  // alone: stop right here
    proposed_ = agreed_ = step;
    return true;
  }
  const int signal = signal_.load();
  if (signal != 0 && !reported_) {
    reported_ = true;
    ThrowIfError(client_->ReportPreemption(SignalName(signal)), "reporting the preemption");
  }
  if (!proposed_) {
    proposed_ = step + 1;
    ThrowIfError(Publish(*client_, key_prefix_, std::to_string(*proposed_)),
                 "proposing the preemption step");
  }
  absl::StatusOr<std::optional<std::vector<std::string>>> proposals = TryGatherPublished(*client_, key_prefix_);
  ThrowIfError(proposals.status(), "agreeing on the preemption step");
  if (!*proposals) return false;
  absl::StatusOr<int64_t> largest = MaxOfPublished(**proposals);
  ThrowIfError(largest.status(), "agreeing on the preemption step");
  agreed_ = *largest;
  if (step > *agreed_) {
    throw Error(absl::StrCat("preemption: this rank is at step ", step, ", past the agreed step ", *agreed_));
  }
  return step == *agreed_;
}

// ---------------------------------------------------------------------------
// JobEnvironment

namespace {

// "auto": cuda:<local rank> when libtorch sees GPUs, else cpu.
std::string ResolveDevice(const std::string& requested, const Runtime& runtime) {
  const bool cuda = torch::cuda::is_available();
  if (requested == "auto") return cuda ? "cuda:" + std::to_string(runtime.local_rank) : "cpu";
  if (requested.rfind("cuda", 0) == 0 && !cuda) {
    throw Error("device '" + requested + "' was asked for, but libtorch sees no CUDA device here");
  }
  return requested;
}

// MPI for a world of more than one rank, when this build has it; null otherwise.
std::unique_ptr<Communicator> MaybeMakeMpi(const Runtime& runtime, bool thread_multiple) {
  if (runtime.world_size == 1) return nullptr;
#if LOCKSTEP_HAVE_MPI
  MpiOptions mpi;
  mpi.thread_multiple = thread_multiple;
  std::unique_ptr<Communicator> comm = MakeMpiCommunicator(mpi);
  if (comm->rank() != runtime.rank || comm->world_size() != runtime.world_size) {
    throw Error("MPI says rank " + std::to_string(comm->rank()) + " of " + std::to_string(comm->world_size()) +
                " but the " + runtime.launcher + " environment says rank " + std::to_string(runtime.rank) + " of " +
                std::to_string(runtime.world_size));
  }
  return comm;
#else
  (void)thread_multiple;
  return nullptr;
#endif
}

// Whether MPI's launcher started this process: mpirun, or srun with PMIx.
bool StartedByMpi(const Runtime& runtime) {
  if (runtime.launcher == "mpirun") return true;
  return runtime.launcher == "slurm" && std::getenv("PMIX_RANK") != nullptr;
}

std::string ResolveJobId(const CoordinationSetup& c) {
  if (!c.job_id.empty()) return c.job_id;
  for (const char* name : {"LOCKSTEP_JOB_ID", "SLURM_JOB_ID"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return value;
  }
  return "lockstep";
}

// The coordination client as the ranks of one fault-tolerance epoch see it: its
// rank and world are the epoch's, its keys and barriers live under
// "lockstep/ft/<epoch>/", so what the job layer publishes and gathers by rank
// (checkpoint shards, the preemption step) spans the new world. The rest goes to
// the client itself.
class EpochView final : public CoordinationClient {
 public:
  EpochView(CoordinationClient* client, const JobEnvironment::Membership& membership)
      : client_(client), membership_(membership), prefix_(absl::StrCat("lockstep/ft/", membership.epoch, "/")) {
    for (int r : membership.ranks) roster_.push_back(client->roster().at(r));
  }
  const std::vector<PeerInfo>& roster() const override { return roster_; }
  int rank() const override { return membership_.rank; }
  int world_size() const override { return membership_.world_size; }
  absl::Status Set(const std::string& key, const std::string& value, bool overwrite) override {
    return client_->Set(prefix_ + key, value, overwrite);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return client_->Get(prefix_ + key, timeout);
  }
  absl::StatusOr<std::optional<std::string>> TryGet(const std::string& key) override {
    return client_->TryGet(prefix_ + key);
  }
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> List(const std::string& prefix) override {
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> listed = client_->List(prefix_ + prefix);
    if (!listed.ok()) return listed;
    for (auto& [key, value] : *listed) key = key.substr(prefix_.size());
    return listed;
  }
  absl::StatusOr<bool> Delete(const std::string& key) override { return client_->Delete(prefix_ + key); }
  absl::Status Barrier(const std::string& name, absl::Duration timeout) override {
    return client_->Barrier(prefix_ + name, timeout);
  }
  absl::Status ReportError(const std::string& message) override { return client_->ReportError(message); }
  absl::Status ReportPreemption(const std::string& reason) override { return client_->ReportPreemption(reason); }
  void SetStep(int64_t step) override { client_->SetStep(step); }
  std::optional<CoordinationEvent> failure() const override { return client_->failure(); }
  absl::Status Goodbye() override { return client_->Goodbye(); }

 private:
  CoordinationClient* const client_;  // Not owned.
  const JobEnvironment::Membership membership_;
  const std::string prefix_;
  std::vector<PeerInfo> roster_;
};

// The current epoch's number, from the service's store; -1 when not set.
int64_t CurrentEpoch(CoordinationClient& client) {
  absl::StatusOr<std::optional<std::string>> value = client.TryGet(kEpochKey);
  int64_t epoch = -1;
  if (value.ok() && *value && absl::SimpleAtoi(**value, &epoch)) return epoch;
  return -1;
}

}  // namespace

JobEnvironment::JobEnvironment(const JobEnvironmentOptions& options, const Runtime& runtime)
    : options_(options), runtime_(runtime) {}

std::unique_ptr<JobEnvironment> JobEnvironment::Create(const JobEnvironmentOptions& options, const Runtime& runtime) {
  const std::string& backend = options.backend;
  if (backend != "auto" && backend != "mpi" && backend != "gloo" && backend != "nccl") {
    throw InvalidArgumentError("backend must be auto, mpi, gloo or nccl, got '" + backend + "'");
  }
  const std::string& mode = options.coordination.mode;
  if (mode != "auto" && mode != "on" && mode != "off") {
    throw InvalidArgumentError("coordination mode must be auto, on or off, got '" + mode + "'");
  }
  const FaultToleranceOptions& ft = options.fault_tolerance;
  if (ft.enabled) {
    if (ft.min_ranks < 1 || ft.min_ranks > runtime.world_size) {
      throw InvalidArgumentError(absl::StrCat("fault_tolerance.min_ranks must be in [1, ", runtime.world_size,
                                              "] (the world size), got ", ft.min_ranks));
    }
    if (options.coordination.standalone) {
      throw InvalidArgumentError("fault_tolerance needs the coordination service hosted by rank 0, not standalone");
    }
    if (mode == "off") throw InvalidArgumentError("fault_tolerance needs the coordination service (mode not 'off')");
  }
  std::unique_ptr<JobEnvironment> env(new JobEnvironment(options, runtime));
  // The handlers first, so that a signal during start-up is not lost.
  env->preemption_ = std::make_unique<PreemptionSyncPoint>();
  if (options.install_signal_handlers) {
    env->preemption_->InstallSignalHandlers();
    // A peer that vanishes (a lost host) must not kill this rank with SIGPIPE while
    // a transport writes to its socket: the write fails instead, and the
    // coordination service's event says which rank and host are gone.
    struct sigaction pipe {};
    if (sigaction(SIGPIPE, nullptr, &pipe) == 0 && pipe.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  }
  env->notice_target_ = env->preemption_.get();

  env->device_ = ResolveDevice(options.device, runtime);
  const bool on_gpu = env->device_.rfind("cuda", 0) == 0;
  const std::string chosen = backend == "auto" ? (on_gpu ? "nccl" : StartedByMpi(runtime) ? "mpi" : "gloo") : backend;
  if (ft.enabled && chosen != "gloo") {
    throw InvalidArgumentError("fault_tolerance runs on the gloo backend (CPU), and this job's backend is " + chosen +
                               (backend == "auto" ? " (auto: start the ranks with launch/local.sh, torchrun-style "
                                                    "variables or plain srun, or set backend: gloo)"
                                                  : ""));
  }
  // MPI only when it is the backend: initialising it under another launcher
  // would make a world of one of each rank.
  std::unique_ptr<Communicator> mpi = chosen == "mpi"
      ? MaybeMakeMpi(runtime, options.mpi_thread_multiple ||
                                  (options.mpi_thread_multiple_on_several_hosts && runtime.several_hosts))
      : nullptr;
  env->StartCoordination(mpi.get());
  env->preemption_->AttachClient(env->client_.get());

  // The communicator: null for a world of one, unless NCCL is asked for.
  if (runtime.world_size > 1 || backend == "nccl") {
    if (chosen == "nccl") {
      NcclIdExchange exchange;
      if (env->client_) {
        exchange = NcclIdOverCoordination(*env->client_, "default", options.collective_timeout);
      } else if (runtime.world_size == 1) {
        exchange.publish = [](const std::string&) {};
      } else {
        throw InvalidArgumentError("backend 'nccl' exchanges its unique id through the coordination service; "
                                   "coordination.mode must not be 'off'");
      }
      env->communicator_ = MakeNcclCommunicator(exchange, runtime.local_rank);
      if (!on_gpu) throw Error("backend 'nccl' needs the model on a CUDA device, not " + env->device_);
    } else if (chosen == "gloo" && ft.enabled && CurrentEpoch(*env->client_) > 0) {
      // A replacement: the job runs in a later epoch, which has this rank again.
      env->gloo_hostname_ = GlooHostname(*env->client_, runtime.host);
      env->joined_late_ = true;
      env->Reconfigure("joining a running job");
    } else if (chosen == "gloo") {
      if (!env->client_) {
        throw InvalidArgumentError("backend 'gloo' meets its peers through the coordination service; "
                                   "coordination.mode must not be 'off'");
      }
      if (on_gpu) throw Error("backend 'gloo' takes CPU tensors; device " + env->device_ + " needs nccl");
      GlooOptions gloo;
      gloo.timeout = absl::ToChronoMilliseconds(options.collective_timeout);
      gloo.hostname = GlooHostname(*env->client_, runtime.host);
      env->gloo_hostname_ = gloo.hostname;
      env->communicator_ =
          MakeGlooCommunicator(GlooStoreOverCoordination(*env->client_, "default"), runtime.rank,
                               runtime.world_size, gloo);
    } else if (mpi) {
      env->communicator_ = std::move(mpi);
    } else {
      throw Error("rank " + std::to_string(runtime.rank) + " of " + std::to_string(runtime.world_size) +
                  ": this build has no MPI backend (configure with Open MPI installed)");
    }
  }
  env->abort_target_ = env->communicator_.get();
  if (!env->joined_late_) {
    env->membership_.rank = runtime.rank;
    env->membership_.world_size = runtime.world_size;
    for (int r = 0; r < runtime.world_size; ++r) env->membership_.ranks.push_back(r);
  }
  return env;
}

// See CoordinationSetup. `bootstrap` (MPI) is used only when no address is set.
void JobEnvironment::StartCoordination(Communicator* bootstrap) {
  const CoordinationSetup& c = options_.coordination;
  if (c.mode == "off" || (c.mode == "auto" && runtime_.world_size == 1)) return;
  absl::StatusOr<std::string> address = ResolveCoordinatorAddress(c.address, c.port);
  ThrowIfError(address.status(), "coordination address");
  absl::StatusOr<std::string> token = ResolveJobToken(c.token_file);
  ThrowIfError(token.status(), "coordination job token");
  job_id_ = ResolveJobId(c);

  CoordinationServiceOptions service;
  service.job_id = job_id_;
  service.world_size = runtime_.world_size;
  service.heartbeat_timeout = c.heartbeat_timeout;
  service.bind_all = c.bind_all;
  service.tls.cert_file = c.tls.cert_file;
  service.tls.key_file = c.tls.key_file;
  service.fault_tolerant = options_.fault_tolerance.enabled;
  service.min_ranks = options_.fault_tolerance.min_ranks;
  auto start_service = [&](const std::string& listen) {
    service.address = listen;
    absl::StatusOr<std::unique_ptr<CoordinationService>> started = CoordinationService::Start(service);
    ThrowIfError(started.status(), "rank 0 starting the coordination service");
    service_ = std::move(*started);
  };

  if (address->empty()) {
    if (c.standalone) {
      throw InvalidArgumentError("coordination.standalone is set but no address is: set coordination.address, "
                                 "--coordinator or MASTER_ADDR/MASTER_PORT");
    }
    if (runtime_.world_size > 1 && bootstrap == nullptr) {
      throw InvalidArgumentError("no coordination service address: set coordination.address, --coordinator or "
                                 "MASTER_ADDR/MASTER_PORT (launch/mpirun.sh and launch/slurm.sbatch do)");
    }
    // Rank 0 picks a free port (on loopback when every rank is on its host) and
    // tells the others "address\ntoken" over MPI.
    std::string announcement;
    if (runtime_.is_chief()) {
      const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
      const bool all_local =
          runtime_.world_size == 1 || (local_size != nullptr && std::atoi(local_size) == runtime_.world_size);
      const std::string host = all_local ? "127.0.0.1" : runtime_.host;
      if (token->empty()) *token = GenerateJobToken();
      service.token = *token;
      start_service(host + ":0");
      announcement = absl::StrCat(host, ":", service_->port(), "\n", *token);
    }
    if (bootstrap != nullptr) announcement = BroadcastString(*bootstrap, announcement);
    const size_t newline = announcement.find('\n');
    *address = announcement.substr(0, newline);
    *token = announcement.substr(newline + 1);
  } else {
    if (token->empty()) {
      throw InvalidArgumentError("the coordination service needs a job token: set LOCKSTEP_JOB_TOKEN "
                                 "(launch/mpirun.sh does), LOCKSTEP_JOB_TOKEN_FILE or coordination.token_file");
    }
    service.token = *token;
    if (runtime_.is_chief() && !c.standalone) start_service(*address);
  }

  CoordinationClientOptions client;
  client.address = *address;
  client.job_id = job_id_;
  client.token = *token;
  client.rank = runtime_.rank;
  client.world_size = runtime_.world_size;
  client.host = runtime_.host;
  client.heartbeat_timeout = c.heartbeat_timeout;
  client.register_timeout = c.register_timeout;
  client.tls.ca_file = c.tls.ca_file.empty() ? c.tls.cert_file : c.tls.ca_file;
  client.service_owner = c.standalone ? "lockstep_coordinator" : "hosted by rank 0";
  client.on_event = [this](const CoordinationEvent& event) { OnCoordinationEvent(event); };
  absl::StatusOr<std::unique_ptr<CoordinationClient>> connected = CoordinationClient::Connect(client);
  ThrowIfError(connected.status(), absl::StrCat("rank ", runtime_.rank, " joining the job at ", *address));
  client_ = std::move(*connected);
  address_ = *address;
}

// On the coordination client's thread.
void JobEnvironment::OnCoordinationEvent(const CoordinationEvent& event) {
  if (event.kind == CoordinationEvent::Kind::kPreemptionNotice) {
    // Set before the client connects; NotifyPeer only raises a flag, which the
    // sync point reads after its client is attached.
    if (PreemptionSyncPoint* target = notice_target_.load()) target->NotifyPeer();
    return;
  }
  if (event.kind == CoordinationEvent::Kind::kMemberLeft || event.kind == CoordinationEvent::Kind::kMemberJoined) {
    // A fault-tolerant job goes on: the collective in progress fails now, not
    // after its timeout, and the training thread reconfigures.
    if (Communicator* communicator = abort_target_.load()) communicator->Abort(event.message);
    return;
  }
  if (event.kind != CoordinationEvent::Kind::kPeerFailed && event.kind != CoordinationEvent::Kind::kCoordinatorLost) {
    return;
  }
  const int rank = runtime_.rank;
  std::fprintf(stderr, "%s: rank %d: stopping: %s\n", options_.program.c_str(), rank, event.message.c_str());
  // The collective in progress fails at once; the training thread then stops with
  // kPeerFailed. One busy elsewhere gets the grace period to notice.
  if (Communicator* communicator = abort_target_.load()) communicator->Abort(event.message);
  if (options_.peer_failure_grace <= absl::ZeroDuration()) return;
  std::thread([program = options_.program, rank, grace = options_.peer_failure_grace,
               code = options_.peer_failure_exit_code] {
    absl::SleepFor(grace);
    std::fprintf(stderr, "%s: rank %d: still running %s after a peer failed; exiting\n", program.c_str(), rank,
                 absl::FormatDuration(grace).c_str());
    std::fflush(stdout);
    _exit(code);
  }).detach();
}

const JobEnvironment::Membership& JobEnvironment::Reconfigure(const std::string& error) {
  if (!fault_tolerant()) throw Error(error);
  // The service starts the next epoch once it has found the dead rank: at once
  // for a killed process, after heartbeat_timeout for a hung one.
  const absl::Duration patience = options_.coordination.heartbeat_timeout + absl::Seconds(5);
  int64_t epoch = CurrentEpoch(*client_);
  if (epoch <= membership_.epoch) {
    absl::StatusOr<std::string> next = client_->Get(EpochMembersKey(membership_.epoch + 1), patience);
    if (!next.ok()) {
      if (next.status().code() != absl::StatusCode::kDeadlineExceeded) {
        // The service itself is gone (rank 0 died) or the job failed: once the
        // client has noticed, HandleFailure stops this rank with its message.
        const absl::Time deadline = absl::Now() + patience;
        while (!client_->failure() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
        throw Error(absl::StrCat(error, " (and the coordination service did not answer: ", next.status().message(),
                                 ")"));
      }
      throw Error(absl::StrCat(error, " (no rank left the job within ", absl::FormatDuration(patience),
                               ", so fault tolerance does not apply)"));
    }
    epoch = std::max(CurrentEpoch(*client_), membership_.epoch + 1);
  }
  absl::StatusOr<std::string> members = client_->Get(EpochMembersKey(epoch), absl::Seconds(5));
  ThrowIfError(members.status(), "reading the job's new membership");
  Membership next;
  next.epoch = epoch;
  for (absl::string_view text : absl::StrSplit(*members, ',')) {
    int r = -1;
    if (!absl::SimpleAtoi(text, &r)) throw Error("the job's membership is malformed: '" + *members + "'");
    if (r == runtime_.rank) next.rank = static_cast<int>(next.ranks.size());
    next.ranks.push_back(r);
  }
  next.world_size = static_cast<int>(next.ranks.size());
  if (std::find(next.ranks.begin(), next.ranks.end(), runtime_.rank) == next.ranks.end()) {
    throw Error(absl::StrCat("rank ", runtime_.rank, " was removed from the job (epoch ", epoch, ": ranks ", *members,
                             ") after: ", error));
  }
  // The new group; the old one stays, aborted, until this environment goes
  // (destroying a Gloo group whose peer died would wait on it).
  abort_target_ = nullptr;
  if (communicator_) {
    communicator_->Abort("the job's membership changed");
    retired_.push_back(std::move(communicator_));
  }
  GlooOptions gloo;
  gloo.hostname = gloo_hostname_.empty() ? "127.0.0.1" : gloo_hostname_;
  gloo.timeout = absl::ToChronoMilliseconds(std::min(options_.collective_timeout, patience + absl::Seconds(30)));
  membership_ = next;
  // The old view stays too: a checkpoint save in flight may still use it.
  if (view_) retired_views_.push_back(std::move(view_));
  view_ = std::make_unique<EpochView>(client_.get(), membership_);
  if (next.world_size > 1) {
    communicator_ = MakeGlooCommunicator(GlooStoreOverCoordination(*client_, absl::StrCat("epoch", epoch)), next.rank,
                                         next.world_size, gloo);
  }
  abort_target_ = communicator_.get();
  // A rank that left while the group formed: its event found no target.
  if (CurrentEpoch(*client_) > epoch && communicator_) communicator_->Abort("the job's membership changed again");
  preemption_->AttachClient(view_.get());
  return membership_;
}

CollectiveOptions JobEnvironment::collective_options() const {
  CollectiveOptions options;
  options.timeout = absl::ToChronoMilliseconds(options_.collective_timeout);
  return options;
}

std::optional<CoordinationEvent> JobEnvironment::peer_failure() const {
  if (!client_) return std::nullopt;
  return client_->failure();
}

std::optional<std::string> JobEnvironment::HandleFailure(const std::string& error) {
  abort_target_ = nullptr;
  if (!client_) return std::nullopt;
  if (failure_handled_) return handled_peer_failure_;  // the job layer handled it, the caller rethrew
  failure_handled_ = true;
  std::optional<std::string> peer;
  if (std::optional<CoordinationEvent> failure = client_->failure()) {
    std::fprintf(stderr, "%s: rank %d: stopped: %s\n", options_.program.c_str(), runtime_.rank,
                  failure->message.c_str());
    peer = failure->message;
  } else {
    (void)client_->ReportError(error);
  }
  if (!finished_) {
    finished_ = true;
    (void)client_->Goodbye();
    if (service_) service_->Shutdown(absl::Seconds(2));
  }
  handled_peer_failure_ = peer;
  return peer;
}

void JobEnvironment::Finish() {
  if (finished_) return;
  if (client_) {
    ThrowIfError(client_->Barrier("lockstep/metrics_closed", options_.collective_timeout),
                 "waiting for the other ranks at the end");
  }
  abort_target_ = nullptr;
  finished_ = true;
  if (client_) (void)client_->Goodbye();
  if (service_) service_->Shutdown(absl::Seconds(60));
}

JobEnvironment::~JobEnvironment() {
  abort_target_ = nullptr;
  notice_target_ = nullptr;
  if (preemption_) preemption_->ReleaseSignalHandlers();  // the job is over: a late signal is ignored
  if (!finished_) {
    if (client_) (void)client_->Goodbye();
    if (service_) service_->Shutdown(absl::Seconds(2));
  }
}

// ---------------------------------------------------------------------------
// TrainingJob

namespace {

// The train state after one step, in memory: what a fault-tolerant job rolls
// back to when a step failed on some ranks and not on others.
struct StepSnapshot {
  int64_t step = -1;
  std::vector<at::Tensor> tensors;  // the model's parameters, then its buffers
  std::map<std::string, at::Tensor> optimizer_tensors;
  std::map<std::string, int64_t> optimizer_ints;
  std::map<std::string, std::string> optimizer_bytes;
  std::string trainer_state;
  std::optional<IteratorPosition> data;
  CustomState custom;
  at::Tensor rng;
};

std::vector<at::Tensor> ModelTensors(torch::nn::Module& model) {
  std::vector<at::Tensor> out = model.parameters();
  for (const at::Tensor& b : model.buffers()) out.push_back(b);
  return out;
}

void CaptureSnapshot(StepSnapshot& s, BaseTrainer& trainer, const BatchIterator& data) {
  TrainState& state = trainer.state();
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = ModelTensors(*state.model);
  s.tensors.resize(now.size());
  for (size_t i = 0; i < now.size(); ++i) {
    at::Tensor& copy = s.tensors[i];
    if (copy.defined() && copy.sizes() == now[i].sizes() && copy.scalar_type() == now[i].scalar_type() &&
        copy.device() == now[i].device()) {
      copy.copy_(now[i].detach());
    } else {
      copy = now[i].detach().clone();
    }
  }
  s.optimizer_tensors.clear();
  s.optimizer_ints.clear();
  s.optimizer_bytes.clear();
  struct Writer final : OptimizerStateWriter {
    StepSnapshot* s;
    void PutTensor(const std::string& key, const at::Tensor& value) override {
      s->optimizer_tensors[key] = value.detach().clone();
    }
    void PutInt(const std::string& key, int64_t value) override { s->optimizer_ints[key] = value; }
    void PutBytes(const std::string& key, const std::string& value) override { s->optimizer_bytes[key] = value; }
  } writer;
  writer.s = &s;
  FindOptimizerStateCodec(*state.optimizer)->Save(*state.optimizer, OptimizerParameters(state), writer);
  s.trainer_state = trainer.SaveTrainerState();
  s.data = data.SavePosition();
  s.custom = trainer.SaveCustomState();
  for (auto& [name, tensor] : s.custom.tensors) tensor = tensor.detach().clone();
  s.rng = at::detail::getDefaultCPUGenerator().get_state();
  s.step = state.step;
}

void RestoreSnapshot(const StepSnapshot& s, BaseTrainer& trainer) {
  TrainState& state = trainer.state();
  {
    at::NoGradGuard no_grad;
    const std::vector<at::Tensor> now = ModelTensors(*state.model);
    if (now.size() != s.tensors.size()) throw Error("fault tolerance: the model changed since its snapshot");
    for (size_t i = 0; i < now.size(); ++i) now[i].detach().copy_(s.tensors[i]);
    for (const at::Tensor& p : state.model->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }
  struct Reader final : OptimizerStateReader {
    const StepSnapshot* s;
    bool Has(const std::string& key) const override {
      return s->optimizer_tensors.count(key) > 0 || s->optimizer_ints.count(key) > 0 ||
             s->optimizer_bytes.count(key) > 0;
    }
    at::Tensor Tensor(const std::string& key, const at::Tensor& like) const override {
      const at::Tensor& t = s->optimizer_tensors.at(key);
      return like.defined() ? t.to(like.device(), /*non_blocking=*/false, /*copy=*/true) : t.clone();
    }
    int64_t Int(const std::string& key) const override { return s->optimizer_ints.at(key); }
    std::string Bytes(const std::string& key) const override { return s->optimizer_bytes.at(key); }
  } reader;
  reader.s = &s;
  FindOptimizerStateCodec(*state.optimizer)->Restore(*state.optimizer, OptimizerParameters(state), reader);
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(s.rng);
  state.step = s.step;
  trainer.RestoreTrainerState(s.trainer_state);
  CustomState custom = s.custom;
  for (auto& [name, tensor] : custom.tensors) tensor = tensor.clone();
  trainer.RestoreCustomState(custom);
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

// A snapshot as bytes (libtorch's pickle format), for a joining rank.
std::string SerializeSnapshot(const StepSnapshot& s) {
  c10::Dict<std::string, at::Tensor> tensors;
  for (size_t i = 0; i < s.tensors.size(); ++i) tensors.insert("model/" + std::to_string(i), s.tensors[i]);
  for (const auto& [key, value] : s.optimizer_tensors) tensors.insert("optimizer/" + key, value);
  for (const auto& [key, value] : s.optimizer_bytes) tensors.insert("optimizer_bytes/" + key, BytesToTensor(value));
  for (const auto& [key, value] : s.custom.tensors) tensors.insert("custom/" + key, value);
  for (const auto& [key, value] : s.custom.bytes) tensors.insert("custom_bytes/" + key, BytesToTensor(value));
  tensors.insert("trainer_state", BytesToTensor(s.trainer_state));
  tensors.insert("rng", s.rng);
  c10::Dict<std::string, int64_t> ints;
  for (const auto& [key, value] : s.optimizer_ints) ints.insert("optimizer/" + key, value);
  ints.insert("step", s.step);
  ints.insert("num_model", static_cast<int64_t>(s.tensors.size()));
  if (s.data) {
    ints.insert("data/epoch", s.data->epoch);
    ints.insert("data/batch_in_epoch", s.data->batch_in_epoch);
  }
  const std::vector<char> bytes = torch::jit::pickle_save(c10::ivalue::Tuple::create({tensors, ints}));
  return std::string(bytes.begin(), bytes.end());
}

void DeserializeSnapshot(const std::string& payload, StepSnapshot& s) {
  const c10::IValue value = torch::jit::pickle_load(std::vector<char>(payload.begin(), payload.end()));
  const auto& elements = value.toTupleRef().elements();
  const c10::Dict<std::string, at::Tensor> tensors = c10::impl::toTypedDict<std::string, at::Tensor>(elements.at(0).toGenericDict());
  const c10::Dict<std::string, int64_t> ints = c10::impl::toTypedDict<std::string, int64_t>(elements.at(1).toGenericDict());
  s = StepSnapshot{};
  s.step = ints.at("step");
  s.tensors.resize(static_cast<size_t>(ints.at("num_model")));
  auto strip = [](const std::string& key, const std::string& prefix) -> std::optional<std::string> {
    if (key.rfind(prefix, 0) != 0) return std::nullopt;
    return key.substr(prefix.size());
  };
  for (const auto& item : tensors) {
    const std::string& key = item.key();
    const at::Tensor& t = item.value();
    if (auto k = strip(key, "model/")) {
      s.tensors.at(std::stoul(*k)) = t;
    } else if (auto k = strip(key, "optimizer_bytes/")) {
      s.optimizer_bytes[*k] = TensorToBytes(t);
    } else if (auto k = strip(key, "optimizer/")) {
      s.optimizer_tensors[*k] = t;
    } else if (auto k = strip(key, "custom_bytes/")) {
      s.custom.bytes[*k] = TensorToBytes(t);
    } else if (auto k = strip(key, "custom/")) {
      s.custom.tensors[*k] = t;
    } else if (key == "trainer_state") {
      s.trainer_state = TensorToBytes(t);
    } else if (key == "rng") {
      s.rng = t;
    }
  }
  for (const auto& item : ints) {
    if (auto k = strip(item.key(), "optimizer/")) s.optimizer_ints[*k] = item.value();
  }
  if (ints.contains("data/epoch")) {
    s.data = IteratorPosition{ints.at("data/epoch"), ints.at("data/batch_in_epoch")};
  }
}

}  // namespace

TrainingJob::TrainingJob(JobEnvironment* environment, JobOptions options, PreemptionSyncPoint* preemption)
    : environment_(environment),
      options_(std::move(options)),
      preemption_(preemption != nullptr ? preemption : environment != nullptr ? &environment->preemption() : nullptr) {
  if (options_.num_train_steps < 0) {
    throw InvalidArgumentError("num_train_steps must be >= 0, got " + std::to_string(options_.num_train_steps));
  }
  if (options_.eval_every_steps < 0) {
    throw InvalidArgumentError("eval_every_steps must be >= 0, got " + std::to_string(options_.eval_every_steps));
  }
}

JobResult TrainingJob::Run(BaseTrainer& trainer, BatchIterator& train_data, const std::vector<EvalSet>& eval_sets,
                           CheckpointManager* checkpoints) {
  // The timeline of options_.trace_steps records on the trainer for this call.
  std::unique_ptr<Timeline> timeline;
  if (!options_.trace_steps.empty()) {
    if (options_.trace_dir.empty()) {
      throw InvalidArgumentError("TrainingJob: JobOptions.trace_steps needs a trace_dir to write the traces to");
    }
    if (*options_.trace_steps.begin() < 1) {
      throw InvalidArgumentError(absl::StrCat("TrainingJob: JobOptions.trace_steps must be >= 1 (1 is the first "
                                              "step), got ", *options_.trace_steps.begin()));
    }
    const int rank = trainer.runtime().rank;
    timeline = std::make_unique<Timeline>(
        (std::filesystem::path(options_.trace_dir) / absl::StrCat("rank_", rank, ".json")).string(), rank,
        options_.trace_steps);
  }
  // The stop check and the update hook capture this call's locals and the
  // checkpoint manager, and the timeline is this call's: they must not outlive it.
  struct ClearHooks {
    BaseTrainer& trainer;
    Timeline* own_timeline;
    ~ClearHooks() {
      trainer.set_stop_check(nullptr);
      trainer.set_before_update(nullptr);
      trainer.set_timeline(own_timeline);
    }
  } clear{trainer, trainer.timeline()};
  if (timeline != nullptr) trainer.set_timeline(timeline.get());
  try {
    return RunOrThrow(trainer, train_data, eval_sets, checkpoints);
  } catch (const std::exception& e) {
    if (environment_ != nullptr) {
      const c10::Error* torch_error = dynamic_cast<const c10::Error*>(&e);  // its what() has a backtrace
      if (std::optional<std::string> peer =
              environment_->HandleFailure(torch_error ? torch_error->what_without_backtrace() : e.what())) {
        JobResult result;
        result.reason = StopReason::kPeerFailed;
        result.step = trainer.state().step;
        result.message = *peer;
        return result;
      }
    }
    throw;
  }
}

std::string TrainingJob::ChooseCheckpoint(const CheckpointManager& checkpoints) {
  const Runtime runtime = environment_ != nullptr ? environment_->runtime() : Runtime::SingleProcess();
  const std::string program = environment_ != nullptr ? environment_->options().program : "lockstep";
  std::string path;
  if (runtime.is_chief()) {
    if (options_.resume == "auto") {
      std::vector<std::string> skipped;
      std::optional<FoundCheckpoint> found = CheckpointManager::FindLatest(checkpoints.options().directory, &skipped);
      for (const std::string& why : skipped) {
        std::fprintf(stderr, "%s: skipping checkpoint %s\n", program.c_str(), why.c_str());
      }
      if (found) {
        path = found->path;
      } else if (!skipped.empty()) {
        // Starting over would throw away the work they hold, and later retention
        // could delete them: refuse, unless a fresh start is asked for.
        throw CheckpointError(absl::StrCat("no valid checkpoint in ", checkpoints.options().directory, ", but ",
                                           skipped.size(), " damaged one(s): ", absl::StrJoin(skipped, "; "),
                                           ". Repair or move them, or start afresh with resume 'none' "
                                           "(lockstep_train --resume=none)"));
      }
    } else {
      path = CheckpointManager::Validate(options_.resume).path;  // throws naming the file and the reason
    }
  }
  CoordinationClient* coordination = environment_ != nullptr ? environment_->coordination() : nullptr;
  if (coordination != nullptr && runtime.world_size > 1) {
    // The others wait for rank 0's choice (it reads every shard of each candidate
    // to check it) as long as for a collective.
    absl::StatusOr<std::string> shared = ShareFromChief(*coordination, "lockstep/resume/path", path, runtime.is_chief(),
                                                        environment_->options().collective_timeout);
    ThrowIfError(shared.status(), "waiting for rank 0 to choose the checkpoint (collective_timeout_seconds)");
    path = *shared;
  }
  return path;
}

JobResult TrainingJob::RunOrThrow(BaseTrainer& trainer, BatchIterator& train_data,
                                  const std::vector<EvalSet>& eval_sets, CheckpointManager* checkpoints) {
  TrainState& state = trainer.state();
  const bool chief = trainer.runtime().is_chief();
  if (checkpoints != nullptr) {
    // Refused now, not at the first save.
    if (!state.optimizer) throw InvalidArgumentError("checkpoints need a train state with an optimizer");
    FindOptimizerStateCodec(*state.optimizer);
    if (!train_data.SavePosition()) {
      throw InvalidArgumentError("the train data iterator cannot save its position (BatchIterator::SavePosition), "
                                 "so a checkpoint could not resume it");
    }
    // An asynchronous checkpoint copies the parameters while the next step runs;
    // the update waits for the copy.
    trainer.set_before_update([checkpoints] { checkpoints->AwaitSnapshot(); });
  }
  for (const EvalSet& set : eval_sets) {
    if (set.name.empty() || !set.make_iterator) {
      throw InvalidArgumentError("every eval set needs a name and a way to make its iterator");
    }
  }
  const bool fault_tolerant = environment_ != nullptr && environment_->fault_tolerant();
  if (fault_tolerant) {
    if (!options_.on_world_changed) {
      throw InvalidArgumentError("a fault-tolerant job needs JobOptions::on_world_changed, to re-split the train data");
    }
    if (!state.optimizer) throw InvalidArgumentError("fault tolerance needs a train state with an optimizer");
    FindOptimizerStateCodec(*state.optimizer);
    if (state.layout) {
      throw InvalidArgumentError("fault tolerance covers replicated data parallelism only; this train state is "
                                 "sharded (set partitioning.strategy to replicated, or turn fault_tolerance off)");
    }
    if (!train_data.SavePosition()) {
      throw InvalidArgumentError("fault tolerance needs train data that can save its position "
                                 "(BatchIterator::SavePosition), to go on from it in a smaller world");
    }
  }
  // The train data: the caller's, or after a change of world the job's own.
  BatchIterator* data = &train_data;
  std::unique_ptr<BatchIterator> own_data;

  JobResult result;
  const bool joining = environment_ != nullptr && environment_->joined_late();
  if (checkpoints != nullptr && options_.resume != "none" && !joining) {
    const std::string path = ChooseCheckpoint(*checkpoints);
    if (!path.empty()) {
      const FoundCheckpoint found = CheckpointManager::ReadManifestOnly(path);
      ShardExtras extras = checkpoints->Restore(found, state);
      train_data.RestorePosition(extras.data);
      trainer.RestoreTrainerState(extras.trainer_state);
      trainer.RestoreCustomState(extras.custom);
      result.resumed_from = path;
      if (chief) {
        std::printf("Resumed from %s: step %" PRId64 ", written by %d rank(s)\n", path.c_str(), state.step,
                    found.world_size);
      }
    }
  }

  std::map<std::string, double> latest_metrics;  // "set/metric" of the last evaluation, for best-M
  auto evaluate = [&] {
    std::vector<std::unique_ptr<BatchIterator>> iterators;
    NamedBatchIterators sets;
    for (const EvalSet& set : eval_sets) {
      iterators.push_back(set.make_iterator());
      sets.emplace_back(set.name, iterators.back().get());
    }
    for (auto& [name, metrics] : trainer.Eval(sets)) {
      for (const auto& [metric, value] : metrics) latest_metrics[name + "/" + metric] = value;
      result.eval[name] = std::move(metrics);
    }
  };
  int64_t last_saved = state.step;
  if (checkpoints != nullptr && !result.resumed_from.empty()) {
    // Resumed from a checkpoint elsewhere (--resume=PATH): this run's own
    // directory has none of this step yet, so the final one is saved even when no
    // step runs (how a checkpoint is resharded to another world size or strategy).
    std::error_code ec;
    const auto from = std::filesystem::weakly_canonical(std::filesystem::path(result.resumed_from).parent_path(), ec);
    const auto own = std::filesystem::weakly_canonical(checkpoints->options().directory, ec);
    if (from != own) last_saved = -1;
  }
  auto save = [&](bool emergency) {
    ShardExtras extras;
    extras.data = *data->SavePosition();
    extras.trainer_state = trainer.SaveTrainerState();
    extras.custom = trainer.SaveCustomState();
    checkpoints->Save(state, extras, latest_metrics, emergency);
    last_saved = state.step;
  };

  const int64_t total = options_.num_train_steps;
  const int64_t period = std::max<int64_t>(options_.eval_every_steps > 0 ? options_.eval_every_steps : total, 1);
  CoordinationClient* coordination = environment_ != nullptr ? environment_->coordination() : nullptr;

  // Fault tolerance: the state after each of the last two steps, in memory; the
  // world size, as a metric; and, after a change of world, when it began.
  StepSnapshot snapshots[2];
  int newest = -1;
  auto capture = [&] {
    if (newest >= 0 && snapshots[newest].step == state.step) return;
    newest = (newest + 1) % 2;
    CaptureSnapshot(snapshots[newest], trainer, *data);
  };
  std::optional<absl::Time> recovering_since;
  auto world = std::make_shared<std::atomic<int>>(environment_ != nullptr ? environment_->membership().world_size : 1);
  if (fault_tolerant) {
    trainer.AddDerivedMetrics([world](const std::string&, MetricMap& metrics) { metrics["world_size"] = *world; });
    capture();
  }
  // After a step failed in a fault-tolerant job: the new world, and every
  // member back at the newest step that all of them completed.
  // Into the world of the environment's membership (after Reconfigure): every
  // member goes back to the newest step that all of them completed, and a
  // process that joins takes rank 0's state of that step.
  auto adopt_world = [&](const std::vector<int>& before, bool joining, absl::Time seen, int64_t failed_after) {
    const JobEnvironment::Membership& now = environment_->membership();
    Communicator* communicator = environment_->communicator();
    // A joiner's trainer was built on the new group (the same collectives).
    if (!joining) trainer.ChangeCommunicator(communicator);
    int64_t target = joining ? std::numeric_limits<int64_t>::max() : snapshots[newest].step;
    if (communicator != nullptr) {
      for (const std::string& text :
           AllGatherStrings(*communicator, std::to_string(target), environment_->collective_options())) {
        target = std::min<int64_t>(target, std::stoll(text));
      }
    }
    std::vector<int> left, joined;
    for (int r : before) {
      if (std::find(now.ranks.begin(), now.ranks.end(), r) == now.ranks.end()) left.push_back(r);
    }
    for (int r : now.ranks) {
      if (std::find(before.begin(), before.end(), r) == before.end()) joined.push_back(r);
    }
    const StepSnapshot* snapshot = nullptr;
    for (int i = 0; i < 2; ++i) {
      if (snapshots[i].step == target) snapshot = &snapshots[i];
    }
    if (!joined.empty() && communicator != nullptr) {
      // Rank 0 hands its state of the step to the members; the joiners take it.
      std::string payload;
      if (now.rank == 0) {
        if (snapshot == nullptr) throw Error(absl::StrCat("fault tolerance: rank 0 has no state of step ", target));
        payload = SerializeSnapshot(*snapshot);
      }
      payload = BroadcastString(*communicator, payload, 0, environment_->collective_options());
      if (joining) {
        const int slot = newest >= 0 ? newest : 0;
        DeserializeSnapshot(payload, snapshots[slot]);
        snapshot = &snapshots[slot];
      }
    }
    if (snapshot == nullptr) {
      throw Error(absl::StrCat("fault tolerance: the ranks cannot all go back to step ", target,
                               "; this rank holds the state of steps ", snapshots[0].step, " and ", snapshots[1].step));
    }
    RestoreSnapshot(*snapshot, trainer);
    newest = static_cast<int>(snapshot - snapshots);
    snapshots[1 - newest].step = -1;
    own_data = options_.on_world_changed(now.rank, now.world_size);
    if (!own_data) throw InvalidArgumentError("JobOptions::on_world_changed returned no train iterator");
    data = own_data.get();
    if (snapshot->data) data->RestorePosition(*snapshot->data);
    coordination = environment_->coordination();
    if (checkpoints != nullptr) checkpoints->SetWorld(now.rank, now.world_size, coordination);
    *world = now.world_size;
    if (chief) {
      std::string what;
      if (!left.empty()) what = absl::StrCat("rank(s) ", absl::StrJoin(left, ", "), " left");
      if (!joined.empty()) {
        absl::StrAppend(&what, what.empty() ? "" : ", ", "rank(s) ", absl::StrJoin(joined, ", "), " joined");
      }
      if (what.empty()) what = "no rank changed";
      std::printf("Membership: %s after step %" PRId64 "; epoch %" PRId64 ": %d rank(s) (%s) go on from step %" PRId64
                  "; reconfigured in %.2f s\n",
                  what.c_str(), failed_after, now.epoch, now.world_size, absl::StrJoin(now.ranks, ", ").c_str(),
                  state.step, absl::ToDoubleSeconds(absl::Now() - seen));
      std::fflush(stdout);
    }
    recovering_since = seen;
  };
  // After a step failed in a fault-tolerant job.
  auto recover = [&](const std::exception& e) {
    const absl::Time seen = absl::Now();
    const c10::Error* torch_error = dynamic_cast<const c10::Error*>(&e);  // its what() has a backtrace
    const std::string error = torch_error ? torch_error->what_without_backtrace() : e.what();
    const std::vector<int> before = environment_->membership().ranks;
    const int64_t failed_after = state.step;
    environment_->Reconfigure(error);
    adopt_world(before, /*joining=*/false, seen, failed_after);
  };
  if (fault_tolerant && environment_->joined_late()) {
    adopt_world({}, /*joining=*/true, absl::Now(), state.step);
    if (!chief) {
      std::printf("Joined the job in epoch %" PRId64 " as rank %d of %d; going on from step %" PRId64 "\n",
                  environment_->membership().epoch, environment_->membership().rank,
                  environment_->membership().world_size, state.step);
      std::fflush(stdout);
    }
  }

  // After every step: the preemption agreement (at the last step training ends
  // anyway, with its final checkpoint), then regular checkpoints between
  // evaluations (those at an evaluation carry its metrics).
  trainer.set_stop_check([&](int64_t step) {
    if (fault_tolerant) {
      capture();
      if (recovering_since) {
        const absl::Time done = absl::Now();
        if (chief) {
          std::printf("Recovered: step %" PRId64 " completed %.2f s after the failure was seen (unix time %.3f)\n",
                      step, absl::ToDoubleSeconds(done - *recovering_since), UnixSeconds(done));
          std::fflush(stdout);
        }
        recovering_since.reset();
      }
    }
    if (coordination != nullptr) coordination->SetStep(step);
    if (options_.on_step) options_.on_step(step);
    if (preemption_ != nullptr && preemption_->notified() && preemption_->ShouldStop(step) && step != total) {
      return true;
    }
    if (checkpoints != nullptr && checkpoints->Due(step) && step % period != 0 && step != total) save(false);
    return false;
  });

  bool evaluated = false;
  while (state.step < total) {
   try {
    const int64_t before = state.step;
    trainer.Train(*data, std::min(period - state.step % period, total - state.step));
    if (trainer.stopped_by_check()) {
      // Every rank is at the agreed step. At an evaluation step, evaluate first, as
      // an uninterrupted run would; a save in flight finishes first.
      if (state.step % period == 0 || state.step == total) {
        evaluate();
        evaluated = true;
      }
      result.reason = StopReason::kPreempted;
      result.preemption_signal = preemption_->signal();
      const int signal = result.preemption_signal;
      const char* cause = signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "a peer's signal";
      if (checkpoints != nullptr) {
        save(/*emergency=*/true);
        checkpoints->Wait();
        result.emergency_checkpoint =
            (std::filesystem::path(checkpoints->options().directory) / CheckpointDirName(state.step)).string();
        if (chief) {
          std::printf("Preempted (%s): emergency checkpoint %s; exiting with %d so that the job is requeued\n", cause,
                      result.emergency_checkpoint.c_str(), kExitPreempted);
        }
      } else if (chief) {
        std::printf("Preempted (%s) at step %" PRId64 " with no checkpoints configured; exiting with %d\n", cause,
                    state.step, kExitPreempted);
      }
      break;
    }
    evaluate();
    evaluated = true;
    if (checkpoints != nullptr && checkpoints->Due(state.step)) save(false);
    if (trainer.halt().halt) break;
    if (state.step == before) break;  // the train data ran out
   } catch (const std::exception& e) {
    // What a lost peer causes: a failed or aborted collective (also as libtorch's
    // error, from a gradient hook inside backward), a coordination call, a
    // checkpoint's barrier. Anything else is this rank's own failure.
    const bool peer_related = dynamic_cast<const CollectiveError*>(&e) != nullptr ||
                              dynamic_cast<const CoordinationError*>(&e) != nullptr ||
                              dynamic_cast<const CheckpointError*>(&e) != nullptr ||
                              dynamic_cast<const c10::Error*>(&e) != nullptr;
    if (!fault_tolerant || !peer_related) throw;
    recover(e);
   }
  }
  if (result.reason != StopReason::kPreempted) {
    if (!evaluated) evaluate();  // resumed at or past num_train_steps
    if (checkpoints != nullptr && options_.final_checkpoint && last_saved != state.step) save(false);
    if (trainer.halt().halt) {
      result.reason = trainer.halt().failure ? StopReason::kDiverged : StopReason::kHalted;
      result.message = trainer.halt().reason;
    }
  }
  if (checkpoints != nullptr) checkpoints->Wait();
  trainer.CloseWriters();  // everything written before the caller's last lines
  result.step = state.step;
  return result;
}

}  // namespace lockstep
