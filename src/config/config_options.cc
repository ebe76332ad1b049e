// Config -> the options of the job layer, the trainer, checkpoints and data.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lockstep/actions.h"
#include "lockstep/comm_hooks.h"
#include "lockstep/config.h"
#include "lockstep/hashing.h"
#include "lockstep/summary_writers.h"

namespace lockstep {

JobEnvironmentOptions ToJobEnvironmentOptions(const config::TrainerConfig& cfg) {
  JobEnvironmentOptions o;
  o.device = cfg.device();
  o.backend = cfg.backend();
  o.collective_timeout = absl::Seconds(cfg.collective_timeout_seconds());
  // A mesh, the hierarchy and the flat all-reduce in host order run split
  // communicators side by side (the last only on several hosts: see job.cc).
  o.mpi_thread_multiple = cfg.partitioning().mesh().model() > 1 || cfg.communication().hierarchical();
  o.mpi_thread_multiple_on_several_hosts = cfg.communication().order_by_host() && !cfg.fault_tolerance().enabled();
  const config::CoordinationConfig& c = cfg.coordination();
  o.coordination.mode = c.mode();
  o.coordination.address = c.address();
  o.coordination.port = c.port();
  o.coordination.standalone = c.standalone();
  o.coordination.bind_all = c.bind_all();
  o.coordination.job_id = c.job_id();
  o.coordination.token_file = c.token_file();
  o.coordination.heartbeat_timeout = absl::Seconds(c.heartbeat_timeout_seconds());
  o.coordination.register_timeout = absl::Seconds(c.register_timeout_seconds());
  o.coordination.tls.cert_file = c.tls_cert_file();
  o.coordination.tls.key_file = c.tls_key_file();
  o.coordination.tls.ca_file = c.tls_ca_file();
  o.fault_tolerance.enabled = cfg.fault_tolerance().enabled();
  o.fault_tolerance.min_ranks = cfg.fault_tolerance().min_ranks();
  return o;
}

JobOptions ToJobOptions(const config::TrainerConfig& cfg) {
  JobOptions o;
  o.num_train_steps = cfg.num_train_steps();
  o.eval_every_steps = cfg.eval_every_steps();
  o.final_checkpoint = cfg.checkpoint().final();
  o.trace_steps = std::set<int64_t>(cfg.trace_steps().begin(), cfg.trace_steps().end());
  if (!o.trace_steps.empty()) o.trace_dir = (std::filesystem::path(cfg.output_dir()) / "trace").string();
  return o;
}

CheckpointOptions ToCheckpointOptions(const config::TrainerConfig& cfg) {
  const config::CheckpointConfig& c = cfg.checkpoint();
  CheckpointOptions o;
  o.directory = c.dir().empty() ? (std::filesystem::path(cfg.output_dir()) / "checkpoints").string() : c.dir();
  o.every_steps = c.every_steps();
  o.keep_last = c.keep_last();
  o.keep_best = c.keep_best();
  o.best_metric = c.best_metric();
  o.best_max = c.best_mode() == "max";
  o.async = c.async();
  o.overlap_copy = c.overlap_copy();  // the update awaits the copy (BaseTrainer::BeforeUpdate)
  o.config_text = ResumeRelevantConfigText(cfg);
  o.config_fingerprint = StableHash(o.config_text);
  o.barrier_timeout = absl::Seconds(cfg.collective_timeout_seconds());
  return o;
}

TrainerOptions ToTrainerOptions(const config::TrainerConfig& cfg) {
  TrainerOptions o;
  o.step.num_microbatches = cfg.num_microbatches();
  o.step.max_grad_norm = cfg.max_grad_norm();
  o.step.schedule = ToLrSchedule(cfg);
  o.step.weight_metrics = cfg.weight_metrics();
  o.summary_every_steps = cfg.summary_every_steps();
  o.data_parallel.bucket_bytes = static_cast<size_t>(cfg.bucket_mb() * (1 << 20));
  o.data_parallel.collective.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(cfg.collective_timeout_seconds() * 1000));
  const config::CommunicationConfig& comm = cfg.communication();
  PowerSgdOptions powersgd;
  powersgd.rank = comm.powersgd_rank();
  powersgd.start_step = comm.powersgd_start_step();
  powersgd.seed = cfg.seed();
  o.data_parallel.comm_hook = MakeCommHook(comm.hook(), powersgd);
  o.data_parallel.hierarchical = comm.hierarchical();
  o.data_parallel.ranks_per_host = comm.ranks_per_host();
  // The reordered group would not follow a world that fault tolerance shrinks.
  o.data_parallel.order_by_host = comm.order_by_host() && !cfg.fault_tolerance().enabled();
  if (comm.autotune_buckets()) {
    std::vector<double> sizes(comm.autotune_bucket_mb().begin(), comm.autotune_bucket_mb().end());
    if (sizes.empty()) sizes = {1, 4, 16, 64};
    for (double mb : sizes) o.data_parallel.autotune_bucket_bytes.push_back(static_cast<size_t>(mb * (1 << 20)));
    o.data_parallel.autotune_steps = comm.autotune_steps();
  }
  o.partitioning = ParsePartitioningStrategy(cfg.partitioning().strategy()).value_or(PartitioningStrategy::kReplicated);
  // Ranks must agree on the model, not on how they split it (a resumed run may
  // choose another strategy): the trainer's start-up check leaves it out.
  config::TrainerConfig agreed = cfg;
  agreed.clear_partitioning();
  o.fingerprint = ConfigToText(agreed);
  return o;
}

