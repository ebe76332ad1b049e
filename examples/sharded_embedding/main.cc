// sharded_embedding: trains a bag-of-tokens classifier on synthetic text, with its
// embedding table split by columns over the model axis of a data x model mesh of
// MPI ranks, through Lockstep's BaseTrainer, mesh, partitioner, communicators and
// data iterator, and Lockstep's job layer for checkpoints, resume and preemption.
// See README.md.
//
//   mpirun -np 2 build/sharded_embedding --steps=300 --check            # 1x2: the table over both
//   mpirun -np 4 build/sharded_embedding --mesh_model=2 --check         # 2x2
//   mpirun -np 2 build/sharded_embedding --checkpoint_dir=runs/emb      # resumes if stopped
//
// Exit codes: 0 done (and with --check, the sharded model matched the unsharded
// one), 1 a failure or a failed check, 2 a bad flag, 3 the loss became NaN,
// 4 another rank failed, 75 preempted (SIGTERM or SIGUSR1: every rank saved an
// emergency checkpoint at the same step; run again to resume).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "lockstep/checkpoint.h"
#include "lockstep/communicator.h"
#include "lockstep/data.h"
#include "lockstep/errors.h"
#include "lockstep/hashing.h"
#include "lockstep/job.h"
#include "lockstep/mesh.h"
#include "lockstep/metrics.h"
#include "lockstep/runtime.h"
#include "lockstep/torch_setup.h"
#include "lockstep/train_state.h"
#include "lockstep/trainer.h"
#include "sharded_embedding_trainer.h"

ABSL_FLAG(int64_t, steps, 300, "optimizer steps");
ABSL_FLAG(int64_t, vocab_size, 1000, "rows of the embedding table (token ids)");
ABSL_FLAG(int64_t, embedding_dim, 32, "columns of the embedding table; a multiple of the model axis");
ABSL_FLAG(int, mesh_model, 0,
          "ranks on the model axis of the data x model mesh (0: all of them, data 1); must divide the world size");
ABSL_FLAG(std::string, rules, "embed:model",
          "partitioning rules, LOGICAL:MESH pairs separated by commas, the first naming an axis wins; the table's "
          "axes are vocab and embed; MESH empty (embed:) replicates");
ABSL_FLAG(int64_t, hidden_dim, 64, "width of the hidden dense layer");
ABSL_FLAG(int64_t, num_classes, 4, "classes");
ABSL_FLAG(int64_t, bag_size, 8, "tokens per example");
ABSL_FLAG(int64_t, global_batch_size, 64, "examples per step over all ranks");
ABSL_FLAG(int64_t, num_train_examples, 8192, "synthetic train examples");
ABSL_FLAG(int64_t, num_eval_examples, 1000, "synthetic eval examples");
ABSL_FLAG(double, learning_rate, 1e-2, "Adam's learning rate");
ABSL_FLAG(uint64_t, seed, 1, "seed of the data, the initial model and the shuffling (not of the rank count)");
ABSL_FLAG(int64_t, summary_every_steps, 50, "steps per train summary");
ABSL_FLAG(bool, check, false,
          "also train the unsharded model on every rank and fail unless the sharded one matches it");
ABSL_FLAG(double, check_tolerance, 1e-4, "largest difference --check accepts (loss and parameters)");
ABSL_FLAG(double, collective_timeout_seconds, 60, "timeout of every collective");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "where checkpoints go (one step directory each); empty: no checkpoints. With one, a new start resumes "
          "from the newest valid checkpoint (see --resume), and SIGTERM/SIGUSR1 saves an emergency one");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0, "a checkpoint every this many steps (0: only the final one)");
ABSL_FLAG(int64_t, eval_every_steps, 0, "evaluate every this many steps (0: only at the end)");
ABSL_FLAG(std::string, resume, "auto", "auto: the newest valid checkpoint, if any; none; or one step directory");

