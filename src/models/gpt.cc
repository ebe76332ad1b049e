#include "lockstep/gpt.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "lockstep/attention.h"
#include "lockstep/communicator.h"
#include "lockstep/errors.h"
#include "lockstep/linear.h"
#include "lockstep/tensor_parallel.h"
#include "lockstep/torch_setup.h"

namespace lockstep {
namespace {

torch::nn::LayerNorm MakeLayerNorm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5));
}

void InitLinear(torch::nn::Linear& linear, double std) {
  at::NoGradGuard no_grad;
  torch::nn::init::normal_(linear->weight, 0.0, std);
  if (linear->bias.defined()) linear->bias.zero_();
}

}  // namespace

void CheckGptOptions(const GptOptions& o) {
  auto require = [](bool ok, const char* field, const std::string& what) {
    if (!ok) throw InvalidArgumentError(absl::StrCat("model 'gpt': ", field, " ", what));
  };
  require(o.vocab_size > 0, "vocab_size", absl::StrCat("must be > 0, got ", o.vocab_size));
  require(o.context_length > 0, "context_length", absl::StrCat("must be > 0, got ", o.context_length));
  require(o.num_layers > 0, "num_layers", absl::StrCat("must be > 0, got ", o.num_layers));
  require(o.num_heads > 0, "num_heads", absl::StrCat("must be > 0, got ", o.num_heads));
  require(o.width > 0, "width", absl::StrCat("must be > 0, got ", o.width));
  require(o.width % o.num_heads == 0, "num_heads",
          absl::StrCat("(", o.num_heads, ") must divide width (", o.width, ")"));
  require(o.dropout >= 0 && o.dropout < 1, "dropout", absl::StrCat("must be in [0, 1), got ", o.dropout));
}

double CountGptParameters(const GptOptions& o) {
  const double w = static_cast<double>(o.width);
  const double per_block = 2 * (2 * w)           // two LayerNorms
                           + (w * 3 * w + 3 * w)  // qkv
                           + (w * w + w)          // attention projection
                           + (w * 4 * w + 4 * w)  // mlp up
                           + (4 * w * w + w);     // mlp down
  return static_cast<double>(o.vocab_size) * w + static_cast<double>(o.context_length) * w +
         static_cast<double>(o.num_layers) * per_block + 2 * w;
}

double GptTrainingFlopsPerToken(const GptOptions& o, int64_t sequence_length) {
  const double n = CountGptParameters(o) - static_cast<double>(o.context_length) * static_cast<double>(o.width);
  return 6 * n + 12.0 * static_cast<double>(o.num_layers) * static_cast<double>(o.width) *
                     static_cast<double>(sequence_length);
}

GptBlockImpl::GptBlockImpl(const GptOptions& o, const GptParallelism& parallel)
    : num_heads_(o.num_heads), dropout_(o.dropout) {
  if (parallel.Splits("heads")) {
    heads_axis_ = parallel.model;
    num_heads_ = o.num_heads / parallel.model->world_size();
  }
  if (parallel.Splits("mlp")) mlp_axis_ = parallel.model;
  ln1_ = register_module("ln1", MakeLayerNorm(o.width));
  qkv_ = register_module("qkv", torch::nn::Linear(o.width, 3 * o.width));
  attn_proj_ = register_module("attn_proj", torch::nn::Linear(o.width, o.width));
  ln2_ = register_module("ln2", MakeLayerNorm(o.width));
  mlp_up_ = register_module("mlp_up", torch::nn::Linear(o.width, 4 * o.width));
  mlp_down_ = register_module("mlp_down", torch::nn::Linear(4 * o.width, o.width));
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(o.num_layers));
  InitLinear(qkv_, 0.02);
  InitLinear(attn_proj_, residual_std);
  InitLinear(mlp_up_, 0.02);
  InitLinear(mlp_down_, residual_std);
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  // num_heads_: all heads, or num_heads / M when the model axis splits them.
  const bool train = is_training() && dropout_ > 0;
  // Without a model axis the parallel linears are plain linears: Linear (linear.h).
  auto column = [](const at::Tensor& in, const torch::nn::Linear& l, Communicator* axis) {
    return axis != nullptr ? ColumnParallelLinear(in, l->weight, l->bias, axis) : Linear(in, l->weight, l->bias);
  };
  auto row = [](const at::Tensor& in, const torch::nn::Linear& l, Communicator* axis) {
    return axis != nullptr ? RowParallelLinear(in, l->weight, l->bias, axis) : Linear(in, l->weight, l->bias);
  };
  // Attention on the fused [B, T, 3W] projection (attention.h). Dropout on the
  // attention weights takes the ATen composite.
  const at::Tensor qkv = column(ln1_->forward(x), qkv_, heads_axis_);
  const at::Tensor attended =
      train ? CausalSelfAttentionComposite(qkv, num_heads_, dropout_, train) : CausalSelfAttention(qkv, num_heads_);
  at::Tensor h = x + at::dropout(row(attended, attn_proj_, heads_axis_), dropout_, train);
  const at::Tensor up = at::gelu(column(ln2_->forward(h), mlp_up_, mlp_axis_));
  return h + at::dropout(row(up, mlp_down_, mlp_axis_), dropout_, train);
}

