#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "lockstep/errors.h"
#include "lockstep/json.h"
#include "lockstep/summary_writers.h"
#include "proto/tensorboard.pb.h"
#include "tests/testing/temp_dir.h"

namespace lockstep {
namespace {

using testing::TempDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(Crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 test vector
  // Any split, any alignment: the same as one pass (and odd tails take the byte path).
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(static_cast<char>(i * 7 + 3));
  const uint32_t whole = Crc32c(text.data(), text.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{13}, size_t{999}, size_t{1000}}) {
    EXPECT_EQ(Crc32cExtend(Crc32c(text.data(), cut), text.data() + cut, text.size() - cut), whole) << cut;
  }
}

TEST(TensorBoardWriterTest, WritesChecksummedEventRecords) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter writer(dir.path());
    path = writer.path();
    writer(Summary{"train", 100, {{"loss", 0.5}, {"accuracy", 0.75}}});
    writer(Summary{"test", 100, {{"loss", NAN}}});
  }
  const std::string data = ReadFile(path);
  std::vector<tensorboard::Event> events;
  size_t offset = 0;
  while (offset < data.size()) {
    uint64_t length = 0;
    std::memcpy(&length, data.data() + offset, 8);
    uint32_t length_crc = 0;
    std::memcpy(&length_crc, data.data() + offset + 8, 4);
    EXPECT_EQ(length_crc, MaskCrc32c(Crc32c(data.data() + offset, 8)));
    const std::string payload = data.substr(offset + 12, length);
    uint32_t payload_crc = 0;
    std::memcpy(&payload_crc, data.data() + offset + 12 + length, 4);
    EXPECT_EQ(payload_crc, MaskCrc32c(Crc32c(payload.data(), payload.size())));
    tensorboard::Event event;
    ASSERT_TRUE(event.ParseFromString(payload));
    events.push_back(event);
    offset += 16 + length;
  }
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_EQ(events[1].step(), 100);
  ASSERT_EQ(events[1].summary().value_size(), 2);
  EXPECT_EQ(events[1].summary().value(0).tag(), "train/accuracy");
  EXPECT_EQ(events[1].summary().value(0).simple_value(), 0.75f);
  EXPECT_EQ(events[1].summary().value(1).tag(), "train/loss");
  EXPECT_TRUE(std::isnan(events[2].summary().value(0).simple_value()));
}

TEST(JsonlWriterTest, OneObjectPerSummary) {
  TempDir dir;
  {
    JsonlWriter writer(dir.path());
    writer(Summary{"train", 10, {{"loss", 0.25}, {"weird", INFINITY}}});
    writer(Summary{"te\"st", 20, {{"accuracy", 1.0}}});
  }
  EXPECT_EQ(ReadFile(dir.path() + "/metrics.jsonl"),
            "{\"step\": 10, \"task\": \"train\", \"loss\": 0.25, \"weird\": null}\n"
            "{\"step\": 20, \"task\": \"te\\\"st\", \"accuracy\": 1}\n");
}

