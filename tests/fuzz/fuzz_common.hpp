// statedict fuzz targets: shared helpers (scratch directory, multi-file inputs).
// SPDX-License-Identifier: MIT
//
// Every target catches `const statedict::error&` only: that is how the library reports a bad
// input. Anything else (another exception, a crash, a sanitizer report, a timeout, an allocation
// beyond -rss_limit_mb / -malloc_limit_mb) is a finding.
//
// Directory-based targets take a multi-file input (see `split_files`):
//
//   u8 flags, then records: u8 n, n bytes of relative path, u32 little-endian L, L bytes of data
//
// (the last record's data is cut at the end of the input). tests/fuzz/make_corpus.py writes seeds
// in this encoding from real checkpoint directories.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <statedict/core/error.hpp>
#include <statedict/core/source.hpp>

// A target's entry point. Each fuzz_<name>.cpp is built on its own as a libFuzzer executable, or
// (STATEDICT_FUZZ_ALL, what tests/fuzz/CMakeLists.txt does) all of them into one executable whose
// fuzz_all.cpp runs the target its name names: one sanitized build instead of nineteen.
#ifdef STATEDICT_FUZZ_ALL
#define STATEDICT_FUZZ_TARGET(data, size)                          \
  int test_one_input(const std::uint8_t* data, std::size_t size); \
  int test_one_input(const std::uint8_t* data, std::size_t size)
#else
#define STATEDICT_FUZZ_TARGET(data, size) extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
#endif

namespace fuzz {

/// With STATEDICT_FUZZ_VERBOSE set, prints each expected error (to see why a seed is refused, or
/// what a reproducer hits).
inline void note(const statedict::error& e) {
  static const bool verbose = std::getenv("STATEDICT_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "statedict::error: %s\n", e.what());
}

/// The input as a MemorySource that does not copy (libFuzzer keeps the bytes alive for the call).
inline std::shared_ptr<const statedict::ByteSource> source_of(const std::uint8_t* data, std::size_t size,
                                                              std::string name = "fuzz-input") {
  return std::make_shared<statedict::MemorySource>(std::move(name), reinterpret_cast<const std::byte*>(data), size,
                                                   statedict::keep_alive{});
}

inline std::span<const std::byte> bytes_of(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}

/// A per-process scratch directory ($TMPDIR or /tmp)/statedict-fuzz-<pid>, removed at exit. The
/// path is never destroyed, so the exit handler can still use it.
inline const std::filesystem::path& scratch_root() {
  static const std::filesystem::path* const root = [] {
    std::error_code ec;
    std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    if (ec) base = "/tmp";
    auto* p = new std::filesystem::path(base / ("statedict-fuzz-" + std::to_string(::getpid())));
    std::filesystem::create_directories(*p);
    return p;
  }();
  static const bool cleanup = [] {
    std::atexit([] {
      std::error_code e;
      std::filesystem::remove_all(*root, e);
    });
    return true;
  }();
  (void)cleanup;
  return *root;
}

/// An empty directory `name` under the scratch root (emptied if it exists).
inline std::filesystem::path fresh_dir(const std::string& name = "in") {
  const auto d = scratch_root() / name;
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  std::filesystem::create_directories(d);
  return d;
}

/// Writes `bytes` to `path` (creating or truncating it). False when the OS refuses.
inline bool write_file(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      ::close(fd);
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return ::close(fd) == 0;
}

struct NamedFile {
  std::string name;
  std::span<const std::byte> data;
};

struct Files {
  std::uint8_t flags = 0;
  std::vector<NamedFile> files;
};

/// A relative path of plain components ([A-Za-z0-9._-], not "." or ".."), at most 64 bytes.
inline bool valid_name(std::string_view n) {
  if (n.empty() || n.size() > 64 || n.front() == '/' || n.back() == '/') return false;
  std::size_t start = 0;
  while (start <= n.size()) {
    std::size_t end = n.find('/', start);
    if (end == std::string_view::npos) end = n.size();
    const std::string_view c = n.substr(start, end - start);
    if (c.empty() || c == "." || c == "..") return false;
    for (char ch : c) {
      const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                      ch == '_' || ch == '-';
      if (!ok) return false;
    }
    start = end + 1;
  }
  return true;
}

/// Splits a multi-file input (see the top of this file); nullopt when a name is not valid_name.
inline std::optional<Files> split_files(const std::uint8_t* data, std::size_t size, std::size_t max_files = 24) {
  Files out;
  if (size == 0) return out;
  out.flags = data[0];
  std::size_t pos = 1;
  while (pos < size && out.files.size() < max_files) {
    const std::size_t n = data[pos++];
    if (n > size - pos) return std::nullopt;
    std::string name(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
    if (!valid_name(name)) return std::nullopt;
    std::size_t len = 0;
    if (size - pos >= 4) {
      len = std::size_t{data[pos]} | std::size_t{data[pos + 1]} << 8 | std::size_t{data[pos + 2]} << 16 |
            std::size_t{data[pos + 3]} << 24;
      pos += 4;
    } else {
      pos = size;
    }
    len = std::min(len, size - pos);
    out.files.push_back(NamedFile{std::move(name), bytes_of(data + pos, len)});
    pos += len;
  }
  return out;
}

/// Writes the files under a fresh directory; nullopt when the names clash (a file where a
/// directory is needed): such inputs are skipped, not findings.
inline std::optional<std::filesystem::path> materialise(const Files& f, const std::string& dir_name = "in") {
  const auto dir = fresh_dir(dir_name);
  for (const auto& nf : f.files) {
    const auto p = dir / nf.name;
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) return std::nullopt;
    if (std::filesystem::is_directory(p, ec)) return std::nullopt;
    if (!write_file(p, nf.data)) return std::nullopt;
  }
  return dir;
}

}  // namespace fuzz
