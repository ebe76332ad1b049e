#include "lockstep/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace lockstep {
namespace {

class ThenWork final : public Work {
 public:
  ThenWork(std::shared_ptr<Work> first, std::function<void()> next) : first_(std::move(first)), next_(std::move(next)) {}

  void Wait() override {
    absl::MutexLock lock(&mutex_);
    if (!done_) {
      done_ = true;
      try {
        first_->Wait();
        std::function<void()> next = std::move(next_);
        next();
      } catch (...) {
        error_ = std::current_exception();
      }
      first_.reset();
    }
    if (error_) std::rethrow_exception(error_);
  }

  bool IsCompleted() override {
    absl::MutexLock lock(&mutex_);
    return done_;
  }

 private:
  absl::Mutex mutex_;
  std::shared_ptr<Work> first_ ABSL_GUARDED_BY(mutex_);
  std::function<void()> next_ ABSL_GUARDED_BY(mutex_);
  bool done_ ABSL_GUARDED_BY(mutex_) = false;
  std::exception_ptr error_ ABSL_GUARDED_BY(mutex_);
};

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
  std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions&) override {
    CheckNotAborted();
    CheckAllToAll(output, input, 1, "all_to_all");
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

 protected:
  void AbortCollectives(const std::string& reason) override {
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

// What a parent's Abort reaches a split group through: the group (its
// ForwardingCommunicator) while it lives, null once it is going. Abort holds
// `mu` while it aborts the group, so the group cannot be destroyed under it.
struct SplitLink {
  absl::Mutex mu;
  Communicator* group ABSL_GUARDED_BY(mu) = nullptr;
};

// Forwards every call to `target`. Two uses:
// - a group that is the whole parent, in the parent's order: `target` is the
//   parent (which must outlive it), nothing owned, no link;
// - a group that Split made and registered: `target` is the backend's group,
//   owned, and before it goes the group is unhooked from its parent's registry,
//   so that an Abort from another thread never reaches a communicator half
//   destroyed.
class ForwardingCommunicator final : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator* parent) : target_(parent) {}
  ForwardingCommunicator(std::unique_ptr<Communicator> group, std::shared_ptr<SplitLink> link)
      : target_(group.get()), owned_(std::move(group)), link_(std::move(link)) {}
  ~ForwardingCommunicator() override {
    if (link_ == nullptr) return;
    absl::MutexLock lock(&link_->mu);
    link_->group = nullptr;
  }

  int rank() const override { return target_->rank(); }
  int world_size() const override { return target_->world_size(); }
  std::string backend() const override { return target_->backend(); }
  std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options) override {
    return target_->AllReduceAsync(std::move(tensor), op, options);
  }
  std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    return target_->AllGatherAsync(std::move(output), std::move(input), options);
  }
  std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp op,
                                           const CollectiveOptions& options) override {
    return target_->ReduceScatterAsync(std::move(output), std::move(input), op, options);
  }
  std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options) override {
    return target_->AllToAllAsync(std::move(output), std::move(input), options);
  }
  std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions& options) override {
    return target_->BroadcastAsync(std::move(tensor), root, options);
  }
  std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& options) override { return target_->BarrierAsync(options); }
  at::Tensor AllocateCollectiveBuffer(int64_t numel, const at::TensorOptions& options,
                                      const CollectiveOptions& collective) override {
    return target_->AllocateCollectiveBuffer(numel, options, collective);
  }

 protected:
  std::unique_ptr<Communicator> SplitGroup(int color, int key, const std::vector<int>& /*members*/,
                                           const CollectiveOptions& options) override {
    return target_->Split(color, key, options);
  }
  // An alias's Abort aborts its parent, and with it the parent's groups.
  void AbortCollectives(const std::string& reason) override { target_->Abort(reason); }

 private:
  Communicator* const target_;
  const std::unique_ptr<Communicator> owned_;
  const std::shared_ptr<SplitLink> link_;
};

}  // namespace

struct Communicator::SplitRegistry {
  absl::Mutex mu;
  std::optional<std::string> aborted ABSL_GUARDED_BY(mu);  // the first Abort's reason
  std::vector<std::weak_ptr<SplitLink>> links ABSL_GUARDED_BY(mu);
};

Communicator::Communicator() : splits_(std::make_unique<SplitRegistry>()) {}

Communicator::~Communicator() = default;

void Communicator::Abort(const std::string& reason) {
  AbortCollectives(reason);
  std::vector<std::shared_ptr<SplitLink>> live;
  {
    absl::MutexLock lock(&splits_->mu);
    if (!splits_->aborted) splits_->aborted = reason;
    for (const std::weak_ptr<SplitLink>& weak : splits_->links) {
      if (std::shared_ptr<SplitLink> link = weak.lock()) live.push_back(std::move(link));
    }
  }
  for (const std::shared_ptr<SplitLink>& link : live) {
    absl::MutexLock lock(&link->mu);
    if (link->group != nullptr) link->group->Abort(reason);
  }
}

