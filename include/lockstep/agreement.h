// Agreements between ranks: the few ways in which the ranks of a job share a
// value or settle on one, each written once and used by every layer (the
// coordination bootstrap, the halting decision, metric names, the data-parallel
// start-up check, checkpoint commits, the resume choice, the preemption step).
//
// Over a Communicator (collectives: SPMD rule, every rank calls them in the same
// order with the same root; errors as the communicator's, CollectiveError and
// CollectiveTimeoutError):
//   BroadcastString    the root's string to every rank
//   AllGatherStrings   every rank's string, in rank order
//
// Over the coordination service's key-value store (absl::Status, as the
// coordination layer; every call may also return what CoordinationClient's calls
// return: UNAUTHENTICATED, UNAVAILABLE, ABORTED when the job failed):
//   ShareFromChief     rank 0 publishes a value under a key, every rank reads it
//   Publish            this rank's value under "<prefix><rank>"
//   GatherPublished    waits for every rank's value under the prefix (rank 0
//                      alone, say, when only it needs them)
//   PublishAndGather   every rank publishes under "<prefix><rank>", each reads all
//   TryGatherPublished the same without waiting: all values once every rank has
//                      published, nullopt before
//   MaxOfPublished     the largest of published integers (an agreed step)
//
// Keys are the caller's: a prefix must be unique to one agreement in one job (a
// step number in it, say), since the store keeps values until they are deleted.
// Thread-safety: as the communicator or client passed in.
#ifndef LOCKSTEP_AGREEMENT_H_
#define LOCKSTEP_AGREEMENT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lockstep/communicator.h"

namespace lockstep {

class CoordinationClient;

// Returns `text` of rank `root` on every rank (other ranks' `text` is ignored).
// Two broadcasts: the length, then the bytes.
std::string BroadcastString(Communicator& communicator, const std::string& text, int root = 0,
                            const CollectiveOptions& options = {});

// Every rank's `text`, indexed by rank. Two all-gathers: the lengths, then the
// bytes padded to the longest.
std::vector<std::string> AllGatherStrings(Communicator& communicator, const std::string& text,
                                          const CollectiveOptions& options = {});

// Rank 0 (is_chief) stores `value` under `key`; every rank, rank 0 included, gets
// the value back (the others wait up to `timeout`). Errors: DEADLINE_EXCEEDED
// naming the key when rank 0 did not publish in time; INVALID_ARGUMENT for a bad
// key or an oversized value.
absl::StatusOr<std::string> ShareFromChief(CoordinationClient& client, const std::string& key, const std::string& value,
                                           bool is_chief, absl::Duration timeout);

// Stores `value` as "<prefix><rank>" (this client's rank). Errors: INVALID_ARGUMENT.
absl::Status Publish(CoordinationClient& client, const std::string& prefix, const std::string& value);

// Waits up to `timeout` for every rank's "<prefix><rank>", returned by rank.
// Errors: DEADLINE_EXCEEDED naming the first key missing; INVALID_ARGUMENT.
absl::StatusOr<std::vector<std::string>> GatherPublished(CoordinationClient& client, const std::string& prefix,
                                                         absl::Duration timeout);

// Publish, then GatherPublished: every rank's value, by rank. Errors: DEADLINE_EXCEEDED naming the first rank
// missing (by its key); INVALID_ARGUMENT.
absl::StatusOr<std::vector<std::string>> PublishAndGather(CoordinationClient& client, const std::string& prefix,
                                                          const std::string& value, absl::Duration timeout);

// Without waiting: every rank's value under "<prefix><rank>" when all world_size
// ranks have published, by rank; nullopt while some have not.
// Errors: INTERNAL when a key under the prefix does not end in a rank number.
absl::StatusOr<std::optional<std::vector<std::string>>> TryGatherPublished(CoordinationClient& client,
                                                                           const std::string& prefix);

// The largest of `values` read as integers. Errors: INVALID_ARGUMENT naming a
// value that is not an integer, or when `values` is empty.
absl::StatusOr<int64_t> MaxOfPublished(const std::vector<std::string>& values);

}  // namespace lockstep

#endif  // LOCKSTEP_AGREEMENT_H_
