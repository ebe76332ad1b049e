// The configuration of a `lockstep_train` run: proto/config.proto in protobuf text
// format, overridden field by field from the command line, validated, and turned
// into the options of the trainer's components.
//
// Errors (absl::Status): InvalidArgument naming the file, line and field for a
// parse error, or the dotted field path and the rule for a bad value; NotFound for
// a missing config file. Stateless functions; thread-safe.
#ifndef LOCKSTEP_CONFIG_H_
#define LOCKSTEP_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lockstep/checkpoint.h"
#include "lockstep/data.h"
#include "lockstep/token_data.h"
#include "lockstep/gpt.h"
#include "lockstep/job.h"
#include "lockstep/mesh.h"
#include "lockstep/models.h"
#include "lockstep/progress.h"
#include "lockstep/runtime.h"
#include "lockstep/schedule.h"
#include "lockstep/train_state.h"
#include "lockstep/trainer.h"
#include "proto/config.pb.h"

namespace lockstep {

// Parses a text-format TrainerConfig. `source` names it in error messages.
absl::StatusOr<config::TrainerConfig> ParseConfig(const std::string& text, const std::string& source);
// Reads and parses a config file.
absl::StatusOr<config::TrainerConfig> LoadConfigFile(const std::string& path);

// Applies one override of the form `dotted.field.path=value`, e.g.
// `optimizer.learning_rate=0.01`, `data.dir=/tmp/fmnist`, `optimizer.kind=SGD`.
absl::Status ApplyOverride(const std::string& assignment, config::TrainerConfig* config);

// Checks every field against its rule. `world_size` is the number of ranks that
// will share the global batch.
absl::Status ValidateConfig(const config::TrainerConfig& config, int world_size = 1);

// Fills derived values (cosine decay_steps = num_train_steps - warmup_steps when 0).
void ResolveDerivedFields(config::TrainerConfig* config);

// Load (or start from defaults when `path` is empty), override, resolve, validate.
absl::StatusOr<config::TrainerConfig> BuildConfig(const std::string& path, const std::vector<std::string>& overrides,
                                                  int world_size = 1);

// The config as text format, every field written (defaults included).
std::string ConfigToText(const config::TrainerConfig& config);
// The part of a config that a resumed run must share with the checkpoint: all of
// it but where and how long it runs, how it reports, how ranks talk and how it
// checkpoints (output_dir, num_train_steps, eval and summary periods, progress,
// weight metrics, threads, backend, device, buckets, timeouts, coordination,
// checkpoint).
std::string ResumeRelevantConfigText(const config::TrainerConfig& config);

// partitioning.mesh for `world_size` ranks (data 0: the world size / model).
MeshShape ToMeshShape(const config::TrainerConfig& config, int world_size);
// partitioning.rules, or DefaultTransformerRules() when there are none.
PartitionRules ToPartitionRules(const config::TrainerConfig& config);
// `runtime` as the mesh's data axis sees it (rank: the data index, world_size:
// the data axis): whose slice of each global batch a rank reads.
Runtime DataAxisRuntime(const Runtime& runtime, const MeshShape& shape);

OptimizerOptions ToOptimizerOptions(const config::OptimizerConfig& config);
LrSchedule ToLrSchedule(const config::TrainerConfig& config);
ModelOptions ToModelOptions(const config::ModelConfig& config);

// The options of the job layer's parts, from a validated config.
JobEnvironmentOptions ToJobEnvironmentOptions(const config::TrainerConfig& config);
JobOptions ToJobOptions(const config::TrainerConfig& config);
// checkpoint.dir, or <output_dir>/checkpoints; the fingerprint covers
// ResumeRelevantConfigText.
CheckpointOptions ToCheckpointOptions(const config::TrainerConfig& config);
// Step, summary and data-parallel options; the caller sets the communicator and
// the coordination client. The fingerprint is the whole config.
TrainerOptions ToTrainerOptions(const config::TrainerConfig& config);
// terminate_on_nan and early_stopping, as actions of `trainer`.
void AddConfiguredActions(const config::TrainerConfig& config, BaseTrainer& trainer);

// Rank 0's writers for a run in config.output_dir, on the trainer's writer thread:
// TensorBoard events, metrics.jsonl, the curves for plots, and stdout lines, or a
// progress bar when config.progress says so (auto: stdout is a terminal, and under
// mpirun only when LOCKSTEP_STDOUT_IS_TERMINAL=1, since mpirun gives every rank a
// pseudo-terminal). Other ranks get none (null members).
struct RunWriters {
  std::shared_ptr<ProgressBar> progress;
  std::shared_ptr<CurvePlotter> plotter;
};
RunWriters AddConfiguredWriters(const config::TrainerConfig& config, const Runtime& runtime, BaseTrainer& trainer);

// Refuses a model that cannot fit in this machine's memory before libtorch tries
// to allocate it: InvalidArgumentError naming model.hidden_units (the field that
// sizes the model), the bytes its weights, gradients and optimizer state need,
// and the memory there is.
void CheckModelFitsInMemory(const config::TrainerConfig& config, const ModelOptions& model);

// Rank 0 writes the resolved config to <output_dir>/config.textproto (creating the
// directory), through a temporary file and a rename. Throws Error when it cannot.
void WriteResolvedConfig(const config::TrainerConfig& config, const Runtime& runtime);

// The train and eval sets of config.data: Fashion-MNIST from data.dir, the
// synthetic sets, or (TOKENS) the token files token_dir/train.bin and eval.bin,
// memory-mapped. Throws DataError naming a missing or malformed file (for token
// files, with the command that prepares them).
struct Datasets {
  std::shared_ptr<const TensorDataset> train;  // images
  std::shared_ptr<const TensorDataset> test;
  std::shared_ptr<const TokenFile> train_tokens;  // TOKENS
  std::shared_ptr<const TokenFile> eval_tokens;
  std::string description;  // "Fashion-MNIST from <dir>", "synthetic", "tokens from <dir>"
  bool tokens() const { return train_tokens != nullptr; }
};
Datasets LoadDatasets(const config::TrainerConfig& config);
// This rank's sharding of the train set (global batch, seed, shuffle), and of the
// eval set (eval batch, one pass, in order).
ShardingOptions ToTrainSharding(const config::TrainerConfig& config, const Runtime& runtime);
ShardingOptions ToEvalSharding(const config::TrainerConfig& config, const Runtime& runtime);
// TOKENS: tokens per example, data.sequence_length or else model.context_length.
int64_t SequenceLength(const config::TrainerConfig& config);
// This rank's train batches: a ShardedBatchIterator over images; over tokens, a
// TokenWindowIterator behind a PrefetchingIterator of data.prefetch_batches.
// Throws InvalidArgumentError naming data.global_batch_size when it is larger than
// the train set (its examples, or its windows of SequenceLength tokens).
std::unique_ptr<BatchIterator> MakeTrainIterator(const config::TrainerConfig& config, const Datasets& data,
                                                 const Runtime& runtime);
// This rank's eval batches, one pass in order.
std::unique_ptr<BatchIterator> MakeEvalIterator(const config::TrainerConfig& config, const Datasets& data,
                                                const Runtime& runtime);

}  // namespace lockstep

#endif  // LOCKSTEP_CONFIG_H_
