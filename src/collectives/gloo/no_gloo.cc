// A build without Gloo (no libgloo-dev headers, or a libtorch without c10d Gloo).
#include "lockstep/gloo_communicator.h"

namespace lockstep {

std::unique_ptr<Communicator> MakeGlooCommunicator(GlooStoreFunctions, int, int, const GlooOptions&) {
  throw InvalidArgumentError(
      "this build has no gloo backend (install libgloo-dev and reconfigure; libtorch must have c10d Gloo)");
}

bool HaveGloo() { return false; }

}  // namespace lockstep
