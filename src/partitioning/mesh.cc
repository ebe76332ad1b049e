#include "lockstep/mesh.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lockstep/errors.h"

namespace lockstep {

std::string DescribeMesh(const MeshShape& shape) {
  return absl::StrCat(shape.data, "x", shape.model, " (data x model)");
}

std::unique_ptr<DeviceMesh> DeviceMesh::Create(Communicator* world, const MeshShape& shape,
                                               const CollectiveOptions& options) {
  if (shape.data < 1 || shape.model < 1) {
    throw InvalidArgumentError(absl::StrCat("mesh ", DescribeMesh(shape), ": both axes must be at least 1"));
  }
  const int world_size = world != nullptr ? world->world_size() : 1;
  if (shape.size() != world_size) {
    throw InvalidArgumentError(absl::StrCat("mesh ", DescribeMesh(shape), " has ", shape.size(),
                                            " ranks, but the world has ", world_size));
  }
  std::unique_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->shape_ = shape;
  if (world == nullptr) {
    mesh->own_world_ = MakeSingleProcessCommunicator();
    world = mesh->own_world_.get();
  }
  mesh->world_ = world;
  const int rank = world->rank();
  mesh->data_index_ = rank / shape.model;
  mesh->model_index_ = rank % shape.model;
  // Every rank splits twice, in the same order.
  mesh->data_ = world->Split(/*color=*/mesh->model_index_, /*key=*/mesh->data_index_, options);
  mesh->model_ = world->Split(/*color=*/mesh->data_index_, /*key=*/mesh->model_index_, options);
  return mesh;
}

PartitionRules DefaultTransformerRules() {
  return {{"vocab", "model"}, {"heads", "model"}, {"mlp", "model"}, {"embed", ""}, {"length", ""}};
}

int64_t ParameterLayout::global_numel() const {
  int64_t n = 1;
  for (int64_t d : global_shape) n *= d;
  return n;
}

std::vector<int64_t> ParameterLayout::local_shape() const {
  std::vector<int64_t> shape = global_shape;
  if (sharded()) shape[split_dim] /= parts;
  return shape;
}

int64_t ParameterLayout::bytes_per_rank() const { return global_numel() / parts * element_size; }

std::string ParameterLayout::Describe() const {
  const std::string global = absl::StrCat("[", absl::StrJoin(global_shape, ", "), "]");
  if (!sharded()) return global + " replicated";
  return absl::StrCat(global, " -> [", absl::StrJoin(local_shape(), ", "), "] split on ", axes[split_dim], " over model");
}

Partitioner::Partitioner(PartitionRules rules, MeshShape shape) : rules_(std::move(rules)), shape_(shape) {
  for (const PartitionRule& rule : rules_) {
    if (rule.logical_axis.empty()) throw InvalidArgumentError("partition rule: logical_axis must not be empty");
    if (rule.mesh_axis == "data") {
      throw InvalidArgumentError(absl::StrCat(
          "partition rule for '", rule.logical_axis,
          "': parameters are not split over the data axis by rules (it holds whole replicas); "
          "use partitioning.strategy to shard state over it"));
    }
    if (!rule.mesh_axis.empty() && rule.mesh_axis != "model") {
      throw InvalidArgumentError(absl::StrCat("partition rule for '", rule.logical_axis, "': unknown mesh axis '",
                                              rule.mesh_axis, "' (model, or empty for replicated)"));
    }
  }
}

bool Partitioner::Splits(const std::string& logical_axis) const {
  if (shape_.model <= 1) return false;
  for (const PartitionRule& rule : rules_) {
    if (rule.logical_axis == logical_axis) return rule.mesh_axis == "model";
  }
  return false;
}

ParameterLayout Partitioner::Layout(const std::string& name, const std::vector<int64_t>& global_shape,
                                    const LogicalAxes& axes, int64_t element_size, int blocks) const {
  if (axes.size() != global_shape.size()) {
    throw InvalidArgumentError(absl::StrCat("parameter '", name, "': ", axes.size(), " logical axes (",
                                            absl::StrJoin(axes, ", "), ") for ", global_shape.size(),
                                            " dimensions"));
  }
  ParameterLayout layout;
  layout.name = name;
  layout.global_shape = global_shape;
  layout.axes = axes;
  layout.element_size = element_size;
  for (int d = 0; d < static_cast<int>(axes.size()); ++d) {
    if (!Splits(axes[d])) continue;
    if (layout.split_dim >= 0) {
      throw InvalidArgumentError(absl::StrCat("parameter '", name, "': axes '", axes[layout.split_dim], "' and '",
                                              axes[d], "' both map to the model axis; one of them must be replicated"));
    }
    if (global_shape[d] % (static_cast<int64_t>(blocks) * shape_.model) != 0) {
      throw InvalidArgumentError(absl::StrCat(
          "parameter '", name, "': dimension ", d, " ('", axes[d], "', ", global_shape[d],
          blocks > 1 ? absl::StrCat(" in ", blocks, " blocks") : std::string(),
          ") does not divide over the model axis of ", shape_.model, " ranks"));
    }
    layout.split_dim = d;
    layout.parts = shape_.model;
    layout.blocks = blocks;
  }
  return layout;
}

std::string Partitioner::Table(const std::vector<ParameterLayout>& layouts, const MeshShape& shape) {
  size_t width = 9, layout_width = 6;
  for (const ParameterLayout& l : layouts) {
    width = std::max(width, l.name.size());
    layout_width = std::max(layout_width, l.Describe().size());
  }
  std::string out = absl::StrFormat("Mesh %s; parameter layouts:\n%-*s  %-*s  %10s\n", DescribeMesh(shape),
                                    static_cast<int>(width), "parameter", static_cast<int>(layout_width), "layout",
                                    "bytes/rank");
  int64_t total = 0, per_rank = 0, sharded_total = 0, sharded_per_rank = 0;
  for (const ParameterLayout& l : layouts) {
    absl::StrAppendFormat(&out, "%-*s  %-*s  %10d\n", static_cast<int>(width), l.name,
                          static_cast<int>(layout_width), l.Describe(), l.bytes_per_rank());
    total += l.global_numel() * l.element_size;
    per_rank += l.bytes_per_rank();
    if (l.sharded()) {
      sharded_total += l.global_numel() * l.element_size;
      sharded_per_rank += l.bytes_per_rank();
    }
  }
  absl::StrAppendFormat(&out, "Parameters per rank: %d of %d bytes (%.3f); the split ones: %d of %d (%.3f)\n",
                        per_rank, total, total > 0 ? static_cast<double>(per_rank) / total : 0.0, sharded_per_rank,
                        sharded_total, sharded_total > 0 ? static_cast<double>(sharded_per_rank) / sharded_total : 0.0);
  return out;
}

}  // namespace lockstep
