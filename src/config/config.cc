#include "lockstep/config.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"
#include "absl/strings/strip.h"

namespace lockstep {
namespace {

namespace pb = google::protobuf;

// Collects the text-format parser's errors as "source:line:column: message (in
// `the offending line`)", so that a bad value is reported with its field name.
class ErrorList : public pb::io::ErrorCollector {
 public:
  ErrorList(std::string source, const std::string& text)
      : source_(std::move(source)), lines_(absl::StrSplit(text, '\n')) {}
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    std::string error = absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message);
    if (line >= 0 && static_cast<size_t>(line) < lines_.size()) {
      absl::StrAppend(&error, " (in `", absl::StripAsciiWhitespace(lines_[line]), "`)");
    }
    errors_.push_back(std::move(error));
  }
  void AddWarning(int line, pb::io::ColumnNumber column, const std::string& message) override {
    AddError(line, column, message);
  }
  std::string ToString() const { return absl::StrJoin(errors_, "; "); }

 private:
  const std::string source_;
  const std::vector<std::string> lines_;
  std::vector<std::string> errors_;
};

absl::Status ParseInto(const std::string& text, const std::string& source, pb::Message* message) {
  ErrorList errors(source, text);
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.MergeFromString(text, message)) return absl::InvalidArgumentError(errors.ToString());
  return absl::OkStatus();
}

// Sets every unset field to its default, recursively, so that printing shows them.
void FillDefaults(pb::Message* message) {
  const pb::Descriptor* descriptor = message->GetDescriptor();
  const pb::Reflection* reflection = message->GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* f = descriptor->field(i);
    if (f->is_repeated()) continue;
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      FillDefaults(reflection->MutableMessage(message, f));
      continue;
    }
    if (reflection->HasField(*message, f)) continue;
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32: reflection->SetInt32(message, f, f->default_value_int32()); break;
      case pb::FieldDescriptor::CPPTYPE_INT64: reflection->SetInt64(message, f, f->default_value_int64()); break;
      case pb::FieldDescriptor::CPPTYPE_UINT32: reflection->SetUInt32(message, f, f->default_value_uint32()); break;
      case pb::FieldDescriptor::CPPTYPE_UINT64: reflection->SetUInt64(message, f, f->default_value_uint64()); break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: reflection->SetDouble(message, f, f->default_value_double()); break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT: reflection->SetFloat(message, f, f->default_value_float()); break;
      case pb::FieldDescriptor::CPPTYPE_BOOL: reflection->SetBool(message, f, f->default_value_bool()); break;
      case pb::FieldDescriptor::CPPTYPE_ENUM: reflection->SetEnum(message, f, f->default_value_enum()); break;
      case pb::FieldDescriptor::CPPTYPE_STRING: reflection->SetString(message, f, f->default_value_string()); break;
      case pb::FieldDescriptor::CPPTYPE_MESSAGE: break;
    }
  }
}

// Accumulates the first violated rule, naming the field by its dotted path.
class Checker {
 public:
  template <typename T>
  void Require(bool ok, const std::string& field, const std::string& rule, const T& value) {
    if (!ok && status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat("config field '", field, "' ", rule, ", got ", value));
    }
  }
  absl::Status status() const { return status_; }

 private:
  absl::Status status_;
};

}  // namespace

absl::StatusOr<config::TrainerConfig> ParseConfig(const std::string& text, const std::string& source) {
  config::TrainerConfig cfg;
  absl::Status status = ParseInto(text, source, &cfg);
  if (!status.ok()) return status;
  return cfg;
}

absl::StatusOr<config::TrainerConfig> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open config file '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseConfig(text.str(), path);
}

