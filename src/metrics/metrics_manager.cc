#include "lockstep/metrics_manager.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "lockstep/agreement.h"
#include "lockstep/errors.h"
#include "lockstep/hashing.h"
#include "lockstep/summary_writers.h"

namespace lockstep {
namespace {

using Entries = MetricsAccumulator::Entries;

// "name\treduction\n" per entry: what every rank must agree on.
std::string Signature(const Entries& entries) {
  std::string out;
  for (const auto& [name, e] : entries) absl::StrAppend(&out, name, "\t", static_cast<int>(e.reduction), "\n");
  return out;
}

// Adds, with no value, the metrics that other ranks have and this one lacks.
void AddMissingNames(Communicator& comm, const CollectiveOptions& options, Entries& entries) {
  for (const std::string& text : AllGatherStrings(comm, Signature(entries), options)) {
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      std::vector<std::string> fields = absl::StrSplit(line, '\t');
      const auto reduction = static_cast<MetricReduction>(std::stoi(fields.at(1)));
      auto [it, inserted] = entries.try_emplace(fields[0]);
      if (inserted) {
        it->second.reduction = reduction;
      } else if (it->second.reduction != reduction) {
        throw Error(absl::StrCat("metrics: ranks combine metric '", fields[0], "' differently (set the same ",
                                 "MetricReduction on every rank)"));
      }
    }
  }
}

}  // namespace

MetricsManager::MetricsManager(Options options) : options_(std::move(options)) {}

void MetricsManager::AddStep(const MetricMap& step_metrics) {
  period_.Add(step_metrics);
  const auto examples = step_metrics.find(kNumExamples);
  timed_examples_ += examples == step_metrics.end() ? 1.0 : examples->second;
  ++timed_steps_;
}

void MetricsManager::AddSums(const MetricSums& sums) {
  period_.AddSums(sums.sums, sums.weight);
  timed_examples_ += sums.weight;
  ++timed_steps_;
}

void MetricsManager::StartTimer() {
  if (!running_since_) running_since_ = std::chrono::steady_clock::now();
}

void MetricsManager::StopTimer() {
  if (!running_since_) return;
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - *running_since_).count();
  running_since_.reset();
}

double MetricsManager::ElapsedSeconds() const {
  double seconds = seconds_;
  if (running_since_) seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - *running_since_).count();
  return seconds;
}

Entries MetricsManager::Combine(Timing& timing) {
  Entries entries = period_.entries();
  timing.seconds = ElapsedSeconds();
  timing.steps = static_cast<double>(timed_steps_);
  timing.examples = timed_examples_;
  Communicator* comm = options_.communicator;
  if (comm == nullptr || comm->world_size() == 1) return entries;
  const CollectiveOptions& options = options_.collective;

  // The same names on every rank? Masked so that negating the hash cannot overflow.
  const int64_t hash = static_cast<int64_t>(StableHash(Signature(entries)) >> 2);
  at::Tensor check = at::tensor({hash, -hash}, at::kLong);
  comm->AllReduce(check, ReduceOp::kMax, options);
  if (check[0].item<int64_t>() != -check[1].item<int64_t>()) AddMissingNames(*comm, options, entries);

  // Sums: value and weight per entry; a kLast entry also rank 0's value and
  // whether rank 0 has it. Maxima: seconds, steps and each kMax entry's value.
  const bool rank0 = comm->rank() == 0;
  std::vector<double> sums = {timing.examples};
  std::vector<double> maxima = {timing.seconds, timing.steps};
  for (const auto& [name, e] : entries) {
    sums.push_back(e.value);
    sums.push_back(e.weight);
    if (e.reduction == MetricReduction::kLast) {
      sums.push_back(rank0 ? e.value : 0.0);
      sums.push_back(rank0 && e.weight > 0 ? 1.0 : 0.0);
    } else if (e.reduction == MetricReduction::kMax) {
      maxima.push_back(e.weight > 0 ? e.value : -std::numeric_limits<double>::infinity());
    }
  }
  at::Tensor sum_tensor = at::from_blob(sums.data(), {static_cast<int64_t>(sums.size())}, at::kDouble).clone();
  at::Tensor max_tensor = at::from_blob(maxima.data(), {static_cast<int64_t>(maxima.size())}, at::kDouble).clone();
  auto sum_work = comm->AllReduceAsync(sum_tensor, ReduceOp::kSum, options);
  auto max_work = comm->AllReduceAsync(max_tensor, ReduceOp::kMax, options);
  sum_work->Wait();
  max_work->Wait();

  const double* s = sum_tensor.data_ptr<double>();
  const double* m = max_tensor.data_ptr<double>();
  timing.examples = *s++;
  timing.seconds = m[0];
  timing.steps = m[1];
  size_t max_at = 2;
  for (auto& [name, e] : entries) {
    const double value_sum = *s++;
    const double weight_sum = *s++;
    e.weight = weight_sum;
    switch (e.reduction) {
      case MetricReduction::kWeightedMean:
      case MetricReduction::kMean:
      case MetricReduction::kSum:
        e.value = value_sum;
        break;
      case MetricReduction::kMax:
        e.value = m[max_at++];
        break;
      case MetricReduction::kLast: {
        const double rank0_value = *s++;
        const double rank0_has = *s++;
        // Rank 0's value; the mean of the others' when rank 0 has none.
        e.value = rank0_has > 0 ? rank0_value : (weight_sum > 0 ? value_sum / weight_sum : 0.0);
        break;
      }
    }
  }
  return entries;
}

Summary MetricsManager::Flush(int64_t step) {
  Timing t;
  Summary summary{options_.task, step, MetricsAccumulator::Finalize(Combine(t))};
  if (t.seconds > 0 && t.steps > 0) {
    summary.metrics[kSecondsPerStep] = t.seconds / t.steps;
    summary.metrics[kStepsPerSecond] = t.steps / t.seconds;
    summary.metrics[kExamplesPerSecond] = t.examples / t.seconds;
  }
  if (options_.derive) options_.derive(summary.task, summary.metrics);
  period_.Clear();
  seconds_ = 0;
  timed_steps_ = 0;
  timed_examples_ = 0;
  if (running_since_) running_since_ = std::chrono::steady_clock::now();
  if (options_.writer) options_.writer->Write(summary);
  return summary;
}

void MetricsManager::Close() {
  if (options_.writer) options_.writer->Close();
}

std::string MetricsManager::SaveState() const { return period_.SaveState(); }

void MetricsManager::RestoreState(const std::string& text) {
  period_.RestoreState(text);
  seconds_ = 0;
  timed_steps_ = 0;
  timed_examples_ = 0;
  if (running_since_) running_since_ = std::chrono::steady_clock::now();
}

}  // namespace lockstep
