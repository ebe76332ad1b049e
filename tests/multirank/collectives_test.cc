// Every collective of the MPI communicator, run by real processes under mpirun
// (ctest starts this binary with -np 2 and -np 3), and of the Gloo communicator
// with LOCKSTEP_TEST_BACKEND=gloo, its ranks started by launch/local.sh
// (torchrun-style) and meeting through the coordination service that rank 0
// hosts. Expected values are computed from rank and world size.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/communicator.h"
#include "lockstep/coordination.h"
#include "lockstep/gloo_communicator.h"
#include "lockstep/job.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/runtime.h"

namespace lockstep {
namespace {

bool Gloo() {
  const char* backend = std::getenv("LOCKSTEP_TEST_BACKEND");
  return backend != nullptr && std::string(backend) == "gloo";
}

// Gloo: the job environment (the coordination service on rank 0, a client on
// every rank), made once per process.
JobEnvironment& GlooEnvironment() {
  static std::unique_ptr<JobEnvironment> env = [] {
    JobEnvironmentOptions options;
    options.backend = "gloo";
    options.install_signal_handlers = false;
    options.program = "collectives_test";
    options.collective_timeout = absl::Seconds(60);
    return JobEnvironment::Create(options, Runtime::FromEnvironment());
  }();
  return *env;
}

// A communicator over every rank of the test's backend, independent of the others.
std::unique_ptr<Communicator> MakeWorld(const MpiOptions& options = {}) {
  if (!Gloo()) return MakeMpiCommunicator(options);
  static int made = 0;
  JobEnvironment& env = GlooEnvironment();
  CoordinationClient* client = env.coordination();
  return MakeGlooCommunicator(GlooStoreOverCoordination(*client, "test" + std::to_string(made++)), client->rank(),
                              client->world_size());
}

const std::vector<int64_t> kSizes = {0, 1, 17, (3 << 20) + 5};  // empty, one, odd, several MiB
const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kDouble, at::kBFloat16};

class CollectivesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MpiOptions options;
    options.chunk_bytes = 256 << 10;  // several chunks for the large sizes
    comm_ = MakeWorld(options);
    rank_ = comm_->rank();
    size_ = comm_->world_size();
    ASSERT_GE(size_, 2) << "run under mpirun (or launch/local.sh for gloo) with at least 2 ranks";
    EXPECT_EQ(comm_->backend(), Gloo() ? "gloo" : "mpi");
  }
  // Small integers (< 256) so that bfloat16 represents them exactly.
  static at::Tensor Pattern(int64_t n, at::ScalarType type) {
    return at::arange(n, at::kLong).remainder(7).add(1).to(type);
  }
  std::unique_ptr<Communicator> comm_;
  int rank_ = 0;
  int size_ = 1;
};

TEST_F(CollectivesTest, AllReduceSumAverageMax) {
  for (at::ScalarType type : kTypes) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(at::toString(type)) + " n=" + std::to_string(n));
      const at::Tensor pattern = Pattern(n, type);
      at::Tensor sum = pattern * (rank_ + 1);
      comm_->AllReduce(sum, ReduceOp::kSum);
      EXPECT_TRUE(sum.equal(pattern * (size_ * (size_ + 1) / 2)));
      at::Tensor max = pattern * (rank_ + 1);
      comm_->AllReduce(max, ReduceOp::kMax);
      EXPECT_TRUE(max.equal(pattern * size_));
      at::Tensor avg = pattern * (2 * rank_ + 1);  // mean over ranks of 2r+1 is size
      comm_->AllReduce(avg, ReduceOp::kAverage);
      EXPECT_TRUE(avg.equal(pattern * size_));
    }
  }
}

TEST_F(CollectivesTest, AllGather) {
  for (at::ScalarType type : kTypes) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(at::toString(type)) + " n=" + std::to_string(n));
      const at::Tensor input = Pattern(n, type) + rank_;
      at::Tensor output = at::zeros({n * size_}, type);
      comm_->AllGather(output, input);
      for (int r = 0; r < size_; ++r) EXPECT_TRUE(output.narrow(0, r * n, n).equal(Pattern(n, type) + r)) << r;
    }
  }
}

