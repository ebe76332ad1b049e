#include "lockstep/gloo_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

// c10d::Store over GlooStoreFunctions: what Gloo's rendezvous needs (set, get,
// wait, check, delete). The coordination store has no atomic counter, so add()
// and compareSet() refuse, naming themselves; Gloo's rendezvous uses neither.
class FunctionStore final : public c10d::Store {
 public:
  FunctionStore(GlooStoreFunctions functions, std::chrono::milliseconds timeout)
      : c10d::Store(timeout), f_(std::move(functions)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    f_.set(key, std::string(value.begin(), value.end()));
  }
  std::vector<uint8_t> get(const std::string& key) override {
    const std::string value = f_.get(key, timeout_);
    return std::vector<uint8_t>(value.begin(), value.end());
  }
  int64_t add(const std::string& key, int64_t) override {
    TORCH_CHECK(false, "lockstep's coordination store has no atomic add (asked for '", key, "')");
  }
  bool deleteKey(const std::string& key) override { return f_.erase(key); }
  bool check(const std::vector<std::string>& keys) override {
    return std::all_of(keys.begin(), keys.end(), [this](const std::string& k) { return f_.try_get(k).has_value(); });
  }
  int64_t getNumKeys() override { TORCH_CHECK(false, "lockstep's coordination store does not count its keys"); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) f_.get(key, timeout);
  }

 private:
  GlooStoreFunctions f_;
};

// libtorch 1.13's Gloo has no bfloat16: such tensors travel as float32 (exact
// for bfloat16 values) and are rounded back when the collective completes.
bool TravelsAsFloat(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }
at::Tensor Wire(const at::Tensor& t) { return TravelsAsFloat(t) ? t.to(at::kFloat) : t; }

// What a c10::Error says, without libtorch's backtrace.
std::string Describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

