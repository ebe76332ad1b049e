// Gradient communication hooks and the hierarchical all-reduce under mpirun -np 2
// and 4: what each hook leaves in a bucket against the sums computed here, the
// replicas staying identical when they train with a hook, the hierarchy
// (ranks_per_host 2 at 4 ranks) training as the flat all-reduce does, and (as
// root, at 4 ranks) two hosts faked by host name and interleaved: the flat buckets
// in host order, the hierarchy finding the hosts.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lockstep/comm_hooks.h"
#include "lockstep/data_parallel.h"
#include "lockstep/errors.h"
#include "lockstep/host.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/trainer.h"
#include "tests/testing/mpi_ranks.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using testing::MaxRelativeDifference;
using testing::Snapshot;
using testing::TinyDataset;
using testing::TinyModel;
using ::testing::HasSubstr;

class CommHooksTest : public testing::MpiRanksTest {
 protected:
  MpiOptions Options() const override {
    MpiOptions options;
    options.thread_multiple = true;  // the hierarchy's groups run side by side
    return options;
  }
};

// Rank r's values: not representable in 16 bits, different on every rank.
at::Tensor RankValues(int rank, int64_t n) {
  return at::linspace(-3.0, 5.0, n, at::kFloat) * (1.0 + 0.37 * rank) + 0.001 * rank;
}

TEST_F(CommHooksTest, HalfPrecisionHooksSumTheRoundedValuesInFloat32InRankOrder) {
  // 700001 values: 1.4 MB in 16 bits, an all-gather in chunks of 1 MiB with a short last one.
  for (const int64_t n : {int64_t{1001}, int64_t{700001}})
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(absl::StrCat(at::toString(dtype), " x ", n));
    HalfPrecisionHook hook(dtype);
    GradientBucket bucket;
    bucket.buffer = RankValues(rank_, n);
    hook.Run(*comm_, bucket, {})->Wait();
    at::Tensor expected = RankValues(0, n).to(dtype).to(at::kFloat);
    for (int r = 1; r < size_; ++r) expected.add_(RankValues(r, n).to(dtype).to(at::kFloat));
    if (size_ >= 3) {
      // Each slice's owner rounds its float32 sum to 16 bits again (fp16: the mean).
      expected = dtype == at::kHalf ? expected.div(size_).to(dtype).to(at::kFloat).mul(size_)
                                    : expected.to(dtype).to(at::kFloat);
    }
    EXPECT_TRUE(at::equal(bucket.buffer, expected));
    // Not the float32 sum: the values did travel in 16 bits.
    at::Tensor exact = at::zeros({n});
    for (int r = 0; r < size_; ++r) exact.add_(RankValues(r, n));
    EXPECT_FALSE(at::equal(bucket.buffer, exact));
    EXPECT_LE((bucket.buffer - exact).abs().max().item<double>(), size_ * 5.0 * (dtype == at::kHalf ? 1e-3 : 8e-3));
  }
}

TEST_F(CommHooksTest, HalfPrecisionBucketsInFlightTogetherEachGetTheirOwnSum) {
  // As the bucketer runs them: every bucket's Run, then the Waits in order. Among
  // 3 or more ranks a bucket's all-gather starts at the next Run; sizes that do
  // not divide by the world (and one smaller than it) are padded.
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(at::toString(dtype));
    HalfPrecisionHook hook(dtype);
    const std::vector<int64_t> sizes = {1001, 3, 70001, 2};
    for (int step = 0; step < 2; ++step) {
      std::vector<GradientBucket> buckets(sizes.size());
      std::vector<std::shared_ptr<Work>> works;
      for (size_t b = 0; b < sizes.size(); ++b) {
        buckets[b].index = static_cast<int>(b);
        buckets[b].step = step;
        buckets[b].buffer = RankValues(rank_, sizes[b]) * static_cast<float>(b + 1 + step);
        works.push_back(hook.Run(*comm_, buckets[b], {}));
      }
      for (size_t b = 0; b < sizes.size(); ++b) {
        works[b]->Wait();
        EXPECT_TRUE(works[b]->IsCompleted());
        at::Tensor exact = at::zeros({sizes[b]});
        for (int r = 0; r < size_; ++r) exact.add_(RankValues(r, sizes[b]) * static_cast<float>(b + 1 + step));
        EXPECT_LE((buckets[b].buffer - exact).abs().max().item<double>(),
                  (b + 1 + step) * size_ * 5.0 * (dtype == at::kHalf ? 1e-3 : 8e-3))
            << "bucket " << b << " of step " << step;
      }
    }
  }
}

