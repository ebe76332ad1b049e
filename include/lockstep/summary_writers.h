// Summary writers: sinks that persist summaries, and the background thread that
// keeps their I/O off the training thread.
//
// TensorBoardWriter writes an events file (events.out.tfevents.<seconds>.<host>.<pid>)
// in TFRecord framing — length, masked CRC32C of the length, payload, masked
// CRC32C of the payload — holding Event protos (proto/tensorboard.proto) with one
// scalar per metric, tagged "<task>/<metric>". JsonlWriter appends one JSON object
// per summary to metrics.jsonl. AsyncSummaryWriter hands summaries to a background
// thread that calls its sinks in order; Close() (or the destructor) drains it.
// Only rank 0 should create writers: in a multi-rank job no other rank writes files.
//
// Writers are not thread-safe by themselves; AsyncSummaryWriter is (Write may be
// called from any thread, the sinks run on its one thread).
#ifndef LOCKSTEP_SUMMARY_WRITERS_H_
#define LOCKSTEP_SUMMARY_WRITERS_H_

#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "lockstep/hashing.h"
#include "lockstep/metrics.h"

namespace lockstep {

// TFRecord's masked form of a CRC32C (lockstep/hashing.h), as its framing stores it.
uint32_t MaskCrc32c(uint32_t crc);

class TensorBoardWriter {
 public:
  // Creates the events file in `dir` (which must exist) and writes the
  // file_version event. Throws Error naming the path when it cannot be created.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event with a scalar per metric (num_examples included). Flushed at once,
  // so that TensorBoard shows it while training goes on.
  void operator()(const Summary& summary);
  const std::string& path() const { return path_; }

 private:
  void WriteRecord(const std::string& payload);
  std::string path_;
  std::FILE* file_ = nullptr;  // Owned.
};

class JsonlWriter {
 public:
  // Appends to `dir`/metrics.jsonl. Throws Error naming the path on failure.
  explicit JsonlWriter(const std::string& dir);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;

  // {"step": 100, "task": "train", "loss": 0.4123, ...}; non-finite values as null.
  void operator()(const Summary& summary);

 private:
  std::FILE* file_ = nullptr;  // Owned.
};

class AsyncSummaryWriter {
 public:
  explicit AsyncSummaryWriter(std::vector<SummarySink> sinks);
  ~AsyncSummaryWriter();  // Close()
  AsyncSummaryWriter(const AsyncSummaryWriter&) = delete;
  AsyncSummaryWriter& operator=(const AsyncSummaryWriter&) = delete;

  // Queues the summary and returns at once.
  void Write(const Summary& summary);
  // Writes everything queued, then stops the thread. Rethrows the first error a
  // sink threw (later summaries are dropped after one). Idempotent.
  void Close();

 private:
  void Loop();

  const std::vector<SummarySink> sinks_;  // Fixed after construction; used by the thread.
  absl::Mutex mu_;
  std::deque<Summary> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::exception_ptr error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_SUMMARY_WRITERS_H_
