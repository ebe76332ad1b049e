#include "sharded_embedding_trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/optimizer.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "lockstep/errors.h"
#include "lockstep/optimizer_state_codec.h"
#include "lockstep/metrics.h"

namespace sharded_embedding {
namespace F = torch::nn::functional;

namespace {

at::Tensor PerExampleCrossEntropy(const at::Tensor& logits, const at::Tensor& targets) {
  return F::cross_entropy(logits, targets, F::CrossEntropyFuncOptions().reduction(torch::kNone));
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a - b).abs().max().item<double>();
}

}  // namespace

BagClassifierImpl::BagClassifierImpl(const at::Tensor& full_table, const lockstep::ParameterLayout& table_layout,
                                     int model_index, int64_t hidden_dim, int64_t num_classes) {
  const int64_t dim = full_table.size(1);
  if (table_layout.global_shape != std::vector<int64_t>{full_table.size(0), dim}) {
    throw lockstep::InvalidArgumentError("BagClassifier: the layout of " + table_layout.name +
                                         " is not for a table of shape [" + std::to_string(full_table.size(0)) + ", " +
                                         std::to_string(dim) + "]");
  }
  if (table_layout.sharded() && table_layout.split_dim != 1) {
    throw lockstep::InvalidArgumentError(
        "BagClassifier: the partitioning rules split the rows ('" + table_layout.axes[table_layout.split_dim] +
        "') of " + table_layout.name + " over the model axis; this model splits its columns only: map 'embed' to "
        "'model' (and 'vocab' to nothing)");
  }
  const int64_t width = table_layout.local_shape()[1];
  column_begin = table_layout.sharded() ? model_index * width : 0;
  shard = register_parameter(kTableName, full_table.slice(1, column_begin, column_begin + width).clone());
  hidden = register_module("hidden", torch::nn::Linear(dim, hidden_dim));
  output = register_module("output", torch::nn::Linear(hidden_dim, num_classes));
}

at::Tensor BagClassifierImpl::Classify(const at::Tensor& features) { return output(F::relu(hidden(features))); }

std::vector<at::Tensor> BagClassifierImpl::DenseParameters() const {
  std::vector<at::Tensor> params = hidden->parameters();
  for (const at::Tensor& p : output->parameters()) params.push_back(p);
  return params;
}

// The same model without sharding: the full table, and a deep copy of the dense
// layers taken at construction (before any update). Trained on the whole global
// batch with plain autograd.
struct UnshardedReference {
  UnshardedReference(const at::Tensor& full_table, BagClassifierImpl& model, const lockstep::OptimizerFactory& factory)
      : table(full_table.detach().clone().requires_grad_(true)),
        hidden(std::dynamic_pointer_cast<torch::nn::LinearImpl>(model.hidden->clone())),
        output(std::dynamic_pointer_cast<torch::nn::LinearImpl>(model.output->clone())) {
    std::vector<at::Tensor> params = {table};
    for (const at::Tensor& p : DenseParameters()) params.push_back(p);
    optimizer = factory(params);
  }

  std::vector<at::Tensor> DenseParameters() const {
    std::vector<at::Tensor> params = hidden->parameters();
    for (const at::Tensor& p : output->parameters()) params.push_back(p);
    return params;
  }

  // One update on the global batch; returns its loss before the update.
  double Step(const GlobalBatch& global) {
    optimizer->zero_grad();
    const at::Tensor ids = global.ids.index({global.valid});
    const at::Tensor targets = global.targets.index({global.valid});
    at::Tensor logits = output->forward(F::relu(hidden->forward(BagMean(table, ids))));
    at::Tensor loss = PerExampleCrossEntropy(logits, targets).mean();
    loss.backward();
    optimizer->step();
    return loss.item<double>();
  }

