#include "lockstep/torch_setup.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <sched.h>

#include <thread>

namespace lockstep {
namespace {

int AvailableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

}  // namespace

int ConfigureTorchForTraining(int num_threads) {
  at::globalContext().setFlushDenormal(true);
  const int threads = num_threads > 0 ? num_threads : AvailableCores();
  if (threads > 0) at::set_num_threads(threads);
  return at::get_num_threads();
}

}  // namespace lockstep
