// IDX files: a 4-byte magic (0, 0, type code, number of dimensions), one
// big-endian uint32 per dimension, then the values in row-major order.
#include <ATen/ATen.h>
#include <zlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "lockstep/data.h"
#include "lockstep/errors.h"

namespace lockstep {
namespace {

struct GzFileCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzFileCloser>;

// Reads the whole file; gzread passes uncompressed files through unchanged.
std::vector<uint8_t> ReadAll(const std::string& path) {
  GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) throw DataError("cannot open IDX file '" + path + "': " + std::strerror(errno));
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> chunk(1 << 20);
  while (true) {
    const int n = gzread(file.get(), chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int code = 0;
      const char* message = gzerror(file.get(), &code);
      throw DataError("cannot read IDX file '" + path + "': " + message);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + n);
  }
  return bytes;
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

struct IdxType {
  at::ScalarType dtype;
  size_t bytes;
};

IdxType TypeOf(uint8_t code, const std::string& path) {
  switch (code) {
    case 0x08: return {at::kByte, 1};
    case 0x09: return {at::kChar, 1};
    case 0x0B: return {at::kShort, 2};
    case 0x0C: return {at::kInt, 4};
    case 0x0D: return {at::kFloat, 4};
    case 0x0E: return {at::kDouble, 8};
  }
  throw DataError("IDX file '" + path + "' has unknown type code " + std::to_string(code));
}

}  // namespace

at::Tensor ReadIdxFile(const std::string& path) {
  const std::vector<uint8_t> bytes = ReadAll(path);
  if (bytes.size() < 4 || bytes[0] != 0 || bytes[1] != 0) {
    throw DataError("'" + path + "' is not an IDX file (bad magic number)");
  }
  const IdxType type = TypeOf(bytes[2], path);
  const size_t rank = bytes[3];
  if (rank == 0 || bytes.size() < 4 + 4 * rank) {
    throw DataError("IDX file '" + path + "' has a truncated or empty header");
  }
  std::vector<int64_t> shape(rank);
  const size_t offset = 4 + 4 * rank;
  // The values the header promises, counted so that no product overflows: a header
  // that promises more than the file holds is refused before anything is allocated.
  const size_t payload = bytes.size() - offset;
  size_t count = 1;
  bool too_many = false;
  for (size_t d = 0; d < rank; ++d) {
    shape[d] = BigEndian32(&bytes[4 + 4 * d]);
    size_t next = 0;
    too_many = too_many || __builtin_mul_overflow(count, static_cast<size_t>(shape[d]), &next);
    count = next;
  }
  size_t value_bytes = 0;
  too_many = too_many || __builtin_mul_overflow(count, type.bytes, &value_bytes);
  if (too_many || value_bytes != payload) {
    std::string dims;
    for (size_t d = 0; d < rank; ++d) dims += (d ? "x" : "") + std::to_string(shape[d]);
    throw DataError("IDX file '" + path + "' holds " + std::to_string(payload) +
                    " bytes of values but its header says " + dims + " values of " + std::to_string(type.bytes) +
                    " bytes");
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type.dtype));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const uint8_t* src = bytes.data() + offset;
  if (count == 0) {
    // No values: an empty tensor has no storage to copy into.
  } else if (type.bytes == 1) {
    std::memcpy(dst, src, count);
  } else {  // big-endian on disk
    for (size_t i = 0; i < count; ++i) {
      for (size_t b = 0; b < type.bytes; ++b) dst[i * type.bytes + b] = src[i * type.bytes + type.bytes - 1 - b];
    }
  }
  return out;
}

}  // namespace lockstep
