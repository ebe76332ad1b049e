#include "lockstep/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <fcntl.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "absl/strings/ascii.h"
#include "lockstep/tensor_parallel.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "lockstep/agreement.h"
#include "lockstep/coordination.h"
#include "lockstep/hashing.h"
#include "lockstep/optimizer_state_codec.h"
#include "proto/checkpoint.pb.h"

namespace lockstep {

namespace fs = std::filesystem;

struct CheckpointManager::Job {
  int64_t step = 0;
  bool emergency = false;
  std::map<std::string, double> metrics;
  c10::impl::GenericDict values{c10::StringType::get(), c10::AnyType::get()};
  std::string partitioning;                           // for the manifest (rank 0)
  std::vector<checkpoint::ShardedTensor> sharded_tensors;  // likewise
};

namespace {

constexpr char kManifestFile[] = "manifest.pb";
constexpr char kLatestFile[] = "latest";
constexpr char kPinnedFile[] = "PINNED";
constexpr char kTmpPrefix[] = ".tmp_";

std::string ShardName(int rank) { return absl::StrFormat("shard_%05d.pt", rank); }

std::string Errno() { return std::strerror(errno); }

// Creates (or truncates) `path`, lets `fill` write to it with a WriteAll function,
// then fsyncs and closes it; the descriptor is closed on every path. Throws
// CheckpointError naming the path.
template <typename Fill>
void WriteFileDurably(const std::string& path, Fill fill) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(absl::StrCat("cannot create '", path, "': ", Errno()));
  try {
    auto write_all = [&](const void* data, size_t length) {
      const char* bytes = static_cast<const char*>(data);
      size_t done = 0;
      while (done < length) {
        const ssize_t n = ::write(fd, bytes + done, std::min<size_t>(length - done, size_t{1} << 30));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw CheckpointError(absl::StrCat("cannot write '", path, "': ", Errno()));
        done += static_cast<size_t>(n);
      }
    };
    fill(write_all);
    if (::fsync(fd) != 0) throw CheckpointError(absl::StrCat("cannot fsync '", path, "': ", Errno()));
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw CheckpointError(absl::StrCat("cannot close '", path, "': ", Errno()));
}

// Writes `size` bytes to `path` and fsyncs it. Throws CheckpointError.
void WriteDurably(const std::string& path, const char* data, size_t size) {
  WriteFileDurably(path, [&](const auto& write_all) { write_all(data, size); });
}

// Writes `values` to `path` in torch.save's zip format (what torch::jit::pickle_save
// produces, streamed straight to the file instead of through a growing buffer:
// 3 s against 0.4 s for 256 MB here), fsyncs it, and returns its size and CRC32C.
//
// A write error (a full disk, EIO, a read-only file system) must not escape
// libtorch's zip writer: its destructor finishes the archive and would write
// again, and an exception there terminates the process. So the writer records
// the first error, skips every later write, and the error is thrown once the
// archive is closed, naming the file and the cause.
std::pair<size_t, uint32_t> WriteShard(const std::string& path, const c10::impl::GenericDict& values) {
  size_t size = 0;
  uint32_t crc = 0;
  WriteFileDurably(path, [&](const auto& write_all) {
    std::exception_ptr failed;
    auto write = [&](const void* data, size_t length) -> size_t {
      if (failed) return length;  // the archive goes on; nothing more reaches the file
      try {
        write_all(data, length);
      } catch (...) {
        failed = std::current_exception();
        return length;
      }
      crc = Crc32cExtend(crc, data, length);
      size += length;
      return length;
    };
    std::vector<char> pickled;
    torch::jit::Pickler pickler([&](const char* data, size_t length) { pickled.insert(pickled.end(), data, data + length); });
    pickler.protocol();
    pickler.pushIValue(c10::IValue(values));
    pickler.stop();
    {
      caffe2::serialize::PyTorchStreamWriter archive(write);
      torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), archive);
      archive.writeEndOfFile();
    }
    if (failed) std::rethrow_exception(failed);
  });
  return {size, crc};
}

// Makes a rename or a new entry in `dir` durable.
void FsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(absl::StrCat("cannot open directory '", dir, "': ", Errno()));
  const int rc = ::fsync(fd);
  const std::string why = rc != 0 ? Errno() : "";
  ::close(fd);
  if (rc != 0) throw CheckpointError(absl::StrCat("cannot fsync directory '", dir, "': ", why));
}

std::string ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(absl::StrCat(path, ": cannot read the ", what, " (", Errno(), ")"));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// CRC32C and size of a file, read in 8 MiB pieces.
std::pair<uint32_t, int64_t> FileCrc(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(absl::StrCat(path, ": missing (", Errno(), ")"));
  std::vector<char> buffer(size_t{8} << 20);
  uint32_t crc = 0;
  int64_t size = 0;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    crc = Crc32cExtend(crc, buffer.data(), static_cast<size_t>(n));
    size += n;
  }
  return {crc, size};
}

std::optional<int64_t> StepOfDirName(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  int64_t step = 0;
  if (!absl::SimpleAtoi(name.substr(prefix.size()), &step) || step < 0) return std::nullopt;
  return step;
}

// A shard's bytes for libtorch's zip reader, refusing reads past the end: the
// memory adapter that torch::jit::pickle_load uses copies whatever a zip
// directory asks for, so a shard whose CRC matches but whose zip directory lies
// (hand-made, or damaged and then rechecksummed) read out of bounds (found by
// fuzz/checkpoint_shard_fuzzer). A short read makes the zip reader fail instead.
class BoundedReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BoundedReadAdapter(const std::string& bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, bytes_.size() - pos));
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  const std::string& bytes_;
};

// Walks the opcodes of a pickle (protocols 0-5) and throws CheckpointError when an
// argument runs past the end, an opcode is unknown, or a memo index is larger
// than the pickle could number: libtorch's unpickler grows its memo table to any
// index a PUT names, so that a hand-made shard made it ask for 26 GB and abort
// (found by fuzz/checkpoint_shard_fuzzer). A real pickle's memo indices count its
// PUTs, each at least two bytes long, so they stay below its size.
void CheckPickle(const char* data, size_t size, const std::string& what) {
  auto bad = [&](const std::string& why) { return CheckpointError(absl::StrCat(what, ": ", why)); };
  size_t at = 0;
  auto need = [&](size_t n) {
    if (n > size - at) throw bad("a pickle argument runs past its end");
  };
  auto little = [&](size_t n) {  // an n-byte little-endian unsigned argument
    need(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(data[at + k])) << (8 * k);
    at += n;
    return v;
  };
  auto line = [&] {  // a newline-terminated argument
    const void* end = std::memchr(data + at, '\n', size - at);
    if (end == nullptr) throw bad("a pickle argument runs past its end");
    std::string text(data + at, static_cast<const char*>(end));
    at = static_cast<size_t>(static_cast<const char*>(end) - data) + 1;
    return text;
  };
  auto memo = [&](uint64_t index) {
    if (index >= size) throw bad(absl::StrCat("a pickle memo index ", index, " in ", size, " bytes"));
  };
  while (at < size) {
    const uint8_t op = static_cast<uint8_t>(data[at++]);
    switch (op) {
      case '(': case '.': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case '}': case ']':
      case ')': case 'a': case 'e': case 'b': case 'd': case 'l': case 't': case 0x85: case 0x86: case 0x87:
      case 'R': case 's': case 'u': case 'Q': case 0x81: case 'o': case 0x8f: case 0x90: case 0x91: case 0x92:
      case 0x93: case 0x94: case 0x97: case 0x98:
        if (op == '.') return;  // STOP
        break;
      case 'K': case 0x80: case 0x82: at += (need(1), 1); break;
      case 'M': case 0x83: at += (need(2), 2); break;
      case 'J': case 0x84: at += (need(4), 4); break;
      case 'G': case 0x95: at += (need(8), 8); break;
      case 'h': case 'q': memo(little(1)); break;
      case 'j': case 'r': memo(little(4)); break;
      case 'U': case 0x8c: case 'C': case 0x8a: { const uint64_t n = little(1); need(n); at += n; break; }
      case 'T': case 'X': case 'B': case 0x8b: { const uint64_t n = little(4); need(n); at += n; break; }
      case 0x8d: case 0x8e: case 0x96: {
        const uint64_t n = little(8);
        if (n > size) throw bad("a pickle argument runs past its end");
        need(n);
        at += n;
        break;
      }
      case 'g': case 'p': {
        uint64_t index = 0;
        if (!absl::SimpleAtoi(line(), &index)) throw bad("a pickle memo index that is not a number");
        memo(index);
        break;
      }
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': line(); break;
      case 'c': case 'i': line(); line(); break;
      default:
        throw bad(absl::StrFormat("an unknown pickle opcode 0x%02x", op));
    }
  }
  throw bad("a pickle without its STOP");
}

