// The job layer: one training job around any BaseTrainer, so that a subclass with
// its own partitioned step gets what a demanding user expects of a trainer without
// writing it again: resume, evaluation periods, periodic / best / final
// checkpoints, an emergency checkpoint that every rank takes at the same step on
// SIGTERM or SIGUSR1, and a clear stop when a peer fails. See
// docs/architecture.md for where it sits.
//
//   JobEnvironment       who this rank is, its device, the coordination service
//                        (rank 0) and client, and the communicator
//   PreemptionSyncPoint  the preemption signals of one job, and the agreement on
//                        the step at which every rank stops
//   TrainingJob          Run(trainer, data, eval sets, checkpoints) -> JobResult
//
//   std::unique_ptr<JobEnvironment> env = JobEnvironment::Create(options, runtime);
//   MyTrainer trainer(state, env->runtime(), env->communicator(), ...);
//   CheckpointManager checkpoints(ckpt_options, env->runtime().rank, env->runtime().world_size,
//                                 env->coordination());
//   JobResult result = TrainingJob(env.get(), job_options).Run(trainer, train, eval_sets, &checkpoints);
//   if (result.reason != StopReason::kPeerFailed) env->Finish();
//   return ExitCodeFor(result.reason);
//
// SPMD rule: every rank creates the environment and runs the job with the same
// options, in the same order. Not thread-safe, except where a method says so.
#ifndef LOCKSTEP_JOB_H_
#define LOCKSTEP_JOB_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "lockstep/communicator.h"
#include "lockstep/coordination.h"
#include "lockstep/metrics.h"
#include "lockstep/runtime.h"

namespace lockstep {

class BaseTrainer;
class BatchIterator;
class CheckpointManager;

// Why a job stopped, and the process exit code each maps to (ExitCodeFor).
enum class StopReason {
  kDone,        // 0: every step ran (or the run resumed at or past the end)
  kHalted,      // 0: an action stopped it (early stopping)
  kDiverged,    // 3: an action stopped it as a failure (the loss became NaN)
  kPeerFailed,  // 4: another rank failed or vanished; this one stopped
  kPreempted,   // 75 (EX_TEMPFAIL): emergency checkpoint saved; start again to resume
};
constexpr int kExitFailure = 1;      // an error while running (data, libtorch, a timeout)
constexpr int kExitUsage = 2;        // a bad flag or config
constexpr int kExitDiverged = 3;
constexpr int kExitPeerFailed = 4;
constexpr int kExitPreempted = 75;
int ExitCodeFor(StopReason reason);
const char* StopReasonName(StopReason reason);  // "done", "halted", ...

// ---------------------------------------------------------------------------
// PreemptionSyncPoint: after a preemption signal reaches any rank, every rank
// stops after the same step. Each rank that learns of it (its own signal, or a
// peer's notice through the coordination service) publishes its current step + 1
// in the key-value store; once all ranks have published, the largest proposal is
// the agreed step. Ranks stay within one step of each other (every step has a
// collective), so no rank has passed the largest proposal when it learns it.
//
//   IDLE --Notify/NotifyPeer--> NOTIFIED --ShouldStop--> PROPOSED --all published--> AGREED(step)
//
// The signal state belongs to the object, not to the process: InstallSignalHandlers
// routes SIGTERM and SIGUSR1 to this object (one at a time per process, since a
// signal handler is process-wide) until UninstallSignalHandlers or destruction;
// tests call Notify instead. Notify, NotifyPeer, signal() and notified() are
// thread-safe (Notify is async-signal-safe); ShouldStop runs on the training thread.
class PreemptionSyncPoint {
 public:
  // `client` may be null: a world of one stops at the step where it learns of a
  // signal. Not owned; must outlive this object. `key_prefix` must be unique to the
  // job in the store (the default is).
  explicit PreemptionSyncPoint(CoordinationClient* client = nullptr, std::string key_prefix = "lockstep/preempt/");
  ~PreemptionSyncPoint();
  PreemptionSyncPoint(const PreemptionSyncPoint&) = delete;
  PreemptionSyncPoint& operator=(const PreemptionSyncPoint&) = delete;