absl::Status ApplyOverride(const std::string& assignment, config::TrainerConfig* cfg) {
  const std::vector<std::string> parts = absl::StrSplit(assignment, absl::MaxSplits('=', 1));
  if (parts.size() != 2 || parts[0].empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set '", assignment, "': expected field.path=value, e.g. optimizer.learning_rate=0.01"));
  }
  const std::string& path = parts[0];
  std::string value = parts[1];
  const std::vector<std::string> names = absl::StrSplit(path, '.');
  const pb::Descriptor* descriptor = cfg->GetDescriptor();
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) {
    const pb::FieldDescriptor* field = descriptor->FindFieldByName(names[i]);
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("--set '", assignment, "': ", descriptor->full_name(),
                                                     " has no field named '", names[i], "'"));
    }
    const bool last = i + 1 == names.size();
    const bool is_message = field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE;
    if (last == is_message) {
      return absl::InvalidArgumentError(absl::StrCat("--set '", assignment, "': field '", path, "' is ",
                                                     is_message ? "a message; name one of its fields" : "not a message"));
    }
    if (last) {
      if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING && !absl::StartsWith(value, "\"")) {
        value = absl::StrCat("\"", absl::CEscape(value), "\"");
      }
      absl::StrAppend(&text, names[i], ": ", value);
    } else {
      absl::StrAppend(&text, names[i], " { ");
      descriptor = field->message_type();
    }
  }
  for (size_t i = 1; i < names.size(); ++i) absl::StrAppend(&text, " }");
  config::TrainerConfig patch;
  absl::Status status = ParseInto(text, absl::StrCat("--set '", assignment, "'"), &patch);
  if (!status.ok()) return status;
  cfg->MergeFrom(patch);
  return absl::OkStatus();
}

void ResolveDerivedFields(config::TrainerConfig* cfg) {
  config::ScheduleConfig* schedule = cfg->mutable_schedule();
  if (schedule->decay() == config::ScheduleConfig::COSINE && schedule->decay_steps() == 0) {
    schedule->set_decay_steps(std::max<int64_t>(1, cfg->num_train_steps() - schedule->warmup_steps()));
  }
}

std::string ResumeRelevantConfigText(const config::TrainerConfig& config) {
  config::TrainerConfig c = config;
  for (const char* field : {"output_dir", "num_train_steps", "eval_every_steps", "summary_every_steps", "progress", "progress_updates",
                            "weight_metrics", "num_threads", "backend", "device", "bucket_mb",
                            "collective_timeout_seconds", "coordination", "checkpoint",
                            "partitioning", "fault_tolerance", "communication", "trace_steps"}) {
    const pb::FieldDescriptor* descriptor = c.GetDescriptor()->FindFieldByName(field);
    if (descriptor != nullptr) c.GetReflection()->ClearField(&c, descriptor);
  }
  return ConfigToText(c);
}