namespace sharded_embedding {
namespace {

class FlagError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void Require(bool ok, const std::string& message) {
  if (!ok) throw FlagError(message);
}

// Token ids uniform over the vocabulary; the label of a bag is the class with the
// highest total score of its tokens under a fixed random teacher table.
lockstep::TensorDataset MakeBags(const at::Tensor& teacher, int64_t num_examples, int64_t bag_size) {
  lockstep::TensorDataset data;
  data.inputs = at::randint(teacher.size(0), {num_examples, bag_size}, at::kLong);
  data.targets = teacher.index_select(0, data.inputs.reshape({-1}))
                     .view({num_examples, bag_size, teacher.size(1)})
                     .sum(1)
                     .argmax(1);
  return data;
}

// "--rules" as PartitionRules: "embed:model,vocab:" -> {embed -> model, vocab -> replicated}.
lockstep::PartitionRules ParseRules(const std::string& text) {
  lockstep::PartitionRules rules;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::vector<std::string> parts = absl::StrSplit(item, ':');
    Require(parts.size() == 2 && !parts[0].empty(),
            "--rules: '" + std::string(item) + "' is not LOGICAL:MESH (say embed:model, or embed: to replicate)");
    rules.push_back({parts[0], parts[1]});
  }
  return rules;
}

// The flags a resumed run must share with its checkpoint (not how long it runs,
// how it reports or where it checkpoints).
std::string ResumeRelevantFlags() {
  return absl::StrCat("vocab_size=", absl::GetFlag(FLAGS_vocab_size), "\nembedding_dim=", absl::GetFlag(FLAGS_embedding_dim),
                      "\nhidden_dim=", absl::GetFlag(FLAGS_hidden_dim), "\nnum_classes=", absl::GetFlag(FLAGS_num_classes),
                      "\nbag_size=", absl::GetFlag(FLAGS_bag_size), "\nglobal_batch_size=",
                      absl::GetFlag(FLAGS_global_batch_size), "\nnum_train_examples=",
                      absl::GetFlag(FLAGS_num_train_examples), "\nnum_eval_examples=",
                      absl::GetFlag(FLAGS_num_eval_examples), "\nlearning_rate=", absl::GetFlag(FLAGS_learning_rate),
                      "\nseed=", absl::GetFlag(FLAGS_seed), "\ncheck=", absl::GetFlag(FLAGS_check), "\n");
}

int Run(std::unique_ptr<lockstep::JobEnvironment>& environment) {
  const lockstep::Runtime runtime = lockstep::Runtime::FromEnvironment();
  const int world = runtime.world_size;
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab_size);
  const int64_t dim = absl::GetFlag(FLAGS_embedding_dim);
  const int64_t classes = absl::GetFlag(FLAGS_num_classes);
  const int64_t bag = absl::GetFlag(FLAGS_bag_size);
  const int64_t global_batch = absl::GetFlag(FLAGS_global_batch_size);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  Require(steps >= 0, "--steps must be >= 0");
  Require(vocab > 0 && classes > 1 && bag > 0 && absl::GetFlag(FLAGS_hidden_dim) > 0,
          "--vocab_size, --hidden_dim and --bag_size must be positive, --num_classes at least 2");
  const int mesh_model = absl::GetFlag(FLAGS_mesh_model) == 0 ? world : absl::GetFlag(FLAGS_mesh_model);
  Require(mesh_model > 0 && world % mesh_model == 0,
          "--mesh_model=" + std::to_string(mesh_model) + " must divide the number of ranks (" + std::to_string(world) +
              ")");
  const lockstep::MeshShape mesh_shape{world / mesh_model, mesh_model};
  Require(dim > 0, "--embedding_dim must be positive");
  // The table's layout from the rules; a model axis that does not divide the split
  // dimension, or an unknown mesh axis, is an InvalidArgumentError naming it (exit 2).
  const lockstep::Partitioner partitioner(ParseRules(absl::GetFlag(FLAGS_rules)), mesh_shape);
  const lockstep::ParameterLayout table_layout =
      partitioner.Layout(BagClassifierImpl::kTableName, {vocab, dim}, BagClassifierImpl::TableAxes());
  Require(!table_layout.sharded() || table_layout.split_dim == 1,
          "--rules split the rows ('vocab') of " + table_layout.name + "; this example splits its columns: " +
              "--rules=embed:model");
  Require(table_layout.sharded() || mesh_shape.model == 1,
          "--rules leave " + table_layout.name + " whole on a model axis of " + std::to_string(mesh_shape.model) +
              " ranks, which would hold copies: split 'embed' over 'model', or --mesh_model=1");
  Require(global_batch >= world, "--global_batch_size must be at least the number of ranks");
  Require(absl::GetFlag(FLAGS_num_train_examples) >= global_batch && absl::GetFlag(FLAGS_num_eval_examples) > 0,
          "--num_train_examples must be at least --global_batch_size, --num_eval_examples positive");
  Require(absl::GetFlag(FLAGS_summary_every_steps) > 0, "--summary_every_steps must be positive");
  Require(absl::GetFlag(FLAGS_checkpoint_every_steps) >= 0 && absl::GetFlag(FLAGS_eval_every_steps) >= 0,
          "--checkpoint_every_steps and --eval_every_steps must be >= 0");

