#include "lockstep/linear.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lockstep/cpu_gemm.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void CheckShapes(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (input.dim() < 1 || weight.dim() != 2 || input.size(-1) != weight.size(1) ||
      (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0)))) {
    throw InvalidArgumentError(absl::StrCat("Linear: input ", c10::str(input.sizes()), ", weight ",
                                            c10::str(weight.sizes()), " and bias ",
                                            bias.defined() ? c10::str(bias.sizes()) : std::string("none"),
                                            " do not fit ([..., in], [out, in], [out])"));
  }
}

struct FusedLinear : public torch::autograd::Function<FusedLinear> {
  // `bias` is empty (0 elements) for none: autograd needs every input defined.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight_in,
                            const at::Tensor& bias_in) {
    const at::Tensor bias = bias_in.numel() > 0 ? bias_in : at::Tensor();
    const int64_t in = weight_in.size(1), out_features = weight_in.size(0);
    const at::Tensor x = input.reshape({-1, in}).contiguous();
    const at::Tensor weight = weight_in.contiguous();
    const int64_t rows = x.size(0);
    at::Tensor out = bias.defined() ? bias.expand({rows, out_features}).contiguous()
                                    : at::empty({rows, out_features}, x.options());
    if (rows > 0) {
      CpuGemm(false, true, rows, out_features, in, 1.f, x.data_ptr<float>(), in, weight.data_ptr<float>(), in,
              bias.defined() ? 1.f : 0.f, out.data_ptr<float>(), out_features);
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.defined();
    std::vector<int64_t> shape = input.sizes().vec();
    shape.back() = out_features;
    return out.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const int64_t in = weight.size(1), out_features = weight.size(0), rows = x.size(0);
    const at::Tensor grad = grads[0].reshape({rows, out_features}).contiguous();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      grad_input = at::empty({rows, in}, x.options());
      if (rows > 0) {
        CpuGemm(false, false, rows, in, out_features, 1.f, grad.data_ptr<float>(), out_features,
                weight.data_ptr<float>(), in, 0.f, grad_input.data_ptr<float>(), in);
      }
      std::vector<int64_t> shape = grads[0].sizes().vec();
      shape.back() = in;
      grad_input = grad_input.view(shape);
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = rows > 0 ? at::empty({out_features, in}, x.options()) : at::zeros({out_features, in}, x.options());
      if (rows > 0) {
        CpuGemm(true, false, out_features, in, rows, 1.f, grad.data_ptr<float>(), out_features, x.data_ptr<float>(),
                in, 0.f, grad_weight.data_ptr<float>(), in);
      }
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = grad.sum(0);
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

bool FusedLinearApplies(const at::Tensor& input, const at::Tensor& weight) {
  return HaveCpuGemm() && input.device().is_cpu() && weight.device().is_cpu() &&
         input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat;
}

at::Tensor Linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  CheckShapes(input, weight, bias);
  if (FusedLinearApplies(input, weight) && (!bias.defined() || (bias.device().is_cpu() &&
                                                                 bias.scalar_type() == at::kFloat))) {
    return FusedLinear::apply(input, weight, bias.defined() ? bias : at::empty({0}, weight.options()));
  }
  return at::linear(input, weight, bias);
}

}  // namespace lockstep