  at::Tensor table;
  std::shared_ptr<torch::nn::LinearImpl> hidden;
  std::shared_ptr<torch::nn::LinearImpl> output;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

ShardedEmbeddingTrainer::ShardedEmbeddingTrainer(lockstep::TrainState& state, lockstep::Runtime runtime,
                                                 const lockstep::DeviceMesh* mesh,
                                                 const lockstep::Partitioner* partitioner,
                                                 ShardedEmbeddingOptions options, const at::Tensor& full_table)
    : BaseTrainer(state, std::move(runtime)), options_(std::move(options)) {
  auto* classifier = dynamic_cast<BagClassifierImpl*>(state.model.get());
  if (classifier == nullptr || !state.optimizer) {
    throw lockstep::InvalidArgumentError("ShardedEmbeddingTrainer: the state needs a BagClassifier and an optimizer");
  }
  if (options_.global_batch_size < 1) throw lockstep::InvalidArgumentError("global_batch_size must be positive");
  // Metrics and eval sums are combined over every rank of the mesh, and halting
  // is agreed with them, by BaseTrainer itself.
  set_mesh(mesh, partitioner, options_.collective);
  const int64_t parts = mesh->model()->world_size();
  if (classifier->shard.size(1) * parts != classifier->hidden->options.in_features()) {
    throw lockstep::InvalidArgumentError(
        "ShardedEmbeddingTrainer: the table holds " + std::to_string(classifier->shard.size(1)) + " of " +
        std::to_string(classifier->hidden->options.in_features()) + " columns, not 1/" + std::to_string(parts) +
        " (the model axis): the partitioning rules must split 'embed' over 'model' on a model axis above 1");
  }
  const int64_t world = mesh->world()->world_size();
  const int64_t rows_per_rank = (options_.global_batch_size + world - 1) / world;
  group_ = c10::make_intrusive<ColumnShardGroup>(mesh->model(), rows_per_rank, options_.collective);
  if (options_.check) {
    if (!full_table.defined() || !options_.optimizer_factory) {
      throw lockstep::InvalidArgumentError("ShardedEmbeddingTrainer: check needs the full table and an optimizer factory");
    }
    world_group_ = c10::make_intrusive<ColumnShardGroup>(mesh->world(), rows_per_rank, options_.collective);
    reference_ = std::make_unique<UnshardedReference>(full_table, model(), options_.optimizer_factory);
  }
}

ShardedEmbeddingTrainer::~ShardedEmbeddingTrainer() = default;

BagClassifierImpl& ShardedEmbeddingTrainer::model() { return static_cast<BagClassifierImpl&>(*state().model); }

lockstep::MetricMap ShardedEmbeddingTrainer::TrainStep(const lockstep::Batch& batch) {
  BagClassifierImpl& m = model();
  m.train();
  // The model group's examples: the lookup needs their ids on every shard.
  const GlobalBatch group_batch = GatherGlobalBatch(*group_, batch.inputs, batch.targets);
  const int64_t n = batch.size();

  state().optimizer->zero_grad();
  // This rank's rows (the padding rows beyond n are dropped; their gradient is 0).
  at::Tensor features = ShardedBagMean(m.shard, group_batch.ids, group_).slice(0, 0, n);
  at::Tensor logits = m.Classify(features);
  at::Tensor losses = PerExampleCrossEntropy(logits, batch.targets);
  // The loss sum: the gradients are sums over examples until they are divided by
  // the global count, which the all-reduce below brings.
  losses.sum().backward();

  // The replicated dense layers' gradients are summed over every rank, with this
  // rank's loss sum and example count riding along.
  const at::Tensor loss_sum = losses.detach().sum().reshape({1});
  const at::Tensor correct = logits.detach().argmax(1).eq(batch.targets).sum().to(at::kFloat).reshape({1});
  std::vector<at::Tensor> dense = m.DenseParameters();
  std::vector<at::Tensor> parts;
  for (const at::Tensor& p : dense) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // no examples on this rank yet
    parts.push_back(p.grad().reshape({-1}));
  }
  parts.push_back(loss_sum);
  parts.push_back(at::full({1}, static_cast<double>(n), loss_sum.options()));
  at::Tensor flat = at::cat(parts);
  communicator()->AllReduce(flat, lockstep::ReduceOp::kSum, collective_options());
  const int64_t offset = flat.numel() - 2;
  const double global_count = flat[offset + 1].item<double>();
  if (global_count <= 0) throw lockstep::Error("TrainStep: the global batch is empty");
  // The shard's gradient covers the model group's examples (its backward gathered
  // their output gradients); the data axis's groups hold the rest.
  if (mesh()->data()->world_size() > 1) {
    mesh()->data()->AllReduce(m.shard.mutable_grad(), lockstep::ReduceOp::kSum, collective_options());
  }
  m.shard.mutable_grad().div_(global_count);
  flat.div_(global_count);
  int64_t begin = 0;
  for (const at::Tensor& p : dense) {
    p.mutable_grad().copy_(flat.slice(0, begin, begin + p.numel()).view_as(p));
    begin += p.numel();
  }
  BeforeUpdate();  // an asynchronous checkpoint may still be copying the parameters
  state().optimizer->step();
  ++state().step;

