// statedict: sinks, the destinations the executor writes into with positioned writes.
// SPDX-License-Identifier: MIT
//
//   FileSink      an OutputFile (io/file.hpp), optionally at a base offset (after a header);
//                 direct I/O past the page cache where the file system has it (use_direct_io);
//                 otherwise copy_file_range fast path, writeback started every 64 MiB (write_behind);
//                 optional CRC-32 of byte regions (zip records),
//                 computed from whatever order the pieces are written in (crc32_combine)
//   MemorySink    a growable in-memory buffer (tests, small outputs)
//   SpanSink      a caller's buffer of fixed size (exec/read.hpp)
//   Crc32Sink     only the CRC-32 of everything written, any order, nothing stored
//   Sha256Sink    only the SHA-256 of everything written; an *ordered* sink: the executor hands it
//                 bytes in increasing offsets from one thread (`inspect --hash`)
//
// Atomicity belongs to the files (OutputFile / OutputDir commit()), not to the sink: a sink only
// writes bytes. Bytes no write covers read as zero (a fresh file, a fresh buffer), and hashing
// sinks count them as zeros too.
#pragma once

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/sha256.hpp"
#include "../io/crc32.hpp"
#include "../io/file.hpp"
#include "../shard/checkpoint.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id sink_overflow   {650, error_kind::usage, "exec.sink_overflow"};
inline constexpr error_id unordered_write {651, error_kind::usage, "exec.unordered_write"};
// clang-format on
}  // namespace errors

/// Where the executor writes. write() is called concurrently from several threads for disjoint
/// ranges, unless ordered().
class Sink {
 public:
  Sink() = default;
  Sink(const Sink&) = delete;
  Sink& operator=(const Sink&) = delete;
  virtual ~Sink() = default;

  /// For messages (a path).
  [[nodiscard]] virtual const std::string& name() const noexcept = 0;
  /// Writes `bytes` at `offset`.
  virtual void write(std::uint64_t offset, std::span<const std::byte> bytes) = 0;
  /// Called once before any write with the destination's size (padding included); a sink may
  /// allocate or extend itself to it.
  virtual void reserve(std::uint64_t /*size*/) {}
  /// Called once after the last write.
  virtual void finish() {}
  /// A file descriptor the executor may copy_file_range into at fd_offset() + offset, or -1.
  [[nodiscard]] virtual int fd() const noexcept { return -1; }
  [[nodiscard]] virtual std::uint64_t fd_offset() const noexcept { return 0; }
  /// True when every byte must go through write() (the sink hashes what it receives), which rules
  /// out copy_file_range.
  [[nodiscard]] virtual bool needs_bytes() const noexcept { return false; }
  /// True when writes must come from one thread in increasing offsets (a streaming hash).
  [[nodiscard]] virtual bool ordered() const noexcept { return false; }
  /// True when several threads writing at once is faster than their taking turns. False by
  /// default: writes into one file through the page cache serialize on the file's lock, where
  /// threads spin (exec/executor.hpp); a direct-I/O FileSink waits for the disk instead.
  [[nodiscard]] virtual bool concurrent_writes() const noexcept { return false; }
};

namespace detail {
/// Writes a file's whole pages with O_DIRECT: from the device's point of view the bytes go from an
/// aligned buffer straight to the disk, and nothing of the file passes through the page cache.
/// The bytes of each write() that fill whole pages are copied into a staging buffer (the one copy
/// through the CPU) and queued; a few I/O threads write the queued buffers, so the caller goes on
/// copying while the disk writes and several writes are in flight (a direct write waits for the
/// device). The bytes of pages a write covers only in part wait in memory until other writes
/// complete the page, which is then queued the same way; what is left when finish() is called (a
/// page shared with bytes the caller writes itself, such as a header, or with a hole) is written
/// there with ordinary writes, after the last direct write. So no page is written both ways, and
/// while direct writes are under way nothing is written through the page cache (the kernel keeps
/// the two coherent only when they do not race on one page). docs/planner.md has the figures.
class direct_writer {
 public:
  /// Staging buffers at most (filled or in flight), and the threads that write them (per file,
  /// started on its first direct write, ended by finish()); bench/HISTORY.md has the figures
  /// for 1 to 8 threads.
  static constexpr std::size_t max_buffers = 8, io_threads = 4;

