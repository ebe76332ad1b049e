// The mesh, partitioning rules and layouts in one process: shapes that do not
// fit the world, rules that cannot work, the layouts a GPT gets, and shards that
// reassemble into the whole tensor.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "lockstep/errors.h"
#include "lockstep/gpt.h"
#include "lockstep/mesh.h"
#include "lockstep/tensor_parallel.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;

template <typename F>
std::string ErrorOf(F f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(MeshTest, AMeshMustHaveTheWorldsRanks) {
  std::unique_ptr<DeviceMesh> alone = DeviceMesh::Create(nullptr, {1, 1});
  EXPECT_EQ(alone->data()->world_size(), 1);
  EXPECT_EQ(alone->model()->world_size(), 1);
  EXPECT_EQ(alone->data_index(), 0);
  EXPECT_THAT(ErrorOf([] { DeviceMesh::Create(nullptr, {2, 1}); }),
              HasSubstr("mesh 2x1 (data x model) has 2 ranks, but the world has 1"));
  EXPECT_THAT(ErrorOf([] { DeviceMesh::Create(nullptr, {0, 1}); }), HasSubstr("both axes must be at least 1"));
}

TEST(MeshTest, RulesMapLogicalAxesToTheModelAxisInOrder) {
  const Partitioner p({{"heads", "model"}, {"heads", ""}, {"embed", ""}}, {2, 4});
  EXPECT_TRUE(p.Splits("heads"));  // the first rule wins
  EXPECT_FALSE(p.Splits("embed"));
  EXPECT_FALSE(p.Splits("mlp"));  // named by no rule: replicated
  EXPECT_FALSE(Partitioner({{"heads", "model"}}, {4, 1}).Splits("heads"));  // a model axis of one splits nothing
  const ParameterLayout qkv = p.Layout("qkv", {96, 32}, {"heads", "embed"}, 4, /*blocks=*/3);
  EXPECT_EQ(qkv.split_dim, 0);
  EXPECT_EQ(qkv.parts, 4);
  EXPECT_EQ(qkv.bytes_per_rank(), 96 * 32 * 4 / 4);
  EXPECT_EQ(qkv.Describe(), "[96, 32] -> [24, 32] split on heads over model");
  EXPECT_THAT(ErrorOf([&] { p.Layout("w", {90, 32}, {"heads", "embed"}, 4, 3); }),
              HasSubstr("parameter 'w': dimension 0 ('heads', 90 in 3 blocks) does not divide over the model axis of 4"));
  EXPECT_THAT(ErrorOf([&] { p.Layout("w", {8, 8}, {"heads", "heads"}); }), HasSubstr("both map to the model axis"));
  EXPECT_THAT(ErrorOf([&] { p.Layout("w", {8}, {"heads", "embed"}); }), HasSubstr("2 logical axes"));
  EXPECT_THAT(ErrorOf([] { Partitioner({{"", "model"}}, {1, 2}); }), HasSubstr("logical_axis must not be empty"));
  EXPECT_THAT(ErrorOf([] { Partitioner({{"mlp", "data"}}, {1, 2}); }), HasSubstr("partitioning.strategy"));
}

TEST(MeshTest, ShardsReassembleIntoTheWholeTensor) {
  const Partitioner p(DefaultTransformerRules(), {1, 2});
  const at::Tensor whole = at::arange(6 * 4, at::kFloat).view({6, 4});
  // Query, key and value blocks of two rows each: rank 0 takes the first row of each.
  const ParameterLayout fused = p.Layout("qkv", {6, 4}, {"heads", "embed"}, 4, 3);
  EXPECT_TRUE(at::equal(ShardOf(whole, fused, 0), at::stack({whole[0], whole[2], whole[4]})));
  // Columns: rank 1 takes the second half of every row.
  const ParameterLayout columns = p.Layout("proj", {6, 4}, {"embed", "mlp"});
  EXPECT_TRUE(at::equal(ShardOf(whole, columns, 1), whole.narrow(1, 2, 2)));
  const ParameterLayout replicated = p.Layout("ln", {6, 4}, {"embed", "length"});
  EXPECT_TRUE(at::equal(ShardOf(whole, replicated, 1), whole));
  EXPECT_TRUE(at::equal(GatherShards(whole, replicated, nullptr), whole));
}

TEST(MeshTest, EveryGptParameterHasALayoutAndTheTableAddsThemUp) {
  GptOptions o;
  o.num_layers = 2;
  o.width = 32;
  const Partitioner p(DefaultTransformerRules(), {2, 2});
  const std::vector<ParameterLayout> layouts = GptParameterLayouts(o, p);
  const GptImpl model(o);
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters()) names.push_back(item.key());
  ASSERT_EQ(layouts.size(), names.size());
  int64_t split = 0, whole = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    EXPECT_EQ(layouts[i].name, names[i]);
    whole += layouts[i].global_numel() * 4;
    if (layouts[i].sharded()) split += layouts[i].global_numel() * 4;
  }
  EXPECT_EQ(static_cast<double>(whole) / 4, CountGptParameters(o));
  const std::string table = Partitioner::Table(layouts, {2, 2});
  EXPECT_THAT(table, HasSubstr("Mesh 2x2 (data x model); parameter layouts:"));
  EXPECT_THAT(table, HasSubstr("wte.weight"));
  EXPECT_THAT(table, HasSubstr("the split ones: " + std::to_string(split / 2) + " of " + std::to_string(split) +
                               " (0.500)"));
  EXPECT_THAT(ErrorOf([&] { GptLogicalAxes("blocks.0.nope.weight"); }), HasSubstr("no parameter named"));
  GptOptions dropout = o;
  dropout.dropout = 0.1;
  std::unique_ptr<DeviceMesh> mesh = DeviceMesh::Create(nullptr, {1, 1});
  const Partitioner alone(DefaultTransformerRules(), {1, 1});
  EXPECT_NO_THROW(GptImpl(dropout, GptParallelism{mesh->model(), 0, &alone}));  // a model axis of one splits nothing
  EXPECT_THAT(ErrorOf([&] { GptImpl(o, GptParallelism{mesh->model(), 0, &p}); }),
              HasSubstr("the partitioner's mesh has a model axis of 2, the model-axis communicator 1 rank(s)"));
}

}  // namespace
}  // namespace lockstep