c10d::ReduceOp ToGloo(ReduceOp op) {
  return op == ReduceOp::kMax ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

// What the communicators of one process group share with their Work handles.
struct Shared {
  absl::Mutex mu;
  std::string broken ABSL_GUARDED_BY(mu);  // the first failure; empty while healthy

  std::string Broken() {
    absl::MutexLock lock(&mu);
    return broken;
  }
  void Break(const std::string& reason) {
    absl::MutexLock lock(&mu);
    if (broken.empty()) broken = reason;
  }
};

class GlooWork final : public Work {
 public:
  GlooWork(std::shared_ptr<Shared> shared, c10::intrusive_ptr<c10d::Work> work, Clock::time_point deadline,
           std::string what, std::function<void()> finish)
      : shared_(std::move(shared)),
        work_(std::move(work)),
        deadline_(deadline),
        what_(std::move(what)),
        finish_(std::move(finish)) {}

  void Wait() override {
    absl::MutexLock lock(&mu_);  // one waiter runs `finish`; the others then see done_
    if (done_) {
      if (!error_.empty()) throw CollectiveError(error_);
      return;
    }
    // Waits of short slices on the work's condition variable: completion ends a
    // slice at once, and Abort from another thread ends the wait within one.
    constexpr auto kSlice = std::chrono::milliseconds(50);
    while (true) {
      const std::string broken = shared_->Broken();
      if (!broken.empty()) Fail(absl::StrCat("gloo ", what_, ": the communicator is broken: ", broken), false);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
      if (left.count() <= 0) {
        Fail(absl::StrCat("gloo ", what_, ": timed out (a peer is dead, stuck or called another collective)"), true);
      }
      try {
        work_->wait(std::max(std::chrono::milliseconds(1), std::min<std::chrono::milliseconds>(kSlice, left)));
        break;
      } catch (const std::exception&) {
        // c10d's wait throws when the slice ends first. The work may complete
        // right after that: its own outcome then decides.
        if (!work_->isCompleted()) continue;
        try {
          work_->wait();  // completed: returns, or rethrows the work's own error
          break;
        } catch (const std::exception& e) {
          Fail(absl::StrCat("gloo ", what_, ": ", Describe(e)), false);
        }
      }
    }
    if (finish_) finish_();
    done_ = true;
  }

  bool IsCompleted() override {
    if (!shared_->Broken().empty()) return true;
    return work_->isCompleted();
  }

 private:
  [[noreturn]] void Fail(const std::string& message, bool timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    shared_->Break(message);
    done_ = true;
    error_ = message;
    if (timeout) throw CollectiveTimeoutError(message);
    throw CollectiveError(message);
  }

  const std::shared_ptr<Shared> shared_;
  const c10::intrusive_ptr<c10d::Work> work_;
  const Clock::time_point deadline_;
  const std::string what_;
  const std::function<void()> finish_;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::string error_ ABSL_GUARDED_BY(mu_);
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, const GlooOptions& options)
      : store_(std::move(store)), options_(options), rank_(rank), world_size_(world_size) {
    auto pg_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    pg_options->threads = std::max(1, options.threads);
    try {
      pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank, world_size, pg_options);
    } catch (const std::exception& e) {
      throw CollectiveError(absl::StrCat("gloo: rank ", rank, " of ", world_size, " could not join the group on ",
                                         options.hostname, ": ", Describe(e)));
    }
  }

  ~GlooCommunicator() override {
    // Collectives still running hold the group's worker threads; each ends by
    // its own timeout at the latest. Give them 2 s; a group whose workers still
    // wait then (on a dead peer) is left to the process's exit rather than
    // joined here.
    const auto until = Clock::now() + std::chrono::seconds(2);
    bool pending = false;
    for (const c10::intrusive_ptr<c10d::Work>& work : launched_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      try {
        if (!work->isCompleted() && left.count() > 0) work->wait(left);
      } catch (const std::exception&) {
        // its failure was, or would have been, reported by its Wait
      }
      pending = pending || !work->isCompleted();
    }
    if (pending) {
      group_.release();
    } else {
      group_.reset();  // joins its workers before the works go
    }
    launched_.clear();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options) override {
    Check(tensor, "AllReduce");
    if (op == ReduceOp::kAverage && !at::isFloatingType(tensor.scalar_type())) {
      throw InvalidArgumentError("AllReduce: kAverage needs a floating-point tensor, got " +
                                 std::string(at::toString(tensor.scalar_type())));
    }
    at::Tensor wire = Wire(tensor);
    std::function<void()> finish;
    if (op == ReduceOp::kAverage || TravelsAsFloat(tensor)) {
      finish = [tensor, wire, average = op == ReduceOp::kAverage, n = world_size_]() mutable {
        if (average) wire.div_(n);
        if (!wire.is_same(tensor)) tensor.copy_(wire);
      };
    }
    if (tensor.numel() == 0) return Done(std::move(finish));
    c10d::AllreduceOptions opts;
    opts.reduceOp = ToGloo(op);
    opts.timeout = options.timeout;
    std::vector<at::Tensor> tensors = {wire};
    return Launch("all-reduce", options, [&] { return group_->allreduce(tensors, opts); }, std::move(finish));
  }

  std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    Check(output, "AllGather");
    Check(input, "AllGather");
    CheckSizes(output, input, world_size_, "AllGather");
    const int64_t n = input.numel();
    if (n == 0) return Done({});
    // In place (input is this rank's slice of output): Gloo reads the input into
    // its own buffer before it writes the outputs.
    std::vector<at::Tensor> inputs = {Wire(input)};
    at::Tensor wire = TravelsAsFloat(output) ? at::empty(output.sizes(), output.options().dtype(at::kFloat)) : output;
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_size_; ++r) outputs[0].push_back(wire.narrow(0, r * n, n));
    std::function<void()> finish;
    if (!wire.is_same(output)) finish = [output, wire]() mutable { output.copy_(wire); };
    c10d::AllgatherOptions opts;
    opts.timeout = options.timeout;
    return Launch("all-gather", options, [&] { return group_->allgather(outputs, inputs, opts); },
                  std::move(finish));
  }

  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp op,
                                           const CollectiveOptions& options) override {
    Check(output, "ReduceScatter");
    Check(input, "ReduceScatter");
    CheckSizes(input, output, world_size_, "ReduceScatter");
    if (op == ReduceOp::kAverage && !at::isFloatingType(input.scalar_type())) {
      throw InvalidArgumentError("ReduceScatter: kAverage needs a floating-point tensor");
    }
    const int64_t n = output.numel();
    if (n == 0) return Done({});
    // libtorch 1.13's Gloo has no reduce-scatter: all-reduce a copy, keep this rank's slice.
    at::Tensor whole = TravelsAsFloat(input) ? input.to(at::kFloat) : input.clone();
    std::function<void()> finish = [output, whole, n, rank = rank_, world = world_size_, op]() mutable {
      at::Tensor mine = whole.narrow(0, rank * n, n);
      if (op == ReduceOp::kAverage) mine.div_(world);
      output.copy_(mine);
    };
    c10d::AllreduceOptions opts;
    opts.reduceOp = ToGloo(op);
    opts.timeout = options.timeout;
    std::vector<at::Tensor> tensors = {whole};
    return Launch("reduce-scatter", options, [&] { return group_->allreduce(tensors, opts); }, std::move(finish));
  }

  std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    Check(output, "AllToAll");
    Check(input, "AllToAll");
    CheckAllToAll(output, input, world_size_, "AllToAll");
    if (input.numel() == 0) return Done({});
    // Nothing is reduced, so the bytes travel as they are (bfloat16 included),
    // in equal blocks along dimension 0.
    at::Tensor out = output.view(-1).view(at::kByte);
    at::Tensor in = input.view(-1).view(at::kByte);
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions opts;
    opts.timeout = options.timeout;
    return Launch("all-to-all", options, [&] { return group_->alltoall_base(out, in, equal_splits, equal_splits, opts); },
                  {});
  }

  std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions& options) override {
    Check(tensor, "Broadcast");
    if (root < 0 || root >= world_size_) {
      throw InvalidArgumentError("Broadcast: root " + std::to_string(root) + " is not a rank of " +
                                 std::to_string(world_size_));
    }
    if (tensor.numel() == 0) return Done({});
    at::Tensor wire = Wire(tensor);
    std::function<void()> finish;
    if (!wire.is_same(tensor)) finish = [tensor, wire]() mutable { tensor.copy_(wire); };
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = options.timeout;
    std::vector<at::Tensor> tensors = {wire};
    return Launch("broadcast", options, [&] { return group_->broadcast(tensors, opts); }, std::move(finish));
  }

  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& options) override {
    c10d::BarrierOptions opts;
    opts.timeout = options.timeout;
    return Launch("barrier", options, [&] { return group_->barrier(opts); }, {});
  }

  void AbortCollectives(const std::string& reason) override { shared_->Break(reason); }

 protected:
  // A new process group of the members over the store, under a prefix of its own.
  std::unique_ptr<Communicator> SplitGroup(int color, int /*key*/, const std::vector<int>& members,
                                           const CollectiveOptions& /*options*/) override {
    if (members.size() == 1) return MakeSingleProcessCommunicator();  // Gloo needs no part from the others
    const int group_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    const std::string prefix = absl::StrCat("split", splits_++, "/color", color);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
    return std::make_unique<GlooCommunicator>(store, group_rank, static_cast<int>(members.size()), options_);
  }

 private:
  void Check(const at::Tensor& tensor, const char* call) const {
    CheckCollectiveTensor(tensor, call);
    switch (tensor.scalar_type()) {
      case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
      case at::kChar: case at::kByte: case at::kInt: case at::kLong:
        break;
      default:
        throw InvalidArgumentError(std::string(call) + ": the gloo backend does not take " +
                                   at::toString(tensor.scalar_type()) + " tensors");
    }
    if (!tensor.device().is_cpu()) {
      throw InvalidArgumentError(std::string(call) + ": the gloo backend takes CPU tensors, got one on " +
                                 tensor.device().str() + " (use nccl for CUDA tensors)");
    }
    const std::string broken = shared_->Broken();
    if (!broken.empty()) throw CollectiveError(std::string("gloo ") + call + ": the communicator is broken: " + broken);
  }

  std::shared_ptr<Work> Launch(const char* what, const CollectiveOptions& options,
                               const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                               std::function<void()> finish) {
    const std::string broken = shared_->Broken();
    if (!broken.empty()) throw CollectiveError(absl::StrCat("gloo ", what, ": the communicator is broken: ", broken));
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
    } catch (const std::exception& e) {
      const std::string message = absl::StrCat("gloo ", what, ": ", Describe(e));
      shared_->Break(message);
      throw CollectiveError(message);
    }
    // The works not yet seen complete, for the destructor, and the last few that
    // are: c10d's worker signals a work's condition variable after marking it
    // complete, so the last reference goes a few collectives later, not as soon
    // as a waiter has seen it complete.
    constexpr size_t kKeepRecent = 8;
    if (launched_.size() > kKeepRecent) {
      const auto old_end = launched_.end() - kKeepRecent;
      launched_.erase(std::remove_if(launched_.begin(), old_end,
                                     [](const c10::intrusive_ptr<c10d::Work>& w) { return w->isCompleted(); }),
                      old_end);
    }
    launched_.push_back(work);
    return std::make_shared<GlooWork>(shared_, std::move(work), Clock::now() + options.timeout, what,
                                      std::move(finish));
  }

  // A collective with nothing to move (empty tensors): complete at once.
  std::shared_ptr<Work> Done(std::function<void()> finish) {
    struct Completed final : Work {
      explicit Completed(std::function<void()> f) : finish(std::move(f)) {}
      void Wait() override {
        std::call_once(once, [this] {
          if (finish) finish();
        });
      }
      bool IsCompleted() override { return true; }
      std::function<void()> finish;
      std::once_flag once;
    };
    return std::make_shared<Completed>(std::move(finish));
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const GlooOptions options_;
  const int rank_;
  const int world_size_;
  const std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  int splits_ = 0;  // SplitGroup calls so far: each group's store prefix
  std::vector<c10::intrusive_ptr<c10d::Work>> launched_;
};

}  // namespace

std::unique_ptr<Communicator> MakeGlooCommunicator(GlooStoreFunctions store, int rank, int world_size,
                                                   const GlooOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InvalidArgumentError("gloo: rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                               " is not a rank of the world");
  }
  if (!store.set || !store.get || !store.try_get || !store.erase) {
    throw InvalidArgumentError("gloo: the store needs set, get, try_get and erase");
  }
  return std::make_unique<GlooCommunicator>(c10::make_intrusive<FunctionStore>(std::move(store), options.timeout),
                                            rank, world_size, options);
}

bool HaveGloo() { return true; }

}  // namespace lockstep
