// lockstep_coordinator: the coordination service on its own, for jobs that must
// outlive rank 0. Point the ranks at it with coordination.address (or
// --coordinator, MASTER_ADDR/MASTER_PORT) and give both the same job id and token.
//
//   LOCKSTEP_JOB_TOKEN=... lockstep_coordinator --address=node1:29400 --world_size=16 --job_id=run42
//
// It exits once every rank of the job has registered and then said goodbye or
// died: 0 when the job ended in order, 1 when a rank failed, 2 for a bad flag.
// SIGTERM or SIGINT stops it at once (exit 1: the job did not finish).
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "lockstep/coordination.h"

ABSL_FLAG(std::string, address, "127.0.0.1:0", "host:port to listen on (port 0 picks a free port, printed)");
ABSL_FLAG(bool, bind_all, false, "listen on every interface at --address's port");
ABSL_FLAG(int, world_size, 0, "number of ranks in the job (required)");
ABSL_FLAG(std::string, job_id, "lockstep", "job id the ranks must present");
ABSL_FLAG(std::string, token_file, "",
          "file holding the job token (else LOCKSTEP_JOB_TOKEN or LOCKSTEP_JOB_TOKEN_FILE)");
ABSL_FLAG(double, heartbeat_timeout_seconds, 10.0, "a rank silent this long is declared dead");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Runs a Lockstep job's coordination service. Usage: lockstep_coordinator "
                               "--world_size=N [--address=host:port] [--job_id=ID]");
  absl::ParseCommandLine(argc, argv);
  const int world_size = absl::GetFlag(FLAGS_world_size);
  if (world_size < 1) {
    std::fprintf(stderr, "lockstep_coordinator: --world_size must be at least 1\n");
    return 2;
  }
  absl::StatusOr<std::string> token = lockstep::ResolveJobToken(absl::GetFlag(FLAGS_token_file));
  if (!token.ok() || token->empty()) {
    std::fprintf(stderr, "lockstep_coordinator: %s\n",
                 token.ok() ? "no job token: set LOCKSTEP_JOB_TOKEN or give --token_file"
                            : std::string(token.status().message()).c_str());
    return 2;
  }
  const double timeout = absl::GetFlag(FLAGS_heartbeat_timeout_seconds);
  if (!(timeout > 0)) {
    std::fprintf(stderr, "lockstep_coordinator: --heartbeat_timeout_seconds must be positive\n");
    return 2;
  }

  // Signals go to one thread that stops the service; every other thread blocks them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGUSR2);  // our own wake-up for the signal thread at the end
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  lockstep::CoordinationServiceOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.bind_all = absl::GetFlag(FLAGS_bind_all);
  options.world_size = world_size;
  options.job_id = absl::GetFlag(FLAGS_job_id);
  options.token = *token;
  options.heartbeat_timeout = absl::Seconds(timeout);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  absl::StatusOr<std::unique_ptr<lockstep::CoordinationService>> service =
      lockstep::CoordinationService::Start(options);
  if (!service.ok()) {
    std::fprintf(stderr, "lockstep_coordinator: %s\n", std::string(service.status().message()).c_str());
    return service.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("lockstep_coordinator: job '%s', %d ranks, listening on port %d\n", options.job_id.c_str(), world_size,
              (*service)->port());
  std::fflush(stdout);

  std::atomic<bool> signalled{false};
  std::thread signals([&] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    if (signal == SIGUSR2) return;  // our own wake-up at the end
    signalled = true;
    std::fprintf(stderr, "lockstep_coordinator: %s, stopping\n", signal == SIGTERM ? "SIGTERM" : "SIGINT");
    (*service)->Shutdown(absl::ZeroDuration());
  });

  (*service)->Wait(/*until_all_gone=*/true);
  const std::string failure = (*service)->failure();
  (*service)->Shutdown(absl::Seconds(1));
  if (!signalled) pthread_kill(signals.native_handle(), SIGUSR2);
  signals.join();
  if (!failure.empty()) {
    std::fprintf(stderr, "lockstep_coordinator: the job failed: %s\n", failure.c_str());
    return 1;
  }
  if (signalled) return 1;
  std::printf("lockstep_coordinator: every rank finished\n");
  return 0;
}
