// Runtime: who this process is in the SPMD job — rank, world size, local rank and
// host — and which launcher said so.
//
// Built once at start-up by the launch layer and passed by value to the layers
// that need it; it is immutable and therefore thread-safe. Sources, each complete
// or absent:
//   mpirun:   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   Slurm:    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID — read only inside a job step
//             (SLURM_STEP_ID set, i.e. started by srun): a batch script's own
//             SLURM_PROCID=0 describes the script, not the processes it starts
//   torchrun: RANK, WORLD_SIZE, LOCAL_RANK
// None of them means rank 0 of a world of 1. Several may be present when they agree.
#ifndef LOCKSTEP_RUNTIME_H_
#define LOCKSTEP_RUNTIME_H_

#include <functional>
#include <optional>
#include <string>

namespace lockstep {

struct Runtime {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string host;
  std::string launcher = "none";  // "none", "mpirun", "slurm" or "torchrun"
  // The launcher says the ranks are on more than one host: OMPI_COMM_WORLD_LOCAL_SIZE
  // below OMPI_COMM_WORLD_SIZE, SLURM_STEP_NUM_NODES above 1, LOCAL_WORLD_SIZE below
  // WORLD_SIZE. False when it does not say (or says something unreadable: this is
  // advice, for choosing MPI's thread level before MPI can be asked).
  bool several_hosts = false;

  bool is_chief() const { return rank == 0; }

  // The runtime of a single process with no launcher: rank 0 of 1 on this host.
  static Runtime SingleProcess();

  // Reads the launcher variables above from the environment.
  // Throws InvalidArgumentError naming the variables when a source is partial
  // (say RANK without WORLD_SIZE), a value is not a number or out of range, or two
  // sources disagree.
  static Runtime FromEnvironment();

  // The same, with `lookup` in place of getenv (for tests).
  using Lookup = std::function<std::optional<std::string>(const std::string& name)>;
  static Runtime FromVariables(const Lookup& lookup);
};

}  // namespace lockstep

#endif  // LOCKSTEP_RUNTIME_H_
