#include "lockstep/comm_hooks.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "half_kernel.h"

namespace lockstep {

std::shared_ptr<Work> AllReduceHook::Run(Communicator& communicator, const GradientBucket& bucket,
                                         const CollectiveOptions& options) {
  return communicator.AllReduceAsync(bucket.buffer, ReduceOp::kSum, options);
}

HalfPrecisionHook::HalfPrecisionHook(at::ScalarType dtype) : dtype_(dtype) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    throw InvalidArgumentError(absl::StrCat("HalfPrecisionHook: dtype must be bfloat16 or half, got ",
                                            at::toString(dtype)));
  }
}

std::string HalfPrecisionHook::name() const { return dtype_ == at::kBFloat16 ? "bf16" : "fp16"; }

namespace {

internal::HalfFormat FormatOf(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? internal::HalfFormat::kBFloat16 : internal::HalfFormat::kHalf;
}

// Adds `world` consecutive parts of `length` 16-bit values (`halves`, stored as
// half and read as `dtype`, rank 0's part first) into `sum`, in rank order, so
// every rank gets the same bits. With `kernel`, half_kernel.h's loops into a
// contiguous float32 CPU `sum`; otherwise libtorch widens each part as it adds it
// (into float32 for a sum; one part is copied into `sum` as it is).
void SumHalfParts(const at::Tensor& halves, at::ScalarType dtype, bool kernel, int world, int64_t length,
                  const at::Tensor& sum) {
  if (kernel) {
    const auto* base = reinterpret_cast<const uint16_t*>(halves.data_ptr());
    std::vector<const uint16_t*> parts(world);
    for (int r = 0; r < world; ++r) parts[r] = base + r * length;
    internal::SumHalves(FormatOf(dtype), parts.data(), world, sum.data_ptr<float>(), length);
    return;
  }
  const at::Tensor values = halves.view(dtype).view({world, length});
  if (world == 1 || sum.scalar_type() == at::kFloat) {
    sum.copy_(values.select(0, 0));
    for (int r = 1; r < world; ++r) sum.add_(values.select(0, r));
    return;
  }
  at::Tensor wide = values.select(0, 0).to(at::kFloat);
  for (int r = 1; r < world; ++r) wide.add_(values.select(0, r));
  sum.copy_(wide);
}

}  // namespace

// A bucket among 3 or more ranks in two phases: an all-to-all sends slice j of
// every rank's 16-bit values to rank j, which sums them in float32; then the
// sums, rounded to 16 bits again, travel back by all-gather. Each phase moves
// (world - 1) / world x n x 2 bytes per rank.
struct internal::SlicedHalfBucket {
  Communicator* communicator = nullptr;
  CollectiveOptions options;
  at::Tensor buffer;      // the bucket: float32 (or other) values in, the sums out
  at::ScalarType dtype;   // bf16 or fp16
  bool kernel = false;    // half_kernel.h's loops (a float32 CPU bucket)
  int world = 1;
  int rank = 0;
  int64_t n = 0, chunk = 0;
  at::Tensor received;    // world x chunk halves: every rank's values of this rank's slice
  std::shared_ptr<Work> exchange;
  at::Tensor gathered;    // world x chunk halves: every slice's rounded sum
  std::shared_ptr<Work> gather;

  // Phase two: waits for the all-to-all, sums this rank's slice and starts the all-gather.
  void StartGather() {
    if (gather) return;  // started already
    at::NoGradGuard no_grad;
    exchange->Wait();
    exchange.reset();
    const at::Tensor sum = at::empty({chunk}, buffer.options().dtype(at::kFloat));
    SumHalfParts(received, dtype, kernel, world, chunk, sum);
    // fp16 sends the mean: a sum of in-range values may pass 65504, their mean cannot.
    if (dtype == at::kHalf) sum.div_(world);
    at::Tensor own = gathered.narrow(0, rank * chunk, chunk);
    if (kernel) {
      internal::RoundToHalf(FormatOf(dtype), sum.data_ptr<float>(), reinterpret_cast<uint16_t*>(own.data_ptr()),
                            chunk);
    } else {
      own.copy_(sum.to(dtype).view(at::kHalf));
    }
    received = at::Tensor();
    gather = communicator->AllGatherAsync(gathered, own, options);
  }

