// statedict: input files (memory-mapped or pread) and output files that appear atomically.
// SPDX-License-Identifier: MIT
//
// Input: `InputFile::open(path)` maps the file read-only; every TensorView into it shares the
// mapping as its keep-alive handle, so the mapping lives as long as any view. `read_mode::pread`
// reads with positioned reads instead, for filesystems where mapping is slow or unsafe (network
// filesystems); readers then copy what they hand out.
//
// Output: `OutputFile::create(path)` writes to a temporary name in the same directory; `commit()`
// fsyncs it, renames it over `path` and fsyncs the directory, so a crash leaves the old file or
// nothing, never a partial file under the final name. An `OutputDir` does the same for a directory
// of files (a sharded checkpoint). Temporaries left by a killed run are removed by the next run
// that writes the same target.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/source.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id open_failed      {380, error_kind::io,    "io.open_failed"};
inline constexpr error_id read_failed      {381, error_kind::io,    "io.read_failed"};
inline constexpr error_id write_failed     {382, error_kind::io,    "io.write_failed"};
inline constexpr error_id not_regular_file {383, error_kind::usage, "io.not_regular_file"};
inline constexpr error_id map_failed       {384, error_kind::io,    "io.map_failed"};
inline constexpr error_id commit_failed    {385, error_kind::io,    "io.commit_failed"};
inline constexpr error_id file_shrank      {386, error_kind::format,"io.file_shrank"};
inline constexpr error_id not_a_directory  {387, error_kind::usage, "io.not_a_directory"};
// clang-format on
}  // namespace errors

namespace detail {
inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

/// Owns a file descriptor and, when mapped, the mapping; the keep-alive handle of every view.
struct file_handle {
  int fd = -1;
  void* map = nullptr;
  std::uint64_t size = 0;
  file_handle() = default;
  file_handle(const file_handle&) = delete;
  file_handle& operator=(const file_handle&) = delete;
  ~file_handle() {
    if (map) ::munmap(map, static_cast<std::size_t>(size));
    if (fd >= 0) ::close(fd);
  }
};
}  // namespace detail

enum class read_mode : std::uint8_t {
  mmap,   ///< map the file; views point into the mapping (zero copy)
  pread,  ///< positioned reads; nothing is mapped
};

/// Access pattern hints for a range of a mapped file.
/// `populate` maps the range's pages in one call (MADV_POPULATE_READ, Linux 5.14; ignored before),
/// reading them in if needed, so that later accesses take no page faults.
/// `large_folios` (MADV_HUGEPAGE) asks that what faults read in comes in 2 MiB folios, mapped whole,
/// where transparent huge pages are enabled ("madvise" or "always"); without it a file read in
/// through a mapping lands in the page cache in 4 KiB folios, one page-table entry each.
enum class access_hint : std::uint8_t { normal, sequential, random, willneed, dontneed, populate, large_folios };

/// A regular file opened for reading.
class InputFile final : public ByteSource {
  struct private_tag {};

 public:
  /// Opens `path`; throws errors::open_failed, errors::not_regular_file or errors::map_failed.
  static std::shared_ptr<const InputFile> open(const std::filesystem::path& path, read_mode mode = read_mode::mmap) {
    return std::make_shared<const InputFile>(private_tag{}, path, mode);
  }

