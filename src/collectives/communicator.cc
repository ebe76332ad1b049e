#include "lockstep/communicator.h"

#include <ATen/ATen.h>

#include <string>

#include "absl/synchronization/mutex.h"

namespace lockstep {
namespace {

class CompletedWork final : public Work {
 public:
  void Wait() override {}
  bool IsCompleted() override { return true; }
};

class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "single_process"; }

  std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions&) override {
    CheckNotAborted();
    CheckCollectiveTensor(tensor, "all_reduce");
    if (op == ReduceOp::kAverage && !at::isFloatingType(tensor.scalar_type())) {
      throw InvalidArgumentError("all_reduce: average needs a floating-point tensor");
    }
    return Done();
  }
  std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input, const CollectiveOptions&) override {
    CheckNotAborted();
    CheckSizes(output, input, 1, "all_gather");
    output.view(-1).copy_(input.view(-1));
    return Done();
  }
  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp,
                                           const CollectiveOptions&) override {
    CheckNotAborted();
    CheckSizes(input, output, 1, "reduce_scatter");
    output.view(-1).copy_(input.view(-1));
    return Done();
  }
  std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions&) override {
    CheckNotAborted();
    CheckCollectiveTensor(tensor, "broadcast");
    if (root != 0) throw InvalidArgumentError("broadcast: root " + std::to_string(root) + " outside a world of 1");
    return Done();
  }
  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions&) override {
    CheckNotAborted();
    return Done();
  }
  void Abort(const std::string& reason) override {
    absl::MutexLock lock(&mu_);
    if (aborted_.empty()) aborted_ = reason;
  }

 private:
  void CheckNotAborted() {
    absl::MutexLock lock(&mu_);
    if (!aborted_.empty()) throw CollectiveError("communicator was aborted: " + aborted_);
  }
  absl::Mutex mu_;
  std::string aborted_ ABSL_GUARDED_BY(mu_);

  static std::shared_ptr<Work> Done() { return std::make_shared<CompletedWork>(); }
};

}  // namespace

at::Tensor Communicator::AllocateCollectiveBuffer(int64_t numel, const at::TensorOptions& options,
                                                  const CollectiveOptions&) {
  return at::empty({numel}, options);
}

void CheckCollectiveTensor(const at::Tensor& tensor, const char* call) {
  if (!tensor.defined()) throw InvalidArgumentError(std::string(call) + ": undefined tensor");
  if (!tensor.is_contiguous()) throw InvalidArgumentError(std::string(call) + ": tensor must be contiguous");
}

void CheckSizes(const at::Tensor& big, const at::Tensor& small, int world_size, const char* call) {
  CheckCollectiveTensor(big, call);
  CheckCollectiveTensor(small, call);
  if (big.scalar_type() != small.scalar_type()) {
    throw InvalidArgumentError(std::string(call) + ": input and output dtypes differ");
  }
  if (big.numel() != small.numel() * world_size) {
    throw InvalidArgumentError(std::string(call) + ": expected " + std::to_string(small.numel() * world_size) +
                               " elements (world_size x " + std::to_string(small.numel()) + "), got " +
                               std::to_string(big.numel()));
  }
}

std::unique_ptr<Communicator> MakeSingleProcessCommunicator() {
  return std::make_unique<SingleProcessCommunicator>();
}

}  // namespace lockstep
