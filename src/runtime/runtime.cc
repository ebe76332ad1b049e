#include "lockstep/runtime.h"

#include <unistd.h>

#include <array>

namespace lockstep {

Runtime Runtime::SingleProcess() {
  Runtime runtime;
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) == 0) runtime.host = name.data();
  return runtime;
}

}  // namespace lockstep