  InputFile(private_tag, const std::filesystem::path& path, read_mode mode)
      : name_(path.string()), mode_(mode), h_(std::make_shared<detail::file_handle>()) {
    const std::string where = "file " + quote(name_);
    h_->fd = ::open(name_.c_str(), O_RDONLY | O_CLOEXEC);
    if (h_->fd < 0) throw_error(errors::open_failed, where, "cannot open: " + detail::errno_text(errno));
    struct stat st {};
    if (::fstat(h_->fd, &st) != 0) throw_error(errors::open_failed, where, "cannot stat: " + detail::errno_text(errno));
    if (!S_ISREG(st.st_mode)) throw_error(errors::not_regular_file, where, "not a regular file");
    h_->size = static_cast<std::uint64_t>(st.st_size);
    if (mode_ == read_mode::mmap && h_->size > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(h_->size), PROT_READ, MAP_PRIVATE, h_->fd, 0);
      if (p == MAP_FAILED) throw_error(errors::map_failed, where, "cannot map: " + detail::errno_text(errno));
      h_->map = p;
    }
  }

  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return h_->size; }
  [[nodiscard]] const std::byte* data() const noexcept override { return static_cast<const std::byte*>(h_->map); }
  [[nodiscard]] int fd() const noexcept override { return h_->fd; }
  [[nodiscard]] keep_alive owner() const override { return h_; }
  [[nodiscard]] read_mode mode() const noexcept { return mode_; }
  [[nodiscard]] bool mapped() const noexcept { return h_->map != nullptr; }

  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    if (dst.empty()) return;
    if (h_->map) {
      std::memcpy(dst.data(), data() + offset, dst.size());
      return;
    }
    pread_all(offset, dst);
  }
  void peek(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    if (!dst.empty()) pread_all(offset, dst);
  }

  /// Advises the kernel about how [offset, offset + length) will be read (mapped files only).
  void advise(std::uint64_t offset, std::uint64_t length, access_hint hint) const noexcept {
    if (!h_->map || length == 0 || offset >= h_->size) return;
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t begin = offset / page * page;
    const std::uint64_t end = std::min(h_->size, offset + std::min(length, h_->size - offset));
    int advice = MADV_NORMAL;
    switch (hint) {
      case access_hint::normal: advice = MADV_NORMAL; break;
      case access_hint::sequential: advice = MADV_SEQUENTIAL; break;
      case access_hint::random: advice = MADV_RANDOM; break;
      case access_hint::willneed: advice = MADV_WILLNEED; break;
      case access_hint::dontneed: advice = MADV_DONTNEED; break;
      case access_hint::populate: advice = 22; break;  // MADV_POPULATE_READ, absent from older headers
      case access_hint::large_folios: advice = MADV_HUGEPAGE; break;
    }
    (void)::madvise(static_cast<char*>(h_->map) + begin, static_cast<std::size_t>(end - begin), advice);
  }

  /// Drops the cached pages of each aligned `block`-byte block overlapping [offset, offset +
  /// length) that has some, but at most `max_cached`, of its pages cached (mapped files only;
  /// pages mapped or dirty stay). A few 4 KiB pages cached inside a block, as reading a format's
  /// headers with pread leaves them, keep the block from being read into one large folio later
  /// (the kernel forms a folio only over pages not yet cached); a copy through the mapping then
  /// pays a page-table entry per 4 KiB of the block, on every warm run after. Returns the number
  /// of blocks dropped.
  std::uint64_t drop_sparse_blocks(std::uint64_t offset, std::uint64_t length, std::uint64_t block,
                                   std::uint64_t max_cached) const {
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    if (!h_->map || page == 0 || block < page || block % page != 0 || offset >= h_->size || length == 0) return 0;
    std::vector<unsigned char> in;
    const std::uint64_t end = std::min(h_->size, offset + std::min(length, h_->size - offset));
    std::uint64_t dropped = 0;
    for (std::uint64_t at = offset / block * block; at < end; at += block) {
      const std::uint64_t len = std::min(block, h_->size - at);
      // mincore looks up every page it is asked about: a block whose sampled pages are all cached
      // (every block of a warm run) is taken as whole without asking about its other pages.
      if (sampled_cached(at, len, std::max(page, block / 4 / page * page))) continue;
      const std::uint64_t n = (len + page - 1) / page, k = cached_pages(at, len, page, in);
      if (k == unknown) return dropped;
      if (k == 0 || k == n || k > max_cached) continue;
      (void)::posix_fadvise(h_->fd, static_cast<off_t>(at), static_cast<off_t>(n * page), POSIX_FADV_DONTNEED);
      ++dropped;
    }
    return dropped;
  }

  /// Whether every page of [offset, offset + length) is in the page cache (mapped files only;
  /// false when the kernel does not tell). At most 64 MiB at a time. With `sample_every` (a
  /// multiple of the page size), only the pages at offset, offset + sample_every, ... and the last
  /// one are asked about: a few lookups in the kernel where every page costs one.
  bool cached(std::uint64_t offset, std::uint64_t length, std::uint64_t sample_every = 0) const {
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    if (!h_->map || page == 0 || offset >= h_->size || length == 0 || length > (std::uint64_t{64} << 20)) return false;
    const std::uint64_t lo = offset / page * page, hi = std::min(h_->size, offset + length);
    if (sample_every >= page && sample_every % page == 0) return sampled_cached(lo, hi - lo, sample_every);
    std::vector<unsigned char> in;
    return cached_pages(lo, hi - lo, page, in) == (hi - lo + page - 1) / page;
  }

  /// Reads [offset, offset + length) into the page cache through a mapping of its own (with
  /// large_folios, advised MADV_HUGEPAGE: read in 2 MiB folios) that is gone again on return, so
  /// nothing stays mapped in this file's mapping. Mapped files only; false when it could not map.
  /// The kernel's own readahead (POSIX_FADV_WILLNEED) reads in 4 KiB folios.
  bool read_ahead(std::uint64_t offset, std::uint64_t length, bool large_folios) const {
    constexpr std::uint64_t align = std::uint64_t{2} << 20;
    if (!h_->map || offset >= h_->size || length == 0) return false;
    const std::uint64_t lo = offset / align * align;
    const std::uint64_t hi = std::min(h_->size, offset + std::min(length, h_->size - offset));
    void* p = ::mmap(nullptr, static_cast<std::size_t>(hi - lo), PROT_READ, MAP_SHARED, h_->fd, static_cast<off_t>(lo));
    if (p == MAP_FAILED) return false;
    if (large_folios) (void)::madvise(p, static_cast<std::size_t>(hi - lo), MADV_HUGEPAGE);
    (void)::madvise(p, static_cast<std::size_t>(hi - lo), 22);  // MADV_POPULATE_READ
    ::munmap(p, static_cast<std::size_t>(hi - lo));
    return true;
  }

 private:
  static constexpr std::uint64_t unknown = ~std::uint64_t{0};

  /// How many pages of [lo, lo + length) (lo page-aligned, mapped files only) are cached, from one
  /// mincore call with `in` as its vector; `unknown` when the kernel does not tell.
  std::uint64_t cached_pages(std::uint64_t lo, std::uint64_t length, std::uint64_t page, std::vector<unsigned char>& in) const {
    const std::uint64_t n = (length + page - 1) / page;
    in.resize(static_cast<std::size_t>(n));
    if (::mincore(static_cast<char*>(h_->map) + lo, static_cast<std::size_t>(length), in.data()) != 0) return unknown;
    std::uint64_t k = 0;
    for (unsigned char c : in) k += c & 1U;
    return k;
  }

  /// Whether the pages at `lo` (page-aligned), lo + stride, ... below lo + length, and the range's
  /// last page, are all cached (mapped files only).
  bool sampled_cached(std::uint64_t lo, std::uint64_t length, std::uint64_t stride) const noexcept {
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t last = (lo + length - 1) / page * page;
    unsigned char in = 0;
    for (std::uint64_t at = lo;; at = std::min(at + stride, last)) {
      if (::mincore(static_cast<char*>(h_->map) + at, static_cast<std::size_t>(page), &in) != 0 || (in & 1U) == 0) return false;
      if (at == last) return true;
    }
  }

  void pread_all(std::uint64_t offset, std::span<std::byte> dst) const {
    std::size_t done = 0;
    while (done < dst.size()) {
      const ssize_t n = ::pread(h_->fd, dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_error(errors::read_failed, "file " + quote(name_),
                    "read at offset " + std::to_string(offset + done) + " failed: " + detail::errno_text(errno));
      }
      if (n == 0)
        throw_error(errors::file_shrank, "file " + quote(name_),
                    "ends at offset " + std::to_string(offset + done) + ", shorter than when opened");
      done += static_cast<std::size_t>(n);
    }
  }

  std::string name_;
  read_mode mode_;
  std::shared_ptr<detail::file_handle> h_;
};