  direct_writer() = default;
  direct_writer(const direct_writer&) = delete;
  direct_writer& operator=(const direct_writer&) = delete;
  ~direct_writer() { stop(true); }

  /// Opens a second descriptor of `fd`'s file with O_DIRECT when the file system reports direct
  /// I/O alignments (statx STATX_DIOALIGN) that a page satisfies; false otherwise (tmpfs, older
  /// kernels), and the writer stays inactive. `staging`: bytes per direct write. `name` for errors.
  bool open(int fd, std::uint64_t staging, std::string name) {
#if defined(STATX_DIOALIGN) && defined(O_DIRECT)
    stop(true);
    struct statx sx {};
    const long page = ::sysconf(_SC_PAGESIZE);
    if (page <= 0 || ::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0 || (sx.stx_mask & STATX_DIOALIGN) == 0) return false;
    page_ = static_cast<std::uint64_t>(page);
    if (sx.stx_dio_offset_align == 0 || sx.stx_dio_offset_align > page_ || page_ % sx.stx_dio_offset_align != 0 ||
        sx.stx_dio_mem_align == 0 || sx.stx_dio_mem_align > page_)
      return false;
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    dfd_ = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    if (dfd_ < 0) return false;
    staging_ = std::max(page_, staging / page_ * page_);
    name_ = std::move(name);
    closing_ = discard_ = false;
    error_ = 0;
    return true;
#else
    (void)fd;
    (void)staging;
    (void)name;
    return false;
#endif
  }
  [[nodiscard]] bool active() const noexcept { return dfd_ >= 0; }

  /// Writes `bytes` at file offset `pos` (disjoint from every other write; any thread); calls
  /// `seen(offset, piece)` for every piece of them, once each, in no particular order (a hash).
  template <class Seen>
  void write(std::uint64_t pos, std::span<const std::byte> bytes, Seen&& seen) {
    const std::uint64_t end = pos + bytes.size();
    const std::uint64_t a = (pos + page_ - 1) / page_ * page_, b = end / page_ * page_;
    if (a >= b) {
      partial(pos, bytes, seen);
      return;
    }
    if (a > pos) partial(pos, bytes.first(static_cast<std::size_t>(a - pos)), seen);
    if (end > b) partial(b, bytes.subspan(static_cast<std::size_t>(b - pos)), seen);
    for (std::uint64_t at = a; at < b;) {
      const std::uint64_t n = std::min(staging_, b - at);
      buffer buf = take();
      try {
        std::memcpy(buf.get(), bytes.data() + (at - pos), static_cast<std::size_t>(n));
        seen(at, std::span<const std::byte>(buf.get(), static_cast<std::size_t>(n)));  // while in the cache
      } catch (...) {
        give(std::move(buf));
        throw;
      }
      submit(job{std::move(buf), n, at, true});
      at += n;
    }
  }

  /// Waits for the queued direct writes (throws the first that failed), then writes what is left
  /// of the partial pages (only the bytes written into them) with ordinary writes to `file`.
  /// Call once every write() has returned.
  void finish(const OutputFile& file) {
    stop(false);
    if (error_ != 0) throw_error(errors::write_failed, "file " + quote(name_), error_text_);
    std::vector<std::pair<std::uint64_t, pending>> left(std::make_move_iterator(pending_.begin()), std::make_move_iterator(pending_.end()));
    pending_.clear();
    std::sort(left.begin(), left.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    for (auto& [at, pg] : left) {
      std::sort(pg.ranges.begin(), pg.ranges.end());
      for (std::size_t i = 0; i < pg.ranges.size();) {
        std::size_t j = i + 1;
        std::uint32_t hi = pg.ranges[i].second;
        while (j < pg.ranges.size() && pg.ranges[j].first == hi) hi = pg.ranges[j++].second;
        const std::uint32_t lo = pg.ranges[i].first;
        file.pwrite(at + lo, std::span<const std::byte>(pg.bytes.get() + lo, hi - lo));
        i = j;
      }
    }
  }
  /// Partial pages waiting for the rest of their bytes.
  [[nodiscard]] std::size_t pending_pages() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_.size();
  }

 private:
  struct free_deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  using buffer = std::unique_ptr<std::byte, free_deleter>;
  struct pending {
    buffer bytes;
    std::uint64_t filled = 0;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> ranges;  // [lo, hi) within the page
  };
  struct job {
    buffer bytes;
    std::uint64_t n = 0, at = 0;
    bool staging = false;  // a staging buffer, reused; else a page of its own
  };

