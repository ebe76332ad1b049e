#include "lockstep/metrics.h"

#include <cinttypes>
#include <cstdio>

namespace lockstep {
namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool KeepsLast(const std::string& name) {
  return name == kLearningRate || name == kWeightsL2Norm ||
         (name.rfind("weights/", 0) == 0 && (EndsWith(name, "/rms") || EndsWith(name, "/max")));
}
bool WeightedByExamples(const std::string& name) { return name == kLoss || name == kAccuracy; }

}  // namespace

std::vector<std::string> FormatSummary(const Summary& summary) {
  std::vector<std::string> lines;
  for (const auto& [name, value] : summary.metrics) {
    if (name == kNumExamples) continue;
    char line[512];
    std::snprintf(line, sizeof(line), "Step %6" PRId64 ": %s %s | %.8f", summary.step, summary.task.c_str(),
                  name.c_str(), value);
    lines.emplace_back(line);
  }
  return lines;
}

void StdoutLogger::operator()(const Summary& summary) const {
  for (const std::string& line : FormatSummary(summary)) std::fprintf(stream, "%s\n", line.c_str());
  std::fflush(stream);
}

void MetricsAccumulator::Add(const MetricMap& m) {
  ++steps_;
  const auto it = m.find(kNumExamples);
  const double examples = it == m.end() ? 1.0 : it->second;
  examples_ += examples;
  for (const auto& [name, value] : m) {
    if (KeepsLast(name)) {
      last_[name] = value;
    } else if (WeightedByExamples(name)) {
      sums_[name] += value * examples;
    } else {
      sums_[name] += value;
    }
  }
}

MetricMap MetricsAccumulator::Flush() {
  MetricMap out = last_;
  for (const auto& [name, sum] : sums_) {
    if (name == kNumExamples) {
      out[name] = sum;
    } else if (WeightedByExamples(name)) {
      out[name] = examples_ > 0 ? sum / examples_ : 0.0;
    } else {
      out[name] = sum / static_cast<double>(steps_);
    }
  }
  const auto seconds = sums_.find(kSecondsPerStep);
  if (seconds != sums_.end() && seconds->second > 0) {
    out[kExamplesPerSecond] = examples_ / seconds->second;
    out[kStepsPerSecond] = static_cast<double>(steps_) / seconds->second;
  }
  steps_ = 0;
  examples_ = 0;
  sums_.clear();
  last_.clear();
  return out;
}

}  // namespace lockstep
