// The config layer, and the lockstep_train binary's command line: bad input gets a
// message naming the field and exit code 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>

#include "google/protobuf/util/message_differencer.h"
#include "absl/strings/str_cat.h"
#include "lockstep/config.h"
#include "tests/testing/temp_dir.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, ParseErrorsNameTheFileLineAndField) {
  absl::StatusOr<config::TrainerConfig> cfg = ParseConfig("num_train_steps: 5\nnum_train_stepz: 6\n", "my.textproto");
  ASSERT_FALSE(cfg.ok());
  EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cfg.status().message(), HasSubstr("my.textproto:2:"));
  EXPECT_THAT(cfg.status().message(), HasSubstr("num_train_stepz"));
  EXPECT_EQ(LoadConfigFile("/nonexistent.textproto").status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, OverridesSetNestedFieldsOfEveryType) {
  config::TrainerConfig cfg;
  ASSERT_TRUE(ApplyOverride("optimizer.learning_rate=0.25", &cfg).ok());
  ASSERT_TRUE(ApplyOverride("optimizer.kind=SGD", &cfg).ok());
  ASSERT_TRUE(ApplyOverride("data.dir=/tmp/some dir", &cfg).ok());
  ASSERT_TRUE(ApplyOverride("data.shuffle=false", &cfg).ok());
  ASSERT_TRUE(ApplyOverride("num_microbatches=4", &cfg).ok());
  EXPECT_EQ(cfg.optimizer().learning_rate(), 0.25);
  EXPECT_EQ(cfg.optimizer().kind(), config::OptimizerConfig::SGD);
  EXPECT_EQ(cfg.data().dir(), "/tmp/some dir");
  EXPECT_FALSE(cfg.data().shuffle());
  EXPECT_EQ(cfg.num_microbatches(), 4);
  ASSERT_TRUE(ApplyOverride("num_microbatches=2", &cfg).ok());
  EXPECT_EQ(cfg.num_microbatches(), 2) << "a later override wins";
}

TEST(ConfigTest, BadOverridesNameTheProblem) {
  config::TrainerConfig cfg;
  EXPECT_THAT(ApplyOverride("optimizer.learning_rat=1", &cfg).message(), HasSubstr("no field named 'learning_rat'"));
  EXPECT_THAT(ApplyOverride("optimizer=1", &cfg).message(), HasSubstr("is a message"));
  EXPECT_THAT(ApplyOverride("num_train_steps.x=1", &cfg).message(), HasSubstr("not a message"));
  EXPECT_THAT(ApplyOverride("num_train_steps=ten", &cfg).message(), HasSubstr("num_train_steps"));
  EXPECT_THAT(ApplyOverride("optimizer.kind=LBFGS", &cfg).message(), HasSubstr("LBFGS"));
  EXPECT_THAT(ApplyOverride("no_equals_sign", &cfg).message(), HasSubstr("expected field.path=value"));
}

TEST(ConfigTest, ValidationNamesTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"optimizer.learning_rate=0", "optimizer.learning_rate"},
      {"optimizer.momentum=1.5", "optimizer.momentum"},
      {"optimizer.beta2=1", "optimizer.beta2"},
      {"schedule.final_fraction=2", "schedule.final_fraction"},
      {"schedule.warmup_steps=-1", "schedule.warmup_steps"},
      {"data.global_batch_size=0", "data.global_batch_size"},
      {"num_train_steps=0", "num_train_steps"},
      {"summary_every_steps=0", "summary_every_steps"},
      {"num_microbatches=0", "num_microbatches"},
      {"num_microbatches=129", "num_microbatches"},
      {"max_grad_norm=-1", "max_grad_norm"},
      {"model.name=resnet", "model.name"},
      {"model.dropout=1", "model.dropout"},
      {"output_dir=", "output_dir"},
      {"partitioning.strategy=zero3", "partitioning.strategy"},
  };
  for (const auto& [assignment, field] : cases) {
    absl::StatusOr<config::TrainerConfig> cfg = BuildConfig("", {assignment});
    ASSERT_FALSE(cfg.ok()) << assignment;
    EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(cfg.status().message(), HasSubstr("'" + field + "'")) << assignment;
  }
  EXPECT_THAT(BuildConfig("", {"data.global_batch_size=10"}, /*world_size=*/3).status().message(),
              HasSubstr("divisible by the world size 3"));
  EXPECT_THAT(BuildConfig("", {"partitioning.strategy=fully_sharded", "weight_metrics=true"}).status().message(),
              HasSubstr("'weight_metrics'"));
  EXPECT_TRUE(BuildConfig("", {"partitioning.strategy=fully_sharded"}).ok());
}