// What torch::jit::pickle_save wrote (pickle_load, through BoundedReadAdapter).
// Every tensor record is read first and handed to the unpickler as a storage of
// the record's real size: left to itself, libtorch sizes a storage by what the
// pickle claims and fills it from a record that may be shorter, so that a
// hand-made shard reads past its data (a crash in CPUGeneratorImpl::set_state;
// found by fuzz/checkpoint_shard_fuzzer). InBounds then checks each tensor against
// the real size.
c10::IValue LoadPickled(const std::string& bytes) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BoundedReadAdapter>(bytes));
  if (reader.hasRecord("data.pkl")) {
    auto [pickle, size] = reader.getRecord("data.pkl");
    CheckPickle(static_cast<const char*>(pickle.get()), size, "data.pkl");
  }
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  constexpr char kTensorDir[] = "data/";
  for (const std::string& name : reader.getAllRecords()) {
    if (name.rfind(kTensorDir, 0) != 0 || name.size() == sizeof(kTensorDir) - 1) continue;
    auto [data, size] = reader.getRecord(name);
    storages->addStorage(name.substr(sizeof(kTensorDir) - 1),
                         c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, false));
  }
  return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", c10::nullopt,
                                           c10::nullopt, c10::nullopt, reader,
                                           torch::jit::Unpickler::defaultTypeParser, storages);
}

// A tensor from a loaded shard, refused unless its sizes, strides and offset stay
// inside its storage: libtorch's unpickler takes them from the file as they are, so
// a hand-made shard could describe a tensor that reads past its data (a crash in
// the first copy; found by fuzz/checkpoint_shard_fuzzer).
at::Tensor InBounds(const at::Tensor& t, const std::string& file, const std::string& key) {
  auto refuse = [&](const std::string& why) {
    return CheckpointError(absl::StrCat(file, ": '", key, "' ", why, " (a damaged or hand-made shard)"));
  };
  if (!t.defined()) throw refuse("is an undefined tensor");
  if (t.is_sparse() || t.is_quantized() || !t.device().is_cpu()) throw refuse("is not a dense CPU tensor");
  if (t.numel() == 0) return t;
  if (!t.has_storage() || t.storage().data() == nullptr) throw refuse("has no data");
  int64_t last = t.storage_offset();
  if (last < 0) throw refuse("starts before its storage");
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) throw refuse("has a negative stride");
    int64_t step = 0;
    if (__builtin_mul_overflow(t.size(d) - 1, t.stride(d), &step) || __builtin_add_overflow(last, step, &last)) {
      throw refuse("has sizes and strides that overflow");
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(last + 1, static_cast<int64_t>(t.element_size()), &bytes) ||
      bytes > static_cast<int64_t>(t.storage().nbytes())) {
    throw refuse(absl::StrCat("extends past its data (", t.storage().nbytes(), " bytes)"));
  }
  return t;
}

// A shard's file name in a manifest: one plain name inside the step directory.
bool IsShardFileName(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find_first_of(std::string("/\0", 2)) == std::string::npos;
}

checkpoint::Manifest ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  if (!fs::exists(path)) throw CheckpointError(absl::StrCat(path, ": missing (an unfinished save)"));
  checkpoint::ManifestFile file;
  if (!file.ParseFromString(ReadFile(path, "manifest"))) {
    throw CheckpointError(absl::StrCat(path, ": not a manifest (truncated or overwritten)"));
  }
  if (Crc32c(file.manifest().data(), file.manifest().size()) != file.crc32c()) {
    throw CheckpointError(absl::StrCat(path, ": fails its checksum (corrupt)"));
  }
  checkpoint::Manifest manifest;
  if (!manifest.ParseFromString(file.manifest())) throw CheckpointError(absl::StrCat(path, ": unreadable manifest"));
  return manifest;
}

// The first line where two config texts differ, for the mismatch message.
std::string FirstDifference(const std::string& saved, const std::string& now) {
  std::vector<std::string> a = absl::StrSplit(saved, '\n');
  std::vector<std::string> b = absl::StrSplit(now, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "(nothing)";
    const std::string y = i < b.size() ? b[i] : "(nothing)";
    if (x != y) return absl::StrCat("checkpoint has '", x, "', this run has '", y, "'");
  }
  return "the texts agree, the fingerprints do not";
}

constexpr char kOptimizerPrefix[] = "optimizer/";
constexpr char kCustomTensorPrefix[] = "custom/tensor/";
constexpr char kCustomBytesPrefix[] = "custom/bytes/";
constexpr char kReplicated[] = "data_parallel_replicated";

// The part of a member of a sharded unit that `rank` holds: elements
// [begin, end) of the member, at `local` in the rank's slice.
struct Piece {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t local = 0;
};
std::optional<Piece> PieceOf(const ShardedLayout::Unit& unit, const ShardedLayout::Member& member, int rank) {
  const int64_t first = std::max(member.offset, rank * unit.slice);
  const int64_t last = std::min(member.offset + member.numel, (rank + 1) * unit.slice);
  if (first >= last) return std::nullopt;
  return Piece{first - member.offset, last - member.offset, first - rank * unit.slice};
}

// "unit<u>/<field>", the name the optimizer's codec gives a value of unit u
// under a sharded layout: u and the field, or nothing for any other name.
std::optional<std::pair<size_t, std::string>> ParseUnitKey(const std::string& key, size_t num_units) {
  size_t u = 0;
  const size_t slash = key.find('/');
  if (key.rfind("unit", 0) != 0 || slash == std::string::npos || !absl::SimpleAtoi(key.substr(4, slash - 4), &u) ||
      u >= num_units) {
    return std::nullopt;
  }
  return std::make_pair(u, key.substr(slash + 1));
}

// A value that a sharded partitioning splits must hold one value per element of the unit's slice.
void CheckSplittable(const ShardedLayout::Unit& unit, const std::string& field, const at::Tensor& value) {
  if (value.dim() != 1 || value.numel() != unit.slice) {
    throw InvalidArgumentError(absl::StrCat("checkpoint: the optimizer's '", field, "' has shape ",
                                            c10::str(value.sizes()), ", not one value per parameter element; "
                                            "a sharded partitioning cannot split it"));
  }
}

[[noreturn]] void RefuseArchive(const std::string& key) {
  throw InvalidArgumentError("checkpoint: the optimizer's state ('" + key +
                             "') is an archive, which a sharded partitioning cannot split");
}

// The optimizer's parameters under a sharded layout: unit u's slice, named "unit<u>".
NamedParameters UnitParameters(const ShardedLayout& layout) {
  NamedParameters out;
  for (size_t u = 0; u < layout.units.size(); ++u) out.emplace_back(absl::StrCat("unit", u), layout.units[u].shard);
  return out;
}

// The shards of one checkpoint, read and checked as they are first needed, and
// its values by logical key: a whole tensor or any range of its elements,
// wherever the manifest puts them.
class CheckpointReader {
 public:
  // `home`: the shard whose unsplit values (step, buffers, RNG, data position)
  // this rank takes: its own, or rank 0's when the checkpoint has fewer ranks.
  CheckpointReader(const FoundCheckpoint& found, int rank)
      : found_(found), home_(rank < found.manifest->world_size() ? rank : 0) {
    for (const checkpoint::ShardedTensor& t : found.manifest->sharded_tensors()) {
      if (!table_.emplace(t.key(), &t).second) throw Bad(absl::StrCat("lists '", t.key(), "' twice"));
    }
  }