TEST_F(CollectivesTest, ReduceScatter) {
  for (at::ScalarType type : kTypes) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{300001}}) {
      SCOPED_TRACE(std::string(at::toString(type)) + " n=" + std::to_string(n));
      const at::Tensor input = Pattern(n * size_, type) * (rank_ + 1);
      at::Tensor output = at::zeros({n}, type);
      comm_->ReduceScatter(output, input, ReduceOp::kSum);
      EXPECT_TRUE(output.equal(Pattern(n * size_, type).narrow(0, rank_ * n, n) * (size_ * (size_ + 1) / 2)));
    }
  }
}

TEST_F(CollectivesTest, AllToAllSendsBlockJToRankJ) {
  // bfloat16 and half too: their bytes travel as they are. 300001 x 2 bytes per
  // block is in chunks (1 MiB) with a short last one.
  for (at::ScalarType type : {at::kFloat, at::kLong, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{300001}}) {
      SCOPED_TRACE(std::string(at::toString(type)) + " n=" + std::to_string(n));
      // Block j of rank r holds 1000 r + j, then a pattern.
      std::vector<at::Tensor> blocks;
      for (int j = 0; j < size_; ++j) blocks.push_back((Pattern(n, at::kFloat).remainder(7) + 1000 * rank_ + j).to(type));
      const at::Tensor input = at::cat(blocks);
      at::Tensor output = at::full({n * size_}, -1, type);
      comm_->AllToAll(output, input);
      for (int r = 0; r < size_; ++r) {
        const at::Tensor expected = (Pattern(n, at::kFloat).remainder(7) + 1000 * r + rank_).to(type);
        EXPECT_TRUE(output.narrow(0, r * n, n).equal(expected)) << "block from rank " << r;
      }
      EXPECT_TRUE(input.equal(at::cat(blocks))) << "the input changed";
    }
  }
  // Async, several in flight, then in order.
  std::vector<at::Tensor> outputs;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 4; ++i) {
    outputs.push_back(at::empty({3 * size_}, at::kInt));
    works.push_back(comm_->AllToAllAsync(outputs.back(), at::full({3 * size_}, 10 * rank_ + i, at::kInt), {}));
  }
  for (int i = 0; i < 4; ++i) {
    works[i]->Wait();
    for (int r = 0; r < size_; ++r) EXPECT_TRUE(outputs[i].narrow(0, 3 * r, 3).eq(10 * r + i).all().item<bool>());
  }
}

// A communicator of a user's that forwards every collective but AllToAll, so
// that Communicator's default (an all-gather, then the blocks) runs.
class WithoutAllToAll final : public Communicator {
 public:
  explicit WithoutAllToAll(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend() const override { return "forwarding"; }
  std::shared_ptr<Work> AllReduceAsync(at::Tensor t, ReduceOp op, const CollectiveOptions& o) override {
    return inner_->AllReduceAsync(t, op, o);
  }
  std::shared_ptr<Work> AllGatherAsync(at::Tensor out, at::Tensor in, const CollectiveOptions& o) override {
    ++all_gathers;
    return inner_->AllGatherAsync(out, in, o);
  }
  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor out, at::Tensor in, ReduceOp op,
                                           const CollectiveOptions& o) override {
    return inner_->ReduceScatterAsync(out, in, op, o);
  }
  std::shared_ptr<Work> BroadcastAsync(at::Tensor t, int root, const CollectiveOptions& o) override {
    return inner_->BroadcastAsync(t, root, o);
  }
  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& o) override { return inner_->BarrierAsync(o); }
  void AbortCollectives(const std::string& reason) override { inner_->Abort(reason); }
  int all_gathers = 0;

 private:
  Communicator* inner_;
};

TEST_F(CollectivesTest, TheDefaultAllToAllGathersAndKeepsTheBlocks) {
  WithoutAllToAll forwarding(comm_.get());
  for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{70001}}) {
    SCOPED_TRACE(n);
    const at::Tensor input = at::arange(n * size_, at::kLong) + 1000000 * rank_;
    at::Tensor output = at::full({n * size_}, -1, at::kLong);
    const int before = forwarding.all_gathers;
    forwarding.AllToAll(output, input);
    EXPECT_EQ(forwarding.all_gathers, before + 1);
    for (int r = 0; r < size_; ++r) {
      EXPECT_TRUE(output.narrow(0, r * n, n).equal(at::arange(rank_ * n, (rank_ + 1) * n, at::kLong) + 1000000 * r))
          << "block from rank " << r;
    }
  }
  EXPECT_THROW(forwarding.AllToAllAsync(at::ones({size_ + 1}), at::ones({size_ + 1}), {}), InvalidArgumentError);
}