TEST(ConfigTest, LanguageModelConfigsAreChecked) {
  auto gpt = [](std::vector<std::string> more) {
    more.insert(more.begin(), {"model.name=gpt", "data.source=TOKENS"});
    return BuildConfig("", more);
  };
  EXPECT_TRUE(gpt({}).ok()) << gpt({}).status();
  EXPECT_THAT(gpt({"model.num_heads=3"}).status().message(),
              HasSubstr("'model.num_heads' must divide model.width (128), got 3"));
  EXPECT_THAT(gpt({"data.sequence_length=65"}).status().message(),
              HasSubstr("'data.sequence_length' is longer than model.context_length (64), got 65"));
  EXPECT_THAT(gpt({"model.vocab_size=100"}).status().message(), HasSubstr("'model.vocab_size'"));
  EXPECT_THAT(gpt({"model.num_layers=0"}).status().message(), HasSubstr("'model.num_layers'"));
  EXPECT_THAT(gpt({"data.prefetch_batches=0"}).status().message(), HasSubstr("'data.prefetch_batches'"));
  EXPECT_THAT(BuildConfig("", {"model.name=gpt"}).status().message(),
              HasSubstr("'data.source' TOKENS goes with model.name gpt"));
  EXPECT_THAT(BuildConfig("", {"data.source=TOKENS"}).status().message(), HasSubstr("'data.source'"));
}

TEST(ConfigTest, MeshesAreChecked) {
  auto on = [](int world, const std::string& more) {
    absl::StatusOr<config::TrainerConfig> cfg = ParseConfig(
        "model { name: 'gpt' } data { source: TOKENS global_batch_size: 12 } " + more, "test");
    EXPECT_TRUE(cfg.ok()) << cfg.status();
    return ValidateConfig(*cfg, world);
  };
  EXPECT_TRUE(on(4, "partitioning { mesh { model: 2 } }").ok()) << on(4, "partitioning { mesh { model: 2 } }");
  EXPECT_TRUE(on(4, "partitioning { mesh { model: 4 } }").ok());
  EXPECT_TRUE(on(4, "partitioning { mesh { data: 2 model: 2 } }").ok());
  // The batch splits over the data axis only: 6 over 2 replicas of 2 ranks.
  EXPECT_TRUE(on(4, "partitioning { mesh { model: 2 } } data { global_batch_size: 6 }").ok());
  EXPECT_THAT(on(4, "partitioning { mesh { data: 3 model: 2 } }").message(),
              HasSubstr("'partitioning.mesh' must have data x model = the world size 4, got 3x2 (data x model)"));
  EXPECT_THAT(on(2, "partitioning { mesh { model: 4 } }").message(), HasSubstr("got autox4"));
  EXPECT_THAT(on(3, "partitioning { mesh { model: 3 } }").message(),
              HasSubstr("parameter 'blocks.0.qkv.weight': 4 heads do not divide over the model axis of 3 ranks"));
  const std::string three_heads = "model { num_heads: 3 width: 129 } partitioning { mesh { model: 3 } ";
  EXPECT_THAT(on(3, three_heads + "}").message(),
              HasSubstr("parameter 'wte.weight': dimension 0 ('vocab', 256) does not divide over the model axis of 3"));
  // Rules name mesh axes that exist, and can keep a layer whole.
  EXPECT_TRUE(on(3, three_heads + "rules { logical_axis: 'heads' mesh_axis: 'model' } }").ok());
  EXPECT_THAT(on(2, "partitioning { mesh { model: 2 } rules { logical_axis: 'vocab' mesh_axis: 'data' } }").message(),
              HasSubstr("use partitioning.strategy"));
  EXPECT_THAT(on(2, "partitioning { mesh { model: 2 } rules { logical_axis: 'vocab' mesh_axis: 'tensor' } }").message(),
              HasSubstr("unknown mesh axis 'tensor'"));
  EXPECT_THAT(on(2, "partitioning { mesh { model: 2 } } model { dropout: 0.1 }").message(),
              HasSubstr("'model.dropout' must be 0 with a model axis above 1"));
  EXPECT_THAT(on(2, "partitioning { mesh { model: 2 } strategy: 'fully_sharded' }").message(),
              HasSubstr("'partitioning.strategy' must be replicated, sharded_optimizer_state or sharded_gradients "
                        "with a model axis above 1"));
  // ZeRO-1 and ZeRO-2 over the data axis compose with the model axis.
  EXPECT_TRUE(on(4, "partitioning { mesh { model: 2 } strategy: 'sharded_optimizer_state' }").ok());
  EXPECT_TRUE(on(4, "partitioning { mesh { model: 2 } strategy: 'sharded_gradients' }").ok());
  EXPECT_THAT(BuildConfig("", {"partitioning.mesh.model=2", "data.source=SYNTHETIC", "model.name=mlp"}, 2)
                  .status()
                  .message(),
              HasSubstr("needs model.name gpt"));
}