  buffer allocate(std::uint64_t n) const {
    auto* p = static_cast<std::byte*>(std::aligned_alloc(static_cast<std::size_t>(page_), static_cast<std::size_t>(n)));
    if (!p) throw std::bad_alloc();
    return buffer(p);
  }
  /// A free staging buffer; waits while max_buffers are filled or in flight.
  buffer take() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (error_ != 0) throw_error(errors::write_failed, "file " + quote(name_), error_text_);
      if (!free_.empty()) {
        buffer b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
      if (allocated_ < max_buffers) {
        ++allocated_;
        lock.unlock();
        return allocate(staging_);
      }
      returned_.wait(lock);
    }
  }
  /// Returns a staging buffer that was not queued (mutex_ not held).
  void give(buffer b) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(b));
    returned_.notify_all();
  }
  /// Queues a direct write (mutex_ held), starting the I/O threads on the first one: a file the
  /// run never writes costs no thread.
  void enqueue(job j) {
    if (io_.empty()) {
      try {
        for (std::size_t t = 0; t < io_threads; ++t) io_.emplace_back([this] { io_loop(); });
      } catch (...) {
        if (io_.empty()) {  // no thread will return buffers: writers must not wait for one
          error_ = 1;
          error_text_ = "cannot start a thread for direct writes";
          returned_.notify_all();
          throw;
        }  // fewer threads than asked for: they will do
      }
    }
    queue_.push_back(std::move(j));
    queued_.notify_one();
  }
  void submit(job j) {
    std::lock_guard<std::mutex> lock(mutex_);
    enqueue(std::move(j));
  }

  void io_loop() {
    for (;;) {
      job j;
      bool skip = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queued_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;
        j = std::move(queue_.front());
        queue_.pop_front();
        skip = discard_;
      }
      std::string failed;
      if (!skip) failed = write_direct(j.bytes.get(), j.n, j.at);
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failed.empty() && error_ == 0) {
        error_ = 1;
        error_text_ = std::move(failed);
        discard_ = true;  // the run fails: the rest need not be written
      }
      if (j.staging) free_.push_back(std::move(j.bytes));
      returned_.notify_all();
    }
  }

  /// Ends the I/O threads once the queue is written (or dropped, with `discard`), and closes the
  /// direct descriptor.
  void stop(bool discard) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      if (discard) discard_ = true;
    }
    queued_.notify_all();
    for (auto& t : io_) t.join();  // no write() is running: io_ no longer changes
    io_.clear();
    if (dfd_ >= 0) ::close(std::exchange(dfd_, -1));
  }

  /// Bytes within one or more pages that the write does not cover whole.
  template <class Seen>
  void partial(std::uint64_t pos, std::span<const std::byte> bytes, Seen& seen) {
    while (!bytes.empty()) {
      const std::uint64_t at = pos / page_ * page_;
      const auto lo = static_cast<std::uint32_t>(pos - at);
      const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>(bytes.size(), page_ - lo));
      seen(pos, bytes.first(n));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pending_.find(at);
        if (it == pending_.end()) it = pending_.emplace(at, pending{allocate(page_), 0, {}}).first;
        std::memcpy(it->second.bytes.get() + lo, bytes.data(), n);
        it->second.ranges.emplace_back(lo, lo + n);
        it->second.filled += n;
        if (it->second.filled == page_) {  // writes are disjoint: every byte of the page is there
          enqueue(job{std::move(it->second.bytes), page_, at, false});
          pending_.erase(it);
        }
      }
      pos += n;
      bytes = bytes.subspan(n);
    }
  }

  /// One direct write of n bytes at `at`; what went wrong, or empty.
  std::string write_direct(const std::byte* p, std::uint64_t n, std::uint64_t at) const {
    while (n) {
      const ssize_t w = ::pwrite(dfd_, p, static_cast<std::size_t>(n), static_cast<off_t>(at));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return "direct write failed: " + errno_text(errno);
      if (w == 0 || static_cast<std::uint64_t>(w) % page_ != 0) return "direct write stopped after " + std::to_string(w) + " bytes";
      p += w;
      n -= static_cast<std::uint64_t>(w);
      at += static_cast<std::uint64_t>(w);
    }
    return {};
  }

  int dfd_ = -1;
  std::uint64_t page_ = 4096, staging_ = 0;
  std::string name_;
  mutable std::mutex mutex_;
  std::condition_variable queued_, returned_;
  std::deque<job> queue_;
  std::vector<std::thread> io_;
  std::vector<buffer> free_;
  std::size_t allocated_ = 0;
  bool closing_ = false, discard_ = false;
  int error_ = 0;
  std::string error_text_;
  std::unordered_map<std::uint64_t, pending> pending_;
};