absl::Status ValidateConfig(const config::TrainerConfig& c, int world_size) {
  Checker check;
  const auto& m = c.model();
  check.Require(m.name() == "cnn" || m.name() == "mlp" || m.name() == "gpt", "model.name",
                "must be one of cnn, mlp, gpt", m.name());
  if (m.name() == "gpt") {
    check.Require(m.num_layers() > 0, "model.num_layers", "must be > 0", m.num_layers());
    check.Require(m.num_heads() > 0, "model.num_heads", "must be > 0", m.num_heads());
    check.Require(m.width() > 0, "model.width", "must be > 0", m.width());
    check.Require(m.num_heads() <= 0 || m.width() % m.num_heads() == 0, "model.num_heads",
                  absl::StrCat("must divide model.width (", m.width(), ")"), m.num_heads());
    check.Require(m.context_length() > 0, "model.context_length", "must be > 0", m.context_length());
    check.Require(m.vocab_size() >= 256, "model.vocab_size", "must be >= 256 (bytes are the tokens)",
                  m.vocab_size());
  }
  check.Require(m.hidden_units() > 0, "model.hidden_units", "must be > 0", m.hidden_units());
  check.Require(m.num_classes() >= 2, "model.num_classes", "must be >= 2", m.num_classes());
  check.Require(m.dropout() >= 0 && m.dropout() < 1, "model.dropout", "must be in [0, 1)", m.dropout());

  const auto& o = c.optimizer();
  check.Require(o.learning_rate() > 0 && std::isfinite(o.learning_rate()), "optimizer.learning_rate",
                "must be positive and finite", o.learning_rate());
  check.Require(o.momentum() >= 0 && o.momentum() < 1, "optimizer.momentum", "must be in [0, 1)", o.momentum());
  check.Require(!o.nesterov() || o.momentum() > 0, "optimizer.nesterov", "needs optimizer.momentum > 0",
                o.momentum());
  check.Require(o.weight_decay() >= 0, "optimizer.weight_decay", "must be >= 0", o.weight_decay());
  check.Require(o.beta1() >= 0 && o.beta1() < 1, "optimizer.beta1", "must be in [0, 1)", o.beta1());
  check.Require(o.beta2() >= 0 && o.beta2() < 1, "optimizer.beta2", "must be in [0, 1)", o.beta2());
  check.Require(o.epsilon() > 0, "optimizer.epsilon", "must be > 0", o.epsilon());

  const auto& s = c.schedule();
  check.Require(s.warmup_steps() >= 0, "schedule.warmup_steps", "must be >= 0", s.warmup_steps());
  check.Require(s.decay_steps() >= 0, "schedule.decay_steps", "must be >= 0", s.decay_steps());
  check.Require(s.final_fraction() >= 0 && s.final_fraction() <= 1, "schedule.final_fraction", "must be in [0, 1]",
                s.final_fraction());

  // The mesh: the global batch is split over its data axis.
  const auto& mesh = c.partitioning().mesh();
  check.Require(mesh.model() >= 1, "partitioning.mesh.model", "must be >= 1", mesh.model());
  check.Require(mesh.data() >= 0, "partitioning.mesh.data", "must be >= 0 (0: the world size / model)", mesh.data());
  const MeshShape shape = ToMeshShape(c, world_size);
  check.Require(shape.data >= 1 && shape.size() == world_size, "partitioning.mesh",
                absl::StrCat("must have data x model = the world size ", world_size),
                absl::StrCat(mesh.data() > 0 ? absl::StrCat(mesh.data()) : std::string("auto"), "x", mesh.model(),
                             " (data x model)"));
  const int data_ranks = std::max(1, shape.data);
  if (shape.model > 1) {
    check.Require(m.name() == "gpt", "partitioning.mesh.model",
                  "above 1 needs model.name gpt (the model whose parameters name their logical axes)", shape.model);
    check.Require(m.dropout() == 0, "model.dropout", "must be 0 with a model axis above 1 (not supported yet)",
                  m.dropout());
    check.Require(c.partitioning().strategy() != "fully_sharded", "partitioning.strategy",
                  "must be replicated, sharded_optimizer_state or sharded_gradients with a model axis above 1 "
                  "(fully_sharded parameters over the data axis of a 2-D mesh are not supported)",
                  c.partitioning().strategy());
    if (m.name() == "gpt" && check.status().ok()) {
      try {
        const Partitioner partitioner(ToPartitionRules(c), shape);
        GptParameterLayouts(ToModelOptions(m).gpt, partitioner);
      } catch (const InvalidArgumentError& e) {
        check.Require(false, "partitioning", e.what(), DescribeMesh(shape));
      }
    }
  }

  const auto& d = c.data();
  check.Require(d.global_batch_size() > 0, "data.global_batch_size", "must be > 0", d.global_batch_size());
  check.Require(d.global_batch_size() % data_ranks == 0, "data.global_batch_size",
                shape.model > 1 ? absl::StrCat("must be divisible by the mesh's data axis ", data_ranks)
                                : absl::StrCat("must be divisible by the world size ", world_size),
                d.global_batch_size());
  check.Require(d.eval_batch_size() > 0, "data.eval_batch_size", "must be > 0", d.eval_batch_size());
  check.Require(d.source() != config::DataConfig::FASHION_MNIST || !d.dir().empty(), "data.dir",
                "must name the Fashion-MNIST folder", "\"\"");
  check.Require(d.synthetic_train_examples() > 0, "data.synthetic_train_examples", "must be > 0",
                d.synthetic_train_examples());
  check.Require(d.synthetic_eval_examples() > 0, "data.synthetic_eval_examples", "must be > 0",
                d.synthetic_eval_examples());
  const bool tokens = d.source() == config::DataConfig::TOKENS;
  check.Require(tokens == (m.name() == "gpt"), "data.source",
                "TOKENS goes with model.name gpt, and gpt with TOKENS",
                absl::StrCat(config::DataConfig::Source_Name(d.source()), " with model ", m.name()));
  check.Require(!tokens || !d.token_dir().empty(), "data.token_dir", "must name the folder of train.bin and eval.bin",
                "\"\"");
  check.Require(d.sequence_length() >= 0, "data.sequence_length", "must be >= 0 (0: model.context_length)",
                d.sequence_length());
  check.Require(d.sequence_length() <= m.context_length(), "data.sequence_length",
                absl::StrCat("is longer than model.context_length (", m.context_length(), ")"), d.sequence_length());
  check.Require(d.prefetch_batches() >= 1, "data.prefetch_batches", "must be >= 1", d.prefetch_batches());

  check.Require(c.num_train_steps() > 0, "num_train_steps", "must be > 0", c.num_train_steps());
  check.Require(c.eval_every_steps() >= 0, "eval_every_steps", "must be >= 0", c.eval_every_steps());
  check.Require(c.summary_every_steps() > 0, "summary_every_steps", "must be > 0", c.summary_every_steps());
  check.Require(c.num_microbatches() >= 1, "num_microbatches", "must be >= 1", c.num_microbatches());
  check.Require(d.global_batch_size() <= 0 || c.num_microbatches() <= d.global_batch_size() / data_ranks,
                "num_microbatches",
                "must not exceed the per-rank batch size (data.global_batch_size / the world size, or the mesh's data "
                "axis)",
                c.num_microbatches());
  check.Require(c.max_grad_norm() >= 0 && std::isfinite(c.max_grad_norm()), "max_grad_norm",
                "must be >= 0 (0 disables clipping)", c.max_grad_norm());
  check.Require(!c.output_dir().empty(), "output_dir", "must not be empty", "\"\"");
  check.Require(c.num_threads() >= 0, "num_threads", "must be >= 0", c.num_threads());
  check.Require(c.backend() == "auto" || c.backend() == "mpi" || c.backend() == "gloo" || c.backend() == "nccl",
                "backend", "must be one of auto, mpi, gloo, nccl", c.backend());
  check.Require(c.device() == "auto" || c.device() == "cpu" || c.device().rfind("cuda", 0) == 0, "device",
                "must be auto, cpu, cuda or cuda:N", c.device());
  check.Require(c.bucket_mb() > 0, "bucket_mb", "must be > 0", c.bucket_mb());
  const std::string& strategy = c.partitioning().strategy();
  check.Require(ParsePartitioningStrategy(strategy).has_value(), "partitioning.strategy",
                "must be one of replicated, sharded_optimizer_state, sharded_gradients, fully_sharded", strategy);
  check.Require(strategy != "fully_sharded" || !c.weight_metrics(), "weight_metrics",
                "must be false with partitioning.strategy fully_sharded (its parameters are not kept whole)",
                c.weight_metrics());
  check.Require(c.progress() == "auto" || c.progress() == "bar" || c.progress() == "lines", "progress",
                "must be one of auto, bar, lines", c.progress());
  check.Require(c.progress_updates() == "summary" || c.progress_updates() == "step", "progress_updates",
                "must be summary or step", c.progress_updates());
  const auto& e = c.early_stopping();
  check.Require(e.mode() == "min" || e.mode() == "max", "early_stopping.mode", "must be min or max", e.mode());
  check.Require(e.patience() >= 0, "early_stopping.patience", "must be >= 0", e.patience());
  check.Require(e.atol() >= 0, "early_stopping.atol", "must be >= 0", e.atol());
  check.Require(e.rtol() >= 0, "early_stopping.rtol", "must be >= 0", e.rtol());
  check.Require(c.collective_timeout_seconds() > 0, "collective_timeout_seconds", "must be > 0",
                c.collective_timeout_seconds());
  for (int64_t step : c.trace_steps()) {
    check.Require(step >= 1 && step <= c.num_train_steps(), "trace_steps",
                  absl::StrCat("must be steps in [1, num_train_steps = ", c.num_train_steps(), "]"), step);
  }
  const auto& comm = c.communication();
  check.Require(comm.hook() == "none" || comm.hook() == "bf16" || comm.hook() == "fp16" || comm.hook() == "powersgd",
                "communication.hook", "must be one of none, bf16, fp16, powersgd", comm.hook());
  check.Require(comm.powersgd_rank() >= 1, "communication.powersgd_rank", "must be >= 1", comm.powersgd_rank());
  check.Require(comm.powersgd_start_step() >= 0, "communication.powersgd_start_step", "must be >= 0",
                comm.powersgd_start_step());
  check.Require(comm.ranks_per_host() >= 0, "communication.ranks_per_host", "must be >= 0 (0: by host name)",
                comm.ranks_per_host());
  check.Require(comm.ranks_per_host() <= 0 || world_size % comm.ranks_per_host() == 0, "communication.ranks_per_host",
                absl::StrCat("must divide the world size ", world_size), comm.ranks_per_host());
  for (double mb : comm.autotune_bucket_mb()) {
    check.Require(mb > 0 && std::isfinite(mb), "communication.autotune_bucket_mb", "must be sizes > 0", mb);
  }
  check.Require(comm.autotune_steps() >= 1, "communication.autotune_steps", "must be >= 1", comm.autotune_steps());
  const bool custom_comm = comm.hook() != "none" || comm.hierarchical() || comm.autotune_buckets();
  check.Require(!custom_comm || strategy == "replicated", "partitioning.strategy",
                "must be replicated with a communication hook, hierarchical all-reduce or bucket autotuning (the "
                "sharded strategies reduce-scatter their gradients in units of bucket_mb)",
                strategy);
  check.Require(!comm.hierarchical() || c.partitioning().mesh().model() <= 1, "communication.hierarchical",
                "must be false with a model axis above 1 (not supported yet)", comm.hierarchical());
  check.Require(!comm.hierarchical() || comm.hook() != "powersgd", "communication.hierarchical",
                "must be false with the powersgd hook (it needs whole buckets; the hierarchy sends slices)",
                comm.hierarchical());
  check.Require(!custom_comm || !c.fault_tolerance().enabled(), "fault_tolerance.enabled",
                "must be false with a communication hook, hierarchical all-reduce or bucket autotuning (not supported "
                "yet)",
                c.fault_tolerance().enabled());
  if (c.fault_tolerance().enabled()) {
    const auto& f = c.fault_tolerance();
    check.Require(f.min_ranks() >= 1 && f.min_ranks() <= world_size, "fault_tolerance.min_ranks",
                  absl::StrCat("must be in [1, ", world_size, "] (the world size)"), f.min_ranks());
    check.Require(strategy == "replicated", "partitioning.strategy",
                  "must be replicated with fault_tolerance (sharded state is not rebuilt on fewer ranks in flight)",
                  strategy);
    check.Require(c.partitioning().mesh().model() <= 1, "partitioning.mesh.model",
                  "must be 1 with fault_tolerance (a model axis cannot lose a rank)", c.partitioning().mesh().model());
    check.Require(c.backend() == "auto" || c.backend() == "gloo", "backend",
                  "must be gloo or auto with fault_tolerance (its groups are Gloo's)", c.backend());
    check.Require(!c.coordination().standalone(), "coordination.standalone",
                  "must be false with fault_tolerance (rank 0 hosts the service)", c.coordination().standalone());
  }
  const auto& k = c.coordination();
  check.Require(k.mode() == "auto" || k.mode() == "on" || k.mode() == "off", "coordination.mode",
                "must be one of auto, on, off", k.mode());
  check.Require(k.address().empty() || (k.address().rfind(':') != std::string::npos && k.address().rfind(':') > 0 &&
                                        k.address().rfind(':') + 1 < k.address().size()),
                "coordination.address", "must be host:port", k.address());
  check.Require(k.port() > 0 && k.port() < 65536, "coordination.port", "must be in 1-65535", k.port());
  check.Require(k.heartbeat_timeout_seconds() > 0 && std::isfinite(k.heartbeat_timeout_seconds()),
                "coordination.heartbeat_timeout_seconds", "must be > 0", k.heartbeat_timeout_seconds());
  check.Require(k.register_timeout_seconds() > 0 && std::isfinite(k.register_timeout_seconds()),
                "coordination.register_timeout_seconds", "must be > 0", k.register_timeout_seconds());
  check.Require(k.tls_cert_file().empty() == k.tls_key_file().empty(), "coordination.tls_key_file",
                "must be given together with coordination.tls_cert_file", k.tls_key_file());
  check.Require(!k.standalone() || k.mode() != "off", "coordination.standalone", "needs coordination.mode on or auto",
                k.mode());
  const auto& ck = c.checkpoint();
  check.Require(ck.every_steps() >= 0, "checkpoint.every_steps", "must be >= 0", ck.every_steps());
  check.Require(ck.keep_last() >= 1, "checkpoint.keep_last", "must be >= 1", ck.keep_last());
  check.Require(ck.keep_best() >= 0, "checkpoint.keep_best", "must be >= 0", ck.keep_best());
  check.Require(ck.best_mode() == "min" || ck.best_mode() == "max", "checkpoint.best_mode", "must be min or max",
                ck.best_mode());
  check.Require(ck.best_metric().find('/') != std::string::npos, "checkpoint.best_metric",
                "must be task/metric, e.g. test/accuracy", ck.best_metric());
  return check.status();
}

