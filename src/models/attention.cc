#include "lockstep/attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lockstep/cpu_gemm.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

struct Shape {
  int64_t batch, length, width, heads, head;
};

Shape CheckedShape(const at::Tensor& qkv, int64_t num_heads) {
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0) {
    throw InvalidArgumentError(absl::StrCat("CausalSelfAttention: qkv must be [batch, length, 3 width], got ",
                                            c10::str(qkv.sizes())));
  }
  const int64_t width = qkv.size(2) / 3;
  if (num_heads <= 0 || width % num_heads != 0) {
    throw InvalidArgumentError(
        absl::StrCat("CausalSelfAttention: ", num_heads, " heads do not divide the width ", width));
  }
  return {qkv.size(0), qkv.size(1), width, num_heads, width / num_heads};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Runs fn(example, head) for every pair, split over ATen's intra-op threads; each
// pair touches its own rows and columns only.
template <typename Fn>
void ForEachHead(const Shape& s, const Fn& fn) {
  at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i / s.heads, i % s.heads);
  });
}

struct FusedCausalAttention : public torch::autograd::Function<FusedCausalAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv_in, int64_t num_heads) {
    const at::Tensor qkv = qkv_in.contiguous();
    const Shape s = CheckedShape(qkv, num_heads);
    const int64_t t = s.length, row = 3 * s.width;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head)));
    const float* base = qkv.data_ptr<float>();
    // Scores, with the future masked: -inf above the diagonal, which softmax turns to 0.
    at::Tensor scores = at::empty({s.batch, s.heads, t, t}, qkv.options());
    float* scores_data = scores.data_ptr<float>();
    ForEachHead(s, [&](int64_t b, int64_t h) {
      const float* q = base + b * t * row + h * s.head;
      float* out = scores_data + (b * s.heads + h) * t * t;
      CpuGemm(false, true, t, t, s.head, scale, q, row, q + s.width, row, 0.f, out, t);
      for (int64_t i = 0; i < t; ++i) {
        std::fill(out + i * t + i + 1, out + (i + 1) * t, -std::numeric_limits<float>::infinity());
      }
    });
    const at::Tensor weights = at::_softmax(scores, -1, false);
    scores.reset();
    at::Tensor out = at::empty({s.batch, t, s.width}, qkv.options());
    const float* weights_data = weights.data_ptr<float>();
    float* out_data = out.data_ptr<float>();
    ForEachHead(s, [&](int64_t b, int64_t h) {
      const float* v = base + b * t * row + 2 * s.width + h * s.head;
      CpuGemm(false, false, t, s.head, t, 1.f, weights_data + (b * s.heads + h) * t * t, t, v, row, 0.f,
              out_data + b * t * s.width + h * s.head, s.width);
    });
    ctx->save_for_backward({qkv, weights});
    ctx->saved_data["heads"] = num_heads;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const at::Tensor& qkv = saved[0];
    const at::Tensor& weights = saved[1];
    const Shape s = CheckedShape(qkv, ctx->saved_data["heads"].toInt());
    const int64_t t = s.length, row = 3 * s.width;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head)));
    const at::Tensor grad_out = grads[0].contiguous();
    const float* base = qkv.data_ptr<float>();
    const float* weights_data = weights.data_ptr<float>();
    const float* grad_out_data = grad_out.data_ptr<float>();
    at::Tensor grad_qkv = at::empty_like(qkv);
    float* grad_base = grad_qkv.data_ptr<float>();
    // dV = P^T dO and dP = dO V^T per head.
    at::Tensor grad_weights = at::empty_like(weights);
    float* grad_weights_data = grad_weights.data_ptr<float>();
    ForEachHead(s, [&](int64_t b, int64_t h) {
      const int64_t offset = b * t * row + 2 * s.width + h * s.head;
      const float* p = weights_data + (b * s.heads + h) * t * t;
      const float* dout = grad_out_data + b * t * s.width + h * s.head;
      CpuGemm(true, false, t, s.head, t, 1.f, p, t, dout, s.width, 0.f, grad_base + offset, row);
      CpuGemm(false, true, t, t, s.head, 1.f, dout, s.width, base + offset, row, 0.f,
              grad_weights_data + (b * s.heads + h) * t * t, t);
    });
    // dS = P * (dP - rowsum(dP * P)); zero where P is (the masked future).
    const at::Tensor grad_scores = at::_softmax_backward_data(grad_weights, weights, -1, at::kFloat);
    grad_weights.reset();
    const float* grad_scores_data = grad_scores.data_ptr<float>();
    // dQ = scale dS K and dK = scale dS^T Q per head.
    ForEachHead(s, [&](int64_t b, int64_t h) {
      const int64_t offset = b * t * row + h * s.head;
      const float* ds = grad_scores_data + (b * s.heads + h) * t * t;
      CpuGemm(false, false, t, s.head, t, scale, ds, t, base + offset + s.width, row, 0.f, grad_base + offset, row);
      CpuGemm(true, false, t, s.head, t, scale, ds, t, base + offset, row, 0.f, grad_base + offset + s.width, row);
    });
    return {grad_qkv, at::Tensor()};
  }
};

}  // namespace

bool FusedCausalSelfAttentionApplies(const at::Tensor& qkv) {
  return HaveCpuGemm() && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3;
}

at::Tensor CausalSelfAttention(const at::Tensor& qkv, int64_t num_heads) {
  // Both paths check the shape and name what does not fit.
  if (FusedCausalSelfAttentionApplies(qkv)) return FusedCausalAttention::apply(qkv, num_heads);
  return CausalSelfAttentionComposite(qkv, num_heads);
}

at::Tensor CausalSelfAttentionComposite(const at::Tensor& qkv, int64_t num_heads, double dropout, bool train) {
  const Shape s = CheckedShape(qkv, num_heads);
  const std::vector<at::Tensor> parts = qkv.split(s.width, 2);
  auto heads = [&](const at::Tensor& x) { return x.view({s.batch, s.length, s.heads, s.head}).transpose(1, 2); };
  const at::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(s.head)));
  const at::Tensor future = at::ones({s.length, s.length}, qkv.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  const at::Tensor weights = at::dropout(at::softmax(scores, -1), dropout, train && dropout > 0);
  return at::matmul(weights, v).transpose(1, 2).contiguous().view({s.batch, s.length, s.width});
}

}  // namespace lockstep