// A bucket of one 40 x 30 matrix and one bias, as the bucketer hands it over.
GradientBucket MatrixBucket(const at::Tensor& matrix, const at::Tensor& bias) {
  GradientBucket bucket;
  bucket.buffer = at::cat({matrix.reshape({-1}), bias});
  bucket.gradients = {bucket.buffer.narrow(0, 0, matrix.numel()).view(matrix.sizes()),
                      bucket.buffer.narrow(0, matrix.numel(), bias.numel())};
  return bucket;
}

TEST_F(CommHooksTest, PowerSgdIsExactWhenTheSumHasLowRankAndAllReducesUntilItsStartStep) {
  PowerSgdOptions options;
  options.rank = size_;  // the sum of `size_` rank-1 matrices has rank <= size_
  options.start_step = 1;
  PowerSgdHook hook(options);
  const auto u = [](int r) { return at::linspace(0.5, 1.5 + r, 40, at::kFloat).unsqueeze(1); };
  const auto v = [](int r) { return at::cos(at::arange(30, at::kFloat) * (0.3 + r)).unsqueeze(0); };
  const auto bias = [](int r) { return at::full({30}, 0.25f * (r + 1)); };
  at::Tensor sum = at::zeros({40, 30});
  at::Tensor bias_sum = at::zeros({30});
  for (int r = 0; r < size_; ++r) {
    sum.add_(at::mm(u(r), v(r)));
    bias_sum.add_(bias(r));
  }
  for (int64_t step : {0, 1, 2}) {
    SCOPED_TRACE(step);
    GradientBucket bucket = MatrixBucket(at::mm(u(rank_), v(rank_)), bias(rank_));
    bucket.step = step;
    hook.Run(*comm_, bucket, {})->Wait();
    // Step 0: a plain all-reduce; then rank size_ factors that span the sum's columns.
    EXPECT_LE((bucket.gradients[0] - sum).abs().max().item<double>(), 1e-4 * sum.abs().max().item<double>());
    EXPECT_TRUE(at::allclose(bucket.gradients[1], bias_sum));
  }
}

TEST_F(CommHooksTest, PowerSgdFeedsBackWhatItsApproximationMissed) {
  PowerSgdOptions options;
  options.rank = 1;
  options.start_step = 0;
  PowerSgdHook hook(options);
  // A full-rank sum that rank 1 cannot hold.
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(1234 + rank_);
  const at::Tensor mine = at::randn({40, 30}, generator);
  at::Tensor sum = mine.clone();
  comm_->AllReduce(sum, ReduceOp::kSum);
  GradientBucket first = MatrixBucket(mine, at::zeros({30}));
  hook.Run(*comm_, first, {})->Wait();
  const at::Tensor missed = sum - first.gradients[0];
  ASSERT_GT(missed.norm().item<double>(), 0.1 * sum.norm().item<double>());
  // With no new gradient, the next step sends only the errors: the ranks' sum of
  // them is what the first approximation missed, and it is approximated in turn.
  GradientBucket second = MatrixBucket(at::zeros({40, 30}), at::zeros({30}));
  second.step = 1;
  hook.Run(*comm_, second, {})->Wait();
  EXPECT_GT(second.gradients[0].norm().item<double>(), 0.1 * missed.norm().item<double>());
  EXPECT_LT((missed - second.gradients[0]).norm().item<double>(), missed.norm().item<double>());
}

TEST_F(CommHooksTest, UnknownHooksAndBadOptionsAreErrors) {
  EXPECT_THAT([] { MakeCommHook("zip"); }, ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr(
                                               "unknown gradient communication hook 'zip' (choose none, allreduce, "
                                               "bf16, fp16 or powersgd)")));
  PowerSgdOptions bad;
  bad.rank = 0;
  EXPECT_THAT([&] { MakeCommHook("powersgd", bad); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("PowerSGD: rank must be >= 1, got 0")));
  EXPECT_FALSE(MakeCommHook("none"));
  EXPECT_THROW(HalfPrecisionHook(at::kFloat), InvalidArgumentError);
}

struct Trained {
  std::vector<at::Tensor> params;
  std::string description;
};

constexpr int64_t kGlobalBatch = 32;

Trained Train(Communicator* comm, int rank, int world, const DataParallelOptions& data_parallel, int steps = 4) {
  BuiltModel model = TinyModel(5);
  OptimizerOptions sgd;
  sgd.learning_rate = 0.1;
  TrainState state = MakeTrainState(model.module, MakeOptimizerFactory(sgd));
  TrainerOptions options;
  options.communicator = comm;
  options.data_parallel = data_parallel;
  Trainer trainer(state, model.apply, CrossEntropyLoss(), options);
  ShardingOptions sharding;
  sharding.global_batch_size = kGlobalBatch;
  sharding.rank = rank;
  sharding.world_size = world;
  sharding.seed = 3;
  ShardedBatchIterator data(TinyDataset(96), sharding);
  trainer.Train(data, steps);
  Trained result;
  result.params = Snapshot(*state.model);
  if (DataParallel* dp = trainer.data_parallel()) result.description = dp->bucketer().description();
  return result;
}

