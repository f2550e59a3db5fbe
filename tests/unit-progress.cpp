// The command-line tool's progress display (cli/progress.hpp) on a fake clock: redraws at most 10
// times a second on a terminal, rate and time left, plain lines when stderr is not a terminal,
// nothing when it is off.
#include <doctest/doctest.h>

#include <statedict/exec/options.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../cli/progress.hpp"

namespace {

using statedict::progress_event;
using statedict::progress_phase;

constexpr std::uint64_t MB = 1000 * 1000;

/// A renderer writing into `out`, its clock `t` (seconds).
struct screen {
  std::string out;
  double t = 0;
  cli::progress_renderer r;
  explicit screen(cli::progress_mode mode, std::size_t width = 80)
      : r({mode, width, "copying"}, [this](std::string_view s) { out += s; }, [this] { return t; }) {}
  void at(double when, progress_phase p, std::uint64_t done = 0, std::uint64_t total = 0, std::string_view file = {}) {
    t = when;
    r.update(progress_event{p, done, total, file});
  }
  /// The terminal's lines as drawn, one per "\r".
  [[nodiscard]] std::vector<std::string> redraws() const {
    std::vector<std::string> v;
    std::size_t at = 0;
    while ((at = out.find('\r', at)) != std::string::npos) {
      const std::size_t end = out.find('\r', at + 1);
      v.push_back(out.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1));
      at = at + 1;
    }
    return v;
  }
};

}  // namespace

TEST_CASE("sizes, durations and the time left") {
  CHECK(cli::human_bytes(0) == "0 B");
  CHECK(cli::human_bytes(999) == "999 B");
  CHECK(cli::human_bytes(1000) == "1.00 kB");
  CHECK(cli::human_bytes(1234567) == "1.23 MB");
  CHECK(cli::human_bytes(12.34e6) == "12.3 MB");
  CHECK(cli::human_bytes(850e6) == "850 MB");
  CHECK(cli::human_bytes(3.0e9) == "3.00 GB");
  CHECK(cli::human_bytes(999.9e6) == "1.00 GB");
  CHECK(cli::human_duration(0) == "0:00");
  CHECK(cli::human_duration(6.2) == "0:07");  // rounded up: never "0:00" while bytes are left
  CHECK(cli::human_duration(59) == "0:59");
  CHECK(cli::human_duration(754) == "12:34");
  CHECK(cli::human_duration(3725) == "1:02:05");
  CHECK(cli::eta_seconds(250, 1000, 50).value() == doctest::Approx(15));
  CHECK(cli::eta_seconds(1000, 1000, 50).value() == 0);
  CHECK_FALSE(cli::eta_seconds(0, 1000, 0).has_value());
}

TEST_CASE("terminal: the rate is the average since the copy started; the time left follows from it") {
  screen s(cli::progress_mode::terminal);
  s.at(0, progress_phase::copying, 0, 1000 * MB, "model.safetensors");
  s.at(0.1, progress_phase::copying, 10 * MB, 1000 * MB, "model.safetensors");  // too early for a rate
  s.at(2, progress_phase::copying, 250 * MB, 1000 * MB, "model.safetensors");
  const auto d = s.redraws();
  REQUIRE(d.size() == 3);
  CHECK(d[0].find("copying    0%  0 B of 1.00 GB  model.safetensors") != std::string::npos);
  CHECK(d[1].find("MB/s") == std::string::npos);
  // 250 MB in 2 s: 125 MB/s, 750 MB left: 6 s.
  CHECK(d[2].find("copying   25%  250 MB of 1.00 GB  125 MB/s  ETA 0:06  model.safetensors") != std::string::npos);
  // A second run of the executor (a writer with one plan per file) starts its own average.
  s.at(3, progress_phase::copying, 1 * MB, 100 * MB, "b.safetensors");
  s.at(4, progress_phase::copying, 51 * MB, 100 * MB, "b.safetensors");
  CHECK(s.redraws().back().find("51.0 MB of 100 MB  50.0 MB/s  ETA 0:01  b.safetensors") != std::string::npos);
}

TEST_CASE("terminal: at most 10 redraws a second, and a state not drawn is drawn by the next tick") {
  screen s(cli::progress_mode::terminal);
  // A report every millisecond for 3 s (the executor's pace on a fast copy).
  const std::uint64_t total = 3000 * MB;
  for (int i = 0; i <= 3000; ++i)
    s.at(i / 1000.0, progress_phase::copying, static_cast<std::uint64_t>(i) * MB, total, "out.safetensors");
  const auto n = s.r.draws();
  CHECK(n >= 28);
  CHECK(n <= 31);
  CHECK(s.redraws().size() == n);
  // Reports closer than 0.1 s after a redraw wait for the ticker.
  screen q(cli::progress_mode::terminal);
  q.at(0, progress_phase::reading, 0, 0, "in.pt");
  q.at(0.01, progress_phase::planning);
  CHECK(q.r.draws() == 1);
  q.t = 0.05;
  q.r.tick();
  CHECK(q.r.draws() == 1);
  q.t = 0.11;
  q.r.tick();
  CHECK(q.r.draws() == 2);
  CHECK(q.redraws().back().find("planning") != std::string::npos);
  // A tick with nothing new does not redraw; one that changes the time shown does.
  q.t = 0.5;
  q.r.tick();
  CHECK(q.r.draws() == 2);
  q.t = 1.2;
  q.r.tick();
  CHECK(q.r.draws() == 3);
  CHECK(q.redraws().back().find("planning  0:01") != std::string::npos);  // whole seconds so far
}

