// statedict: ByteSource, a readable range of bytes (a file, a mapping, a buffer).
// SPDX-License-Identifier: MIT
//
// Abstract so that shard/ and exec/ can describe and copy bytes without knowing what holds them;
// io/ provides the file-backed implementations (mmap or pread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "error.hpp"
#include "tensor.hpp"

namespace statedict::inline v0 {

namespace errors {
inline constexpr error_id out_of_source{116, error_kind::format, "core.out_of_source"};
}

/// A read-only range of bytes [0, size()).
class ByteSource {
 public:
  ByteSource() = default;
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;
  virtual ~ByteSource() = default;

  /// Human-readable name for messages (a path).
  [[nodiscard]] virtual const std::string& name() const noexcept = 0;
  [[nodiscard]] virtual std::uint64_t size() const noexcept = 0;
  /// All bytes, when directly addressable (a mapping or a buffer); nullptr otherwise (pread).
  [[nodiscard]] virtual const std::byte* data() const noexcept { return nullptr; }
  /// A file descriptor positioned reads may use (copy_file_range fast paths), or -1.
  [[nodiscard]] virtual int fd() const noexcept { return -1; }
  /// Offset of this source's byte 0 within fd() (for sources that are a slice of a file).
  [[nodiscard]] virtual std::uint64_t fd_offset() const noexcept { return 0; }
  /// Shared owner that keeps data() valid.
  [[nodiscard]] virtual keep_alive owner() const = 0;

  /// Copies [offset, offset + dst.size()) into dst; throws errors::out_of_source when the range is
  /// not inside the source, io errors on read failure.
  virtual void read(std::uint64_t offset, std::span<std::byte> dst) const = 0;
  /// Like read(), for a few scattered bytes (zip local headers): sources backed by a file read them
  /// with pread instead of faulting in (and later unmapping) the mapped pages around each one.
  virtual void peek(std::uint64_t offset, std::span<std::byte> dst) const { read(offset, dst); }

  /// Throws errors::out_of_source unless [offset, offset + length) lies inside the source.
  void check_range(std::uint64_t offset, std::uint64_t length, std::string_view what = "range") const {
    if (offset > size() || length > size() - offset)
      throw_error(errors::out_of_source, "file " + quote(name()),
                  std::string(what) + " of " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
                      " runs past the end (" + std::to_string(size()) + " bytes)");
  }
};

/// Bytes held in memory (a Tensor, a vector, a string), or an unowned range kept alive by `owner`.
class MemorySource final : public ByteSource {
 public:
  MemorySource(std::string name, const std::byte* data, std::uint64_t size, keep_alive owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(std::move(owner)) {}
  /// Owns a copy of `bytes`.
  static std::shared_ptr<MemorySource> copy_of(std::string name, std::span<const std::byte> bytes) {
    auto buf = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
    return std::make_shared<MemorySource>(std::move(name), buf->data(), buf->size(), buf);
  }

  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return size_; }
  [[nodiscard]] const std::byte* data() const noexcept override { return data_; }
  [[nodiscard]] keep_alive owner() const override { return owner_; }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    if (!dst.empty()) std::memcpy(dst.data(), data_ + offset, dst.size());
  }

 private:
  std::string name_;
  const std::byte* data_;
  std::uint64_t size_;
  keep_alive owner_;
};

/// Bytes [offset, offset + length) of another source, seen as a source of their own (a DCP item
/// inside a .distcp file, a zip entry).
class SliceSource final : public ByteSource {
 public:
  SliceSource(std::shared_ptr<const ByteSource> base, std::uint64_t offset, std::uint64_t length, std::string name = {})
      : base_(std::move(base)), offset_(offset), length_(length) {
    base_->check_range(offset, length, "slice");
    name_ = name.empty() ? base_->name() + "@" + std::to_string(offset) : std::move(name);
  }
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }
  [[nodiscard]] std::uint64_t size() const noexcept override { return length_; }
  [[nodiscard]] const std::byte* data() const noexcept override {
    const std::byte* d = base_->data();
    return d ? d + offset_ : nullptr;
  }
  [[nodiscard]] int fd() const noexcept override { return base_->fd(); }
  [[nodiscard]] std::uint64_t fd_offset() const noexcept override { return base_->fd_offset() + offset_; }
  [[nodiscard]] keep_alive owner() const override { return base_->owner(); }
  void read(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    base_->read(offset_ + offset, dst);
  }
  void peek(std::uint64_t offset, std::span<std::byte> dst) const override {
    check_range(offset, dst.size());
    base_->peek(offset_ + offset, dst);
  }
  [[nodiscard]] const std::shared_ptr<const ByteSource>& base() const noexcept { return base_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }

 private:
  std::shared_ptr<const ByteSource> base_;
  std::uint64_t offset_;
  std::uint64_t length_;
  std::string name_;
};

/// Bytes [offset, offset + length) of a source, as a span kept alive by `owner`: zero-copy when the
/// source is addressable, a fresh buffer otherwise.
struct Region {
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
  keep_alive owner;
  [[nodiscard]] std::span<const std::byte> span() const noexcept { return {data, static_cast<std::size_t>(size)}; }
};

/// Reads a region (see Region). Callers bound `length` by a format's cap before asking.
inline Region read_region(const ByteSource& src, std::uint64_t offset, std::uint64_t length) {
  src.check_range(offset, length);
  if (const std::byte* d = src.data()) return Region{d + offset, length, src.owner()};
  auto buf = std::make_shared<std::vector<std::byte>>(static_cast<std::size_t>(length));
  src.read(offset, *buf);
  const std::byte* p = buf->data();
  return Region{p, length, std::move(buf)};
}

}  // namespace statedict::inline v0
