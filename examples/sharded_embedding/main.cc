// sharded_embedding: trains a bag-of-tokens classifier on synthetic text, with its
// embedding table split by columns over the ranks of an MPI job, through Lockstep's
// BaseTrainer, communicator and data iterator. See README.md.
//
//   mpirun -np 2 build/sharded_embedding --steps=300 --check
//
// Exit codes: 0 done (and with --check, the sharded model matched the unsharded
// one), 1 a failure or a failed check, 2 a bad flag.
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
#include "lockstep/communicator.h"
#include "lockstep/data.h"
#include "lockstep/errors.h"
#include "lockstep/metrics.h"
#include "lockstep/runtime.h"
#include "lockstep/torch_setup.h"
#include "lockstep/train_state.h"
#include "lockstep/trainer.h"
#if LOCKSTEP_HAVE_MPI
#include "lockstep/mpi_communicator.h"
#endif
#include "sharded_embedding_trainer.h"

ABSL_FLAG(int64_t, steps, 300, "optimizer steps");
ABSL_FLAG(int64_t, vocab_size, 1000, "rows of the embedding table (token ids)");
ABSL_FLAG(int64_t, embedding_dim, 32, "columns of the embedding table; a multiple of the number of ranks");
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

std::unique_ptr<lockstep::Communicator> MakeCommunicator(const lockstep::Runtime& runtime) {
  if (runtime.world_size == 1) return lockstep::MakeSingleProcessCommunicator();
#if LOCKSTEP_HAVE_MPI
  std::unique_ptr<lockstep::Communicator> comm = lockstep::MakeMpiCommunicator();
  if (comm->rank() != runtime.rank || comm->world_size() != runtime.world_size) {
    throw lockstep::Error("MPI and the " + runtime.launcher + " environment disagree on rank and world size");
  }
  return comm;
#else
  throw lockstep::Error("this Lockstep was built without MPI; run a single process");
#endif
}

int Run() {
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
  Require(dim > 0 && dim % world == 0, "--embedding_dim=" + std::to_string(dim) + " must be a positive multiple of " +
                                           "the number of ranks (" + std::to_string(world) + ")");
  Require(global_batch >= world, "--global_batch_size must be at least the number of ranks");
  Require(absl::GetFlag(FLAGS_num_train_examples) >= global_batch && absl::GetFlag(FLAGS_num_eval_examples) > 0,
          "--num_train_examples must be at least --global_batch_size, --num_eval_examples positive");
  Require(absl::GetFlag(FLAGS_summary_every_steps) > 0, "--summary_every_steps must be positive");

  lockstep::ConfigureTorchForTraining();  // before the communicator starts its thread
  std::unique_ptr<lockstep::Communicator> comm = MakeCommunicator(runtime);

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
  auto model = BagClassifier(full_table, runtime.rank, world, absl::GetFlag(FLAGS_hidden_dim), classes);

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
  ShardedEmbeddingTrainer trainer(state, runtime, comm.get(), options, full_table);
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
  lockstep::ShardedBatchIterator eval(eval_data, shard);

  if (runtime.is_chief()) {
    std::printf("sharded_embedding: %d rank(s) (%s, %s backend); embedding table %lld x %lld in %d column shard(s) "
                "of %lld x %lld; global batch %lld, bags of %lld tokens, %lld classes\n",
                world, runtime.launcher.c_str(), comm->backend().c_str(), static_cast<long long>(vocab),
                static_cast<long long>(dim), world, static_cast<long long>(vocab), static_cast<long long>(dim / world),
                static_cast<long long>(global_batch), static_cast<long long>(bag), static_cast<long long>(classes));
    std::fflush(stdout);
  }
  const auto start = std::chrono::steady_clock::now();
  trainer.Train(train, steps);
  const auto results = trainer.Eval({{"test", &eval}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const lockstep::MetricMap& test = results.front().second;
  const CheckResult check = options.check ? trainer.GlobalCheckResult() : CheckResult{};

  int code = trainer.halt().failure ? 3 : 0;
  if (runtime.is_chief()) {
    std::printf("Done: %lld steps in %.2f s; test loss %.4f, test accuracy %.4f\n",
                static_cast<long long>(state.step), seconds, test.at(lockstep::kLoss), test.at(lockstep::kAccuracy));
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
  return code;
}

}  // namespace
}  // namespace sharded_embedding

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Trains a classifier whose embedding table is sharded by columns over the ranks.\n"
                               "  mpirun -np 2 sharded_embedding --steps=300 --check");
  absl::ParseCommandLine(argc, argv);
  try {
    return sharded_embedding::Run();
  } catch (const sharded_embedding::FlagError& e) {
    std::fprintf(stderr, "sharded_embedding: %s\n", e.what());
    return 2;
  } catch (const lockstep::InvalidArgumentError& e) {
    std::fprintf(stderr, "sharded_embedding: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharded_embedding: error: %s\n", e.what());
    return 1;
  }
}
