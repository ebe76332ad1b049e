// The NCCL backend builds here (CUDA 13 and NCCL 2.28 in /usr/local/cuda) but no
// GPU exists: asking for it must fail at start-up with a clear error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "lockstep/nccl_communicator.h"

#if LOCKSTEP_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

namespace lockstep {
namespace {

using ::testing::HasSubstr;

TEST(NcclCommunicatorTest, WithoutAGpuStartUpFailsClearly) {
  NcclIdExchange exchange;  // a world of one: nothing to fetch
  exchange.publish = [](const std::string&) {};
  if (!HaveNccl()) {
    EXPECT_THAT([&] { MakeNcclCommunicator(exchange, 0); },
                ::testing::ThrowsMessage<CollectiveError>(HasSubstr("this build has no NCCL backend")));
    return;
  }
#if LOCKSTEP_HAVE_NCCL
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    GTEST_SKIP() << "this host has " << devices << " CUDA device(s); the no-GPU error cannot be observed";
  }
#endif
  EXPECT_THAT([&] { MakeNcclCommunicator(exchange, 0); },
              ::testing::ThrowsMessage<CollectiveError>(HasSubstr("NCCL backend: no CUDA device on rank 0")));
}

}  // namespace
}  // namespace lockstep
