#include "lockstep/mpi_communicator.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <random>
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

// The thread level MPI gave (once initialised).
std::atomic<int> mpi_thread_level{-1};

void InitializeMpi(bool thread_multiple) {
  static std::once_flag once;
  std::call_once(once, [thread_multiple] {
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
      LOCKSTEP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, thread_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED,
                                         &provided));
      std::atexit(FinalizeMpiAtExit);
    } else {
      LOCKSTEP_MPI_CHECK(MPI_Query_thread(&provided));
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      throw CollectiveError("MPI provides thread level " + std::to_string(provided) +
                            ", the MPI communicator needs MPI_THREAD_SERIALIZED");
    }
    mpi_thread_level = provided;
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
    completed_at_ = std::chrono::steady_clock::now();
  }
  std::optional<std::chrono::steady_clock::time_point> completed_at() override {
    absl::MutexLock lock(&mu_);
    return completed_at_;
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
  std::optional<std::chrono::steady_clock::time_point> completed_at_ ABSL_GUARDED_BY(mu_);
};

// A buffer from AllocateCollectiveBuffer in POSIX shared memory: every rank's
// buffer of the same allocation, as mapped into this process.
struct SharedSegment {
  size_t bytes = 0;
  std::vector<void*> maps;  // rank -> this process's mapping of that rank's buffer
  SharedSegment() = default;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  ~SharedSegment() { Unmap(); }
  void Unmap() {
    for (void* p : maps) {
      if (p != nullptr) munmap(p, bytes);
    }
    maps.clear();
  }
};

// The live shared buffers by this rank's base address. Shared with the tensors'
// deleters, which may run after the communicator is gone.
struct SharedRegistry {
  absl::Mutex mu;
  std::map<const void*, std::shared_ptr<SharedSegment>> segments ABSL_GUARDED_BY(mu);
};

// The dtypes that shared buffers hold (those ReduceSliceInPlace is built for).
bool SharedDtype(at::ScalarType type) { return type == at::kFloat || type == at::kDouble; }

