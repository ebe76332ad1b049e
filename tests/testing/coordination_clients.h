// Test fixture: connects several coordination clients at once, as the ranks of a
// job do (registration returns only when every rank has registered, so they must
// connect concurrently). Header-only; tests include it.
#ifndef LOCKSTEP_TESTS_TESTING_COORDINATION_CLIENTS_H_
#define LOCKSTEP_TESTS_TESTING_COORDINATION_CLIENTS_H_

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <vector>

#include "lockstep/coordination.h"

namespace lockstep::testing {

// One client per options entry, connected concurrently; a failed connection is a
// test failure and a null entry.
inline std::vector<std::unique_ptr<CoordinationClient>> ConnectConcurrently(
    const std::vector<CoordinationClientOptions>& options) {
  std::vector<std::future<absl::StatusOr<std::unique_ptr<CoordinationClient>>>> pending;
  for (const CoordinationClientOptions& o : options) {
    pending.push_back(std::async(std::launch::async, [o] { return CoordinationClient::Connect(o); }));
  }
  std::vector<std::unique_ptr<CoordinationClient>> clients;
  for (auto& p : pending) {
    auto client = p.get();
    EXPECT_TRUE(client.ok()) << client.status();
    clients.push_back(client.ok() ? std::move(*client) : nullptr);
  }
  return clients;
}

}  // namespace lockstep::testing

#endif  // LOCKSTEP_TESTS_TESTING_COORDINATION_CLIENTS_H_