TEST(ConfigTest, CommunicationAndTracingAreChecked) {
  auto on = [](int world, const std::string& more) {
    absl::StatusOr<config::TrainerConfig> cfg = ParseConfig("data { global_batch_size: 12 } " + more, "test");
    EXPECT_TRUE(cfg.ok()) << cfg.status();
    return ValidateConfig(*cfg, world);
  };
  for (const char* hook : {"none", "bf16", "fp16", "powersgd"}) {
    EXPECT_TRUE(on(2, absl::StrCat("communication { hook: '", hook, "' }")).ok()) << hook;
  }
  EXPECT_TRUE(on(4, "communication { hierarchical: true hook: 'bf16' ranks_per_host: 2 }").ok());
  EXPECT_THAT(on(2, "communication { hook: 'zip' }").message(),
              HasSubstr("'communication.hook' must be one of none, bf16, fp16, powersgd, got zip"));
  EXPECT_THAT(on(2, "communication { hook: 'powersgd' powersgd_rank: 0 }").message(),
              HasSubstr("'communication.powersgd_rank' must be >= 1"));
  EXPECT_THAT(on(4, "communication { hierarchical: true ranks_per_host: 3 }").message(),
              HasSubstr("'communication.ranks_per_host' must divide the world size 4"));
  EXPECT_THAT(on(2, "communication { hook: 'bf16' } partitioning { strategy: 'sharded_gradients' }").message(),
              HasSubstr("'partitioning.strategy' must be replicated with a communication hook"));
  EXPECT_THAT(on(4, "communication { hierarchical: true hook: 'powersgd' }").message(),
              HasSubstr("must be false with the powersgd hook"));
  EXPECT_THAT(on(2, "communication { hook: 'fp16' } fault_tolerance { enabled: true }").message(),
              HasSubstr("'fault_tolerance.enabled' must be false with a communication hook"));
  EXPECT_TRUE(on(2, "communication { autotune_buckets: true autotune_bucket_mb: [0.5, 8] }").ok());
  EXPECT_THAT(on(2, "communication { autotune_buckets: true autotune_bucket_mb: 0 }").message(),
              HasSubstr("'communication.autotune_bucket_mb' must be sizes > 0"));
  EXPECT_THAT(on(2, "communication { autotune_buckets: true } partitioning { strategy: 'fully_sharded' }").message(),
              HasSubstr("bucket autotuning"));
  EXPECT_TRUE(on(1, "num_train_steps: 10 trace_steps: [1, 10]").ok());
  EXPECT_THAT(on(1, "num_train_steps: 10 trace_steps: 11").message(),
              HasSubstr("'trace_steps' must be steps in [1, num_train_steps = 10], got 11"));
}