  // Waits for the all-gather and widens the sums into the bucket.
  void Finish() {
    at::NoGradGuard no_grad;
    StartGather();  // a no-op when the next bucket's Run started it
    gather->Wait();
    SumHalfParts(gathered.narrow(0, 0, n), dtype, kernel, 1, n, buffer);  // one part: widened exactly
    if (dtype == at::kHalf) buffer.mul_(world);
    buffer = at::Tensor();
    gathered = at::Tensor();
  }
};

HalfPrecisionHook::~HalfPrecisionHook() = default;

std::shared_ptr<Work> HalfPrecisionHook::Run(Communicator& communicator, const GradientBucket& bucket,
                                             const CollectiveOptions& options) {
  at::NoGradGuard no_grad;
  const at::Tensor buffer = bucket.buffer;
  const int64_t n = buffer.numel();
  const int world = communicator.world_size();
  const internal::HalfFormat format = FormatOf(dtype_);
  // A float32 bucket on the CPU takes the vectorised loops of half_kernel.h (the
  // same bits as libtorch's casts, in about half the time); anything else libtorch's.
  const bool kernel = buffer.device().is_cpu() && buffer.scalar_type() == at::kFloat && buffer.is_contiguous() &&
                      internal::HaveHalfKernel(format);
  // Every backend moves 16-bit floats as they are in an all-gather when they
  // are called half (some widen bfloat16 to float32 on the wire): the bits
  // travel as half and are read back as `dtype_`. Among 3 or more ranks the
  // bucket is padded to world x chunk values for the all-to-all.
  const bool sliced = world >= 3;
  const int64_t chunk = sliced ? (n + world - 1) / world : n;
  const int64_t padded = sliced ? world * chunk : n;
  at::Tensor compressed;
  if (kernel) {
    compressed = at::empty({padded}, buffer.options().dtype(at::kHalf));
    internal::RoundToHalf(format, buffer.data_ptr<float>(), reinterpret_cast<uint16_t*>(compressed.data_ptr()), n);
    if (padded > n) compressed.narrow(0, n, padded - n).zero_();
  } else if (sliced) {
    at::Tensor values = at::zeros({padded}, buffer.options().dtype(dtype_));
    values.narrow(0, 0, n).copy_(buffer.reshape({-1}));
    compressed = values.view(at::kHalf);
  } else {
    compressed = buffer.to(dtype_).view(at::kHalf);
  }

  if (sliced) {
    // The last bucket's phase two starts first: every rank starts its
    // collectives in the same order (Run's, then Wait's), and the all-gather
    // goes out behind the all-to-all already in flight.
    if (std::shared_ptr<internal::SlicedHalfBucket> earlier = std::move(pending_)) earlier->StartGather();
    auto state = std::make_shared<internal::SlicedHalfBucket>();
    state->communicator = &communicator;
    state->options = options;
    state->buffer = buffer;
    state->dtype = dtype_;
    state->kernel = kernel;
    state->world = world;
    state->rank = communicator.rank();
    state->n = n;
    state->chunk = chunk;
    state->received = at::empty({padded}, compressed.options());
    state->gathered = at::empty({padded}, compressed.options());
    state->exchange = communicator.AllToAllAsync(state->received, compressed, options);
    pending_ = state;
    std::shared_ptr<Work> exchange = state->exchange;
    return Then(std::move(exchange), [state = std::move(state)] { state->Finish(); });
  }

  at::Tensor gathered = at::empty({world * n}, compressed.options());
  std::shared_ptr<Work> work = communicator.AllGatherAsync(gathered, compressed, options);
  const at::ScalarType dtype = dtype_;
  // `compressed` stays alive until the all-gather is done.
  return Then(std::move(work), [buffer, gathered, compressed, dtype, kernel, world, n] {
    at::NoGradGuard no_grad;
    SumHalfParts(gathered, dtype, kernel, world, n, buffer);  // rank 0's values, then rank 1's, ...
  });
}

