// Checksums and hashes that must give the same value in every process, on every
// run and on every host: CRC32C for checkpoint shards and TensorBoard records,
// and a 64-bit FNV-1a hash for fingerprints that ranks compare (model shapes,
// configs, metric names).
//
// Stateless functions; thread-safe.
#ifndef LOCKSTEP_HASHING_H_
#define LOCKSTEP_HASHING_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace lockstep {

// CRC32C (Castagnoli) of `size` bytes. Uses the SSE4.2 crc32 instruction where the
// CPU has it, a table otherwise; both give the same value.
uint32_t Crc32c(const void* data, size_t size);
// The CRC32C of (the bytes whose CRC32C is `crc`) followed by these bytes:
// Crc32cExtend(Crc32c(a), b) == Crc32c(a + b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// A 64-bit FNV-1a hash, stable across processes and runs (unlike std::hash).
uint64_t StableHash(const std::string& text, uint64_t seed = 14695981039346656037ULL);

}  // namespace lockstep

#endif  // LOCKSTEP_HASHING_H_