TEST(JsonQuoteTest, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(JsonQuote("plain name"), "\"plain name\"");
  EXPECT_EQ(JsonQuote("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonQuote(std::string("tab\tnew\nnul") + '\0'), "\"tab\\u0009new\\u000anul\\u0000\"");
  EXPECT_EQ(JsonQuote("h\xc3\xa9"), "\"h\xc3\xa9\"");  // UTF-8 passes through
}

TEST(WritersTest, UnwritableDirectoryIsAnErrorNamingThePath) {
  EXPECT_THAT([] { TensorBoardWriter("/nonexistent/dir"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("/nonexistent/dir/events.out.tfevents")));
  EXPECT_THAT([] { JsonlWriter("/nonexistent/dir"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("/nonexistent/dir/metrics.jsonl")));
}

TEST(AsyncSummaryWriterTest, WritesInOrderOnItsThreadAndCloseDrains) {
  std::vector<int64_t> steps;
  std::thread::id sink_thread;
  AsyncSummaryWriter writer({[&](const Summary& s) {
    steps.push_back(s.step);
    sink_thread = std::this_thread::get_id();
  }});
  for (int i = 1; i <= 100; ++i) writer.Write(Summary{"train", i, {}});
  writer.Close();
  ASSERT_EQ(steps.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(steps[i], i + 1);
  EXPECT_NE(sink_thread, std::this_thread::get_id());
  EXPECT_THROW(writer.Write(Summary{}), Error);
  writer.Close();  // idempotent
}

TEST(AsyncSummaryWriterTest, CloseRethrowsASinkFailure) {
  AsyncSummaryWriter writer({[](const Summary& s) {
    if (s.step == 2) throw Error("disk full");
  }});
  for (int i = 1; i <= 3; ++i) writer.Write(Summary{"train", i, {}});
  EXPECT_THAT([&] { writer.Close(); }, ::testing::ThrowsMessage<Error>(::testing::HasSubstr("disk full")));
}

}  // namespace
}  // namespace lockstep

#include "lockstep/progress.h"

namespace lockstep {
namespace {

TEST(ProgressBarTest, LineShowsStepEtaLossAndAccuracy) {
  ProgressBar bar(100);
  bar(Summary{"train", 0, {}});  // the first summary starts the clock
  EXPECT_EQ(bar.Line(50, 10.0, {{kLoss, 0.5}, {kAccuracy, 0.8}}),
            "[###############...............] step 50/100 ETA 0:10 loss 0.5000 acc 0.8000");
  EXPECT_EQ(bar.Line(100, 20.0, {{kLoss, 0.25}}), "[##############################] step 100/100 loss 0.2500");
}

TEST(ProgressBarTest, RedrawsTrainLinesAndPrintsEvalLinesBelow) {
  char buffer[4096] = {};
  std::FILE* stream = fmemopen(buffer, sizeof(buffer) - 1, "w");
  {
    ProgressBar bar(20, stream);
    bar(Summary{"train", 10, {{kLoss, 1.0}}});
    bar(Summary{"train", 20, {{kLoss, 0.5}}});
    bar(Summary{"test", 20, {{kAccuracy, 0.9}}});
    bar.Finish();
  }
  std::fclose(stream);
  const std::string out = buffer;
  EXPECT_THAT(out, ::testing::HasSubstr("\r[###############...............] step 10/20"));
  EXPECT_THAT(out, ::testing::HasSubstr("step 20/20 loss 0.5000\x1b[K\nStep     20: test accuracy | 0.90000000\n"));
}

TEST(ProgressBarTest, StepUpdatesRedrawBetweenSummariesAtMostEveryInterval) {
  char buffer[8192] = {};
  std::FILE* stream = fmemopen(buffer, sizeof(buffer) - 1, "w");
  {
    ProgressBar bar(1000, stream);
    bar.min_interval = std::chrono::milliseconds(50);
    bar(Summary{"train", 10, {{kLoss, 1.0}}});
    for (int step = 11; step <= 15; ++step) bar.Step(step);  // within the interval: no redraw
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    bar.Step(16);  // redrawn, with the last summary's loss
    bar(Summary{"train", 12, {{kLoss, 0.7}}});  // a late summary does not move the bar back
    bar.Step(1000);  // the last step is always drawn
    bar.Finish();
  }
  std::fclose(stream);
  const std::string out = buffer;
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("step 11/1000")));
  EXPECT_THAT(out, ::testing::HasSubstr("step 16/1000"));
  EXPECT_THAT(out, ::testing::HasSubstr("loss 1.0000"));
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("step 12/1000")));
  EXPECT_THAT(out, ::testing::HasSubstr("step 1000/1000 loss 0.7000"));
}

TEST(CurvePlotterTest, WritesOneSvgPerMetricWithData) {
  TempDir dir;
  CurvePlotter plotter;
  for (int step = 10; step <= 50; step += 10) {
    plotter(Summary{"train", step, {{kLoss, 1.0 / step}, {kLearningRate, 0.1}}});
    plotter(Summary{"test", step, {{kLoss, 2.0 / step}, {kAccuracy, step / 100.0}}});
  }
  const std::vector<std::string> written = plotter.WritePlots(dir.path());
  EXPECT_EQ(written.size(), 3u);  // loss, accuracy, learning_rate
  const std::string loss = ReadFile(dir.path() + "/loss.svg");
  EXPECT_THAT(loss, ::testing::StartsWith("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_THAT(loss, ::testing::HasSubstr(">train</text>"));
  EXPECT_THAT(loss, ::testing::HasSubstr(">test</text>"));
  EXPECT_EQ(std::count(loss.begin(), loss.end(), 'L'), 8 + 0) << "two polylines of five points";
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/examples_per_second.svg"));
}

}  // namespace
}  // namespace lockstep