TEST(ConfigTest, ShippedConfigsAreValidAndRoundTrip) {
  for (const auto& entry : std::filesystem::directory_iterator(std::string(LOCKSTEP_SOURCE_DIR) + "/configs")) {
    SCOPED_TRACE(entry.path().string());
    absl::StatusOr<config::TrainerConfig> cfg = BuildConfig(entry.path().string(), {});
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    absl::StatusOr<config::TrainerConfig> again = ParseConfig(ConfigToText(*cfg), "resolved");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*cfg, *again));
  }
}

TEST(ConfigTest, CosineDecayStepsDefaultToTheRestOfTraining) {
  absl::StatusOr<config::TrainerConfig> cfg =
      BuildConfig("", {"schedule.decay=COSINE", "schedule.warmup_steps=100", "num_train_steps=1000"});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->schedule().decay_steps(), 900);
  const LrSchedule schedule = ToLrSchedule(*cfg);
  EXPECT_EQ(schedule.decay, LrSchedule::Decay::kCosine);
  EXPECT_NO_THROW(schedule.Validate());
}

struct Result {
  int exit_code = -1;
  std::string output;
};

// Runs lockstep_train with the given arguments (and, before the binary, shell
// variable assignments such as "OMP_NUM_THREADS=3"); stdout and stderr together.
Result RunTrainBinary(const std::string& args, const std::string& environment = "") {
  const std::string command =
      environment + " " + std::string(LOCKSTEP_BINARY_DIR) + "/lockstep_train " + args + " 2>&1";
  Result result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

class TrainBinaryTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  const std::string dir_ = temp_.path();
};

TEST_F(TrainBinaryTest, BadFlagsAndConfigsExitWithCode2) {
  Result r = RunTrainBinary("--no_such_flag=1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("no_such_flag"));

  r = RunTrainBinary("--set=optimizer.learning_rate=-3");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("'optimizer.learning_rate' must be positive"));

  r = RunTrainBinary("--set=model.nme=cnn");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("no field named 'nme'"));

  r = RunTrainBinary("--set=num_train_steps=1 --set=seed=2");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("--set given 2 times"));

  std::FILE* bad = std::fopen((dir_ + "/bad.textproto").c_str(), "w");
  std::fputs("optimizer {\n  kind: ADAM\n  learning_rate: \"fast\"\n}\n", bad);
  std::fclose(bad);
  r = RunTrainBinary("--config=" + dir_ + "/bad.textproto");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("bad.textproto:3:"));
  EXPECT_THAT(r.output, HasSubstr("learning_rate"));

  r = RunTrainBinary("--config=" + dir_ + "/missing.textproto");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("missing.textproto"));

  r = RunTrainBinary("--help");
  EXPECT_EQ(r.exit_code, 0) << "help is not an error";
  EXPECT_THAT(r.output, HasSubstr("--set"));

  r = RunTrainBinary("stray_argument");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("stray_argument"));
}

TEST_F(TrainBinaryTest, AskingForNcclWithoutAGpuFailsAtStartUp) {
  const Result r = RunTrainBinary("--set=backend=nccl,data.source=SYNTHETIC,output_dir=" + dir_ + "/out");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, ::testing::AnyOf(HasSubstr("NCCL backend: no CUDA device"),
                                         HasSubstr("this build has no NCCL backend")));
}

TEST_F(TrainBinaryTest, MissingDataIsARuntimeFailureNamingTheFile) {
  const Result r = RunTrainBinary("--set=data.dir=" + dir_ + "/nowhere,output_dir=" + dir_ + "/out");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr(dir_ + "/nowhere/train-images-idx3-ubyte.gz"));
}

