// Under mpirun, two ways a collective that the other ranks never join must end,
// with a message, never a hang; ctest checks the message.
//   (no argument)   rank 0 calls an all-reduce with a 1 s timeout: it fails with
//                   a CollectiveTimeoutError and the communicator is broken.
//   --split_abort   rank 0 calls it on a group split from the world (the world in
//                   reverse order: a communicator of MPI's own), with a minute's
//                   timeout, and another thread aborts the world after 0.5 s, as
//                   the job does when a peer dies: the group's all-reduce fails at
//                   once with the abort's reason.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "lockstep/mpi_communicator.h"

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int Timeout(lockstep::Communicator& comm) {
  at::Tensor t = at::ones({1000});
  const auto start = std::chrono::steady_clock::now();
  try {
    comm.AllReduce(t, lockstep::ReduceOp::kSum, lockstep::CollectiveOptions{std::chrono::milliseconds(1000)});
  } catch (const lockstep::CollectiveTimeoutError& e) {
    std::printf("rank 0: CollectiveTimeoutError after %.1f s: %s\n", SecondsSince(start), e.what());
    try {
      comm.Barrier();
    } catch (const lockstep::CollectiveError& again) {
      std::printf("rank 0: then: %s\n", again.what());
    }
    std::fflush(stdout);
    return 3;
  }
  std::printf("rank 0: the all-reduce completed without its peers\n");
  return 1;
}

int SplitAbort(lockstep::Communicator& world, lockstep::Communicator& group) {
  at::Tensor t = at::ones({1000});
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    world.Abort("rank 1 is dead (the probe says so)");
  });
  const auto start = std::chrono::steady_clock::now();
  int code = 1;
  try {
    group.AllReduce(t, lockstep::ReduceOp::kSum, lockstep::CollectiveOptions{std::chrono::minutes(1)});
    std::printf("rank 0: the group's all-reduce completed without its peers\n");
  } catch (const lockstep::CollectiveTimeoutError& e) {
    std::printf("rank 0: the group's all-reduce timed out instead: %s\n", e.what());
  } catch (const lockstep::CollectiveError& e) {
    std::printf("rank 0: the group's all-reduce failed after %.1f s: %s\n", SecondsSince(start), e.what());
    code = 3;
  }
  aborter.join();
  std::fflush(stdout);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  const bool split_abort = argc > 1 && std::strcmp(argv[1], "--split_abort") == 0;
  lockstep::MpiOptions options;
  options.thread_multiple = split_abort;  // MPI splits only with MPI_THREAD_MULTIPLE
  std::unique_ptr<lockstep::Communicator> world = lockstep::MakeMpiCommunicator(options);
  std::unique_ptr<lockstep::Communicator> group;
  if (split_abort) group = world->Split(0, -world->rank());
  if (world->rank() != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return 0;
  }
  return split_abort ? SplitAbort(*world, *group) : Timeout(*world);
}