TEST_F(CollectivesTest, BroadcastFromEveryRoot) {
  for (int root = 0; root < size_; ++root) {
    for (int64_t n : kSizes) {
      at::Tensor t = rank_ == root ? at::arange(n, at::kDouble) * (root + 1) : at::zeros({n}, at::kDouble);
      comm_->Broadcast(t, root);
      EXPECT_TRUE(t.equal(at::arange(n, at::kDouble) * (root + 1))) << "root " << root << " n " << n;
    }
  }
}

TEST_F(CollectivesTest, AsyncCallsOverlapAndCompleteInOrder) {
  std::vector<at::Tensor> tensors;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 8; ++i) {
    tensors.push_back(at::full({(1 << 18) + i}, static_cast<float>(rank_ + i), at::kFloat));
    works.push_back(comm_->AllReduceAsync(tensors.back(), ReduceOp::kSum, CollectiveOptions{}));
  }
  works.push_back(comm_->BarrierAsync(CollectiveOptions{}));
  for (auto& w : works) w->Wait();
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(works[i]->IsCompleted());
    const float expected = static_cast<float>(size_ * (size_ - 1) / 2 + size_ * i);
    EXPECT_TRUE(tensors[i].eq(expected).all().item<bool>()) << i;
  }
}

TEST_F(CollectivesTest, BadCallsAreClearErrors) {
  at::Tensor t = at::ones({4, 4}).t();  // not contiguous
  EXPECT_THROW(comm_->AllReduceAsync(t, ReduceOp::kSum, {}), InvalidArgumentError);
  EXPECT_THROW(comm_->AllReduceAsync(at::ones({3}, at::kLong), ReduceOp::kAverage, {}), InvalidArgumentError);
  EXPECT_THROW(comm_->AllGatherAsync(at::ones({3}), at::ones({3}), {}), InvalidArgumentError);
  EXPECT_THROW(comm_->BroadcastAsync(at::ones({3}), size_, {}), InvalidArgumentError);
  // All-to-all: sizes that differ or do not divide, dtypes that differ, overlap.
  EXPECT_THROW(comm_->AllToAllAsync(at::ones({2 * size_}), at::ones({size_}), {}), InvalidArgumentError);
  EXPECT_THROW(comm_->AllToAllAsync(at::ones({2 * size_ + 1}), at::ones({2 * size_ + 1}), {}), InvalidArgumentError);
  EXPECT_THROW(comm_->AllToAllAsync(at::ones({size_}, at::kInt), at::ones({size_}), {}), InvalidArgumentError);
  at::Tensor both = at::ones({2 * size_});
  EXPECT_THROW(comm_->AllToAllAsync(both, both, {}), InvalidArgumentError);
  comm_->Barrier();
}

// Several communicators live side by side in one process (no singletons).
TEST_F(CollectivesTest, IndependentCommunicators) {
  std::unique_ptr<Communicator> other = MakeWorld();
  at::Tensor a = at::full({5}, 1.0);
  at::Tensor b = at::full({5}, 2.0);
  auto wa = comm_->AllReduceAsync(a, ReduceOp::kSum, {});
  auto wb = other->AllReduceAsync(b, ReduceOp::kSum, {});
  wb->Wait();
  wa->Wait();
  EXPECT_TRUE(a.eq(size_).all().item<bool>());
  EXPECT_TRUE(b.eq(2 * size_).all().item<bool>());
}

// The line of /proc/self/maps whose range holds `address`, or "".
std::string MappingOf(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto a = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range;
    fields >> range;
    const size_t dash = range.find('-');
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (a >= lo && a < hi) return line;
  }
  return "";
}

// Split into the even and the odd ranks: each group reduces on its own, ordered
// by key (here: reversed ranks), and the world still works beside them.
TEST_F(CollectivesTest, SplitGivesGroupsOfTheirOwn) {
  if (!Gloo()) GTEST_SKIP() << "MPI's split needs MPI_THREAD_MULTIPLE from MPI_Init: tensor_parallel_test covers it";
  std::unique_ptr<Communicator> group = comm_->Split(rank_ % 2, -rank_);
  int members = 0, top = -1;
  for (int r = rank_ % 2; r < size_; r += 2) ++members, top = r;
  ASSERT_EQ(group->world_size(), members);
  if (members > 1) {
    EXPECT_EQ(group->rank(), (top - rank_) / 2);  // the highest rank first
    at::Tensor t = at::full({7}, static_cast<double>(rank_));
    group->AllReduce(t, ReduceOp::kSum);
    double expected = 0;
    for (int r = rank_ % 2; r < size_; r += 2) expected += r;
    EXPECT_TRUE(t.eq(expected).all().item<bool>());
  }
  at::Tensor w = at::ones({3});
  comm_->AllReduce(w, ReduceOp::kSum);
  EXPECT_TRUE(w.eq(size_).all().item<bool>());
}

