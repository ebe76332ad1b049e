// Pieces of the coordination layer shared by the service, the client and the
// launchers: addresses, tokens, peers and the Status -> exception boundary.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordination_internal.h"
#include "lockstep/coordination.h"

namespace lockstep {

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("coordinator address '", address, "' is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator address '", address, "': port '", address.substr(colon + 1), "' is not 0-65535"));
  }
  return std::make_pair(host, port);
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the ", what, " file '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

PeerInfo FromProto(const coordination::PeerInfo& peer) {
  return PeerInfo{peer.rank(), peer.host(), peer.pid(), peer.incarnation()};
}

coordination::PeerInfo ToProto(const PeerInfo& peer) {
  coordination::PeerInfo out;
  out.set_rank(peer.rank);
  out.set_host(peer.host);
  out.set_pid(peer.pid);
  out.set_incarnation(peer.incarnation);
  return out;
}

std::string EpochMembersKey(int64_t epoch) { return absl::StrCat(kEpochKey, "/", epoch); }

std::string DescribePeer(const PeerInfo& peer) {
  return absl::StrFormat("rank %d (host %s, pid %d)", peer.rank, peer.host.empty() ? "?" : peer.host, peer.pid);
}

absl::StatusOr<std::string> FirstSlurmHost(const std::string& nodelist) {
  std::string host;
  bool in_brackets = false;
  bool took_number = false;
  for (char c : nodelist) {
    if (in_brackets) {
      if (c == ']') {
        in_brackets = false;
      } else if (!took_number && std::isdigit(static_cast<unsigned char>(c))) {
        host.push_back(c);
      } else if (c == '-' || c == ',') {
        took_number = true;
      } else if (!std::isdigit(static_cast<unsigned char>(c))) {
        return absl::InvalidArgumentError(absl::StrCat("SLURM_JOB_NODELIST '", nodelist, "' is malformed"));
      }
      continue;
    }
    if (c == ',') break;
    if (c == '[') {
      in_brackets = true;
      took_number = false;
      continue;
    }
    host.push_back(c);
  }
  if (in_brackets || host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("SLURM_JOB_NODELIST '", nodelist, "' is malformed"));
  }
  return host;
}

absl::StatusOr<std::string> ResolveCoordinatorAddress(const std::string& configured, int default_port) {
  if (!configured.empty()) {
    if (auto split = SplitHostPort(configured); !split.ok()) return split.status();
    return configured;
  }
  const char* master_addr = std::getenv("MASTER_ADDR");
  if (master_addr != nullptr && *master_addr != '\0') {
    const char* master_port = std::getenv("MASTER_PORT");
    if (master_port == nullptr || *master_port == '\0') {
      return absl::InvalidArgumentError("MASTER_ADDR is set but MASTER_PORT is not");
    }
    int port = 0;
    if (!absl::SimpleAtoi(master_port, &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("MASTER_PORT '", master_port, "' is not a port number"));
    }
    const std::string host = master_addr;
    return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
  }
  const char* nodelist = std::getenv("SLURM_JOB_NODELIST");
  if (nodelist != nullptr && *nodelist != '\0') {
    absl::StatusOr<std::string> host = FirstSlurmHost(nodelist);
    if (!host.ok()) return host.status();
    return absl::StrCat(*host, ":", default_port);
  }
  return std::string();
}

absl::StatusOr<std::string> ResolveJobToken(const std::string& token_file) {
  if (const char* token = std::getenv("LOCKSTEP_JOB_TOKEN"); token != nullptr && *token != '\0') return token;
  std::string path = token_file;
  if (path.empty()) {
    if (const char* env = std::getenv("LOCKSTEP_JOB_TOKEN_FILE")) path = env;
  }
  if (path.empty()) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string message = absl::StrCat("cannot read the job token file '", path, "': ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(message) : absl::NotFoundError(message);
  }
  std::ostringstream text;
  text << in.rdbuf();
  std::string token(absl::StripTrailingAsciiWhitespace(text.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("the job token file '", path, "' is empty"));
  return token;
}

std::string GenerateJobToken() {
  std::random_device entropy;  // /dev/urandom on Linux
  std::string token;
  for (int i = 0; i < 8; ++i) absl::StrAppend(&token, absl::Hex(entropy(), absl::kZeroPad8));
  return token;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Every byte of the longer string is looked at whatever the contents.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

void ThrowIfError(const absl::Status& status, const std::string& context) {
  if (status.ok()) return;
  const std::string message = absl::StrCat(context, ": ", status.message());
  if (status.code() == absl::StatusCode::kInvalidArgument) throw InvalidArgumentError(message);
  throw CoordinationError(message);
}

}  // namespace lockstep
