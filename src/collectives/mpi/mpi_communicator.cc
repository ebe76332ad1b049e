#include "lockstep/mpi_communicator.h"

#include <ATen/ATen.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

// Every MPI return code passes here: the call, where, and MPI's own message.
#define LOCKSTEP_MPI_CHECK(call)                                                                  \
  do {                                                                                            \
    const int lockstep_mpi_rc = (call);                                                           \
    if (lockstep_mpi_rc != MPI_SUCCESS) ::lockstep::ThrowMpiError(#call, __FILE__, __LINE__, lockstep_mpi_rc); \
  } while (false)

namespace lockstep {

[[noreturn]] void ThrowMpiError(const char* call, const char* file, int line, int code) {
  char message[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, message, &length);
  throw CollectiveError(absl::StrCat("MPI call ", call, " failed at ", file, ":", line, ": ", message));
}

namespace {

using Clock = std::chrono::steady_clock;

// A collective failed somewhere in this process: MPI_Finalize at exit would wait
// for peers that may be gone, so it is skipped.
std::atomic<bool> mpi_failed{false};

void FinalizeMpiAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && !mpi_failed.load()) MPI_Finalize();
}

void InitializeMpi() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    LOCKSTEP_MPI_CHECK(MPI_Initialized(&initialized));
    int provided = 0;
    if (!initialized) {
      // Open MPI's non-blocking all-reduce (libnbc) picks a binomial tree for any
      // in-place call on fewer than 4 ranks: every byte goes to rank 0 and back,
      // and rank 0 does all the reducing. Reduce-scatter + all-gather
      // (Rabenseifner's; ring where the count is below the power of two) moves
      // half as much per rank: 1 MiB on 2 ranks 0.47 -> 0.38 ms, 64 MiB 60 -> 38 ms
      // here. Shared-memory messages in 128 KiB fragments rather than 32 KiB: a
      // quarter of the per-fragment work, 64 MiB 30 -> 24 ms. Both are read at
      // MPI_Init; a value the user set wins; other MPIs ignore them.
      setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
      setenv("OMPI_MCA_btl_vader_max_send_size", "131072", /*overwrite=*/0);
      LOCKSTEP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
      std::atexit(FinalizeMpiAtExit);
    } else {
      LOCKSTEP_MPI_CHECK(MPI_Query_thread(&provided));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      throw CollectiveError("MPI provides thread level " + std::to_string(provided) +
                            ", the MPI communicator needs MPI_THREAD_SERIALIZED");
    }
  });
}

MPI_Datatype MpiType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kShort: return MPI_INT16_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;  // moved as bits; reduced in float32
    default: break;
  }
  throw InvalidArgumentError(std::string("MPI communicator: unsupported dtype ") + at::toString(type));
}

bool ReducedInFloat(at::ScalarType type) { return type == at::kBFloat16 || type == at::kHalf; }