LogicalAxes GptLogicalAxes(const std::string& name, int* blocks) {
  if (blocks != nullptr) *blocks = 1;
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "wte.weight") return {"vocab", "embed"};
  if (name == "wpe.weight") return {"length", "embed"};
  if (name.rfind("ln_f.", 0) == 0) return {"embed"};
  if (name.rfind("blocks.", 0) == 0) {
    if (ends_with("qkv.weight") || ends_with("qkv.bias")) {
      if (blocks != nullptr) *blocks = 3;
      return ends_with(".weight") ? LogicalAxes{"heads", "embed"} : LogicalAxes{"heads"};
    }
    if (ends_with("attn_proj.weight")) return {"embed", "heads"};
    if (ends_with("mlp_up.weight")) return {"mlp", "embed"};
    if (ends_with("mlp_up.bias")) return {"mlp"};
    if (ends_with("mlp_down.weight")) return {"embed", "mlp"};
    if (ends_with(".bias") || ends_with("ln1.weight") || ends_with("ln2.weight")) return {"embed"};
  }
  throw InvalidArgumentError("gpt: no parameter named '" + name + "'");
}

std::vector<ParameterLayout> GptParameterLayouts(const GptOptions& o, const Partitioner& partitioner) {
  CheckGptOptions(o);
  const int parts = partitioner.shape().model;
  if (partitioner.Splits("heads") && o.num_heads % parts != 0) {
    throw InvalidArgumentError(absl::StrCat("parameter 'blocks.0.qkv.weight': ", o.num_heads,
                                            " heads do not divide over the model axis of ", parts, " ranks"));
  }
  const int64_t w = o.width;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"wte.weight", {o.vocab_size, w}},
                                                                      {"wpe.weight", {o.context_length, w}}};
  for (int64_t i = 0; i < o.num_layers; ++i) {
    const std::string b = absl::StrCat("blocks.", i, ".");
    for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"ln1.weight", {w}}, {"ln1.bias", {w}}, {"qkv.weight", {3 * w, w}}, {"qkv.bias", {3 * w}},
             {"attn_proj.weight", {w, w}}, {"attn_proj.bias", {w}}, {"ln2.weight", {w}}, {"ln2.bias", {w}},
             {"mlp_up.weight", {4 * w, w}}, {"mlp_up.bias", {4 * w}}, {"mlp_down.weight", {w, 4 * w}},
             {"mlp_down.bias", {w}}}) {
      shapes.emplace_back(b + name, shape);
    }
  }
  shapes.emplace_back("ln_f.weight", std::vector<int64_t>{w});
  shapes.emplace_back("ln_f.bias", std::vector<int64_t>{w});
  std::vector<ParameterLayout> layouts;
  for (const auto& [name, shape] : shapes) {
    int blocks = 1;
    const LogicalAxes axes = GptLogicalAxes(name, &blocks);
    layouts.push_back(partitioner.Layout(name, shape, axes, /*element_size=*/4, blocks));
  }
  return layouts;
}