namespace detail {
/// Temporary names are `.<target>.statedict-<pid>-<n>.tmp` next to the target.
inline std::string temp_prefix(const std::string& target_name) { return "." + target_name + ".statedict-"; }

inline std::string temp_name(const std::string& target_name) {
  static std::atomic<unsigned> counter{0};
  return temp_prefix(target_name) + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".tmp";
}

/// Removes temporaries of `target_name` in `dir` whose writing process no longer exists.
inline void remove_stale_temps(const std::filesystem::path& dir, const std::string& target_name) {
  std::error_code ec;
  const std::string prefix = temp_prefix(target_name);
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (n.size() <= prefix.size() + 4 || n.compare(0, prefix.size(), prefix) != 0 || n.substr(n.size() - 4) != ".tmp")
      continue;
    const std::string rest = n.substr(prefix.size());
    const auto dash = rest.find('-');
    if (dash == std::string::npos) continue;
    long pid = 0;
    try {
      pid = std::stol(rest.substr(0, dash));
    } catch (...) {
      continue;
    }
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // still running (or not ours to judge)
    std::filesystem::remove_all(entry.path(), ec);
  }
}

inline void fsync_dir(const std::filesystem::path& dir) {
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;
  (void)::fsync(dfd);
  ::close(dfd);
}