// A collective that the other ranks never join times out as a
// CollectiveTimeoutError, and the communicator is broken after it; Abort breaks
// a healthy one at once, with its reason.
TEST_F(CollectivesTest, TimeoutAndAbortBreakTheCommunicator) {
  if (!Gloo()) GTEST_SKIP() << "MPI's timeout is tested by collective_timeout.np2 (its communicator ends the job)";
  std::unique_ptr<Communicator> lonely = MakeWorld();
  if (rank_ == 0) {
    at::Tensor t = at::ones({10});
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(lonely->AllReduce(t, ReduceOp::kSum, CollectiveOptions{std::chrono::milliseconds(500)}),
                 CollectiveTimeoutError);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0);
    EXPECT_THAT([&] { lonely->AllReduce(t, ReduceOp::kSum); },
                ::testing::ThrowsMessage<CollectiveError>(::testing::HasSubstr("broken")));
  }
  comm_->Barrier();  // the others wait here, never joining rank 0's all-reduce
  // Every rank closes that group before any makes the next one: otherwise a
  // rank's peers could be closing their side of it while the next group connects.
  lonely.reset();
  comm_->Barrier();
  std::unique_ptr<Communicator> aborted = MakeWorld();
  aborted->Abort("a test said so");
  EXPECT_THAT([&] { aborted->Barrier(); },
              ::testing::ThrowsMessage<CollectiveError>(::testing::HasSubstr("a test said so")));
  // Bad input is still a clear error, ahead of the broken state.
  EXPECT_THROW(aborted->AllReduceAsync(at::ones({4, 4}).t(), ReduceOp::kSum, {}), InvalidArgumentError);
  EXPECT_THROW(aborted->AllReduceAsync(at::ones({4}, at::kBool), ReduceOp::kSum, {}), InvalidArgumentError);
}

// Aborting a communicator reaches the groups split from it: rank 0 waits in an
// all-reduce of a group (the world in reverse order, a process group of its
// own) that no other rank has joined yet, with a minute's timeout, and another
// thread aborts the world. The group's all-reduce fails with the abort's reason
// at once; only then do the others join it, so that rank 0's group can close.
TEST_F(CollectivesTest, AbortReachesTheSplitGroups) {
  if (!Gloo()) GTEST_SKIP() << "an aborted MPI collective ends the job: collective_timeout.split_abort.np2 covers MPI";
  std::unique_ptr<Communicator> world = MakeWorld();
  std::unique_ptr<Communicator> group = world->Split(0, -rank_);
  ASSERT_EQ(group->rank(), size_ - 1 - rank_);
  const CollectiveOptions minute{std::chrono::minutes(1)};
  at::Tensor t = at::ones({1000});
  if (rank_ == 0) {
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      world->Abort("a peer died (the test says so)");
    });
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THAT([&] { group->AllReduce(t, ReduceOp::kSum, minute); },
                ::testing::ThrowsMessage<CollectiveError>(::testing::HasSubstr("a peer died (the test says so)")));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 10.0);
    aborter.join();
    EXPECT_THAT([&] { group->Barrier(); }, ::testing::ThrowsMessage<CollectiveError>(::testing::HasSubstr("peer died")));
  }
  comm_->Barrier();
  // Rank 0's all-reduce is still in flight in its process group: the others
  // complete it.
  if (rank_ != 0) group->AllReduce(t, ReduceOp::kSum, minute);
  comm_->Barrier();
  group.reset();
  world.reset();
  comm_->Barrier();
}