  lockstep::ConfigureTorchForTraining();  // before the communicator starts its thread
  // The job's environment: MPI, the coordination service (rank 0) and a client per
  // rank, the preemption signal handlers.
  lockstep::JobEnvironmentOptions env_options;
  env_options.backend = "mpi";
  env_options.device = "cpu";
  env_options.collective_timeout = absl::Seconds(absl::GetFlag(FLAGS_collective_timeout_seconds));
  env_options.program = "sharded_embedding";
  // Two axes of more than one rank split the world with MPI_Comm_split and use
  // both communicators, one after the other, in every step.
  env_options.mpi_thread_multiple = mesh_shape.data > 1 && mesh_shape.model > 1;
  environment = lockstep::JobEnvironment::Create(env_options, runtime);
  std::unique_ptr<lockstep::Communicator> single;  // a world of one has no job communicator
  lockstep::Communicator* comm = environment->communicator();
  if (comm == nullptr) {
    single = lockstep::MakeSingleProcessCommunicator();
    comm = single.get();
  }
  const std::unique_ptr<lockstep::DeviceMesh> mesh =
      lockstep::DeviceMesh::Create(comm, mesh_shape, environment->collective_options());

  // Everything random comes from the seed alone, in the same order on every rank,
  // whatever the number of ranks: data, then the full table, then the dense layers.
  at::manual_seed(seed);
  const at::Tensor teacher = at::randn({vocab, classes});
  auto train_data = std::make_shared<lockstep::TensorDataset>(
      MakeBags(teacher, absl::GetFlag(FLAGS_num_train_examples), bag));
  auto eval_data =
      std::make_shared<lockstep::TensorDataset>(MakeBags(teacher, absl::GetFlag(FLAGS_num_eval_examples), bag));
  at::manual_seed(seed + 1);
  const at::Tensor full_table = at::randn({vocab, dim});
  auto model = BagClassifier(full_table, table_layout, mesh->model_index(), absl::GetFlag(FLAGS_hidden_dim), classes);

  lockstep::OptimizerOptions adam;
  adam.kind = lockstep::OptimizerOptions::Kind::kAdam;
  adam.learning_rate = absl::GetFlag(FLAGS_learning_rate);
  const lockstep::OptimizerFactory factory = lockstep::MakeOptimizerFactory(adam);
  lockstep::TrainState state = lockstep::MakeTrainState(model.ptr(), factory);