absl::StatusOr<config::TrainerConfig> BuildConfig(const std::string& path, const std::vector<std::string>& overrides,
                                                  int world_size) {
  config::TrainerConfig cfg;
  if (!path.empty()) {
    absl::StatusOr<config::TrainerConfig> loaded = LoadConfigFile(path);
    if (!loaded.ok()) return loaded.status();
    cfg = *std::move(loaded);
  }
  for (const std::string& assignment : overrides) {
    absl::Status status = ApplyOverride(assignment, &cfg);
    if (!status.ok()) return status;
  }
  FillDefaults(&cfg);
  ResolveDerivedFields(&cfg);
  absl::Status status = ValidateConfig(cfg, world_size);
  if (!status.ok()) return status;
  return cfg;
}

std::string ConfigToText(const config::TrainerConfig& cfg) {
  config::TrainerConfig full = cfg;
  FillDefaults(&full);
  std::string text;
  pb::TextFormat::PrintToString(full, &text);
  return text;
}

OptimizerOptions ToOptimizerOptions(const config::OptimizerConfig& c) {
  OptimizerOptions o;
  switch (c.kind()) {
    case config::OptimizerConfig::SGD: o.kind = OptimizerOptions::Kind::kSgd; break;
    case config::OptimizerConfig::ADAM: o.kind = OptimizerOptions::Kind::kAdam; break;
    case config::OptimizerConfig::ADAMW: o.kind = OptimizerOptions::Kind::kAdamW; break;
  }
  o.learning_rate = c.learning_rate();
  o.momentum = c.momentum();
  o.nesterov = c.nesterov();
  o.weight_decay = c.weight_decay();
  o.beta1 = c.beta1();
  o.beta2 = c.beta2();
  o.epsilon = c.epsilon();
  return o;
}

