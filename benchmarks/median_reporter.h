// MedianReporter: prints what Google Benchmark's console reporter prints and keeps
// each benchmark's median real time (or its only run's), so that a suite's main()
// can print ratios against a baseline measured in the same run; and the start-up
// and run that the suites' main() functions share.
#ifndef LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_
#define LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

class MedianReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if ((run.run_type == Run::RT_Aggregate && run.aggregate_name == "median") ||
          (run.run_type == Run::RT_Iteration && run.repetitions <= 1)) {
        medians[run.run_name.function_name] = run.GetAdjustedRealTime();
      }
    }
  }
  // Benchmark function name -> median real time, in the benchmark's unit.
  std::map<std::string, double> medians;
};

// Google Benchmark's start-up, with `defaults` (flags such as
// "--benchmark_repetitions=5") placed before the command line's, so that the
// command line wins. False, with the flag reported, when a flag is unknown.
inline bool InitializeBenchmarks(std::vector<char*> args, const std::vector<std::string>& defaults) {
  static std::vector<std::string> kept;  // the flag library may keep pointers into argv
  kept = defaults;
  std::vector<char*> flags;
  for (std::string& flag : kept) flags.push_back(flag.data());
  args.insert(args.begin() + (args.empty() ? 0 : 1), flags.begin(), flags.end());
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  return !benchmark::ReportUnrecognizedArguments(count, args.data());
}

// Runs the selected benchmarks, printing as the console reporter does, and returns
// each one's median real time by function name.
inline std::map<std::string, double> RunBenchmarksForMedians() {
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return std::move(reporter.medians);
}

// Prints "<label> (median of repetitions): <ratio>" for two benchmarks of
// `medians`, numerator over denominator, when both ran.
inline void PrintMedianRatio(const std::map<std::string, double>& medians, const std::string& numerator,
                             const std::string& denominator, const std::string& label) {
  if (medians.count(numerator) == 0 || medians.count(denominator) == 0) return;
  std::printf("%s (median of repetitions): %.4f\n", label.c_str(), medians.at(numerator) / medians.at(denominator));
}

}  // namespace lockstep

#endif  // LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_
