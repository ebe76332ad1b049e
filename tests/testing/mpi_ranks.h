// A GoogleTest fixture for the multi-rank tests: this process's MPI
// communicator, its rank and the world size, and a failed test when it is not
// run under mpirun with at least 2 ranks. Header-only.
#ifndef LOCKSTEP_TESTS_TESTING_MPI_RANKS_H_
#define LOCKSTEP_TESTS_TESTING_MPI_RANKS_H_

#include <gtest/gtest.h>

#include <memory>

#include "lockstep/communicator.h"
#include "lockstep/mpi_communicator.h"

namespace lockstep::testing {

class MpiRanksTest : public ::testing::Test {
 protected:
  // What the communicator is made with (MPI is initialised by the first one).
  virtual MpiOptions Options() const { return {}; }

  void SetUp() override {
    comm_ = MakeMpiCommunicator(Options());
    rank_ = comm_->rank();
    size_ = comm_->world_size();
    ASSERT_GE(size_, 2) << "run under mpirun with at least 2 ranks";
  }

  std::unique_ptr<Communicator> comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace lockstep::testing

#endif  // LOCKSTEP_TESTS_TESTING_MPI_RANKS_H_