  int home() const { return home_; }
  const std::map<std::string, const checkpoint::ShardedTensor*>& table() const { return table_; }

  std::string File(int rank) const {
    const checkpoint::ShardFile& shard = found_.manifest->shards(rank);
    if (!IsShardFileName(shard.path())) {
      throw CheckpointError(absl::StrCat(found_.path, "/", kManifestFile, ": bad shard path '",
                                         absl::CHexEscape(shard.path()), "'"));
    }
    return (fs::path(found_.path) / shard.path()).string();
  }

  // Rank `rank`'s shard, checked against the manifest.
  const c10::impl::GenericDict& Values(int rank) {
    auto cached = values_.find(rank);
    if (cached != values_.end()) return cached->second;
    const checkpoint::ShardFile& shard = found_.manifest->shards(rank);
    const std::string file = File(rank);
    const std::string text = ReadFile(file, "shard");
    if (static_cast<int64_t>(text.size()) != shard.bytes() || Crc32c(text.data(), text.size()) != shard.crc32c()) {
      throw CheckpointError(absl::StrCat(file, ": does not match its manifest (size or CRC32C): corrupt"));
    }
    c10::IValue loaded;
    try {
      loaded = LoadPickled(text);
    } catch (const c10::Error& e) {
      throw CheckpointError(absl::StrCat(file, ": unreadable shard: ", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      // libtorch's unpickler also throws standard exceptions (std::out_of_range on a
      // memo index past its table; found by fuzz/checkpoint_shard_fuzzer).
      throw CheckpointError(absl::StrCat(file, ": unreadable shard: ", e.what()));
    }
    if (!loaded.isGenericDict()) throw CheckpointError(absl::StrCat(file, ": not a dictionary"));
    return values_.emplace(rank, loaded.toGenericDict()).first->second;
  }

  // The rank whose shard holds `key` when the key is not split: a split
  // parameter's optimizer scalars ("optimizer/<name>/step") are in the shards
  // that hold pieces of it; everything else is in the home shard.
  int Owner(const std::string& key) const {
    auto split = table_.find(key);
    if (split != table_.end() && split->second->pieces_size() > 0) return split->second->pieces(0).rank();
    if (key.rfind(kOptimizerPrefix, 0) == 0) {
      const size_t slash = key.rfind('/');
      const std::string member = key.substr(sizeof(kOptimizerPrefix) - 1, slash - (sizeof(kOptimizerPrefix) - 1));
      auto model = table_.find("model/" + member);
      if (slash > sizeof(kOptimizerPrefix) - 1 && model != table_.end() && model->second->pieces_size() > 0) {
        return model->second->pieces(0).rank();
      }
    }
    return home_;
  }

  bool Has(const std::string& key) {
    if (table_.count(key) > 0) return true;
    const c10::impl::GenericDict& values = Values(Owner(key));
    return values.find(key) != values.end();
  }

  // An unsplit value.
  c10::IValue Value(const std::string& key) {
    const int owner = Owner(key);
    const c10::impl::GenericDict& values = Values(owner);
    auto it = values.find(key);
    if (it == values.end()) throw CheckpointError(absl::StrCat(File(owner), ": has no '", key, "' (a different model?)"));
    return it->value();
  }

  // A whole tensor, of the shape and dtype of `like` (when defined).
  at::Tensor Whole(const std::string& key, const at::Tensor& like) {
    at::Tensor t;
    std::vector<int64_t> shape;
    std::string where;
    auto split = table_.find(key);
    if (split != table_.end()) {
      shape.assign(split->second->shape().begin(), split->second->shape().end());
      int64_t numel = 1;
      for (int64_t d : shape) {
        if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) throw Bad(absl::StrCat("'", key, "' has a bad shape"));
      }
      t = Range(key, 0, numel).view(shape);
      where = absl::StrCat(found_.path, " (", found_.manifest->world_size(), " shards)");
    } else {
      const int owner = Owner(key);
      t = InBounds(Value(key).toTensor(), File(owner), key);
      where = File(owner);
    }
    if (like.defined() && (t.sizes() != like.sizes() || t.scalar_type() != like.scalar_type())) {
      throw CheckpointError(absl::StrCat(where, ": '", key, "' has shape ", c10::str(t.sizes()), " ",
                                         c10::toString(t.scalar_type()), ", the model's has ", c10::str(like.sizes()),
                                         " ", c10::toString(like.scalar_type())));
    }
    return t;
  }

  // Elements [begin, end) of the row-major flattening of `key`, as a new 1-D tensor.
  at::Tensor Range(const std::string& key, int64_t begin, int64_t end) {
    auto split = table_.find(key);
    if (split == table_.end()) {
      at::Tensor whole = Whole(key, at::Tensor()).reshape({-1});
      if (begin < 0 || end > whole.numel() || begin > end) {
        throw CheckpointError(absl::StrCat(File(Owner(key)), ": '", key, "' has ", whole.numel(),
                                           " elements, not the ", end, " the model needs"));
      }
      return whole.narrow(0, begin, end - begin).clone();
    }
    const checkpoint::ShardedTensor& entry = *split->second;
    const int64_t numel = Numel(entry);
    at::Tensor out;
    int64_t filled = 0;
    for (int i = 0; i < entry.pieces_size(); ++i) {
      const checkpoint::TensorPiece& piece = entry.pieces(i);
      const int64_t first = std::max(begin, piece.begin());
      const int64_t last = std::min(end, piece.end());
      if (first >= last) continue;
      const std::string file = File(piece.rank());
      const c10::impl::GenericDict& values = Values(piece.rank());
      auto it = values.find(key);
      if (it == values.end()) throw CheckpointError(absl::StrCat(file, ": has no '", key, "', its manifest says it has"));
      const at::Tensor t = InBounds(it->value().toTensor(), file, key);
      if (t.dim() != 1 || t.numel() != piece.end() - piece.begin()) {
        throw CheckpointError(absl::StrCat(file, ": '", key, "' has shape ", c10::str(t.sizes()), ", the manifest says [",
                                           piece.end() - piece.begin(), "]"));
      }
      if (!out.defined()) out = at::empty({end - begin}, t.options());
      if (t.scalar_type() != out.scalar_type()) {
        throw CheckpointError(absl::StrCat(file, ": '", key, "' is ", c10::toString(t.scalar_type()),
                                           " in one shard and ", c10::toString(out.scalar_type()), " in another"));
      }
      out.narrow(0, first - begin, last - first).copy_(t.narrow(0, first - piece.begin(), last - first));
      filled += last - first;
    }
    if (begin < 0 || end > numel || begin > end || filled != end - begin) {
      throw CheckpointError(absl::StrCat(found_.path, ": '", key, "' has ", numel, " elements in its shards, not the ",
                                         end, " the model needs"));
    }
    if (!out.defined()) out = at::empty({0});
    return out;
  }

 private:
  CheckpointError Bad(const std::string& what) const {
    return CheckpointError(absl::StrCat(found_.path, "/", kManifestFile, ": ", what));
  }

  // The number of elements of a split tensor, its pieces checked once: valid
  // ranks, and together every element of the tensor exactly once.
  int64_t Numel(const checkpoint::ShardedTensor& entry) {
    auto cached = numel_.find(entry.key());
    if (cached != numel_.end()) return cached->second;
    int64_t numel = 1;
    for (int64_t d : entry.shape()) {
      if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) throw Bad(absl::StrCat("'", entry.key(), "' has a bad shape"));
    }
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const checkpoint::TensorPiece& piece : entry.pieces()) {
      if (piece.rank() < 0 || piece.rank() >= found_.manifest->world_size() || piece.begin() < 0 ||
          piece.begin() >= piece.end() || piece.end() > numel) {
        throw Bad(absl::StrCat("'", entry.key(), "' has a bad piece (rank ", piece.rank(), ", [", piece.begin(), ", ",
                               piece.end(), ") of ", numel, ")"));
      }
      ranges.emplace_back(piece.begin(), piece.end());
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t next = 0;
    for (const auto& [first, last] : ranges) {
      if (first != next) throw Bad(absl::StrCat("the pieces of '", entry.key(), "' do not cover it exactly once"));
      next = last;
    }
    if (next != numel) throw Bad(absl::StrCat("the pieces of '", entry.key(), "' do not cover it exactly once"));
    numel_[entry.key()] = numel;
    return numel;
  }