  // Sets the client once it exists (the handlers go in before it connects, so that
  // no signal is missed during start-up). Before the first ShouldStop.
  void AttachClient(CoordinationClient* client) { client_ = client; }

  // Throws Error when another PreemptionSyncPoint holds the handlers.
  void InstallSignalHandlers();
  // Puts back the handlers that were there before.
  void UninstallSignalHandlers();
  // Stops routing signals to this object but leaves the handlers in place, so a
  // signal that arrives while the process winds down after the job (a second
  // SIGTERM of a preemption, say) is ignored instead of killing it with 143.
  void ReleaseSignalHandlers();

  // A preemption signal arrived at this process (SIGTERM, SIGUSR1).
  void Notify(int signal);
  // Another rank reported a preemption (CoordinationEvent::kPreemptionNotice).
  void NotifyPeer();
  // The signal this process received, 0 for none.
  int signal() const { return signal_.load(); }
  bool notified() const { return signal_.load() != 0 || peer_notice_.load(); }

  // Called on every rank after every step with the new step. Returns true when
  // this rank must stop now: the agreed step is `step`. Cheap (one load) until
  // notified; then one key-value call per step until agreed.
  // Errors: CoordinationError (the store failed, or ReportPreemption did), Error
  // when this rank is already past the agreed step (a broken SPMD order).
  bool ShouldStop(int64_t step);
  std::optional<int64_t> agreed_step() const { return agreed_; }
  // The step this rank proposed, once it has.
  std::optional<int64_t> proposed_step() const { return proposed_; }

 private:
  friend void DeliverPreemptionSignal(int signal);

  CoordinationClient* client_;  // Not owned; null for a world of one.
  const std::string key_prefix_;

