#include "lockstep/runtime.h"

#include <array>
#include <cstdlib>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lockstep/errors.h"
#include "lockstep/host.h"

namespace lockstep {
namespace {

struct Source {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  // Optional, for Runtime::several_hosts: the ranks on this host, or the hosts.
  const char* local_size;
  const char* hosts;
};

constexpr std::array<Source, 3> kSources = {{
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr, "SLURM_STEP_NUM_NODES"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", nullptr},
}};

int ParseInt(const Runtime::Lookup& lookup, const char* name, int min) {
  const std::string value = lookup(name).value_or("");
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < min) {
    throw InvalidArgumentError(absl::StrCat("launcher variable ", name, "='", value, "' is not an integer >= ", min));
  }
  return parsed;
}

// An optional count: 0 when `name` is null, unset or not a positive integer.
int OptionalCount(const Runtime::Lookup& lookup, const char* name) {
  if (name == nullptr) return 0;
  const std::optional<std::string> value = lookup(name);
  int parsed = 0;
  return value && absl::SimpleAtoi(*value, &parsed) && parsed > 0 ? parsed : 0;
}

}  // namespace

Runtime Runtime::SingleProcess() {
  Runtime runtime;
  runtime.host = HostName();
  return runtime;
}

Runtime Runtime::FromVariables(const Lookup& lookup) {
  std::vector<Runtime> found;
  for (const Source& source : kSources) {
    if (std::string(source.launcher) == "slurm" && !lookup("SLURM_STEP_ID") && !lookup("SLURM_STEPID")) continue;
    std::vector<std::string> present;
    std::vector<std::string> missing;
    for (const char* name : {source.rank, source.size, source.local_rank}) {
      (lookup(name) ? present : missing).push_back(name);
    }
    if (present.empty()) continue;
    if (!missing.empty()) {
      throw InvalidArgumentError(absl::StrCat("partial ", source.launcher, " environment: ", absl::StrJoin(present, ", "),
                                              " set but ", absl::StrJoin(missing, ", "), " missing"));
    }
    Runtime r;
    r.launcher = source.launcher;
    r.world_size = ParseInt(lookup, source.size, 1);
    r.rank = ParseInt(lookup, source.rank, 0);
    r.local_rank = ParseInt(lookup, source.local_rank, 0);
    // Advice only: a value that is absent or unreadable says nothing.
    const int local_size = OptionalCount(lookup, source.local_size);
    r.several_hosts = (local_size > 0 && local_size < r.world_size) || OptionalCount(lookup, source.hosts) > 1;
    if (r.rank >= r.world_size) {
      throw InvalidArgumentError(absl::StrCat(source.rank, "=", r.rank, " is not below ", source.size, "=",
                                              r.world_size));
    }
    found.push_back(r);
  }
  Runtime runtime = found.empty() ? Runtime{} : found.front();
  for (const Runtime& other : found) {
    if (other.rank != runtime.rank || other.world_size != runtime.world_size) {
      throw InvalidArgumentError(absl::StrCat("contradictory launcher environment: ", runtime.launcher, " says rank ",
                                              runtime.rank, " of ", runtime.world_size, ", ", other.launcher,
                                              " says rank ", other.rank, " of ", other.world_size));
    }
  }
  runtime.host = HostName();
  return runtime;
}

Runtime Runtime::FromEnvironment() {
  return FromVariables([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

}  // namespace lockstep
