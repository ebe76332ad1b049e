// An independent peer for the sharded strategies, under mpirun -np 2: PyTorch's
// own ZeRO (DDP + torch.distributed.optim.ZeroRedundancyOptimizer over Adam, run
// by tests/system/zero_peer.py with /usr/bin/python3) and Lockstep's Trainer
// under each partitioning strategy the library offers train the same MLP from the
// same initial parameters on the same global batches for 5 steps, and every final
// parameter agrees within 1e-5 relative (max |ours - theirs| / max |theirs|), as
// does each step's mean loss over the global batch. Whatever the two share, the
// other side's Adam, gradient averaging and parameter broadcast are written by
// other people. Skipped when /usr/bin/python3 cannot import torch.
//
// Rank 0 runs the Python side before MPI starts (no fork under MPI) and then
// tells rank 1 where the files are, or why there are none.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/mpi_communicator.h"
#include "lockstep/sharded_data_parallel.h"
#include "lockstep/trainer.h"
#include "tests/testing/temp_dir.h"

namespace lockstep {
namespace {

constexpr int kWorld = 2;
constexpr double kTolerance = 1e-5;

c10::impl::GenericDict ReadTorchSave(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) throw std::runtime_error("cannot read " + path);
  return torch::jit::pickle_load(bytes).toGenericDict();
}

at::Tensor Get(const c10::impl::GenericDict& dict, const std::string& key) {
  auto it = dict.find(key);
  if (it == dict.end()) throw std::runtime_error("no '" + key + "' in the file zero_peer.py wrote");
  return it->value().toTensor();
}

// max |a - b| / max |b|: every element counts, scaled by the tensor's magnitude.
double MaxRelative(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// The MLP of zero_peer.py: 13-29-23-7 with ReLUs, named as torch.nn.Sequential names it.
std::shared_ptr<torch::nn::SequentialImpl> Mlp() {
  torch::nn::Sequential seq(torch::nn::Linear(13, 29), torch::nn::ReLU(), torch::nn::Linear(29, 23),
                            torch::nn::ReLU(), torch::nn::Linear(23, 7));
  return seq.ptr();
}

// This rank's half of each global batch, in order.
class HalvesIterator : public BatchIterator {
 public:
  HalvesIterator(const c10::impl::GenericDict& inputs, int steps, int rank) {
    for (int s = 0; s < steps; ++s) {
      const at::Tensor x = Get(inputs, "inputs/" + std::to_string(s));
      const at::Tensor y = Get(inputs, "targets/" + std::to_string(s));
      const int64_t half = x.size(0) / kWorld;
      batches_.push_back(Batch{x.narrow(0, rank * half, half).contiguous(),
                               y.narrow(0, rank * half, half).contiguous(), {}});
    }
  }
  std::optional<Batch> Next() override {
    if (next_ >= batches_.size()) return std::nullopt;
    return batches_[next_++];
  }

 private:
  std::vector<Batch> batches_;
  size_t next_ = 0;
};

// Set up once for all tests: the Python side's files (rank 0 makes them before MPI
// starts), the communicator, and what rank 0 found.
struct Suite {
  std::unique_ptr<testing::TempDir> dir;  // rank 0's; removed at the end
  std::unique_ptr<Communicator> comm;
  enum Status : uint8_t { kReady = 0, kSkip = 1, kFailed = 2 } status = kReady;
  std::string message;  // the directory when ready, else why not
};
Suite* suite = nullptr;

class ZeroPeerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    suite = new Suite;
    const char* rank_env = std::getenv("OMPI_COMM_WORLD_RANK");
    const bool rank0 = rank_env == nullptr || std::string(rank_env) == "0";
    if (rank0) {
      if (std::system("/usr/bin/python3 -c 'import torch, torch.distributed.optim' >/dev/null 2>&1") != 0) {
        suite->status = Suite::kSkip;
        suite->message = "/usr/bin/python3 cannot import torch (python3-torch): no PyTorch peer to compare with";
      } else {
        suite->dir = std::make_unique<testing::TempDir>();
        const std::string command = std::string("/usr/bin/python3 ") + LOCKSTEP_SOURCE_DIR +
                                    "/tests/system/zero_peer.py " + suite->dir->path() + " --steps 5";
        if (std::system(command.c_str()) != 0) {
          suite->status = Suite::kFailed;
          suite->message = "failed: " + command;
        } else {
          suite->message = suite->dir->path();
        }
      }
    }
    suite->comm = MakeMpiCommunicator();
    // Rank 0's status and message to every rank.
    at::Tensor packet = at::zeros({4096}, at::kByte);
    if (suite->comm->rank() == 0) {
      packet[0] = static_cast<uint8_t>(suite->status);
      const size_t n = std::min<size_t>(suite->message.size(), 4094);
      std::copy_n(suite->message.data(), n, reinterpret_cast<char*>(packet.data_ptr<uint8_t>()) + 1);
    }
    suite->comm->Broadcast(packet, 0);
    suite->status = static_cast<Suite::Status>(packet[0].item<uint8_t>());
    suite->message = std::string(reinterpret_cast<const char*>(packet.data_ptr<uint8_t>()) + 1);
  }
  static void TearDownTestSuite() {
    if (suite->comm) suite->comm->Barrier();  // rank 1 is done with rank 0's files
    delete suite;
    suite = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(suite->comm->world_size(), kWorld) << "run under mpirun -np 2 (the Python side has 2 ranks)";
    if (suite->status == Suite::kSkip) GTEST_SKIP() << suite->message;
    ASSERT_EQ(suite->status, Suite::kReady) << suite->message;
  }
};

