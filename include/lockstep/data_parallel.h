// Data parallelism: parameters replicated on every rank, each rank on its shard of
// the global batch, gradients summed across ranks while backward still runs.
//
// DataParallel is built once per model, on every rank, after the model exists:
// it checks that every rank has the same model (names, shapes and dtypes of
// parameters and buffers, plus a caller-given fingerprint such as the config) and
// fails on every rank with the differences named if not, then copies rank 0's
// parameters and buffers to all ranks.
//
// GradientBucketer groups the parameters into buckets of at most `bucket_bytes`:
// first in reverse registration order (roughly the order backward produces
// gradients), then, after the first synchronised step, in the order their
// gradients actually became final there (rank 0's order, broadcast, so that every
// rank keeps the same buckets). Once armed for a backward pass, an autograd hook on each
// parameter's gradient accumulator marks it ready; as soon as every gradient of a
// bucket is final, the bucket's all-reduce starts while backward goes on. Buckets
// start in index order on every rank (the SPMD rule), whatever order hooks fire.
// Finish() starts what remains (a parameter without a gradient counts as zero)
// and waits. The parameters' .grad live in the bucket buffers (plain tensors on
// their storage, set by Arm), so backward accumulates into what is all-reduced and
// the sums are the gradients, with no copy either way; a .grad replaced since (set
// to none, say) is copied in and pointed back. Arm it only for the last
// microbatch: earlier ones accumulate locally without communication.
//
// How a bucket travels is the comm hook's (lockstep/comm_hooks.h): plain
// all-reduce without one, bf16/fp16 or PowerSGD compression with one. With
// `hierarchical`, a job with several ranks on each of several hosts reduces
// each bucket in three phases: a reduce-scatter among the ranks of a host
// (shared memory with MPI), an all-reduce of each rank's slice with the ranks of
// the same local index on the other hosts (so every local rank carries 1/L of
// the traffic between hosts, striped), and an all-gather within the host. The
// first phase runs when the bucket is launched, the second overlaps backward,
// the third runs in Finish. A hook then runs on the slices, between hosts.
//
// Flat (no hierarchy), the buckets travel on the communicator's ranks in host
// order (`order_by_host`): when the launcher interleaved the hosts (mpirun
// --map-by node, Slurm's --distribution=cyclic: ranks 0 and 2 on one host), a
// group of the same ranks sorted by host carries them, so that the all-reduce's
// exchanges between neighbours stay within a host, as with the ranks in blocks.
// On 2 hosts x 2 ranks Open MPI's all-reduce in rank order put twice the bytes on
// the link between them. The sums are the same up to float rounding (another
// order of addition).
//
// Not thread-safe: one training thread (autograd runs CPU hooks on it).
#ifndef LOCKSTEP_DATA_PARALLEL_H_
#define LOCKSTEP_DATA_PARALLEL_H_

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm_hooks.h"
#include "lockstep/communicator.h"

namespace torch::nn {
class Module;
}

namespace lockstep {

class CoordinationClient;
class Timeline;

struct DataParallelOptions {
  size_t bucket_bytes = size_t{25} << 20;
  CollectiveOptions collective;  // timeout of every collective the step issues
  // When set, the start-up check goes through the coordination service's
  // key-value store (keys "lockstep/startup/<name>/<rank>") instead of an
  // all-gather; each DataParallel of a job needs its own name. Borrowed.
  CoordinationClient* coordination = nullptr;
  std::string name = "model";
  // How each bucket travels (lockstep/comm_hooks.h); empty: a float32 all-reduce.
  CommHookFactory comm_hook;
  // Hierarchical all-reduce (see above) when the ranks are on more than one host
  // with more than one rank on each, the same number everywhere; otherwise flat,
  // and description() says why.
  bool hierarchical = false;
  // For the hierarchy: consecutive ranks, this many per host. 0: the ranks that
  // report the same host name (gethostname) share a host.
  int ranks_per_host = 0;
  // Flat: when the ranks of a host are not consecutive, all-reduce over a group
  // of them in host order (Communicator::Split, at construction). That needs a
  // backend that splits (MPI: MPI_THREAD_MULTIPLE); without one the ranks stay
  // in launch order and description() says why. One all-gather of host-name
  // hashes at construction either way; off: none.
  bool order_by_host = true;
  // Bucket-size tuning, as Horovod's autotune does it: when not empty, after the
  // first synchronised step each of these sizes is tried for `autotune_steps`
  // steps (plus one to settle), the median step time (Finish to Finish, the
  // slowest rank's) is measured, and the fastest size is kept. Every rank takes
  // the same decision; description() then lists the times and the choice, and
  // rank 0 prints it.
  std::vector<size_t> autotune_bucket_bytes;
  int autotune_steps = 5;
};

class GradientBucketer {
 public:
  // `communicator` is borrowed and must outlive the bucketer. Not owned. A
  // collective (buffers, the hierarchy's groups, the host order). Errors: InvalidArgumentError
  // for a hierarchy that cannot be built (ranks_per_host not dividing the world,
  // a hook that needs parameter shapes), those of the collectives.
  GradientBucketer(Communicator* communicator, std::vector<at::Tensor> parameters, const DataParallelOptions& options);
  ~GradientBucketer();
  GradientBucketer(const GradientBucketer&) = delete;
  GradientBucketer& operator=(const GradientBucketer&) = delete;

