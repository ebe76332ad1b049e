#include "lockstep/metrics.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lockstep/errors.h"

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

std::string MetricsAccumulator::SaveState() const {
  std::string out = absl::StrFormat("steps %d\nexamples %a\n", steps_, examples_);
  for (const auto& [name, value] : sums_) absl::StrAppendFormat(&out, "sum %s %a\n", name, value);
  for (const auto& [name, value] : last_) absl::StrAppendFormat(&out, "last %s %a\n", name, value);
  return out;
}

void MetricsAccumulator::RestoreState(const std::string& text) {
  MetricsAccumulator restored;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    auto number = [&](const std::string& field) {
      char* end = nullptr;
      const double value = std::strtod(field.c_str(), &end);
      if (end == field.c_str() || *end != '\0') {
        throw InvalidArgumentError(absl::StrCat("metrics state: bad number in '", line, "'"));
      }
      return value;
    };
    if (f.size() == 2 && f[0] == "steps") {
      restored.steps_ = static_cast<int64_t>(number(f[1]));
    } else if (f.size() == 2 && f[0] == "examples") {
      restored.examples_ = number(f[1]);
    } else if (f.size() == 3 && f[0] == "sum") {
      restored.sums_[f[1]] = number(f[2]);
    } else if (f.size() == 3 && f[0] == "last") {
      restored.last_[f[1]] = number(f[2]);
    } else {
      throw InvalidArgumentError(absl::StrCat("metrics state: unexpected line '", line, "'"));
    }
  }
  *this = std::move(restored);
}

}  // namespace lockstep
