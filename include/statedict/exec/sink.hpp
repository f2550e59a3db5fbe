// statedict: sinks, the destinations the executor writes into with positioned writes.
// SPDX-License-Identifier: MIT
//
//   FileSink      an OutputFile (io/file.hpp), optionally at a base offset (after a header);
//                 copy_file_range fast path; writeback started every 64 MiB written (write_behind);
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
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <sys/stat.h>
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
};

namespace detail {
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
    file_.pwrite(base_ + offset, bytes);
    if (crc_.active()) crc_.add(offset, bytes);
    if (pace_) write_behind_step(bytes.size());
  }
  void reserve(std::uint64_t size) override { size_ = size; }
  /// Extends the file to base + size when the writes stopped short of it (trailing padding). Done
  /// at the end, not up front: filling a sparse hole is slower than writing at the end on ext4.
  void finish() override {
    struct stat st {};
    if (::fstat(file_.fd(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) < base_ + size_)
      file_.resize(base_ + size_);
    if (crc_.active()) crc_.finish();
  }
  [[nodiscard]] int fd() const noexcept override { return file_.fd(); }
  [[nodiscard]] std::uint64_t fd_offset() const noexcept override { return base_; }
  [[nodiscard]] bool needs_bytes() const noexcept override { return crc_.active(); }

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
