// Communicator: the collectives that ranks of an SPMD job meet in — all-reduce,
// reduce-scatter, all-gather, all-to-all, broadcast and barrier over torch tensors.
//
// SPMD rule: every rank calls the same collectives, with tensors of the same size
// and dtype, in the same order. A call that breaks the rule, or a peer that dies,
// shows up as a CollectiveTimeoutError after the call's timeout, never as a hang.
//
// Async calls return a Work handle at once; Work::Wait() blocks until the
// collective is done and rethrows its failure. Tensors must stay alive and
// untouched until then. Blocking calls are Async + Wait. A communicator may be
// called from one thread at a time; its Work handles may be waited on from any.
// After a failure the communicator is broken: every later call fails at once
// with the original reason. Abort() breaks a communicator and every group split
// from it that is still alive (and theirs, in turn).
//
//   HEALTHY --timeout, backend error or Abort()--> BROKEN (every call throws)
#ifndef LOCKSTEP_COMMUNICATOR_H_
#define LOCKSTEP_COMMUNICATOR_H_

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/errors.h"

namespace lockstep {

enum class ReduceOp { kSum, kAverage, kMax };

struct CollectiveOptions {
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

// A collective failed: the backend reported an error, or the communicator is broken.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

// A collective did not complete within its timeout: a peer is dead, stuck, or
// called a different collective.
class CollectiveTimeoutError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective completes. Errors: CollectiveTimeoutError after the
  // call's timeout; CollectiveError when the backend failed.
  virtual void Wait() = 0;
  // True once the collective has completed or failed (never blocks).
  virtual bool IsCompleted() = 0;
  // When it completed, on the steady clock, for backends that note it (MPI, on
  // its worker thread); nullopt before that, and from the others (timelines
  // then use the time they saw it complete).
  virtual std::optional<std::chrono::steady_clock::time_point> completed_at() { return std::nullopt; }
};

class Communicator {
 public:
  Communicator();
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;

  // In place: every rank's `tensor` becomes the reduction over all ranks.
  // kAverage is for floating-point tensors only.
  // Errors (thrown at once): InvalidArgumentError for a non-contiguous tensor, a
  // dtype or device the backend does not take; CollectiveError when broken.
  virtual std::shared_ptr<Work> AllReduceAsync(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options) = 0;
  // `output` (world_size * n elements) receives every rank's `input` (n elements),
  // rank r's at offset r * n. In place when `input` is this rank's slice of `output`.
  virtual std::shared_ptr<Work> AllGatherAsync(at::Tensor output, at::Tensor input,
                                               const CollectiveOptions& options) = 0;
  // `input` has world_size * n elements; rank r's `output` (n elements) receives
  // the reduction over ranks of input elements [r * n, (r + 1) * n).
  virtual std::shared_ptr<Work> ReduceScatterAsync(at::Tensor output, at::Tensor input, ReduceOp op,
                                                   const CollectiveOptions& options) = 0;
  // `input` and `output` have world_size * n elements of one dtype (any: the
  // bytes travel as they are, nothing is reduced): block j of this rank's input,
  // elements [j * n, (j + 1) * n), lands in rank j's output as block r, r being
  // this rank. `output` may not overlap `input`. The default is an all-gather of
  // every rank's whole input, which moves world_size times the bytes; the MPI,
  // Gloo and NCCL backends move only the blocks.
  virtual std::shared_ptr<Work> AllToAllAsync(at::Tensor output, at::Tensor input, const CollectiveOptions& options);
  // Every rank's `tensor` becomes `root`'s.
  virtual std::shared_ptr<Work> BroadcastAsync(at::Tensor tensor, int root, const CollectiveOptions& options) = 0;
  // Completes once every rank has called it.
  virtual std::shared_ptr<Work> BarrierAsync(const CollectiveOptions& options) = 0;

  // A 1-D tensor of `numel` elements (contents undefined) for data this
  // communicator will all-reduce again and again, such as gradient buckets. A
  // collective: every rank calls it with the same arguments, in the same order as
  // its other collectives. A backend may place it where it reduces fastest (the
  // MPI communicator: memory that every rank of a one-host job maps, see
  // lockstep/mpi_communicator.h); the default is at::empty. Errors: those of the
  // other collectives.
  virtual at::Tensor AllocateCollectiveBuffer(int64_t numel, const at::TensorOptions& options,
                                              const CollectiveOptions& collective = {});

