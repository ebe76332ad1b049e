// The coordination service and client against each other: a real gRPC server on
// a loopback port, clients as threads (and, for a crashed service, the
// lockstep_coordinator binary killed with SIGKILL).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "lockstep/coordination.h"
#include "proto/coordination.grpc.pb.h"
#include "tests/testing/coordination_clients.h"
#include "tests/testing/temp_dir.h"

extern char** environ;

namespace lockstep {
namespace {

namespace pb = ::lockstep::coordination;
using ::testing::HasSubstr;

constexpr char kToken[] = "0123456789abcdef-test-token";
constexpr char kJob[] = "test-job";

std::unique_ptr<CoordinationService> StartService(int world_size, absl::Duration heartbeat_timeout = absl::Seconds(10),
                                                  CoordinationServiceOptions options = {}) {
  options.address = "127.0.0.1:0";
  options.job_id = kJob;
  options.token = kToken;
  options.world_size = world_size;
  options.heartbeat_timeout = heartbeat_timeout;
  options.log_refusals = false;
  auto service = CoordinationService::Start(options);
  EXPECT_TRUE(service.ok()) << service.status();
  return service.ok() ? std::move(*service) : nullptr;
}

// Collects the events a client's on_event receives.
struct EventLog {
  absl::Mutex mu;
  std::vector<CoordinationEvent> events;
  std::vector<absl::Time> times;

  std::function<void(const CoordinationEvent&)> Callback() {
    return [this](const CoordinationEvent& e) {
      absl::MutexLock lock(&mu);
      events.push_back(e);
      times.push_back(absl::Now());
    };
  }
  // Waits up to `timeout` for an event of `kind`; returns it with its arrival time.
  std::optional<std::pair<CoordinationEvent, absl::Time>> WaitFor(CoordinationEvent::Kind kind,
                                                                   absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    auto has = [this, kind] {
      for (const auto& e : events) {
        if (e.kind == kind) return true;
      }
      return false;
    };
    mu.AwaitWithTimeout(absl::Condition(&has), timeout);
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].kind == kind) return std::make_pair(events[i], times[i]);
    }
    return std::nullopt;
  }
};

CoordinationClientOptions ClientOptions(int port, int rank, int world_size) {
  CoordinationClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port);
  options.job_id = kJob;
  options.token = kToken;
  options.rank = rank;
  options.world_size = world_size;
  options.host = absl::StrCat("host", rank);
  options.register_timeout = absl::Seconds(20);
  return options;
}

// Connects ranks [0, world) concurrently; every connection must succeed.
std::vector<std::unique_ptr<CoordinationClient>> ConnectAll(int port, int world_size,
                                                            std::vector<EventLog>* logs = nullptr,
                                                            absl::Duration heartbeat_timeout = absl::Seconds(10)) {
  std::vector<CoordinationClientOptions> options;
  for (int r = 0; r < world_size; ++r) {
    options.push_back(ClientOptions(port, r, world_size));
    options.back().heartbeat_timeout = heartbeat_timeout;
    if (logs) options.back().on_event = (*logs)[r].Callback();
  }
  return testing::ConnectConcurrently(options);
}

// A raw stub that sends whatever metadata a test wants.
struct RawStub {
  explicit RawStub(int port)
      : channel(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials())),
        stub(pb::Coordination::NewStub(channel)) {}
  void Prepare(grpc::ClientContext& context, const std::string& job, const std::string& token) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!job.empty()) context.AddMetadata("lockstep-job-id", job);
    if (!token.empty()) context.AddMetadata("lockstep-token", token);
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Coordination::Stub> stub;
};

TEST(CoordinationTest, EveryRankRegistersAndGetsTheRoster) {
  auto service = StartService(3);
  ASSERT_NE(service, nullptr);
  ASSERT_GT(service->port(), 0);
  auto clients = ConnectAll(service->port(), 3);
  for (const auto& client : clients) {
    ASSERT_NE(client, nullptr);
    ASSERT_EQ(client->roster().size(), 3u);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(client->roster()[r].rank, r);
      EXPECT_EQ(client->roster()[r].host, absl::StrCat("host", r));
      EXPECT_EQ(client->roster()[r].pid, getpid());
    }
  }
  for (auto& client : clients) EXPECT_TRUE(client->Goodbye().ok());
  service->Shutdown(absl::Seconds(5));
  EXPECT_EQ(service->failure(), "");
  for (auto& client : clients) EXPECT_FALSE(client->failure().has_value());
}

