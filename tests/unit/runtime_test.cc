#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "lockstep/errors.h"
#include "lockstep/runtime.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;
using Vars = std::map<std::string, std::string>;

Runtime From(const Vars& vars) {
  return Runtime::FromVariables([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string ErrorOf(const Vars& vars) {
  try {
    From(vars);
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "no error";
}

TEST(RuntimeTest, NoLauncherIsAWorldOfOne) {
  const Runtime r = From({});
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.local_rank, 0);
  EXPECT_EQ(r.launcher, "none");
  EXPECT_FALSE(r.host.empty());
  EXPECT_TRUE(r.is_chief());
}

TEST(RuntimeTest, ReadsEachLauncher) {
  Runtime r = From({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  EXPECT_EQ(r.launcher, "mpirun");
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_FALSE(r.is_chief());
  r = From({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_STEP_ID", "0"}});
  EXPECT_EQ(r.launcher, "slurm");
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.local_rank, 1);
  r = From({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(r.launcher, "torchrun");
  EXPECT_EQ(r.world_size, 2);
}

TEST(RuntimeTest, SeveralHostsWhenTheLauncherSaysSo) {
  const Vars mpirun = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}};
  EXPECT_FALSE(From(mpirun).several_hosts);  // not said
  Vars vars = mpirun;
  vars["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  EXPECT_TRUE(From(vars).several_hosts);
  vars["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4";
  EXPECT_FALSE(From(vars).several_hosts);
  vars["OMPI_COMM_WORLD_LOCAL_SIZE"] = "two";  // unreadable: says nothing
  EXPECT_FALSE(From(vars).several_hosts);
  const Vars slurm = {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_STEP_ID", "0"}};
  vars = slurm;
  vars["SLURM_STEP_NUM_NODES"] = "2";
  EXPECT_TRUE(From(vars).several_hosts);
  vars["SLURM_STEP_NUM_NODES"] = "1";
  EXPECT_FALSE(From(vars).several_hosts);
  vars = {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}};
  EXPECT_TRUE(From(vars).several_hosts);
  EXPECT_FALSE(From({}).several_hosts);
}

TEST(RuntimeTest, IgnoresTheBatchScriptsOwnSlurmVariables) {
  // mpirun started inside an sbatch script: SLURM_PROCID=0 describes the script.
  const Runtime r = From({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
                          {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}});
  EXPECT_EQ(r.launcher, "mpirun");
  EXPECT_EQ(r.rank, 3);
}

TEST(RuntimeTest, AgreeingSourcesAreFine) {
  const Runtime r = From({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(r.rank, 1);
}

TEST(RuntimeTest, PartialOrContradictoryVariablesAreClearErrors) {
  EXPECT_THAT(ErrorOf({{"RANK", "0"}}), HasSubstr("partial torchrun environment: RANK set but WORLD_SIZE, LOCAL_RANK missing"));
  EXPECT_THAT(ErrorOf({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}), HasSubstr("RANK='x'"));
  EXPECT_THAT(ErrorOf({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
              HasSubstr("RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_THAT(ErrorOf({{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"LOCAL_RANK", "0"}}), HasSubstr("WORLD_SIZE='0'"));
  EXPECT_THAT(ErrorOf({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                       {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
              HasSubstr("contradictory launcher environment: mpirun says rank 1 of 2, torchrun says rank 0 of 2"));
}

}  // namespace
}  // namespace lockstep
