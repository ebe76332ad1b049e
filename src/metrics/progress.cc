#include "lockstep/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lockstep/errors.h"

namespace lockstep {

bool IsTerminal(std::FILE* stream) { return isatty(fileno(stream)) == 1; }

ProgressBar::ProgressBar(int64_t total_steps, std::FILE* stream)
    : total_steps_(std::max<int64_t>(total_steps, 1)), stream_(stream) {}

std::string ProgressBar::Line(int64_t step, double seconds, const MetricMap& metrics) const {
  constexpr int kWidth = 30;
  const double fraction = std::clamp(static_cast<double>(step) / total_steps_, 0.0, 1.0);
  const int filled = static_cast<int>(fraction * kWidth);
  std::string line = "[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "] ";
  absl::StrAppendFormat(&line, "step %d/%d", step, total_steps_);
  const int64_t done = step - std::max<int64_t>(first_step_, 0);
  if (done > 0 && step < total_steps_) {
    const int64_t eta = static_cast<int64_t>(seconds / done * (total_steps_ - step));
    absl::StrAppendFormat(&line, " ETA %d:%02d", eta / 60, eta % 60);
  }
  if (auto it = metrics.find(kLoss); it != metrics.end()) absl::StrAppendFormat(&line, " loss %.4f", it->second);
  if (auto it = metrics.find(kAccuracy); it != metrics.end()) absl::StrAppendFormat(&line, " acc %.4f", it->second);
  return line;
}

void ProgressBar::operator()(const Summary& summary) {
  absl::MutexLock lock(&mu_);
  if (summary.task != "train") {
    if (line_open_) std::fputc('\n', stream_);
    line_open_ = false;
    for (const std::string& line : FormatSummary(summary)) std::fprintf(stream_, "%s\n", line.c_str());
    std::fflush(stream_);
    return;
  }
  last_metrics_ = summary.metrics;
  if (summary.step >= last_step_) Draw(summary.step, summary.metrics);
}

void ProgressBar::Step(int64_t step) {
  const auto now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  if (now - last_draw_ < min_interval && step < total_steps_) return;
  Draw(step, last_metrics_);
}

void ProgressBar::Draw(int64_t step, const MetricMap& metrics) {
  if (first_step_ < 0) first_step_ = 0;
  last_step_ = step;
  last_draw_ = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(last_draw_ - start_).count();
  std::fprintf(stream_, "\r%s\x1b[K", Line(step, seconds, metrics).c_str());
  std::fflush(stream_);
  line_open_ = true;
}

void ProgressBar::Finish() {
  absl::MutexLock lock(&mu_);
  if (line_open_) std::fputc('\n', stream_);
  line_open_ = false;
  std::fflush(stream_);
}

void CurvePlotter::operator()(const Summary& summary) {
  for (const auto& [metric, value] : summary.metrics) {
    if (std::isfinite(value)) curves_[metric][summary.task].emplace_back(summary.step, value);
  }
}

namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"};

std::string Svg(const std::string& title, const std::map<std::string, std::vector<std::pair<int64_t, double>>>& series) {
  constexpr double kW = 640, kH = 400, kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;
  int64_t x_min = INT64_MAX, x_max = INT64_MIN;
  double y_min = INFINITY, y_max = -INFINITY;
  for (const auto& [task, points] : series) {
    for (const auto& [x, y] : points) {
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  }
  if (x_max == x_min) x_max = x_min + 1;
  if (y_max == y_min) y_max = y_min + 1;
  auto px = [&](int64_t x) { return kLeft + (kW - kLeft - kRight) * (x - x_min) / double(x_max - x_min); };
  auto py = [&](double y) { return kH - kBottom - (kH - kTop - kBottom) * (y - y_min) / (y_max - y_min); };
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"24\" font-size=\"16\">%s</text>\n",
      int(kW), int(kH), kLeft, title);
  // Axes with min / max labels.
  absl::StrAppendFormat(&svg, "<path d=\"M%g %g V%g H%g\" stroke=\"black\" fill=\"none\"/>\n", kLeft, kTop,
                        kH - kBottom, kW - kRight);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.4g</text>\n", kLeft - 6, py(y_max) + 4,
                        y_max);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.4g</text>\n", kLeft - 6, py(y_min) + 4,
                        y_min);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\">%d</text>\n", kLeft, kH - kBottom + 18, x_min);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%d</text>\n", kW - kRight,
                        kH - kBottom + 18, x_max);
  absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">step</text>\n", (kW + kLeft) / 2,
                        kH - 12);
  int color = 0;
  for (const auto& [task, points] : series) {
    const char* c = kColors[color % 5];
    std::string path;
    for (const auto& [x, y] : points) absl::StrAppendFormat(&path, "%s%.1f %.1f", path.empty() ? "M" : " L", px(x), py(y));
    absl::StrAppendFormat(&svg, "<path d=\"%s\" stroke=\"%s\" stroke-width=\"2\" fill=\"none\"/>\n", path, c);
    absl::StrAppendFormat(&svg, "<text x=\"%g\" y=\"%d\" fill=\"%s\">%s</text>\n", kW - kRight - 120,
                          int(kTop + 16 * (color + 1)), c, task);
    ++color;
  }
  return svg + "</svg>\n";
}

}  // namespace

std::vector<std::string> CurvePlotter::WritePlots(const std::string& dir) const {
  std::vector<std::string> written;
  for (const char* metric : {kLoss, kAccuracy, kLearningRate, kExamplesPerSecond}) {
    const auto it = curves_.find(metric);
    if (it == curves_.end()) continue;
    const std::string path = absl::StrCat(dir, "/", metric, ".svg");
    std::FILE* file = std::fopen(path.c_str(), "w");
    if (file == nullptr) throw Error("cannot write plot '" + path + "': " + std::strerror(errno));
    const std::string svg = Svg(metric, it->second);
    const bool ok = std::fwrite(svg.data(), 1, svg.size(), file) == svg.size();
    std::fclose(file);
    if (!ok) throw Error("cannot write plot '" + path + "'");
    written.push_back(path);
  }
  return written;
}

}  // namespace lockstep