TEST(CoordinationTest, RegistrationTimesOutNamingTheMissingRanks) {
  auto service = StartService(3);
  CoordinationClientOptions options = ClientOptions(service->port(), 0, 3);
  options.register_timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  auto client = CoordinationClient::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("ranks 1, 2 of 3 did not register"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(CoordinationTest, NoServiceIsADeadlineNamingTheAddress) {
  auto service = StartService(1);
  const int port = service->port();
  service.reset();  // nothing listens there now
  CoordinationClientOptions options = ClientOptions(port, 0, 1);
  options.register_timeout = absl::Milliseconds(500);
  auto client = CoordinationClient::Connect(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kDeadlineExceeded) << client.status();
  EXPECT_THAT(std::string(client.status().message()), HasSubstr(absl::StrCat("127.0.0.1:", port)));
}

TEST(CoordinationTest, AWorldSizeMismatchIsRefused) {
  auto service = StartService(2);
  auto client = CoordinationClient::Connect(ClientOptions(service->port(), 0, 3));
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("says the world has 3 ranks; this job has 2"));
}

TEST(CoordinationTest, ARankHeldByALiveProcessIsRefused) {
  auto service = StartService(2);
  // Rank 0 registers and waits for rank 1.
  auto first = std::async(std::launch::async,
                          [&] { return CoordinationClient::Connect(ClientOptions(service->port(), 0, 2)); });
  absl::SleepFor(absl::Milliseconds(300));
  CoordinationClientOptions impostor = ClientOptions(service->port(), 0, 2);
  impostor.host = "elsewhere";
  impostor.pid = 4242;
  auto second = CoordinationClient::Connect(impostor);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("rank 0 is held by a live process, rank 0 (host host0"));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("host elsewhere, pid 4242"));
  auto rank1 = CoordinationClient::Connect(ClientOptions(service->port(), 1, 2));
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  auto rank0 = first.get();
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  EXPECT_EQ((*rank0)->roster()[0].host, "host0");
}

TEST(CoordinationTest, KeyValueStore) {
  auto service = StartService(2);
  auto clients = ConnectAll(service->port(), 2);
  CoordinationClient& a = *clients[0];
  CoordinationClient& b = *clients[1];

  ASSERT_TRUE(a.Set("job/x", "1").ok());
  EXPECT_EQ(*b.Get("job/x", absl::Seconds(1)), "1");
  EXPECT_EQ(*b.TryGet("job/x"), std::optional<std::string>("1"));
  EXPECT_EQ(*b.TryGet("job/none"), std::nullopt);
  EXPECT_EQ(a.Set("job/x", "2", /*overwrite=*/false).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(a.Set("job/x", "2").ok());
  EXPECT_EQ(*b.Get("job/x", absl::Seconds(1)), "2");
  ASSERT_TRUE(a.Set("job/y", std::string("\0binary\xff", 8)).ok());
  EXPECT_EQ(*b.Get("job/y", absl::Seconds(1)), std::string("\0binary\xff", 8));
  ASSERT_TRUE(a.Set("other/z", "3").ok());
  auto listed = b.List("job/");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].first, "job/x");
  EXPECT_EQ((*listed)[1].first, "job/y");
  EXPECT_EQ(*b.Delete("job/x"), true);
  EXPECT_EQ(*b.Delete("job/x"), false);
  EXPECT_EQ(*a.TryGet("job/x"), std::nullopt);

  // A blocking get returns as soon as another rank sets the key.
  const absl::Time start = absl::Now();
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    ASSERT_TRUE(a.Set("late", "here").ok());
  });
  auto late = b.Get("late", absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "here");
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));

  // ... and fails naming the key when nobody does.
  auto missing = b.Get("never", absl::Milliseconds(300));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("key 'never' was not set within 0.3 s"));
}