// On one host, float and double collective buffers live in shared memory whose
// name is already gone (mapped "(deleted)"), and all-reducing a whole one (the
// in-place path) gives the same sums and means as MPI, again and again.
TEST_F(CollectivesTest, SharedCollectiveBuffersReduceInPlace) {
  if (Gloo()) GTEST_SKIP() << "the gloo backend's collective buffers are plain tensors (no shared-memory path)";
  for (at::ScalarType type : {at::kFloat, at::kDouble}) {
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{3 * 2048 + 5}, int64_t{(1 << 20) + 3}}) {
      SCOPED_TRACE(std::string(at::toString(type)) + " n=" + std::to_string(n));
      at::Tensor buffer = comm_->AllocateCollectiveBuffer(n, at::TensorOptions().dtype(type));
      ASSERT_EQ(buffer.numel(), n);
      ASSERT_EQ(buffer.scalar_type(), type);
      EXPECT_THAT(MappingOf(buffer.data_ptr()), ::testing::AllOf(::testing::HasSubstr("/dev/shm/lockstep-"),
                                                                 ::testing::HasSubstr("(deleted)")));
      const at::Tensor pattern = Pattern(n, type);
      for (int round = 0; round < 3; ++round) {
        buffer.copy_(pattern * (rank_ + 1 + round));
        comm_->AllReduce(buffer, ReduceOp::kSum);
        EXPECT_TRUE(buffer.equal(pattern * (size_ * (size_ + 1) / 2 + size_ * round)));
        buffer.copy_(pattern * (2 * rank_ + 1));  // mean over ranks of 2r+1 is size
        comm_->AllReduce(buffer, ReduceOp::kAverage);
        EXPECT_TRUE(buffer.equal(pattern * size_));
      }
      // Max, and a part of the buffer, go through MPI.
      buffer.copy_(pattern * (rank_ + 1));
      comm_->AllReduce(buffer, ReduceOp::kMax);
      EXPECT_TRUE(buffer.equal(pattern * size_));
      if (n > 2) {
        buffer.copy_(pattern * (rank_ + 1));
        at::Tensor part = buffer.narrow(0, 1, n - 2);
        comm_->AllReduce(part, ReduceOp::kSum);
        EXPECT_TRUE(part.equal(pattern.narrow(0, 1, n - 2) * (size_ * (size_ + 1) / 2)));
        EXPECT_TRUE(buffer.narrow(0, 0, 1).equal(pattern.narrow(0, 0, 1) * (rank_ + 1))) << "outside the part";
      }
    }
  }
}

// Reduce-scatter from a shared buffer and all-gather into one (the sharded
// strategies' path on one host) give what MPI gives, round after round.
TEST_F(CollectivesTest, SharedCollectiveBuffersReduceScatterAndAllGather) {
  if (Gloo()) GTEST_SKIP() << "the gloo backend's collective buffers are plain tensors (no shared-memory path)";
  for (at::ScalarType type : {at::kFloat, at::kDouble}) {
    for (int64_t slice : {int64_t{1}, int64_t{3 * 2048 + 5}, int64_t{(1 << 18) + 3}}) {
      SCOPED_TRACE(std::string(at::toString(type)) + " slice=" + std::to_string(slice));
      const int64_t n = slice * size_;
      at::Tensor buffer = comm_->AllocateCollectiveBuffer(n, at::TensorOptions().dtype(type));
      ASSERT_THAT(MappingOf(buffer.data_ptr()), ::testing::HasSubstr("/dev/shm/lockstep-"));
      const at::Tensor pattern = Pattern(n, type);
      const at::Tensor mine = pattern.narrow(0, rank_ * slice, slice);
      for (int round = 0; round < 3; ++round) {
        at::Tensor out = at::empty({slice}, at::TensorOptions().dtype(type));
        buffer.copy_(pattern * (rank_ + 1 + round));
        comm_->ReduceScatter(out, buffer, ReduceOp::kSum);
        EXPECT_TRUE(out.equal(mine * (size_ * (size_ + 1) / 2 + size_ * round)));
        buffer.copy_(pattern * (2 * rank_ + 1));
        comm_->ReduceScatter(out, buffer, ReduceOp::kAverage);
        EXPECT_TRUE(out.equal(mine * size_));
        // All-gather into the buffer: rank r contributes (r + 1 + round) times its slice.
        buffer.fill_(-1);
        comm_->AllGather(buffer, mine * (rank_ + 1 + round));
        for (int r = 0; r < size_; ++r) {
          EXPECT_TRUE(buffer.narrow(0, r * slice, slice).equal(pattern.narrow(0, r * slice, slice) * (r + 1 + round)))
              << "rank " << r << "'s slice";
        }
        // In place, into the shared buffer and into a plain tensor (the staging path).
        for (at::Tensor out : {buffer, at::empty({n}, at::TensorOptions().dtype(type))}) {
          out.fill_(-1);
          at::Tensor own = out.narrow(0, rank_ * slice, slice);
          own.copy_(mine * (rank_ + 2));
          comm_->AllGather(out, own);
          for (int r = 0; r < size_; ++r) {
            EXPECT_TRUE(out.narrow(0, r * slice, slice).equal(pattern.narrow(0, r * slice, slice) * (r + 2)))
                << "in place, rank " << r << "'s slice";
          }
        }
      }
    }
  }
}

