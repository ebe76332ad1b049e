// This machine's host name, the one every layer uses: the launch layer's
// Runtime::host, the name a rank registers with the coordination service, and
// the grouping of ranks by host for the hierarchical all-reduce.
//
// Stateless; thread-safe.
#ifndef LOCKSTEP_HOST_H_
#define LOCKSTEP_HOST_H_

#include <string>

namespace lockstep {

// gethostname(2), or "unknown-host" when it fails.
std::string HostName();

}  // namespace lockstep

#endif  // LOCKSTEP_HOST_H_
