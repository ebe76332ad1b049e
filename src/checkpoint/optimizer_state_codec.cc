#include "lockstep/optimizer_state_codec.h"

#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "lockstep/errors.h"
#include "lockstep/sgd.h"
#include "lockstep/train_state.h"

namespace lockstep {
namespace {

// SGD: "<name>/momentum_buffer" for each parameter that has momentum state.
class SgdCodec final : public OptimizerStateCodec {
 public:
  std::string name() const override { return "SGD"; }
  void Save(const torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
            OptimizerStateWriter& out) const override {
    for (const auto& [name, p] : parameters) {
      auto it = optimizer.state().find(OptimizerStateKey(p));
      if (it == optimizer.state().end()) continue;  // no step taken yet
      const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined()) out.PutTensor(name + "/momentum_buffer", s.momentum_buffer());
    }
  }
  void Restore(torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
               const OptimizerStateReader& in) const override {
    optimizer.state().clear();
    for (const auto& [name, p] : parameters) {
      if (!in.Has(name + "/momentum_buffer")) continue;
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(in.Tensor(name + "/momentum_buffer", p));
      optimizer.state()[OptimizerStateKey(p)] = std::move(s);
    }
  }
};

// Adam and AdamW (their param states have the same fields):
// "<name>/{step,exp_avg,exp_avg_sq,max_exp_avg_sq}".
template <typename ParamState>
class AdamCodec final : public OptimizerStateCodec {
 public:
  explicit AdamCodec(std::string name) : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  void Save(const torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
            OptimizerStateWriter& out) const override {
    for (const auto& [name, p] : parameters) {
      auto it = optimizer.state().find(OptimizerStateKey(p));
      if (it == optimizer.state().end()) continue;
      const auto& s = static_cast<const ParamState&>(*it->second);
      out.PutInt(name + "/step", s.step());
      out.PutTensor(name + "/exp_avg", s.exp_avg());
      out.PutTensor(name + "/exp_avg_sq", s.exp_avg_sq());
      if (s.max_exp_avg_sq().defined()) out.PutTensor(name + "/max_exp_avg_sq", s.max_exp_avg_sq());
    }
  }
  void Restore(torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
               const OptimizerStateReader& in) const override {
    optimizer.state().clear();
    for (const auto& [name, p] : parameters) {
      if (!in.Has(name + "/step")) continue;
      auto s = std::make_unique<ParamState>();
      s->step(in.Int(name + "/step"));
      s->exp_avg(in.Tensor(name + "/exp_avg", p));
      s->exp_avg_sq(in.Tensor(name + "/exp_avg_sq", p));
      if (in.Has(name + "/max_exp_avg_sq")) s->max_exp_avg_sq(in.Tensor(name + "/max_exp_avg_sq", p));
      optimizer.state()[OptimizerStateKey(p)] = std::move(s);
    }
  }

 private:
  const std::string name_;
};

// Any other optimizer: its own serialize archive, as bytes under "archive".
// libtorch's archives key parameter state by position in the param groups, so a
// restore into an optimizer built the same way finds its state.
class ArchiveCodec final : public OptimizerStateCodec {
 public:
  std::string name() const override { return "libtorch archive"; }
  void Save(const torch::optim::Optimizer& optimizer, const NamedParameters&, OptimizerStateWriter& out) const override {
    out.PutBytes("archive", Serialize(optimizer));
  }
  void Restore(torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
               const OptimizerStateReader& in) const override {
    std::istringstream stream(in.Bytes("archive"));
    torch::serialize::InputArchive archive;
    const c10::optional<c10::Device> device =
        parameters.empty() ? c10::nullopt : c10::optional<c10::Device>(parameters.front().second.device());
    archive.load_from(stream, device);
    optimizer.load(archive);
  }
  static std::string Serialize(const torch::optim::Optimizer& optimizer) {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream stream;
    archive.save_to(stream);
    return stream.str();
  }
  // Whether save() writes anything: torch::optim::Optimizer's own save() is empty,
  // so a subclass that does not override it would lose its state silently.
  static bool Writes(const torch::optim::Optimizer& optimizer) {
    std::istringstream stream(Serialize(optimizer));
    torch::serialize::InputArchive archive;
    archive.load_from(stream);
    return !archive.keys().empty();
  }
};

struct Registry {
  std::mutex mu;
  std::map<std::type_index, std::shared_ptr<const OptimizerStateCodec>> codecs;  // guarded by mu

  Registry() {
    auto sgd = std::make_shared<SgdCodec>();
    codecs.emplace(typeid(torch::optim::SGD), sgd);
    codecs.emplace(typeid(BlockedSgd), sgd);  // a torch::optim::SGD with the same state
    codecs.emplace(typeid(torch::optim::Adam), std::make_shared<AdamCodec<torch::optim::AdamParamState>>("Adam"));
    codecs.emplace(typeid(torch::optim::AdamW), std::make_shared<AdamCodec<torch::optim::AdamWParamState>>("AdamW"));
  }
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: codecs may be used at exit
  return *registry;
}

}  // namespace

void RegisterOptimizerStateCodec(std::type_index type, std::shared_ptr<const OptimizerStateCodec> codec) {
  if (!codec) throw InvalidArgumentError("RegisterOptimizerStateCodec: null codec");
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.codecs[type] = std::move(codec);
}

std::string OptimizerTypeName(const torch::optim::Optimizer& optimizer) { return c10::demangle(typeid(optimizer).name()); }

std::shared_ptr<const OptimizerStateCodec> FindOptimizerStateCodec(const torch::optim::Optimizer& optimizer) {
  {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mu);
    auto it = registry.codecs.find(typeid(optimizer));
    if (it != registry.codecs.end()) return it->second;
  }
  bool writes = false;
  std::string why = "its save() writes nothing";
  try {
    writes = ArchiveCodec::Writes(optimizer);
  } catch (const std::exception& e) {
    why = std::string("its save() fails: ") + e.what();
  }
  if (!writes) {
    throw InvalidArgumentError("optimizer " + OptimizerTypeName(optimizer) + " cannot be saved in checkpoints: " + why +
                               "; override save()/load() or register an OptimizerStateCodec for it "
                               "(lockstep/optimizer_state_codec.h)");
  }
  static const auto archive = std::make_shared<ArchiveCodec>();
  return archive;
}

NamedParameters OptimizerParameters(const TrainState& state) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : state.model->named_parameters()) names[item.value().unsafeGetTensorImpl()] = item.key();
  NamedParameters out;
  for (const auto& group : state.optimizer->param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto name = names.find(p.unsafeGetTensorImpl());
      if (name == names.end()) throw InvalidArgumentError("the optimizer holds a parameter the model does not");
      out.emplace_back(name->second, p);
    }
  }
  return out;
}

}  // namespace lockstep