  if (reference_) {
    const GlobalBatch global = GatherGlobalBatch(*world_group_, batch.inputs, batch.targets);
    CompareWithReference(flat[offset].item<double>(), reference_->Step(global));
  }
  // This rank's values; BaseTrainer combines them over ranks, weighted by examples.
  lockstep::MetricMap metrics = {{lockstep::kNumExamples, static_cast<double>(n)}};
  if (n > 0) {
    metrics[lockstep::kLoss] = loss_sum.item<double>() / static_cast<double>(n);
    metrics[lockstep::kAccuracy] = correct.item<double>() / static_cast<double>(n);
  }
  return metrics;
}

void ShardedEmbeddingTrainer::CompareWithReference(double global_loss, double reference_loss) {
  BagClassifierImpl& m = model();
  torch::NoGradGuard no_grad;
  const int64_t width = m.shard.size(1);
  ++check_.steps;
  check_.max_loss_diff = std::max(check_.max_loss_diff, std::abs(global_loss - reference_loss));
  check_.max_table_diff = std::max(
      check_.max_table_diff, MaxAbsDiff(m.shard, reference_->table.slice(1, m.column_begin, m.column_begin + width)));
  const std::vector<at::Tensor> mine = m.DenseParameters();
  const std::vector<at::Tensor> theirs = reference_->DenseParameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    check_.max_dense_diff = std::max(check_.max_dense_diff, MaxAbsDiff(mine[i], theirs[i]));
  }
}

CheckResult ShardedEmbeddingTrainer::GlobalCheckResult() {
  at::Tensor values = at::tensor({static_cast<double>(check_.steps), check_.max_loss_diff, check_.max_table_diff,
                                  check_.max_dense_diff},
                                 at::kDouble);
  communicator()->AllReduce(values, lockstep::ReduceOp::kMax, collective_options());
  CheckResult result;
  result.steps = static_cast<int64_t>(values[0].item<double>());
  result.max_loss_diff = values[1].item<double>();
  result.max_table_diff = values[2].item<double>();
  result.max_dense_diff = values[3].item<double>();
  return result;
}

namespace {

// The reference's optimizer state goes through Lockstep's optimizer state codec
// into named custom tensors ("reference/optimizer/<parameter>/<field>"), so that
// checkpoints of equal states are equal byte for byte.
constexpr char kOptimizerPrefix[] = "reference/optimizer/";

class CustomStateWriter final : public lockstep::OptimizerStateWriter {
 public:
  explicit CustomStateWriter(lockstep::CustomState& out) : out_(out) {}
  void PutTensor(const std::string& key, const at::Tensor& value) override {
    out_.tensors[kOptimizerPrefix + key] = value.detach().clone();
  }
  void PutInt(const std::string& key, int64_t value) override {
    out_.tensors[kOptimizerPrefix + key] = at::tensor({value}, at::kLong);
  }
  void PutBytes(const std::string& key, const std::string& value) override { out_.bytes[kOptimizerPrefix + key] = value; }

 private:
  lockstep::CustomState& out_;
};

class CustomStateReader final : public lockstep::OptimizerStateReader {
 public:
  explicit CustomStateReader(const lockstep::CustomState& in) : in_(in) {}
  bool Has(const std::string& key) const override {
    return in_.tensors.count(kOptimizerPrefix + key) > 0 || in_.bytes.count(kOptimizerPrefix + key) > 0;
  }
  at::Tensor Tensor(const std::string& key, const at::Tensor& like) const override {
    at::Tensor t = Find(key);
    if (like.defined() && t.sizes() != like.sizes()) {
      throw lockstep::InvalidArgumentError("custom state " + key + " has another shape than the reference's");
    }
    return t;
  }
  int64_t Int(const std::string& key) const override { return Find(key).item<int64_t>(); }
  std::string Bytes(const std::string& key) const override {
    auto it = in_.bytes.find(kOptimizerPrefix + key);
    if (it == in_.bytes.end()) throw lockstep::InvalidArgumentError("the checkpoint has no custom bytes " + key);
    return it->second;
  }

