#include "lockstep/timeline.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "lockstep/errors.h"
#include "lockstep/json.h"

namespace lockstep {

namespace {

int64_t Microseconds(Timeline::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

}  // namespace

Timeline::Timeline(std::string path, int rank, std::set<int64_t> steps)
    : path_(std::move(path)), rank_(rank), steps_(std::move(steps)) {}

void Timeline::BeginStep(int64_t step) {
  step_ = step;
  recording_ = steps_.count(step) > 0;
  if (recording_) step_start_ = Clock::now();
}

void Timeline::EndStep() {
  if (!recording_) return;
  Add(absl::StrCat("step ", step_), 0, step_start_, Clock::now(), "");
  recording_ = false;
  Write();
}

void Timeline::Add(const std::string& name, int track, Clock::time_point start, Clock::time_point end,
                   const std::string& args_json) {
  if (!recording_) return;
  if (track > max_track_) max_track_ = track;
  const int64_t begin = Microseconds(start);
  spans_.push_back({name, track, begin, std::max<int64_t>(0, Microseconds(end) - begin), args_json});
}

void Timeline::Write() const {
  const std::filesystem::path path(path_);
  std::error_code error;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), error);
  const std::string temporary = path_ + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    out << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << rank_ << ", \"args\": {\"name\": \"rank " << rank_
        << "\"}}";
    for (int track = 0; track <= max_track_; ++track) {
      const std::string name = track == 0 ? "step" : track == 1 ? "training thread" : absl::StrCat("bucket ", track - 2);
      out << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank_ << ", \"tid\": " << track
          << ", \"args\": {\"name\": " << JsonQuote(name) << "}}";
      out << ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": " << rank_ << ", \"tid\": " << track
          << ", \"args\": {\"sort_index\": " << track << "}}";
    }
    for (const Span& s : spans_) {
      out << ",\n{\"name\": " << JsonQuote(s.name) << ", \"ph\": \"X\", \"pid\": " << rank_ << ", \"tid\": " << s.track
          << ", \"ts\": " << s.start_us << ", \"dur\": " << s.duration_us;
      if (!s.args_json.empty()) out << ", \"args\": {" << s.args_json << "}";
      out << "}";
    }
    out << "\n]}\n";
    if (!out.good()) throw Error("timeline: could not write " + temporary);
  }
  std::filesystem::rename(temporary, path_, error);
  if (error) throw Error("timeline: could not write " + path_ + ": " + error.message());
}

}  // namespace lockstep
