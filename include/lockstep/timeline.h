// A timeline of chosen train steps: each rank records spans (data wait, forward,
// backward, every gradient bucket's communication, the waits for it, the
// optimizer) and writes them as a Chrome trace, the JSON that chrome://tracing and
// https://ui.perfetto.dev open. Times come from the monotonic clock, which the
// processes of one host share, so the files of a host's ranks line up when they
// are opened together (tools/timeline_svg.py merges and draws them).
//
// Tracks (Chrome's threads) within a rank (Chrome's process): "step" (the whole
// step), "training thread", and one per gradient bucket, whose span runs from its
// launch until the bucketer saw it complete.
//
// Not thread-safe: the training thread records (the bucketer polls its buckets
// there too).
#ifndef LOCKSTEP_TIMELINE_H_
#define LOCKSTEP_TIMELINE_H_

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace lockstep {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // Records the steps in `steps` (state.step after the step, so 1 is the first)
  // and writes `path` (its folder is made) after each of them. `rank` is the
  // Chrome process of the spans.
  Timeline(std::string path, int rank, std::set<int64_t> steps);

  // The step that ends with state.step == `step` begins; recording() says
  // whether it is one of the chosen.
  void BeginStep(int64_t step);
  // Ends it; after a chosen step the file is rewritten with every span so far.
  // Errors: Error when the file cannot be written.
  void EndStep();
  bool recording() const { return recording_; }

  // A span on the training thread (track 1) or on a track of its own.
  void Add(const std::string& name, Clock::time_point start, Clock::time_point end) { Add(name, 1, start, end, ""); }
  // `track` >= 0: 0 the step, 1 the training thread, 2 + b gradient bucket b.
  // `args_json`: "" or the members of a JSON object ("\"bytes\": 4096").
  void Add(const std::string& name, int track, Clock::time_point start, Clock::time_point end,
           const std::string& args_json);

  const std::string& path() const { return path_; }

 private:
  struct Span {
    std::string name;
    int track;
    int64_t start_us;
    int64_t duration_us;
    std::string args_json;
  };
  void Write() const;

  std::string path_;
  int rank_;
  std::set<int64_t> steps_;
  bool recording_ = false;
  int64_t step_ = 0;
  Clock::time_point step_start_;
  int max_track_ = 1;
  std::vector<Span> spans_;
};

// Records the span from its construction to its destruction when `timeline` is
// recording (a null timeline records nothing).
class TimelineSpan {
 public:
  TimelineSpan(Timeline* timeline, const char* name)
      : timeline_(timeline != nullptr && timeline->recording() ? timeline : nullptr), name_(name) {
    if (timeline_ != nullptr) start_ = Timeline::Clock::now();
  }
  ~TimelineSpan() {
    if (timeline_ != nullptr) timeline_->Add(name_, start_, Timeline::Clock::now());
  }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  Timeline* timeline_;
  const char* name_;
  Timeline::Clock::time_point start_;
};

}  // namespace lockstep

#endif  // LOCKSTEP_TIMELINE_H_
