// MedianReporter: prints what Google Benchmark's console reporter prints and keeps
// each benchmark's median real time (or its only run's), so that a suite's main()
// can print ratios against a baseline measured in the same run.
#ifndef LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_
#define LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_

#include <benchmark/benchmark.h>

#include <map>
#include <string>
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

}  // namespace lockstep

#endif  // LOCKSTEP_BENCHMARKS_MEDIAN_REPORTER_H_
