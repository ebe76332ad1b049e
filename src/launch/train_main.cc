// lockstep_train: trains a model from a config and evaluates it, printing progress
// and summaries.
//
//   lockstep_train --config=configs/fashion_mnist_cnn.textproto
//                  --set=num_train_steps=500,output_dir=runs/short
//
// Exit codes: 0 done; 1 a failure while running (unreadable data, a libtorch
// error); 2 a bad command line or config (the message names the flag or field);
// 3 training diverged (the train loss became NaN or infinite; every rank stops);
// 4 another rank failed or vanished, and this one stopped (the message names it);
// 75 preempted: SIGTERM or SIGUSR1 arrived, every rank saved an emergency
// checkpoint at the same step, and the next start resumes from it (requeue me).
#include <torch/cuda.h>
#include <torch/utils.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "lockstep/checkpoint.h"
#include "lockstep/communicator.h"
#include "lockstep/config.h"
#include "lockstep/coordination.h"
#include "lockstep/data.h"
#include "lockstep/errors.h"
#include "lockstep/models.h"
#include "lockstep/nccl_communicator.h"
#include "lockstep/progress.h"
#include "lockstep/runtime.h"
#include "lockstep/summary_writers.h"
#include "lockstep/torch_setup.h"
#include "lockstep/trainer.h"
#if LOCKSTEP_HAVE_MPI
#include "lockstep/mpi_communicator.h"
#endif

ABSL_FLAG(std::string, config, "", "Path to a TrainerConfig in protobuf text format (proto/config.proto); "
                                   "empty uses the defaults.");
ABSL_FLAG(std::vector<std::string>, set, {},
          "Config overrides, field.path=value, comma-separated in one flag: "
          "--set=optimizer.learning_rate=0.01,num_train_steps=100");
ABSL_FLAG(std::string, resume, "auto",
          "auto: continue from the newest valid checkpoint in checkpoint.dir, if any; none: start afresh; "
          "or the path of one step directory");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of the coordination service (overrides coordination.address)");

namespace lockstep {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitDiverged = 3;  // an action stopped training as a failure (NaN loss)
constexpr int kExitPeerFailed = 4;  // another rank failed or vanished; this one stopped
constexpr int kExitPreempted = 75;  // EX_TEMPFAIL: saved an emergency checkpoint; run again to resume
constexpr auto kStopGrace = std::chrono::seconds(3);  // then a rank that has not stopped exits anyway

// absl::ParseCommandLine reports a bad flag and calls exit(1); during parsing this
// handler turns that into our usage-error exit code. --help exits 0.
bool parsing_flags = false;
bool help_requested = false;
void ExitWithUsageCode() {
  if (help_requested) {
    std::fflush(stdout);  // _Exit does not flush stdio
    std::_Exit(0);
  }
  if (parsing_flags) std::_Exit(kExitUsage);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void WriteFileAtomically(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error("cannot write '" + tmp.string() + "'");
  }
  std::filesystem::rename(tmp, path);
}

struct Datasets {
  std::shared_ptr<const TensorDataset> train;
  std::shared_ptr<const TensorDataset> test;
  std::string description;
};

Datasets LoadData(const config::TrainerConfig& cfg) {
  const config::DataConfig& d = cfg.data();
  Datasets data;
  if (d.source() == config::DataConfig::SYNTHETIC) {
    SyntheticOptions train;
    train.num_examples = d.synthetic_train_examples();
    train.num_classes = cfg.model().num_classes();
    train.seed = cfg.seed();
    train.teacher_seed = cfg.seed();
    SyntheticOptions test = train;
    test.num_examples = d.synthetic_eval_examples();
    test.seed = cfg.seed() + 1;
    data.train = std::make_shared<const TensorDataset>(MakeSyntheticDataset(train));
    data.test = std::make_shared<const TensorDataset>(MakeSyntheticDataset(test));
    data.description = "synthetic";
  } else {
    data.train = std::make_shared<const TensorDataset>(LoadFashionMnist(d.dir(), Split::kTrain));
    data.test = std::make_shared<const TensorDataset>(LoadFashionMnist(d.dir(), Split::kTest));
    data.description = "Fashion-MNIST from " + d.dir();
  }
  return data;
}

// "auto": cuda:<local rank> when libtorch sees GPUs, else cpu.
// Throws Error when a CUDA device is asked for and none exists.
std::string ResolveDevice(const std::string& requested, const Runtime& runtime) {
  const bool cuda = torch::cuda::is_available();
  if (requested == "auto") return cuda ? "cuda:" + std::to_string(runtime.local_rank) : "cpu";
  if (requested.rfind("cuda", 0) == 0 && !cuda) {
    throw Error("device '" + requested + "' was asked for, but libtorch sees no CUDA device here");
  }
  return requested;
}

// The preemption signal that arrived (SIGTERM, SIGUSR1), 0 for none. Written by
// the signal handler (a lock-free atomic store is async-signal-safe), read by the
// training thread after every step.
std::atomic<int> preemption_signal{0};
// A peer's preemption notice arrived through the coordination service.
std::atomic<bool> preemption_notice{false};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void OnPreemptionSignal(int signal) { preemption_signal.store(signal); }

void InstallPreemptionHandlers() {
  struct sigaction action {};
  action.sa_handler = OnPreemptionSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGUSR1, &action, nullptr);
}

