#include "lockstep/metrics.h"

#include <algorithm>
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

const char* ReductionName(MetricReduction r) {
  switch (r) {
    case MetricReduction::kWeightedMean: return "weighted_mean";
    case MetricReduction::kMean: return "mean";
    case MetricReduction::kSum: return "sum";
    case MetricReduction::kMax: return "max";
    case MetricReduction::kLast: return "last";
  }
  return "?";
}

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

MetricReduction DefaultReduction(const std::string& name) {
  if (name == kLoss || name == kAccuracy) return MetricReduction::kWeightedMean;
  if (name == kNumExamples) return MetricReduction::kSum;
  if (name == kLearningRate || name == kGradientsL2Norm || name == kWeightsL2Norm) return MetricReduction::kLast;
  if (name.rfind("weights/", 0) == 0 &&
      (EndsWith(name, "/rms") || EndsWith(name, "/max") || EndsWith(name, "/update_ratio"))) {
    return MetricReduction::kLast;
  }
  return MetricReduction::kMean;
}

MetricReduction MetricsAccumulator::reduction(const std::string& name) const {
  const auto it = reductions_.find(name);
  return it == reductions_.end() ? DefaultReduction(name) : it->second;
}

MetricsAccumulator::Entry& MetricsAccumulator::EntryFor(const std::string& name) {
  auto [it, inserted] = entries_.try_emplace(name);
  if (inserted) it->second.reduction = reduction(name);
  return it->second;
}

void MetricsAccumulator::Add(const MetricMap& m) {
  ++steps_;
  const auto it = m.find(kNumExamples);
  const double examples = it == m.end() ? 1.0 : it->second;
  for (const auto& [name, value] : m) {
    Entry& e = EntryFor(name);
    switch (e.reduction) {
      case MetricReduction::kWeightedMean:
        e.value += value * examples;
        e.weight += examples;
        break;
      case MetricReduction::kMean:
      case MetricReduction::kSum:
        e.value += value;
        e.weight += 1;
        break;
      case MetricReduction::kMax:
        e.value = e.weight == 0 ? value : std::max(e.value, value);
        e.weight += 1;
        break;
      case MetricReduction::kLast:
        e.value = value;
        e.weight += 1;
        break;
    }
  }
}

void MetricsAccumulator::AddSums(const std::map<std::string, double>& sums, double weight) {
  ++steps_;
  for (const auto& [name, sum] : sums) {
    Entry& e = entries_[name];
    e.reduction = MetricReduction::kWeightedMean;
    e.value += sum;
    e.weight += weight;
  }
  Entry& examples = EntryFor(kNumExamples);
  examples.value += weight;
  examples.weight += 1;
}

MetricMap MetricsAccumulator::Finalize(const Entries& entries) {
  MetricMap out;
  for (const auto& [name, e] : entries) {
    if (e.reduction == MetricReduction::kWeightedMean || e.reduction == MetricReduction::kMean) {
      out[name] = e.weight > 0 ? e.value / e.weight : 0.0;
    } else {
      out[name] = e.value;
    }
  }
  return out;
}

MetricMap MetricsAccumulator::Flush() {
  MetricMap out = Finalize(entries_);
  Clear();
  return out;
}

void MetricsAccumulator::Clear() {
  steps_ = 0;
  entries_.clear();
}

std::string MetricsAccumulator::SaveState() const {
  std::string out = absl::StrFormat("steps %d\n", steps_);
  for (const auto& [name, e] : entries_) {
    absl::StrAppendFormat(&out, "entry %s %s %a %a\n", name, ReductionName(e.reduction), e.value, e.weight);
  }
  return out;
}

void MetricsAccumulator::RestoreState(const std::string& text) {
  int64_t steps = 0;
  Entries entries;
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
      steps = static_cast<int64_t>(number(f[1]));
    } else if (f.size() == 5 && f[0] == "entry") {
      Entry e;
      bool known = false;
      for (MetricReduction r : {MetricReduction::kWeightedMean, MetricReduction::kMean, MetricReduction::kSum,
                                MetricReduction::kMax, MetricReduction::kLast}) {
        if (f[2] == ReductionName(r)) {
          e.reduction = r;
          known = true;
        }
      }
      if (!known) throw InvalidArgumentError(absl::StrCat("metrics state: unknown reduction in '", line, "'"));
      e.value = number(f[3]);
      e.weight = number(f[4]);
      entries[f[1]] = e;
    } else {
      throw InvalidArgumentError(absl::StrCat("metrics state: unexpected line '", line, "'"));
    }
  }
  steps_ = steps;
  entries_ = std::move(entries);
}

void MetricSums::Merge(const MetricSums& other) {
  for (const auto& [name, sum] : other.sums) sums[name] += sum;
  weight += other.weight;
}

MetricMap MetricSums::Means() const {
  MetricMap means;
  for (const auto& [name, sum] : sums) means[name] = weight > 0 ? sum / weight : 0.0;
  means[kNumExamples] = weight;
  return means;
}

}  // namespace lockstep
