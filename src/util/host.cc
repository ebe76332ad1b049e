#include "lockstep/host.h"

#include <unistd.h>

#include <array>

namespace lockstep {

std::string HostName() {
  std::array<char, 256> name{};  // zero-filled: terminated even when truncated
  if (gethostname(name.data(), name.size() - 1) != 0) return "unknown-host";
  return name.data();
}

}  // namespace lockstep
