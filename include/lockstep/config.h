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
#include "lockstep/models.h"
#include "lockstep/schedule.h"
#include "lockstep/train_state.h"
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

OptimizerOptions ToOptimizerOptions(const config::OptimizerConfig& config);
LrSchedule ToLrSchedule(const config::TrainerConfig& config);
ModelOptions ToModelOptions(const config::ModelConfig& config);

}  // namespace lockstep

#endif  // LOCKSTEP_CONFIG_H_
