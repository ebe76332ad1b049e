#include "lockstep/sgd.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "lockstep/errors.h"
#include "lockstep/train_state.h"
#include "sgd_kernel.h"

namespace lockstep {
namespace {

struct Hyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

// One block (or a whole tensor): the update of torch::optim::SGD::step, with the
// momentum multiply-add fused when dampening is 0. `first`: the buffer was just
// made and takes the (weight-decayed) gradient, as libtorch's clone does.
void Update(at::Tensor p, const at::Tensor& grad, at::Tensor buf, bool first, const Hyper& h) {
  at::Tensor d = h.weight_decay != 0 ? grad.add(p, h.weight_decay) : grad;
  if (h.momentum != 0) {
    if (first) {
      buf.copy_(d);
    } else if (h.dampening == 0) {
      at::add_out(buf, d, buf, h.momentum);  // d + momentum * buf
    } else {
      buf.mul_(h.momentum).add_(d, 1 - h.dampening);
    }
    d = h.nesterov ? d.add(buf, h.momentum) : buf;
  }
  p.add_(d, -h.lr);
}

}  // namespace

BlockedSgd::BlockedSgd(std::vector<torch::Tensor> params, torch::optim::SGDOptions options, int64_t block_elements)
    : torch::optim::SGD(std::move(params), options), block_elements_(block_elements) {
  if (block_elements < 1) {
    throw InvalidArgumentError("BlockedSgd: block_elements must be >= 1, got " + std::to_string(block_elements));
  }
}

torch::Tensor BlockedSgd::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  Squares squares;
  squares.complete = true;
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    const Hyper h{options.lr(), options.momentum(), options.dampening(), options.weight_decay(), options.nesterov()};
    for (const at::Tensor& param : group.params()) {
      if (!param.grad().defined()) continue;
      at::Tensor p = param.detach();  // the same storage, outside autograd
      const at::Tensor grad = param.grad().detach();
      at::Tensor buf;
      bool first = false;
      if (h.momentum != 0) {
        auto& states = state();
        const auto key = OptimizerStateKey(param);
        auto it = states.find(key);
        if (it == states.end()) {
          first = true;
          buf = at::empty_like(grad, at::MemoryFormat::Contiguous);
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(buf);
          states[key] = std::move(s);
        } else {
          buf = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
        }
      }
      ++squares.tensors;
      squares.elements += p.numel();
      const auto one_pass = [](const at::Tensor& t) {
        return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && !t.is_sparse();
      };
      if (one_pass(p) && one_pass(grad) && (h.momentum == 0 || (h.dampening == 0 && one_pass(buf)))) {
        internal::SgdKernelArgs args;
        args.weights = p.data_ptr<float>();
        args.gradient = grad.data_ptr<float>();
        args.momentum_buffer = h.momentum != 0 ? buf.data_ptr<float>() : nullptr;
        args.size = p.numel();
        args.learning_rate = static_cast<float>(h.lr);
        args.momentum = static_cast<float>(h.momentum);
        args.weight_decay = static_cast<float>(h.weight_decay);
        args.nesterov = h.nesterov;
        args.first = first;
        const internal::SgdKernelSquares s = internal::FusedSgdUpdate(args);
        squares.gradients += s.gradient;
        squares.weights += s.weights;
        continue;
      }
      squares.complete = false;
      const bool blocked = p.is_contiguous() && grad.is_contiguous() && (!buf.defined() || buf.is_contiguous()) &&
                           p.numel() > block_elements_;
      if (!blocked) {
        Update(p, grad, buf, first, h);
        continue;
      }
      const at::Tensor p_flat = p.view(-1);
      const at::Tensor g_flat = grad.view(-1);
      const at::Tensor b_flat = buf.defined() ? buf.view(-1) : at::Tensor();
      const int64_t n = p_flat.numel();
      for (int64_t offset = 0; offset < n; offset += block_elements_) {
        const int64_t length = std::min(block_elements_, n - offset);
        Update(p_flat.narrow(0, offset, length), g_flat.narrow(0, offset, length),
               b_flat.defined() ? b_flat.narrow(0, offset, length) : at::Tensor(), first, h);
      }
    }
  }
  last_step_squares_ = squares;
  return loss;
}

}  // namespace lockstep
