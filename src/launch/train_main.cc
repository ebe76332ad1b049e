// lockstep_train: trains a model from a config and evaluates it, printing progress
// and summaries. Thin: the config becomes options, the job layer (lockstep/job.h)
// runs the job, and why it stopped becomes the exit code.
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
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "lockstep/agreement.h"
#include "lockstep/checkpoint.h"
#include "lockstep/config.h"
#include "lockstep/gpt.h"
#include "lockstep/mesh.h"
#include "lockstep/job.h"
#include "lockstep/models.h"
#include "lockstep/torch_setup.h"
#include "lockstep/trainer.h"

ABSL_FLAG(std::string, config, "", "Path to a TrainerConfig in protobuf text format (proto/config.proto); "
                                   "empty uses the defaults.");
ABSL_FLAG(std::vector<std::string>, set, {},
          "Config overrides, field.path=value, comma-separated in one flag: "
          "--set=optimizer.learning_rate=0.01,num_train_steps=100");
ABSL_FLAG(std::string, resume, "auto",
          "auto: continue from the newest valid checkpoint in checkpoint.dir, if any; none: start afresh; "
          "or the path of one step directory");
ABSL_FLAG(std::string, coordinator, "", "host:port of the coordination service (overrides coordination.address)");

namespace lockstep {
namespace {

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

int Run(const config::TrainerConfig& cfg, const Runtime& runtime, std::unique_ptr<JobEnvironment>& env) {
  const auto run_start = std::chrono::steady_clock::now();
  const int threads = ConfigureTorchForTraining(cfg.num_threads());  // before MPI starts its threads
  const std::filesystem::path output_dir = cfg.output_dir();
  WriteResolvedConfig(cfg, runtime);
  JobEnvironmentOptions env_options = ToJobEnvironmentOptions(cfg);
  if (!absl::GetFlag(FLAGS_coordinator).empty()) env_options.coordination.address = absl::GetFlag(FLAGS_coordinator);
  env_options.program = "lockstep_train";
  env = JobEnvironment::Create(env_options, runtime);
  if (runtime.is_chief() && env->coordination()) {
    std::printf("Coordination: job '%s' at %s (%s, %s), heartbeat timeout %.1f s\n", env->job_id().c_str(),
                env->coordination_address().c_str(), env->hosts_coordination_service() ? "hosted by rank 0" : "standalone",
                cfg.coordination().tls_cert_file().empty() && cfg.coordination().tls_ca_file().empty() ? "plaintext" : "TLS",
                cfg.coordination().heartbeat_timeout_seconds());
  }

  const Datasets data = LoadDatasets(cfg);
  Communicator* communicator = env->communicator();
  if (runtime.is_chief()) {
    std::printf("lockstep_train: %d rank(s) via %s, %s backend, device %s, %d threads per rank; data: %s (%" PRId64
                " train, %" PRId64 " test %s); config written to %s\n",
                runtime.world_size, runtime.launcher.c_str(), communicator ? communicator->backend().c_str() : "no",
                env->device().c_str(), threads, data.description.c_str(),
                data.tokens() ? data.train_tokens->size() : data.train->size(),
                data.tokens() ? data.eval_tokens->size() : data.test->size(), data.tokens() ? "tokens" : "examples",
                (output_dir / "config.textproto").c_str());
  }
  torch::manual_seed(cfg.seed());
  const auto init_start = std::chrono::steady_clock::now();
  ModelOptions model_options = ToModelOptions(cfg.model());
  if (!data.tokens()) {
    model_options.in_channels = data.train->inputs.size(1);
    model_options.height = data.train->inputs.size(2);
    model_options.width = data.train->inputs.size(3);
  }
  CheckModelFitsInMemory(cfg, model_options);  // a clear error, not libtorch's allocator's
  // A data x model mesh: the model splits itself over its model axis.
  const MeshShape mesh_shape = ToMeshShape(cfg, runtime.world_size);
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<Partitioner> partitioner;
  GptParallelism parallel;
  if (mesh_shape.model > 1) {
    mesh = DeviceMesh::Create(communicator, mesh_shape, env->collective_options());
    partitioner = std::make_unique<Partitioner>(ToPartitionRules(cfg), mesh_shape);
    parallel = GptParallelism{mesh->model(), mesh->model_index(), partitioner.get()};
  }
  BuiltModel model = mesh ? BuildGpt(model_options.gpt, parallel) : BuildModel(model_options);
  std::vector<ParameterLayout> layouts;
  if (mesh) layouts = std::dynamic_pointer_cast<GptImpl>(model.module)->layouts();
  if (mesh && runtime.is_chief()) std::printf("%s", Partitioner::Table(layouts, mesh_shape).c_str());
  TrainState state = MakeTrainState(model.module, MakeOptimizerFactory(ToOptimizerOptions(cfg.optimizer())));
  state.model->to(torch::Device(env->device()));
  if (runtime.is_chief()) {
    std::printf("Model: %s, %" PRId64 " trainable weights, initialised in %.3f s\n", model_options.name.c_str(),
                CountTrainableWeights(*state.model), SecondsSince(init_start));
  }

  TrainerOptions options = ToTrainerOptions(cfg);
  options.communicator = communicator;
  // A replacement in a fault-tolerant job checks its model over the new group,
  // as the ranks it joins do.
  options.data_parallel.coordination = env->joined_late() ? nullptr : env->coordination();
  options.mesh = mesh.get();
  options.parameter_layouts = layouts;
  LossFn loss = CrossEntropyLoss();
  if (data.tokens()) {
    const auto* gpt = dynamic_cast<const GptImpl*>(model.module.get());
    loss = gpt != nullptr ? LanguageModelLoss(gpt->vocab_axis(), gpt->vocab_begin()) : LanguageModelLoss();
  }
  Trainer trainer(state, model.apply, loss, options, runtime);
  if (cfg.trace_steps_size() > 0 && runtime.is_chief()) {  // the job records them (JobOptions::trace_steps)
    std::printf("Timeline: %d step(s) traced to %s/trace/rank_<r>.json (open in https://ui.perfetto.dev)\n",
                cfg.trace_steps_size(), cfg.output_dir().c_str());
  }
  if (DataParallel* replicated = trainer.data_parallel(); replicated != nullptr && runtime.is_chief()) {
    std::printf("Communication: %s\n", replicated->bucketer().description().c_str());
  }
  if (const ShardedDataParallel* sharded = trainer.sharded_data_parallel(); sharded != nullptr && runtime.is_chief()) {
    std::printf("Partitioning: %s over %d data rank(s): %d unit(s) of %" PRId64
                " parameter elements, each rank updating 1/%d of them%s\n",
                PartitioningStrategyName(sharded->strategy()).c_str(), sharded->world_size(), sharded->num_units(),
                sharded->num_elements(), sharded->world_size(), mesh ? " (of its model index's shards)" : "");
  }
  // Rank 0 alone writes (stdout, TensorBoard events, JSONL) on the trainer's
  // background thread; on a terminal a progress bar replaces the train lines.
  const RunWriters writers = AddConfiguredWriters(cfg, runtime, trainer);
  const std::shared_ptr<ProgressBar>& progress = writers.progress;
  AddConfiguredActions(cfg, trainer);

  // Each rank reads its data replica's slice of every global batch.
  // (A fault-tolerant job that loses a rank moves the others to new places.)
  Runtime data_runtime = DataAxisRuntime(runtime, mesh_shape);
  std::unique_ptr<BatchIterator> train_data = MakeTrainIterator(cfg, data, data_runtime);
  const std::vector<EvalSet> eval_sets = {{"test", [&] { return MakeEvalIterator(cfg, data, data_runtime); }}};
  if (data.tokens()) {
    // Bits per byte, tokens/s and MFU against the matrix-product peak that every
    // rank measures now, all at once (rank 0's figure is used).
    const int64_t sequence = SequenceLength(cfg);
    const double peak_flops = AddLanguageModelMetrics(trainer, model_options.gpt, sequence, env->device());
    if (runtime.is_chief()) {
      std::printf("Language model: %" PRId64 " tokens per example, %.3g training FLOPs per token; peak %.3g GFLOP/s "
                  "per rank (float32 matrix products on %s, measured on every rank at once; MFU is against it)\n",
                  sequence, GptTrainingFlopsPerToken(model_options.gpt, sequence), peak_flops / 1e9,
                  env->device().c_str());
    }
  }
  CheckpointManager checkpoints(ToCheckpointOptions(cfg), runtime.rank, runtime.world_size, env->coordination());
  if (mesh) {
    checkpoints.set_model_axis(mesh->model(), mesh->model_index(), layouts);
    checkpoints.set_data_axis(mesh->data());
  }
  JobOptions job_options = ToJobOptions(cfg);
  job_options.resume = absl::GetFlag(FLAGS_resume);
  if (progress && cfg.progress_updates() == "step") job_options.on_step = [progress](int64_t s) { progress->Step(s); };
  job_options.on_world_changed = [&](int rank, int world_size) {
    data_runtime.rank = rank;
    data_runtime.world_size = world_size;
    return MakeTrainIterator(cfg, data, data_runtime);
  };
  if (runtime.is_chief() && env->fault_tolerant()) {
    std::printf("Fault tolerance: on; a rank other than 0 that dies leaves the job, which goes on while %d or more "
                "rank(s) remain\n", cfg.fault_tolerance().min_ranks());
  }

  JobResult result = TrainingJob(env.get(), job_options).Run(trainer, *train_data, eval_sets, &checkpoints);
  if (result.reason == StopReason::kPeerFailed) return ExitCodeFor(result.reason);
  if (progress) progress->Finish();
  if (runtime.is_chief() && result.reason != StopReason::kPreempted) {
    if (!writers.plotter->WritePlots(output_dir.string()).empty()) {
      std::printf("Plots: %s/{loss,accuracy,learning_rate,examples_per_second}.svg\n", output_dir.c_str());
    }
    if (trainer.halt().halt) std::printf("Stopped after step %" PRId64 ": %s\n", state.step, result.message.c_str());
    MetricMap& test = result.eval["test"];
    if (data.tokens()) {
      std::printf("Done: %" PRId64 " steps in %.1f s; test loss %.4f, test bits per byte %.4f\n", state.step,
                  SecondsSince(run_start), test[kLoss], test["bits_per_byte"]);
    } else {
      std::printf("Done: %" PRId64 " steps in %.1f s; test loss %.4f, test accuracy %.4f\n", state.step,
                  SecondsSince(run_start), test[kLoss], test[kAccuracy]);
    }
  }
  env->Finish();  // every rank waits until rank 0's writers are drained
  return ExitCodeFor(result.reason);
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  using namespace lockstep;
  // Summary lines reach a log file (sbatch, mpirun --output-filename) as they are
  // printed, not in 4 KiB blocks.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  absl::SetProgramUsageMessage("Trains a model from a TrainerConfig. Usage: lockstep_train --config=FILE [--set=a.b=v]");
  // absl keeps only the last of repeated flags; silently dropping overrides would
  // train the wrong model, so a repeated --set is refused.
  int set_flags = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--set" || arg.rfind("--set=", 0) == 0) ++set_flags;
    if (arg.rfind("--help", 0) == 0 || arg == "--version") help_requested = true;  // absl exits: not an error
  }
  if (set_flags > 1) {
    std::fprintf(stderr, "lockstep_train: --set given %d times; give all overrides in one, comma-separated: "
                 "--set=a.b=1,c=2\n", set_flags);
    return kExitUsage;
  }
  std::atexit(ExitWithUsageCode);
  parsing_flags = true;
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  parsing_flags = false;
  if (positional.size() > 1) {
    std::fprintf(stderr, "lockstep_train: unexpected argument '%s' (flags take the form --name=value)\n", positional[1]);
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
  std::unique_ptr<JobEnvironment> env;
  std::string kind, error;
  try {
    return Run(*cfg, runtime, env);
  } catch (const c10::Error& e) {
    kind = "libtorch error: ";
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    kind = "error: ";
    error = e.what();
  }
  // A failure that a peer's failure caused is that peer's: exit 4, naming it.
  if (env && env->HandleFailure(error)) return kExitPeerFailed;
  std::fprintf(stderr, "lockstep_train: rank %d: %s%s\n", runtime.rank, kind.c_str(), error.c_str());
  return kExitFailure;
}