struct PowerSgdHook::State {
  // One gradient of a bucket, compressed or not.
  struct Matrix {
    size_t gradient = 0;  // index into GradientBucket::gradients
    int64_t n = 0, m = 0, r = 0;
    at::Tensor q;      // m x r, warm-started from the last step
    at::Tensor error;  // n x m: what the last approximation missed
  };
  struct Bucket {
    bool ready = false;
    std::vector<Matrix> matrices;    // compressed
    std::vector<size_t> uncompressed;  // indices into gradients
  };
  std::map<int, Bucket> buckets;  // by index: a node keeps its address as others come
};

PowerSgdHook::PowerSgdHook(const PowerSgdOptions& options) : options_(options), state_(std::make_unique<State>()) {
  if (options.rank < 1) throw InvalidArgumentError(absl::StrCat("PowerSGD: rank must be >= 1, got ", options.rank));
  if (options.start_step < 0) {
    throw InvalidArgumentError(absl::StrCat("PowerSGD: start_step must be >= 0, got ", options.start_step));
  }
  if (!(options.min_compression > 0)) {
    throw InvalidArgumentError(absl::StrCat("PowerSGD: min_compression must be > 0, got ", options.min_compression));
  }
}

PowerSgdHook::~PowerSgdHook() = default;

std::string PowerSgdHook::name() const {
  return absl::StrCat("powersgd(rank ", options_.rank, ", from step ", options_.start_step, ")");
}

void PowerSgdHook::OnLayoutChanged() { state_->buckets.clear(); }