  // The next backward pass launches buckets as their gradients become final.
  void Arm();
  // Launches the buckets that have not started, waits for all of them and writes
  // the sums into the parameters' .grad. Errors: those of Communicator::Wait.
  void Finish();

  // Bucket b holds these parameter indices (into the constructor's vector).
  const std::vector<std::vector<size_t>>& buckets() const;
  // Buckets launched from autograd hooks (before Finish) in the last step.
  int launched_during_backward() const;
  // Seconds the training thread has spent blocked in Finish waiting for bucket
  // all-reduces, summed since construction: the communication that backward did
  // not hide. Two clock reads per bucket.
  double wait_seconds() const;
  // One line for logs: the hook and the hierarchy, or why there is none.
  const std::string& description() const;
  // Records each bucket's communication (launch to seen complete) and the waits
  // for it on `timeline` while it records. Borrowed; null: none.
  void set_timeline(Timeline* timeline);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// The start-up check of every data-parallel scheme, a collective: every rank
// learns every rank's model shape and fingerprint and all fail together, naming
// the ranks that differ (InvalidArgumentError); then rank 0's parameters and
// buffers are broadcast to all. Through the coordination service's key-value
// store when `options.coordination` is set.
void CheckModelsAgreeAndBroadcast(Communicator* communicator, torch::nn::Module& model, const std::string& fingerprint,
                                  const DataParallelOptions& options);

class DataParallel {
 public:
  // Collective: every rank constructs it with the same model. `fingerprint`
  // names anything else that must agree (the resolved config, say).
  // Errors: InvalidArgumentError on every rank when models or fingerprints differ;
  // CollectiveError from the communicator; CoordinationError from the service.
  DataParallel(Communicator* communicator, torch::nn::Module& model, const std::string& fingerprint,
               const DataParallelOptions& options = {});

  Communicator& communicator() { return *communicator_; }
  GradientBucketer& bucketer() { return *bucketer_; }
  const DataParallelOptions& options() const { return options_; }
  int rank() const { return communicator_->rank(); }
  int world_size() const { return communicator_->world_size(); }

  // Sums a float64 CPU tensor in place across ranks.
  void AllReduceSum(at::Tensor& values);
  // The same, started now; finish it with Wait(). `values` must stay untouched
  // until then.
  std::shared_ptr<Work> AllReduceSumAsync(const at::Tensor& values);
  // Waits for a handle from AllReduceSumAsync, counting the time as communication
  // wait. Errors: those of Work::Wait.
  void Wait(Work& work);

  // Seconds the training thread has spent blocked on communication since
  // construction: gradient buckets (GradientBucketer::wait_seconds) plus the
  // AllReduceSum calls and Waits (the global batch weight).
  double communication_wait_seconds() const;

 private:
  Communicator* const communicator_;  // Not owned.
  const DataParallelOptions options_;
  std::unique_ptr<GradientBucketer> bucketer_;
  double all_reduce_sum_seconds_ = 0.0;
};

}  // namespace lockstep

#endif  // LOCKSTEP_DATA_PARALLEL_H_