/// "out/" names the directory "out": drop a trailing separator.
inline std::filesystem::path without_trailing_slash(const std::filesystem::path& p) {
  auto n = p.lexically_normal();
  if (n.filename().empty() && n.has_parent_path()) n = n.parent_path();
  return n;
}

inline std::filesystem::path parent_or_dot(const std::filesystem::path& p) {
  auto parent = p.parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}
}  // namespace detail

/// A file being written. Created under a temporary name; appears under its final name only when
/// `commit()` succeeds. Destroying it uncommitted removes the temporary. Writes are unbuffered:
/// callers write large blocks.
class OutputFile {
 public:
  /// Starts writing `path` atomically (temporary name in the same directory).
  static OutputFile create(const std::filesystem::path& path) { return OutputFile(path, true); }
  /// Starts writing `path` directly (for files inside an OutputDir, which is itself atomic).
  static OutputFile create_plain(const std::filesystem::path& path) { return OutputFile(path, false); }

  OutputFile(OutputFile&& o) noexcept
      : final_(std::move(o.final_)), temp_(std::move(o.temp_)), fd_(std::exchange(o.fd_, -1)), pos_(o.pos_),
        atomic_(o.atomic_), committed_(o.committed_) {}
  OutputFile& operator=(OutputFile&& o) noexcept {
    if (this != &o) {
      abandon();
      final_ = std::move(o.final_);
      temp_ = std::move(o.temp_);
      fd_ = std::exchange(o.fd_, -1);
      pos_ = o.pos_;
      atomic_ = o.atomic_;
      committed_ = o.committed_;
    }
    return *this;
  }
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile() { abandon(); }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return final_; }
  [[nodiscard]] const std::filesystem::path& temp_path() const noexcept { return temp_; }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  /// Bytes appended with write() so far.
  [[nodiscard]] std::uint64_t position() const noexcept { return pos_; }

  /// Appends bytes at position().
  void write(std::span<const std::byte> bytes) {
    pwrite(pos_, bytes);
    pos_ += bytes.size();
  }
  void write(std::string_view s) { write(std::as_bytes(std::span<const char>(s.data(), s.size()))); }

  /// Writes bytes at `offset` (thread-safe; does not move position()).
  void pwrite(std::uint64_t offset, std::span<const std::byte> bytes) const {
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_error(errors::write_failed, "file " + quote(final_.string()), "write failed: " + detail::errno_text(errno));
      }
      done += static_cast<std::size_t>(n);
    }
  }

  /// Sets the file size (sparse extension), so positioned writes can fill it in any order.
  void resize(std::uint64_t size) const {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
      throw_error(errors::write_failed, "file " + quote(final_.string()), "cannot resize: " + detail::errno_text(errno));
  }

  /// Moves position() (for callers that fill regions with pwrite and then append).
  void seek(std::uint64_t pos) noexcept { pos_ = pos; }

  /// Flushes to disk and gives the file its final name.
  void commit() {
    if (committed_) return;
    const std::string where = "file " + quote(final_.string());
    if (::fsync(fd_) != 0) throw_error(errors::commit_failed, where, "fsync failed: " + detail::errno_text(errno));
    if (::close(std::exchange(fd_, -1)) != 0)
      throw_error(errors::commit_failed, where, "close failed: " + detail::errno_text(errno));
    if (atomic_) {
      if (::rename(temp_.c_str(), final_.c_str()) != 0)
        throw_error(errors::commit_failed, where, "rename failed: " + detail::errno_text(errno));
      detail::fsync_dir(detail::parent_or_dot(final_));
    }
    committed_ = true;
  }

 private:
  OutputFile(const std::filesystem::path& path, bool atomic) : final_(path), atomic_(atomic) {
    const std::string name = final_.filename().string();
    if (name.empty()) throw_error(errors::open_failed, "file " + quote(path.string()), "not a file name");
    if (atomic_) {
      const auto dir = detail::parent_or_dot(path);
      detail::remove_stale_temps(dir, name);
      temp_ = dir / detail::temp_name(name);
    } else {
      temp_ = path;
    }
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | (atomic_ ? O_EXCL : O_TRUNC) | O_CLOEXEC, 0666);
    if (fd_ < 0)
      throw_error(errors::open_failed, "file " + quote(path.string()), "cannot create: " + detail::errno_text(errno));
  }

  void abandon() noexcept {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
  }

  std::filesystem::path final_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::uint64_t pos_ = 0;
  bool atomic_ = true;
  bool committed_ = false;
};