  std::atomic<int> signal_{0};
  std::atomic<bool> peer_notice_{false};
  // Training thread only.
  bool reported_ = false;
  std::optional<int64_t> proposed_;
  std::optional<int64_t> agreed_;
};

// ---------------------------------------------------------------------------
// JobEnvironment: the process's place in the job. Create reads the launcher's
// variables (Runtime), resolves the device, starts MPI when the world has more
// than one rank and this build has it, starts the coordination service on rank 0
// (unless standalone) and connects this rank's client, and makes the communicator
// chosen by `backend`. It installs the preemption signal handlers for its
// PreemptionSyncPoint. A peer's failure, reported by the coordination service,
// aborts the collective in progress at once; a training thread that is not in a
// collective gets `peer_failure_grace` to notice before the process exits with
// `peer_failure_exit_code`.
//
//   CREATED --Finish()--> FINISHED            (orderly end; the destructor says goodbye otherwise)
//      \--peer failed--> ABORTED (communicator aborted; Run returns kPeerFailed)
struct CoordinationSetup {
  // "auto" (on when the world has more than one rank), "on" or "off".
  std::string mode = "auto";
  // host:port of the service. Empty: MASTER_ADDR + MASTER_PORT, Slurm's first
  // node at `port`, or else rank 0 picks a free port and tells the others over MPI.
  std::string address;
  int port = 29400;
  bool standalone = false;  // the service runs elsewhere (lockstep_coordinator)
  bool bind_all = false;
  std::string job_id;  // empty: LOCKSTEP_JOB_ID, SLURM_JOB_ID, or "lockstep"
  std::string token_file;  // see ResolveJobToken
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  absl::Duration register_timeout = absl::Minutes(5);
  // cert_file + key_file: rank 0's service speaks TLS; ca_file (default:
  // cert_file) is what the clients trust.
  TlsOptions tls;
};

// Fault tolerance for replicated data parallelism on the Gloo backend. When a
// rank other than 0 dies (killed: its connection to the coordination service
// closes; hung: its heartbeats stop for heartbeat_timeout), the service removes
// it and starts a new epoch of membership instead of failing the job, as long as
// `min_ranks` ranks remain. The survivors' collectives fail (the service's event
// aborts any that wait), and TrainingJob::Run then: reads the new membership,
// makes a Gloo group among the survivors, rolls every survivor back to the last
// step that all of them completed (it keeps the train state of the last two
// steps in memory), re-splits the global batch over the new world and goes on,
// with no restart and no checkpoint read. Rank 0 hosts the service: its death
// ends the job as without fault tolerance. A rank cannot join a running job.
struct FaultToleranceOptions {
  bool enabled = false;
  int min_ranks = 1;  // fewer live ranks than this: the job fails (exit 4)
};

struct JobEnvironmentOptions {
  std::string device = "auto";   // "auto" (cuda:<local rank> when there is a GPU), "cpu", "cuda:N"
  // "auto": nccl on a GPU; on CPU, mpi when mpirun (or srun with PMIx) started
  // the ranks, gloo when anything else did (torchrun-style variables,
  // launch/local.sh, plain srun). Or "mpi", "gloo", "nccl".
  std::string backend = "auto";
  CoordinationSetup coordination;
  absl::Duration collective_timeout = absl::Minutes(5);
  // MPI with MPI_THREAD_MULTIPLE (MpiOptions::thread_multiple): a mesh whose axes
  // both exceed one rank runs communicators side by side.
  bool mpi_thread_multiple = false;
  // The same when the launcher says the ranks span several hosts
  // (Runtime::several_hosts): what DataParallelOptions::order_by_host (on by
  // default, as this is) needs there, decided before MPI is started.
  bool mpi_thread_multiple_on_several_hosts = true;
  // Prefix of this layer's lines on stderr ("lockstep_train: rank 1: stopping: ...").
  std::string program = "lockstep";
  bool install_signal_handlers = true;
  // Zero disables the exit: the caller then relies on collectives failing.
  absl::Duration peer_failure_grace = absl::Seconds(3);
  int peer_failure_exit_code = kExitPeerFailed;
  FaultToleranceOptions fault_tolerance;
};

class JobEnvironment {
 public:
  // A collective over the job's processes. Errors: InvalidArgumentError for
  // options that cannot work (an unknown backend, coordination off with nccl, no
  // address where one is needed); Error when the device or MPI disagree with the
  // launcher; CoordinationError when this rank cannot join the job.
  static std::unique_ptr<JobEnvironment> Create(const JobEnvironmentOptions& options, const Runtime& runtime);
  // Says goodbye if Finish did not run (the service drains for 2 s).
  ~JobEnvironment();
  JobEnvironment(const JobEnvironment&) = delete;
  JobEnvironment& operator=(const JobEnvironment&) = delete;

  const Runtime& runtime() const { return runtime_; }
  const std::string& device() const { return device_; }
  // Null for a world of one (except backend "nccl"). Not owned by the caller.
  // A fault-tolerant job's changes after Reconfigure.
  Communicator* communicator() const { return communicator_.get(); }
  CollectiveOptions collective_options() const;
  // Null when coordination is off. After Reconfigure, a view of the client for
  // the new world: its rank and world size are the new ones, and its keys and
  // barriers are the epoch's own.
  CoordinationClient* coordination() const { return view_ ? view_.get() : client_.get(); }

