// Fuzzes the coordination service's request handlers with random requests, in
// process: the service runs with no listening port and is reached through gRPC's
// in-process channel, so no network is involved. Each input is a fresh service for a
// world of 2 and up to 24 calls; the input picks each call's method, its
// authentication (right token, wrong token, none) and its fields.
//
// Properties: no call crashes or hangs the service; a call without the job's token
// is refused (UNAUTHENTICATED, or by gRPC when it does not parse); a per-rank call
// (heartbeat, error report, preemption notice, goodbye) succeeds only from the
// incarnation that registered the rank; the job is failed only by an error report
// that was accepted.
#include <fuzzer/FuzzedDataProvider.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "coordination/coordination_internal.h"
#include "fuzz_util.h"
#include "lockstep/coordination.h"
#include "proto/coordination.grpc.pb.h"

namespace pb = lockstep::coordination;

namespace {

constexpr char kJob[] = "fuzz-job";
constexpr char kToken[] = "fuzz-token";
constexpr int kWorld = 2;

enum class Auth { kRight, kWrongToken, kNone };

std::unique_ptr<grpc::ClientContext> Context(Auth auth) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (auth != Auth::kNone) {
    context->AddMetadata(lockstep::kJobIdMetadata, kJob);
    context->AddMetadata(lockstep::kTokenMetadata, auth == Auth::kRight ? kToken : "not-the-token");
  }
  return context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  lockstep::CoordinationServiceOptions options;
  options.job_id = kJob;
  options.token = kToken;
  options.world_size = kWorld;
  options.heartbeat_timeout = absl::Seconds(30);
  options.max_wait = absl::Milliseconds(20);  // registrations, gets and barriers give up quickly
  options.max_key_bytes = 64;
  options.max_value_bytes = 256;
  options.max_keys = 32;
  options.log_refusals = false;
  auto started = lockstep::StartInProcessCoordinationService(options);
  LOCKSTEP_FUZZ_CHECK(started.ok(), std::string(started.status().message()).c_str());
  auto stub = pb::Coordination::NewStub(started->channel);

  // The incarnation that holds each rank, as far as accepted registrations tell.
  std::array<uint64_t, kWorld> holder{};
  std::array<bool, kWorld> held{};
  bool error_accepted = false;
  auto rank_in = [&] { return in.ConsumeIntegralInRange<int32_t>(-1, kWorld); };
  auto incarnation_in = [&] { return in.ConsumeIntegralInRange<uint64_t>(1, 4); };
  auto string_in = [&] { return in.ConsumeRandomLengthString(80); };