/// CRC-32 of byte regions of a sink, from pieces written in any order and by any thread.
class crc_regions {
 public:
  void set(std::vector<FlatRange> regions) {
    std::sort(regions.begin(), regions.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
    regions_ = std::move(regions);
    pieces_.assign(regions_.size(), {});
    crcs_.assign(regions_.size(), 0);
  }
  [[nodiscard]] bool active() const noexcept { return !regions_.empty(); }

  void add(std::uint64_t offset, std::span<const std::byte> bytes) {
    const std::uint64_t end = offset + bytes.size();
    auto it = std::upper_bound(regions_.begin(), regions_.end(), offset,
                               [](std::uint64_t v, const FlatRange& r) { return v < r.begin; });
    if (it != regions_.begin()) --it;
    for (; it != regions_.end() && it->begin < end; ++it) {
      const std::uint64_t lo = std::max(it->begin, offset), hi = std::min(it->end, end);
      if (hi <= lo) continue;
      const std::uint32_t c = zip::crc32(bytes.subspan(static_cast<std::size_t>(lo - offset), static_cast<std::size_t>(hi - lo)));
      std::lock_guard<std::mutex> lock(mutex_);
      pieces_[static_cast<std::size_t>(it - regions_.begin())].push_back(piece{lo, hi - lo, c});
    }
  }

  /// Combines the pieces of every region in offset order; unwritten bytes count as zeros.
  void finish() {
    static constexpr std::byte zeros[4096] = {};
    auto zero_crc = [&](std::uint32_t crc, std::uint64_t n) {
      while (n) {
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, sizeof zeros));
        crc = zip::crc32(std::span<const std::byte>(zeros, k), crc);
        n -= k;
      }
      return crc;
    };
    for (std::size_t i = 0; i < regions_.size(); ++i) {
      auto& ps = pieces_[i];
      std::sort(ps.begin(), ps.end(), [](const piece& a, const piece& b) { return a.offset < b.offset; });
      std::uint32_t crc = 0;
      std::uint64_t pos = regions_[i].begin;
      for (const piece& p : ps) {
        if (p.offset > pos) crc = zero_crc(crc, p.offset - pos);
        crc = zip::crc32_combine(crc, p.crc, p.length);
        pos = p.offset + p.length;
      }
      if (pos < regions_[i].end) crc = zero_crc(crc, regions_[i].end - pos);
      crcs_[i] = crc;
      ps.clear();
      ps.shrink_to_fit();
    }
  }
  [[nodiscard]] std::uint32_t crc(std::size_t i) const { return crcs_.at(i); }
  [[nodiscard]] const std::vector<FlatRange>& regions() const noexcept { return regions_; }

 private:
  struct piece {
    std::uint64_t offset, length;
    std::uint32_t crc;
  };
  std::vector<FlatRange> regions_;
  std::vector<std::vector<piece>> pieces_;
  std::vector<std::uint32_t> crcs_;
  std::mutex mutex_;
};
}  // namespace detail

