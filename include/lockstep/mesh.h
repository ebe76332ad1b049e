// A device mesh and t5x-style partitioning rules.
//
// DeviceMesh arranges the ranks of a world as `data x model`: rank r sits at
// data index r / model and model index r % model, so the ranks of one model-axis
// group are neighbours (on one host, when a host runs whole groups), as Megatron
// places tensor-parallel ranks. It splits the world into one communicator per
// axis group:
//
//   data()   the ranks with this rank's model index (data parallelism: gradients
//            are summed here, the sharded strategies slice state here)
//   model()  the ranks with this rank's data index (tensor parallelism: the
//            layers of tensor_parallel.h all-reduce activations here)
//
// Parameters name the logical axes of their dimensions ("vocab", "embed",
// "heads", "mlp", ...). PartitionRules map logical axes to mesh axes in order,
// the first rule that names an axis wins, and an axis no rule names is
// replicated. A Partitioner applies the rules to a parameter and gives its
// layout: which dimension is split over the model axis, if any, and its bytes per
// rank. The rules come from the config, so a user changes the layout without
// touching the model:
//
//   mesh { data: 2 model: 2 }
//   partition_rules { logical_axis: "heads" mesh_axis: "model" }
//   partition_rules { logical_axis: "mlp" mesh_axis: "model" }
//   partition_rules { logical_axis: "vocab" mesh_axis: "model" }
//   partition_rules { logical_axis: "embed" }            # replicated
//
// The data axis is not a target of rules: it holds whole replicas, and
// partitioning.strategy (ZeRO) slices state over it.
#ifndef LOCKSTEP_MESH_H_
#define LOCKSTEP_MESH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/communicator.h"

namespace lockstep {

struct MeshShape {
  int data = 1;
  int model = 1;
  int size() const { return data * model; }
};

// "2x2 (data x model)".
std::string DescribeMesh(const MeshShape& shape);

class DeviceMesh {
 public:
  // A collective over `world` (null: this process alone, shape 1x1). Throws
  // InvalidArgumentError when an axis is below 1 or data x model is not the world
  // size, naming both; errors of Communicator::Split otherwise. `world` must
  // outlive the mesh.
  static std::unique_ptr<DeviceMesh> Create(Communicator* world, const MeshShape& shape,
                                            const CollectiveOptions& options = {});

  const MeshShape& shape() const { return shape_; }
  int data_index() const { return data_index_; }
  int model_index() const { return model_index_; }
  // Never null (a group of one is a single-process communicator).
  Communicator* world() const { return world_; }
  Communicator* data() const { return data_.get(); }
  Communicator* model() const { return model_.get(); }

 private:
  DeviceMesh() = default;
  MeshShape shape_;
  int data_index_ = 0;
  int model_index_ = 0;
  std::unique_ptr<Communicator> own_world_;  // when created without one
  Communicator* world_ = nullptr;
  std::unique_ptr<Communicator> data_;
  std::unique_ptr<Communicator> model_;
};

// One rule: a logical axis and the mesh axis it is split over ("model"), or ""
// for replicated.
struct PartitionRule {
  std::string logical_axis;
  std::string mesh_axis;
};
using PartitionRules = std::vector<PartitionRule>;

// The transformer's rules in Megatron's layout: attention heads, MLP columns and
// the vocabulary split over the model axis; the residual stream ("embed") and
// positions ("length") replicated.
PartitionRules DefaultTransformerRules();

// Logical axis names of a parameter's dimensions, outermost first.
using LogicalAxes = std::vector<std::string>;

struct ParameterLayout {
  std::string name;
  std::vector<int64_t> global_shape;
  LogicalAxes axes;
  int split_dim = -1;  // the dimension split over the model axis; -1: replicated
  int parts = 1;       // model-axis size when split
  // The split dimension holds `blocks` equal blocks, each split over the model
  // axis on its own: the query, key and value rows of a fused projection (3).
  int blocks = 1;
  int64_t element_size = 4;

  bool sharded() const { return split_dim >= 0; }
  int64_t global_numel() const;
  // This rank's shape: the global shape with the split dimension divided by parts.
  std::vector<int64_t> local_shape() const;
  int64_t bytes_per_rank() const;
  // "[768, 128] -> [384, 128] over model" or "[128] replicated".
  std::string Describe() const;
};

class Partitioner {
 public:
  // Throws InvalidArgumentError for a rule with an empty logical axis, or a mesh
  // axis other than "model" and "" (the message says what the data axis is for).
  Partitioner(PartitionRules rules, MeshShape shape);

  const PartitionRules& rules() const { return rules_; }
  const MeshShape& shape() const { return shape_; }
  // Whether `logical_axis` is split over the model axis (of more than one rank).
  bool Splits(const std::string& logical_axis) const;

  // The layout of a parameter. Throws InvalidArgumentError naming the parameter
  // when axes and shape disagree in length, when two of its axes map to the model
  // axis, or when the model axis does not divide the split dimension.
  ParameterLayout Layout(const std::string& name, const std::vector<int64_t>& global_shape, const LogicalAxes& axes,
                         int64_t element_size = 4, int blocks = 1) const;

  // The start-up table: parameter, global shape, layout, bytes per rank, and the
  // totals against a replicated model.
  static std::string Table(const std::vector<ParameterLayout>& layouts, const MeshShape& shape);

 private:
  PartitionRules rules_;
  MeshShape shape_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_MESH_H_
