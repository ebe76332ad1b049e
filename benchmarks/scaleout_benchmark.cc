// The Lockstep half of the scale-out suite (benchmarks/scaleout.sh runs it next to
// PyTorch DDP and writes the tables, JSON and plots). One process per rank, under
// mpirun; rank 0 prints one JSON object on the last line of stdout.
//
//   launch/mpirun.sh -n 2 -- build/benchmarks/scaleout_benchmark --model=small_mlp --batch_per_rank=32
//   launch/mpirun.sh -n 2 -- build/benchmarks/scaleout_benchmark --mode=collectives
//
// --mode=train: the data-parallel Trainer (MPI communicator, synthetic batches)
// on one model. After warm-up, `rounds` rounds each time steps/rounds steps with
// communication ("sync": the Trainer with the communicator) and, on more than one
// rank, as many without ("nosync": a Trainer on the same state without a
// communicator, every rank computing alone, as DDP's no_sync()). A barrier
// separates the phases. Reports, per rank, the median step time of each phase,
// the median time blocked on communication per sync step (DataParallel's
// communication_wait_seconds, of which the gradient buckets'), peak RSS, and a
// forward / backward / optimizer breakdown from a hand-written loop on the same
// model and batches.
//
// --partitioning picks how the ranks partition the train state
// (TrainerOptions::partitioning; any name ParsePartitioningStrategy accepts), and
// the JSON reports the bytes of parameters, gradients and optimizer state each
// rank holds after the timed steps: ShardedDataParallel::bytes() under a sharded
// strategy on more than one rank, otherwise the same three counted from the
// model's parameters, their .grad and the optimizer's state tensors, so that the
// ratio of the two is like for like. Under a sharded strategy there is no nosync
// phase and no breakdown loop: both drive the optimizer outside the sharded step,
// and it now holds this rank's slices only.
//
// --mesh_model=M (the GPT): the ranks form a (ranks / M) x M mesh, the model is
// split over the model axis as DefaultTransformerRules say and trained data
// parallel over the data axis; --global_batch fixes the examples per step so that
// meshes of the same world compare at the same work. The JSON adds the mesh and
// the bytes per rank; there is no nosync phase.
//
// --mode=collectives: all-reduce of float32 messages of each size, the
// Communicator against raw MPI_Allreduce on MPI_COMM_WORLD, in the same run: on
// a buffer from AllocateCollectiveBuffer, as gradient buckets use ("lockstep_s"),
// on an ordinary tensor ("lockstep_plain_s"), and the Gloo communicator (libtorch's
// c10d ProcessGroupGloo over loopback TCP, "gloo_s") when this build has it; its
// ranks meet through the coordination service that the job environment starts.
// Every rank runs the same fixed iteration counts (collectives must match).
#include <ATen/ATen.h>
#include <malloc.h>
#include <mpi.h>
#include <sys/resource.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "lockstep/data.h"
#include "lockstep/gpt.h"
#include "lockstep/mesh.h"
#include "lockstep/gloo_communicator.h"
#include "lockstep/job.h"
#include "lockstep/models.h"
#include "lockstep/mpi_communicator.h"
#include "lockstep/runtime.h"
#include "lockstep/comm_hooks.h"
#include "lockstep/sharded_data_parallel.h"
#include "lockstep/torch_setup.h"
#include "lockstep/trainer.h"

ABSL_FLAG(std::string, mode, "train", "train or collectives");
ABSL_FLAG(std::string, model, "small_mlp",
          "small_mlp (784-256-256-10), wide_mlp (1024-4096-4096-1024), cnn, or gpt (configs/kjv_gpt.textproto's "
          "GPT on random bytes)");
ABSL_FLAG(int64_t, batch_per_rank, 32, "examples per rank per step (weak scaling)");
ABSL_FLAG(std::string, optimizer, "sgd", "sgd (momentum 0.9) or adam");
ABSL_FLAG(std::string, partitioning, "replicated",
          "how the ranks partition the train state: replicated, sharded_optimizer_state, sharded_gradients, or "
          "any other strategy lockstep::ParsePartitioningStrategy accepts");