TEST_CASE("terminal: a shorter line covers the longer one before it; clear() and message() erase it") {
  screen s(cli::progress_mode::terminal);
  s.at(0, progress_phase::reading, 0, 0, "a/rather/long/path/to/the/input/checkpoint.pt");
  s.at(1, progress_phase::planning);
  const auto d = s.redraws();
  REQUIRE(d.size() == 2);
  CHECK(d[1].size() == d[0].size());  // padded with spaces
  CHECK(d[1].find_last_not_of(' ') < d[0].size() / 2);
  s.out.clear();
  s.r.message("statedict: a note\n");
  CHECK(s.out == "\r" + std::string(std::string("  planning").size(), ' ') + "\rstatedict: a note\n");
  s.at(2, progress_phase::syncing, 1, 1, "x.pt");
  s.out.clear();
  s.r.clear();
  CHECK(s.out.size() > 2);
  CHECK(s.out.front() == '\r');
  CHECK(s.out.back() == '\r');
  CHECK(s.out.find_first_not_of(" \r") == std::string::npos);
  s.out.clear();
  s.r.clear();  // nothing shown: nothing to erase
  CHECK(s.out.empty());
}

TEST_CASE("terminal: the file name is shortened from the left to fit the width") {
  screen s(cli::progress_mode::terminal, 60);
  const std::string name = "model-00001-of-00042-with-a-very-long-name-indeed.safetensors";
  s.at(0, progress_phase::copying, 5 * MB, 10 * MB, name);
  const auto d = s.redraws();
  REQUIRE(d.size() == 1);
  CHECK(d[0].size() <= 59);
  CHECK(d[0].find("...") != std::string::npos);
  CHECK(d[0].find("indeed.safetensors") != std::string::npos);
}

TEST_CASE("lines: the copy and the sync announce themselves, then a line every 5 s; no carriage returns") {
  screen s(cli::progress_mode::lines);
  s.at(0, progress_phase::reading, 0, 0, "in.pt");
  s.at(0.5, progress_phase::planning);
  CHECK(s.out.empty());  // a failing command's error stays the one line on stderr
  s.at(1, progress_phase::copying, 0, 1000 * MB, "out.safetensors");
  CHECK(s.out == "statedict: copying    0%  0 B of 1.00 GB  out.safetensors\n");
  for (int i = 1; i <= 12; ++i) {
    s.at(1 + i * 0.5, progress_phase::copying, static_cast<std::uint64_t>(i) * 50 * MB, 1000 * MB, "out.safetensors");
    s.r.tick();
  }
  // The second line 5 s after the first: 500 MB in 5 s, 100 MB/s, 500 MB left: 5 s.
  const auto count = std::count(s.out.begin(), s.out.end(), '\n');
  CHECK(count == 2);
  CHECK(s.out.find("statedict: copying   50%  500 MB of 1.00 GB  100 MB/s  ETA 0:05  out.safetensors\n") != std::string::npos);
  s.at(8, progress_phase::syncing, 1000 * MB, 1000 * MB, "out.safetensors");
  CHECK(s.out.substr(s.out.rfind('\n', s.out.size() - 2) + 1) == "statedict: syncing  0:00  out.safetensors\n");
  CHECK(s.out.find('\r') == std::string::npos);
  s.r.clear();  // lines need no erasing
  CHECK(s.out.find('\r') == std::string::npos);
}

TEST_CASE("lines: a long reading or planning phase gets a line every 5 s") {
  screen s(cli::progress_mode::lines);
  s.at(0, progress_phase::reading, 0, 0, "ckpt/");
  s.t = 4.9;
  s.r.tick();
  CHECK(s.out.empty());
  s.t = 5.0;
  s.r.tick();
  CHECK(s.out == "statedict: reading metadata  0:05  ckpt/\n");
  s.t = 7;
  s.r.tick();
  CHECK(std::count(s.out.begin(), s.out.end(), '\n') == 1);
}

TEST_CASE("off: nothing is written but messages") {
  screen s(cli::progress_mode::off);
  s.at(0, progress_phase::reading, 0, 0, "in.pt");
  s.at(1, progress_phase::copying, 5, 10, "out.pt");
  s.t = 10;
  s.r.tick();
  s.r.clear();
  CHECK(s.out.empty());
  CHECK(s.r.draws() == 0);
  s.r.message("statedict: a note\n");
  CHECK(s.out == "statedict: a note\n");
}