// Rank 0's parameters, broadcast, against this rank's: bit for bit.
void ExpectReplicasIdentical(Communicator& comm, const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    at::Tensor theirs = p.clone();
    comm.Broadcast(theirs, 0);
    EXPECT_TRUE(at::equal(theirs, p));
  }
}

TEST_F(CommHooksTest, ReplicasStayIdenticalUnderEveryHookAndTrainCloseToFloat32) {
  DataParallelOptions plain;
  plain.bucket_bytes = 2048;  // several buckets
  const Trained reference = Train(comm_.get(), rank_, size_, plain);
  EXPECT_THAT(reference.description, HasSubstr("float32 all-reduce; flat"));
  for (const std::string name : {"bf16", "fp16", "powersgd"}) {
    SCOPED_TRACE(name);
    PowerSgdOptions powersgd;
    powersgd.start_step = 1;
    DataParallelOptions options = plain;
    options.comm_hook = MakeCommHook(name, powersgd);
    const Trained ours = Train(comm_.get(), rank_, size_, options);
    EXPECT_THAT(ours.description, HasSubstr(name));
    ExpectReplicasIdentical(*comm_, ours.params);
    const double difference = MaxRelativeDifference(ours.params, reference.params);
    EXPECT_GT(difference, 0.0) << "the hook changed nothing";
    EXPECT_LT(difference, name == "powersgd" ? 0.5 : 0.05);
  }
}

TEST_F(CommHooksTest, HierarchicalAllReduceTrainsAsTheFlatOne) {
  DataParallelOptions flat;
  flat.bucket_bytes = 2048;
  const Trained reference = Train(comm_.get(), rank_, size_, flat);
  DataParallelOptions hierarchical = flat;
  hierarchical.hierarchical = true;
  hierarchical.ranks_per_host = 2;
  const Trained ours = Train(comm_.get(), rank_, size_, hierarchical);
  ExpectReplicasIdentical(*comm_, ours.params);
  EXPECT_LE(MaxRelativeDifference(ours.params, reference.params), 1e-5);
  if (size_ % 4 == 0) {
    EXPECT_THAT(ours.description, HasSubstr(absl::StrCat("hierarchical all-reduce: ", size_ / 2, " hosts x 2 ranks")));
    // bf16 between the hosts, over the hierarchy.
    hierarchical.comm_hook = MakeCommHook("bf16");
    const Trained compressed = Train(comm_.get(), rank_, size_, hierarchical);
    ExpectReplicasIdentical(*comm_, compressed.params);
    EXPECT_LT(MaxRelativeDifference(compressed.params, reference.params), 0.05);
    EXPECT_THAT(compressed.description, HasSubstr("bf16 hook; hierarchical all-reduce"));
  } else {
    EXPECT_THAT(ours.description, HasSubstr("hierarchical all-reduce off: every rank is on one host"));
  }
  // By host name: every rank here is on this host.
  hierarchical.comm_hook = {};
  hierarchical.ranks_per_host = 0;
  EXPECT_THAT(Train(comm_.get(), rank_, size_, hierarchical, 1).description,
              HasSubstr("hierarchical all-reduce off: every rank is on one host"));
}

// This thread's host name in a UTS namespace of its own, back as it was at the end
// (the namespace stays: a thread cannot leave it). ok() is false when either
// step failed (not root), and why() says why.
class FakeHostName {
 public:
  explicit FakeHostName(const std::string& name) : original_(HostName()) {
    if (unshare(CLONE_NEWUTS) != 0) {
      why_ = absl::StrCat("unshare(CLONE_NEWUTS): ", std::strerror(errno));
    } else if (sethostname(name.data(), name.size()) != 0) {
      why_ = absl::StrCat("sethostname: ", std::strerror(errno));
    }
  }
  ~FakeHostName() {
    if (why_.empty()) (void)sethostname(original_.data(), original_.size());
  }
  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }

 private:
  std::string original_;
  std::string why_;
};