/// Writes into an OutputFile at `base` + offset (the file is not owned; commit it after execute).
/// finish() extends the file to base + the destination size, so trailing padding exists.
class FileSink final : public Sink {
 public:
  explicit FileSink(OutputFile& file, std::uint64_t base = 0) : file_(file), base_(base), name_(file.path().string()) {}

  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  void write(std::uint64_t offset, std::span<const std::byte> bytes) override {
    if (direct_.active()) {
      direct_.write(base_ + offset, bytes, [this](std::uint64_t pos, std::span<const std::byte> piece) {
        if (crc_.active()) crc_.add(pos - base_, piece);
      });
      return;
    }
    file_.pwrite(base_ + offset, bytes);
    if (crc_.active()) crc_.add(offset, bytes);
    if (pace_) write_behind_step(bytes.size());
  }
  void reserve(std::uint64_t size) override {
    size_ = size;
    // With direct I/O, the blocks are allocated up front: the writes then fill allocated space,
    // which ext4 lets several threads do at once (writes that allocate, or that extend the
    // file, hold the inode's lock while the disk writes). Where it is not supported, they allocate.
    if (direct_.active() && size) (void)::fallocate(file_.fd(), 0, static_cast<off_t>(base_), static_cast<off_t>(size));
  }
  /// Extends the file to base + size when the writes stopped short of it (trailing padding). Done
  /// at the end, not up front: filling a sparse hole is slower than writing at the end on ext4.
  void finish() override {
    if (direct_.active()) direct_.finish(file_);
    struct stat st {};
    if (::fstat(file_.fd(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) < base_ + size_)
      file_.resize(base_ + size_);
    if (crc_.active()) crc_.finish();
  }
  /// -1 with direct I/O: the executor must not copy_file_range into the page cache meanwhile.
  [[nodiscard]] int fd() const noexcept override { return direct_.active() ? -1 : file_.fd(); }
  /// With direct I/O, one thread copies while another waits for the disk.
  [[nodiscard]] bool concurrent_writes() const noexcept override { return direct_.active(); }
  [[nodiscard]] std::uint64_t fd_offset() const noexcept override { return base_; }
  [[nodiscard]] bool needs_bytes() const noexcept override { return crc_.active(); }

  /// Writes the bytes the executor hands over with direct I/O, past the page cache (see
  /// detail::direct_writer), `staging` bytes per write; call before execute. False when the file
  /// system does not support it (the sink then writes through the page cache as before).
  bool use_direct_io(std::uint64_t staging = std::uint64_t{1} << 20) { return direct_.open(file_.fd(), staging, name_); }
  [[nodiscard]] bool direct_io() const noexcept { return direct_.active(); }
  /// Partial pages held in memory (direct I/O) until their other bytes arrive or finish().
  [[nodiscard]] std::size_t pending_pages() const { return direct_.pending_pages(); }

  /// Starts writeback of the file's dirty pages (sync_file_range, SYNC_FILE_RANGE_WRITE: it does
  /// not wait for it) each time another `bytes` have been written through this sink, so that the
  /// disk writes while the copy goes on and the commit's fsync finds little left; 0: never.
  /// 64 MiB by default (docs/planner.md: the whole command's wall time against writing everything
  /// first and fsyncing it at the end).
  void write_behind(std::uint64_t bytes) noexcept { pace_ = bytes; }
  /// How many times write_behind started writeback.
  [[nodiscard]] std::uint64_t writebacks_started() const noexcept { return kicks_.load(); }

  /// Computes the CRC-32 of each region (offsets relative to this sink, non-overlapping), e.g. the
  /// data of each zip record. Call before execute; read crc32(i) after it (regions sorted by start).
  void track_crc32(std::vector<FlatRange> regions) { crc_.set(std::move(regions)); }
  [[nodiscard]] std::uint32_t crc32(std::size_t i) const { return crc_.crc(i); }
  [[nodiscard]] const std::vector<FlatRange>& crc_regions() const noexcept { return crc_.regions(); }

 private:
  void write_behind_step(std::uint64_t n) noexcept {
    const std::uint64_t w = written_.fetch_add(n) + n;
    std::uint64_t k = kicked_.load();
    if (w - k < pace_ || !kicked_.compare_exchange_strong(k, w)) return;  // another thread kicks
    (void)::sync_file_range(file_.fd(), 0, 0, SYNC_FILE_RANGE_WRITE);     // a hint: errors surface at fsync
    kicks_.fetch_add(1);
  }

  OutputFile& file_;
  std::uint64_t base_;
  std::uint64_t size_ = 0;
  std::string name_;
  detail::crc_regions crc_;
  detail::direct_writer direct_;
  std::uint64_t pace_ = std::uint64_t{64} << 20;
  std::atomic<std::uint64_t> written_{0}, kicked_{0}, kicks_{0};
};

namespace detail {
/// Copies `bytes` to [offset, offset + bytes.size()) of `to`; throws sink_overflow past its end.
inline void copy_into(std::span<std::byte> to, std::uint64_t offset, std::span<const std::byte> bytes, const std::string& sink) {
  if (offset > to.size() || bytes.size() > to.size() - offset)
    throw_error(errors::sink_overflow, "sink " + quote(sink),
                "write of " + std::to_string(bytes.size()) + " bytes at " + std::to_string(offset) + " past its " +
                    std::to_string(to.size()) + " bytes");
  if (!bytes.empty()) std::memcpy(to.data() + offset, bytes.data(), bytes.size());
}
}  // namespace detail

/// An in-memory destination. reserve() sizes it (zero-filled); writes beyond its size throw.
class MemorySink final : public Sink {
 public:
  explicit MemorySink(std::string name = "memory", std::uint64_t size = 0) : name_(std::move(name)) {
    bytes_.resize(static_cast<std::size_t>(size));
  }
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  void write(std::uint64_t offset, std::span<const std::byte> bytes) override { detail::copy_into(bytes_, offset, bytes, name_); }
  void reserve(std::uint64_t size) override {
    if (size > bytes_.size()) bytes_.resize(static_cast<std::size_t>(size));
  }
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::vector<std::byte>& buffer() noexcept { return bytes_; }

