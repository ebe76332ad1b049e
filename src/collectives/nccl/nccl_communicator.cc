#include "lockstep/nccl_communicator.h"

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

// Every CUDA and NCCL return code passes here: the call, where, and the library's
// own message.
#define LOCKSTEP_CUDA_CHECK(call)                                                                   \
  do {                                                                                              \
    const cudaError_t lockstep_cuda_rc = (call);                                                    \
    if (lockstep_cuda_rc != cudaSuccess) {                                                          \
      throw ::lockstep::CollectiveError(absl::StrCat("CUDA call ", #call, " failed at ", __FILE__, ":", \
                                                     __LINE__, ": ", cudaGetErrorString(lockstep_cuda_rc))); \
    }                                                                                               \
  } while (false)

#define LOCKSTEP_NCCL_CHECK(call)                                                                   \
  do {                                                                                              \
    const ncclResult_t lockstep_nccl_rc = (call);                                                   \
    if (lockstep_nccl_rc != ncclSuccess) {                                                          \
      throw ::lockstep::CollectiveError(absl::StrCat("NCCL call ", #call, " failed at ", __FILE__, ":", \
                                                     __LINE__, ": ", ncclGetErrorString(lockstep_nccl_rc))); \
    }                                                                                               \
  } while (false)

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t NcclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: break;
  }
  throw InvalidArgumentError(std::string("NCCL communicator: unsupported dtype ") + at::toString(type));
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAverage: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, cudaEvent_t done, std::string what, Clock::time_point deadline,
           std::chrono::milliseconds timeout)
      : owner_(owner), done_(done), what_(std::move(what)), deadline_(deadline), timeout_(timeout) {}
  ~NcclWork() override { cudaEventDestroy(done_); }
  void Wait() override;
  bool IsCompleted() override { return cudaEventQuery(done_) != cudaErrorNotReady; }

 private:
  NcclCommunicator* const owner_;  // Not owned; outlives its work.
  const cudaEvent_t done_;
  const std::string what_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclIdExchange& exchange, int device) : device_(device) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count == 0) {
      throw CollectiveError(absl::StrCat("NCCL backend: no CUDA device on rank ", exchange.rank, " (",
                                         rc == cudaSuccess ? "none found" : cudaGetErrorString(rc),
                                         "); use the MPI backend for CPU training"));
    }
    if (device < 0 || device >= count) {
      throw CollectiveError(absl::StrCat("NCCL backend: rank ", exchange.rank, " asks for CUDA device ", device,
                                         " but this host has ", count));
    }
    rank_ = exchange.rank;
    world_size_ = exchange.world_size;
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (rank_ == 0) {
      LOCKSTEP_NCCL_CHECK(ncclGetUniqueId(&id));
      exchange.publish(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    } else {
      const std::string bytes = exchange.fetch();
      if (bytes.size() != sizeof(id)) {
        throw CollectiveError(absl::StrCat("NCCL backend: rank ", rank_, " fetched a unique id of ", bytes.size(),
                                           " bytes; NCCL's has ", sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
    LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    LOCKSTEP_NCCL_CHECK(ncclCommInitRank(&comm_, world_size_, id, rank_));
  }

  // A group that ncclCommSplit made from `parent`.
  NcclCommunicator(int device, ncclComm_t comm) : device_(device), comm_(comm) {
    LOCKSTEP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    LOCKSTEP_NCCL_CHECK(ncclCommCount(comm_, &world_size_));
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
    LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }

  ~NcclCommunicator() override {
    if (comm_ != nullptr) broken_.empty() ? ncclCommDestroy(comm_) : ncclCommAbort(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options) override {
    Check(tensor, "all_reduce");
    return Launch("all_reduce", tensor, options, [&] {
      LOCKSTEP_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                        NcclType(tensor.scalar_type()), NcclOp(op), comm_, stream_));
    });
  }
  std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    CheckSizes(output, input, world_size_, "all_gather");
    Check(output, "all_gather");
    Check(input, "all_gather");
    return Launch("all_gather", input, options, [&] {
      LOCKSTEP_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                                        NcclType(input.scalar_type()), comm_, stream_));
    });
  }
  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp op,
                                           const CollectiveOptions& options) override {
    CheckSizes(input, output, world_size_, "reduce_scatter");
    Check(output, "reduce_scatter");
    Check(input, "reduce_scatter");
    return Launch("reduce_scatter", input, options, [&] {
      LOCKSTEP_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                            NcclType(input.scalar_type()), NcclOp(op), comm_, stream_));
    });
  }
  // Grouped sends and receives, one pair per peer (the bytes as they are).
  std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    CheckAllToAll(output, input, world_size_, "all_to_all");
    Check(output, "all_to_all");
    Check(input, "all_to_all");
    const size_t block = static_cast<size_t>(input.numel() / world_size_) * input.element_size();
    return Launch("all_to_all", input, options, [&] {
      const auto* in = static_cast<const char*>(input.data_ptr());
      auto* out = static_cast<char*>(output.data_ptr());
      LOCKSTEP_NCCL_CHECK(ncclGroupStart());
      for (int peer = 0; peer < world_size_; ++peer) {
        LOCKSTEP_NCCL_CHECK(ncclSend(in + peer * block, block, ncclUint8, peer, comm_, stream_));
        LOCKSTEP_NCCL_CHECK(ncclRecv(out + peer * block, block, ncclUint8, peer, comm_, stream_));
      }
      LOCKSTEP_NCCL_CHECK(ncclGroupEnd());
    });
  }
  std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions& options) override {
    Check(tensor, "broadcast");
    if (root < 0 || root >= world_size_) {
      throw InvalidArgumentError(absl::StrCat("broadcast: root ", root, " outside a world of ", world_size_));
    }
    return Launch("broadcast", tensor, options, [&] {
      LOCKSTEP_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                        NcclType(tensor.scalar_type()), root, comm_, stream_));
    });
  }
  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& options) override {
    if (!barrier_buffer_.defined()) {
      barrier_buffer_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
    }
    return AllReduceAsync(barrier_buffer_, ReduceOp::kSum, options);
  }

  // ncclCommSplit (NCCL 2.18 and later): the new communicator shares this one's
  // bootstrap, so no unique id has to travel. Blocks until every rank of this
  // communicator has called it.
  std::unique_ptr<Communicator> SplitGroup(int color, int key, const std::vector<int>& /*members*/,
                                           const CollectiveOptions& options) override {
    (void)options;
    if (!broken_.empty()) throw CollectiveError("NCCL communicator is broken: " + broken_);
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
    ncclComm_t group = nullptr;
    LOCKSTEP_NCCL_CHECK(ncclCommSplit(comm_, color, key, &group, nullptr));
    return std::make_unique<NcclCommunicator>(device_, group);
  }

  // From any thread: the next poll of a Work (on the thread that waits) breaks the
  // communicator with `reason`.
  void AbortCollectives(const std::string& reason) override {
    absl::MutexLock lock(&abort_mu_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  std::string AbortReason() {
    absl::MutexLock lock(&abort_mu_);
    return abort_reason_;
  }

  // Called by NcclWork when it gives up: NCCL kernels that wait for a dead peer
  // never finish, so the communicator is aborted and marked broken.
  void Break(const std::string& reason) {
    if (broken_.empty()) broken_ = reason;
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }
  // An asynchronous NCCL error (a peer's connection failed), or none.
  std::string AsyncError() {
    if (comm_ == nullptr) return broken_;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess || async != ncclSuccess) {
      return absl::StrCat("asynchronous NCCL error: ", ncclGetErrorString(async));
    }
    return "";
  }

 private:
  void Check(const at::Tensor& tensor, const char* call) const {
    CheckCollectiveTensor(tensor, call);
    if (!tensor.is_cuda() || tensor.get_device() != device_) {
      throw InvalidArgumentError(absl::StrCat(call, ": the NCCL communicator takes tensors on cuda:", device_,
                                              ", got ", tensor.device().str()));
    }
    NcclType(tensor.scalar_type());
    if (!broken_.empty()) throw CollectiveError("NCCL communicator is broken: " + broken_);
    if (const std::string aborted = const_cast<NcclCommunicator*>(this)->AbortReason(); !aborted.empty()) {
      throw CollectiveError("NCCL communicator was aborted: " + aborted);
    }
  }

  template <typename Issue>
  std::shared_ptr<Work> Launch(const char* call, const at::Tensor& tensor, const CollectiveOptions& options,
                               Issue issue) {
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t ready = nullptr;
    cudaEvent_t done = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    // After the work already queued on the default stream (which produced `tensor`).
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(ready, nullptr));
    LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    cudaEventDestroy(ready);
    issue();
    LOCKSTEP_CUDA_CHECK(cudaEventRecord(done, stream_));
    return std::make_shared<NcclWork>(
        this, done, absl::StrCat(call, " of ", tensor.numel(), " ", at::toString(tensor.scalar_type()), " elements"),
        Clock::now() + options.timeout, options.timeout);
  }

  const int device_;
  int rank_ = 0;
  int world_size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  at::Tensor barrier_buffer_;
  std::string broken_;
  absl::Mutex abort_mu_;
  std::string abort_reason_ ABSL_GUARDED_BY(abort_mu_);
};

void NcclWork::Wait() {
  while (true) {
    const cudaError_t state = cudaEventQuery(done_);
    if (state == cudaSuccess) return;
    if (state != cudaErrorNotReady) {
      throw CollectiveError(absl::StrCat(what_, " failed: ", cudaGetErrorString(state)));
    }
    if (const std::string aborted = owner_->AbortReason(); !aborted.empty()) {
      owner_->Break(aborted);
      throw CollectiveError(absl::StrCat(what_, " aborted: ", aborted));
    }
    const std::string async = owner_->AsyncError();
    if (!async.empty()) {
      owner_->Break(async);
      throw CollectiveError(absl::StrCat(what_, " failed: ", async));
    }
    if (Clock::now() > deadline_) {
      const std::string reason = absl::StrCat(what_, " did not complete within ", timeout_.count(),
                                              " ms: a peer rank is dead, stuck, or called a different collective");
      owner_->Break(reason);
      throw CollectiveTimeoutError(reason);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

std::unique_ptr<Communicator> MakeNcclCommunicator(const NcclIdExchange& exchange, int device) {
  return std::make_unique<NcclCommunicator>(exchange, device);
}

bool HaveNccl() { return true; }

}  // namespace lockstep
