#include "lockstep/hashing.h"

#include <array>
#include <cstring>

namespace lockstep {
namespace {

// Neither zlib (CRC-32, another polynomial) nor this abseil has CRC32C, and Debian
// ships no C++ library for it: a table-driven implementation of the reflected
// Castagnoli polynomial, and the SSE4.2 instruction where the CPU has it.
constexpr uint32_t kCastagnoli = 0x82F63B78u;

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kCastagnoli : 0u);
    table[i] = crc;
  }
  return table;
}

// Both take and return the CRC register (not inverted).
uint32_t Crc32cTable(uint32_t crc, const uint8_t* bytes, size_t size) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < size; ++i) crc = (crc >> 8) ^ table[(crc ^ bytes[i]) & 0xFFu];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(uint32_t crc, const uint8_t* bytes, size_t size) {
  uint64_t wide = crc;
  for (; size >= 8; size -= 8, bytes += 8) {
    uint64_t word;
    std::memcpy(&word, bytes, 8);
    wide = __builtin_ia32_crc32di(wide, word);
  }
  crc = static_cast<uint32_t>(wide);
  for (; size > 0; --size, ++bytes) crc = __builtin_ia32_crc32qi(crc, *bytes);
  return crc;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  uint32_t reg = crc ^ 0xFFFFFFFFu;
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  reg = sse42 ? Crc32cSse42(reg, bytes, size) : Crc32cTable(reg, bytes, size);
#else
  reg = Crc32cTable(reg, bytes, size);
#endif
  return reg ^ 0xFFFFFFFFu;
}

uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }

uint64_t StableHash(const std::string& text, uint64_t seed) {
  uint64_t hash = seed;
  for (const unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

}  // namespace lockstep
