// Runtime: who this process is in the SPMD job — rank, world size, local rank and
// host.
//
// Built once at start-up by the launch layer and passed by value to the layers
// that need it; it is immutable and therefore thread-safe. A process started with
// no launcher is rank 0 of a world of 1. (Discovery from mpirun, Slurm and
// torchrun-style variables is the data-parallel milestone; today every process
// reports a world of one.)
#ifndef LOCKSTEP_RUNTIME_H_
#define LOCKSTEP_RUNTIME_H_

#include <string>

namespace lockstep {

struct Runtime {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string host;

  bool is_chief() const { return rank == 0; }

  // The runtime of a single process with no launcher: rank 0 of 1 on this host.
  static Runtime SingleProcess();
};

}  // namespace lockstep

#endif  // LOCKSTEP_RUNTIME_H_