// Hooks `group` to this communicator's Abort. A group split off just as this
// communicator was aborted starts aborted.
std::unique_ptr<Communicator> Communicator::Register(std::unique_ptr<Communicator> group) {
  auto link = std::make_shared<SplitLink>();
  auto registered = std::make_unique<ForwardingCommunicator>(std::move(group), link);
  {
    absl::MutexLock lock(&link->mu);
    link->group = registered.get();
  }
  std::optional<std::string> aborted;
  {
    absl::MutexLock lock(&splits_->mu);
    std::vector<std::weak_ptr<SplitLink>>& links = splits_->links;
    links.erase(std::remove_if(links.begin(), links.end(), [](const auto& weak) { return weak.expired(); }),
                links.end());
    links.push_back(link);
    aborted = splits_->aborted;
  }
  if (aborted) registered->Abort(*aborted);
  return registered;
}

std::unique_ptr<Communicator> Communicator::Split(int color, int key, const CollectiveOptions& options) {
  if (color < 0) throw InvalidArgumentError("split: color must be >= 0, got " + std::to_string(color));
  const int n = world_size();
  at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, at::kLong);
  at::Tensor all = at::empty({2 * n}, at::kLong);
  AllGather(all, mine, options);
  // Every group, each in (key, rank) order.
  std::map<int64_t, std::vector<std::pair<int64_t, int>>> groups;
  const int64_t* values = all.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r) groups[values[2 * r]].emplace_back(values[2 * r + 1], r);
  bool backend_groups = false;  // any group of more than one rank and fewer than all
  for (auto& [group_color, group] : groups) {
    std::sort(group.begin(), group.end());
    if (group.size() > 1 && static_cast<int>(group.size()) < n) backend_groups = true;
  }
  const std::vector<std::pair<int64_t, int>>& mine_sorted = groups.at(color);
  std::vector<int> members;
  for (const auto& [member_key, r] : mine_sorted) members.push_back(r);
  // Every rank takes part in the backend's split when any group needs it.
  if (backend_groups) return Register(SplitGroup(color, key, members, options));
  if (members.size() == 1) return Register(MakeSingleProcessCommunicator());
  bool whole = true;
  for (int i = 0; whole && i < n; ++i) whole = members[i] == i;
  if (whole) return std::make_unique<ForwardingCommunicator>(this);
  return Register(SplitGroup(color, key, members, options));  // the whole world, reordered
}

std::unique_ptr<Communicator> Communicator::SplitGroup(int, int, const std::vector<int>&, const CollectiveOptions&) {
  throw InvalidArgumentError("split: the " + backend() + " communicator cannot split into groups");
}

std::shared_ptr<Work> Then(std::shared_ptr<Work> first, std::function<void()> next) {
  return std::make_shared<ThenWork>(std::move(first), std::move(next));
}

std::shared_ptr<Work> Communicator::AllToAllAsync(at::Tensor output, at::Tensor input,
                                                  const CollectiveOptions& options) {
  const int world = world_size();
  CheckAllToAll(output, input, world, "all_to_all");
  const int64_t n = input.numel() / world;
  // Every rank's whole input, then this rank's block of each.
  at::Tensor gathered = at::empty({world * input.numel()}, input.options());
  std::shared_ptr<Work> work = AllGatherAsync(gathered, input.view(-1), options);
  return Then(std::move(work), [output, gathered, n, world, rank = rank()]() mutable {
    output.view({world, n}).copy_(gathered.view({world, world, n}).select(1, rank));
  });
}

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

void CheckAllToAll(const at::Tensor& output, const at::Tensor& input, int world_size, const char* call) {
  CheckCollectiveTensor(output, call);
  CheckCollectiveTensor(input, call);
  if (output.scalar_type() != input.scalar_type()) {
    throw InvalidArgumentError(std::string(call) + ": input and output dtypes differ");
  }
  if (output.numel() != input.numel() || input.numel() % world_size != 0) {
    throw InvalidArgumentError(std::string(call) + ": input and output need the same number of elements, a " +
                               "multiple of world_size " + std::to_string(world_size) + "; got " +
                               std::to_string(input.numel()) + " and " + std::to_string(output.numel()));
  }
  if (output.numel() > 0 && output.device() == input.device()) {
    const auto* a = static_cast<const char*>(output.data_ptr());
    const auto* b = static_cast<const char*>(input.data_ptr());
    const int64_t bytes = output.numel() * output.element_size();
    if (a < b + bytes && b < a + bytes) throw InvalidArgumentError(std::string(call) + ": output overlaps input");
  }
}

std::unique_ptr<Communicator> MakeSingleProcessCommunicator() {
  return std::make_unique<SingleProcessCommunicator>();
}

}  // namespace lockstep