ABSL_FLAG(bool, nosync_phase, true, "also time steps without communication (nosync) on more than one rank");
ABSL_FLAG(int, threads, 1, "intra-op threads per rank");
ABSL_FLAG(int, warmup_steps, 5, "untimed steps of each phase before the timed ones");
ABSL_FLAG(int, steps, 40, "timed steps per phase, spread over the rounds");
ABSL_FLAG(int, rounds, 4, "alternations of the sync and nosync phases");
ABSL_FLAG(int, breakdown_steps, 10, "timed steps of the hand-written forward/backward/optimizer loop");
ABSL_FLAG(double, bucket_mb, 25, "gradient bucket size in MiB");
ABSL_FLAG(int64_t, chunk_kib, 1024, "the MPI communicator's chunk size (MpiOptions::chunk_bytes), KiB");
ABSL_FLAG(int, chunks_in_flight, 4, "the MPI communicator's MpiOptions::chunks_in_flight");
ABSL_FLAG(bool, shared_memory_buffers, true,
          "the MPI communicator's MpiOptions::shared_memory_buffers (gradient buckets in shared memory on one host)");
ABSL_FLAG(int, mesh_model, 1,
          "the model axis of a data x model mesh (gpt only): each model is split over this many ranks (tensor "
          "parallelism, DefaultTransformerRules), data replicas = ranks / mesh_model");
ABSL_FLAG(int64_t, global_batch, 0,
          "examples per step over all data replicas (each takes global_batch / replicas); 0: batch_per_rank x "
          "replicas (weak scaling)");
ABSL_FLAG(std::string, comm_hook, "none", "gradient communication hook: none, bf16, fp16 or powersgd");
ABSL_FLAG(int, powersgd_rank, 4, "PowerSGD's rank");
ABSL_FLAG(int64_t, powersgd_start_step, 2, "PowerSGD: plain all-reduce steps before it starts");
ABSL_FLAG(bool, hierarchical, false, "hierarchical all-reduce (several hosts with several ranks each)");
ABSL_FLAG(int, ranks_per_host, 0, "for the hierarchy: consecutive ranks per host; 0: by host name");
ABSL_FLAG(bool, order_by_host, true,
          "flat all-reduce over the ranks sorted by host when the launcher interleaved the hosts");
ABSL_FLAG(std::string, sizes, "8,4096,65536,262144,1048576,4194304,16777216,67108864",
          "collectives: message sizes in bytes, comma-separated");

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double MaxRssMib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux reports KiB
}

// This process's proportional set size (PSS), MiB: its private pages plus its share
// of each shared page (a shared-memory segment mapped by 2 ranks counts half in
// each), which peak RSS counts whole in every rank that touched it. 0 when
// /proc/self/smaps_rollup cannot be read.
double PssMib() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return 0.0;
  char line[256];
  double kib = 0.0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    long long value = 0;
    if (std::sscanf(line, "Pss: %lld kB", &value) == 1) {
      kib = static_cast<double>(value);
      break;
    }
  }
  std::fclose(f);
  return kib / 1024.0;
}

// Every rank's values, rank by rank (each rank passes the same count).
std::vector<double> GatherAll(Communicator& comm, const std::vector<double>& mine) {
  at::Tensor in = at::tensor(mine, at::kDouble);
  at::Tensor out = at::zeros({static_cast<int64_t>(mine.size()) * comm.world_size()}, at::kDouble);
  comm.AllGather(out, in);
  const double* v = out.data_ptr<double>();
  return std::vector<double>(v, v + out.numel());
}

// A tiny JSON writer: enough for numbers, strings and arrays of numbers.
class Json {
 public:
  Json& Num(const std::string& key, double value) {
    Key(key);
    out_ << value;
    return *this;
  }
  Json& Str(const std::string& key, const std::string& value) {
    Key(key);
    out_ << '"' << value << '"';
    return *this;
  }
  Json& Array(const std::string& key, const std::vector<double>& values) {
    Key(key);
    out_ << '[';
    for (size_t i = 0; i < values.size(); ++i) out_ << (i ? "," : "") << values[i];
    out_ << ']';
    return *this;
  }
  Json& Raw(const std::string& key, const std::string& json) {
    Key(key);
    out_ << json;
    return *this;
  }
  std::string Done() { return out_.str() + "}"; }

 private:
  void Key(const std::string& key) {
    out_ << (first_ ? "{" : ",") << '"' << key << "\":";
    first_ = false;
  }
  std::ostringstream out_ = [] {
    std::ostringstream s;
    s.precision(9);
    return s;
  }();
  bool first_ = true;
};