  // Fault-tolerant jobs (options().fault_tolerance): the ranks that train now.
  struct Membership {
    int64_t epoch = 0;
    std::vector<int> ranks;  // their ranks at start-up, ascending
    int rank = 0;            // this rank's place among them
    int world_size = 1;
  };
  bool fault_tolerant() const { return options_.fault_tolerance.enabled && client_ != nullptr; }
  // This process replaced a rank that had left a running fault-tolerant job:
  // TrainingJob::Run then takes the train state from rank 0 instead of resuming.
  bool joined_late() const { return joined_late_; }
  const Membership& membership() const { return membership_; }
  // After this rank's work failed with `error` in a fault-tolerant job: waits (up
  // to heartbeat_timeout + 5 s) for the service to start a new epoch, makes a
  // Gloo communicator among its ranks and returns the membership. The old
  // communicator stays (aborted) until the environment goes. Throws Error with
  // `error` when no rank left in that time (a failure the job does not
  // survive), or when this rank is the one that was removed.
  const Membership& Reconfigure(const std::string& error);
  bool hosts_coordination_service() const { return service_ != nullptr; }
  const std::string& coordination_address() const { return address_; }
  const std::string& job_id() const { return job_id_; }
  const JobEnvironmentOptions& options() const { return options_; }
  PreemptionSyncPoint& preemption() { return *preemption_; }

  // The peer failure the coordination service reported, if any (thread-safe).
  std::optional<CoordinationEvent> peer_failure() const;
  // After this rank's work threw `error`: when a peer's failure caused it, prints
  // "<program>: rank R: stopped: <the peer's failure>" on stderr and returns that
  // message (the caller stops with kPeerFailed); otherwise tells the others at
  // once (not after a heartbeat timeout) and returns nullopt (the caller rethrows).
  // Either way this rank says goodbye. A second call returns what the first did.
  std::optional<std::string> HandleFailure(const std::string& error);
  // The orderly end, a collective: every rank waits for the others at a barrier
  // (so that rank 0's files are complete when any process ends), says goodbye,
  // and rank 0's service waits up to a minute for the others' goodbyes.
  // Errors: CoordinationError when a rank does not arrive within collective_timeout.
  void Finish();

 private:
  JobEnvironment(const JobEnvironmentOptions& options, const Runtime& runtime);
  void StartCoordination(Communicator* bootstrap);
  void OnCoordinationEvent(const CoordinationEvent& event);

  // Fixed after Create.
  const JobEnvironmentOptions options_;
  const Runtime runtime_;
  std::string device_;
  std::string address_;
  std::string job_id_;
  std::unique_ptr<CoordinationService> service_;
  std::unique_ptr<CoordinationClient> client_;
  std::unique_ptr<Communicator> communicator_;
  std::unique_ptr<PreemptionSyncPoint> preemption_;
  // Fault tolerance: the membership, the communicators of earlier epochs, the
  // client's view for this epoch, and what Gloo needs to make a group.
  Membership membership_;
  std::vector<std::unique_ptr<Communicator>> retired_;
  std::unique_ptr<CoordinationClient> view_;
  std::vector<std::unique_ptr<CoordinationClient>> retired_views_;
  std::string gloo_hostname_;
  bool joined_late_ = false;

