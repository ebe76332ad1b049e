// OptimizerStateCodec: how an optimizer's state goes into a checkpoint shard and
// comes back, chosen by the optimizer's type from a registry instead of a chain of
// casts in the checkpoint code.
//
//   - torch::optim::SGD (and BlockedSgd), Adam and AdamW have built-in codecs that
//     write one named tensor per parameter and field, readable by torch.load:
//     "optimizer/<parameter name>/momentum_buffer"; ".../exp_avg", ".../exp_avg_sq",
//     ".../max_exp_avg_sq", ".../step" (Adam, AdamW).
//   - Any other libtorch optimizer goes through its own serialize archive
//     (Optimizer::save / load), kept in the shard as "optimizer/archive" bytes.
//     Restoring it is exact, but the bytes name parameters by their addresses in
//     the saving process, so equal states need not give equal bytes: register a
//     codec where checkpoints are compared byte for byte.
//   - RegisterOptimizerStateCodec adds a codec for a type of your own.
//
// FindOptimizerStateCodec is asked at start-up (the job layer does), so an
// optimizer that cannot be saved is refused before the first step, with its type
// named, never at the first save.
//
// The registry is process-wide on purpose: codecs describe types, like libtorch's
// own operator registry, and hold no job state. It is thread-safe.
#ifndef LOCKSTEP_OPTIMIZER_STATE_CODEC_H_
#define LOCKSTEP_OPTIMIZER_STATE_CODEC_H_

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

namespace lockstep {

// The optimizer's parameters, in param-group order, with their names in the model.
using NamedParameters = std::vector<std::pair<std::string, at::Tensor>>;

// Where a codec's values go. Keys are relative to "optimizer/".
class OptimizerStateWriter {
 public:
  virtual ~OptimizerStateWriter() = default;
  // The tensor may be copied later (an asynchronous checkpoint copies it before the
  // next update), so pass the optimizer's own tensor, not a temporary view of it.
  virtual void PutTensor(const std::string& key, const at::Tensor& value) = 0;
  virtual void PutInt(const std::string& key, int64_t value) = 0;
  virtual void PutBytes(const std::string& key, const std::string& value) = 0;
};

// Where a codec reads them back. Errors: CheckpointError naming the shard file and
// the key when it is missing or, for a tensor, of another shape or dtype than `like`.
class OptimizerStateReader {
 public:
  virtual ~OptimizerStateReader() = default;
  virtual bool Has(const std::string& key) const = 0;
  // On the device of `like` (when defined).
  virtual at::Tensor Tensor(const std::string& key, const at::Tensor& like) const = 0;
  virtual int64_t Int(const std::string& key) const = 0;
  virtual std::string Bytes(const std::string& key) const = 0;
};

class OptimizerStateCodec {
 public:
  virtual ~OptimizerStateCodec() = default;
  // A name for messages ("SGD", "libtorch archive").
  virtual std::string name() const = 0;
  virtual void Save(const torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
                    OptimizerStateWriter& out) const = 0;
  // Replaces the optimizer's state with the saved one.
  virtual void Restore(torch::optim::Optimizer& optimizer, const NamedParameters& parameters,
                       const OptimizerStateReader& in) const = 0;
};

// Registers `codec` for optimizers whose dynamic type is exactly `type`; replaces
// an earlier registration for the same type.
void RegisterOptimizerStateCodec(std::type_index type, std::shared_ptr<const OptimizerStateCodec> codec);
template <typename OptimizerType>
void RegisterOptimizerStateCodec(std::shared_ptr<const OptimizerStateCodec> codec) {
  RegisterOptimizerStateCodec(std::type_index(typeid(OptimizerType)), std::move(codec));
}

// The codec for this optimizer: the one registered for its type, else libtorch's
// archive when its save() writes anything. Throws InvalidArgumentError naming the
// optimizer's type when it can be saved neither way.
std::shared_ptr<const OptimizerStateCodec> FindOptimizerStateCodec(const torch::optim::Optimizer& optimizer);

// The optimizer's type, demangled ("torch::optim::SGD"), for messages.
std::string OptimizerTypeName(const torch::optim::Optimizer& optimizer);

struct TrainState;
// The optimizer's parameters in its own order, each with its name in the model
// (a replicated state's). Throws InvalidArgumentError when the optimizer holds
// a tensor that is not one of the model's parameters.
NamedParameters OptimizerParameters(const TrainState& state);

}  // namespace lockstep

#endif  // LOCKSTEP_OPTIMIZER_STATE_CODEC_H_
