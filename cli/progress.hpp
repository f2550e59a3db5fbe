// Progress of the statedict tool on stderr, the way tqdm and pv show it: the phase, percent, bytes,
// rate and time left, and the file being written. On a terminal one line redrawn at most 10 times
// a second; otherwise plain lines, a few per run (docs/cli.md, "Progress"). The library reports
// (statedict::progress_event through exec_options::progress); this file renders.
#pragma once

#include <statedict/exec/options.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace cli {

enum class progress_mode : std::uint8_t {
  off,       ///< nothing (--quiet)
  terminal,  ///< one line, redrawn in place ("\r")
  lines,     ///< newline-terminated lines (stderr is a file or a pipe)
};

/// "512 B", "12.3 kB", "850 MB", "3.00 GB": decimal units, three significant digits.
inline std::string human_bytes(double n) {
  static constexpr const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  std::size_t u = 0;
  while (n >= 999.5 && u + 1 < std::size(units)) {
    n /= 1000;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", n);
  else std::snprintf(buf, sizeof buf, n >= 99.95 ? "%.0f %s" : n >= 9.995 ? "%.1f %s" : "%.2f %s", n, units[u]);
  return buf;
}

/// "0:07", "12:03", "1:02:03" (rounded up to whole seconds).
inline std::string human_duration(double seconds) {
  const auto s = static_cast<std::uint64_t>(std::max(0.0, seconds) + 0.999);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%llu:%02llu:%02llu", static_cast<unsigned long long>(s / 3600),
                  static_cast<unsigned long long>(s / 60 % 60), static_cast<unsigned long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%llu:%02llu", static_cast<unsigned long long>(s / 60), static_cast<unsigned long long>(s % 60));
  return buf;
}

/// Seconds until `total` at `rate` bytes a second from `done`; none without a rate.
inline std::optional<double> eta_seconds(std::uint64_t done, std::uint64_t total, double rate) {
  if (!(rate > 0)) return std::nullopt;
  return done >= total ? 0.0 : static_cast<double>(total - done) / rate;
}

/// Renders progress events as a terminal line or as plain lines. Thread-safe: the executor's
/// workers call update() (one at a time) while a ticker calls tick(). The rate is the average
/// since the copy started (the copy of one run: it restarts when a writer runs the executor
/// again), which keeps the time left steady while direct I/O and writeback make the
/// instantaneous rate jump.
class progress_renderer {
 public:
  /// Terminal: at most this many seconds between two redraws (10 a second).
  static constexpr double redraw_interval = 0.1;
  /// Lines: a line at least this many seconds after the previous one, when something changed.
  static constexpr double line_interval = 5.0;
  /// The rate is shown once the copy has run this long.
  static constexpr double rate_after = 0.25;

  struct settings {
    progress_mode mode = progress_mode::off;
    std::size_t width = 80;              ///< terminal columns
    std::string copying = "copying";     ///< what the copy phase is called ("hashing")
  };

  /// `write` gets what goes to the screen; `now` is a monotonic clock in seconds.
  progress_renderer(settings s, std::function<void(std::string_view)> write, std::function<double()> now)
      : s_(std::move(s)), write_(std::move(write)), now_(std::move(now)) {}

  [[nodiscard]] progress_mode mode() const noexcept { return s_.mode; }

  /// Records an event; draws it if a draw is due.
  void update(const statedict::progress_event& e) {
    if (s_.mode == progress_mode::off) return;
    std::lock_guard<std::mutex> lock(m_);
    const double t = now_();
    const bool new_phase = !seen_ || e.phase != state_.phase;
    if (e.phase == statedict::progress_phase::copying && (new_phase || e.done < state_.done)) {
      copy_start_ = t;  // a new copy (one per run of the executor)
      copy_start_done_ = e.done;
    }
    if (new_phase) phase_start_ = t;
    if (!seen_) last_draw_ = t;  // lines: the first one line_interval after the start at the latest
    state_.phase = e.phase;
    state_.done = e.done;
    state_.total = e.total;
    file_.assign(e.file.data(), e.file.size());
    seen_ = true;
    // Lines: the copy and the sync announce themselves (reading and planning, which most failing
    // commands do not pass, only after line_interval: an error stays the one line on stderr).
    const bool announce = s_.mode == progress_mode::lines && new_phase &&
                          (e.phase == statedict::progress_phase::copying || e.phase == statedict::progress_phase::syncing);
    draw_if_due(t, announce);
  }

  /// Draws the last state if a draw is due (call every redraw_interval: a state that was not drawn
  /// when it came, because the last draw was too recent, is drawn then).
  void tick() {
    if (s_.mode == progress_mode::off) return;
    std::lock_guard<std::mutex> lock(m_);
    draw_if_due(now_(), false);
  }

  /// Erases the terminal line (at the end, before the command's summary or error).
  void clear() {
    std::lock_guard<std::mutex> lock(m_);
    erase();
  }

  /// Writes `text` (whole lines) in any mode, the terminal line erased first (the next tick
  /// draws it again below).
  void message(std::string_view text) {
    std::lock_guard<std::mutex> lock(m_);
    erase();
    write_(text);
  }

  /// Times the screen was written to (terminal redraws, or lines).
  [[nodiscard]] std::size_t draws() const {
    std::lock_guard<std::mutex> lock(m_);
    return draws_;
  }

 private:
  /// The state as one line of text (no "\r", no newline), at most `width` characters when the
  /// width allows (the file name is shortened from the left).
  [[nodiscard]] std::string describe(double t, std::size_t width) const {
    using statedict::progress_phase;
    std::string text;
    switch (state_.phase) {
      case progress_phase::reading: text = "reading metadata"; break;
      case progress_phase::planning: text = "planning"; break;
      case progress_phase::copying: text = s_.copying; break;
      case progress_phase::syncing: text = "syncing"; break;
    }
    if (state_.phase == progress_phase::copying) {
      const double pct = state_.total ? 100.0 * static_cast<double>(state_.done) / static_cast<double>(state_.total) : 100.0;
      char buf[16];
      std::snprintf(buf, sizeof buf, "%3.0f%%", std::min(pct, 100.0));
      text += "  " + std::string(buf) + "  " + human_bytes(static_cast<double>(state_.done)) + " of " +
              human_bytes(static_cast<double>(state_.total));
      if (const auto r = rate(t)) {
        text += "  " + human_bytes(*r) + "/s";
        if (const auto eta = eta_seconds(state_.done, state_.total, *r)) text += "  ETA " + human_duration(*eta);
      }
    } else if (s_.mode == progress_mode::lines || t - phase_start_ >= 1.0) {
      text += "  " + human_duration(std::floor(t - phase_start_));  // how long this phase has taken so far
    }
    if (!file_.empty()) {
      std::string f = file_;
      const std::size_t room = width > text.size() + 2 ? width - text.size() - 2 : 0;
      if (f.size() > room && room >= 8) f = "..." + f.substr(f.size() - (room - 3));
      text += "  " + f;
    }
    return text;
  }

  /// Bytes a second since the copy started; none before rate_after seconds of it.
  [[nodiscard]] std::optional<double> rate(double t) const {
    if (state_.phase != statedict::progress_phase::copying) return std::nullopt;
    const double dt = t - copy_start_;
    if (dt < rate_after || state_.done <= copy_start_done_) return std::nullopt;
    return static_cast<double>(state_.done - copy_start_done_) / dt;
  }

  void erase() {
    if (s_.mode == progress_mode::terminal && shown_ > 0) write_("\r" + std::string(shown_, ' ') + "\r");
    shown_ = 0;
    last_text_.clear();
  }

  void draw_if_due(double t, bool force) {
    if (!seen_) return;
    if (s_.mode == progress_mode::terminal) {
      if (draws_ > 0 && t - last_draw_ < redraw_interval) return;
      // One column less than the terminal: a full line would wrap on some terminals.
      std::string text = "  " + describe(t, s_.width > 3 ? s_.width - 3 : 0);
      if (text == last_text_) return;
      last_text_ = text;
      const std::size_t len = text.size();
      if (len < shown_) text += std::string(shown_ - len, ' ');
      write_("\r" + text);
      shown_ = len;
    } else {
      if (!force && t - last_draw_ < line_interval) return;
      write_("statedict: " + describe(t, std::string::npos) + "\n");
    }
    last_draw_ = t;
    ++draws_;
  }

  settings s_;
  std::function<void(std::string_view)> write_;
  std::function<double()> now_;
  mutable std::mutex m_;
  statedict::progress_event state_{};  // its file: file_
  std::string file_;
  std::string last_text_;
  bool seen_ = false;
  double phase_start_ = 0, copy_start_ = 0, last_draw_ = 0;
  std::uint64_t copy_start_done_ = 0;
  std::size_t draws_ = 0, shown_ = 0;
};

/// Calls renderer.tick() every redraw_interval on a thread of its own while it lives.
class progress_ticker {
 public:
  explicit progress_ticker(progress_renderer& r) : r_(r) {
    if (r.mode() == progress_mode::off) return;
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(m_);
      while (!stop_) {
        cv_.wait_for(lock, std::chrono::duration<double>(progress_renderer::redraw_interval));
        if (!stop_) r_.tick();
      }
    });
  }
  progress_ticker(const progress_ticker&) = delete;
  progress_ticker& operator=(const progress_ticker&) = delete;
  ~progress_ticker() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  progress_renderer& r_;
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cli