struct OurRun {
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<double> losses;
};

OurRun TrainOurs(PartitioningStrategy strategy, size_t unit_bytes, const c10::impl::GenericDict& inputs, int steps,
              double lr) {
  std::shared_ptr<torch::nn::SequentialImpl> model = Mlp();
  {
    at::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) item.value().copy_(Get(inputs, "init/" + item.key()));
  }
  OptimizerOptions adam;
  adam.kind = OptimizerOptions::Kind::kAdam;
  adam.learning_rate = lr;  // betas, epsilon and weight decay: torch.optim.Adam's defaults
  TrainState state = MakeTrainState(model, MakeOptimizerFactory(adam));
  TrainerOptions options;
  options.communicator = suite->comm.get();
  options.partitioning = strategy;
  options.data_parallel.bucket_bytes = unit_bytes;
  Trainer trainer(state, ForwardOf<torch::nn::SequentialImpl>(), CrossEntropyLoss(), options);
  HalvesIterator data(inputs, steps, suite->comm->rank());
  OurRun run;
  for (int s = 0; s < steps; ++s) run.losses.push_back(trainer.Train(data, 1).at(kLoss));
  EXPECT_EQ(state.step, steps);
  // Fully sharded, the model's parameters hold no data between steps: gather them
  // (a collective, as for evaluation).
  if (ShardedDataParallel* sharded = trainer.sharded_data_parallel(); sharded != nullptr && !sharded->gathered()) {
    sharded->GatherForEval();
  }
  for (const auto& item : state.model->named_parameters()) {
    run.params.emplace_back(item.key(), item.value().detach().clone());
  }
  return run;
}

TEST_F(ZeroPeerTest, ShardedStrategiesEndWhereZeroRedundancyOptimizerEnds) {
  const c10::impl::GenericDict inputs = ReadTorchSave(suite->message + "/zero_peer_inputs.pt");
  const c10::impl::GenericDict theirs = ReadTorchSave(suite->message + "/zero_peer_final.pt");
  const int steps = static_cast<int>(Get(inputs, "steps").item<int64_t>());
  const double lr = Get(inputs, "lr").item<double>();
  const at::Tensor their_losses = Get(theirs, "losses");
  ASSERT_EQ(their_losses.numel(), steps);

  // Every strategy the library offers, by name through ParsePartitioningStrategy;
  // replicated too, as plain data parallelism against the same peer.
  std::vector<PartitioningStrategy> strategies;
  for (const char* name : {"replicated", "sharded_optimizer_state", "sharded_gradients", "fully_sharded"}) {
    if (std::optional<PartitioningStrategy> s = ParsePartitioningStrategy(name)) {
      strategies.push_back(*s);
    } else if (suite->comm->rank() == 0) {
      std::printf("zero_peer_test: no strategy '%s' in this build; not compared\n", name);
    }
  }
  ASSERT_GE(strategies.size(), 3u);
  for (PartitioningStrategy strategy : strategies) {
    // One unit per parameter (each unit's element count odd, so padded) and one unit for all.
    for (size_t unit_bytes : {size_t{1}, size_t{25} << 20}) {
      SCOPED_TRACE(PartitioningStrategyName(strategy) + ", unit_bytes " + std::to_string(unit_bytes));
      const OurRun ours = TrainOurs(strategy, unit_bytes, inputs, steps, lr);
      ASSERT_EQ(ours.params.size(), 6u);
      for (const auto& [name, value] : ours.params) {
        const at::Tensor their = Get(theirs, name);
        ASSERT_EQ(value.sizes(), their.sizes()) << name;
        EXPECT_LE(MaxRelative(value, their), kTolerance) << name;
        // Not vacuous: training moved the parameter far more than the tolerance.
        EXPECT_GT(MaxRelative(Get(inputs, "init/" + name), their), 100 * kTolerance) << name;
      }
      for (int s = 0; s < steps; ++s) {
        const double expected = their_losses[s].item<double>();
        EXPECT_NEAR(ours.losses[s], expected, kTolerance * expected) << "step " << s;
      }
    }
  }
}

}  // namespace
}  // namespace lockstep
