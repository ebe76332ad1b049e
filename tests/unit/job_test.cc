// The job layer in one process: the preemption agreement with several clients as
// threads against a real coordination service on loopback, the agreement helpers
// over the same store, optimizer state codecs, and TrainingJob::Run around a
// Trainer and a BaseTrainer subclass with custom state (resume, preemption,
// start-up refusals).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/optim/rmsprop.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "lockstep/agreement.h"
#include "lockstep/checkpoint.h"
#include "lockstep/coordination.h"
#include "lockstep/job.h"
#include "lockstep/models.h"
#include "lockstep/optimizer_state_codec.h"
#include "lockstep/timeline.h"
#include "lockstep/trainer.h"
#include "tests/testing/coordination_clients.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_problem.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr char kToken[] = "job-test-token-0123456789";

std::unique_ptr<CoordinationService> StartService(int world_size) {
  CoordinationServiceOptions options;
  options.address = "127.0.0.1:0";
  options.job_id = "job-test";
  options.token = kToken;
  options.world_size = world_size;
  options.log_refusals = false;
  auto service = CoordinationService::Start(options);
  EXPECT_TRUE(service.ok()) << service.status();
  return service.ok() ? std::move(*service) : nullptr;
}

// Connects `world_size` clients (registration waits for all of them, so they
// connect concurrently); on_event of rank r calls events[r] when set.
std::vector<std::unique_ptr<CoordinationClient>> ConnectAll(
    int port, int world_size, std::vector<std::function<void(const CoordinationEvent&)>> events = {}) {
  std::vector<CoordinationClientOptions> options;
  for (int r = 0; r < world_size; ++r) {
    CoordinationClientOptions o;
    o.address = absl::StrCat("127.0.0.1:", port);
    o.job_id = "job-test";
    o.token = kToken;
    o.rank = r;
    o.world_size = world_size;
    o.register_timeout = absl::Seconds(30);
    if (r < static_cast<int>(events.size())) o.on_event = events[r];
    options.push_back(o);
  }
  return testing::ConnectConcurrently(options);
}

// A reusable barrier for threads that stand in for ranks: every step has a
// collective, so no rank starts step s + 1 before every rank has finished step s.
// Arrive returns false when the others did not come within the timeout.
class StepBarrier {
 public:
  explicit StepBarrier(int parties) : parties_(parties) {}
  bool Arrive(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const int64_t generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      return true;
    }
    auto passed = [this, generation] { return generation_ != generation; };
    return mu_.AwaitWithTimeout(absl::Condition(&passed), timeout);
  }

 private:
  absl::Mutex mu_;
  const int parties_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// 50 trials: a signal to a random client at a random step; every client must stop
