// The Gloo communicator, for CPU tensors, on libtorch's own c10d ProcessGroupGloo.
//
// What a job started without mpirun uses (torchrun-style variables,
// launch/local.sh, plain srun): its ranks meet through the coordination service's
// key-value store, which a c10d::Store adapter hands to Gloo's rendezvous, so no
// second server (TCPStore) is needed. Collectives run on the process group's
// worker threads over TCP; Work::Wait waits with the call's deadline in short
// slices so that Abort (from the coordination client's thread) ends a wait at
// once. On a timeout, a Gloo error or Abort the communicator is broken: every
// later call fails with the first reason. Each collective carries its call's
// timeout into Gloo too; a communicator destroyed while collectives still run
// gives them 2 s, then leaves its process group to the process's exit (joining
// would wait on a dead peer until those timeouts).
//
// Gloo has no average and, in libtorch 1.13, no reduce-scatter: an average is a
// sum divided on the caller's thread in Wait, and a reduce-scatter is an
// all-reduce of a copy of the input of which each rank keeps its slice (twice the
// bytes of a real one). Built when CMake finds Gloo's headers (libgloo-dev) and
// libtorch has c10d Gloo (LOCKSTEP_WITH_GLOO).
#ifndef LOCKSTEP_GLOO_COMMUNICATOR_H_
#define LOCKSTEP_GLOO_COMMUNICATOR_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "lockstep/communicator.h"

namespace lockstep {

class CoordinationClient;

// The key-value store Gloo's rendezvous runs on. All may throw; `get` waits up to
// `timeout` and throws a CollectiveTimeoutError naming the key when it is not set.
struct GlooStoreFunctions {
  std::function<void(const std::string& key, const std::string& value)> set;
  std::function<std::string(const std::string& key, std::chrono::milliseconds timeout)> get;
  std::function<std::optional<std::string>(const std::string& key)> try_get;
  std::function<bool(const std::string& key)> erase;
};

// Through the coordination service's key-value store, under "lockstep/gloo/<name>/".
GlooStoreFunctions GlooStoreOverCoordination(CoordinationClient& coordination, const std::string& name);

// What GlooOptions::hostname should be for a rank on `this_host`: 127.0.0.1 when
// every rank in the coordination client's roster is on that host, else
// `this_host` itself (each rank binds what its name resolves to, which the other
// hosts reach).
std::string GlooHostname(const CoordinationClient& coordination, const std::string& this_host);

struct GlooOptions {
  // The address this rank's Gloo device binds to and peers connect to:
  // 127.0.0.1 when every rank is on one host, else this host's name or address.
  std::string hostname = "127.0.0.1";
  // Gloo's own timeout for the rendezvous and for each operation (the bound on
  // how long a worker thread can wait on a dead peer).
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  int threads = 2;  // the process group's worker threads
};

// Every rank of the world calls it with stores over the same name. Errors:
// CollectiveError naming the problem (Gloo could not bind or connect, the
// rendezvous timed out); InvalidArgumentError for a bad rank or world size.
std::unique_ptr<Communicator> MakeGlooCommunicator(GlooStoreFunctions store, int rank, int world_size,
                                                   const GlooOptions& options = {});

// Whether this build has the Gloo backend.
bool HaveGloo();

}  // namespace lockstep

#endif  // LOCKSTEP_GLOO_COMMUNICATOR_H_