struct ModelSpec {
  ModelOptions options;
  std::vector<int64_t> input_shape;  // per example
  int64_t sequence_length = 0;       // a language model's tokens per example; 0 for a classifier
};

ModelSpec Spec(const std::string& name) {
  ModelSpec spec;
  if (name == "small_mlp") {
    spec.options.name = "mlp";
    spec.options.hidden_layers = {256, 256};
    spec.input_shape = {1, 28, 28};
  } else if (name == "wide_mlp") {
    spec.options.name = "mlp";
    spec.options.height = 32;
    spec.options.width = 32;
    spec.options.hidden_layers = {4096, 4096};
    spec.options.num_classes = 1024;
    spec.input_shape = {1, 32, 32};
  } else if (name == "cnn") {
    spec.options.name = "cnn";
    spec.input_shape = {1, 28, 28};
  } else if (name == "gpt") {
    // configs/kjv_gpt.textproto's model: 4 layers, 4 heads, width 128, 64 bytes of context.
    spec.options.name = "gpt";
    spec.sequence_length = spec.options.gpt.context_length;
  } else {
    throw InvalidArgumentError("unknown --model '" + name + "' (small_mlp, wide_mlp, cnn, gpt)");
  }
  return spec;
}

// Cycles through a few synthetic batches made up front (no data loading in the timing).
class CyclingIterator : public BatchIterator {
 public:
  CyclingIterator(const ModelSpec& spec, int64_t batch, int rank) {
    at::manual_seed(1000 + rank);
    std::vector<int64_t> shape = {batch};
    shape.insert(shape.end(), spec.input_shape.begin(), spec.input_shape.end());
    for (int i = 0; i < 4; ++i) {
      if (spec.sequence_length > 0) {  // random bytes: the step's cost does not depend on the text
        const int64_t vocab = spec.options.gpt.vocab_size;
        batches_.push_back(Batch{at::randint(vocab, {batch, spec.sequence_length}, at::kLong),
                                 at::randint(vocab, {batch, spec.sequence_length}, at::kLong), {}});
        continue;
      }
      batches_.push_back(Batch{at::randn(shape), at::randint(spec.options.num_classes, {batch}, at::kLong), {}});
    }
  }
  std::optional<Batch> Next() override { return batches_[next_++ % batches_.size()]; }
  const Batch& Peek(size_t i) const { return batches_[i % batches_.size()]; }

 private:
  std::vector<Batch> batches_;
  size_t next_ = 0;
};

int64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// The tensors of one parameter's optimizer state, for the optimizers this
// benchmark makes (SGD's BlockedSgd is a torch::optim::SGD).
int64_t OptimizerStateBytes(const torch::optim::OptimizerParamState& state) {
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) return Bytes(s->momentum_buffer());
  if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    return Bytes(s->exp_avg()) + Bytes(s->exp_avg_sq()) + Bytes(s->max_exp_avg_sq());
  }
  if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    return Bytes(s->exp_avg()) + Bytes(s->exp_avg_sq()) + Bytes(s->max_exp_avg_sq());
  }
  return 0;
}

// What this rank holds between steps: ShardedDataParallel's own account when the
// state is sharded; otherwise the same three quantities counted from the model's
// parameters, their gradients and the optimizer's state, so that sharded and
// replicated runs compare like for like.
PartitionedBytes HeldBytes(const TrainState& state, const ShardedDataParallel* sharded) {
  if (sharded != nullptr) return sharded->bytes();
  PartitionedBytes b;
  for (const at::Tensor& p : state.model->parameters()) {
    b.parameters += Bytes(p);
    b.gradients += Bytes(p.grad());
  }
  for (const auto& [key, param_state] : state.optimizer->state()) {
    (void)key;
    b.optimizer_state += OptimizerStateBytes(*param_state);
  }
  return b;
}

OptimizerOptions Optimizer(const std::string& name) {
  OptimizerOptions o;
  if (name == "sgd") {
    o.kind = OptimizerOptions::Kind::kSgd;
    o.learning_rate = 0.01;
    o.momentum = 0.9;
  } else if (name == "adam") {
    o.kind = OptimizerOptions::Kind::kAdam;
    o.learning_rate = 1e-3;
  } else {
    throw InvalidArgumentError("unknown --optimizer '" + name + "' (sgd, adam)");
  }
  return o;
}