  ShardedEmbeddingOptions options;
  options.global_batch_size = global_batch;
  options.collective.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_collective_timeout_seconds) * 1000));
  options.check = absl::GetFlag(FLAGS_check);
  options.optimizer_factory = factory;
  ShardedEmbeddingTrainer trainer(state, runtime, mesh.get(), &partitioner, options, full_table);
  trainer.set_summary_every_steps(absl::GetFlag(FLAGS_summary_every_steps));
  trainer.AddSummarySink(lockstep::StdoutLogger{});  // rank 0 only
  trainer.AddAction(std::make_unique<lockstep::TerminateOnNanAction>());

  lockstep::ShardingOptions shard;
  shard.global_batch_size = global_batch;
  shard.rank = runtime.rank;
  shard.world_size = world;
  shard.seed = seed;
  lockstep::ShardedBatchIterator train(train_data, shard);
  shard.shuffle = false;
  shard.num_epochs = 1;
  const lockstep::ShardingOptions eval_shard = shard;

  if (runtime.is_chief()) {
    const int64_t width = table_layout.local_shape()[1];
    std::printf("sharded_embedding: %d rank(s) (%s, %s backend), mesh %s; embedding table %lld x %lld in %d column "
                "shard(s) of %lld x %lld; global batch %lld, bags of %lld tokens, %lld classes\n",
                world, runtime.launcher.c_str(), comm->backend().c_str(), lockstep::DescribeMesh(mesh_shape).c_str(),
                static_cast<long long>(vocab), static_cast<long long>(dim), table_layout.parts,
                static_cast<long long>(vocab), static_cast<long long>(width), static_cast<long long>(global_batch),
                static_cast<long long>(bag), static_cast<long long>(classes));
    std::printf("%s", lockstep::Partitioner::Table({table_layout}, mesh_shape).c_str());
    std::fflush(stdout);
  }
  // Checkpoints, resume, evaluation periods and preemption: the job layer's.
  std::unique_ptr<lockstep::CheckpointManager> checkpoints;
  if (!absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    lockstep::CheckpointOptions ckpt;
    ckpt.directory = absl::GetFlag(FLAGS_checkpoint_dir);
    ckpt.every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
    // Each rank's shard holds its own columns: it loads on the same mesh only.
    ckpt.partitioning = mesh_shape.data == 1 && table_layout.sharded()
                            ? "sharded_embedding_columns"
                            : absl::StrCat("sharded_embedding_columns_", mesh_shape.data, "x", mesh_shape.model);
    ckpt.config_text = ResumeRelevantFlags();
    ckpt.config_fingerprint = lockstep::StableHash(ckpt.config_text);
    ckpt.barrier_timeout = env_options.collective_timeout;
    checkpoints = std::make_unique<lockstep::CheckpointManager>(ckpt, runtime.rank, world, environment->coordination());
  }
  lockstep::JobOptions job;
  job.num_train_steps = steps;
  job.eval_every_steps = absl::GetFlag(FLAGS_eval_every_steps);
  job.resume = absl::GetFlag(FLAGS_resume);
  const std::vector<lockstep::EvalSet> eval_sets = {
      {"test", [&] { return std::make_unique<lockstep::ShardedBatchIterator>(eval_data, eval_shard); }}};

  const auto start = std::chrono::steady_clock::now();
  lockstep::JobResult result =
      lockstep::TrainingJob(environment.get(), job).Run(trainer, train, eval_sets, checkpoints.get());
  if (result.reason == lockstep::StopReason::kPeerFailed) return lockstep::ExitCodeFor(result.reason);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (result.reason == lockstep::StopReason::kPreempted) {
    environment->Finish();
    return lockstep::ExitCodeFor(result.reason);
  }
  lockstep::MetricMap& test = result.eval["test"];
  const CheckResult check = options.check ? trainer.GlobalCheckResult() : CheckResult{};

  int code = lockstep::ExitCodeFor(result.reason);
  if (runtime.is_chief()) {
    std::printf("Done: %lld steps in %.2f s; test loss %.4f, test accuracy %.4f\n",
                static_cast<long long>(state.step), seconds, test[lockstep::kLoss], test[lockstep::kAccuracy]);
    if (trainer.halt().halt) std::printf("Stopped early: %s\n", trainer.halt().reason.c_str());
  }
  if (options.check) {
    const double tolerance = absl::GetFlag(FLAGS_check_tolerance);
    const bool ok = check.steps == state.step && check.max_loss_diff <= tolerance &&
                    check.max_table_diff <= tolerance && check.max_dense_diff <= tolerance;
    if (runtime.is_chief()) {
      std::printf("Check against the unsharded model over %lld steps: max |loss diff| %.3g, max |table diff| %.3g, "
                  "max |dense diff| %.3g (tolerance %.3g): %s\n",
                  static_cast<long long>(check.steps), check.max_loss_diff, check.max_table_diff, check.max_dense_diff,
                  tolerance, ok ? "PASS" : "FAIL");
    }
    if (!ok) code = 1;
  }
  std::fflush(stdout);
  environment->Finish();
  return code;
}

}  // namespace
}  // namespace sharded_embedding

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Trains a classifier whose embedding table is sharded by columns over the ranks.\n"
                               "  mpirun -np 2 sharded_embedding --steps=300 --check");
  absl::ParseCommandLine(argc, argv);
  std::unique_ptr<lockstep::JobEnvironment> environment;
  int code = 1;
  std::string message, prefix;
  try {
    return sharded_embedding::Run(environment);
  } catch (const sharded_embedding::FlagError& e) {
    code = 2;
    message = e.what();
  } catch (const lockstep::InvalidArgumentError& e) {
    code = 2;
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
    prefix = "error: ";
  }
  // The others learn of this rank's failure at once; one that a peer's failure
  // caused is the peer's (exit 4).
  if (environment && environment->HandleFailure(message)) return lockstep::kExitPeerFailed;
  std::fprintf(stderr, "sharded_embedding: %s%s\n", prefix.c_str(), message.c_str());
  return code;
}
