// Fuzzes the config text parser and the --set overrides.
//
// The input is config text; each line "#set field.path=value" in it (a comment to
// the text parser) is also applied as a --set override, so the configs under
// configs/ are seeds as they are. Properties: any input is a config or an error
// with a message, never a crash; a config that validates prints as text that parses
// back to an equivalent config (defaults spelt out) and validates again; the
// conversions to options that the job runs after validation do not throw.
#include <google/protobuf/util/message_differencer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "fuzz_util.h"
#include "lockstep/config.h"
#include "lockstep/errors.h"
#include "lockstep/models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "#set ") && overrides.size() < 8) overrides.emplace_back(line);
  }
  const int world_size = 1 + static_cast<int>(size % 4);

  absl::StatusOr<lockstep::config::TrainerConfig> config = lockstep::ParseConfig(text, "fuzz.textproto");
  if (!config.ok()) {
    LOCKSTEP_FUZZ_CHECK(!config.status().message().empty(), "a parse error without a message");
    return 0;
  }
  for (const std::string& assignment : overrides) {
    const absl::Status status = lockstep::ApplyOverride(assignment, &*config);
    LOCKSTEP_FUZZ_CHECK(status.ok() || !status.message().empty(), "an override error without a message");
  }
  const absl::Status valid = lockstep::ValidateConfig(*config, world_size);
  if (!valid.ok()) {
    LOCKSTEP_FUZZ_CHECK(!valid.message().empty(), "a validation error without a message");
    return 0;
  }
  lockstep::ResolveDerivedFields(&*config);

  const std::string printed = lockstep::ConfigToText(*config);
  absl::StatusOr<lockstep::config::TrainerConfig> again = lockstep::ParseConfig(printed, "printed.textproto");
  LOCKSTEP_FUZZ_CHECK(again.ok(), std::string(again.status().message()).c_str());
  std::string differences;
  google::protobuf::util::MessageDifferencer differencer;
  // Printed text spells out every default; an unset field and its default are the same config.
  differencer.set_message_field_comparison(google::protobuf::util::MessageDifferencer::EQUIVALENT);
  differencer.ReportDifferencesToString(&differences);
  LOCKSTEP_FUZZ_CHECK(differencer.Compare(*config, *again), differences.c_str());
  const absl::Status valid_again = lockstep::ValidateConfig(*again, world_size);
  LOCKSTEP_FUZZ_CHECK(valid_again.ok(), std::string(valid_again.message()).c_str());

  // What lockstep_train does with a valid config before it builds anything.
  (void)lockstep::ToOptimizerOptions(config->optimizer());
  (void)lockstep::ToLrSchedule(*config);
  (void)lockstep::ToTrainerOptions(*config);
  (void)lockstep::ToCheckpointOptions(*config);
  (void)lockstep::ToJobOptions(*config);
  (void)lockstep::ToJobEnvironmentOptions(*config);
  (void)lockstep::ResumeRelevantConfigText(*config);
  try {
    lockstep::CheckModelFitsInMemory(*config, lockstep::ToModelOptions(config->model()));
  } catch (const lockstep::Error& e) {
    LOCKSTEP_FUZZ_CHECK(absl::StrContains(e.what(), "model."), e.what());
  }
  return 0;
}