int RunTrain(Communicator& comm, const Runtime& runtime) {
  const std::string model_name = absl::GetFlag(FLAGS_model);
  const int64_t batch = absl::GetFlag(FLAGS_batch_per_rank);
  const int warmup = absl::GetFlag(FLAGS_warmup_steps);
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  const int per_round = std::max(1, absl::GetFlag(FLAGS_steps) / rounds);
  const int world = comm.world_size();
  const ModelSpec spec = Spec(model_name);
  const std::string partitioning_name = absl::GetFlag(FLAGS_partitioning);
  const std::optional<PartitioningStrategy> partitioning = ParsePartitioningStrategy(partitioning_name);
  if (!partitioning) {
    throw InvalidArgumentError("unknown --partitioning '" + partitioning_name +
                               "' (replicated, sharded_optimizer_state, sharded_gradients, ...)");
  }

  // A data x model mesh: the model splits itself over the model axis.
  const int mesh_model = absl::GetFlag(FLAGS_mesh_model);
  if (mesh_model < 1 || world % mesh_model != 0) {
    throw InvalidArgumentError("--mesh_model must divide the number of ranks (" + std::to_string(world) + ")");
  }
  if (mesh_model > 1 && spec.sequence_length == 0) throw InvalidArgumentError("--mesh_model above 1 needs --model=gpt");
  const MeshShape mesh_shape{world / mesh_model, mesh_model};
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<Partitioner> partitioner;
  GptParallelism parallel;
  if (mesh_model > 1) {
    mesh = DeviceMesh::Create(&comm, mesh_shape);
    partitioner = std::make_unique<Partitioner>(DefaultTransformerRules(), mesh_shape);
    parallel = GptParallelism{mesh->model(), mesh->model_index(), partitioner.get()};
  }
  const int64_t global_batch = absl::GetFlag(FLAGS_global_batch);
  if (global_batch < 0 || (global_batch > 0 && global_batch % mesh_shape.data != 0)) {
    throw InvalidArgumentError("--global_batch must be a multiple of the data replicas (" +
                               std::to_string(mesh_shape.data) + ")");
  }
  const int64_t replica_batch = global_batch > 0 ? global_batch / mesh_shape.data : batch;
  const int data_index = comm.rank() / mesh_model;

  at::manual_seed(0);
  BuiltModel model = mesh ? BuildGpt(spec.options.gpt, parallel) : BuildModel(spec.options);
  std::vector<ParameterLayout> layouts;
  if (mesh) layouts = std::dynamic_pointer_cast<GptImpl>(model.module)->layouts();
  TrainState state = MakeTrainState(model.module, MakeOptimizerFactory(Optimizer(absl::GetFlag(FLAGS_optimizer))));
  int64_t grad_bytes = 0;
  std::vector<double> parameter_bytes;  // in registration order
  for (const at::Tensor& p : state.model->parameters()) {
    grad_bytes += p.numel() * p.element_size();
    parameter_bytes.push_back(static_cast<double>(p.numel() * p.element_size()));
  }

  TrainerOptions options;
  options.summary_every_steps = 1 << 30;
  options.communicator = &comm;
  options.data_parallel.bucket_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20));
  PowerSgdOptions powersgd;
  powersgd.rank = absl::GetFlag(FLAGS_powersgd_rank);
  powersgd.start_step = absl::GetFlag(FLAGS_powersgd_start_step);
  options.data_parallel.comm_hook = MakeCommHook(absl::GetFlag(FLAGS_comm_hook), powersgd);
  options.data_parallel.hierarchical = absl::GetFlag(FLAGS_hierarchical);
  options.data_parallel.ranks_per_host = absl::GetFlag(FLAGS_ranks_per_host);
  options.data_parallel.order_by_host = absl::GetFlag(FLAGS_order_by_host);
  options.partitioning = *partitioning;
  options.mesh = mesh.get();
  options.parameter_layouts = layouts;
  if (mesh) options.communicator = nullptr;  // the mesh's world
  LossFn loss_fn = CrossEntropyLoss();
  if (spec.sequence_length > 0) {
    const auto* gpt = dynamic_cast<const GptImpl*>(model.module.get());
    loss_fn = LanguageModelLoss(gpt->vocab_axis(), gpt->vocab_begin());
  }
  Trainer sync(state, model.apply, loss_fn, options, runtime);
  DataParallel* dp = sync.data_parallel();
  ShardedDataParallel* sharded = sync.sharded_data_parallel();
  // The nosync phase: a Trainer on the same state without a communicator. Not
  // under a sharded strategy, whose optimizer now updates this rank's slices only.
  const bool nosync = world > 1 && sharded == nullptr && !mesh && absl::GetFlag(FLAGS_nosync_phase);
  std::unique_ptr<Trainer> alone;
  if (nosync) {
    TrainerOptions alone_options = options;
    alone_options.communicator = nullptr;
    alone_options.partitioning = PartitioningStrategy::kReplicated;
    alone = std::make_unique<Trainer>(state, model.apply, loss_fn, alone_options, runtime);
  }
  // Seconds blocked on communication so far, whichever of the two does it.
  auto comm_wait = [&] {
    return dp != nullptr ? dp->communication_wait_seconds()
                         : sharded != nullptr ? sharded->communication_wait_seconds() : 0.0;
  };
  // The ranks of one model-axis group take the same batches.
  CyclingIterator data(spec, replica_batch, data_index);

  std::vector<double> sync_times, nosync_times, wait_times, bucket_wait_times;
  // One Train call per phase, as in training; each step is timed from the callback
  // BaseTrainer makes after every step, so the step's own work (loss, accuracy,
  // norms) is in every timed step and the summary at the end of the call (metrics
  // combined over ranks once per summary period) is in none.
  auto run_phase = [&](Trainer& trainer, int steps, std::vector<double>* times, bool timed_waits) {
    double wait_before = comm_wait();
    double bucket_before = dp ? dp->bucketer().wait_seconds() : 0.0;
    auto start = Clock::now();
    trainer.set_stop_check([&](int64_t) {
      if (times != nullptr) {
        times->push_back(Since(start));
        if (timed_waits) {
          wait_times.push_back(comm_wait() - wait_before);
          bucket_wait_times.push_back(dp ? dp->bucketer().wait_seconds() - bucket_before : 0.0);
        }
      }
      wait_before = comm_wait();
      bucket_before = dp ? dp->bucketer().wait_seconds() : 0.0;
      start = Clock::now();
      return false;
    });
    trainer.Train(data, steps);
    trainer.set_stop_check(nullptr);
    comm.Barrier();
  };
  run_phase(sync, warmup, nullptr, false);
  if (nosync) run_phase(*alone, warmup, nullptr, false);
  for (int r = 0; r < rounds; ++r) {
    run_phase(sync, per_round, &sync_times, true);
    if (nosync) run_phase(*alone, per_round, &nosync_times, false);
  }
  const double rss = MaxRssMib();
  // Between steps, after the timed ones: what the rank holds at rest. The heap
  // first gives back what it keeps of freed blocks (ConfigureTorchForTraining
  // keeps them for the next step's activations), so that transient buffers of the
  // step do not count as held.
  malloc_trim(0);
  const double pss = PssMib();
  // A language model's MFU divides by this: the float32 matrix-product peak, every
  // rank measuring at once (the phases above end at a barrier).
  const double peak_flops = spec.sequence_length > 0 ? MeasureMatmulFlops("cpu") : 0.0;
  // Before the breakdown loop, which would add gradients a sharded run does not keep.
  const PartitionedBytes held = HeldBytes(state, sharded);

  // Forward / backward / optimizer of a hand-written loop on the same model and
  // batches, without communication.
  std::vector<double> forward, backward, update;
  torch::optim::Optimizer& optimizer = *state.optimizer;
  const int breakdown_steps = sharded != nullptr ? 0 : absl::GetFlag(FLAGS_breakdown_steps);
  const int breakdown_warmup = std::min(2, breakdown_steps);
  for (int i = 0; i < breakdown_warmup + breakdown_steps; ++i) {
    const Batch& b = data.Peek(i);
    const auto t0 = Clock::now();
    optimizer.zero_grad();
    at::Tensor loss = loss_fn(model.apply(*state.model, b.inputs), b.targets).mean();
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    optimizer.step();
    const auto t3 = Clock::now();
    if (i < breakdown_warmup) continue;
    forward.push_back(std::chrono::duration<double>(t1 - t0).count());
    backward.push_back(std::chrono::duration<double>(t2 - t1).count());
    update.push_back(std::chrono::duration<double>(t3 - t2).count());
  }

  const std::vector<double> per_rank =
      GatherAll(comm, {Median(sync_times), Median(nosync_times), Median(wait_times), Median(bucket_wait_times), rss,
                       Median(forward), Median(backward), Median(update), static_cast<double>(held.parameters),
                       static_cast<double>(held.gradients), static_cast<double>(held.optimizer_state), pss, peak_flops});
  if (comm.rank() != 0) return 0;
  constexpr int kColumns = 13;
  auto column = [&](int k) {
    std::vector<double> out;
    for (int r = 0; r < world; ++r) out.push_back(per_rank[kColumns * r + k]);
    return out;
  };
  auto ms = [](std::vector<double> v) {
    for (double& x : v) x *= 1e3;
    return v;
  };
  Json json;
  json.Str("framework", "lockstep")
      .Str("model", model_name)
      .Num("ranks", world)
      .Num("batch_per_rank", static_cast<double>(replica_batch))
      .Num("mesh_data", mesh_shape.data)
      .Num("mesh_model", mesh_shape.model)
      .Num("global_batch", static_cast<double>(replica_batch * mesh_shape.data))
      .Num("threads", at::get_num_threads())
      .Str("optimizer", absl::GetFlag(FLAGS_optimizer))
      .Str("partitioning", partitioning_name)
      .Num("sharded", sharded != nullptr ? 1 : 0)
      .Num("parameters", static_cast<double>(CountTrainableWeights(*state.model)))
      .Num("gradient_bytes", static_cast<double>(grad_bytes))
      .Array("parameter_bytes", parameter_bytes)
      .Num("buckets", dp ? static_cast<double>(dp->bucketer().buckets().size()) : 0.0)
      .Num("bucket_bytes", static_cast<double>(options.data_parallel.bucket_bytes))
      .Str("comm_hook", absl::GetFlag(FLAGS_comm_hook))
      .Str("communication", dp ? dp->bucketer().description() : std::string())
      .Array("step_ms", ms(sync_times))  // rank 0's, every timed step
      .Array("nosync_step_ms", ms(nosync_times))
      .Array("step_ms_median_per_rank", ms(column(0)))
      .Array("nosync_step_ms_median_per_rank", ms(column(1)))
      .Array("comm_wait_ms_median_per_rank", ms(column(2)))
      .Array("bucket_wait_ms_median_per_rank", ms(column(3)))
      .Array("max_rss_mib_per_rank", column(4))
      .Array("pss_mib_per_rank", column(11))
      .Num("tokens_per_example", static_cast<double>(spec.sequence_length))
      .Num("flops_per_token",
           spec.sequence_length > 0 ? GptTrainingFlopsPerToken(spec.options.gpt, spec.sequence_length) : 0.0)
      .Array("peak_flops_per_rank", column(12))
      .Array("forward_ms_median_per_rank", ms(column(5)))
      .Array("backward_ms_median_per_rank", ms(column(6)))
      .Array("optimizer_ms_median_per_rank", ms(column(7)))
      // Rank 0's bytes after the timed steps, then every rank's.
      .Num("bytes_parameters", static_cast<double>(held.parameters))
      .Num("bytes_gradients", static_cast<double>(held.gradients))
      .Num("bytes_optimizer_state", static_cast<double>(held.optimizer_state))
      .Array("bytes_parameters_per_rank", column(8))
      .Array("bytes_gradients_per_rank", column(9))
      .Array("bytes_optimizer_state_per_rank", column(10));
  std::printf("%s\n", json.Done().c_str());
  return 0;
}