 private:
  std::string name_;
  std::vector<std::byte> bytes_;
};

/// A caller's buffer of fixed size, not owned. Writes beyond it throw.
class SpanSink final : public Sink {
 public:
  SpanSink(std::string name, std::span<std::byte> bytes) : name_(std::move(name)), bytes_(bytes) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  void write(std::uint64_t offset, std::span<const std::byte> bytes) override { detail::copy_into(bytes_, offset, bytes, name_); }
  void reserve(std::uint64_t size) override {
    if (size > bytes_.size())
      throw_error(errors::sink_overflow, "sink " + quote(name_),
                  "needs " + std::to_string(size) + " bytes, has " + std::to_string(bytes_.size()));
  }

 private:
  std::string name_;
  std::span<std::byte> bytes_;
};

/// The CRC-32 of a destination of `reserve()`d size, from writes in any order; nothing is stored.
class Crc32Sink final : public Sink {
 public:
  explicit Crc32Sink(std::string name = "crc32") : name_(std::move(name)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  void write(std::uint64_t offset, std::span<const std::byte> bytes) override { crc_.add(offset, bytes); }
  void reserve(std::uint64_t size) override { crc_.set({FlatRange{0, size}}); }
  void finish() override { crc_.finish(); }
  [[nodiscard]] bool needs_bytes() const noexcept override { return true; }
  [[nodiscard]] std::uint32_t crc32() const { return crc_.crc(0); }

 private:
  std::string name_;
  detail::crc_regions crc_;
};

/// The SHA-256 of a destination's bytes (of its `reserve()`d size); gaps count as zeros. Ordered:
/// the executor writes it from one thread in increasing offsets.
class Sha256Sink final : public Sink {
 public:
  explicit Sha256Sink(std::string name = "sha256") : name_(std::move(name)) {}
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  void write(std::uint64_t offset, std::span<const std::byte> bytes) override {
    if (offset < pos_)
      throw_error(errors::unordered_write, "sink " + quote(name_),
                  "write at " + std::to_string(offset) + " after byte " + std::to_string(pos_) + " was hashed");
    zeros(offset - pos_);
    h_.update(bytes);
    pos_ = offset + bytes.size();
  }
  void reserve(std::uint64_t size) override { size_ = size; }
  void finish() override {
    if (pos_ < size_) zeros(size_ - pos_);
    pos_ = size_;
    digest_ = h_.digest();
  }
  [[nodiscard]] bool needs_bytes() const noexcept override { return true; }
  [[nodiscard]] bool ordered() const noexcept override { return true; }
  /// After execute: the digest.
  [[nodiscard]] const Sha256::digest_type& digest() const noexcept { return digest_; }
  [[nodiscard]] std::string hex() const {
    static constexpr char d[] = "0123456789abcdef";
    std::string s;
    for (std::uint8_t b : digest_) {
      s += d[b >> 4];
      s += d[b & 15];
    }
    return s;
  }

 private:
  void zeros(std::uint64_t n) {
    static constexpr std::byte z[4096] = {};
    while (n) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, sizeof z));
      h_.update(std::span<const std::byte>(z, k));
      n -= k;
    }
  }
  std::string name_;
  Sha256 h_;
  std::uint64_t pos_ = 0, size_ = 0;
  Sha256::digest_type digest_{};
};

}  // namespace statedict::inline v0