std::shared_ptr<Work> PowerSgdHook::Run(Communicator& communicator, const GradientBucket& bucket,
                                        const CollectiveOptions& options) {
  if (bucket.step < options_.start_step) return communicator.AllReduceAsync(bucket.buffer, ReduceOp::kSum, options);
  if (bucket.gradients.empty() && bucket.buffer.numel() > 0) {
    throw InvalidArgumentError("PowerSGD: the bucket came without its gradients' shapes");
  }
  at::NoGradGuard no_grad;
  State::Bucket& b = state_->buckets[bucket.index];
  if (!b.ready) {
    b.ready = true;
    for (size_t i = 0; i < bucket.gradients.size(); ++i) {
      const at::Tensor& g = bucket.gradients[i];
      const int64_t n = g.dim() >= 2 ? g.size(0) : 0;
      const int64_t m = n > 0 ? g.numel() / n : 0;
      const int64_t r = std::min<int64_t>({options_.rank, n, m});
      if (n == 0 || m == 0 || static_cast<double>(n) * m < options_.min_compression * r * (n + m)) {
        b.uncompressed.push_back(i);
        continue;
      }
      State::Matrix matrix;
      matrix.gradient = i;
      matrix.n = n;
      matrix.m = m;
      matrix.r = r;
      // The same Q on every rank: a generator seeded by (seed, bucket, gradient).
      at::Generator generator =
          at::make_generator<at::CPUGeneratorImpl>(options_.seed * 1000003 + bucket.index * 1009 + i);
      matrix.q = at::randn({m, r}, generator, g.options().device(at::kCPU)).to(g.device());
      matrix.error = at::zeros({n, m}, g.options());
      b.matrices.push_back(std::move(matrix));
    }
  }

  // M = gradient + error, in the bucket itself; P = M Q for every matrix, in one
  // flat tensor; the uncompressed gradients in another.
  int64_t p_size = 0, q_size = 0, rest_size = 0;
  for (const State::Matrix& x : b.matrices) {
    p_size += x.n * x.r;
    q_size += x.m * x.r;
  }
  for (size_t i : b.uncompressed) rest_size += bucket.gradients[i].numel();
  const at::TensorOptions options_of = bucket.buffer.options();
  at::Tensor p_flat = at::empty({p_size}, options_of);
  at::Tensor q_flat = at::empty({q_size}, options_of);
  at::Tensor rest = at::empty({rest_size}, options_of);
  std::vector<at::Tensor> ms, ps, qs;
  int64_t p_at = 0, q_at = 0;
  for (State::Matrix& x : b.matrices) {
    at::Tensor m = bucket.gradients[x.gradient].view({x.n, x.m});
    m.add_(x.error);
    at::Tensor p = p_flat.narrow(0, p_at, x.n * x.r).view({x.n, x.r});
    at::mm_out(p, m, x.q);
    ms.push_back(m);
    ps.push_back(p);
    qs.push_back(q_flat.narrow(0, q_at, x.m * x.r).view({x.m, x.r}));
    p_at += x.n * x.r;
    q_at += x.m * x.r;
  }
  int64_t rest_at = 0;
  for (size_t i : b.uncompressed) {
    const at::Tensor& g = bucket.gradients[i];
    rest.narrow(0, rest_at, g.numel()).copy_(g.reshape({-1}));
    rest_at += g.numel();
  }
  std::shared_ptr<Work> rest_work = communicator.AllReduceAsync(rest, ReduceOp::kSum, options);
  std::shared_ptr<Work> p_work = communicator.AllReduceAsync(p_flat, ReduceOp::kSum, options);

  Communicator* comm = &communicator;
  const double world = communicator.world_size();
  std::vector<at::Tensor> gradients = bucket.gradients;
  State::Bucket* state = &b;  // the hook outlives the step's handles (the bucketer owns both)
  return Then(std::move(p_work), [=]() mutable {
    at::NoGradGuard no_grad;
    // P is now the sum over ranks of M Q: orthonormalise it, then Q = M^T P.
    for (size_t k = 0; k < ps.size(); ++k) {
      ps[k].copy_(std::get<0>(at::linalg_qr(ps[k], "reduced")));
      at::mm_out(qs[k], ms[k].t(), ps[k]);
    }
    comm->AllReduce(q_flat, ReduceOp::kSum, options);
    // The sum over ranks is approximated by P Q^T; this rank keeps what its share
    // of it (1 / world) missed.
    for (size_t k = 0; k < ps.size(); ++k) {
      State::Matrix& x = state->matrices[k];
      const at::Tensor approximation = at::mm(ps[k], qs[k].t());
      at::sub_out(x.error, ms[k], approximation, 1.0 / world);
      ms[k].copy_(approximation);
      x.q.copy_(qs[k]);
    }
    rest_work->Wait();
    int64_t offset = 0;
    for (size_t i : state->uncompressed) {
      at::Tensor& g = gradients[i];
      g.copy_(rest.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  });
}

CommHookFactory MakeCommHook(const std::string& name, const PowerSgdOptions& powersgd) {
  if (name == "none") return {};
  if (name == "allreduce") return [] { return std::make_unique<AllReduceHook>(); };
  if (name == "bf16") return [] { return std::make_unique<HalfPrecisionHook>(at::kBFloat16); };
  if (name == "fp16") return [] { return std::make_unique<HalfPrecisionHook>(at::kHalf); };
  if (name == "powersgd") {
    PowerSgdHook check(powersgd);  // bad options fail here, not in the first step
    return [powersgd] { return std::make_unique<PowerSgdHook>(powersgd); };
  }
  throw InvalidArgumentError("unknown gradient communication hook '" + name +
                             "' (choose none, allreduce, bf16, fp16 or powersgd)");
}

}  // namespace lockstep