std::vector<int64_t> ParseSizes(const std::string& text) {
  std::vector<int64_t> sizes;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) sizes.push_back(std::max<int64_t>(4, std::stoll(item)));
  }
  return sizes;
}

// Calls per timing: many for small messages, at least 5 for large ones.
int Iterations(int64_t bytes) { return static_cast<int>(std::clamp<int64_t>((int64_t{64} << 20) / bytes, 5, 200)); }

int RunCollectives(Communicator& comm, const Runtime& runtime) {
  const int world = comm.world_size();
  // Gloo beside MPI: the coordination service (rank 0) for its rendezvous.
  std::unique_ptr<JobEnvironment> env;
  std::unique_ptr<Communicator> gloo;
  if (HaveGloo() && world > 1) {
    JobEnvironmentOptions options;
    options.backend = "mpi";
    options.install_signal_handlers = false;
    options.program = "scaleout_benchmark";
    env = JobEnvironment::Create(options, runtime);
    GlooOptions gloo_options;
    gloo_options.hostname = GlooHostname(*env->coordination(), runtime.host);
    gloo = MakeGlooCommunicator(GlooStoreOverCoordination(*env->coordination(), "benchmark"), comm.rank(), world,
                                gloo_options);
  }
  std::ostringstream rows;
  rows.precision(9);
  bool first = true;
  for (const int64_t bytes : ParseSizes(absl::GetFlag(FLAGS_sizes))) {
    at::Tensor t = at::ones({bytes / 4}, at::kFloat);
    // A buffer as gradient buckets get it (shared memory on one host).
    at::Tensor bucket = comm.AllocateCollectiveBuffer(bytes / 4, at::TensorOptions().dtype(at::kFloat)).fill_(1);
    const int n = Iterations(bytes);
    // Three (four) timings of n calls each, interleaved; the median.
    std::vector<double> raw, ours, plain, gloo_times;
    for (int rep = 0; rep < 4; ++rep) {
      MPI_Barrier(MPI_COMM_WORLD);
      auto start = Clock::now();
      for (int i = 0; i < n; ++i) {
        MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
      const double raw_s = Since(start) / n;
      comm.Barrier();
      start = Clock::now();
      for (int i = 0; i < n; ++i) comm.AllReduce(bucket, ReduceOp::kSum);
      const double ours_s = Since(start) / n;
      comm.Barrier();
      start = Clock::now();
      for (int i = 0; i < n; ++i) comm.AllReduce(t, ReduceOp::kSum);
      const double plain_s = Since(start) / n;
      double gloo_s = 0;
      if (gloo) {
        gloo->Barrier();
        start = Clock::now();
        for (int i = 0; i < n; ++i) gloo->AllReduce(t, ReduceOp::kSum);
        gloo_s = Since(start) / n;
      }
      if (rep == 0) continue;  // warm-up
      raw.push_back(raw_s);
      ours.push_back(ours_s);
      plain.push_back(plain_s);
      gloo_times.push_back(gloo_s);
    }
    // The slowest rank's time is the collective's.
    const std::vector<double> all = GatherAll(comm, {Median(raw), Median(ours), Median(plain), Median(gloo_times)});
    double raw_s = 0, ours_s = 0, plain_s = 0, gloo_s = 0;
    for (int r = 0; r < world; ++r) {
      raw_s = std::max(raw_s, all[4 * r]);
      ours_s = std::max(ours_s, all[4 * r + 1]);
      plain_s = std::max(plain_s, all[4 * r + 2]);
      gloo_s = std::max(gloo_s, all[4 * r + 3]);
    }
    rows << (first ? "" : ",") << "{\"bytes\":" << bytes << ",\"iterations\":" << n << ",\"mpi_s\":" << raw_s
         << ",\"lockstep_s\":" << ours_s << ",\"lockstep_plain_s\":" << plain_s;
    if (gloo) rows << ",\"gloo_s\":" << gloo_s;
    rows << "}";
    first = false;
  }
  if (comm.rank() == 0) {
    Json json;
    json.Str("framework", "lockstep").Str("mode", "collectives").Num("ranks", world).Raw("allreduce",
                                                                                      "[" + rows.str() + "]");
    std::printf("%s\n", json.Done().c_str());
  }
  return 0;
}

int Main() {
  ConfigureTorchForTraining(absl::GetFlag(FLAGS_threads));
  const Runtime runtime = Runtime::FromEnvironment();
  MpiOptions mpi;
  mpi.chunk_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_kib)) << 10;
  mpi.chunks_in_flight = absl::GetFlag(FLAGS_chunks_in_flight);
  mpi.shared_memory_buffers = absl::GetFlag(FLAGS_shared_memory_buffers);
  // The mesh's axes, the hierarchy's groups and the host-ordered flat group (on
  // several hosts) run side by side.
  mpi.thread_multiple = absl::GetFlag(FLAGS_mesh_model) > 1 || absl::GetFlag(FLAGS_hierarchical) ||
                        (absl::GetFlag(FLAGS_order_by_host) && runtime.several_hosts);
  std::unique_ptr<Communicator> comm = MakeMpiCommunicator(mpi);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "train") return RunTrain(*comm, runtime);
  if (mode == "collectives") return RunCollectives(*comm, runtime);
  std::fprintf(stderr, "scaleout_benchmark: unknown --mode '%s' (train, collectives)\n", mode.c_str());
  return 2;
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return lockstep::Main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaleout_benchmark: %s\n", e.what());
    return 1;
  }
}