/// Gathers small positioned writes into an OutputFile and issues each run of adjacent ones as one
/// pwrite: the zip headers, descriptors and directories around storages that the executor writes
/// (a DCP rank file of 10,000 items is otherwise 100,000 writes of a few dozen bytes). Writes that
/// do not continue the pending run start a new one; call flush() when done (the destructor drops
/// what is pending: after an error the file is abandoned anyway).
class WriteCoalescer {
 public:
  explicit WriteCoalescer(const OutputFile& file, std::size_t max_run = std::size_t{1} << 20) : file_(&file), max_(max_run) {}

  void write(std::uint64_t offset, std::span<const std::byte> bytes) {
    if (bytes.empty()) return;
    if (buf_.empty() || offset != start_ + buf_.size() || buf_.size() + bytes.size() > max_) {
      flush();
      if (bytes.size() >= max_) {
        file_->pwrite(offset, bytes);
        return;
      }
      start_ = offset;
    }
    buf_.insert(buf_.end(), bytes.begin(), bytes.end());
  }
  void flush() {
    if (buf_.empty()) return;
    file_->pwrite(start_, buf_);
    buf_.clear();
  }

 private:
  const OutputFile* file_;
  std::size_t max_;
  std::uint64_t start_ = 0;
  std::vector<std::byte> buf_;
};

/// A directory of output files that appears atomically: files are written into a temporary
/// directory next to the target; `commit()` fsyncs them and swaps the directory into place (an
/// existing target is replaced in one step with renameat2(RENAME_EXCHANGE), then removed).
class OutputDir {
 public:
  static OutputDir create(const std::filesystem::path& path) { return OutputDir(path); }

  OutputDir(OutputDir&& o) noexcept
      : final_(std::move(o.final_)), temp_(std::move(o.temp_)), committed_(std::exchange(o.committed_, true)) {}
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;
  OutputDir& operator=(OutputDir&&) = delete;
  ~OutputDir() {
    if (!committed_ && !temp_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(temp_, ec);
    }
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return final_; }
  /// Where files go until commit().
  [[nodiscard]] const std::filesystem::path& temp_path() const noexcept { return temp_; }