void AddConfiguredActions(const config::TrainerConfig& cfg, BaseTrainer& trainer) {
  if (cfg.terminate_on_nan()) trainer.AddAction(std::make_unique<TerminateOnNanAction>("train", kLoss));
  if (cfg.early_stopping().enabled()) {
    const config::EarlyStoppingConfig& e = cfg.early_stopping();
    trainer.AddAction(std::make_unique<EarlyStoppingAction>(
        e.task(), e.metric(), e.mode() == "max" ? EarlyStoppingAction::Mode::kMax : EarlyStoppingAction::Mode::kMin,
        e.patience(), e.atol(), e.rtol()));
  }
}

RunWriters AddConfiguredWriters(const config::TrainerConfig& cfg, const Runtime& runtime, BaseTrainer& trainer) {
  RunWriters writers;
  if (!runtime.is_chief()) return writers;
  auto events = std::make_shared<TensorBoardWriter>(cfg.output_dir());
  auto jsonl = std::make_shared<JsonlWriter>(cfg.output_dir());
  writers.plotter = std::make_shared<CurvePlotter>();
  trainer.AddSummaryWriter([events](const Summary& s) { (*events)(s); });
  trainer.AddSummaryWriter([jsonl](const Summary& s) { (*jsonl)(s); });
  trainer.AddSummaryWriter([plotter = writers.plotter](const Summary& s) { (*plotter)(s); });
  bool bar = cfg.progress() == "bar";
  if (cfg.progress() == "auto") {
    const char* told = std::getenv("LOCKSTEP_STDOUT_IS_TERMINAL");
    bar = told != nullptr ? std::string(told) == "1" : runtime.launcher != "mpirun" && IsTerminal(stdout);
  }
  if (bar) {
    writers.progress = std::make_shared<ProgressBar>(cfg.num_train_steps());
    trainer.AddSummaryWriter([progress = writers.progress](const Summary& s) { (*progress)(s); });
  } else {
    trainer.AddSummaryWriter(StdoutLogger{});
  }
  return writers;
}

void CheckModelFitsInMemory(const config::TrainerConfig& cfg, const ModelOptions& model) {
  const double parameters = CountModelParameters(model);
  // Weights and gradients in float32, and the optimizer's state per weight.
  const bool adam = cfg.optimizer().kind() != config::OptimizerConfig::SGD;
  const double bytes_per_parameter = 4 + 4 + (adam ? 8 : 4);
  const double needed = parameters * bytes_per_parameter;
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (memory > 0 && needed > memory) {
    throw InvalidArgumentError(absl::StrFormat(
        "config: %s makes the %s model %.3g parameters, which need %.3g GB for weights, gradients "
        "and %s state (%.0f bytes each), more than this machine's %.3g GB of memory",
        model.name == "gpt" ? absl::StrFormat("model.width=%d, model.num_layers=%d", cfg.model().width(),
                                              cfg.model().num_layers())
                            : absl::StrFormat("model.hidden_units=%d", cfg.model().hidden_units()),
        model.name, parameters, needed / 1e9, adam ? "Adam's" : "SGD's",
        bytes_per_parameter, memory / 1e9));
  }
}

void WriteResolvedConfig(const config::TrainerConfig& cfg, const Runtime& runtime) {
  if (!runtime.is_chief()) return;
  const std::filesystem::path dir = cfg.output_dir();
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "config.textproto";
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << ConfigToText(cfg);
    out.flush();
    if (!out) throw Error("cannot write '" + tmp.string() + "'");
  }
  std::filesystem::rename(tmp, path);
}

