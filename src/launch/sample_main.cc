// lockstep_sample: prints text from a trained GPT (a lockstep_train run with
// model.name gpt) continuing a prompt, so a user sees what the model learned.
//
//   lockstep_sample --run=runs/kjv_gpt --prompt="And God said" --tokens=300
//   lockstep_sample --run=runs/kjv_gpt --temperature=0.8 --top_k=40 --seed=7
//   lockstep_sample --run=runs/kjv_gpt --checkpoint=runs/kjv_gpt/checkpoints/step_00001000
//
// The model comes from the run's resolved config (RUN/config.textproto); its
// weights from the newest valid checkpoint of the run (or --checkpoint), under any
// world size or partitioning it was saved with. Each new byte is drawn from the
// softmax of the last position's logits divided by the temperature, among the
// top_k most likely (0: all); temperature 0 takes the most likely byte. The same
// seed gives the same text. Exit 0; 2 for bad flags or a run that is not a GPT;
// 1 when no checkpoint loads.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "lockstep/checkpoint.h"
#include "lockstep/config.h"
#include "lockstep/errors.h"
#include "lockstep/gpt.h"
#include "lockstep/hashing.h"
#include "lockstep/torch_setup.h"
#include "proto/checkpoint.pb.h"

ABSL_FLAG(std::string, run, "", "The output_dir of a lockstep_train run of a GPT (it holds config.textproto)");
ABSL_FLAG(std::string, checkpoint, "", "A step directory to load; default: the run's newest valid checkpoint");
ABSL_FLAG(std::string, prompt, "\n", "Text the model continues (bytes are its tokens)");
ABSL_FLAG(int, tokens, 300, "Bytes to generate");
ABSL_FLAG(double, temperature, 0.8, "Divides the logits before the softmax; 0 takes the most likely byte");
ABSL_FLAG(int, top_k, 40, "Draw among the k most likely bytes; 0: among all");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the draws: the same seed, the same text");

namespace lockstep {
namespace {

constexpr int kExitUsage = 2;

int Usage(const std::string& message) {
  std::fprintf(stderr, "lockstep_sample: %s\n", message.c_str());
  return kExitUsage;
}

int Run() {
  const std::string run = absl::GetFlag(FLAGS_run);
  if (run.empty()) return Usage("--run=DIR is required (the output_dir of a lockstep_train run)");
  const std::filesystem::path config_path = std::filesystem::path(run) / "config.textproto";
  if (!std::filesystem::exists(config_path)) {
    return Usage("'" + config_path.string() + "' is missing: --run must name a lockstep_train output_dir");
  }
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const double temperature = absl::GetFlag(FLAGS_temperature);
  const int top_k = absl::GetFlag(FLAGS_top_k);
  if (tokens < 0) return Usage("--tokens must be >= 0");
  if (!(temperature >= 0)) return Usage("--temperature must be >= 0");
  if (top_k < 0) return Usage("--top_k must be >= 0 (0: all bytes)");
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (prompt.empty()) return Usage("--prompt must not be empty (the model needs a first byte)");

  absl::StatusOr<config::TrainerConfig> cfg = BuildConfig(config_path.string(), {}, /*world_size=*/1);
  if (!cfg.ok()) return Usage(config_path.string() + ": " + std::string(cfg.status().message()));
  if (cfg->model().name() != "gpt") {
    return Usage(config_path.string() + ": model.name is '" + cfg->model().name() + "', not gpt: nothing to sample");
  }
  ConfigureTorchForTraining(cfg->num_threads());
  CheckpointOptions options = ToCheckpointOptions(*cfg);
  FoundCheckpoint found;
  if (!absl::GetFlag(FLAGS_checkpoint).empty()) {
    found = CheckpointManager::Validate(absl::GetFlag(FLAGS_checkpoint));
  } else {
    std::vector<std::string> skipped;
    std::optional<FoundCheckpoint> latest = CheckpointManager::FindLatest(options.directory, &skipped);
    for (const std::string& why : skipped) std::fprintf(stderr, "lockstep_sample: skipping %s\n", why.c_str());
    if (!latest) throw CheckpointError("no valid checkpoint in '" + options.directory + "'");
    found = *latest;
  }
  // The model as the checkpoint was trained: its manifest keeps that config (a
  // later start of the run with other settings rewrites config.textproto).
  absl::StatusOr<config::TrainerConfig> trained = ParseConfig(found.manifest->config_text(), found.path + " (manifest)");
  if (!trained.ok()) throw CheckpointError(std::string(trained.status().message()));
  if (trained->model().name() != "gpt") {
    return Usage(found.path + ": trained model.name '" + trained->model().name() + "', not gpt: nothing to sample");
  }
  options.config_text = found.manifest->config_text();
  options.config_fingerprint = StableHash(options.config_text);
  const ModelOptions model_options = ToModelOptions(trained->model());
  auto model = std::make_shared<GptImpl>(model_options.gpt);
  TrainState state = MakeTrainState(model, MakeOptimizerFactory(ToOptimizerOptions(trained->optimizer())));
  CheckpointManager manager(options, /*rank=*/0, /*world_size=*/1, nullptr);
  manager.Restore(found, state);
  std::fprintf(stderr, "lockstep_sample: %s (step %lld, written by %d rank(s)); temperature %g, top_k %d, seed %llu\n",
               found.path.c_str(), static_cast<long long>(found.step), found.world_size, temperature, top_k,
               static_cast<unsigned long long>(absl::GetFlag(FLAGS_seed)));

  model->eval();
  at::NoGradGuard no_grad;
  at::manual_seed(absl::GetFlag(FLAGS_seed));
  std::vector<int64_t> text(prompt.begin(), prompt.end());
  for (int64_t& t : text) t = static_cast<uint8_t>(t);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  const int64_t context = model_options.gpt.context_length;
  for (int i = 0; i < tokens; ++i) {
    const int64_t begin = std::max<int64_t>(0, static_cast<int64_t>(text.size()) - context);
    const at::Tensor window =
        at::tensor(std::vector<int64_t>(text.begin() + begin, text.end()), at::kLong).unsqueeze(0);
    at::Tensor logits = model->forward(window).select(1, window.size(1) - 1).squeeze(0).to(at::kDouble);
    int64_t next = 0;
    if (temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / temperature;
      at::Tensor candidates = at::arange(logits.size(0), at::kLong);
      if (top_k > 0 && top_k < logits.size(0)) {
        auto [values, indices] = logits.topk(top_k);
        logits = values;
        candidates = indices;
      }
      next = candidates[at::multinomial(at::softmax(logits, 0), 1).item<int64_t>()].item<int64_t>();
    }
    text.push_back(next);
    const char c = static_cast<char>(next);
    std::fwrite(&c, 1, 1, stdout);
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Prints text from a trained GPT run. Usage: lockstep_sample --run=DIR [--prompt=TEXT] [--tokens=N] "
      "[--temperature=T] [--top_k=K] [--seed=S] [--checkpoint=STEP_DIR]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "lockstep_sample: unexpected argument '%s' (flags take the form --name=value)\n",
                 positional[1]);
    return lockstep::kExitUsage;
  }
  try {
    return lockstep::Run();
  } catch (const lockstep::InvalidArgumentError& e) {
    std::fprintf(stderr, "lockstep_sample: %s\n", e.what());
    return lockstep::kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep_sample: error: %s\n", e.what());
    return 1;
  }
}
