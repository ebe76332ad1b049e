#include "lockstep/comm_hooks.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <exception>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "half_kernel.h"

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

}  // namespace

std::shared_ptr<Work> Then(std::shared_ptr<Work> first, std::function<void()> next) {
  return std::make_shared<ThenWork>(std::move(first), std::move(next));
}

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

std::shared_ptr<Work> HalfPrecisionHook::Run(Communicator& communicator, const GradientBucket& bucket,
                                             const CollectiveOptions& options) {
  at::NoGradGuard no_grad;
  const at::Tensor buffer = bucket.buffer;
  const int64_t n = buffer.numel();
  const int world = communicator.world_size();
  const internal::HalfFormat format =
      dtype_ == at::kBFloat16 ? internal::HalfFormat::kBFloat16 : internal::HalfFormat::kHalf;
  // A float32 bucket on the CPU takes the vectorised loops of half_kernel.h (the
  // same bits as libtorch's casts, in about half the time); anything else libtorch's.
  const bool kernel = buffer.device().is_cpu() && buffer.scalar_type() == at::kFloat && buffer.is_contiguous() &&
                      internal::HaveHalfKernel(format);
  // Every backend moves 16-bit floats as they are in an all-gather when they
  // are called half (some widen bfloat16 to float32 on the wire): the bits
  // travel as half and are read back as `dtype_`.
  at::Tensor compressed;
  if (kernel) {
    compressed = at::empty({n}, buffer.options().dtype(at::kHalf));
    internal::RoundToHalf(format, buffer.data_ptr<float>(), reinterpret_cast<uint16_t*>(compressed.data_ptr()), n);
  } else {
    compressed = buffer.to(dtype_).view(at::kHalf);
  }
  at::Tensor gathered = at::empty({world * n}, compressed.options());
  std::shared_ptr<Work> work = communicator.AllGatherAsync(gathered, compressed, options);
  const at::ScalarType dtype = dtype_;
  return Then(std::move(work), [buffer, gathered, compressed, dtype, format, kernel, world, n] {
    at::NoGradGuard no_grad;
    // Rank 0's values, then rank 1's, ...: the same float32 sum on every rank.
    if (kernel) {
      const auto* base = reinterpret_cast<const uint16_t*>(gathered.data_ptr());
      std::vector<const uint16_t*> parts(world);
      for (int r = 0; r < world; ++r) parts[r] = base + r * n;
      internal::SumHalves(format, parts.data(), world, buffer.data_ptr<float>(), n);
      return;
    }
    // Widened as they are added into the buffer (no temporaries).
    const at::Tensor values = gathered.view(dtype).view({world, n});
    if (buffer.scalar_type() == at::kFloat) {
      buffer.copy_(values.select(0, 0));
      for (int r = 1; r < world; ++r) buffer.add_(values.select(0, r));
    } else {
      at::Tensor sum = values.select(0, 0).to(at::kFloat);
      for (int r = 1; r < world; ++r) sum.add_(values.select(0, r));
      buffer.copy_(sum);
    }
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