  for (int call = 0; call < 24 && in.remaining_bytes() > 0; ++call) {
    const int method = in.ConsumeIntegralInRange(0, 10);
    const auto auth = static_cast<Auth>(in.ConsumeIntegralInRange(0, 9) == 0 ? in.ConsumeIntegralInRange(1, 2) : 0);
    auto context = Context(auth);
    grpc::Status status;
    int per_rank = -1;            // the rank of a per-rank call
    uint64_t per_rank_from = 0;   // and its incarnation
    bool is_error_report = false;
    switch (method) {
      case 0: {
        pb::RegisterRequest request;
        pb::RegisterResponse response;
        request.mutable_peer()->set_rank(rank_in());
        request.mutable_peer()->set_host(string_in());
        request.mutable_peer()->set_pid(in.ConsumeIntegral<int64_t>());
        request.mutable_peer()->set_incarnation(incarnation_in());
        request.set_world_size(in.ConsumeBool() ? kWorld : in.ConsumeIntegral<int32_t>());
        request.set_timeout_ms(in.ConsumeIntegralInRange<int64_t>(-5, 50));
        status = stub->Register(context.get(), request, &response);
        const int rank = request.peer().rank();
        const bool took = status.ok() || status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
        if (took && rank >= 0 && rank < kWorld) {
          holder[rank] = request.peer().incarnation();
          held[rank] = true;
        }
        break;
      }
      case 1: {
        pb::HeartbeatRequest request;
        pb::HeartbeatResponse response;
        request.set_rank(per_rank = rank_in());
        request.set_incarnation(per_rank_from = incarnation_in());
        request.set_step(in.ConsumeIntegral<int64_t>());
        status = stub->Heartbeat(context.get(), request, &response);
        break;
      }
      case 2: {
        pb::SetRequest request;
        pb::SetResponse response;
        request.mutable_kv()->set_key(string_in());
        request.mutable_kv()->set_value(in.ConsumeRandomLengthString(400));
        request.set_overwrite(in.ConsumeBool());
        status = stub->Set(context.get(), request, &response);
        break;
      }
      case 3: {
        pb::GetRequest request;
        pb::GetResponse response;
        request.set_key(string_in());
        request.set_timeout_ms(in.ConsumeIntegralInRange<int64_t>(-5, 50));
        status = stub->Get(context.get(), request, &response);
        break;
      }
      case 4: {
        pb::ListRequest request;
        pb::ListResponse response;
        request.set_prefix(string_in());
        status = stub->List(context.get(), request, &response);
        break;
      }
      case 5: {
        pb::DeleteRequest request;
        pb::DeleteResponse response;
        request.set_key(string_in());
        status = stub->Delete(context.get(), request, &response);
        break;
      }
      case 6: {
        pb::BarrierRequest request;
        pb::BarrierResponse response;
        request.set_name(string_in());
        request.set_rank(rank_in());
        request.set_timeout_ms(in.ConsumeIntegralInRange<int64_t>(-5, 50));
        status = stub->Barrier(context.get(), request, &response);
        break;
      }
      case 7: {
        pb::ErrorReport request;
        pb::ErrorReportResponse response;
        request.set_rank(per_rank = rank_in());
        request.set_incarnation(per_rank_from = incarnation_in());
        request.set_message(string_in());
        status = stub->ReportError(context.get(), request, &response);
        is_error_report = true;
        break;
      }
      case 8: {
        pb::PreemptionNotice request;
        pb::PreemptionNoticeResponse response;
        request.set_rank(per_rank = rank_in());
        request.set_incarnation(per_rank_from = incarnation_in());
        request.set_reason(string_in());
        status = stub->ReportPreemption(context.get(), request, &response);
        break;
      }
      case 9: {
        pb::WatchRequest request;
        request.set_rank(rank_in());
        request.set_after_sequence(in.ConsumeIntegralInRange<int64_t>(-2, 8));
        context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(30));
        auto reader = stub->WatchEvents(context.get(), request);
        pb::Event event;
        for (int i = 0; i < 4 && reader->Read(&event); ++i) {
        }
        status = reader->Finish();
        break;
      }
      case 10: {
        pb::GoodbyeRequest request;
        pb::GoodbyeResponse response;
        request.set_rank(per_rank = rank_in());
        request.set_incarnation(per_rank_from = incarnation_in());
        status = stub->Goodbye(context.get(), request, &response);
        break;
      }
    }
    if (auth != Auth::kRight && method != 9) {
      // Refused by the service, or (INTERNAL) by gRPC itself before any handler ran:
      // a request whose string fields are not UTF-8 does not parse.
      LOCKSTEP_FUZZ_CHECK(status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                              status.error_code() == grpc::StatusCode::INTERNAL,
                          status.error_message().c_str());
    }
    if (status.ok() && per_rank >= 0) {
      LOCKSTEP_FUZZ_CHECK(per_rank < kWorld && held[per_rank] && holder[per_rank] == per_rank_from,
                          "a per-rank call from an incarnation that does not hold the rank was accepted");
    }
    if (status.ok() && is_error_report) error_accepted = true;
  }
  const std::string failure = started->service->failure();
  LOCKSTEP_FUZZ_CHECK(failure.empty() || error_accepted, failure.c_str());
  started->service->Shutdown(absl::ZeroDuration());
  return 0;
}