 private:
  at::Tensor Find(const std::string& key) const {
    auto it = in_.tensors.find(kOptimizerPrefix + key);
    if (it == in_.tensors.end()) throw lockstep::InvalidArgumentError("the checkpoint has no custom tensor " + key);
    return it->second;
  }
  const lockstep::CustomState& in_;
};

lockstep::NamedParameters ReferenceParameters(const UnshardedReference& reference) {
  lockstep::NamedParameters named = {{"table", reference.table}};
  const std::vector<at::Tensor> dense = reference.DenseParameters();
  for (size_t i = 0; i < dense.size(); ++i) named.emplace_back("dense" + std::to_string(i), dense[i]);
  return named;
}

}  // namespace

lockstep::CustomState ShardedEmbeddingTrainer::SaveCustomState() {
  lockstep::CustomState out;
  if (!reference_) return out;
  // The differences so far, as text (hex floats are exact).
  out.bytes["check"] = absl::StrFormat("%d %a %a %a", check_.steps, check_.max_loss_diff, check_.max_table_diff,
                                       check_.max_dense_diff);
  for (const auto& [name, p] : ReferenceParameters(*reference_)) out.tensors["reference/" + name] = p.detach().clone();
  CustomStateWriter writer(out);
  lockstep::FindOptimizerStateCodec(*reference_->optimizer)
      ->Save(*reference_->optimizer, ReferenceParameters(*reference_), writer);
  return out;
}

void ShardedEmbeddingTrainer::RestoreCustomState(const lockstep::CustomState& state) {
  auto check = state.bytes.find("check");
  if ((check != state.bytes.end()) != (reference_ != nullptr)) {
    throw lockstep::InvalidArgumentError(std::string("the checkpoint was saved ") +
                                         (reference_ ? "without" : "with") + " --check and this run is " +
                                         (reference_ ? "with" : "without") + " it");
  }
  if (!reference_) return;
  if (std::sscanf(check->second.c_str(), "%" SCNd64 " %la %la %la", &check_.steps, &check_.max_loss_diff,
                  &check_.max_table_diff, &check_.max_dense_diff) != 4) {
    throw lockstep::InvalidArgumentError("the checkpoint's check state is malformed: '" + check->second + "'");
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : ReferenceParameters(*reference_)) {
    auto it = state.tensors.find("reference/" + name);
    if (it == state.tensors.end() || it->second.sizes() != p.sizes()) {
      throw lockstep::InvalidArgumentError("the checkpoint has no reference " + name + " of the reference's shape");
    }
    p.copy_(it->second);
  }
  CustomStateReader reader(state);
  lockstep::FindOptimizerStateCodec(*reference_->optimizer)
      ->Restore(*reference_->optimizer, ReferenceParameters(*reference_), reader);
}

lockstep::MetricSums ShardedEmbeddingTrainer::EvalStep(const lockstep::Batch& batch) {
  BagClassifierImpl& m = model();
  m.eval();
  torch::NoGradGuard no_grad;
  // Every rank of the model group takes part in the lookup, also one whose slice
  // of this batch is empty.
  const GlobalBatch group_batch = GatherGlobalBatch(*group_, batch.inputs, batch.targets);
  const int64_t n = batch.size();
  at::Tensor logits = m.Classify(ShardedBagMean(m.shard, group_batch.ids, group_).slice(0, 0, n));
  lockstep::MetricSums sums;
  sums.weight = static_cast<double>(n);
  if (n > 0) {
    sums.sums[lockstep::kLoss] = PerExampleCrossEntropy(logits, batch.targets).sum().item<double>();
    sums.sums[lockstep::kAccuracy] = logits.argmax(1).eq(batch.targets).sum().item<double>();
  }
  return sums;
}

}  // namespace sharded_embedding
