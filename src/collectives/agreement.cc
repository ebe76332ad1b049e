#include "lockstep/agreement.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "lockstep/coordination.h"

namespace lockstep {

std::string BroadcastString(Communicator& communicator, const std::string& text, int root,
                            const CollectiveOptions& options) {
  if (communicator.world_size() == 1) return text;
  const bool is_root = communicator.rank() == root;
  at::Tensor length = at::tensor({is_root ? static_cast<int64_t>(text.size()) : int64_t{0}}, at::kLong);
  communicator.Broadcast(length, root, options);
  const int64_t size = length.item<int64_t>();
  if (size == 0) return std::string();
  at::Tensor bytes = at::empty({size}, at::kByte);
  if (is_root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  communicator.Broadcast(bytes, root, options);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(size));
}

std::vector<std::string> AllGatherStrings(Communicator& communicator, const std::string& text,
                                          const CollectiveOptions& options) {
  const int world = communicator.world_size();
  if (world == 1) return {text};
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  at::Tensor lengths = at::zeros({world}, at::kLong);
  communicator.AllGather(lengths, length, options);
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all = at::zeros({world * longest}, at::kByte);
  communicator.AllGather(all, mine, options);
  std::vector<std::string> out;
  out.reserve(world);
  for (int r = 0; r < world; ++r) {
    const char* at = static_cast<const char*>(all.data_ptr()) + r * longest;
    out.emplace_back(at, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

absl::StatusOr<std::string> ShareFromChief(CoordinationClient& client, const std::string& key, const std::string& value,
                                           bool is_chief, absl::Duration timeout) {
  if (is_chief) {
    absl::Status set = client.Set(key, value);
    if (!set.ok()) return set;
    return value;
  }
  return client.Get(key, timeout);
}

absl::Status Publish(CoordinationClient& client, const std::string& prefix, const std::string& value) {
  return client.Set(absl::StrCat(prefix, client.rank()), value);
}

absl::StatusOr<std::vector<std::string>> PublishAndGather(CoordinationClient& client, const std::string& prefix,
                                                          const std::string& value, absl::Duration timeout) {
  absl::Status set = Publish(client, prefix, value);
  if (!set.ok()) return set;
  return GatherPublished(client, prefix, timeout);
}

absl::StatusOr<std::vector<std::string>> GatherPublished(CoordinationClient& client, const std::string& prefix,
                                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::string> values(client.world_size());
  for (int r = 0; r < client.world_size(); ++r) {
    absl::StatusOr<std::string> theirs =
        client.Get(absl::StrCat(prefix, r), std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!theirs.ok()) return theirs.status();
    values[r] = *std::move(theirs);
  }
  return values;
}

absl::StatusOr<std::optional<std::vector<std::string>>> TryGatherPublished(CoordinationClient& client,
                                                                           const std::string& prefix) {
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> listed = client.List(prefix);
  if (!listed.ok()) return listed.status();
  std::vector<std::optional<std::string>> by_rank(client.world_size());
  int found = 0;
  for (auto& [key, value] : *listed) {
    int rank = -1;
    if (!absl::SimpleAtoi(key.substr(prefix.size()), &rank) || rank < 0 || rank >= client.world_size()) {
      return absl::InternalError(absl::StrCat("key '", key, "' under '", prefix, "' does not end in a rank number"));
    }
    if (!by_rank[rank]) ++found;
    by_rank[rank] = std::move(value);
  }
  if (found < client.world_size()) return std::optional<std::vector<std::string>>();
  std::vector<std::string> values;
  values.reserve(by_rank.size());
  for (auto& v : by_rank) values.push_back(*std::move(v));
  return std::optional<std::vector<std::string>>(std::move(values));
}

absl::StatusOr<int64_t> MaxOfPublished(const std::vector<std::string>& values) {
  if (values.empty()) return absl::InvalidArgumentError("no values to take the largest of");
  int64_t largest = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(values[i], &v)) {
      return absl::InvalidArgumentError(absl::StrCat("published value '", values[i], "' (rank ", i, ") is not an integer"));
    }
    largest = i == 0 ? v : std::max(largest, v);
  }
  return largest;
}

}  // namespace lockstep