// Sum (or mean) over ranks of elements [lo, hi) of every rank's buffer, written
// back to every rank's buffer. Ranks are added in rank order, so every element's
// result is the same on every rank and from run to run. A 2048-element block of
// the sum stays in L1: memory sees each rank's slice read once and written once.
template <typename T>
void ReduceSliceInPlace(const std::vector<void*>& maps, int64_t lo, int64_t hi, bool average) {
  constexpr int64_t kBlock = 2048;
  T acc[kBlock];
  const int world = static_cast<int>(maps.size());
  for (int64_t start = lo; start < hi; start += kBlock) {
    const int64_t len = std::min(kBlock, hi - start);
    const T* first = static_cast<const T*>(maps[0]) + start;
    std::copy(first, first + len, acc);
    for (int r = 1; r < world; ++r) {
      const T* __restrict src = static_cast<const T*>(maps[r]) + start;
      for (int64_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    if (average) {
      for (int64_t i = 0; i < len; ++i) acc[i] /= static_cast<T>(world);
    }
    for (int r = 0; r < world; ++r) std::copy(acc, acc + len, static_cast<T*>(maps[r]) + start);
  }
}

// The sum (or mean) over ranks of elements [lo, hi) of every rank's buffer,
// written to `out` (hi - lo elements), in rank order as ReduceSliceInPlace.
template <typename T>
void ReduceSliceInto(const std::vector<void*>& maps, int64_t lo, int64_t hi, bool average, T* __restrict out) {
  const int world = static_cast<int>(maps.size());
  const T* first = static_cast<const T*>(maps[0]) + lo;
  std::copy(first, first + (hi - lo), out);
  for (int r = 1; r < world; ++r) {
    const T* __restrict src = static_cast<const T*>(maps[r]) + lo;
    for (int64_t i = 0; i < hi - lo; ++i) out[i] += src[i];
  }
  if (average) {
    for (int64_t i = 0; i < hi - lo; ++i) out[i] /= static_cast<T>(world);
  }
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(const MpiOptions& options) : options_(options) {
    if (options_.chunk_bytes == 0 || options_.chunks_in_flight < 1) {
      throw InvalidArgumentError("MPI communicator: chunk_bytes and chunks_in_flight must be positive");
    }
    InitializeMpi(options_.thread_multiple);
    LOCKSTEP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    Start();
  }

  // A group that SplitGroup made: takes `comm`.
  MpiCommunicator(const MpiOptions& options, MPI_Comm comm) : options_(options), comm_(comm) { Start(); }

  void Start() {
    LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm_, &world_size_));
    if (options_.shared_memory_buffers && world_size_ > 1) {
      // Shared buffers only when every rank is on this host.
      MPI_Comm node = MPI_COMM_NULL;
      LOCKSTEP_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
      int node_size = 0;
      LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &node_size));
      LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
      // Rank 0's random number names this communicator's segments.
      uint64_t id = std::random_device{}();
      id = (id << 32) ^ std::random_device{}();
      LOCKSTEP_MPI_CHECK(MPI_Bcast(&id, 1, MPI_UINT64_T, 0, comm_));
      shared_prefix_ = absl::StrCat("/lockstep-", absl::Hex(id, absl::kZeroPad16));
      shared_ok_ = node_size == world_size_;
    }
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
    if (op != ReduceOp::kMax) {
      if (std::shared_ptr<SharedSegment> segment = FindSegment(tensor)) {
        return Enqueue(Describe("all_reduce", tensor), options,
                       [this, tensor, op, segment](Clock::time_point deadline) {
                         SharedAllReduce(*segment, tensor, op == ReduceOp::kAverage, deadline);
                       });
      }
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
    if (input.scalar_type() == output.scalar_type()) {
      if (std::shared_ptr<SharedSegment> segment = FindSegment(output)) {
        // Every rank's output is mapped here: this rank writes its input into each.
        return Enqueue(Describe("all_gather", input), options,
                       [this, output, input, segment](Clock::time_point deadline) {
                         const size_t bytes = input.numel() * input.element_size();
                         const at::Tensor in = input.contiguous();
                         BarrierNow(deadline);  // every rank is done with its output's old contents
                         for (void* map : segment->maps) {
                           char* slot = static_cast<char*>(map) + rank_ * bytes;
                           if (slot != in.data_ptr()) std::memcpy(slot, in.data_ptr(), bytes);  // else in place
                         }
                         std::atomic_thread_fence(std::memory_order_seq_cst);
                         BarrierNow(deadline);
                       });
      }
    }
    CheckedCount(input.numel(), "all_gather");
    if (UsesStaging(input, output)) {
      return Enqueue(Describe("all_gather", input), options, [this, output, input](Clock::time_point deadline) {
        if (!StagingAllGather(output, input, deadline)) MpiAllGather(output, input, deadline);
      });
    }
    return Enqueue(Describe("all_gather", input), options, [this, output, input](Clock::time_point deadline) {
      MpiAllGather(output, input, deadline);
    });
  }

  // Worker thread.
  void MpiAllGather(const at::Tensor& output, const at::Tensor& input, Clock::time_point deadline) {
    const MPI_Datatype type = MpiType(input.scalar_type());
    const int count = static_cast<int>(input.numel());
    const bool in_place =
        input.data_ptr() == static_cast<char*>(output.data_ptr()) + rank_ * count * input.element_size();
    const size_t element_size = input.element_size();
    if (static_cast<size_t>(count) * element_size <= options_.chunk_bytes) {
      MPI_Request request;
      LOCKSTEP_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data_ptr(), count, type, output.data_ptr(),
                                        count, type, comm_, &request));
      Drive(&request, 1, deadline);
      return;
    }
    // Large: in chunks, several in flight, as all-reduces go (Open MPI moves one
    // large message between hosts at about half the link's rate; chunks fill it).
    // Chunk [offset, offset + k) of every rank lands at rank r's place in the
    // output, r x count + offset: a block of k elements whose extent is count.
    auto* in = static_cast<const char*>(input.data_ptr());
    auto* out = static_cast<char*>(output.data_ptr());
    Pipelined(count, element_size, deadline, [&](size_t byte_offset, int k, MPI_Request* request) {
      MPI_Datatype block = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL;
      LOCKSTEP_MPI_CHECK(MPI_Type_contiguous(k, type, &block));
      LOCKSTEP_MPI_CHECK(MPI_Type_create_resized(block, 0, static_cast<MPI_Aint>(count) * element_size, &strided));
      LOCKSTEP_MPI_CHECK(MPI_Type_commit(&strided));
      LOCKSTEP_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : in + byte_offset, k, type, out + byte_offset, 1,
                                        strided, comm_, request));
      // Freed now, released by MPI once the collective is done with it.
      LOCKSTEP_MPI_CHECK(MPI_Type_free(&strided));
      LOCKSTEP_MPI_CHECK(MPI_Type_free(&block));
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
    if (op != ReduceOp::kMax && output.scalar_type() == input.scalar_type() && output.is_contiguous()) {
      if (std::shared_ptr<SharedSegment> segment = FindSegment(input)) {
        // Every rank's input is mapped here: this rank sums its slice of them.
        return Enqueue(Describe("reduce_scatter", input), options,
                       [this, output, input, op, segment](Clock::time_point deadline) {
                         BarrierNow(deadline);  // every rank's input is complete
                         std::atomic_thread_fence(std::memory_order_seq_cst);
                         const int64_t n = output.numel();
                         const bool average = op == ReduceOp::kAverage;
                         if (input.scalar_type() == at::kFloat) {
                           ReduceSliceInto<float>(segment->maps, rank_ * n, (rank_ + 1) * n, average,
                                                  output.data_ptr<float>());
                         } else {
                           ReduceSliceInto<double>(segment->maps, rank_ * n, (rank_ + 1) * n, average,
                                                   output.data_ptr<double>());
                         }
                         BarrierNow(deadline);  // no rank changes its input while another reads it
                       });
      }
    }
    const MPI_Datatype type = MpiType(input.scalar_type());
    const int count = CheckedCount(output.numel(), "reduce_scatter");
    const bool staged = op != ReduceOp::kMax && output.is_contiguous() && UsesStaging(input, output);
    return Enqueue(Describe("reduce_scatter", input), options,
                   [this, output, input, op, type, count, staged](Clock::time_point deadline) {
                     if (staged && StagingReduceScatter(output, input, op == ReduceOp::kAverage, deadline)) return;
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

  std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    CheckAllToAll(output, input, world_size_, "all_to_all");
    CheckCpu(output, "all_to_all");
    CheckCpu(input, "all_to_all");
    const size_t block = static_cast<size_t>(input.numel() / world_size_) * input.element_size();
    CheckedCount(static_cast<int64_t>(block), "all_to_all");
    return Enqueue(Describe("all_to_all", input), options, [this, output, input, block](Clock::time_point deadline) {
      if (block == 0) return;
      auto* in = static_cast<const char*>(input.data_ptr());
      auto* out = static_cast<char*>(output.data_ptr());
      if (block <= options_.chunk_bytes) {
        MPI_Request request;
        LOCKSTEP_MPI_CHECK(MPI_Ialltoall(in, static_cast<int>(block), MPI_BYTE, out, static_cast<int>(block), MPI_BYTE,
                                         comm_, &request));
        Drive(&request, 1, deadline);
        return;
      }
      // Large: in chunks, several in flight, as all-gathers go. Chunk [offset,
      // offset + k) of every block: k bytes whose extent is the block.
      Pipelined(block, 1, deadline, [&](size_t offset, int k, MPI_Request* request) {
        MPI_Datatype bytes = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL;
        LOCKSTEP_MPI_CHECK(MPI_Type_contiguous(k, MPI_BYTE, &bytes));
        LOCKSTEP_MPI_CHECK(MPI_Type_create_resized(bytes, 0, static_cast<MPI_Aint>(block), &strided));
        LOCKSTEP_MPI_CHECK(MPI_Type_commit(&strided));
        LOCKSTEP_MPI_CHECK(MPI_Ialltoall(in + offset, 1, strided, out + offset, 1, strided, comm_, request));
        LOCKSTEP_MPI_CHECK(MPI_Type_free(&strided));
        LOCKSTEP_MPI_CHECK(MPI_Type_free(&bytes));
      });
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
    return Enqueue("barrier", options, [this](Clock::time_point deadline) { BarrierNow(deadline); });
  }

  at::Tensor AllocateCollectiveBuffer(int64_t numel, const at::TensorOptions& options,
                                      const CollectiveOptions& collective) override {
    const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
    if (!shared_ok_ || numel <= 0 || !options.device().is_cpu() || !SharedDtype(dtype)) {
      return at::empty({numel}, options);
    }
    auto segment = std::make_shared<SharedSegment>();
    segment->bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    const uint64_t id = next_segment_id_++;
    Enqueue(absl::StrCat("shared buffer of ", segment->bytes, " bytes"), collective,
            [this, segment, id](Clock::time_point deadline) { MapSharedSegment(*segment, id, deadline); })
        ->Wait();
    if (segment->maps.empty()) return at::empty({numel}, options);  // on every rank alike
    void* base = segment->maps[rank_];
    {
      absl::MutexLock lock(&registry_->mu);
      registry_->segments[base] = segment;
    }
    return at::from_blob(
        base, {numel},
        [registry = registry_, base](void*) {
          absl::MutexLock lock(&registry->mu);
          registry->segments.erase(base);  // unmapped once no all-reduce holds it either
        },
        options);
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
      std::exception_ptr failure;
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
          failure = std::make_exception_ptr(CollectiveError("MPI communicator is broken: " + broken_reason_));
        }
      }
      try {
        if (!failure) task.run(task.work->deadline());
      } catch (const CollectiveTimeoutError&) {
        const std::string message = MpiWork::TimeoutMessage(task.work->what(), task.work->timeout());
        Break(message);
        failure = std::make_exception_ptr(CollectiveTimeoutError(message));
      } catch (const std::exception& e) {
        const std::string message = task.work->what() + " failed: " + e.what();
        Break(message);
        failure = std::make_exception_ptr(CollectiveError(message));
      }
      // On every path (done, failed, or never run on a broken communicator) the
      // call's tensors are let go before the caller hears it is done: once Wait
      // returns, the caller's references are the only ones (this thread frees
      // nothing the caller may still be reading, and memory comes back when the
      // caller drops it, not when this thread gets round to it).
      task.run = nullptr;
      task.work->Finish(failure);
    }
  }

  std::unique_ptr<Communicator> SplitGroup(int color, int key, const std::vector<int>& /*members*/,
                                           const CollectiveOptions& options) override {
    if (mpi_thread_level.load() < MPI_THREAD_MULTIPLE) {
      throw InvalidArgumentError(absl::StrCat(
          "split: rank ", rank_, " would run communicators of ", world_size_, " and fewer ranks side by side, which "
          "needs MPI initialised with MPI_THREAD_MULTIPLE (MpiOptions::thread_multiple); MPI gave level ",
          mpi_thread_level.load()));
    }
    MPI_Comm group = MPI_COMM_NULL;
    // On the worker, behind this communicator's earlier collectives. The barrier
    // first, with the deadline: MPI_Comm_split itself blocks without one.
    Enqueue(absl::StrCat("split (color ", color, ")"), options, [this, &group, color, key](Clock::time_point deadline) {
      BarrierNow(deadline);
      LOCKSTEP_MPI_CHECK(MPI_Comm_split(comm_, color, key, &group));
    })->Wait();
    return std::make_unique<MpiCommunicator>(options_, group);
  }

  void AbortCollectives(const std::string& reason) override {
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

  // The segment of a whole buffer from AllocateCollectiveBuffer, if `tensor` is one.
  std::shared_ptr<SharedSegment> FindSegment(const at::Tensor& tensor) {
    if (!shared_ok_ || !tensor.is_contiguous() || !tensor.device().is_cpu() || !SharedDtype(tensor.scalar_type())) {
      return nullptr;
    }
    absl::MutexLock lock(&registry_->mu);
    auto it = registry_->segments.find(tensor.data_ptr());
    if (it == registry_->segments.end() || it->second->bytes != static_cast<size_t>(tensor.numel()) * tensor.element_size()) {
      return nullptr;
    }
    return it->second;
  }

  std::string SegmentName(uint64_t id, int rank) const { return absl::StrCat(shared_prefix_, "-", id, "-", rank); }

  // Whether `ok` holds on every rank (a collective).
  bool OnEveryRank(bool ok, Clock::time_point deadline) {
    int value = ok ? 1 : 0;
    MPI_Request request;
    LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_MIN, comm_, &request));
    Drive(&request, 1, deadline);
    return value == 1;
  }

  void BarrierNow(Clock::time_point deadline) {
    MPI_Request request;
    LOCKSTEP_MPI_CHECK(MPI_Ibarrier(comm_, &request));
    Drive(&request, 1, deadline);
  }

  // On the worker, every rank: creates this rank's segment (tmpfs pages reserved
  // up front, so that running out of /dev/shm is an error here and not a SIGBUS
  // later), maps every rank's, and removes the names once all are mapped. Leaves
  // `segment.maps` empty on every rank when any rank could not.
  void MapSharedSegment(SharedSegment& segment, uint64_t id, Clock::time_point deadline) {
    segment.maps.assign(world_size_, nullptr);
    const std::string own = SegmentName(id, rank_);
    std::string problem;
    const int fd = shm_open(own.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    struct Unlink {
      const std::string& name;
      bool armed;
      ~Unlink() {
        if (armed) shm_unlink(name.c_str());
      }
    } unlink_own{own, fd >= 0};
    if (fd < 0) {
      problem = absl::StrCat("shm_open ", own, ": ", std::strerror(errno));
    } else {
      const int rc = posix_fallocate(fd, 0, static_cast<off_t>(segment.bytes));
      void* p = rc == 0 ? mmap(nullptr, segment.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
      if (rc != 0) {
        problem = absl::StrCat("reserving ", segment.bytes, " bytes of shared memory: ", std::strerror(rc));
      } else if (p == MAP_FAILED) {
        problem = absl::StrCat("mmap: ", std::strerror(errno));
      } else {
        segment.maps[rank_] = p;
      }
      close(fd);
    }
    bool ok = OnEveryRank(problem.empty(), deadline);
    for (int r = 0; ok && r < world_size_; ++r) {
      if (r == rank_) continue;
      const int peer = shm_open(SegmentName(id, r).c_str(), O_RDWR, 0);
      // A peer that asked for another size broke the SPMD rule; mapping past the
      // end of its segment would fault on first touch.
      struct stat info {};
      const bool same_size = peer >= 0 && fstat(peer, &info) == 0 && static_cast<size_t>(info.st_size) == segment.bytes;
      void* p = same_size ? mmap(nullptr, segment.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, peer, 0) : MAP_FAILED;
      const int error = errno;
      if (peer >= 0) close(peer);
      if (p == MAP_FAILED) {
        problem = peer >= 0 && !same_size
                      ? absl::StrCat("rank ", r, " asked for a buffer of another size (", info.st_size, " bytes, not ",
                                     segment.bytes, ")")
                      : absl::StrCat("mapping rank ", r, "'s shared memory: ", std::strerror(error));
        break;
      }
      segment.maps[r] = p;
    }
    if (ok) ok = OnEveryRank(problem.empty(), deadline);  // also: every rank has mapped every segment
    if (!ok) {
      segment.Unmap();
      if (!problem.empty() && !warned_shared_) {
        warned_shared_ = true;
        std::fprintf(stderr,
                     "lockstep: rank %d: a collective buffer of %zu bytes is not in shared memory (%s); its "
                     "all-reduces go through MPI (said once per communicator)\n",
                     rank_, segment.bytes, problem.c_str());
      }
    }
  }

  // All-reduce of a whole shared buffer in place: once every rank's buffer is
  // final (a barrier), rank r reduces slice r of all of them and writes the result
  // into all of them; a second barrier ends it. No copies through MPI.
  void SharedAllReduce(const SharedSegment& segment, const at::Tensor& tensor, bool average, Clock::time_point deadline) {
    BarrierNow(deadline);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const int64_t n = tensor.numel();
    const int64_t lo = n * rank_ / world_size_;
    const int64_t hi = n * (rank_ + 1) / world_size_;
    if (tensor.scalar_type() == at::kFloat) {
      ReduceSliceInPlace<float>(segment.maps, lo, hi, average);
    } else {
      ReduceSliceInPlace<double>(segment.maps, lo, hi, average);
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    BarrierNow(deadline);
  }

  // Collectives between plain tensors on one host go through a staging buffer in
  // shared memory (each rank's input copied in, the results read from every
  // rank's): one memory copy more than a shared collective buffer, far less than
  // MPI's shared-memory transport for large messages. The staging buffer grows to
  // the largest such collective (a sharded unit) and stays.
  bool UsesStaging(const at::Tensor& input, const at::Tensor& output) const {
    return shared_ok_ && input.scalar_type() == output.scalar_type() && SharedDtype(input.scalar_type()) &&
           input.device().is_cpu() && output.device().is_cpu() && output.is_contiguous() && input.numel() > 0;
  }

  // Worker thread. Every rank calls it for the same collective with the same
  // size, so every rank grows the staging buffer at the same point. False (on
  // every rank alike) when shared memory could not be mapped.
  bool EnsureStaging(size_t bytes, Clock::time_point deadline) {
    if (staging_ != nullptr && staging_->bytes >= bytes) return true;
    if (staging_failed_) return false;
    auto segment = std::make_shared<SharedSegment>();
    segment->bytes = bytes;
    MapSharedSegment(*segment, next_segment_id_++, deadline);
    if (segment->maps.empty()) {
      staging_failed_ = true;
      return false;
    }
    staging_ = std::move(segment);
    return true;
  }

  // Worker thread. The opening both staged collectives share: this rank's input
  // copied into its staging segment, then a barrier, after which every rank's
  // input is readable in staging_->maps. Returns the contiguous input (whose
  // storage an in-place all-gather compares with the output), or an undefined
  // tensor when shared memory is unavailable (the caller takes the MPI path; the
  // same on every rank).
  at::Tensor StageInput(const at::Tensor& input, Clock::time_point deadline) {
    const size_t bytes = input.numel() * input.element_size();
    if (!EnsureStaging(bytes, deadline)) return {};
    at::Tensor in = input.contiguous();
    // The previous collective ended with a barrier: no rank still reads this one's staging.
    std::memcpy(staging_->maps[rank_], in.data_ptr(), bytes);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    BarrierNow(deadline);
    return in;
  }

  // Worker thread. The closing: every rank has read what it needs before any rank
  // writes its staging again.
  void EndStaged(Clock::time_point deadline) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    BarrierNow(deadline);
  }

  // Worker thread.
  bool StagingAllGather(const at::Tensor& output, const at::Tensor& input, Clock::time_point deadline) {
    const at::Tensor in = StageInput(input, deadline);
    if (!in.defined()) return false;
    const size_t bytes = input.numel() * input.element_size();
    char* out = static_cast<char*>(output.data_ptr());
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_ || out + r * bytes != in.data_ptr()) std::memcpy(out + r * bytes, staging_->maps[r], bytes);
    }
    EndStaged(deadline);
    return true;
  }

  // Worker thread.
  bool StagingReduceScatter(const at::Tensor& output, const at::Tensor& input, bool average,
                            Clock::time_point deadline) {
    if (!StageInput(input, deadline).defined()) return false;
    const int64_t n = output.numel();
    if (input.scalar_type() == at::kFloat) {
      ReduceSliceInto<float>(staging_->maps, rank_ * n, (rank_ + 1) * n, average, output.data_ptr<float>());
    } else {
      ReduceSliceInto<double>(staging_->maps, rank_ * n, (rank_ + 1) * n, average, output.data_ptr<double>());
    }
    EndStaged(deadline);
    return true;
  }

  // Fixed after construction.
  const MpiOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;  // used by the worker thread only, after construction
  int rank_ = 0;
  int world_size_ = 1;
  bool shared_ok_ = false;  // AllocateCollectiveBuffer may share memory
  std::string shared_prefix_;
  const std::shared_ptr<SharedRegistry> registry_ = std::make_shared<SharedRegistry>();
  std::atomic<uint64_t> next_segment_id_{0};
  bool warned_shared_ = false;  // worker only
  std::shared_ptr<SharedSegment> staging_;  // worker only
  bool staging_failed_ = false;             // worker only

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