TEST(CoordinationTest, RequestsOverTheLimitsAreRefused) {
  CoordinationServiceOptions limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 1000;
  limits.max_keys = 3;
  limits.max_message_bytes = 64 << 10;
  auto service = StartService(1, absl::Seconds(10), limits);
  auto clients = ConnectAll(service->port(), 1);
  CoordinationClient& c = *clients[0];
  EXPECT_EQ(c.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Set(std::string(17, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  absl::Status big = c.Set("k", std::string(1001, 'v'));
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()), HasSubstr("1001 bytes; the limit is 1000"));
  // Over the message limit: gRPC refuses it before our code sees it.
  EXPECT_EQ(c.Set("k", std::string(128 << 10, 'v')).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(c.Set("a", "1").ok());
  ASSERT_TRUE(c.Set("b", "1").ok());
  ASSERT_TRUE(c.Set("c", "1").ok());
  absl::Status full = c.Set("d", "1");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("holds 3 keys"));
  EXPECT_TRUE(c.Set("a", "2").ok());  // overwriting adds no key
  // The service still answers.
  EXPECT_EQ(*c.TryGet("a"), std::optional<std::string>("2"));
}

TEST(CoordinationTest, AWrongTokenOrJobIdCanNeitherReadNorWrite) {
  auto service = StartService(1);
  auto clients = ConnectAll(service->port(), 1);
  ASSERT_TRUE(clients[0]->Set("secret", "v1").ok());
  RawStub raw(service->port());
  struct Credentials {
    std::string job, token;
  };
  for (const Credentials& creds : {Credentials{kJob, "wrong"}, Credentials{kJob, ""}, Credentials{"other", kToken},
                                   Credentials{"", ""}, Credentials{kJob, std::string(kToken) + "x"}}) {
    {
      grpc::ClientContext context;
      raw.Prepare(context, creds.job, creds.token);
      pb::GetRequest request;
      request.set_key("secret");
      pb::GetResponse response;
      grpc::Status status = raw.stub->Get(&context, request, &response);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << creds.job << "/" << creds.token;
      EXPECT_FALSE(response.found());
      EXPECT_EQ(response.value(), "");
    }
    {
      grpc::ClientContext context;
      raw.Prepare(context, creds.job, creds.token);
      pb::SetRequest request;
      request.mutable_kv()->set_key("secret");
      request.mutable_kv()->set_value("overwritten");
      pb::SetResponse response;
      EXPECT_EQ(raw.stub->Set(&context, request, &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext context;
      raw.Prepare(context, creds.job, creds.token);
      pb::ListRequest request;
      pb::ListResponse response;
      EXPECT_EQ(raw.stub->List(&context, request, &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
      EXPECT_EQ(response.kvs_size(), 0);
    }
  }
  EXPECT_EQ(*clients[0]->TryGet("secret"), std::optional<std::string>("v1"));
  // A client with the wrong token cannot even register.
  CoordinationClientOptions wrong = ClientOptions(service->port(), 0, 1);
  wrong.token = "nope";
  auto refused = CoordinationClient::Connect(wrong);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(CoordinationTest, MalformedRequestsDoNotHurtTheService) {
  auto service = StartService(2);
  RawStub raw(service->port());
  grpc::GenericStub generic(raw.channel);
  for (const char* method : {"/lockstep.coordination.Coordination/Set",
                                    "/lockstep.coordination.Coordination/Register",
                                    "/lockstep.coordination.Coordination/Barrier"}) {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    const std::string garbage = "\xff\xff\xff\xff\x0f garbage that is not a protobuf \x08\x80";
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&done](grpc::Status s) { done.set_value(s); });
    EXPECT_FALSE(done.get_future().get().ok()) << method;
  }
  // Well-formed but nonsensical: a rank outside the world, a negative timeout.
  {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    pb::BarrierRequest request;
    request.set_name("b");
    request.set_rank(-7);
    pb::BarrierResponse response;
    grpc::Status status = raw.stub->Barrier(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("rank -7 is outside this job's world of 2"));
  }
  {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    pb::HeartbeatRequest request;
    request.set_rank(1);
    pb::HeartbeatResponse response;
    EXPECT_EQ(raw.stub->Heartbeat(&context, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  // The service is unharmed: a whole job still works.
  auto clients = ConnectAll(service->port(), 2);
  EXPECT_TRUE(clients[0]->Set("k", "v").ok());
  EXPECT_EQ(*clients[1]->Get("k", absl::Seconds(1)), "v");
  EXPECT_EQ(service->failure(), "");
}

TEST(CoordinationTest, BarriersWaitForEveryRankAndNameTheMissing) {
  auto service = StartService(3);
  auto clients = ConnectAll(service->port(), 3);
  for (int round = 0; round < 3; ++round) {  // a name can be reused
    std::vector<std::future<absl::Status>> arrivals;
    for (int r = 0; r < 3; ++r) {
      arrivals.push_back(std::async(std::launch::async, [&, r] {
        absl::SleepFor(absl::Milliseconds(50 * r));
        return clients[r]->Barrier("step", absl::Seconds(10));
      }));
    }
    for (auto& a : arrivals) EXPECT_TRUE(a.get().ok());
  }
  // Rank 2 never comes.
  std::vector<std::future<absl::Status>> partial;
  for (int r = 0; r < 2; ++r) {
    partial.push_back(std::async(std::launch::async, [&, r] {
      return clients[r]->Barrier("checkpoint", absl::Milliseconds(400));
    }));
  }
  for (auto& p : partial) {
    absl::Status s = p.get();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(s.message()), HasSubstr("barrier 'checkpoint': rank 2 of 3 did not arrive within 0.4 s"));
  }
}

TEST(CoordinationTest, ADeadRankIsNamedToEveryOtherRankWithinTheTimeout) {
  const absl::Duration timeout = absl::Seconds(1);
  auto service = StartService(3, timeout);
  std::vector<EventLog> logs(3);
  // Ranks 0 and 1 are real clients; rank 2 registers by hand and then goes silent.
  RawStub raw(service->port());
  auto rank2 = std::async(std::launch::async, [&] {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    pb::RegisterRequest request;
    request.mutable_peer()->set_rank(2);
    request.mutable_peer()->set_host("node-c");
    request.mutable_peer()->set_pid(777);
    request.mutable_peer()->set_incarnation(5);
    request.set_world_size(3);
    request.set_timeout_ms(10000);
    pb::RegisterResponse response;
    return raw.stub->Register(&context, request, &response);
  });
  std::vector<std::future<absl::StatusOr<std::unique_ptr<CoordinationClient>>>> pending;
  for (int r = 0; r < 2; ++r) {
    CoordinationClientOptions options = ClientOptions(service->port(), r, 3);
    options.heartbeat_timeout = timeout;
    options.on_event = logs[r].Callback();
    pending.push_back(std::async(std::launch::async, [options] { return CoordinationClient::Connect(options); }));
  }
  std::vector<std::unique_ptr<CoordinationClient>> clients;
  for (auto& p : pending) {
    auto c = p.get();
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
  }
  ASSERT_TRUE(rank2.get().ok());
  const absl::Time registered = absl::Now();
  // Rank 0 waits in a barrier that can never complete; the failure ends it.
  auto stuck = std::async(std::launch::async, [&] { return clients[0]->Barrier("never", absl::Seconds(60)); });
  for (int r = 0; r < 2; ++r) {
    auto event = logs[r].WaitFor(CoordinationEvent::Kind::kPeerFailed, absl::Seconds(10));
    ASSERT_TRUE(event.has_value()) << "rank " << r << " never heard";
    EXPECT_THAT(event->first.message, HasSubstr("rank 2 (host node-c, pid 777) is dead: no heartbeat for"));
    EXPECT_EQ(event->first.peer.rank, 2);
    EXPECT_LT(event->second - registered, timeout + absl::Seconds(1));
    ASSERT_TRUE(clients[r]->failure().has_value());
  }
  absl::Status barrier = stuck.get();
  EXPECT_EQ(barrier.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(barrier.message()), HasSubstr("rank 2 (host node-c, pid 777) is dead"));
  EXPECT_THAT(service->failure(), HasSubstr("rank 2"));
}

// A fault-tolerant service: rank 0 is a real client; ranks 1 and 2 register by
// hand, open their event streams and then drop them, as a killed process's
// connection drops. The first death starts epoch 1 without rank 2 (well before
// the 10 s heartbeat timeout); the second leaves fewer than min_ranks, and the
// job fails.
TEST(CoordinationTest, AFaultTolerantJobGoesOnWithoutARankThatDiesUntilTooFewAreLeft) {
  CoordinationServiceOptions ft;
  ft.fault_tolerant = true;
  ft.min_ranks = 2;
  auto service = StartService(3, absl::Seconds(10), ft);
  ASSERT_NE(service, nullptr);
  RawStub raw(service->port());
  auto register_by_hand = [&](int rank) {
    return std::async(std::launch::async, [&raw, rank] {
      grpc::ClientContext context;
      raw.Prepare(context, kJob, kToken);
      pb::RegisterRequest request;
      request.mutable_peer()->set_rank(rank);
      request.mutable_peer()->set_host("node-x");
      request.mutable_peer()->set_pid(700 + rank);
      request.mutable_peer()->set_incarnation(50 + rank);
      request.set_world_size(3);
      request.set_timeout_ms(10000);
      pb::RegisterResponse response;
      return raw.stub->Register(&context, request, &response);
    });
  };
  auto rank1 = register_by_hand(1);
  auto rank2 = register_by_hand(2);
  EventLog log;
  CoordinationClientOptions options = ClientOptions(service->port(), 0, 3);
  options.on_event = log.Callback();
  auto client = CoordinationClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(rank1.get().ok());
  ASSERT_TRUE(rank2.get().ok());
  auto value = [&](const std::string& key) {
    auto v = (*client)->TryGet(key);
    return v.ok() && *v ? **v : std::string("(none)");
  };
  EXPECT_EQ(value(kEpochKey), "0");
  EXPECT_EQ(value(EpochMembersKey(0)), "0,1,2");

  // An event stream per hand-made rank, dropped without a goodbye.
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<pb::Event>> reader;
  };
  auto open_stream = [&](int rank) {
    auto stream = std::make_unique<Stream>();
    raw.Prepare(stream->context, kJob, kToken);
    stream->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    pb::WatchRequest request;
    request.set_rank(rank);
    stream->reader = raw.stub->WatchEvents(&stream->context, request);
    return stream;
  };
  auto stream1 = open_stream(1);
  auto stream2 = open_stream(2);
  absl::SleepFor(absl::Milliseconds(400));  // the service has both streams
  // A wait for a key that the rank about to go was to set.
  auto waiting = std::async(std::launch::async, [&] { return (*client)->Get("from-rank-2", absl::Seconds(20)); });
  const absl::Time dropped = absl::Now();
  stream2->context.TryCancel();
  auto left = log.WaitFor(CoordinationEvent::Kind::kMemberLeft, absl::Seconds(5));
  ASSERT_TRUE(left.has_value()) << "rank 0 never heard that rank 2 left";
  EXPECT_LT(left->second - dropped, absl::Seconds(3));  // not the 10 s heartbeat timeout
  EXPECT_EQ(left->first.peer.rank, 2);
  EXPECT_THAT(left->first.message, HasSubstr("rank 2 (host node-x, pid 702) is dead: its connection closed"));
  EXPECT_THAT(left->first.message, HasSubstr("the job goes on with ranks 0, 1 (epoch 1)"));
  EXPECT_FALSE((*client)->failure().has_value());
  EXPECT_EQ(service->failure(), "");
  EXPECT_EQ(value(kEpochKey), "1");
  EXPECT_EQ(value(EpochMembersKey(1)), "0,1");
  absl::StatusOr<std::string> waited = waiting.get();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kFailedPrecondition) << waited.status();
  EXPECT_THAT(std::string(waited.status().message()),
              HasSubstr("membership changed (epoch 1) while waiting for key 'from-rank-2'"));
  EXPECT_LT(absl::Now() - dropped, absl::Seconds(5));
  EXPECT_FALSE((*client)->failure().has_value());

  // Barriers wait for the live ranks only.
  auto barrier1 = std::async(std::launch::async, [&] {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    pb::BarrierRequest request;
    request.set_name("after");
    request.set_rank(1);
    request.set_timeout_ms(10000);
    pb::BarrierResponse response;
    return raw.stub->Barrier(&context, request, &response);
  });
  EXPECT_TRUE((*client)->Barrier("after", absl::Seconds(10)).ok());
  EXPECT_TRUE(barrier1.get().ok());

  // The removed rank's heartbeats are refused, naming why.
  {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    pb::HeartbeatRequest request;
    request.set_rank(2);
    request.set_incarnation(52);
    pb::HeartbeatResponse response;
    const grpc::Status status = raw.stub->Heartbeat(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_THAT(status.error_message(), HasSubstr("rank 2 (host node-x, pid 702) was removed from the job"));
  }

  // One more death leaves 1 rank, fewer than min_ranks: the job fails.
  stream1->context.TryCancel();
  auto failed = log.WaitFor(CoordinationEvent::Kind::kPeerFailed, absl::Seconds(5));
  ASSERT_TRUE(failed.has_value()) << "rank 0 never heard that the job failed";
  EXPECT_THAT(failed->first.message, HasSubstr("rank 1 (host node-x, pid 701) is dead"));
  EXPECT_THAT(failed->first.message, HasSubstr("1 rank(s) left, fewer than min_ranks 2"));
  EXPECT_THAT(service->failure(), HasSubstr("fewer than min_ranks 2"));
  for (Stream* s : {stream1.get(), stream2.get()}) (void)s->reader->Finish();
}

TEST(CoordinationTest, AReportedErrorAndAPreemptionNoticeReachEveryRank) {
  auto service = StartService(2);
  std::vector<EventLog> logs(2);
  auto clients = ConnectAll(service->port(), 2, &logs);
  ASSERT_TRUE(clients[0]->ReportPreemption("SIGTERM").ok());
  for (int r = 0; r < 2; ++r) {
    auto event = logs[r].WaitFor(CoordinationEvent::Kind::kPreemptionNotice, absl::Seconds(5));
    ASSERT_TRUE(event.has_value());
    EXPECT_THAT(event->first.message, HasSubstr("rank 0 (host host0, pid"));
    EXPECT_THAT(event->first.message, HasSubstr("received a preemption notice (SIGTERM)"));
    EXPECT_FALSE(clients[r]->failure().has_value());  // a notice is not a failure
  }
  ASSERT_TRUE(clients[1]->ReportError("CUDA error: an illegal memory access").ok());
  for (int r = 0; r < 2; ++r) {
    auto event = logs[r].WaitFor(CoordinationEvent::Kind::kPeerFailed, absl::Seconds(5));
    ASSERT_TRUE(event.has_value());
    EXPECT_THAT(event->first.message, HasSubstr("rank 1 (host host1, pid"));
    EXPECT_THAT(event->first.message, HasSubstr("failed: CUDA error: an illegal memory access"));
  }
  EXPECT_EQ(clients[0]->Set("k", "v").code(), absl::StatusCode::kAborted);
}

// A caller with the job's token that is not the registered incarnation of a rank
// (never registered, or a stale process) cannot report errors, preemption notices
// or goodbyes for it: refused, and a real job then starts and runs unharmed.
TEST(CoordinationTest, PerRankCallsFromAnythingButTheRegisteredIncarnationAreRefused) {
  auto service = StartService(2);
  RawStub raw(service->port());
  auto expect_refused = [&](auto call, const char* what) {
    grpc::ClientContext context;
    raw.Prepare(context, kJob, kToken);
    grpc::Status status = call(context);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << what;
    EXPECT_THAT(status.error_message(), HasSubstr("which is not the registered one")) << what;
  };
  auto report_error = [&](uint64_t incarnation) {
    return [&, incarnation](grpc::ClientContext& context) {
      pb::ErrorReport request;
      request.set_rank(0);
      request.set_incarnation(incarnation);
      request.set_message("forged");
      pb::ErrorReportResponse response;
      return raw.stub->ReportError(&context, request, &response);
    };
  };
  auto notice = [&](uint64_t incarnation) {
    return [&, incarnation](grpc::ClientContext& context) {
      pb::PreemptionNotice request;
      request.set_rank(1);
      request.set_incarnation(incarnation);
      request.set_reason("forged");
      pb::PreemptionNoticeResponse response;
      return raw.stub->ReportPreemption(&context, request, &response);
    };
  };
  auto goodbye = [&](uint64_t incarnation) {
    return [&, incarnation](grpc::ClientContext& context) {
      pb::GoodbyeRequest request;
      request.set_rank(0);
      request.set_incarnation(incarnation);
      pb::GoodbyeResponse response;
      return raw.stub->Goodbye(&context, request, &response);
    };
  };
  // Before anyone registered.
  expect_refused(report_error(0), "error report, unregistered");
  expect_refused(notice(0), "preemption notice, unregistered");
  expect_refused(goodbye(0), "goodbye, unregistered");
  EXPECT_EQ(service->failure(), "");

  std::vector<EventLog> logs(2);
  auto clients = ConnectAll(service->port(), 2, &logs);
  ASSERT_NE(clients[0], nullptr);
  // After: another incarnation than the registered one is refused too.
  const uint64_t registered = clients[0]->roster()[0].incarnation;
  expect_refused(report_error(registered + 1), "error report, wrong incarnation");
  expect_refused(notice(clients[1]->roster()[1].incarnation + 1), "preemption notice, wrong incarnation");
  expect_refused(goodbye(registered + 1), "goodbye, wrong incarnation");
  EXPECT_EQ(service->failure(), "");
  EXPECT_TRUE(clients[0]->Set("k", "v").ok());
  EXPECT_EQ(*clients[1]->Get("k", absl::Seconds(1)), "v");
  EXPECT_FALSE(logs[0].WaitFor(CoordinationEvent::Kind::kPreemptionNotice, absl::Milliseconds(300)).has_value());
  // The real ranks' own calls still work.
  ASSERT_TRUE(clients[1]->ReportPreemption("SIGTERM").ok());
  EXPECT_TRUE(logs[0].WaitFor(CoordinationEvent::Kind::kPreemptionNotice, absl::Seconds(5)).has_value());
  for (auto& c : clients) EXPECT_TRUE(c->Goodbye().ok());
}

TEST(CoordinationTest, OrderlyShutdownWaitsForEveryRank) {
  auto service = StartService(2);
  std::vector<EventLog> logs(2);
  auto clients = ConnectAll(service->port(), 2, &logs);
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    service->Shutdown(absl::Seconds(20));
    stopped = true;
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(stopped.load());  // rank 1 has not said goodbye yet
  EXPECT_TRUE(clients[1]->Set("still", "served").ok());
  EXPECT_TRUE(clients[0]->Goodbye().ok());
  EXPECT_TRUE(clients[1]->Goodbye().ok());
  stopper.join();
  EXPECT_TRUE(stopped.load());
  EXPECT_EQ(service->failure(), "");
  for (auto& c : clients) EXPECT_FALSE(c->failure().has_value());
}

// Starts the standalone lockstep_coordinator for a world of 2 with `extra_args`,
// and reads the port it listens on from its first line.
struct SpawnedCoordinator {
  pid_t pid = 0;
  int port = 0;
  FILE* stream = nullptr;  // its stdout. Owned.
};

void SpawnCoordinator(const std::vector<std::string>& extra_args, SpawnedCoordinator& spawned) {
  const std::string binary = LOCKSTEP_COORDINATOR_BINARY;
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string token_env = absl::StrCat("LOCKSTEP_JOB_TOKEN=", kToken);
  std::vector<std::string> args = {binary, "--world_size=2", absl::StrCat("--job_id=", kJob)};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp = {const_cast<char*>(token_env.c_str())};
  // The sanitizer lanes' options (suppressions) reach the coordinator too.
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view var(*e);
    if (absl::StartsWith(var, "ASAN_OPTIONS=") || absl::StartsWith(var, "LSAN_OPTIONS=") ||
        absl::StartsWith(var, "UBSAN_OPTIONS=") || absl::StartsWith(var, "TSAN_OPTIONS=")) {
      envp.push_back(*e);
    }
  }
  envp.push_back(nullptr);
  const int spawn = posix_spawn(&spawned.pid, binary.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  ASSERT_EQ(spawn, 0) << binary;
  spawned.stream = fdopen(out[0], "r");
  char line[512] = {};
  ASSERT_NE(fgets(line, sizeof(line), spawned.stream), nullptr);
  const char* at = std::strstr(line, "listening on port");
  ASSERT_NE(at, nullptr) << line;
  ASSERT_EQ(std::sscanf(at, "listening on port %d", &spawned.port), 1) << line;
}

// The standalone binary, killed with SIGKILL: every client names the lost service.
TEST(CoordinationTest, ACrashedCoordinatorIsNamedByEveryRank) {
  SpawnedCoordinator coordinator;
  ASSERT_NO_FATAL_FAILURE(SpawnCoordinator({"--address=127.0.0.1:0"}, coordinator));
  const pid_t pid = coordinator.pid;
  const int port = coordinator.port;
  FILE* stream = coordinator.stream;

  const absl::Duration timeout = absl::Seconds(2);
  std::vector<EventLog> logs(2);
  auto clients = ConnectAll(port, 2, &logs, timeout);
  ASSERT_TRUE(clients[0]->Set("k", "v").ok());
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  fclose(stream);
  const absl::Time killed = absl::Now();
  for (int r = 0; r < 2; ++r) {
    auto event = logs[r].WaitFor(CoordinationEvent::Kind::kCoordinatorLost, absl::Seconds(10));
    ASSERT_TRUE(event.has_value()) << "rank " << r;
    EXPECT_THAT(event->first.message, HasSubstr(absl::StrCat("lost the coordination service at 127.0.0.1:", port)));
    EXPECT_LT(event->second - killed, timeout + absl::Seconds(1));
  }
}

// The standalone binary, hung with SIGSTOP: its connections stay open, so only
// the unanswered heartbeats tell. Every client names the lost service, and then
// leaves without waiting on it (a goodbye would only wait out its deadline, 2 s,
// eating into the grace period a stopping rank has).
TEST(CoordinationTest, AHungCoordinatorIsNamedAndNotWaitedOn) {
  SpawnedCoordinator coordinator;
  ASSERT_NO_FATAL_FAILURE(SpawnCoordinator({"--address=127.0.0.1:0"}, coordinator));
  const pid_t pid = coordinator.pid;
  const absl::Duration timeout = absl::Seconds(2);
  std::vector<EventLog> logs(2);
  auto clients = ConnectAll(coordinator.port, 2, &logs, timeout);
  ASSERT_TRUE(clients[0]->Set("k", "v").ok());
  kill(pid, SIGSTOP);
  const absl::Time stopped = absl::Now();
  for (int r = 0; r < 2; ++r) {
    auto event = logs[r].WaitFor(CoordinationEvent::Kind::kCoordinatorLost, absl::Seconds(10));
    EXPECT_TRUE(event.has_value()) << "rank " << r;
    if (!event) continue;
    EXPECT_THAT(event->first.message, HasSubstr("no answer for"));
    EXPECT_LT(event->second - stopped, timeout + absl::Seconds(2));
  }
  for (int r = 0; r < 2; ++r) {
    const absl::Time start = absl::Now();
    EXPECT_TRUE(clients[r]->Goodbye().ok()) << "rank " << r;
    EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "rank " << r << " waited on the hung service";
  }
  clients.clear();  // the destructors say no goodbye either
  kill(pid, SIGKILL);
  kill(pid, SIGCONT);
  int status = 0;
  waitpid(pid, &status, 0);
  fclose(coordinator.stream);
}

TEST(CoordinationTest, TheStandaloneCoordinatorExitsOnceEveryRankIsDone) {
  SpawnedCoordinator coordinator;
  ASSERT_NO_FATAL_FAILURE(SpawnCoordinator({}, coordinator));
  const pid_t pid = coordinator.pid;
  const int port = coordinator.port;
  FILE* stream = coordinator.stream;
  {
    auto clients = ConnectAll(port, 2);
    for (auto& c : clients) EXPECT_TRUE(c->Goodbye().ok());
  }
  int status = -1;
  for (int i = 0; i < 100 && waitpid(pid, &status, WNOHANG) == 0; ++i) absl::SleepFor(absl::Milliseconds(100));
  if (!WIFEXITED(status)) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    FAIL() << "the coordinator did not exit after every rank said goodbye";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0);
  fclose(stream);
}

TEST(CoordinationTest, TlsWhenConfigured) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl to make a certificate";
  testing::TempDir dir;
  const std::string cert = dir.file("cert.pem"), key = dir.file("key.pem");
  const std::string make = absl::StrCat(
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout ",
      key, " -out ", cert, " >/dev/null 2>&1");
  ASSERT_EQ(std::system(make.c_str()), 0);
  CoordinationServiceOptions tls;
  tls.tls.cert_file = cert;
  tls.tls.key_file = key;
  auto service = StartService(1, absl::Seconds(10), tls);
  ASSERT_NE(service, nullptr);
  CoordinationClientOptions options = ClientOptions(service->port(), 0, 1);
  options.tls.ca_file = cert;
  auto client = CoordinationClient::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->Set("k", "over tls").ok());
  EXPECT_EQ(*(*client)->TryGet("k"), std::optional<std::string>("over tls"));
  // A client without TLS gets nowhere.
  CoordinationClientOptions plain = ClientOptions(service->port(), 0, 1);
  plain.register_timeout = absl::Milliseconds(500);
  EXPECT_FALSE(CoordinationClient::Connect(plain).ok());
  // A bad key file is a clear error.
  tls.tls.key_file = dir.file("missing.pem");
  tls.address = "127.0.0.1:0";
  tls.job_id = kJob;
  tls.token = kToken;
  auto bad = CoordinationService::Start(tls);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("missing.pem"));
}

TEST(CoordinationTest, StartRefusesBadOptions) {
  CoordinationServiceOptions options;
  options.job_id = kJob;
  EXPECT_EQ(CoordinationService::Start(options).status().code(), absl::StatusCode::kInvalidArgument);  // no token
  options.token = kToken;
  options.address = "127.0.0.1";
  EXPECT_EQ(CoordinationService::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.address = "127.0.0.1:99999";
  EXPECT_EQ(CoordinationService::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.address = "127.0.0.1:0";
  options.fault_tolerant = true;
  options.min_ranks = 2;  // more than the world of 1
  EXPECT_EQ(CoordinationService::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.fault_tolerant = false;
  auto first = StartService(1);
  options.address = absl::StrCat("127.0.0.1:", first->port());  // taken
  EXPECT_EQ(CoordinationService::Start(options).status().code(), absl::StatusCode::kUnavailable);
}

TEST(CoordinationAddressTest, ResolvesFromConfigThenEnvironment) {
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  unsetenv("SLURM_JOB_NODELIST");
  EXPECT_EQ(*ResolveCoordinatorAddress("", 29400), "");
  EXPECT_EQ(*ResolveCoordinatorAddress("a:1", 29400), "a:1");
  EXPECT_FALSE(ResolveCoordinatorAddress("a", 29400).ok());
  setenv("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1", 1);
  EXPECT_EQ(*ResolveCoordinatorAddress("", 29400), "gpu07:29400");
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  EXPECT_FALSE(ResolveCoordinatorAddress("", 29400).ok());  // no MASTER_PORT
  setenv("MASTER_PORT", "1234", 1);
  EXPECT_EQ(*ResolveCoordinatorAddress("", 29400), "127.0.0.1:1234");
  setenv("MASTER_PORT", "http", 1);
  EXPECT_THAT(std::string(ResolveCoordinatorAddress("", 29400).status().message()), HasSubstr("MASTER_PORT 'http'"));
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  unsetenv("SLURM_JOB_NODELIST");

  EXPECT_EQ(*FirstSlurmHost("node1"), "node1");
  EXPECT_EQ(*FirstSlurmHost("a,b"), "a");
  EXPECT_EQ(*FirstSlurmHost("n[001-004]"), "n001");
  EXPECT_EQ(*FirstSlurmHost("rack[3,5]-n[10-11],x"), "rack3-n10");
  EXPECT_FALSE(FirstSlurmHost("n[1-2").ok());
  EXPECT_FALSE(FirstSlurmHost("").ok());
  EXPECT_FALSE(FirstSlurmHost("n[a-b]").ok());
}

TEST(CoordinationAddressTest, TokensFromTheEnvironmentOrAFile) {
  testing::TempDir dir;
  unsetenv("LOCKSTEP_JOB_TOKEN");
  unsetenv("LOCKSTEP_JOB_TOKEN_FILE");
  EXPECT_EQ(*ResolveJobToken(""), "");
  std::ofstream(dir.file("token")) << "from-file\n";
  EXPECT_EQ(*ResolveJobToken(dir.file("token")), "from-file");
  setenv("LOCKSTEP_JOB_TOKEN_FILE", dir.file("token").c_str(), 1);
  EXPECT_EQ(*ResolveJobToken(""), "from-file");
  setenv("LOCKSTEP_JOB_TOKEN", "from-env", 1);
  EXPECT_EQ(*ResolveJobToken(dir.file("token")), "from-env");
  unsetenv("LOCKSTEP_JOB_TOKEN");
  unsetenv("LOCKSTEP_JOB_TOKEN_FILE");
  EXPECT_THAT(std::string(ResolveJobToken(dir.file("absent")).status().message()), HasSubstr("absent"));
  std::ofstream(dir.file("empty")) << "\n";
  EXPECT_EQ(ResolveJobToken(dir.file("empty")).status().code(), absl::StatusCode::kInvalidArgument);

  const std::string a = GenerateJobToken(), b = GenerateJobToken();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(CoordinationAddressTest, StatusBecomesTheTrainersExceptions) {
  EXPECT_NO_THROW(ThrowIfError(absl::OkStatus(), "x"));
  EXPECT_THROW(ThrowIfError(absl::InvalidArgumentError("bad"), "x"), InvalidArgumentError);
  try {
    ThrowIfError(absl::AbortedError("rank 3 (host h, pid 1) is dead"), "barrier 'end'");
    FAIL();
  } catch (const CoordinationError& e) {
    EXPECT_STREQ(e.what(), "barrier 'end': rank 3 (host h, pid 1) is dead");
  }
}

}  // namespace
}  // namespace lockstep