// Other dtypes, an empty buffer, and a communicator told not to share get plain
// tensors, which reduce through MPI as any other.
TEST_F(CollectivesTest, CollectiveBuffersFallBackToPlainTensors) {
  at::Tensor longs = comm_->AllocateCollectiveBuffer(33, at::TensorOptions().dtype(at::kLong));
  EXPECT_THAT(MappingOf(longs.data_ptr()), ::testing::Not(::testing::HasSubstr("lockstep-")));
  longs.fill_(rank_ + 1);
  comm_->AllReduce(longs, ReduceOp::kSum);
  EXPECT_TRUE(longs.eq(size_ * (size_ + 1) / 2).all().item<bool>());
  EXPECT_EQ(comm_->AllocateCollectiveBuffer(0, at::TensorOptions().dtype(at::kFloat)).numel(), 0);

  // Ranks that ask for different sizes (an SPMD mistake) get plain tensors, and a
  // rank that saw the mismatch says so on stderr, instead of mapping past the end
  // of a peer's segment.
  at::Tensor uneven = comm_->AllocateCollectiveBuffer(100 + rank_, at::TensorOptions().dtype(at::kFloat));
  EXPECT_EQ(uneven.numel(), 100 + rank_);
  EXPECT_THAT(MappingOf(uneven.data_ptr()), ::testing::Not(::testing::HasSubstr("lockstep-")));
  comm_->Barrier();
  if (Gloo()) return;  // the rest is MPI's own option

  MpiOptions no_sharing;
  no_sharing.shared_memory_buffers = false;
  std::unique_ptr<Communicator> plain = MakeMpiCommunicator(no_sharing);
  at::Tensor floats = plain->AllocateCollectiveBuffer(1000, at::TensorOptions().dtype(at::kFloat));
  EXPECT_THAT(MappingOf(floats.data_ptr()), ::testing::Not(::testing::HasSubstr("lockstep-")));
  floats.fill_(rank_ + 1);
  plain->AllReduce(floats, ReduceOp::kSum);
  EXPECT_TRUE(floats.eq(size_ * (size_ + 1) / 2).all().item<bool>());
  // Its all-gather (in place too) and reduce-scatter go through MPI.
  at::Tensor gathered = at::full({3 * size_}, -1.0f);
  plain->AllGather(gathered, at::full({3}, static_cast<float>(rank_)));
  for (int r = 0; r < size_; ++r) EXPECT_TRUE(gathered.narrow(0, 3 * r, 3).eq(r).all().item<bool>()) << r;
  gathered.fill_(-1);
  gathered.narrow(0, 3 * rank_, 3).fill_(rank_ + 5);
  plain->AllGather(gathered, gathered.narrow(0, 3 * rank_, 3));
  for (int r = 0; r < size_; ++r) EXPECT_TRUE(gathered.narrow(0, 3 * r, 3).eq(r + 5).all().item<bool>()) << r;
  // Above the chunk size (1 MiB) it goes in chunks, each rank's landing in its place; in place too.
  const int64_t n = 300001;
  at::Tensor large = at::full({n * size_}, -1.0f);
  plain->AllGather(large, at::arange(n, at::kFloat) + rank_);
  for (int r = 0; r < size_; ++r) EXPECT_TRUE(large.narrow(0, n * r, n).equal(at::arange(n, at::kFloat) + r)) << r;
  large.fill_(-1);
  large.narrow(0, n * rank_, n).copy_(at::arange(n, at::kFloat) * (rank_ + 2));
  plain->AllGather(large, large.narrow(0, n * rank_, n));
  for (int r = 0; r < size_; ++r) {
    EXPECT_TRUE(large.narrow(0, n * r, n).equal(at::arange(n, at::kFloat) * (r + 2))) << r;
  }
  at::Tensor mine = at::empty({3});
  plain->ReduceScatter(mine, at::arange(3 * size_, at::kFloat), ReduceOp::kSum);
  EXPECT_TRUE(mine.equal(at::arange(3 * rank_, 3 * rank_ + 3, at::kFloat) * size_));
}

}  // namespace
}  // namespace lockstep