// The communicator a coordination failure aborts (set once it exists).
std::atomic<Communicator*> abort_target{nullptr};

// On the coordination client's thread: a peer failed or the service is gone.
// The collective in progress fails at once (the training thread then exits with
// kExitPeerFailed); a training thread busy elsewhere gets kStopGrace to notice.
void OnCoordinationEvent(int rank, const CoordinationEvent& event) {
  if (event.kind == CoordinationEvent::Kind::kPreemptionNotice) {
    preemption_notice.store(true);
    return;
  }
  if (event.kind != CoordinationEvent::Kind::kPeerFailed && event.kind != CoordinationEvent::Kind::kCoordinatorLost) {
    return;
  }
  std::fprintf(stderr, "lockstep_train: rank %d: stopping: %s\n", rank, event.message.c_str());
  if (Communicator* communicator = abort_target.load()) communicator->Abort(event.message);
  std::thread([rank] {
    std::this_thread::sleep_for(kStopGrace);
    std::fprintf(stderr, "lockstep_train: rank %d: still running %lld s after a peer failed; exiting\n", rank,
                 static_cast<long long>(kStopGrace.count()));
    std::fflush(stdout);
    _exit(kExitPeerFailed);
  }).detach();
}

std::string JobId(const config::CoordinationConfig& c) {
  if (!c.job_id().empty()) return c.job_id();
  for (const char* name : {"LOCKSTEP_JOB_ID", "SLURM_JOB_ID"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return value;
  }
  return "lockstep";
}

// The coordination service (rank 0, unless standalone) and this rank's client.
struct JobCoordination {
  std::unique_ptr<CoordinationService> service;
  std::unique_ptr<CoordinationClient> client;
  std::string address;

  // Orderly end: goodbye, then rank 0's service waits for the others' goodbyes.
  void Finish(absl::Duration drain) {
    if (client) (void)client->Goodbye();
    if (service) service->Shutdown(drain);
  }
};

// Rank 0 tells the others "address\ntoken" over MPI (only when no address is
// configured: bare mpirun).
std::string BroadcastText(Communicator& bootstrap, const std::string& text) {
  constexpr int64_t kBytes = 4096;
  at::Tensor buffer = at::zeros({kBytes}, at::kByte);
  if (bootstrap.rank() == 0) {
    if (static_cast<int64_t>(text.size()) >= kBytes) throw Error("coordination bootstrap message too long");
    std::memcpy(buffer.data_ptr(), text.data(), text.size());
  }
  bootstrap.Broadcast(buffer, 0);
  return std::string(static_cast<const char*>(buffer.data_ptr()));
}

// See CoordinationConfig. `bootstrap` (MPI) is used only when no address is set.
JobCoordination StartCoordination(const config::CoordinationConfig& c, const std::string& flag_address,
                                  const Runtime& runtime, Communicator* bootstrap) {
  JobCoordination job;
  if (c.mode() == "off" || (c.mode() == "auto" && runtime.world_size == 1)) return job;
  absl::StatusOr<std::string> address =
      ResolveCoordinatorAddress(flag_address.empty() ? c.address() : flag_address, c.port());
  ThrowIfError(address.status(), "coordination address");
  absl::StatusOr<std::string> token = ResolveJobToken(c.token_file());
  ThrowIfError(token.status(), "coordination job token");

  CoordinationServiceOptions service;
  service.job_id = JobId(c);
  service.world_size = runtime.world_size;
  service.heartbeat_timeout = absl::Seconds(c.heartbeat_timeout_seconds());
  service.bind_all = c.bind_all();
  service.tls.cert_file = c.tls_cert_file();
  service.tls.key_file = c.tls_key_file();
  auto start_service = [&](const std::string& listen) {
    service.address = listen;
    absl::StatusOr<std::unique_ptr<CoordinationService>> started = CoordinationService::Start(service);
    ThrowIfError(started.status(), "rank 0 starting the coordination service");
    job.service = std::move(*started);
  };

  if (address->empty()) {
    if (c.standalone()) {
      throw InvalidArgumentError("coordination.standalone is set but no address is: set coordination.address, "
                                 "--coordinator or MASTER_ADDR/MASTER_PORT");
    }
    if (runtime.world_size > 1 && bootstrap == nullptr) {
      throw InvalidArgumentError("no coordination service address: set coordination.address, --coordinator or "
                                 "MASTER_ADDR/MASTER_PORT (launch/mpirun.sh and launch/slurm.sbatch do)");
    }
    // Rank 0 picks a free port: on loopback when every rank is on its host.
    std::string announcement;
    if (runtime.is_chief()) {
      const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
      const bool all_local = runtime.world_size == 1 ||
                             (local_size != nullptr && std::atoi(local_size) == runtime.world_size);
      const std::string host = all_local ? "127.0.0.1" : runtime.host;
      if (token->empty()) *token = GenerateJobToken();
      service.token = *token;
      start_service(host + ":0");
      announcement = absl::StrCat(host, ":", job.service->port(), "\n", *token);
    }
    if (bootstrap != nullptr) announcement = BroadcastText(*bootstrap, announcement);
    const size_t newline = announcement.find('\n');
    *address = announcement.substr(0, newline);
    *token = announcement.substr(newline + 1);
  } else {
    if (token->empty()) {
      throw InvalidArgumentError("the coordination service needs a job token: set LOCKSTEP_JOB_TOKEN "
                                 "(launch/mpirun.sh does), LOCKSTEP_JOB_TOKEN_FILE or coordination.token_file");
    }
    service.token = *token;
    if (runtime.is_chief() && !c.standalone()) start_service(*address);
  }

  CoordinationClientOptions client;
  client.address = *address;
  client.job_id = service.job_id;
  client.token = *token;
  client.rank = runtime.rank;
  client.world_size = runtime.world_size;
  client.host = runtime.host;
  client.heartbeat_timeout = service.heartbeat_timeout;
  client.register_timeout = absl::Seconds(c.register_timeout_seconds());
  client.tls.ca_file = c.tls_ca_file();
  if (client.tls.ca_file.empty() && !c.tls_cert_file().empty()) client.tls.ca_file = c.tls_cert_file();
  client.service_owner = c.standalone() ? "lockstep_coordinator" : "hosted by rank 0";
  const int rank = runtime.rank;
  client.on_event = [rank](const CoordinationEvent& event) { OnCoordinationEvent(rank, event); };
  absl::StatusOr<std::unique_ptr<CoordinationClient>> connected = CoordinationClient::Connect(client);
  ThrowIfError(connected.status(), absl::StrCat("rank ", rank, " joining the job at ", *address));
  job.client = std::move(*connected);
  job.address = *address;
  return job;
}

// The communicator for a world of more than one rank; null for a world of one.
// `mpi` is the MPI communicator made earlier (for the coordination bootstrap) or null.
std::unique_ptr<Communicator> MakeCommunicator(const std::string& requested, const std::string& device,
                                               const Runtime& runtime, std::unique_ptr<Communicator> mpi,
                                               CoordinationClient* coordination, absl::Duration timeout) {
  const bool on_gpu = device.rfind("cuda", 0) == 0;
  const std::string backend = requested == "auto" ? (on_gpu ? "nccl" : "mpi") : requested;
  if (runtime.world_size == 1 && requested != "nccl") return nullptr;
  if (backend == "nccl") {
    NcclIdExchange exchange;
    if (coordination != nullptr) {
      exchange = NcclIdOverCoordination(*coordination, "default", timeout);
    } else if (runtime.world_size == 1) {
      exchange.publish = [](const std::string&) {};
    } else {
      throw InvalidArgumentError("backend 'nccl' exchanges its unique id through the coordination service; "
                                 "coordination.mode must not be 'off'");
    }
    std::unique_ptr<Communicator> nccl = MakeNcclCommunicator(exchange, runtime.local_rank);
    if (!on_gpu) throw Error("backend 'nccl' needs the model on a CUDA device, not " + device);
    return nccl;
  }
  if (mpi) return mpi;
  throw Error("rank " + std::to_string(runtime.rank) + " of " + std::to_string(runtime.world_size) +
              ": this build has no MPI backend (configure with Open MPI installed)");
}

// MPI for a world of more than one rank, when this build has it; null otherwise.
std::unique_ptr<Communicator> MaybeMakeMpi(const Runtime& runtime) {
  if (runtime.world_size == 1) return nullptr;
#if LOCKSTEP_HAVE_MPI
  std::unique_ptr<Communicator> comm = MakeMpiCommunicator();
  if (comm->rank() != runtime.rank || comm->world_size() != runtime.world_size) {
    throw Error("MPI says rank " + std::to_string(comm->rank()) + " of " + std::to_string(comm->world_size()) +
                " but the " + runtime.launcher + " environment says rank " + std::to_string(runtime.rank) + " of " +
                std::to_string(runtime.world_size));
  }
  return comm;
#else
  return nullptr;
#endif
}

// See TrainerConfig.progress.
bool UseProgressBar(const std::string& progress, const Runtime& runtime) {
  if (progress != "auto") return progress == "bar";
  if (const char* told = std::getenv("LOCKSTEP_STDOUT_IS_TERMINAL")) return std::string(told) == "1";
  return runtime.launcher != "mpirun" && IsTerminal(stdout);
}

int Train(const config::TrainerConfig& cfg, const Runtime& runtime, const std::string& device,
          Communicator* communicator, CoordinationClient* coordination, const std::filesystem::path& output_dir,
          int threads, std::chrono::steady_clock::time_point run_start);

int Run(const config::TrainerConfig& cfg, const Runtime& runtime) {
  const auto run_start = std::chrono::steady_clock::now();
  const int threads = ConfigureTorchForTraining(cfg.num_threads());
  const std::filesystem::path output_dir = cfg.output_dir();
  if (runtime.is_chief()) {
    std::filesystem::create_directories(output_dir);
    WriteFileAtomically(output_dir / "config.textproto", ConfigToText(cfg));
  }

  const std::string device = ResolveDevice(cfg.device(), runtime);
  std::unique_ptr<Communicator> mpi = MaybeMakeMpi(runtime);
  JobCoordination coordination =
      StartCoordination(cfg.coordination(), absl::GetFlag(FLAGS_coordinator), runtime, mpi.get());
  const absl::Duration collective_timeout = absl::Seconds(cfg.collective_timeout_seconds());
  std::unique_ptr<Communicator> communicator = MakeCommunicator(cfg.backend(), device, runtime, std::move(mpi),
                                                                coordination.client.get(), collective_timeout);
  abort_target = communicator.get();
  if (runtime.is_chief() && coordination.client) {
    std::printf("Coordination: job '%s' at %s (%s), heartbeat timeout %.1f s\n", JobId(cfg.coordination()).c_str(),
                coordination.address.c_str(), coordination.service ? "hosted by rank 0" : "standalone",
                cfg.coordination().heartbeat_timeout_seconds());
  }
  try {
    const int code = Train(cfg, runtime, device, communicator.get(), coordination.client.get(), output_dir, threads,
                           run_start);
    // Every rank waits here until rank 0 has drained its metrics writers, so that
    // when any rank's process ends the output files are complete.
    if (coordination.client) {
      ThrowIfError(coordination.client->Barrier("lockstep/metrics_closed", collective_timeout),
                   "waiting for the other ranks at the end");
    }
    abort_target = nullptr;
    coordination.Finish(absl::Seconds(60));
    return code;
  } catch (const std::exception& e) {
    abort_target = nullptr;
    if (coordination.client) {
      if (std::optional<CoordinationEvent> failure = coordination.client->failure()) {
        std::fprintf(stderr, "lockstep_train: rank %d: stopped: %s\n", runtime.rank, failure->message.c_str());
        coordination.Finish(absl::Seconds(2));
        return kExitPeerFailed;
      }
      // This rank's own failure: the others learn it at once, not after a timeout.
      (void)coordination.client->ReportError(e.what());
      coordination.Finish(absl::Seconds(2));
    }
    throw;
  }
}

// --resume: rank 0 picks the checkpoint (the newest valid one for "auto") and
// tells the others through the key-value store, so that every rank loads the same.
// The others wait for rank 0's choice (which reads every shard of each candidate
// to check it) as long as for a collective.
void ResumeIfAsked(const CheckpointManager& checkpoints, TrainState& state, ShardedBatchIterator& train_data,
                   BaseTrainer& trainer, const Runtime& runtime, CoordinationClient* coordination,
                   absl::Duration wait) {
  const std::string resume = absl::GetFlag(FLAGS_resume);
  if (resume == "none") return;
  std::string path;
  if (runtime.is_chief()) {
    if (resume == "auto") {
      std::vector<std::string> skipped;
      std::optional<FoundCheckpoint> found = CheckpointManager::FindLatest(checkpoints.options().directory, &skipped);
      for (const std::string& why : skipped) std::fprintf(stderr, "lockstep_train: skipping checkpoint %s\n", why.c_str());
      if (found) path = found->path;
    } else {
      path = CheckpointManager::Validate(resume).path;  // throws naming the file and the reason
    }
  }
  if (coordination != nullptr && runtime.world_size > 1) {
    if (runtime.is_chief()) ThrowIfError(coordination->Set("lockstep/resume/path", path), "sharing the resume path");
    absl::StatusOr<std::string> shared = coordination->Get("lockstep/resume/path", wait);
    ThrowIfError(shared.status(), "waiting for rank 0 to choose the checkpoint (collective_timeout_seconds)");
    path = *shared;
  }
  if (path.empty()) return;
  const FoundCheckpoint found = CheckpointManager::ReadManifestOnly(path);
  const ShardExtras extras = checkpoints.Restore(found, state);
  train_data.Restore(extras.data);
  trainer.RestoreTrainerState(extras.trainer_state);
  if (runtime.is_chief()) {
    std::printf("Resumed from %s: step %" PRId64 ", written by %d rank(s)\n", path.c_str(), state.step,
                found.world_size);
  }
}

int Train(const config::TrainerConfig& cfg, const Runtime& runtime, const std::string& device,
          Communicator* communicator, CoordinationClient* coordination, const std::filesystem::path& output_dir,
          int threads, std::chrono::steady_clock::time_point run_start) {
  const Datasets data = LoadData(cfg);
  if (runtime.is_chief()) {
    std::printf("lockstep_train: %d rank(s) via %s, %s backend, device %s, %d threads per rank; data: %s (%" PRId64
                " train, %" PRId64 " test examples); config written to %s\n",
                runtime.world_size, runtime.launcher.c_str(), communicator ? communicator->backend().c_str() : "no",
                device.c_str(), threads, data.description.c_str(), data.train->size(), data.test->size(),
                (output_dir / "config.textproto").c_str());
  }

  torch::manual_seed(cfg.seed());
  const auto init_start = std::chrono::steady_clock::now();
  ModelOptions model_options = ToModelOptions(cfg.model());
  model_options.in_channels = data.train->inputs.size(1);
  model_options.height = data.train->inputs.size(2);
  model_options.width = data.train->inputs.size(3);
  BuiltModel model = BuildModel(model_options);
  TrainState state = MakeTrainState(model.module, MakeOptimizerFactory(ToOptimizerOptions(cfg.optimizer())));
  state.model->to(torch::Device(device));
  if (runtime.is_chief()) {
    std::printf("Model: %s, %" PRId64 " trainable weights, initialised in %.3f s\n", model_options.name.c_str(),
                CountTrainableWeights(*state.model), SecondsSince(init_start));
  }

  TrainerOptions options;
  options.step.num_microbatches = cfg.num_microbatches();
  options.step.max_grad_norm = cfg.max_grad_norm();
  options.step.schedule = ToLrSchedule(cfg);
  options.step.weight_metrics = cfg.weight_metrics();
  options.summary_every_steps = cfg.summary_every_steps();
  options.communicator = communicator;
  options.data_parallel.coordination = coordination;
  options.data_parallel.bucket_bytes = static_cast<size_t>(cfg.bucket_mb() * (1 << 20));
  options.data_parallel.collective.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(cfg.collective_timeout_seconds() * 1000));
  options.fingerprint = ConfigToText(cfg);
  // An async checkpoint copies the parameters while the next step's forward and
  // backward run; the update waits for the copy.
  CheckpointManager* checkpoints_for_update = nullptr;
  options.step.before_update = [&checkpoints_for_update] {
    if (checkpoints_for_update != nullptr) checkpoints_for_update->AwaitSnapshot();
  };
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options, runtime);
  // Rank 0 alone writes: stdout, TensorBoard events and JSONL, on the trainer's
  // background writer thread so that the training thread never waits on I/O.
  // On a terminal, a progress bar replaces the train lines; plots at the end.
  std::shared_ptr<ProgressBar> progress;
  auto plotter = std::make_shared<CurvePlotter>();
  if (runtime.is_chief()) {
    auto events = std::make_shared<TensorBoardWriter>(output_dir.string());
    auto jsonl = std::make_shared<JsonlWriter>(output_dir.string());
    trainer.AddSummaryWriter([events](const Summary& s) { (*events)(s); });
    trainer.AddSummaryWriter([jsonl](const Summary& s) { (*jsonl)(s); });
    trainer.AddSummaryWriter([plotter](const Summary& s) { (*plotter)(s); });
    if (UseProgressBar(cfg.progress(), runtime)) {
      progress = std::make_shared<ProgressBar>(cfg.num_train_steps());
      trainer.AddSummaryWriter([progress](const Summary& s) { (*progress)(s); });
    } else {
      trainer.AddSummaryWriter(StdoutLogger{});
    }
  }

  if (cfg.terminate_on_nan()) trainer.AddAction(std::make_unique<TerminateOnNanAction>("train", kLoss));
  if (cfg.early_stopping().enabled()) {
    const config::EarlyStoppingConfig& e = cfg.early_stopping();
    trainer.AddAction(std::make_unique<EarlyStoppingAction>(
        e.task(), e.metric(), e.mode() == "max" ? EarlyStoppingAction::Mode::kMax : EarlyStoppingAction::Mode::kMin,
        e.patience(), e.atol(), e.rtol()));
  }

  ShardingOptions train_sharding;
  train_sharding.global_batch_size = cfg.data().global_batch_size();
  train_sharding.rank = runtime.rank;
  train_sharding.world_size = runtime.world_size;
  train_sharding.seed = cfg.seed();
  train_sharding.shuffle = cfg.data().shuffle();
  ShardedBatchIterator train_data(data.train, train_sharding);

  auto evaluate = [&] {
    ShardingOptions eval_sharding = train_sharding;
    eval_sharding.global_batch_size = cfg.data().eval_batch_size();
    eval_sharding.shuffle = false;
    eval_sharding.num_epochs = 1;
    ShardedBatchIterator test_data(data.test, eval_sharding);
    return trainer.Eval({{"test", &test_data}}).front().second;
  };

  // Checkpoints: resume, regular saves, the final one, and the emergency one.
  CheckpointOptions checkpoint_options;
  checkpoint_options.directory =
      cfg.checkpoint().dir().empty() ? (output_dir / "checkpoints").string() : cfg.checkpoint().dir();
  checkpoint_options.every_steps = cfg.checkpoint().every_steps();
  checkpoint_options.keep_last = cfg.checkpoint().keep_last();
  checkpoint_options.keep_best = cfg.checkpoint().keep_best();
  checkpoint_options.best_metric = cfg.checkpoint().best_metric();
  checkpoint_options.best_max = cfg.checkpoint().best_mode() == "max";
  checkpoint_options.async = cfg.checkpoint().async();
  checkpoint_options.overlap_copy = cfg.checkpoint().overlap_copy();  // the update awaits the copy
  checkpoint_options.config_text = ResumeRelevantConfigText(cfg);
  checkpoint_options.config_fingerprint = StableHash(checkpoint_options.config_text);
  checkpoint_options.barrier_timeout = absl::Seconds(cfg.collective_timeout_seconds());
  CheckpointManager checkpoints(checkpoint_options, runtime.rank, runtime.world_size, coordination);
  checkpoints_for_update = &checkpoints;
  ResumeIfAsked(checkpoints, state, train_data, trainer, runtime, coordination,
                absl::Seconds(cfg.collective_timeout_seconds()));

  MetricMap test;
  std::map<std::string, double> latest_metrics;  // "task/metric" of the last eval, for best-M
  int64_t last_saved = state.step;
  auto save = [&](bool emergency) {
    ShardExtras extras{train_data.position(), trainer.SaveTrainerState()};
    checkpoints.Save(state, extras, latest_metrics, emergency);
    last_saved = state.step;
  };

  // Preemption: after every step, once a signal or a peer's notice is known, the
  // ranks agree on a step (the largest proposal: each rank's step + 1, published in
  // the key-value store) and all stop exactly there. Ranks stay within a step of
  // each other (every step all-reduces), so no rank has passed it when it learns it.
  const int64_t total = cfg.num_train_steps();
  const int64_t period = cfg.eval_every_steps() > 0 ? cfg.eval_every_steps() : total;
  bool reported = false, proposed = false;
  std::optional<int64_t> sync_step;
  const bool progress_every_step = progress && cfg.progress_updates() == "step";
  trainer.set_stop_check([&](int64_t step) {
    if (coordination) coordination->SetStep(step);
    if (progress_every_step) progress->Step(step);
    const int signal = preemption_signal.load();
    if (signal != 0 || preemption_notice.load()) {
      if (coordination == nullptr) return true;  // alone: stop right here
      if (signal != 0 && !reported) {
        reported = true;
        ThrowIfError(coordination->ReportPreemption(signal == SIGTERM ? "SIGTERM" : "SIGUSR1"),
                     "reporting the preemption");
      }
      if (!proposed) {
        proposed = true;
        ThrowIfError(coordination->Set(absl::StrCat("lockstep/preempt/", runtime.rank), std::to_string(step + 1)),
                     "proposing the preemption step");
      }
      if (!sync_step) {
        absl::StatusOr<std::vector<std::pair<std::string, std::string>>> proposals =
            coordination->List("lockstep/preempt/");
        ThrowIfError(proposals.status(), "agreeing on the preemption step");
        if (static_cast<int>(proposals->size()) == runtime.world_size) {
          int64_t agreed = 0;
          for (const auto& [key, value] : *proposals) agreed = std::max<int64_t>(agreed, std::stoll(value));
          sync_step = agreed;
          if (step > agreed) {
            throw Error(absl::StrCat("preemption: this rank is at step ", step, ", past the agreed step ", agreed));
          }
        }
      }
      // At the last step training ends anyway, with its final checkpoint.
      if (sync_step && step == *sync_step && step != total) return true;
    }
    // Regular checkpoints between evaluations (those at an evaluation carry its metrics).
    if (checkpoints.Due(step) && step % period != 0 && step != total) save(false);
    return false;
  });

  int exit_code = 0;
  while (state.step < total) {
    const int64_t chunk = std::min(period - state.step % period, total - state.step);
    trainer.Train(train_data, chunk);
    if (trainer.stopped_by_check()) {
      // Preempted: every rank is at the agreed step. At an evaluation step, evaluate
      // first, as an uninterrupted run would; a save in flight finishes first.
      if (state.step % period == 0 || state.step == total) {
        test = evaluate();
        for (const auto& [name, value] : test) latest_metrics["test/" + name] = value;
      }
      save(/*emergency=*/true);
      checkpoints.Wait();
      if (runtime.is_chief()) {
        const int signal = preemption_signal.load();
        std::printf("Preempted (%s): emergency checkpoint %s/%s; exiting with %d so that the job is requeued\n",
                    signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "a peer's signal",
                    checkpoint_options.directory.c_str(), CheckpointDirName(state.step).c_str(), kExitPreempted);
      }
      exit_code = kExitPreempted;
      break;
    }
    test = evaluate();
    for (const auto& [name, value] : test) latest_metrics["test/" + name] = value;
    if (checkpoints.Due(state.step)) save(false);
    if (trainer.halt().halt) break;
  }
  if (exit_code == 0 && test.empty()) test = evaluate();  // resumed at or past num_train_steps
  if (exit_code == 0 && cfg.checkpoint().final() && last_saved != state.step) save(false);
  checkpoints.Wait();
  trainer.CloseWriters();  // everything written before the last line
  if (progress) progress->Finish();
  if (runtime.is_chief() && exit_code == 0) {
    const std::vector<std::string> plots = plotter->WritePlots(output_dir.string());
    if (!plots.empty()) std::printf("Plots: %s/{loss,accuracy,learning_rate,examples_per_second}.svg\n", output_dir.c_str());
    if (trainer.halt().halt) std::printf("Stopped after step %" PRId64 ": %s\n", state.step, trainer.halt().reason.c_str());
    std::printf("Done: %" PRId64 " steps in %.1f s; test loss %.4f, test accuracy %.4f\n", state.step,
                SecondsSince(run_start), test[kLoss], test[kAccuracy]);
  }
  if (exit_code != 0) return exit_code;
  return trainer.halt().failure ? kExitDiverged : 0;
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  using namespace lockstep;
  // Summary lines reach a log file (sbatch, mpirun --output-filename) as they are
  // printed, not in 4 KiB blocks.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  InstallPreemptionHandlers();
  absl::SetProgramUsageMessage("Trains a model from a TrainerConfig. Usage: lockstep_train --config=FILE [--set=a.b=v]");
  // absl keeps only the last of repeated flags; silently dropping overrides would
  // train the wrong model, so a repeated --set is refused.
  int set_flags = 0;
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--set" || arg.rfind("--set=", 0) == 0) ++set_flags;
    if (arg.rfind("--help", 0) == 0 || arg == "--version") help = true;
  }
  if (set_flags > 1) {
    std::fprintf(stderr, "lockstep_train: --set given %d times; give all overrides in one, comma-separated: "
                 "--set=a.b=1,c=2\n", set_flags);
    return kExitUsage;
  }
  std::atexit(ExitWithUsageCode);
  help_requested = help;  // absl exits after printing help; that is not an error
  parsing_flags = true;
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  parsing_flags = false;
  if (positional.size() > 1) {
    std::fprintf(stderr, "lockstep_train: unexpected argument '%s' (flags take the form --name=value)\n",
                 positional[1]);
    return kExitUsage;
  }
  Runtime runtime;
  try {
    runtime = Runtime::FromEnvironment();
  } catch (const Error& e) {
    std::fprintf(stderr, "lockstep_train: %s\n", e.what());
    return kExitUsage;
  }
  absl::StatusOr<config::TrainerConfig> cfg =
      BuildConfig(absl::GetFlag(FLAGS_config), absl::GetFlag(FLAGS_set), runtime.world_size);
  if (!cfg.ok()) {
    std::fprintf(stderr, "lockstep_train: config error: %s\n", std::string(cfg.status().message()).c_str());
    return kExitUsage;
  }
  try {
    return Run(*cfg, runtime);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "lockstep_train: rank %d: libtorch error: %s\n", runtime.rank, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep_train: rank %d: error: %s\n", runtime.rank, e.what());
  }
  return kExitFailure;
}