GptImpl::GptImpl(const GptOptions& o, const GptParallelism& parallel) : options_(o) {
  CheckGptOptions(o);
  if (parallel.model != nullptr && parallel.partitioner != nullptr &&
      parallel.partitioner->shape().model != parallel.model->world_size()) {
    throw InvalidArgumentError(absl::StrCat("gpt: the partitioner's mesh has a model axis of ",
                                            parallel.partitioner->shape().model, ", the model-axis communicator ",
                                            parallel.model->world_size(), " rank(s)"));
  }
  const bool split = parallel.Splits("heads") || parallel.Splits("mlp") || parallel.Splits("vocab");
  if (split && o.dropout > 0) {
    throw InvalidArgumentError(absl::StrCat("model 'gpt': dropout (", o.dropout,
                                            ") with tensor parallelism is not supported; set dropout to 0"));
  }
  // Checked before any parameter is made, so a layout error names its parameter.
  if (parallel.partitioner != nullptr) layouts_ = GptParameterLayouts(o, *parallel.partitioner);
  wte_ = register_module("wte", torch::nn::Embedding(o.vocab_size, o.width));
  wpe_ = register_module("wpe", torch::nn::Embedding(o.context_length, o.width));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) blocks_->push_back(GptBlock(o, parallel));
  ln_f_ = register_module("ln_f", MakeLayerNorm(o.width));
  at::NoGradGuard no_grad;
  torch::nn::init::normal_(wte_->weight, 0.0, 0.02);
  torch::nn::init::normal_(wpe_->weight, 0.0, 0.02);
  if (layouts_.empty()) {
    layouts_ = GptParameterLayouts(o, Partitioner({}, MeshShape{}));
    return;
  }
  // Keep this rank's shards of the parameters drawn in full above.
  for (auto& item : named_parameters()) {
    const ParameterLayout* layout = nullptr;
    for (const ParameterLayout& l : layouts_) {
      if (l.name == item.key()) layout = &l;
    }
    if (layout == nullptr) throw Error("gpt: no layout for parameter '" + item.key() + "'");
    if (layout->sharded() && parallel.model != nullptr) {
      item.value().set_data(ShardOf(item.value(), *layout, parallel.model_index));
    }
  }
  if (parallel.Splits("vocab")) {
    vocab_axis_ = parallel.model;
    vocab_begin_ = o.vocab_size / parallel.model->world_size() * parallel.model_index;
  }
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  if (tokens.dim() != 2 || tokens.scalar_type() != at::kLong) {
    throw InvalidArgumentError(absl::StrCat("gpt: tokens must be int64 [batch, length], got ",
                                            c10::toString(tokens.scalar_type()), " ", c10::str(tokens.sizes())));
  }
  const int64_t length = tokens.size(1);
  if (length > options_.context_length) {
    throw InvalidArgumentError(absl::StrCat("gpt: a sequence of ", length, " tokens is longer than the model's context_length (",
                                            options_.context_length, ")"));
  }
  const bool train = is_training() && options_.dropout > 0;
  at::Tensor x = VocabParallelEmbedding(tokens, wte_->weight, vocab_begin_, vocab_axis_) +
                 wpe_->forward(at::arange(length, tokens.options()));
  x = at::dropout(x, options_.dropout, train);
  for (const auto& block : *blocks_) x = block->as<GptBlockImpl>()->forward(x);
  // The head is tied to the embedding: with a split vocabulary, this rank's columns.
  return Linear(CopyToModelParallel(ln_f_->forward(x), vocab_axis_), wte_->weight);
}

BuiltModel BuildGpt(const GptOptions& options, const GptParallelism& parallel) {
  auto gpt = std::make_shared<GptImpl>(options, parallel);
  return {gpt, [](torch::nn::Module& m, const at::Tensor& x) { return static_cast<GptImpl&>(m).forward(x); }};
}

DeriveMetricsFn LanguageModelMetrics(const GptOptions& options, int64_t sequence_length, int world_size,
                                     double peak_flops_per_rank) {
  const double flops_per_token = GptTrainingFlopsPerToken(options, sequence_length);
  return [=](const std::string& task, MetricMap& metrics) {
    if (auto loss = metrics.find(kLoss); loss != metrics.end()) metrics["bits_per_byte"] = loss->second / std::log(2.0);
    if (task != "train") return;
    auto examples = metrics.find(kExamplesPerSecond);
    if (examples == metrics.end()) return;
    const double tokens = examples->second * static_cast<double>(sequence_length);
    metrics["tokens_per_second"] = tokens;
    metrics["tokens_per_second_per_rank"] = tokens / world_size;
    if (peak_flops_per_rank > 0) metrics["mfu"] = flops_per_token * tokens / (peak_flops_per_rank * world_size);
  };
}

double AddLanguageModelMetrics(BaseTrainer& trainer, const GptOptions& options, int64_t sequence_length,
                               const std::string& device) {
  Communicator* communicator = trainer.communicator();
  const double peak = MeasureAgreedMatmulFlops(communicator, device);
  const int world_size = communicator != nullptr ? communicator->world_size() : 1;
  trainer.AddDerivedMetrics(LanguageModelMetrics(options, sequence_length, world_size, peak));
  return peak;
}

LossFn LanguageModelLoss(Communicator* vocab_axis, int64_t vocab_begin) {
  return [vocab_axis, vocab_begin](const at::Tensor& outputs, const at::Tensor& targets) {
    if (outputs.dim() != 3 || targets.dim() != 2 || outputs.size(0) != targets.size(0) ||
        outputs.size(1) != targets.size(1)) {
      throw InvalidArgumentError(absl::StrCat("LanguageModelLoss: logits ", c10::str(outputs.sizes()),
                                              " do not match targets ", c10::str(targets.sizes())));
    }
    const int64_t batch = outputs.size(0), length = outputs.size(1);
    const at::Tensor per_token = VocabParallelCrossEntropy(outputs.reshape({batch * length, outputs.size(2)}),
                                                           targets.reshape({batch * length}), vocab_begin, vocab_axis);
    return per_token.view({batch, length}).mean(1);
  };
}

}  // namespace lockstep