TEST_F(TrainBinaryTest, AGlobalBatchLargerThanTheTrainSetIsRefusedByName) {
  // Found by the fault suite's config mutations: data { global_batch_size: 2147483647 }
  // was accepted, and every step then ran on the whole train set until it was killed.
  const std::string common = "--set=data.source=SYNTHETIC,model.name=mlp,num_train_steps=2,eval_every_steps=0,"
                             "data.synthetic_train_examples=64,data.synthetic_eval_examples=8,output_dir=" +
                             dir_ + "/run,data.global_batch_size=";
  for (const std::string batch : {"65", "2147483647"}) {
    const Result r = RunTrainBinary(common + batch);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_THAT(r.output, HasSubstr("data.global_batch_size=" + batch +
                                    " is larger than the train set, which holds 64 examples; use a global batch of "
                                    "at most 64"));
  }
  const Result r = RunTrainBinary(common + "64");
  EXPECT_EQ(r.exit_code, 0) << "the whole set is one batch\n" << r.output;
}

TEST_F(TrainBinaryTest, LanguageModelErrorsNameTheFieldOrTheCommandThatPreparesTheData) {
  Result r = RunTrainBinary("--config=" + std::string(LOCKSTEP_SOURCE_DIR) +
                            "/configs/kjv_gpt.textproto --set=model.num_heads=5,output_dir=" + dir_ + "/out");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("'model.num_heads' must divide model.width (128)"));
  r = RunTrainBinary("--config=" + std::string(LOCKSTEP_SOURCE_DIR) +
                     "/configs/kjv_gpt.textproto --set=data.sequence_length=100,output_dir=" + dir_ + "/out");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("'data.sequence_length' is longer than model.context_length (64)"));
  r = RunTrainBinary("--config=" + std::string(LOCKSTEP_SOURCE_DIR) + "/configs/kjv_gpt.textproto --set=data.token_dir=" +
                     dir_ + "/unprepared,output_dir=" + dir_ + "/out");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("'" + dir_ + "/unprepared/train.bin' is missing; prepare it with: "
                                  "data/prepare_kjv.py " + dir_ + "/unprepared"));
}

TEST_F(TrainBinaryTest, TrainsOnSyntheticDataAndWritesTheResolvedConfig) {
  const Result r = RunTrainBinary(
      "--set=data.source=SYNTHETIC,model.name=mlp,num_train_steps=30,eval_every_steps=20,summary_every_steps=10,"
      "data.global_batch_size=32,data.synthetic_train_examples=256,data.synthetic_eval_examples=64,output_dir=" +
      dir_ + "/run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("Model: mlp, [0-9]+ trainable weights, initialised in [0-9.]+ s"));
  for (const std::string metric : {"loss", "accuracy", "learning_rate", "gradients_l2norm", "weights_l2norm",
                                   "seconds_per_step", "examples_per_second"}) {
    EXPECT_TRUE(std::regex_search(r.output, std::regex("\nStep     10: train " + metric + " \\| [0-9]+\\.[0-9]{8}\n")))
        << metric << " missing from\n" << r.output;
  }
  EXPECT_THAT(r.output, HasSubstr("Step     20: test accuracy | "));
  EXPECT_THAT(r.output, HasSubstr("Step     30: test loss | "));
  absl::StatusOr<config::TrainerConfig> written = LoadConfigFile(dir_ + "/run/config.textproto");
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->num_train_steps(), 30);
  EXPECT_EQ(written->data().source(), config::DataConfig::SYNTHETIC);
  EXPECT_EQ(written->optimizer().learning_rate(), 0.001) << "defaults are written out too";
}

TEST_F(TrainBinaryTest, ThreadsFollowOmpNumThreadsUnlessTheConfigSetsThem) {
  const std::string common = "--set=data.source=SYNTHETIC,model.name=mlp,num_train_steps=1,eval_every_steps=0,"
                             "data.global_batch_size=32,data.synthetic_train_examples=64,"
                             "data.synthetic_eval_examples=8,output_dir=" +
                             dir_ + "/run";
  for (const auto& [args, threads] : std::vector<std::pair<std::string, std::string>>{
           {common, "3"}, {common + ",num_threads=2", "2"}}) {
    const Result r = RunTrainBinary(args, "OMP_NUM_THREADS=3");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr(", " + threads + " threads per rank;")) << args;
  }
}

}  // namespace
}  // namespace lockstep