  // Read by the coordination client's thread.
  std::atomic<Communicator*> abort_target_{nullptr};
  std::atomic<PreemptionSyncPoint*> notice_target_{nullptr};
  bool finished_ = false;  // Finish or HandleFailure said goodbye
  bool failure_handled_ = false;
  std::optional<std::string> handled_peer_failure_;
};

// ---------------------------------------------------------------------------
// TrainingJob: the train / evaluate / checkpoint loop around a BaseTrainer.
//
// Run: resumes (rank 0 picks the checkpoint: the newest valid one for "auto", and
// shares its path through the coordination service, so every rank loads the same
// one), then trains in periods of eval_every_steps, evaluating each eval set after
// each period and at the end; checkpoints when due (between evaluations too), the
// final one at the end, the best-by-metric ones at evaluations (their metrics go in
// the manifest as "<set>/<metric>"); and after every step asks the preemption sync
// point, stopping at the agreed step with an emergency checkpoint (evaluating first
// when that step ends a period, as an uninterrupted run would). The trainer's own
// state (SaveTrainerState), the data position and the subclass's custom state
// (BaseTrainer::SaveCustomState) go into every checkpoint and come back on resume,
// so a resumed run continues bit for bit.
struct EvalSet {
  std::string name;  // the summary's task, and "<name>/<metric>" for best checkpoints
  // A fresh one-pass iterator over this rank's shard of the set, per evaluation.
  std::function<std::unique_ptr<BatchIterator>()> make_iterator;
};

struct JobOptions {
  int64_t num_train_steps = 0;
  // Evaluate (and take due checkpoints) every this many steps; 0: only at the end.
  int64_t eval_every_steps = 0;
  // "auto": the newest valid checkpoint in the manager's directory, if any (when
  // there are checkpoints but none is valid, Run refuses with a CheckpointError
  // naming each, rather than start over); "none": start afresh; or the path of
  // one step directory.
  std::string resume = "auto";
  // A checkpoint at the end unless the last step already has one.
  bool final_checkpoint = true;
  // Called on the training thread after every step (a progress bar, say).
  std::function<void(int64_t step)> on_step;
  // Fault-tolerant jobs (FaultToleranceOptions): called on every remaining rank
  // once the world has changed, with this rank's new place; returns a fresh train
  // iterator for that world, into which the job restores the position. Eval
  // sets' make_iterator must give the new world's shards from then on. Required
  // when the environment is fault-tolerant.
  std::function<std::unique_ptr<BatchIterator>(int rank, int world_size)> on_world_changed;
  // The train steps to record on a timeline (state.step after the step: 1 is the
  // first), whatever the BaseTrainer: Run records them on the trainer
  // (BaseTrainer::set_timeline) and each rank writes
  // <trace_dir>/rank_<r>.json, a Chrome trace (lockstep/timeline.h), after each of
  // them; the trainer's own timeline, if any, is put back after Run. Empty: the
  // trainer's own timeline, if any, records. trace_dir is required with steps.
  std::set<int64_t> trace_steps;
  std::string trace_dir;
};

struct JobResult {
  StopReason reason = StopReason::kDone;
  int64_t step = 0;  // the state's step when it stopped
  // Each eval set's metrics at the last evaluation (empty if none ran).
  std::map<std::string, MetricMap> eval;
  std::string message;  // the action's reason, or the peer failure's message
  int preemption_signal = 0;  // kPreempted: the signal this process got, 0 for a peer's
  std::string resumed_from;   // the checkpoint resumed from, if any
  std::string emergency_checkpoint;  // kPreempted: its step directory
};

class TrainingJob {
 public:
  // `environment` may be null: a single process, no coordination, no signals
  // (give a PreemptionSyncPoint through `preemption` to have them). Not owned.
  TrainingJob(JobEnvironment* environment, JobOptions options, PreemptionSyncPoint* preemption = nullptr);

  // Runs the job (see above). `checkpoints` may be null: no checkpoints and no
  // resume; a preemption then stops without saving. Not owned.
  // Errors: InvalidArgumentError before the first step for bad options (trace
  // steps without trace_dir, or below 1), an
  // optimizer whose state cannot be saved (naming its type), or train data that
  // cannot save its position; CheckpointError for a checkpoint that cannot be
  // resumed or written; anything the trainer throws. A failure caused by a
  // peer's failure is not thrown: it returns kPeerFailed with the peer's message.
  // This rank's own failure is reported to the others before it is rethrown.
  JobResult Run(BaseTrainer& trainer, BatchIterator& train_data, const std::vector<EvalSet>& eval_sets,
                CheckpointManager* checkpoints);

 private:
  JobResult RunOrThrow(BaseTrainer& trainer, BatchIterator& train_data, const std::vector<EvalSet>& eval_sets,
                       CheckpointManager* checkpoints);
  // The checkpoint to resume from, chosen by rank 0 and shared; empty for none.
  std::string ChooseCheckpoint(const CheckpointManager& checkpoints);

  JobEnvironment* const environment_;  // Not owned; may be null.
  const JobOptions options_;
  PreemptionSyncPoint* const preemption_;  // Not owned; may be null.
};

}  // namespace lockstep

#endif  // LOCKSTEP_JOB_H_