TEST_F(CommHooksTest, FlatBucketsRunInHostOrderWhenTheHostsInterleave) {
  if (size_ % 4 != 0) GTEST_SKIP() << "two hosts interleave from 4 ranks on; this run has " << size_;
  // Ranks 0 and 2 on one host, 1 and 3 on the other, as mpirun --map-by node places them.
  FakeHostName fake(absl::StrCat("lockstep-test-host-", rank_ % 2));
  at::Tensor failed = at::full({1}, fake.ok() ? 0 : 1, at::kInt);
  comm_->AllReduce(failed, ReduceOp::kMax);  // all ranks skip alike, or none
  if (failed.item<int>() != 0) GTEST_SKIP() << "cannot fake host names here (root only)" << (fake.ok() ? "" : ": ") << fake.why();
  DataParallelOptions launch_order;
  launch_order.bucket_bytes = 2048;
  launch_order.order_by_host = false;
  const Trained reference = Train(comm_.get(), rank_, size_, launch_order);
  EXPECT_EQ(reference.description, "gradient buckets: float32 all-reduce; flat");
  std::string hosts;
  for (int r = 0; r < size_; ++r) absl::StrAppend(&hosts, r > 0 ? " " : "", r % 2);
  DataParallelOptions host_order = launch_order;
  host_order.order_by_host = true;
  const Trained ours = Train(comm_.get(), rank_, size_, host_order);
  EXPECT_EQ(ours.description, absl::StrCat("gradient buckets: float32 all-reduce; flat all-reduce, ranks in host order "
                                           "(the launcher interleaved the hosts: rank -> host ", hosts, ")"));
  ExpectReplicasIdentical(*comm_, ours.params);
  EXPECT_LE(MaxRelativeDifference(ours.params, reference.params), 1e-5);  // another order of addition
  // A hook runs on the reordered group too (the 16-bit all-to-all among 4 and more).
  host_order.comm_hook = MakeCommHook("bf16");
  const Trained compressed = Train(comm_.get(), rank_, size_, host_order);
  EXPECT_THAT(compressed.description, HasSubstr("bf16 hook; flat all-reduce, ranks in host order"));
  ExpectReplicasIdentical(*comm_, compressed.params);
  EXPECT_LT(MaxRelativeDifference(compressed.params, reference.params), 0.05);
  // The hierarchy finds the two hosts by name, whatever the ranks' order.
  DataParallelOptions hierarchical = launch_order;
  hierarchical.hierarchical = true;
  const Trained layered = Train(comm_.get(), rank_, size_, hierarchical);
  EXPECT_THAT(layered.description, HasSubstr(absl::StrCat("hierarchical all-reduce: 2 hosts x ", size_ / 2, " ranks")));
  ExpectReplicasIdentical(*comm_, layered.params);
  EXPECT_LE(MaxRelativeDifference(layered.params, reference.params), 1e-5);
}

TEST_F(CommHooksTest, BucketAutotuneTriesEachSizeAndKeepsTheFastestOnEveryRank) {
  DataParallelOptions plain;
  plain.bucket_bytes = 2048;
  const Trained reference = Train(comm_.get(), rank_, size_, plain, 12);
  DataParallelOptions tuned = plain;
  tuned.autotune_bucket_bytes = {1024, size_t{1} << 20};
  tuned.autotune_steps = 2;
  // Step 1 rebuilds the layout; then each size for 1 + 2 steps (+ 1 before the first).
  const Trained ours = Train(comm_.get(), rank_, size_, tuned, 12);
  EXPECT_THAT(ours.description, ::testing::MatchesRegex(
                                    ".*; bucket autotune: 0.000977 MiB [0-9.]+ ms, 1 MiB [0-9.]+ ms -> (0.000977|1) MiB "
                                    "\\([0-9]+ bucket\\(s\\)\\)"));
  ExpectReplicasIdentical(*comm_, ours.params);
  // The sizes change how gradients are grouped, not what they sum to.
  EXPECT_LE(MaxRelativeDifference(ours.params, reference.params), 1e-5);
  // Every rank chose the same.
  const std::string choice = ours.description.substr(ours.description.find("->"));
  at::Tensor mine = at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(choice) & 0xffffffff), at::kLong);
  at::Tensor max = mine.clone();
  comm_->AllReduce(max, ReduceOp::kMax);
  EXPECT_EQ(max.item<int64_t>(), mine.item<int64_t>());
}

TEST_F(CommHooksTest, TheHierarchyRefusesPowerSgdAndRanksPerHostThatDoNotDivideTheWorld) {
  BuiltModel model = TinyModel(1);
  DataParallelOptions options;
  options.hierarchical = true;
  options.ranks_per_host = size_ + 1;
  EXPECT_THAT([&] { GradientBucketer(comm_.get(), model.module->parameters(), options); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("does not divide the world")));
  if (size_ % 4 == 0) {
    options.ranks_per_host = 2;
    options.comm_hook = MakeCommHook("powersgd");
    EXPECT_THAT([&] { GradientBucketer(comm_.get(), model.module->parameters(), options); },
                ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("hook needs whole buckets")));
  }
}

}  // namespace
}  // namespace lockstep
