// Every collective of the MPI communicator, run by real processes under mpirun
// (ctest starts this binary with -np 2 and -np 3). Expected values are computed
// from rank and world size.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "lockstep/communicator.h"
#include "lockstep/mpi_communicator.h"

namespace lockstep {
namespace {

const std::vector<int64_t> kSizes = {0, 1, 17, (3 << 20) + 5};  // empty, one, odd, several MiB
const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kDouble, at::kBFloat16};

class CollectivesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MpiOptions options;
    options.chunk_bytes = 256 << 10;  // several chunks for the large sizes
    comm_ = MakeMpiCommunicator(options);
    rank_ = comm_->rank();
    size_ = comm_->world_size();
    ASSERT_GE(size_, 2) << "run under mpirun with at least 2 ranks";
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
  comm_->Barrier();
}

// Several communicators live side by side in one process (no singletons).
TEST_F(CollectivesTest, IndependentCommunicators) {
  std::unique_ptr<Communicator> other = MakeMpiCommunicator();
  at::Tensor a = at::full({5}, 1.0);
  at::Tensor b = at::full({5}, 2.0);
  auto wa = comm_->AllReduceAsync(a, ReduceOp::kSum, {});
  auto wb = other->AllReduceAsync(b, ReduceOp::kSum, {});
  wb->Wait();
  wa->Wait();
  EXPECT_TRUE(a.eq(size_).all().item<bool>());
  EXPECT_TRUE(b.eq(2 * size_).all().item<bool>());
}

}  // namespace
}  // namespace lockstep