MPI_Op MpiOp(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

std::string Describe(const char* call, const at::Tensor& t) {
  return absl::StrCat(call, " of ", t.numel(), " ", at::toString(t.scalar_type()), " elements");
}

class MpiWork final : public Work {
 public:
  MpiWork(std::string what, Clock::time_point deadline, std::chrono::milliseconds timeout)
      : what_(std::move(what)), deadline_(deadline), timeout_(timeout) {}

  void Wait() override {
    absl::MutexLock lock(&mu_);
    // The worker enforces the deadline while it drives the call; this bound also
    // covers a worker still busy with an earlier call.
    const absl::Time give_up = absl::Now() + absl::FromChrono(deadline_ - Clock::now()) + absl::Seconds(1);
    if (!mu_.AwaitWithDeadline(absl::Condition(&done_), give_up)) {
      mpi_failed = true;
      throw CollectiveTimeoutError(TimeoutMessage(what_, timeout_));
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool IsCompleted() override {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  void Finish(std::exception_ptr error) {
    absl::MutexLock lock(&mu_);
    error_ = std::move(error);
    done_ = true;
  }

  static std::string TimeoutMessage(const std::string& what, std::chrono::milliseconds timeout) {
    return absl::StrCat(what, " did not complete within ", timeout.count(),
                        " ms: a peer rank is dead, stuck, or called a different collective");
  }

  const std::string& what() const { return what_; }
  Clock::time_point deadline() const { return deadline_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  // Fixed after construction.
  const std::string what_;
  const Clock::time_point deadline_;
  const std::chrono::milliseconds timeout_;

  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::exception_ptr error_ ABSL_GUARDED_BY(mu_);
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(const MpiOptions& options) : options_(options) {
    if (options_.chunk_bytes == 0 || options_.chunks_in_flight < 1) {
      throw InvalidArgumentError("MPI communicator: chunk_bytes and chunks_in_flight must be positive");
    }
    InitializeMpi();
    LOCKSTEP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm_, &world_size_));
    worker_ = std::thread([this] { WorkerLoop(); });
  }

  ~MpiCommunicator() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    worker_.join();
    if (broken_reason_.empty()) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "mpi"; }

  std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options) override {
    CheckCpu(tensor, "all_reduce");
    const MPI_Datatype type = MpiType(tensor.scalar_type());
    if (op == ReduceOp::kAverage && !at::isFloatingType(tensor.scalar_type())) {
      throw InvalidArgumentError("all_reduce: average needs a floating-point tensor, got " +
                                 std::string(at::toString(tensor.scalar_type())));
    }
    return Enqueue(Describe("all_reduce", tensor), options, [this, tensor, op, type](Clock::time_point deadline) {
      if (ReducedInFloat(tensor.scalar_type())) {
        at::Tensor wide = tensor.to(at::kFloat);
        AllReduceChunked(wide, MPI_FLOAT, op, deadline);
        tensor.copy_(wide);
      } else {
        AllReduceChunked(tensor, type, op, deadline);
      }
      if (op == ReduceOp::kAverage) tensor.div_(world_size_);
    });
  }

  std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    CheckSizes(output, input, world_size_, "all_gather");
    CheckCpu(output, "all_gather");
    CheckCpu(input, "all_gather");
    const MPI_Datatype type = MpiType(input.scalar_type());
    const int count = CheckedCount(input.numel(), "all_gather");
    return Enqueue(Describe("all_gather", input), options, [this, output, input, type, count](Clock::time_point d) {
      MPI_Request request;
      LOCKSTEP_MPI_CHECK(MPI_Iallgather(input.data_ptr(), count, type, output.data_ptr(), count, type, comm_, &request));
      Drive(&request, 1, d);
    });
  }

  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp op,
                                           const CollectiveOptions& options) override {
    CheckSizes(input, output, world_size_, "reduce_scatter");
    CheckCpu(output, "reduce_scatter");
    CheckCpu(input, "reduce_scatter");
    if (op == ReduceOp::kAverage && !at::isFloatingType(input.scalar_type())) {
      throw InvalidArgumentError("reduce_scatter: average needs a floating-point tensor");
    }
    const MPI_Datatype type = MpiType(input.scalar_type());
    const int count = CheckedCount(output.numel(), "reduce_scatter");
    return Enqueue(Describe("reduce_scatter", input), options,
                   [this, output, input, op, type, count](Clock::time_point deadline) {
                     const bool wide = ReducedInFloat(input.scalar_type());
                     at::Tensor in = wide ? input.to(at::kFloat) : input;
                     at::Tensor out = wide ? at::empty_like(output, at::kFloat) : output;
                     MPI_Request request;
                     if (count > 0) {
                       LOCKSTEP_MPI_CHECK(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count,
                                                                    wide ? MPI_FLOAT : type, MpiOp(op), comm_,
                                                                    &request));
                       Drive(&request, 1, deadline);
                     }
                     if (wide) output.copy_(out);
                     if (op == ReduceOp::kAverage) output.div_(world_size_);
                   });
  }

  std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions& options) override {
    CheckCpu(tensor, "broadcast");
    if (root < 0 || root >= world_size_) {
      throw InvalidArgumentError(absl::StrCat("broadcast: root ", root, " outside a world of ", world_size_));
    }
    return Enqueue(Describe("broadcast", tensor), options, [this, tensor, root](Clock::time_point deadline) {
      auto* bytes = static_cast<char*>(tensor.data_ptr());
      const size_t total = tensor.numel() * tensor.element_size();
      Pipelined(total, 1, deadline, [&](size_t offset, int count, MPI_Request* request) {
        LOCKSTEP_MPI_CHECK(MPI_Ibcast(bytes + offset, count, MPI_BYTE, root, comm_, request));
      });
    });
  }

  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& options) override {
    return Enqueue("barrier", options, [this](Clock::time_point deadline) {
      MPI_Request request;
      LOCKSTEP_MPI_CHECK(MPI_Ibarrier(comm_, &request));
      Drive(&request, 1, deadline);
    });
  }

 private:
  struct Task {
    std::shared_ptr<MpiWork> work;
    std::function<void(Clock::time_point)> run;
  };

  static void CheckCpu(const at::Tensor& tensor, const char* call) {
    CheckCollectiveTensor(tensor, call);
    if (!tensor.device().is_cpu()) {
      throw InvalidArgumentError(std::string(call) + ": the MPI communicator takes CPU tensors; use NCCL for " +
                                 tensor.device().str());
    }
  }

  static int CheckedCount(int64_t count, const char* call) {
    if (count > INT_MAX) throw InvalidArgumentError(std::string(call) + ": more than INT_MAX elements");
    return static_cast<int>(count);
  }

  std::shared_ptr<Work> Enqueue(std::string what, const CollectiveOptions& options,
                                std::function<void(Clock::time_point)> run) {
    auto work = std::make_shared<MpiWork>(std::move(what), Clock::now() + options.timeout, options.timeout);
    absl::MutexLock lock(&mu_);
    if (!broken_reason_.empty()) throw CollectiveError("MPI communicator is broken: " + broken_reason_);
    if (!abort_reason_.empty()) throw CollectiveError("MPI communicator was aborted: " + abort_reason_);
    queue_.push_back(Task{work, std::move(run)});
    return work;
  }

  void WorkerLoop() {
    while (true) {
      Task task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](MpiCommunicator* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
              return self->stopping_ || !self->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping
        task = std::move(queue_.front());
        queue_.pop_front();
        if (!broken_reason_.empty()) {
          task.work->Finish(std::make_exception_ptr(CollectiveError("MPI communicator is broken: " + broken_reason_)));
          continue;
        }
      }
      try {
        task.run(task.work->deadline());
        task.work->Finish(nullptr);
      } catch (const CollectiveTimeoutError&) {
        const std::string message = MpiWork::TimeoutMessage(task.work->what(), task.work->timeout());
        Break(message);
        task.work->Finish(std::make_exception_ptr(CollectiveTimeoutError(message)));
      } catch (const std::exception& e) {
        const std::string message = task.work->what() + " failed: " + e.what();
        Break(message);
        task.work->Finish(std::make_exception_ptr(CollectiveError(message)));
      }
    }
  }

  void Abort(const std::string& reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (abort_reason_.empty()) abort_reason_ = reason;
    }
    aborted_.store(true, std::memory_order_release);
  }

  void Break(const std::string& reason) {
    mpi_failed = true;
    absl::MutexLock lock(&mu_);
    if (broken_reason_.empty()) broken_reason_ = reason;
  }

  [[noreturn]] void ThrowAborted() {
    absl::MutexLock lock(&mu_);
    throw CollectiveError("aborted: " + abort_reason_);
  }

  // Tests the requests until all complete, or throws at the deadline or on Abort.
  // Open MPI progresses non-blocking collectives only inside MPI calls, so the
  // worker polls: for the first millisecond it polls back to back (a peer's
  // message usually arrives within it), yielding the core between polls to a
  // training thread that shares it (one core per rank: the training thread goes on
  // with backward instead of waiting for the spin to end), then it sleeps between
  // polls so the cores stay with compute.
  void Drive(MPI_Request* requests, int count, Clock::time_point deadline) {
    const Clock::time_point spin_until = Clock::now() + std::chrono::milliseconds(1);
    while (true) {
      int flag = 0;
      LOCKSTEP_MPI_CHECK(MPI_Testall(count, requests, &flag, MPI_STATUSES_IGNORE));
      if (flag) return;
      const Clock::time_point now = Clock::now();
      if (now > deadline) throw CollectiveTimeoutError("deadline passed");
      if (aborted_.load(std::memory_order_acquire)) ThrowAborted();
      if (now > spin_until) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        std::this_thread::yield();
      }
    }
  }

  // Issues `start` for consecutive chunks of a `total_elements`-long buffer,
  // keeping at most chunks_in_flight outstanding.
  void Pipelined(size_t total_elements, size_t element_size, Clock::time_point deadline,
                 const std::function<void(size_t offset, int count, MPI_Request*)>& start) {
    const size_t chunk = std::max<size_t>(1, std::min<size_t>(options_.chunk_bytes / element_size, INT_MAX));
    std::deque<MPI_Request> in_flight;
    for (size_t offset = 0; offset < total_elements; offset += chunk) {
      if (static_cast<int>(in_flight.size()) == options_.chunks_in_flight) {
        Drive(&in_flight.front(), 1, deadline);
        in_flight.pop_front();
      }
      in_flight.emplace_back();
      start(offset * element_size, static_cast<int>(std::min(chunk, total_elements - offset)), &in_flight.back());
    }
    while (!in_flight.empty()) {
      Drive(&in_flight.front(), 1, deadline);
      in_flight.pop_front();
    }
  }

  void AllReduceChunked(const at::Tensor& tensor, MPI_Datatype type, ReduceOp op, Clock::time_point deadline) {
    auto* bytes = static_cast<char*>(tensor.data_ptr());
    const size_t element_size = tensor.element_size();
    Pipelined(tensor.numel(), element_size, deadline, [&](size_t byte_offset, int count, MPI_Request* request) {
      LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, bytes + byte_offset, count, type, MpiOp(op), comm_, request));
    });
  }

  // Fixed after construction.
  const MpiOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;  // used by the worker thread only, after construction
  int rank_ = 0;
  int world_size_ = 1;

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string broken_reason_;  // written under mu_; read after join in the destructor
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> aborted_{false};

  std::thread worker_;
};

}  // namespace

std::unique_ptr<Communicator> MakeMpiCommunicator(const MpiOptions& options) {
  return std::make_unique<MpiCommunicator>(options);
}

}  // namespace lockstep
