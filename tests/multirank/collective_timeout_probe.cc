// Under mpirun: rank 0 calls an all-reduce that the other ranks never join, with a
// 1 s timeout. It must fail with a message, not hang; ctest checks the message.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "lockstep/mpi_communicator.h"

int main() {
  auto comm = lockstep::MakeMpiCommunicator();
  if (comm->rank() != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return 0;
  }
  at::Tensor t = at::ones({1000});
  const auto start = std::chrono::steady_clock::now();
  try {
    comm->AllReduce(t, lockstep::ReduceOp::kSum, lockstep::CollectiveOptions{std::chrono::milliseconds(1000)});
  } catch (const lockstep::CollectiveTimeoutError& e) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0: CollectiveTimeoutError after %.1f s: %s\n", seconds, e.what());
    try {
      comm->Barrier();
    } catch (const lockstep::CollectiveError& again) {
      std::printf("rank 0: then: %s\n", again.what());
    }
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank 0: the all-reduce completed without its peers\n");
  return 1;
}