// at the same step, the largest step any client published + 1 ... i.e. the
// largest proposal, and no client may hang.
TEST(PreemptionSyncPointTest, EveryClientStopsAtTheLargestProposalInFiftyRandomTrials) {
  std::mt19937 random(20261203);
  constexpr int kTrials = 50;
  constexpr int64_t kMaxSteps = 5000;
  for (int trial = 0; trial < kTrials; ++trial) {
    const int world = 2 + static_cast<int>(random() % 3);  // 2 to 4 clients
    const int victim = static_cast<int>(random() % world);
    const int64_t signal_step = 1 + static_cast<int64_t>(random() % 20);
    SCOPED_TRACE(absl::StrCat("trial ", trial, ": ", world, " clients, signal to ", victim, " at step ", signal_step));
    std::unique_ptr<CoordinationService> service = StartService(world);
    ASSERT_NE(service, nullptr);
    std::vector<std::unique_ptr<PreemptionSyncPoint>> points(world);
    for (auto& p : points) p = std::make_unique<PreemptionSyncPoint>();
    std::vector<std::function<void(const CoordinationEvent&)>> events;
    for (int r = 0; r < world; ++r) {
      PreemptionSyncPoint* point = points[r].get();
      events.push_back([point](const CoordinationEvent& e) {
        if (e.kind == CoordinationEvent::Kind::kPreemptionNotice) point->NotifyPeer();
      });
    }
    std::vector<std::unique_ptr<CoordinationClient>> clients = ConnectAll(service->port(), world, events);
    for (int r = 0; r < world; ++r) {
      ASSERT_NE(clients[r], nullptr);
      points[r]->AttachClient(clients[r].get());
    }

    StepBarrier barrier(world);
    std::vector<int64_t> stopped_at(world, -1);
    std::vector<std::string> errors(world);
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back([&, r] {
        try {
          for (int64_t step = 1; step <= kMaxSteps; ++step) {
            if (!barrier.Arrive(absl::Seconds(20))) {
              errors[r] = absl::StrCat("stuck at step ", step, ": another client stopped without it");
              return;
            }
            absl::SleepFor(absl::Microseconds(200));  // the step's work
            if (r == victim && step == signal_step) points[r]->Notify(SIGTERM);
            if (points[r]->ShouldStop(step)) {
              stopped_at[r] = step;
              return;
            }
          }
          errors[r] = "never stopped";
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (std::thread& t : ranks) t.join();
    int64_t largest_proposal = 0;
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(errors[r], "") << "client " << r;
      ASSERT_TRUE(points[r]->proposed_step().has_value()) << "client " << r << " never proposed";
      largest_proposal = std::max(largest_proposal, *points[r]->proposed_step());
    }
    EXPECT_GT(largest_proposal, signal_step);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(stopped_at[r], largest_proposal) << "client " << r;
      EXPECT_EQ(points[r]->agreed_step(), largest_proposal) << "client " << r;
    }
    EXPECT_EQ(points[victim]->signal(), SIGTERM);
    for (auto& c : clients) (void)c->Goodbye();
    service->Shutdown(absl::Seconds(5));
    if (HasFailure()) break;  // one trial's failures say enough
  }
}

TEST(PreemptionSyncPointTest, AloneItStopsAtTheStepWhereItLearnsOfTheSignal) {
  PreemptionSyncPoint point;
  EXPECT_FALSE(point.ShouldStop(1));
  EXPECT_FALSE(point.notified());
  point.Notify(SIGUSR1);
  EXPECT_TRUE(point.ShouldStop(2));
  EXPECT_EQ(point.agreed_step(), 2);
  EXPECT_EQ(point.signal(), SIGUSR1);
  EXPECT_THAT([&] { point.ShouldStop(3); }, ::testing::ThrowsMessage<Error>(HasSubstr("past the agreed step 2")));
}

TEST(PreemptionSyncPointTest, SignalsReachTheObjectThatInstalledTheHandlersAndOnlyOneAtATime) {
  PreemptionSyncPoint first;
  first.InstallSignalHandlers();
  PreemptionSyncPoint second;
  EXPECT_THAT([&] { second.InstallSignalHandlers(); },
              ::testing::ThrowsMessage<Error>(HasSubstr("already receives SIGTERM and SIGUSR1")));
  ASSERT_EQ(raise(SIGUSR1), 0);
  EXPECT_EQ(first.signal(), SIGUSR1);
  EXPECT_FALSE(second.notified());
  first.UninstallSignalHandlers();
  second.InstallSignalHandlers();
  ASSERT_EQ(raise(SIGTERM), 0);
  EXPECT_EQ(second.signal(), SIGTERM);
  EXPECT_EQ(first.signal(), SIGUSR1);
  // Released: the handlers stay, a late signal reaches nobody and kills nothing.
  second.ReleaseSignalHandlers();
  ASSERT_EQ(raise(SIGTERM), 0);
  PreemptionSyncPoint third;
  third.InstallSignalHandlers();
  EXPECT_FALSE(third.notified());
  third.UninstallSignalHandlers();  // the destructor would too
}

TEST(AgreementTest, PublishGatherShareAndTheLargestProposal) {
  constexpr int kWorld = 3;
  std::unique_ptr<CoordinationService> service = StartService(kWorld);
  ASSERT_NE(service, nullptr);
  std::vector<std::unique_ptr<CoordinationClient>> clients = ConnectAll(service->port(), kWorld);
  for (auto& c : clients) ASSERT_NE(c, nullptr);

  // Nothing published yet, then part of it: not complete.
  auto none = TryGatherPublished(*clients[0], "t/proposal/");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  ASSERT_TRUE(clients[1]->Set("t/proposal/1", "17").ok());
  EXPECT_FALSE(TryGatherPublished(*clients[0], "t/proposal/")->has_value());

  std::vector<std::future<absl::StatusOr<std::vector<std::string>>>> gathered;
  for (int r = 0; r < kWorld; ++r) {
    gathered.push_back(std::async(std::launch::async, [&, r] {
      return PublishAndGather(*clients[r], "t/gather/", absl::StrCat("value of ", r), absl::Seconds(10));
    }));
  }
  for (int r = 0; r < kWorld; ++r) {
    auto values = gathered[r].get();
    ASSERT_TRUE(values.ok()) << values.status();
    EXPECT_THAT(*values, ::testing::ElementsAre("value of 0", "value of 1", "value of 2")) << "rank " << r;
  }

  ASSERT_TRUE(clients[0]->Set("t/proposal/0", "12").ok());
  ASSERT_TRUE(clients[2]->Set("t/proposal/2", "9").ok());
  auto all = TryGatherPublished(*clients[2], "t/proposal/");
  ASSERT_TRUE(all.ok() && all->has_value());
  EXPECT_EQ(*MaxOfPublished(**all), 17);
  EXPECT_EQ(MaxOfPublished({"3", "x"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaxOfPublished({}).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(clients[0]->Set("t/bad/zero", "1").ok());
  EXPECT_EQ(TryGatherPublished(*clients[0], "t/bad/").status().code(), absl::StatusCode::kInternal);

  auto from_chief = std::async(std::launch::async, [&] {
    return ShareFromChief(*clients[2], "t/shared", "ignored", /*is_chief=*/false, absl::Seconds(10));
  });
  EXPECT_EQ(*ShareFromChief(*clients[0], "t/shared", "rank 0's choice", /*is_chief=*/true, absl::Seconds(1)),
            "rank 0's choice");
  EXPECT_EQ(*from_chief.get(), "rank 0's choice");
  auto late = ShareFromChief(*clients[1], "t/never", "", /*is_chief=*/false, absl::Milliseconds(200));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("t/never"));

  std::unique_ptr<Communicator> alone = MakeSingleProcessCommunicator();
  EXPECT_EQ(BroadcastString(*alone, "text"), "text");
  EXPECT_THAT(AllGatherStrings(*alone, "mine"), ::testing::ElementsAre("mine"));
  for (auto& c : clients) (void)c->Goodbye();
}

// ---------------------------------------------------------------------------
// Optimizer state codecs.

// Keeps what a codec writes, and reads it back.
class MapState final : public OptimizerStateWriter, public OptimizerStateReader {
 public:
  void PutTensor(const std::string& key, const at::Tensor& value) override { tensors[key] = value.clone(); }
  void PutInt(const std::string& key, int64_t value) override { ints[key] = value; }
  void PutBytes(const std::string& key, const std::string& value) override { bytes[key] = value; }
  bool Has(const std::string& key) const override {
    return tensors.count(key) > 0 || ints.count(key) > 0 || bytes.count(key) > 0;
  }
  at::Tensor Tensor(const std::string& key, const at::Tensor&) const override { return tensors.at(key).clone(); }
  int64_t Int(const std::string& key) const override { return ints.at(key); }
  std::string Bytes(const std::string& key) const override { return bytes.at(key); }

  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, int64_t> ints;
  std::map<std::string, std::string> bytes;
};

NamedParameters Named(torch::nn::Module& module) {
  NamedParameters out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

void OneStep(torch::nn::Module& model, const ApplyFn& apply, torch::optim::Optimizer& optimizer, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor x = at::randn({8, 1, 8, 8});
  optimizer.zero_grad();
  apply(model, x).pow(2).mean().backward();
  optimizer.step();
}

TEST(OptimizerStateCodecTest, AnyLibtorchOptimizerRoundTripsThroughItsOwnArchive) {
  BuiltModel a = testing::TinyModel(3);
  BuiltModel b = testing::TinyModel(3);
  torch::optim::RMSprop opt_a(a.module->parameters(), torch::optim::RMSpropOptions(0.01).momentum(0.9));
  torch::optim::RMSprop opt_b(b.module->parameters(), torch::optim::RMSpropOptions(0.01).momentum(0.9));
  for (uint64_t s = 0; s < 3; ++s) OneStep(*a.module, a.apply, opt_a, s);
  std::shared_ptr<const OptimizerStateCodec> codec = FindOptimizerStateCodec(opt_a);
  EXPECT_EQ(codec->name(), "libtorch archive");
  MapState saved;
  codec->Save(opt_a, Named(*a.module), saved);
  EXPECT_EQ(saved.bytes.count("archive"), 1u);
  // b: the same parameters, the saved optimizer state; one more step on both.
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a.module->parameters().size(); ++i) b.module->parameters()[i].copy_(a.module->parameters()[i]);
  }
  FindOptimizerStateCodec(opt_b)->Restore(opt_b, Named(*b.module), saved);
  OneStep(*a.module, a.apply, opt_a, 9);
  OneStep(*b.module, b.apply, opt_b, 9);
  for (size_t i = 0; i < a.module->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(a.module->parameters()[i], b.module->parameters()[i])) << "parameter " << i;
  }
}

TEST(OptimizerStateCodecTest, BuiltInCodecsWriteOneTensorPerParameterAndField) {
  BuiltModel m = testing::TinyModel(4);
  OptimizerOptions o;
  o.kind = OptimizerOptions::Kind::kAdam;
  std::unique_ptr<torch::optim::Optimizer> adam = MakeOptimizerFactory(o)(m.module->parameters());
  OneStep(*m.module, m.apply, *adam, 1);
  MapState saved;
  std::shared_ptr<const OptimizerStateCodec> codec = FindOptimizerStateCodec(*adam);
  EXPECT_EQ(codec->name(), "Adam");
  codec->Save(*adam, Named(*m.module), saved);
  const std::string first = m.module->named_parameters()[0].key();
  EXPECT_EQ(saved.ints.at(first + "/step"), 1);
  EXPECT_EQ(saved.tensors.count(first + "/exp_avg"), 1u);
  EXPECT_EQ(saved.tensors.count(first + "/exp_avg_sq"), 1u);
  o.kind = OptimizerOptions::Kind::kSgd;
  EXPECT_EQ(FindOptimizerStateCodec(*MakeOptimizerFactory(o)(m.module->parameters()))->name(), "SGD");
}

// An optimizer that keeps state but never overrides save(): libtorch's own save()
// writes nothing, so its state would be lost silently.
class ForgetfulOptimizer final : public torch::optim::Optimizer {
 public:
  explicit ForgetfulOptimizer(std::vector<at::Tensor> params)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  at::Tensor step(LossClosure) override {
    torch::NoGradGuard no_grad;
    for (auto& p : param_groups()[0].params()) {
      if (p.grad().defined()) p.add_(p.grad(), -0.1);
    }
    return {};
  }
};

class ForgetfulCodec final : public OptimizerStateCodec {
 public:
  std::string name() const override { return "forgetful (nothing to keep)"; }
  void Save(const torch::optim::Optimizer&, const NamedParameters&, OptimizerStateWriter&) const override {}
  void Restore(torch::optim::Optimizer&, const NamedParameters&, const OptimizerStateReader&) const override {}
};

TEST(OptimizerStateCodecTest, AnOptimizerThatCannotBeSavedIsNamedUntilACodecIsRegistered) {
  BuiltModel m = testing::TinyModel(5);
  ForgetfulOptimizer optimizer(m.module->parameters());
  EXPECT_THAT([&] { FindOptimizerStateCodec(optimizer); },
              ::testing::ThrowsMessage<InvalidArgumentError>(
                  ::testing::AllOf(HasSubstr("ForgetfulOptimizer cannot be saved in checkpoints"),
                                   HasSubstr("its save() writes nothing"))));
  RegisterOptimizerStateCodec<ForgetfulOptimizer>(std::make_shared<ForgetfulCodec>());
  EXPECT_EQ(FindOptimizerStateCodec(optimizer)->name(), "forgetful (nothing to keep)");
}

// ---------------------------------------------------------------------------
// TrainingJob::Run in one process.

ShardingOptions TrainSharding() {
  ShardingOptions o;
  o.global_batch_size = 16;
  o.seed = 11;
  return o;
}

struct JobSetup {
  explicit JobSetup(std::unique_ptr<torch::optim::Optimizer> (*make)(std::vector<at::Tensor>) = nullptr) {
    model = testing::TinyModel(21);
    OptimizerOptions o;
    o.kind = OptimizerOptions::Kind::kAdam;
    o.learning_rate = 0.01;
    state = MakeTrainState(model.module, make ? OptimizerFactory(make) : MakeOptimizerFactory(o));
  }
  BuiltModel model;
  TrainState state;
  std::shared_ptr<const TensorDataset> train = testing::TinyDataset(192, 1);
  std::shared_ptr<const TensorDataset> test = testing::TinyDataset(64, 2);
  std::vector<EvalSet> EvalSets() const {
    ShardingOptions o = TrainSharding();
    o.shuffle = false;
    o.num_epochs = 1;
    return {{"test", [this, o] { return std::make_unique<ShardedBatchIterator>(test, o); }}};
  }
};

// A trainer subclass with state of its own: it counts the examples it has seen
// and keeps a running sum of the losses, both of which must survive a resume.
class CountingTrainer final : public Trainer {
 public:
  CountingTrainer(TrainState& state, ApplyFn apply, TrainerOptions options)
      : Trainer(state, std::move(apply), CrossEntropyLoss(), std::move(options)) {}
  CustomState SaveCustomState() override {
    CustomState s;
    s.bytes["examples_seen"] = std::to_string(examples_seen);
    s.tensors["loss_sum"] = loss_sum.clone();
    return s;
  }
  void RestoreCustomState(const CustomState& s) override {
    examples_seen = std::stoll(s.bytes.at("examples_seen"));
    loss_sum = s.tensors.at("loss_sum").clone();
  }
  int64_t examples_seen = 0;
  at::Tensor loss_sum = at::zeros({1}, at::kDouble);

 protected:
  MetricMap TrainStep(const Batch& batch) override {
    MetricMap m = Trainer::TrainStep(batch);
    examples_seen += batch.size();
    loss_sum += m.at(kLoss);
    return m;
  }
};

CheckpointOptions Checkpoints(const std::string& dir) {
  CheckpointOptions o;
  o.directory = dir;
  o.every_steps = 4;
  o.keep_last = 10;
  o.async = true;
  return o;
}

TrainerOptions QuietTrainer() {
  TrainerOptions o;
  o.summary_every_steps = 5;
  return o;
}

struct Finished {
  JobResult result;
  std::vector<at::Tensor> parameters;
  int64_t examples_seen;
  double loss_sum;
};

// Runs the job on a fresh setup in `dir`; `stop_at` > 0 sends a SIGTERM-like
// notice to the job's own sync point after that step.
Finished RunCountingJob(const std::string& dir, int64_t steps, int64_t stop_at = 0) {
  JobSetup setup;
  CountingTrainer trainer(setup.state, setup.model.apply, QuietTrainer());
  ShardedBatchIterator train(setup.train, TrainSharding());
  CheckpointManager checkpoints(Checkpoints(dir), 0, 1, nullptr);
  PreemptionSyncPoint preemption;
  JobOptions options;
  options.num_train_steps = steps;
  options.eval_every_steps = 10;
  options.on_step = [&](int64_t step) {
    if (step == stop_at) preemption.Notify(SIGTERM);
  };
  JobResult result = TrainingJob(nullptr, options, &preemption).Run(trainer, train, setup.EvalSets(), &checkpoints);
  return {result, testing::Snapshot(*setup.model.module), trainer.examples_seen, trainer.loss_sum.item<double>()};
}

TEST(TrainingJobTest, PreemptedThenResumedEndsBitForBitWithTheTrainersOwnState) {
  testing::TempDir straight_dir, preempted_dir;
  const Finished straight = RunCountingJob(straight_dir.path(), 30);
  EXPECT_EQ(straight.result.reason, StopReason::kDone);
  EXPECT_EQ(straight.result.step, 30);
  EXPECT_TRUE(straight.result.eval.count("test"));
  EXPECT_EQ(straight.examples_seen, 30 * 16);
  EXPECT_TRUE(fs::exists(fs::path(straight_dir.path()) / CheckpointDirName(30)));  // the final one

  const Finished preempted = RunCountingJob(preempted_dir.path(), 30, /*stop_at=*/13);
  EXPECT_EQ(preempted.result.reason, StopReason::kPreempted);
  EXPECT_EQ(ExitCodeFor(preempted.result.reason), 75);
  EXPECT_EQ(preempted.result.step, 13);
  EXPECT_EQ(preempted.result.preemption_signal, SIGTERM);
  EXPECT_EQ(preempted.result.emergency_checkpoint, preempted_dir.path() + "/" + CheckpointDirName(13));
  ASSERT_TRUE(CheckpointManager::Validate(preempted.result.emergency_checkpoint).step == 13);

  const Finished resumed = RunCountingJob(preempted_dir.path(), 30);
  EXPECT_EQ(resumed.result.reason, StopReason::kDone);
  EXPECT_EQ(resumed.result.resumed_from, preempted.result.emergency_checkpoint);
  EXPECT_EQ(resumed.examples_seen, straight.examples_seen);
  EXPECT_EQ(resumed.loss_sum, straight.loss_sum);
  ASSERT_EQ(resumed.parameters.size(), straight.parameters.size());
  for (size_t i = 0; i < straight.parameters.size(); ++i) {
    EXPECT_TRUE(at::equal(resumed.parameters[i], straight.parameters[i])) << "parameter " << i;
  }
  for (const char* metric : {kLoss, kAccuracy}) {
    EXPECT_EQ(resumed.result.eval.at("test").at(metric), straight.result.eval.at("test").at(metric)) << metric;
  }
}

// An iterator without a saveable position.
class EndlessIterator final : public BatchIterator {
 public:
  explicit EndlessIterator(std::shared_ptr<const TensorDataset> data) : inner_(std::move(data), TrainSharding()) {}
  std::optional<Batch> Next() override { return inner_.Next(); }

 private:
  ShardedBatchIterator inner_;
};

class UnsaveableOptimizer final : public torch::optim::Optimizer {
 public:
  explicit UnsaveableOptimizer(std::vector<at::Tensor> params)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  at::Tensor step(LossClosure) override { return {}; }
};

std::unique_ptr<torch::optim::Optimizer> MakeUnsaveable(std::vector<at::Tensor> params) {
  return std::make_unique<UnsaveableOptimizer>(std::move(params));
}

TEST(TrainingJobTest, RefusesAtStartUpWhatCheckpointsCouldNotSaveOrResume) {
  testing::TempDir dir;
  JobOptions options;
  options.num_train_steps = 5;
  {
    JobSetup setup(&MakeUnsaveable);
    Trainer trainer(setup.state, setup.model.apply, CrossEntropyLoss(), QuietTrainer());
    ShardedBatchIterator train(setup.train, TrainSharding());
    CheckpointManager checkpoints(Checkpoints(dir.path()), 0, 1, nullptr);
    EXPECT_THAT([&] { TrainingJob(nullptr, options).Run(trainer, train, setup.EvalSets(), &checkpoints); },
                ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("UnsaveableOptimizer cannot be saved")));
    EXPECT_EQ(setup.state.step, 0);  // refused before the first step
  }
  {
    JobSetup setup;
    Trainer trainer(setup.state, setup.model.apply, CrossEntropyLoss(), QuietTrainer());
    EndlessIterator train(setup.train);
    CheckpointManager checkpoints(Checkpoints(dir.path()), 0, 1, nullptr);
    EXPECT_THAT([&] { TrainingJob(nullptr, options).Run(trainer, train, setup.EvalSets(), &checkpoints); },
                ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("cannot save its position")));
    EXPECT_EQ(setup.state.step, 0);
    // Without checkpoints, the same data trains.
    JobResult result = TrainingJob(nullptr, options).Run(trainer, train, setup.EvalSets(), nullptr);
    EXPECT_EQ(result.reason, StopReason::kDone);
    EXPECT_EQ(result.step, 5);
  }
  EXPECT_THAT([] { JobOptions bad; bad.num_train_steps = -1; TrainingJob(nullptr, bad); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("num_train_steps must be >= 0")));
  EXPECT_EQ(ExitCodeFor(StopReason::kDone), 0);
  EXPECT_EQ(ExitCodeFor(StopReason::kHalted), 0);
  EXPECT_EQ(ExitCodeFor(StopReason::kDiverged), 3);
  EXPECT_EQ(ExitCodeFor(StopReason::kPeerFailed), 4);
}

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