Datasets LoadDatasets(const config::TrainerConfig& cfg) {
  const config::DataConfig& d = cfg.data();
  Datasets data;
  if (d.source() == config::DataConfig::TOKENS) {
    const std::filesystem::path dir = d.token_dir();
    for (const char* name : {"train.bin", "eval.bin"}) {
      if (!std::filesystem::exists(dir / name)) {
        throw DataError(absl::StrCat("data: '", (dir / name).string(), "' is missing; prepare it with: ",
                                     "data/prepare_kjv.py ", dir.string(), "  (needs apt-get install bible-kjv bible-kjv-text)"));
      }
    }
    data.train_tokens = TokenFile::Open((dir / "train.bin").string());
    data.eval_tokens = TokenFile::Open((dir / "eval.bin").string());
    data.description = "tokens from " + dir.string();
  } else if (d.source() == config::DataConfig::SYNTHETIC) {
    SyntheticOptions train;
    train.num_examples = d.synthetic_train_examples();
    train.num_classes = cfg.model().num_classes();
    train.seed = cfg.seed();
    train.teacher_seed = cfg.seed();
    SyntheticOptions test = train;
    test.num_examples = d.synthetic_eval_examples();
    test.seed = cfg.seed() + 1;
    data.train = std::make_shared<const TensorDataset>(MakeSyntheticDataset(train));
    data.test = std::make_shared<const TensorDataset>(MakeSyntheticDataset(test));
    data.description = "synthetic";
  } else {
    data.train = std::make_shared<const TensorDataset>(LoadFashionMnist(d.dir(), Split::kTrain));
    data.test = std::make_shared<const TensorDataset>(LoadFashionMnist(d.dir(), Split::kTest));
    data.description = "Fashion-MNIST from " + d.dir();
  }
  return data;
}

ShardingOptions ToTrainSharding(const config::TrainerConfig& cfg, const Runtime& runtime) {
  ShardingOptions o;
  o.global_batch_size = cfg.data().global_batch_size();
  o.rank = runtime.rank;
  o.world_size = runtime.world_size;
  o.seed = cfg.seed();
  o.shuffle = cfg.data().shuffle();
  return o;
}

ShardingOptions ToEvalSharding(const config::TrainerConfig& cfg, const Runtime& runtime) {
  ShardingOptions o = ToTrainSharding(cfg, runtime);
  o.global_batch_size = cfg.data().eval_batch_size();
  o.shuffle = false;
  o.num_epochs = 1;
  return o;
}

int64_t SequenceLength(const config::TrainerConfig& cfg) {
  return cfg.data().sequence_length() > 0 ? cfg.data().sequence_length() : cfg.model().context_length();
}

namespace {

TokenWindowOptions ToTokenWindows(const ShardingOptions& sharding, const config::TrainerConfig& cfg) {
  TokenWindowOptions o;
  o.sequence_length = SequenceLength(cfg);
  o.global_batch_size = sharding.global_batch_size;
  o.rank = sharding.rank;
  o.world_size = sharding.world_size;
  o.seed = sharding.seed;
  o.num_epochs = sharding.num_epochs;
  return o;
}

}  // namespace

std::unique_ptr<BatchIterator> MakeTrainIterator(const config::TrainerConfig& cfg, const Datasets& data,
                                                 const Runtime& runtime) {
  // A global batch larger than the train set cannot be filled: every step would be
  // the whole set (a smaller batch than asked, and with a huge number, a step that
  // takes hours or more memory than the machine has). Refuse it by name.
  const int64_t batch = cfg.data().global_batch_size();
  // (Windows refuses a non-positive sequence length by name, in a config that
  // skipped validation.)
  const int64_t length = SequenceLength(cfg);
  const int64_t examples =
      data.tokens() ? TokenWindowIterator::Windows(data.train_tokens->size(), length) : data.train->size();
  if (batch > examples) {
    throw InvalidArgumentError(absl::StrFormat(
        "config: data.global_batch_size=%d is larger than the train set, which holds %d %s; "
        "use a global batch of at most %d",
        batch, examples,
        data.tokens() ? absl::StrFormat("windows of %d tokens", length) : std::string("examples"),
        examples));
  }
  if (!data.tokens()) return std::make_unique<ShardedBatchIterator>(data.train, ToTrainSharding(cfg, runtime));
  TokenWindowOptions o = ToTokenWindows(ToTrainSharding(cfg, runtime), cfg);
  o.random_windows = true;
  return std::make_unique<PrefetchingIterator>(std::make_unique<TokenWindowIterator>(data.train_tokens, o),
                                               cfg.data().prefetch_batches());
}

std::unique_ptr<BatchIterator> MakeEvalIterator(const config::TrainerConfig& cfg, const Datasets& data,
                                                const Runtime& runtime) {
  if (!data.tokens()) return std::make_unique<ShardedBatchIterator>(data.test, ToEvalSharding(cfg, runtime));
  TokenWindowOptions o = ToTokenWindows(ToEvalSharding(cfg, runtime), cfg);
  o.random_windows = false;
  return std::make_unique<TokenWindowIterator>(data.eval_tokens, o);
}

}  // namespace lockstep