LrSchedule ToLrSchedule(const config::TrainerConfig& c) {
  LrSchedule s;
  s.peak = c.optimizer().learning_rate();
  switch (c.schedule().decay()) {
    case config::ScheduleConfig::CONSTANT: s.decay = LrSchedule::Decay::kConstant; break;
    case config::ScheduleConfig::COSINE: s.decay = LrSchedule::Decay::kCosine; break;
    case config::ScheduleConfig::RSQRT: s.decay = LrSchedule::Decay::kRsqrt; break;
  }
  s.warmup_steps = c.schedule().warmup_steps();
  s.decay_steps = c.schedule().decay_steps();
  s.final_fraction = c.schedule().final_fraction();
  return s;
}

MeshShape ToMeshShape(const config::TrainerConfig& c, int world_size) {
  MeshShape shape;
  shape.model = std::max(1, c.partitioning().mesh().model());
  shape.data = c.partitioning().mesh().data() > 0 ? c.partitioning().mesh().data() : world_size / shape.model;
  return shape;
}

PartitionRules ToPartitionRules(const config::TrainerConfig& c) {
  if (c.partitioning().rules().empty()) return DefaultTransformerRules();
  PartitionRules rules;
  for (const config::PartitionRuleConfig& r : c.partitioning().rules()) rules.push_back({r.logical_axis(), r.mesh_axis()});
  return rules;
}

Runtime DataAxisRuntime(const Runtime& runtime, const MeshShape& shape) {
  Runtime out = runtime;
  out.rank = runtime.rank / shape.model;
  out.world_size = shape.data;
  return out;
}

ModelOptions ToModelOptions(const config::ModelConfig& c) {
  ModelOptions m;
  m.name = c.name();
  m.hidden_units = c.hidden_units();
  m.num_classes = c.num_classes();
  m.dropout = c.dropout();
  m.gpt.num_layers = c.num_layers();
  m.gpt.num_heads = c.num_heads();
  m.gpt.width = c.width();
  m.gpt.context_length = c.context_length();
  m.gpt.vocab_size = c.vocab_size();
  m.gpt.dropout = c.dropout();
  return m;
}

}  // namespace lockstep