  // Splits the ranks into disjoint groups, as MPI_Comm_split does: the ranks that
  // pass the same `color` (>= 0) form one group, ordered by `key`, then by rank
  // here. A collective over this communicator (every rank calls it, in the same
  // order as its other collectives). The result is a communicator of its own,
  // independent of this one, that may be called from another thread than this one
  // (the data axis of a mesh during backward, the model axis in forward). A group
  // of one rank is a single-process communicator; a group that is this whole
  // communicator in the same order forwards to it (it must outlive the result).
  // Other groups are the backend's (SplitGroup). Aborting this communicator
  // aborts the result too, for as long as the result lives. Errors: InvalidArgumentError for
  // a negative color, a backend that cannot split, or MPI without
  // MPI_THREAD_MULTIPLE; CollectiveError as for the other collectives.
  std::unique_ptr<Communicator> Split(int color, int key, const CollectiveOptions& options = {});

  // Safe from any thread (the coordination client's, when a peer died): the
  // collective in progress, or the next one, fails with a CollectiveError that
  // carries `reason`, and the communicator is broken. The first reason wins.
  // Every group Split from this communicator that is still alive is aborted
  // with it, and the groups split from those: a rank blocked in a host's group
  // or on a mesh axis hears of a dead peer as soon as one blocked here does.
  void Abort(const std::string& reason);

  void AllReduce(at::Tensor tensor, ReduceOp op, const CollectiveOptions& options = {}) {
    AllReduceAsync(std::move(tensor), op, options)->Wait();
  }
  void AllGather(at::Tensor output, at::Tensor input, const CollectiveOptions& options = {}) {
    AllGatherAsync(std::move(output), std::move(input), options)->Wait();
  }
  void ReduceScatter(at::Tensor output, at::Tensor input, ReduceOp op, const CollectiveOptions& options = {}) {
    ReduceScatterAsync(std::move(output), std::move(input), op, options)->Wait();
  }
  void AllToAll(at::Tensor output, at::Tensor input, const CollectiveOptions& options = {}) {
    AllToAllAsync(std::move(output), std::move(input), options)->Wait();
  }
  void Broadcast(at::Tensor tensor, int root, const CollectiveOptions& options = {}) {
    BroadcastAsync(std::move(tensor), root, options)->Wait();
  }
  void Barrier(const CollectiveOptions& options = {}) { BarrierAsync(options)->Wait(); }

 protected:
  // The backend's groups (see Split): called on every rank, after Split has
  // agreed on the groups, whenever any group has more than one rank and fewer
  // than all (so a rank alone in its group takes part too: MPI_Comm_split and
  // ncclCommSplit are collectives over this communicator). `members` are this
  // rank's group, as ranks here, in the group's order. Default:
  // InvalidArgumentError naming backend().
  virtual std::unique_ptr<Communicator> SplitGroup(int color, int key, const std::vector<int>& members,
                                                   const CollectiveOptions& options);

  // The backend's part of Abort: breaks this communicator alone, as Abort
  // describes (Abort itself passes the reason on to the split groups). Called
  // from any thread, possibly more than once.
  virtual void AbortCollectives(const std::string& reason) = 0;

 private:
  struct SplitRegistry;  // the live groups split from this one
  std::unique_ptr<Communicator> Register(std::unique_ptr<Communicator> group);
  const std::unique_ptr<SplitRegistry> splits_;
};

// A handle that waits for `first`, then runs `next` (on the thread that waits,
// once; a failure of either is rethrown by every later Wait). IsCompleted is
// true once a Wait has returned. For work in phases: a collective, then what is
// done with its result (a gradient hook's decompression, a default AllToAll).
std::shared_ptr<Work> Then(std::shared_ptr<Work> first, std::function<void()> next);

// A world of one: every collective completes at once (all-gather and
// reduce-scatter copy). What a single process without a launcher uses.
std::unique_ptr<Communicator> MakeSingleProcessCommunicator();

// Checks shared by the backends. Throw InvalidArgumentError naming the call.
void CheckCollectiveTensor(const at::Tensor& tensor, const char* call);
void CheckSizes(const at::Tensor& big, const at::Tensor& small, int world_size, const char* call);
// Both contiguous, of one dtype and numel, a multiple of world_size.
void CheckAllToAll(const at::Tensor& output, const at::Tensor& input, int world_size, const char* call);

}  // namespace lockstep

#endif  // LOCKSTEP_COMMUNICATOR_H_