  /// Creates `relative` inside the directory (subdirectories are created as needed).
  OutputFile create_file(const std::filesystem::path& relative) const {
    const auto p = temp_ / relative;
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    return OutputFile::create_plain(p);
  }

  /// fsyncs every file and the directory, then moves it to its final name.
  void commit() {
    if (committed_) return;
    const std::string where = "directory " + quote(final_.string());
    std::error_code ec;
    for (const auto& e : std::filesystem::recursive_directory_iterator(temp_, ec)) {
      const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      const int rc = ::fsync(fd);
      ::close(fd);
      if (rc != 0) throw_error(errors::commit_failed, where, "fsync failed: " + detail::errno_text(errno));
    }
    detail::fsync_dir(temp_);
    if (std::filesystem::exists(final_, ec)) {
      if (!std::filesystem::is_directory(final_, ec))
        throw_error(errors::not_a_directory, where, "exists and is not a directory");
      // Atomic swap, then remove the old tree (now under the temporary name).
      if (::syscall(SYS_renameat2, AT_FDCWD, temp_.c_str(), AT_FDCWD, final_.c_str(), 2 /* RENAME_EXCHANGE */) != 0)
        throw_error(errors::commit_failed, where, "cannot replace: " + detail::errno_text(errno));
      committed_ = true;
      std::filesystem::remove_all(temp_, ec);
    } else {
      if (::rename(temp_.c_str(), final_.c_str()) != 0)
        throw_error(errors::commit_failed, where, "rename failed: " + detail::errno_text(errno));
      committed_ = true;
    }
    detail::fsync_dir(detail::parent_or_dot(final_));
  }

 private:
  explicit OutputDir(const std::filesystem::path& path) : final_(detail::without_trailing_slash(path)) {
    const std::string name = final_.filename().string();
    if (name.empty()) throw_error(errors::open_failed, "directory " + quote(path.string()), "not a directory name");
    const auto parent = detail::parent_or_dot(final_);
    detail::remove_stale_temps(parent, name);
    temp_ = parent / detail::temp_name(name);
    if (::mkdir(temp_.c_str(), 0777) != 0)
      throw_error(errors::open_failed, "directory " + quote(path.string()), "cannot create: " + detail::errno_text(errno));
  }

  std::filesystem::path final_;
  std::filesystem::path temp_;
  bool committed_ = false;
};

/// A file of a multi-file output and the size its plan gives it.
struct PlannedFile {
  std::string name;
  std::uint64_t size = 0;
};

/// The last step of an output written in parts (`--part index`): throws `id`, naming `kind` (a
/// "Hugging Face checkpoint"), `dir` and every planned file (a `noun`, "shard") that is missing or
/// has another size than planned, unless there is none.
inline void check_parts_written(const std::filesystem::path& dir, const std::vector<PlannedFile>& files, const error_id& id,
                                std::string_view kind, std::string_view noun) {
  std::vector<std::string> missing, wrong;
  for (const PlannedFile& f : files) {
    std::error_code ec;
    const auto have = std::filesystem::file_size(dir / f.name, ec);
    if (ec) missing.push_back(quote(f.name));
    else if (have != f.size)
      wrong.push_back(quote(f.name) + " has " + std::to_string(have) + " bytes, the plan expects " + std::to_string(f.size));
  }
  if (missing.empty() && wrong.empty()) return;
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size() && i < 20; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 20) s += " and " + std::to_string(v.size() - 20) + " more";
    return s;
  };
  std::string what;
  if (!missing.empty())
    what = std::to_string(missing.size()) + " " + std::string(noun) + (missing.size() == 1 ? "" : "s") + " missing (" + list(missing) +
           "): write every part before the index";
  if (!wrong.empty())
    what += (what.empty() ? "" : "; ") + list(wrong) + " (a part written with other options?)";
  throw_error(id, std::string(kind) + " " + quote(dir.string()), what);
}

}  // namespace statedict::inline v0