int CountOf(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A BaseTrainer of its own (not Trainer): one SGD step on the tiny model, with a
// span of its own on the timeline that the job gives it.
class PlainTrainer final : public BaseTrainer {
 public:
  PlainTrainer(TrainState& state, ApplyFn apply) : BaseTrainer(state, Runtime::SingleProcess()), apply_(apply) {}

 protected:
  MetricMap TrainStep(const Batch& batch) override {
    const TimelineSpan span(timeline(), "plain step");
    state().optimizer->zero_grad();
    at::Tensor loss = at::cross_entropy_loss(apply_(*state().model, batch.inputs), batch.targets);
    loss.backward();
    state().optimizer->step();
    ++state().step;
    return {{kLoss, loss.item<double>()}};
  }
  MetricSums EvalStep(const Batch& batch) override {
    (void)batch;
    return {};
  }

 private:
  ApplyFn apply_;
};

TEST(TrainingJobTest, TraceStepsAreRecordedOnAnyBaseTrainerAndItsOwnTimelineComesBack) {
  testing::TempDir dir;
  JobOptions options;
  options.num_train_steps = 6;
  options.trace_steps = {2, 5};
  options.trace_dir = dir.path() + "/trace";
  {
    JobSetup setup;
    PlainTrainer trainer(setup.state, setup.model.apply);
    ShardedBatchIterator train(setup.train, TrainSharding());
    Timeline own(dir.path() + "/own.json", 0, {1});
    trainer.set_timeline(&own);
    const JobResult result = TrainingJob(nullptr, options).Run(trainer, train, {}, nullptr);
    EXPECT_EQ(result.step, 6);
    EXPECT_EQ(trainer.timeline(), &own) << "the trainer's own timeline is put back";
    EXPECT_FALSE(std::filesystem::exists(own.path())) << "the job's timeline recorded instead of the trainer's";
  }
  const std::string plain = ReadWholeFile(dir.path() + "/trace/rank_0.json");
  EXPECT_THAT(plain, HasSubstr("\"traceEvents\""));
  EXPECT_THAT(plain, HasSubstr("{\"name\": \"step 2\", \"ph\": \"X\""));
  EXPECT_THAT(plain, HasSubstr("{\"name\": \"step 5\", \"ph\": \"X\""));
  EXPECT_EQ(CountOf(plain, "\"name\": \"step "), 2) << "only the chosen steps\n" << plain;
  EXPECT_EQ(CountOf(plain, "\"name\": \"plain step\""), 2) << plain;
  EXPECT_EQ(CountOf(plain, "\"name\": \"data wait\""), 2) << plain;

  // Trainer adds the step's phases, on the same options.
  testing::TempDir trainer_dir;
  options.trace_steps = {3};
  options.trace_dir = trainer_dir.path();
  JobSetup setup;
  Trainer trainer(setup.state, setup.model.apply, CrossEntropyLoss(), QuietTrainer());
  ShardedBatchIterator train(setup.train, TrainSharding());
  TrainingJob(nullptr, options).Run(trainer, train, {}, nullptr);
  EXPECT_EQ(trainer.timeline(), nullptr);
  const std::string phases = ReadWholeFile(trainer_dir.path() + "/rank_0.json");
  for (const std::string span : {"step 3", "data wait", "forward", "backward", "norms and optimizer"}) {
    EXPECT_EQ(CountOf(phases, "\"name\": \"" + span + "\""), 1) << span << "\n" << phases;
  }

  options.trace_dir = "";
  EXPECT_THAT([&] { TrainingJob(nullptr, options).Run(trainer, train, {}, nullptr); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("trace_steps needs a trace_dir")));
  options.trace_dir = trainer_dir.path();
  options.trace_steps = {0, 4};
  EXPECT_THAT([&] { TrainingJob(nullptr, options).Run(trainer, train, {}, nullptr); },
              ::testing::ThrowsMessage<InvalidArgumentError>(HasSubstr("trace_steps must be >= 1")));
}

TEST(TrainingJobTest, AnActionsHaltIsReportedWithItsReason) {
  JobSetup setup;
  Trainer trainer(setup.state, setup.model.apply, CrossEntropyLoss(), QuietTrainer());
  trainer.AddAction(std::make_unique<EarlyStoppingAction>("test", kLoss, EarlyStoppingAction::Mode::kMin,
                                                          /*patience=*/1, /*atol=*/1e9, /*rtol=*/0.0));
  ShardedBatchIterator train(setup.train, TrainSharding());
  JobOptions options;
  options.num_train_steps = 100;
  options.eval_every_steps = 5;
  JobResult result = TrainingJob(nullptr, options).Run(trainer, train, setup.EvalSets(), nullptr);
  EXPECT_EQ(result.reason, StopReason::kHalted);
  EXPECT_LT(result.step, 100);
  EXPECT_FALSE(result.message.empty());
  EXPECT_EQ(ExitCodeFor(result.reason), 0);
}

}  // namespace
}  // namespace lockstep