  const FoundCheckpoint& found_;
  const int home_;
  std::map<std::string, const checkpoint::ShardedTensor*> table_;
  std::map<int, c10::impl::GenericDict> values_;
  std::map<std::string, int64_t> numel_;
};

}  // namespace

at::Tensor BytesToTensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string TensorToBytes(const at::Tensor& t) {
  const at::Tensor bytes = t.to(at::kCPU).contiguous();
  if (bytes.scalar_type() != at::kByte || bytes.dim() != 1) throw CheckpointError("bytes entry is not a uint8 vector");
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

CheckpointManager::CheckpointManager(CheckpointOptions options, int rank, int world_size,
                                     CoordinationClient* coordination)
    : options_(std::move(options)), rank_(rank), world_size_(world_size), coordination_(coordination) {
  if (options_.directory.empty()) throw InvalidArgumentError("checkpoint directory is empty");
  if (options_.keep_last < 1) throw InvalidArgumentError("checkpoint keep_last must be at least 1");
  if (options_.keep_best > 0 && options_.best_metric.find('/') == std::string::npos) {
    throw InvalidArgumentError("checkpoint best_metric must be task/metric (e.g. test/accuracy), got '" +
                               options_.best_metric + "'");
  }
  fs::create_directories(options_.directory);
}

CheckpointManager::~CheckpointManager() {
  try {
    Wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep: rank %d: checkpoint save failed: %s\n", rank_, e.what());
  }
}

void CheckpointManager::AwaitSnapshot() {
  if (!snapshot_.valid()) return;
  std::shared_future<void> snapshot = std::move(snapshot_);
  snapshot_ = {};
  snapshot.get();  // rethrows a failed copy
}

void CheckpointManager::Wait() {
  try {
    AwaitSnapshot();
  } catch (...) {
    // the same failure comes out of the save itself
  }
  if (in_flight_.valid()) in_flight_.get();
}

void CheckpointManager::SetWorld(int rank, int world_size, CoordinationClient* coordination) {
  if (rank < 0 || rank >= world_size) {
    throw InvalidArgumentError(absl::StrCat("checkpoint: rank ", rank, " of a world of ", world_size));
  }
  try {
    Wait();
  } catch (const std::exception& e) {
    // A save that a lost rank left unfinished is never committed, so it is never loaded.
    std::fprintf(stderr, "lockstep: rank %d: the checkpoint save in flight when the world changed is abandoned: %s\n",
                 rank_, e.what());
  }
  rank_ = rank;
  world_size_ = world_size;
  coordination_ = coordination;
}

void CheckpointManager::set_model_axis(Communicator* model_axis, int model_index,
                                       std::vector<ParameterLayout> layouts) {
  split_.clear();
  model_axis_ = model_axis != nullptr && model_axis->world_size() > 1 ? model_axis : nullptr;
  model_index_ = model_index;
  for (ParameterLayout& layout : layouts) {
    if (layout.sharded()) split_[layout.name] = std::move(layout);
  }
}

void CheckpointManager::CheckMeshLayout(const ShardedLayout& layout) const {
  if (data_axis_ == nullptr) {
    throw InvalidArgumentError("checkpoint: a sharded train state beside a model axis needs set_data_axis");
  }
  if (layout.rank != data_axis_->rank() || layout.world_size != data_axis_->world_size()) {
    throw InvalidArgumentError(absl::StrCat("checkpoint: the train state is sharded for rank ", layout.rank, " of ",
                                            layout.world_size, ", the data axis is rank ", data_axis_->rank(), " of ",
                                            data_axis_->world_size()));
  }
  if (!layout.parameters_whole) {
    throw InvalidArgumentError("checkpoint: fully sharded parameters beside a model axis are not supported");
  }
}

void CheckpointManager::Save(const TrainState& state, const ShardExtras& extras,
                             const std::map<std::string, double>& metrics, bool emergency) {
  const auto start = std::chrono::steady_clock::now();
  if (world_size_ > 1 && coordination_ == nullptr) {
    throw InvalidArgumentError("checkpoints of a world of more than one rank need the coordination service");
  }
  Wait();  // one save at a time; rethrows the previous one's failure
  auto job = std::make_shared<Job>();
  job->step = state.step;
  job->emergency = emergency;
  job->metrics = metrics;
  // Async: copies now, since training goes on changing the tensors in place.
  const bool copy = options_.async;
  // Copies go to staging tensors kept from the previous save (it has finished):
  // memory already mapped copies at memcpy speed; fresh allocations fault in every
  // page (112 ms against 30 ms for 256 MB here).
  std::vector<std::pair<at::Tensor, at::Tensor>> deferred;  // (staging, source), copied in the background
  auto put = [&](const std::string& key, const at::Tensor& t, bool may_defer = true) {
    if (!t.defined()) return;
    if (!copy) {
      // Shards hold CPU tensors: a model on a GPU is copied to the host here.
      job->values.insert(key, t.detach().cpu());
      return;
    }
    at::Tensor& staged = staging_[key];
    if (!staged.defined() || staged.sizes() != t.sizes() || staged.scalar_type() != t.scalar_type()) {
      staged = at::empty(t.sizes(), t.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
    }
    if (options_.overlap_copy && may_defer) {
      deferred.emplace_back(staged, t.detach());
    } else {
      staged.copy_(t.detach());
    }
    job->values.insert(key, staged);
  };
  // The optimizer's state, through its codec.
  struct Writer final : OptimizerStateWriter {
    std::function<void(const std::string&, const at::Tensor&)> put_tensor;
    std::function<void(const std::string&, int64_t)> put_int;
    std::function<void(const std::string&, const std::string&)> put_bytes;
    void PutTensor(const std::string& key, const at::Tensor& value) override { put_tensor(key, value); }
    void PutInt(const std::string& key, int64_t value) override { put_int(key, value); }
    void PutBytes(const std::string& key, const std::string& value) override { put_bytes(key, value); }
  } writer;
  const ShardedLayout* layout = state.layout.get();
  job->partitioning = layout != nullptr ? layout->strategy : options_.partitioning;
  // A sharded layout over the data axis of a mesh with a split model: gathered
  // whole over both axes, so the checkpoint is a replicated one.
  const bool mesh_sharded = layout != nullptr && model_axis_ != nullptr;
  if (mesh_sharded) {
    CheckMeshLayout(*layout);
    job->partitioning = kReplicated;
  }
  if (layout == nullptr || mesh_sharded) {
    // A model split over a model axis: every rank of the axis gathers each split
    // value, in the same order, and the checkpoint holds whole tensors.
    auto whole = [&](const std::string& name, const at::Tensor& value) -> at::Tensor {
      if (model_axis_ == nullptr) return value;
      auto split = split_.find(name);
      if (split == split_.end()) return value;
      if (value.sizes().vec() != split->second.local_shape()) return value;  // a scalar of the optimizer's, say
      return GatherShards(value.detach(), split->second, model_axis_);
    };
    for (const auto& item : state.model->named_parameters()) {
      put("model/" + item.key(), whole(item.key(), item.value()));
    }
    writer.put_tensor = [&](const std::string& key, const at::Tensor& value) {
      put(kOptimizerPrefix + key, whole(key.substr(0, key.rfind('/')), value));
    };
    writer.put_int = [&](const std::string& key, int64_t value) { job->values.insert(kOptimizerPrefix + key, value); };
    writer.put_bytes = [&](const std::string& key, const std::string& value) {
      job->values.insert(kOptimizerPrefix + key, BytesToTensor(value));
    };
    if (!mesh_sharded) {
      FindOptimizerStateCodec(*state.optimizer)->Save(*state.optimizer, OptimizerParameters(state), writer);
    } else {
      // The codec sees "unit<u>" parameters holding this data rank's slices: each
      // value is all-gathered over the data axis, cut into its members (this model
      // index's shards) and gathered whole over the model axis by `whole`.
      auto unit_and_field = [&](const std::string& key) {
        auto parsed = ParseUnitKey(key, layout->units.size());
        if (!parsed) {
          throw InvalidArgumentError("checkpoint: the optimizer's codec wrote '" + key + "', not a parameter's value");
        }
        return *parsed;
      };
      writer.put_tensor = [&](const std::string& key, const at::Tensor& value) {
        const auto [u, field] = unit_and_field(key);
        const ShardedLayout::Unit& unit = layout->units[u];
        CheckSplittable(unit, field, value);
        const at::Tensor input = value.detach().contiguous();
        at::Tensor flat = at::empty({unit.slice * layout->world_size}, input.options());
        data_axis_->AllGather(flat, input);
        for (const ShardedLayout::Member& member : unit.members) {
          put(absl::StrCat(kOptimizerPrefix, member.name, "/", field),
              whole(member.name, flat.narrow(0, member.offset, member.numel).view(member.shape)));
        }
      };
      writer.put_int = [&](const std::string& key, int64_t value) {
        const auto [u, field] = unit_and_field(key);
        for (const ShardedLayout::Member& member : layout->units[u].members) {
          job->values.insert(absl::StrCat(kOptimizerPrefix, member.name, "/", field), value);
        }
      };
      writer.put_bytes = [&](const std::string& key, const std::string&) { RefuseArchive(key); };
      FindOptimizerStateCodec(*state.optimizer)->Save(*state.optimizer, UnitParameters(*layout), writer);
    }
  } else {
    if (layout->rank != rank_ || layout->world_size != world_size_) {
      throw InvalidArgumentError(absl::StrCat("checkpoint: the train state is sharded for rank ", layout->rank, " of ",
                                              layout->world_size, ", the manager is rank ", rank_, " of ", world_size_));
    }
    // Each rank saves its pieces of each parameter and of its optimizer state,
    // so every element is saved once; the manifest says where each piece is.
    // A piece is a view of the slice: copied (async) or cloned, never saved
    // with the rest of its storage.
    auto put_piece = [&](const std::string& key, const at::Tensor& slice, const Piece& piece) {
      const at::Tensor part = slice.narrow(0, piece.local, piece.end - piece.begin);
      if (copy) {
        put(key, part);
      } else {
        job->values.insert(key, part.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
      }
    };
    // Each unit's split values: "" for the parameters, then the optimizer's fields.
    std::vector<std::set<std::string>> fields(layout->units.size());
    for (size_t u = 0; u < layout->units.size(); ++u) {
      const ShardedLayout::Unit& unit = layout->units[u];
      fields[u].insert("");
      for (const ShardedLayout::Member& member : unit.members) {
        if (auto piece = PieceOf(unit, member, rank_)) put_piece("model/" + member.name, unit.shard, *piece);
      }
    }
    // The codec sees one parameter per unit, "unit<u>"; its values per element
    // are split over the members, its scalars go with every piece.
    auto unit_and_field = [&](const std::string& key) {
      auto parsed = ParseUnitKey(key, layout->units.size());
      if (!parsed) {
        throw InvalidArgumentError("checkpoint: the optimizer's codec wrote '" + key + "', not a parameter's value");
      }
      return *parsed;
    };
    writer.put_tensor = [&](const std::string& key, const at::Tensor& value) {
      const auto [u, field] = unit_and_field(key);
      const ShardedLayout::Unit& unit = layout->units[u];
      CheckSplittable(unit, field, value);
      fields[u].insert(field);
      for (const ShardedLayout::Member& member : unit.members) {
        if (auto piece = PieceOf(unit, member, rank_)) {
          put_piece(absl::StrCat(kOptimizerPrefix, member.name, "/", field), value, *piece);
        }
      }
    };
    writer.put_int = [&](const std::string& key, int64_t value) {
      const auto [u, field] = unit_and_field(key);
      const ShardedLayout::Unit& unit = layout->units[u];
      for (const ShardedLayout::Member& member : unit.members) {
        if (PieceOf(unit, member, rank_)) job->values.insert(absl::StrCat(kOptimizerPrefix, member.name, "/", field), value);
      }
    };
    writer.put_bytes = [&](const std::string& key, const std::string&) { RefuseArchive(key); };
    FindOptimizerStateCodec(*state.optimizer)->Save(*state.optimizer, UnitParameters(*layout), writer);
    if (rank_ == 0) {
      // Every rank's pieces, for the manifest. Rank 0 holds a slice of every
      // unit, so its fields are every rank's.
      for (size_t u = 0; u < layout->units.size(); ++u) {
        const ShardedLayout::Unit& unit = layout->units[u];
        for (const std::string& field : fields[u]) {
          for (const ShardedLayout::Member& member : unit.members) {
            checkpoint::ShardedTensor& entry = job->sharded_tensors.emplace_back();
            entry.set_key(field.empty() ? "model/" + member.name
                                        : absl::StrCat(kOptimizerPrefix, member.name, "/", field));
            for (int64_t d : member.shape) entry.add_shape(d);
            for (int r = 0; r < world_size_; ++r) {
              if (auto piece = PieceOf(unit, member, r)) {
                checkpoint::TensorPiece* out = entry.add_pieces();
                out->set_rank(r);
                out->set_begin(piece->begin);
                out->set_end(piece->end);
              }
            }
          }
        }
      }
    }
  }
  // Buffers change in forward (batch-norm statistics): copied now.
  for (const auto& item : state.model->named_buffers()) put("model/" + item.key(), item.value(), false);
  // A trainer subclass's own state; copied now, like the buffers.
  for (const auto& [name, tensor] : extras.custom.tensors) put(kCustomTensorPrefix + name, tensor, false);
  for (const auto& [name, bytes] : extras.custom.bytes) job->values.insert(kCustomBytesPrefix + name, BytesToTensor(bytes));
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    job->values.insert("rng/cpu", generator.get_state());
  }
  job->values.insert("step", state.step);
  job->values.insert("data/epoch", extras.data.epoch);
  job->values.insert("data/batch_in_epoch", extras.data.batch_in_epoch);
  job->values.insert("trainer_state", extras.trainer_state);
  if (options_.async) {
    auto copied = std::make_shared<std::promise<void>>();
    snapshot_ = copied->get_future().share();
    in_flight_ = std::async(std::launch::async, [this, job, copied, deferred = std::move(deferred)] {
      try {
        for (const auto& [staged, source] : deferred) staged.copy_(source);
        copied->set_value();
      } catch (...) {
        copied->set_exception(std::current_exception());
        throw;
      }
      Write(*job);
    });
  } else {
    Write(*job);
  }
  last_pause_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CheckpointManager::Write(const Job& job) {
  const fs::path dir = options_.directory;
  const std::string name = CheckpointDirName(job.step);
  const fs::path tmp = dir / (kTmpPrefix + name);
  std::error_code ec;
  fs::create_directories(tmp, ec);
  if (ec) throw CheckpointError(absl::StrCat("cannot create '", tmp.string(), "': ", ec.message()));

  const auto [bytes_written, crc] = WriteShard((tmp / ShardName(rank_)).string(), job.values);
  // A lambda may not capture a structured binding in C++17 (clang refuses).
  const std::string own_report = absl::StrCat(bytes_written, " ", crc);

  const std::string key_prefix = absl::StrCat("lockstep/checkpoint/", job.step, "/");
  if (coordination_ != nullptr && world_size_ > 1) {
    ThrowIfError(Publish(*coordination_, key_prefix + "shard/", own_report),
                 "checkpoint: reporting this rank's shard");
    ThrowIfError(coordination_->Barrier(key_prefix + "written", options_.barrier_timeout),
                 absl::StrCat("checkpoint step ", job.step, ": waiting for every rank's shard"));
  }
  // Rank 0 commits; should it fail, the others learn it at the "committed"
  // barrier from "failed" rather than wait for a commit that will not come.
  auto commit = [&] {
    checkpoint::Manifest manifest;
    manifest.set_step(job.step);
    manifest.set_world_size(world_size_);
    manifest.set_partitioning(job.partitioning);
    for (const checkpoint::ShardedTensor& entry : job.sharded_tensors) *manifest.add_sharded_tensors() = entry;
    manifest.set_config_fingerprint(options_.config_fingerprint);
    manifest.set_config_text(options_.config_text);
    manifest.set_emergency(job.emergency);
    manifest.set_created_unix_seconds(
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count());
    for (const auto& [metric, value] : job.metrics) (*manifest.mutable_metrics())[metric] = value;
    // Every rank's report (rank 0's own, alone, needs no store). Each rank
    // reported before the "written" barrier, so a report still missing is a
    // rank that left a fault-tolerant job: no need to wait long.
    std::vector<std::string> reports = {own_report};
    if (coordination_ != nullptr && world_size_ > 1) {
      absl::StatusOr<std::vector<std::string>> gathered =
          GatherPublished(*coordination_, key_prefix + "shard/", absl::Seconds(5));
      ThrowIfError(gathered.status(), "checkpoint: the ranks' shard reports");
      reports = *std::move(gathered);
    }
    for (int r = 0; r < world_size_; ++r) {
      checkpoint::ShardFile* shard = manifest.add_shards();
      shard->set_rank(r);
      shard->set_path(ShardName(r));
      const std::string& info = reports.at(r);
      std::vector<std::string> fields = absl::StrSplit(info, ' ');
      int64_t size = 0;
      uint32_t shard_crc = 0;
      if (fields.size() != 2 || !absl::SimpleAtoi(fields[0], &size) || !absl::SimpleAtoi(fields[1], &shard_crc)) {
        throw CheckpointError(absl::StrCat("checkpoint: rank ", r, " reported '", info, "'"));
      }
      shard->set_bytes(size);
      shard->set_crc32c(shard_crc);
    }
    checkpoint::ManifestFile file;
    file.set_manifest(manifest.SerializeAsString());
    file.set_crc32c(Crc32c(file.manifest().data(), file.manifest().size()));
    const std::string manifest_bytes = file.SerializeAsString();
    WriteDurably((tmp / kManifestFile).string(), manifest_bytes.data(), manifest_bytes.size());
    FsyncDirectory(tmp.string());
    const fs::path final_dir = dir / name;
    bool committed = false;  // this step is already (an emergency save right after a regular one)
    if (fs::exists(final_dir)) {
      try {
        Validate(final_dir.string());
        committed = true;
      } catch (const CheckpointError&) {
        // Damaged (often recoverable, one bad shard of many): kept aside, never deleted.
        const fs::path aside = dir / absl::StrCat(name, ".damaged.", std::chrono::duration_cast<std::chrono::seconds>(
                                                                         std::chrono::system_clock::now().time_since_epoch())
                                                                         .count());
        fs::rename(final_dir, aside);
        std::fprintf(stderr, "lockstep: checkpoint %s was damaged; moved to %s and saved again\n", final_dir.c_str(),
                     aside.c_str());
      }
    }
    if (committed) {
      fs::remove_all(tmp);
    } else {
      fs::rename(tmp, final_dir);
    }
    FsyncDirectory(dir.string());
    // Only now does "latest" move.
    const std::string latest_tmp = (dir / (std::string(kTmpPrefix) + kLatestFile)).string();
    const std::string latest_text = name + "\n";
    WriteDurably(latest_tmp, latest_text.data(), latest_text.size());
    fs::rename(latest_tmp, dir / kLatestFile);
    FsyncDirectory(dir.string());
    ApplyRetention(job.step);
  };
  const bool shared = coordination_ != nullptr && world_size_ > 1;
  if (rank_ == 0) {
    try {
      commit();
    } catch (const std::exception& e) {
      if (shared) {
        (void)coordination_->Set(key_prefix + "failed", e.what());
        (void)coordination_->Barrier(key_prefix + "committed", options_.barrier_timeout);
      }
      throw;
    }
  }
  if (shared) {
    ThrowIfError(coordination_->Barrier(key_prefix + "committed", options_.barrier_timeout),
                 absl::StrCat("checkpoint step ", job.step, ": waiting for rank 0 to commit"));
    (void)coordination_->Delete(absl::StrCat(key_prefix, "shard/", rank_));
    if (rank_ != 0) {
      absl::StatusOr<std::optional<std::string>> failed = coordination_->TryGet(key_prefix + "failed");
      if (failed.ok() && *failed) {
        throw CheckpointError(absl::StrCat("checkpoint step ", job.step, ": rank 0 could not commit it: ", **failed));
      }
    }
  }
}

void CheckpointManager::ApplyRetention(int64_t committed_step) {
  struct Entry {
    int64_t step;
    fs::path path;
    std::optional<double> metric;
    bool pinned;
  };
  std::vector<Entry> entries;
  for (const auto& item : fs::directory_iterator(options_.directory)) {
    const std::string name = item.path().filename().string();
    if (name.rfind(kTmpPrefix, 0) == 0 && name != std::string(kTmpPrefix) + kLatestFile) {
      fs::remove_all(item.path());  // every rank's part of every save so far is committed: leftovers of a crash
      continue;
    }
    const std::optional<int64_t> step = StepOfDirName(name, "step_");
    if (!step || !item.is_directory()) continue;
    // Newer than the checkpoint just committed: a run resumed from an older one
    // because these are damaged (or were not chosen). Left alone.
    if (*step > committed_step) continue;
    Entry entry{*step, item.path(), std::nullopt, fs::exists(item.path() / kPinnedFile)};
    try {
      const checkpoint::Manifest manifest = ReadManifest(item.path().string());
      auto metric = manifest.metrics().find(options_.best_metric);
      if (metric != manifest.metrics().end() && !std::isnan(metric->second)) entry.metric = metric->second;
    } catch (const CheckpointError&) {
      continue;  // not a checkpoint; left alone (and never loaded)
    }
    entries.push_back(entry);
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.step > b.step; });
  std::set<int64_t> keep;
  for (size_t i = 0; i < entries.size() && static_cast<int>(i) < options_.keep_last; ++i) keep.insert(entries[i].step);
  if (options_.keep_best > 0) {
    std::vector<Entry> ranked;
    for (const Entry& e : entries) {
      if (e.metric) ranked.push_back(e);
    }
    std::stable_sort(ranked.begin(), ranked.end(), [this](const Entry& a, const Entry& b) {
      return options_.best_max ? *a.metric > *b.metric : *a.metric < *b.metric;
    });
    for (size_t i = 0; i < ranked.size() && static_cast<int>(i) < options_.keep_best; ++i) keep.insert(ranked[i].step);
  }
  for (const Entry& e : entries) {
    if (keep.count(e.step) || e.pinned) continue;
    // Renamed first (atomic), then deleted: a crash midway leaves a .tmp_ directory
    // that nothing loads and the next save removes, never a half-deleted step_N.
    const fs::path doomed = e.path.parent_path() / (std::string(kTmpPrefix) + "deleting_" + e.path.filename().string());
    fs::rename(e.path, doomed);
    fs::remove_all(doomed);
  }
}

std::optional<std::string> CheckpointManager::ReadLatest(const std::string& directory) {
  const fs::path file = fs::path(directory) / kLatestFile;
  std::error_code error;
  const fs::file_status status = fs::status(file, error);
  if (status.type() == fs::file_type::not_found) return std::nullopt;
  if (error) throw CheckpointError(absl::StrCat(file.string(), ": cannot read it (", error.message(), ")"));
  if (!fs::is_regular_file(status)) throw CheckpointError(absl::StrCat(file.string(), ": not a file"));
  constexpr uintmax_t kMaxBytes = 64;  // "step_" and up to 19 digits, with room for a line end
  const uintmax_t size = fs::file_size(file, error);
  if (error || size > kMaxBytes) {
    throw CheckpointError(absl::StrCat(file.string(), ": not a step name (",
                                       error ? error.message() : absl::StrCat(size, " bytes"), ")"));
  }
  const std::string text = ReadFile(file.string(), "latest file");
  const std::string name(absl::StripTrailingAsciiWhitespace(text));
  const std::string digits = name.size() > 5 ? name.substr(5) : "";
  if (name.rfind("step_", 0) != 0 || digits.empty() || digits.size() > 19 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
      !StepOfDirName(name, "step_")) {
    throw CheckpointError(
        absl::StrCat(file.string(), ": does not name a step directory (holds '", absl::CHexEscape(name), "')"));
  }
  return (fs::path(directory) / name).string();
}

FoundCheckpoint CheckpointManager::Validate(const std::string& path) {
  if (!fs::is_directory(path)) throw CheckpointError(absl::StrCat(path, ": not a checkpoint directory"));
  FoundCheckpoint found = ReadManifestOnly(path);
  for (const checkpoint::ShardFile& shard : found.manifest->shards()) {
    if (!IsShardFileName(shard.path())) {
      throw CheckpointError(absl::StrCat(path, "/", kManifestFile, ": bad shard path '",
                                         absl::CHexEscape(shard.path()), "'"));
    }
    const std::string file = (fs::path(path) / shard.path()).string();
    std::error_code error;
    const fs::file_status status = fs::status(file, error);
    if (status.type() == fs::file_type::not_found) {
      throw CheckpointError(absl::StrCat(file, ": missing (a partial checkpoint)"));
    }
    if (error) throw CheckpointError(absl::StrCat(file, ": cannot read it (", error.message(), ")"));
    if (!fs::is_regular_file(status)) throw CheckpointError(absl::StrCat(file, ": not a file"));
    const int64_t size = static_cast<int64_t>(fs::file_size(file));
    if (size != shard.bytes()) {
      throw CheckpointError(absl::StrCat(file, ": ", size, " bytes, the manifest says ", shard.bytes(), " (truncated)"));
    }
    const auto [crc, read] = FileCrc(file);
    if (crc != shard.crc32c() || read != size) {
      throw CheckpointError(absl::StrFormat("%s: CRC32C %08x, the manifest says %08x (corrupt)", file, crc,
                                            shard.crc32c()));
    }
  }
  return found;
}

FoundCheckpoint CheckpointManager::ReadManifestOnly(const std::string& path) {
  auto manifest = std::make_shared<checkpoint::Manifest>(ReadManifest(path));
  if (manifest->world_size() < 1 || manifest->shards_size() != manifest->world_size()) {
    throw CheckpointError(absl::StrCat(path, "/", kManifestFile, ": lists ", manifest->shards_size(),
                                       " shards for a world of ", manifest->world_size()));
  }
  return FoundCheckpoint{path, manifest->step(), manifest->world_size(), manifest};
}

std::optional<FoundCheckpoint> CheckpointManager::FindLatest(const std::string& directory,
                                                             std::vector<std::string>* skipped) {
  if (!fs::is_directory(directory)) return std::nullopt;
  std::vector<std::pair<int64_t, fs::path>> candidates;
  std::vector<std::pair<int64_t, fs::path>> unfinished;
  for (const auto& item : fs::directory_iterator(directory)) {
    const std::string name = item.path().filename().string();
    if (!item.is_directory()) continue;
    if (auto step = StepOfDirName(name, "step_")) candidates.emplace_back(*step, item.path());
    if (auto step = StepOfDirName(name, std::string(kTmpPrefix) + "step_")) unfinished.emplace_back(*step, item.path());
  }
  std::sort(candidates.rbegin(), candidates.rend());
  for (const auto& [step, path] : candidates) {
    try {
      FoundCheckpoint found = Validate(path.string());
      if (skipped) {
        for (const auto& [tmp_step, tmp_path] : unfinished) {
          if (tmp_step > step) skipped->push_back(absl::StrCat(tmp_path.string(), ": an unfinished save (never committed)"));
        }
      }
      return found;
    } catch (const CheckpointError& e) {
      if (skipped) skipped->push_back(e.what());
    }
  }
  return std::nullopt;
}

ShardExtras CheckpointManager::Restore(const FoundCheckpoint& found, TrainState& state) const {
  const checkpoint::Manifest& manifest = *found.manifest;
  // A partitioning of the user's own (a BaseTrainer that splits its model itself)
  // has no table of pieces: each rank's shard is that rank's state, so it loads on
  // the same number of ranks under the same partitioning only, each rank from its own shard.
  if (manifest.partitioning() != kReplicated && manifest.sharded_tensors_size() == 0) {
    if (manifest.world_size() != world_size_ || manifest.partitioning() != options_.partitioning) {
      throw CheckpointError(absl::StrCat(found.path, ": written by ", manifest.world_size(),
                                         " ranks with partitioning '", manifest.partitioning(),
                                         "' (per-rank state, no table of its pieces), which cannot load on ",
                                         world_size_, " ranks with partitioning '", options_.partitioning, "'"));
    }
  }
  if (manifest.config_fingerprint() != options_.config_fingerprint) {
    throw CheckpointError(absl::StrCat(found.path, ": written with a different config: ",
                                       FirstDifference(manifest.config_text(), options_.config_text),
                                       " (resume with the same config, or start afresh with --resume=none)"));
  }
  const ShardedLayout* layout = state.layout.get();
  const bool mesh_sharded = layout != nullptr && model_axis_ != nullptr;
  if (mesh_sharded) {
    CheckMeshLayout(*layout);
  } else if (layout != nullptr && (layout->rank != rank_ || layout->world_size != world_size_)) {
    throw InvalidArgumentError(absl::StrCat("checkpoint: the train state is sharded for rank ", layout->rank, " of ",
                                            layout->world_size, ", the manager is rank ", rank_, " of ", world_size_));
  }
  // The rank whose slices the layout holds: over the data axis on a mesh.
  const int slice_rank = layout != nullptr ? layout->rank : rank_;
  // Any layout loads from any other: each value this rank needs is read from the
  // shards that hold it (every shard of a sharded checkpoint, for a replicated
  // model; this rank's own one when the layouts agree).
  CheckpointReader reader(found, rank_);
  const std::string home = reader.File(reader.home());
  // The value of `key` for a tensor like `like`: with a model axis, this rank's
  // shard of the whole tensor when `name` is a split parameter.
  auto ReadShard = [this](CheckpointReader& from, const std::string& key, const std::string& name,
                          const at::Tensor& like) -> at::Tensor {
    auto split = split_.find(name);
    if (model_axis_ == nullptr || split == split_.end() || !like.defined()) return from.Whole(key, like);
    if (like.sizes().vec() != split->second.local_shape()) return from.Whole(key, like);
    const at::Tensor whole_like = at::empty(split->second.global_shape, like.options().requires_grad(false));
    return ShardOf(from.Whole(key, whole_like), split->second, model_index_);
  };
  try {
    {
      at::NoGradGuard no_grad;
      if (layout == nullptr || layout->parameters_whole) {
        for (const auto& item : state.model->named_parameters()) {
          item.value().copy_(ReadShard(reader, "model/" + item.key(), item.key(), item.value()));
        }
      } else {
        // Fully sharded: only this rank's slices hold parameters (the padding stays zero).
        for (const ShardedLayout::Unit& unit : layout->units) {
          for (const ShardedLayout::Member& member : unit.members) {
            if (auto piece = PieceOf(unit, member, slice_rank)) {
              unit.shard.narrow(0, piece->local, piece->end - piece->begin)
                  .copy_(reader.Range("model/" + member.name, piece->begin, piece->end));
            }
          }
        }
      }
      for (const auto& item : state.model->named_buffers()) {
        item.value().copy_(reader.Whole("model/" + item.key(), item.value()));
      }
    }
    struct Reader final : OptimizerStateReader {
      std::function<bool(const std::string&)> has;
      std::function<at::Tensor(const std::string&, const at::Tensor&)> tensor;
      std::function<int64_t(const std::string&)> integer;
      std::function<std::string(const std::string&)> bytes;
      bool Has(const std::string& key) const override { return has(key); }
      at::Tensor Tensor(const std::string& key, const at::Tensor& like) const override { return tensor(key, like); }
      int64_t Int(const std::string& key) const override { return integer(key); }
      std::string Bytes(const std::string& key) const override { return bytes(key); }
    } optimizer_reader;
    if (layout == nullptr) {
      optimizer_reader.has = [&](const std::string& key) { return reader.Has(kOptimizerPrefix + key); };
      optimizer_reader.tensor = [&](const std::string& key, const at::Tensor& like) {
        at::Tensor t = ReadShard(reader, kOptimizerPrefix + key, key.substr(0, key.rfind('/')), like);
        return like.defined() ? t.to(like.device()) : t;
      };
      optimizer_reader.integer = [&](const std::string& key) { return reader.Value(kOptimizerPrefix + key).toInt(); };
      optimizer_reader.bytes = [&](const std::string& key) {
        return TensorToBytes(reader.Whole(kOptimizerPrefix + key, at::Tensor()));
      };
      FindOptimizerStateCodec(*state.optimizer)->Restore(*state.optimizer, OptimizerParameters(state), optimizer_reader);
    } else {
      // "unit<u>/<field>": this rank's slice of the unit, assembled from the
      // members' values (zeros in the padding); a scalar from the unit's first member.
      auto unit_and_field = [&](const std::string& key) {
        auto parsed = ParseUnitKey(key, layout->units.size());
        if (!parsed) throw InvalidArgumentError("checkpoint: the optimizer's codec asked for '" + key + "'");
        return *parsed;
      };
      auto first_member_key = [&](const std::string& key) {
        const auto [u, field] = unit_and_field(key);
        return absl::StrCat(kOptimizerPrefix, layout->units[u].members.front().name, "/", field);
      };
      optimizer_reader.has = [&](const std::string& key) { return reader.Has(first_member_key(key)); };
      optimizer_reader.integer = [&](const std::string& key) { return reader.Value(first_member_key(key)).toInt(); };
      optimizer_reader.tensor = [&](const std::string& key, const at::Tensor& like) {
        const auto [u, field] = unit_and_field(key);
        const ShardedLayout::Unit& unit = layout->units[u];
        at::Tensor out = at::zeros({unit.slice}, like.options().requires_grad(false));
        for (const ShardedLayout::Member& member : unit.members) {
          if (auto piece = PieceOf(unit, member, slice_rank)) {
            const std::string member_key = absl::StrCat(kOptimizerPrefix, member.name, "/", field);
            at::Tensor values;
            if (mesh_sharded && split_.count(member.name) > 0) {
              // This model index's shard of the whole value, then the slice's range of it.
              const at::Tensor member_like = at::empty(member.shape, like.options().requires_grad(false));
              values = ReadShard(reader, member_key, member.name, member_like)
                           .reshape({-1})
                           .narrow(0, piece->begin, piece->end - piece->begin);
            } else {
              values = reader.Range(member_key, piece->begin, piece->end);
            }
            out.narrow(0, piece->local, piece->end - piece->begin).copy_(values);
          }
        }
        return out;
      };
      optimizer_reader.bytes = [&](const std::string& key) -> std::string {
        throw CheckpointError(absl::StrCat(found.path, ": the optimizer asks for '", key,
                                           "', an archive, which a sharded partitioning cannot load"));
      };
      FindOptimizerStateCodec(*state.optimizer)->Restore(*state.optimizer, UnitParameters(*layout), optimizer_reader);
    }
    {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      const at::Tensor rng = InBounds(reader.Value("rng/cpu").toTensor(), home, "rng/cpu").contiguous();
      // libtorch's set_state trusts the state's layout (a crash on a wrong one;
      // found by fuzz/checkpoint_shard_fuzzer): it must be what get_state gives.
      const at::Tensor expected = generator.get_state();
      if (rng.scalar_type() != expected.scalar_type() || rng.sizes() != expected.sizes()) {
        throw CheckpointError(absl::StrCat(home, ": 'rng/cpu' is not a CPU generator state (", c10::str(rng.sizes()), " ",
                                           c10::toString(rng.scalar_type()), ", expected ", c10::str(expected.sizes()),
                                           " ", c10::toString(expected.scalar_type()), ")"));
      }
      generator.set_state(rng);
    }
    state.step = reader.Value("step").toInt();
    ShardExtras extras;
    extras.data.epoch = reader.Value("data/epoch").toInt();
    extras.data.batch_in_epoch = reader.Value("data/batch_in_epoch").toInt();
    extras.trainer_state = reader.Value("trainer_state").toStringRef();
    for (const auto& item : reader.Values(reader.home())) {
      const std::string& key = item.key().toStringRef();
      if (key.rfind(kCustomTensorPrefix, 0) == 0) {
        extras.custom.tensors[key.substr(sizeof(kCustomTensorPrefix) - 1)] = InBounds(item.value().toTensor(), home, key);
      } else if (key.rfind(kCustomBytesPrefix, 0) == 0) {
        extras.custom.bytes[key.substr(sizeof(kCustomBytesPrefix) - 1)] =
            TensorToBytes(InBounds(item.value().toTensor(), home, key));
      }
    }
    return extras;
  } catch (const CheckpointError&) {
    throw;
  } catch (const InvalidArgumentError&) {
    throw;
  } catch (const c10::Error& e) {
    throw CheckpointError(absl::StrCat(found.path, ": unexpected content: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw CheckpointError(absl::StrCat(found.path, ": unexpected content: ", e.what()));
  }
}

void ConsolidateCheckpoint(const std::string& step_directory, const std::string& output_file) {
  const FoundCheckpoint found = CheckpointManager::Validate(step_directory);
  if (found.manifest->partitioning() != kReplicated && found.manifest->sharded_tensors_size() == 0) {
    throw CheckpointError(absl::StrCat(step_directory, ": partitioning '", found.manifest->partitioning(),
                                       "' keeps per-rank state without a table of its pieces; it cannot be "
                                       "consolidated into one model"));
  }
  CheckpointReader reader(found, 0);
  c10::impl::GenericDict out{c10::StringType::get(), c10::AnyType::get()};
  try {
    // Split tensors whole, in the manifest's order; then every other value from
    // the first shard that has it (rank 0's step, data position and RNG state).
    for (const checkpoint::ShardedTensor& entry : found.manifest->sharded_tensors()) {
      out.insert(entry.key(), reader.Whole(entry.key(), at::Tensor()));
    }
    for (int r = 0; r < found.world_size; ++r) {
      for (const auto& item : reader.Values(r)) {
        const std::string& key = item.key().toStringRef();
        if (reader.table().count(key) == 0 && out.find(key) == out.end()) out.insert(key, item.value());
      }
      if (found.manifest->sharded_tensors_size() == 0) break;  // replicated: rank 0's shard is the whole state
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const c10::Error& e) {
    throw CheckpointError(absl::StrCat(found.path, ": unexpected content: ", e.what_without_backtrace()));
  }
  const fs::path tmp = fs::path(output_file).parent_path() / (kTmpPrefix + fs::path(output_file).filename().string());
  WriteShard(tmp.string(), out);
  std::error_code ec;
  fs::rename(tmp, output_file, ec);
  if (ec) throw CheckpointError(absl::StrCat("cannot rename '", tmp.string(), "' to '", output_file, "': ", ec.message()));
}

}  // namespace lockstep
