#include "lockstep/summary_writers.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "lockstep/errors.h"
#include "lockstep/host.h"
#include "lockstep/json.h"
#include "proto/tensorboard.pb.h"

namespace lockstep {
namespace {

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::FILE* OpenOrThrow(const std::string& path, const char* mode) {
  std::FILE* file = std::fopen(path.c_str(), mode);
  if (file == nullptr) throw Error("cannot open '" + path + "' for writing: " + std::strerror(errno));
  return file;
}

void AppendLittleEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

}  // namespace

uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  path_ = absl::StrCat(dir, "/events.out.tfevents.", static_cast<int64_t>(WallSeconds()), ".", HostName(), ".",
                       getpid());
  file_ = OpenOrThrow(path_, "wb");
  tensorboard::Event version;
  version.set_wall_time(WallSeconds());
  version.set_file_version("brain.Event:2");
  WriteRecord(version.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::WriteRecord(const std::string& payload) {
  std::string header;
  AppendLittleEndian(&header, payload.size(), 8);
  std::string record = header;
  AppendLittleEndian(&record, MaskCrc32c(Crc32c(header.data(), header.size())), 4);
  record += payload;
  AppendLittleEndian(&record, MaskCrc32c(Crc32c(payload.data(), payload.size())), 4);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0) {
    throw Error("cannot write '" + path_ + "': " + std::strerror(errno));
  }
}

void TensorBoardWriter::operator()(const Summary& summary) {
  tensorboard::Event event;
  event.set_wall_time(WallSeconds());
  event.set_step(summary.step);
  for (const auto& [name, value] : summary.metrics) {
    tensorboard::SummaryValue* v = event.mutable_summary()->add_value();
    v->set_tag(summary.task + "/" + name);
    v->set_simple_value(static_cast<float>(value));
  }
  WriteRecord(event.SerializeAsString());
}

JsonlWriter::JsonlWriter(const std::string& dir) : file_(OpenOrThrow(dir + "/metrics.jsonl", "a")) {}

JsonlWriter::~JsonlWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonlWriter::operator()(const Summary& summary) {
  std::string line = absl::StrCat("{\"step\": ", summary.step, ", \"task\": ", JsonQuote(summary.task));
  for (const auto& [name, value] : summary.metrics) {
    char number[32];
    if (std::isfinite(value)) {
      std::snprintf(number, sizeof(number), "%.17g", value);
    } else {
      std::snprintf(number, sizeof(number), "null");
    }
    absl::StrAppend(&line, ", ", JsonQuote(name), ": ", number);
  }
  line += "}\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw Error(std::string("cannot write metrics.jsonl: ") + std::strerror(errno));
  }
}

AsyncSummaryWriter::AsyncSummaryWriter(std::vector<SummarySink> sinks)
    : sinks_(std::move(sinks)), thread_([this] { Loop(); }) {}

AsyncSummaryWriter::~AsyncSummaryWriter() {
  try {
    Close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lockstep: summary writer: %s\n", e.what());
  }
}

void AsyncSummaryWriter::Write(const Summary& summary) {
  absl::MutexLock lock(&mu_);
  if (closing_) throw Error("AsyncSummaryWriter: Write after Close");
  queue_.push_back(summary);
}

void AsyncSummaryWriter::Close() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void AsyncSummaryWriter::Loop() {
  while (true) {
    Summary summary;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](AsyncSummaryWriter* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->closing_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // closing, and everything is written
      summary = std::move(queue_.front());
      queue_.pop_front();
      if (error_) continue;  // after a failure, drop the rest
    }
    try {
      for (const SummarySink& sink : sinks_) sink(summary);
    } catch (...) {
      absl::MutexLock lock(&mu_);
      error_ = std::current_exception();
    }
  }
}

}  // namespace lockstep
