// Gradient communication hooks: how each gradient bucket of replicated data
// parallelism (GradientBucketer) travels between ranks.
//
// Without a hook a bucket is all-reduced as it is (float32 sums). A hook may
// compress it first: the built-in ones send bf16 or fp16 and sum in float32, or
// send PowerSGD's low-rank factors (Vogels et al., 2019) with error feedback.
// Users add their own by subclassing GradientCommHook and setting
// DataParallelOptions::comm_hook to a factory of it.
//
// The contract, which every hook keeps:
// - Run is called once per bucket per step, in bucket index order, the same on
//   every rank (the SPMD rule): during backward as buckets become final, the
//   rest in GradientBucketer::Finish. Then Finish waits on the returned Work
//   handles in the same order. Both on the training thread.
// - Once the Work has been waited on, `bucket.buffer` holds the sum over ranks
//   of every rank's buffer, or the hook's approximation of it, identical on
//   every rank (otherwise the replicas drift apart).
// - Collectives go through the communicator passed in, in the same order on
//   every rank; the Work may issue more of them when waited on (see Then).
#ifndef LOCKSTEP_COMM_HOOKS_H_
#define LOCKSTEP_COMM_HOOKS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/communicator.h"

namespace lockstep {

struct GradientBucket {
  // The bucket's index in the current layout; stable until OnLayoutChanged.
  int index = 0;
  // Flat and contiguous: this rank's gradients in, the reduced ones out.
  at::Tensor buffer;
  // Views of `buffer` shaped like the bucket's parameters, in buffer order. Empty
  // when the hook runs on a slice of the bucket (hierarchical all-reduce).
  std::vector<at::Tensor> gradients;
  // Synchronised steps this bucketer has finished before this one (0 first).
  int64_t step = 0;
};

class GradientCommHook {
 public:
  virtual ~GradientCommHook() = default;
  // For logs: "bf16", "powersgd(rank 4)".
  virtual std::string name() const = 0;
  // Starts the bucket's communication and returns its handle (see the contract
  // above). Errors: those of the communicator's collectives.
  virtual std::shared_ptr<Work> Run(Communicator& communicator, const GradientBucket& bucket,
                                    const CollectiveOptions& options) = 0;
  // True when Run needs GradientBucket::gradients (the parameters' shapes);
  // such a hook cannot run on slices of buckets.
  virtual bool needs_parameter_shapes() const { return false; }
  // The buckets were regrouped (after the first synchronised step): state kept
  // per bucket index no longer applies.
  virtual void OnLayoutChanged() {}
};

// Every DataParallel makes its own hook (a hook may keep state per bucket).
using CommHookFactory = std::function<std::unique_ptr<GradientCommHook>()>;

// No compression: the bucket is all-reduced (what no hook does too).
class AllReduceHook final : public GradientCommHook {
 public:
  std::string name() const override { return "allreduce"; }
  std::shared_ptr<Work> Run(Communicator& communicator, const GradientBucket& bucket,
                            const CollectiveOptions& options) override;
};

namespace internal {
struct SlicedHalfBucket;
}  // namespace internal

// Sends the bucket as bf16 or fp16 (half the bytes of float32) and sums the
// ranks' values in float32, in rank order, so every rank gets the same sum:
// - between 2 ranks, the 16-bit values travel by all-gather and each rank adds
//   both in float32;
// - among 3 or more, an all-to-all sends slice j of every rank's values to rank
//   j, which adds them in float32 and rounds the sum to 16 bits again (fp16: the
//   mean, times world after, so that a sum above 65504 does not overflow); the
//   rounded sums travel back by all-gather. A bucket's all-gather starts when
//   the next bucket's Run comes, or at its own Wait.
// Either way each rank sends (and receives) (world - 1) / world x n x 4 bytes
// in all, half of a bandwidth-optimal float32 all-reduce's. fp16 keeps 3
// more mantissa bits than bf16 but flushes magnitudes below 6e-8 to zero and
// overflows above 65504; bf16 has float32's range.
class HalfPrecisionHook final : public GradientCommHook {
 public:
  // `dtype`: at::kBFloat16 or at::kHalf. Errors: InvalidArgumentError otherwise.
  explicit HalfPrecisionHook(at::ScalarType dtype);
  std::string name() const override;
  std::shared_ptr<Work> Run(Communicator& communicator, const GradientBucket& bucket,
                            const CollectiveOptions& options) override;

  ~HalfPrecisionHook() override;

 private:
  at::ScalarType dtype_;
  // Among 3 or more ranks: the last bucket whose all-gather may not have started.
  std::shared_ptr<internal::SlicedHalfBucket> pending_;
};

struct PowerSgdOptions {
  // Rank of the approximation of each gradient matrix.
  int rank = 4;
  // Plain all-reduce for this many synchronised steps first (the error feedback
  // starts with the compression).
  int64_t start_step = 10;
  // A gradient of shape (n, ...) is compressed as an n x m matrix only when
  // n x m >= min_compression x rank x (n + m); others (biases, small layers) are
  // all-reduced in float32.
  double min_compression = 2.0;
  // Seeds the initial Q factors, the same on every rank.
  uint64_t seed = 0;
};

// PowerSGD: each gradient matrix M (plus its error from the last step) is
// approximated by P Q^T of rank r with one step of subspace iteration: P = M Q,
// all-reduced and orthonormalised, then Q = M^T P, all-reduced, so the ranks send
// r (n + m) numbers instead of n m. Error feedback keeps what the approximation
// missed (M - P Q^T / world) for the next step; warm start keeps Q from one step
// to the next. Its state (errors, Q) is not in checkpoints: a resumed run starts
// it afresh, so resuming under PowerSGD is not bit for bit.
class PowerSgdHook final : public GradientCommHook {
 public:
  // Errors: InvalidArgumentError for rank < 1, start_step < 0 or min_compression <= 0.
  explicit PowerSgdHook(const PowerSgdOptions& options);
  ~PowerSgdHook() override;
  std::string name() const override;
  std::shared_ptr<Work> Run(Communicator& communicator, const GradientBucket& bucket,
                            const CollectiveOptions& options) override;
  bool needs_parameter_shapes() const override { return true; }
  void OnLayoutChanged() override;

 private:
  struct State;
  PowerSgdOptions options_;
  std::unique_ptr<State> state_;
};

// The built-in hooks by name: "none" (an empty factory), "allreduce", "bf16",
// "fp16", "powersgd" (with `powersgd`). Errors: InvalidArgumentError naming
// the choices for any other name.
CommHookFactory MakeCommHook(const std::string& name, const PowerSgdOptions& powersgd = {});

}  // namespace lockstep

#endif  // LOCKSTEP_COMM_HOOKS_H_
