// statedict: zip archives of stored entries, as torch.save writes them (and deflated ones, as
// other zip tools may rewrite them).
// SPDX-License-Identifier: MIT
//
// Reading: `zip::Archive::open(source)` reads the end-of-central-directory record (and the ZIP64
// records when present), then the central directory, which is the source of truth: torch writes
// zero sizes and CRCs in its local headers. Each stored entry is a zero-copy Region of the source
// (`archive.read(entry)`). The source may be a whole file, a pread file, or a SliceSource over an
// archive embedded at an offset inside a larger file (a DCP item); data in front of the archive is
// also tolerated (offsets are then rebased, as Python's zipfile does). Inputs are hostile: every
// offset and size is checked against the source, counts are capped (`zip::limits`), ZIP64 fields
// are validated, names are checked, and encrypted entries or compression methods other than
// DEFLATE give an error naming the entry when read. A deflated entry is inflated into memory
// (io/inflate.hpp, zlib) within `limits::max_inflated_bytes`. CRC verification is optional
// (`read_options::verify_crc`, off by default: torch can write archives without CRCs).
//
// Writing: the layout is computed up front from the entry names and sizes (`zip::plan`), exactly
// as torch's writer (miniz with ZIP64 always on) places them: a local header with zero CRC and
// sizes, an "FB" extra field padding the data start to a multiple of 64, the data, a data
// descriptor (64-bit sizes when the entry needs ZIP64), then the central directory, a ZIP64
// end-of-central-directory record and locator, and the classic end record. Because every offset
// is known before a byte is written, entries can be filled in any order with positioned writes
// (several threads), and only the CRCs are needed at the end (`zip::tail_bytes`). `zip::Writer`
// is the simple sequential streaming form.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/hash_index.hpp"
#include "../core/source.hpp"
#include "crc32.hpp"
#include "file.hpp"
#include "inflate.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id zip_not_a_zip          {400, error_kind::format,      "zip.not_a_zip"};
inline constexpr error_id zip_bad_end_record     {401, error_kind::format,      "zip.bad_end_record"};
inline constexpr error_id zip_bad_zip64          {402, error_kind::format,      "zip.bad_zip64"};
inline constexpr error_id zip_bad_central_dir    {403, error_kind::format,      "zip.bad_central_directory"};
inline constexpr error_id zip_too_many_entries   {404, error_kind::limit,       "zip.too_many_entries"};
inline constexpr error_id zip_central_dir_too_large{405, error_kind::limit,     "zip.central_directory_too_large"};
inline constexpr error_id zip_bad_local_header   {406, error_kind::format,      "zip.bad_local_header"};
inline constexpr error_id zip_entry_out_of_bounds{407, error_kind::format,      "zip.entry_out_of_bounds"};
inline constexpr error_id zip_compressed_entry   {408, error_kind::unsupported, "zip.compressed_entry"};
inline constexpr error_id zip_encrypted_entry    {409, error_kind::unsupported, "zip.encrypted_entry"};
inline constexpr error_id zip_crc_mismatch       {410, error_kind::format,      "zip.crc_mismatch"};
inline constexpr error_id zip_bad_entry_name     {411, error_kind::format,      "zip.bad_entry_name"};
inline constexpr error_id zip_duplicate_entry    {412, error_kind::format,      "zip.duplicate_entry"};
inline constexpr error_id zip_missing_entry      {413, error_kind::key,         "zip.missing_entry"};
inline constexpr error_id zip_multi_disk         {414, error_kind::unsupported, "zip.multi_disk"};
inline constexpr error_id zip_bad_extra_field    {415, error_kind::format,      "zip.bad_extra_field"};
inline constexpr error_id zip_size_mismatch      {416, error_kind::format,      "zip.size_mismatch"};
inline constexpr error_id zip_bad_writer_input   {420, error_kind::usage,       "zip.bad_writer_input"};
inline constexpr error_id zip_writer_order       {421, error_kind::usage,       "zip.writer_order"};
// clang-format on
}  // namespace errors

namespace zip {

/// Caps on hostile archives. Each is checked before anything of that size is allocated.
struct limits {
  /// Entries in the central directory. torch writes 2-4 records plus one per storage.
  std::uint64_t max_entries = 1U << 20;
  /// Bytes of central directory read into memory.
  std::uint64_t max_central_directory_bytes = std::uint64_t{256} << 20;
  /// Bytes of deflated entries one archive inflates into memory, over all its entries (checked
  /// against each entry's declared size before anything is allocated). Deflated records cannot be
  /// views of the file; torch.save never writes them, another zip tool may.
  std::uint64_t max_inflated_bytes = std::uint64_t{4} << 30;
};

struct read_options {
  zip::limits limits{};
  /// Check each entry's CRC-32 when it is read (reads every byte of the entry).
  bool verify_crc = false;
  /// Leave the local headers unread: open() reads only the end records and the central directory,
  /// and each entry's data_offset stays 0 (unknown) until locate() or adopt_data_offsets(). For a
  /// reader with other work to do meanwhile (torch_file predicts where torch put the data, reads
  /// the headers on another thread with data_offsets() and checks the prediction).
  bool defer_local_headers = false;
};

/// One entry, as the central directory describes it (offsets relative to the source's byte 0).
struct Entry {
  std::string name;
  std::uint64_t header_offset = 0;  ///< local header
  std::uint64_t data_offset = 0;    ///< first byte of the (stored) data
  std::uint64_t size = 0;           ///< uncompressed size
  std::uint64_t compressed_size = 0;
  std::uint32_t crc = 0;
  std::uint16_t method = 0;         ///< 0 stored, 8 deflate, ...
  std::uint16_t flags = 0;
  [[nodiscard]] bool stored() const noexcept { return method == 0; }
  [[nodiscard]] bool deflated() const noexcept { return method == 8; }
};

namespace detail {
inline std::uint16_t rd16(const std::byte* p) noexcept {
  return static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) | (std::to_integer<unsigned>(p[1]) << 8));
}
inline std::uint32_t rd32(const std::byte* p) noexcept {
  return static_cast<std::uint32_t>(rd16(p)) | (static_cast<std::uint32_t>(rd16(p + 2)) << 16);
}
inline std::uint64_t rd64(const std::byte* p) noexcept {
  return static_cast<std::uint64_t>(rd32(p)) | (static_cast<std::uint64_t>(rd32(p + 4)) << 32);
}
inline void wr16(std::vector<std::byte>& out, std::uint64_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffU));
}
inline void wr32(std::vector<std::byte>& out, std::uint64_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffU));
}
inline void wr64(std::vector<std::byte>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffU));
}
inline void wrstr(std::vector<std::byte>& out, std::string_view s) {
  for (char c : s) out.push_back(static_cast<std::byte>(c));
}

inline constexpr std::uint32_t sig_local = 0x04034b50;
inline constexpr std::uint32_t sig_central = 0x02014b50;
inline constexpr std::uint32_t sig_descriptor = 0x08074b50;
inline constexpr std::uint32_t sig_end = 0x06054b50;
inline constexpr std::uint32_t sig_end64 = 0x06064b50;
inline constexpr std::uint32_t sig_locator64 = 0x07064b50;
inline constexpr std::size_t local_header_size = 30;
inline constexpr std::size_t central_header_size = 46;
inline constexpr std::size_t end_size = 22;
inline constexpr std::size_t end64_size = 56;
inline constexpr std::size_t locator64_size = 20;
inline constexpr std::uint32_t u32_max = 0xFFFFFFFFU;
inline constexpr std::uint16_t u16_max = 0xFFFFU;
inline constexpr std::uint16_t extra_zip64 = 0x0001;
inline constexpr std::uint16_t extra_padding = 0x4246;  // "FB", torch's alignment padding

inline std::string where(const ByteSource& src) { return "zip archive " + quote(src.name()); }
}  // namespace detail

/// A zip archive read from a ByteSource. Cheap to move; entries and their index are built once.
class Archive {
 public:
  /// Reads the end records and the central directory. Throws format/limit errors for a malformed
  /// archive; errors name the source.
  static Archive open(std::shared_ptr<const ByteSource> source, const read_options& options = {}) {
    Archive a;
    a.source_ = std::move(source);
    a.options_ = options;
    a.parse();
    return a;
  }

  [[nodiscard]] const std::vector<Entry>& entries() const noexcept { return entries_; }
  /// Moves the entries out (names and all, for a reader that keeps them past the archive); the
  /// archive is left without entries. Pointers to entries stay valid in the returned vector.
  [[nodiscard]] std::vector<Entry> release_entries() noexcept {
    index_ = {};
    return std::exchange(entries_, {});
  }
  [[nodiscard]] const std::shared_ptr<const ByteSource>& source() const noexcept { return source_; }
  /// Bytes in front of the archive proper (0 unless the source has data prepended to the archive).
  [[nodiscard]] std::uint64_t prefix_bytes() const noexcept { return delta_; }
  /// Offset of the central directory in the source.
  [[nodiscard]] std::uint64_t central_directory_offset() const noexcept { return cd_offset_; }
  /// Whether the archive has ZIP64 end records.
  [[nodiscard]] bool zip64() const noexcept { return zip64_; }

  /// The entry named `name`, or nullptr.
  [[nodiscard]] const Entry* find(std::string_view name) const {
    const auto i = index_.find(name_hash(name), [&](std::uint32_t e) { return entries_[e].name == name; });
    return i == statedict::detail::hash_index::npos ? nullptr : &entries_[i];
  }
  /// The entry named `name`; throws errors::zip_missing_entry.
  [[nodiscard]] const Entry& at(std::string_view name) const {
    if (const Entry* e = find(name)) return *e;
    throw_error(errors::zip_missing_entry, detail::where(*source_), "no entry " + quote(name));
  }

  /// The bytes of an entry: for a stored entry, zero-copy when the source is addressable; a
  /// deflated one is inflated into memory (counted against limits::max_inflated_bytes). Throws for
  /// other methods or encrypted entries, and on a CRC mismatch when verify_crc is set.
  [[nodiscard]] Region read(const Entry& e) const {
    check_extractable(e);
    if (e.stored()) {
      Region r = read_region(*source_, located(e), e.size);
      if (options_.verify_crc) verify(e, r);
      return r;
    }
    auto buf = std::make_shared<std::vector<std::byte>>();
    claim_inflated(e);
    buf->resize(static_cast<std::size_t>(e.size));
    extract(e, *buf);
    const std::byte* p = buf->data();
    return Region{p, e.size, std::move(buf)};
  }
  [[nodiscard]] Region read(std::string_view name) const { return read(at(name)); }

  /// Writes the bytes of entry `e` (stored or deflated) into `out`, which must hold e.size bytes;
  /// verifies the CRC when verify_crc is set. The caller accounts for the memory: claim_inflated()
  /// for a deflated entry.
  void extract(const Entry& e, std::span<std::byte> out) const {
    check_extractable(e);
    if (out.size() != e.size)
      throw_error(errors::out_of_range, detail::where(*source_), "entry " + quote(e.name) + ": a buffer of " + std::to_string(out.size()) +
                                                                    " bytes for " + std::to_string(e.size));
    if (e.stored()) {
      source_->read(located(e), out);
    } else {
      const Region packed = read_region(*source_, located(e), e.compressed_size);
      inflate_raw(packed.span(), out, detail::where(*source_) + ": entry " + quote(e.name));
    }
    if (options_.verify_crc) verify(e, Region{out.data(), out.size(), {}});
  }

  /// Counts a deflated entry's size against limits::max_inflated_bytes (the total over the
  /// archive); throws errors::zip_inflate_limit beyond it.
  void claim_inflated(const Entry& e) const {
    const std::uint64_t cap = options_.limits.max_inflated_bytes;
    std::uint64_t before = inflated_->load();
    do {
      if (e.size > cap || before > cap - e.size)
        throw_error(errors::zip_inflate_limit, detail::where(*source_),
                    "entry " + quote(e.name) + " inflates to " + std::to_string(e.size) + " bytes; with the " + std::to_string(before) +
                        " already inflated that exceeds limits::max_inflated_bytes (" + std::to_string(cap) + ")");
    } while (!inflated_->compare_exchange_weak(before, before + e.size));
  }
  /// Bytes of deflated entries inflated so far (claim_inflated()).
  [[nodiscard]] std::uint64_t inflated_bytes() const noexcept { return inflated_->load(); }

  /// Throws unless `e` is a stored, unencrypted entry: one whose bytes can be used in place.
  void check_readable(const Entry& e) const {
    check_extractable(e);
    if (!e.stored())
      throw_error(errors::zip_compressed_entry, detail::where(*source_),
                  "entry " + quote(e.name) + " is compressed (method " + std::to_string(e.method) +
                      "); only stored entries can be read in place, as torch.save writes them");
  }
  /// Throws unless `e` is unencrypted and stored or deflated (what read() and extract() handle).
  void check_extractable(const Entry& e) const {
    if (e.flags & 1U)
      throw_error(errors::zip_encrypted_entry, detail::where(*source_), "entry " + quote(e.name) + " is encrypted");
    if (!e.stored() && !e.deflated())
      throw_error(errors::zip_compressed_entry, detail::where(*source_),
                  "entry " + quote(e.name) + " is compressed with method " + std::to_string(e.method) +
                      "; statedict reads stored (0) and deflated (8) entries");
  }

  /// Every entry's data offset, in entries() order, from the local headers (the central
  /// directory does not repeat the local extra field, which torch uses to pad data to 64 bytes).
  /// Changes nothing, so it may run on another thread while this archive is used through its
  /// const members; throws as open() would for a bad local header.
  /// Headers close to each other are read with one positioned read: a torch file has one header
  /// per storage and small storages sit back to back, so a 10,000-storage checkpoint needs about a
  /// third of the reads. Reads stay small (never past max_span), and `peek` keeps thousands of
  /// them from faulting in the mapped pages around each header.
  [[nodiscard]] std::vector<std::uint64_t> data_offsets() const {
    static constexpr std::uint64_t max_gap = 16 << 10;   // headers further apart start a new read
    static constexpr std::uint64_t max_span = 64 << 10;  // bytes of one read
    std::vector<std::uint64_t> out(entries_.size());
    std::vector<std::uint32_t> order(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) order[i] = static_cast<std::uint32_t>(i);
    auto by_offset = [&](std::uint32_t a, std::uint32_t b) { return entries_[a].header_offset < entries_[b].header_offset; };
    if (!std::is_sorted(order.begin(), order.end(), by_offset)) std::stable_sort(order.begin(), order.end(), by_offset);
    std::unique_ptr<std::byte[]> buf;  // not zeroed: peek fills what is read
    std::size_t buf_size = 0;
    std::size_t b = 0;
    while (b < order.size()) {
      const std::uint64_t start = entries_[order[b]].header_offset;
      std::uint64_t stop = header_end(entries_[order[b]]);
      std::size_t e = b + 1;
      for (; e < order.size(); ++e) {
        const Entry& en = entries_[order[e]];
        if (en.header_offset - entries_[order[e - 1]].header_offset > max_gap || header_end(en) - start > max_span) break;
        stop = std::max(stop, header_end(en));
      }
      const auto span = static_cast<std::size_t>(stop - start);
      if (span > buf_size) {
        buf = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(span, max_span));
        buf_size = std::max<std::size_t>(span, max_span);
      }
      source_->peek(start, std::span<std::byte>(buf.get(), span));
      for (std::size_t k = b; k < e; ++k) {
        const Entry& en = entries_[order[k]];
        const std::uint64_t at = en.header_offset - start;
        out[order[k]] = locate_data(en, buf.get() + static_cast<std::size_t>(at));
      }
      b = e;
    }
    return out;
  }
  /// Records offsets from data_offsets() (of this archive) in the entries.
  void adopt_data_offsets(std::span<const std::uint64_t> offsets) {
    if (offsets.size() != entries_.size())
      throw_error(errors::out_of_range, "adopt_data_offsets: " + std::to_string(offsets.size()) + " offsets for " +
                                                std::to_string(entries_.size()) + " entries");
    for (std::size_t i = 0; i < entries_.size(); ++i) entries_[i].data_offset = offsets[i];
  }
  /// Reads one entry's local header now (an archive opened with defer_local_headers).
  void locate(const Entry& e) {
    const std::less<const Entry*> before;  // a total order, also for pointers into other arrays
    if (before(&e, entries_.data()) || !before(&e, entries_.data() + entries_.size()))
      throw_error(errors::out_of_range, "locate: not an entry of this archive");
    const auto i = static_cast<std::size_t>(&e - entries_.data());
    std::vector<std::byte> buf(static_cast<std::size_t>(header_end(e) - e.header_offset));
    source_->peek(e.header_offset, buf);
    entries_[i].data_offset = locate_data(e, buf.data());
  }

  /// The entry's data offset; throws when its local header was not read yet.
  [[nodiscard]] std::uint64_t located(const Entry& e) const {
    if (e.data_offset == 0)  // a local header takes 30 bytes or more: 0 is "not read yet"
      fail(errors::zip_bad_local_header, "entry " + quote(e.name) + ": its local header was not read (defer_local_headers)");
    return e.data_offset;
  }

  /// Checks the CRC-32 of an entry's bytes against the central directory.
  void verify(const Entry& e, const Region& r) const {
    const std::uint32_t c = crc32(r.span());
    if (c != e.crc)
      throw_error(errors::zip_crc_mismatch, detail::where(*source_),
                  "entry " + quote(e.name) + ": CRC-32 of the data is " + hex(c) + ", the central directory says " +
                      hex(e.crc));
  }

 private:
  static std::string hex(std::uint32_t v) {
    static constexpr char d[] = "0123456789abcdef";
    std::string s = "0x";
    for (int i = 7; i >= 0; --i) s += d[(v >> (4 * i)) & 15U];
    return s;
  }

  [[noreturn]] void fail(const error_id& id, const std::string& detail) const {
    throw_error(id, detail::where(*source_), detail);
  }

  void parse() {
    const ByteSource& src = *source_;
    const std::uint64_t size = src.size();
    if (size < detail::end_size) fail(errors::zip_not_a_zip, "file of " + std::to_string(size) + " bytes is too short for a zip archive");

    // End of central directory: the last signature whose comment fits in the file.
    const std::uint64_t window = std::min<std::uint64_t>(size, detail::end_size + 0xFFFF);
    const Region tail = read_region(src, size - window, window);
    const std::byte* t = tail.data;
    std::uint64_t end_pos = 0;
    bool found = false;
    for (std::uint64_t i = window - detail::end_size + 1; i-- > 0;) {
      if (detail::rd32(t + i) != detail::sig_end) continue;
      const std::uint64_t comment = detail::rd16(t + i + 20);
      if (i + detail::end_size + comment <= window) {
        end_pos = size - window + i;
        found = true;
        break;
      }
    }
    if (!found) fail(errors::zip_not_a_zip, "no end-of-central-directory record in the last " + std::to_string(window) + " bytes");
    const std::byte* e = t + (end_pos - (size - window));
    const std::uint16_t disk = detail::rd16(e + 4), cd_disk = detail::rd16(e + 6);
    std::uint64_t n_disk = detail::rd16(e + 8), n_total = detail::rd16(e + 10);
    std::uint64_t cd_size = detail::rd32(e + 12), cd_offset = detail::rd32(e + 16);
    std::uint64_t cd_end = end_pos;  // where the central directory must end
    // The ZIP64 locator's recorded offset of its end record, and where the record is.
    std::optional<std::pair<std::uint64_t, std::uint64_t>> recorded_end64;

    // ZIP64: a locator right before the end record.
    if (end_pos >= detail::locator64_size) {
      const Region loc = read_region(src, end_pos - detail::locator64_size, detail::locator64_size);
      if (detail::rd32(loc.data) == detail::sig_locator64) {
        zip64_ = true;
        const std::uint64_t loc_pos = end_pos - detail::locator64_size;
        if (detail::rd32(loc.data + 4) != 0 || detail::rd32(loc.data + 16) > 1)
          fail(errors::zip_multi_disk, "ZIP64 locator names disk " + std::to_string(detail::rd32(loc.data + 4)) + " of " +
                                           std::to_string(detail::rd32(loc.data + 16)));
        // The record normally sits right before the locator; otherwise trust the recorded offset.
        std::uint64_t rec_pos = loc_pos >= detail::end64_size ? loc_pos - detail::end64_size : ~std::uint64_t{0};
        auto is_rec = [&](std::uint64_t pos) {
          if (pos == ~std::uint64_t{0} || pos > loc_pos || loc_pos - pos < detail::end64_size) return false;
          const Region r = read_region(src, pos, 4);
          return detail::rd32(r.data) == detail::sig_end64;
        };
        if (is_rec(rec_pos)) recorded_end64.emplace(detail::rd64(loc.data + 8), rec_pos);
        if (!is_rec(rec_pos)) {
          rec_pos = detail::rd64(loc.data + 8);
          if (!is_rec(rec_pos))
            fail(errors::zip_bad_zip64, "ZIP64 locator at offset " + std::to_string(loc_pos) +
                                            " points to no ZIP64 end record (offset " + std::to_string(rec_pos) + ")");
        }
        const Region r = read_region(src, rec_pos, detail::end64_size);
        const std::byte* z = r.data;
        const std::uint64_t rec_size = detail::rd64(z + 4);
        if (rec_size < detail::end64_size - 12 || rec_size > loc_pos - rec_pos - 12)
          fail(errors::zip_bad_zip64, "ZIP64 end record size " + std::to_string(rec_size) + " does not fit before the locator");
        if (detail::rd32(z + 16) != 0 || detail::rd32(z + 20) != 0)
          fail(errors::zip_multi_disk, "ZIP64 end record spans several disks");
        const std::uint64_t n_disk64 = detail::rd64(z + 24), n_total64 = detail::rd64(z + 32);
        const std::uint64_t cd_size64 = detail::rd64(z + 40), cd_offset64 = detail::rd64(z + 48);
        // Classic fields must agree unless they are the ZIP64 escape values.
        auto agree = [&](std::uint64_t classic, std::uint64_t wide, std::uint64_t escape, const char* what) {
          if (classic != escape && classic != wide)
            fail(errors::zip_bad_zip64, std::string(what) + " is " + std::to_string(classic) + " in the end record but " +
                                            std::to_string(wide) + " in the ZIP64 end record");
        };
        agree(n_disk, n_disk64, detail::u16_max, "entry count (this disk)");
        agree(n_total, n_total64, detail::u16_max, "entry count");
        agree(cd_size, cd_size64, detail::u32_max, "central directory size");
        n_disk = n_disk64;
        n_total = n_total64;
        cd_size = cd_size64;
        cd_offset = cd_offset64;
        cd_end = rec_pos;
      }
    }
    if (!zip64_ && (disk != 0 || cd_disk != 0))
      fail(errors::zip_multi_disk, "archive spans several disks (disk " + std::to_string(disk) + ")");
    if (n_disk != n_total)
      fail(errors::zip_bad_end_record, std::to_string(n_disk) + " entries on this disk but " + std::to_string(n_total) + " in total");
    if (n_total > options_.limits.max_entries)
      fail(errors::zip_too_many_entries, std::to_string(n_total) + " entries exceed limits.max_entries (" +
                                             std::to_string(options_.limits.max_entries) + ")");
    if (cd_size > options_.limits.max_central_directory_bytes)
      fail(errors::zip_central_dir_too_large, "central directory of " + std::to_string(cd_size) +
                                                  " bytes exceeds limits.max_central_directory_bytes (" +
                                                  std::to_string(options_.limits.max_central_directory_bytes) + ")");
    if (cd_size > cd_end || cd_offset > cd_end - cd_size)
      fail(errors::zip_bad_end_record, "central directory of " + std::to_string(cd_size) + " bytes at offset " +
                                           std::to_string(cd_offset) + " does not end before offset " + std::to_string(cd_end));
    // Data in front of the archive shifts every recorded offset by the same amount.
    delta_ = cd_end - (cd_offset + cd_size);
    cd_offset_ = cd_offset + delta_;
    if (n_total > cd_size / detail::central_header_size)
      fail(errors::zip_bad_central_dir, std::to_string(n_total) + " entries cannot fit in a central directory of " +
                                            std::to_string(cd_size) + " bytes");

    const Region cd = read_region(src, cd_offset_, cd_size);
    entries_.reserve(static_cast<std::size_t>(n_total));
    index_.reserve(static_cast<std::size_t>(n_total));
    std::uint64_t pos = 0;
    for (std::uint64_t i = 0; i < n_total; ++i) {
      if (cd_size - pos < detail::central_header_size)
        fail(errors::zip_bad_central_dir, "central directory ends inside entry " + std::to_string(i));
      const std::byte* h = cd.data + pos;
      if (detail::rd32(h) != detail::sig_central)
        fail(errors::zip_bad_central_dir, "entry " + std::to_string(i) + " has no central header signature");
      Entry en;
      en.flags = detail::rd16(h + 8);
      en.method = detail::rd16(h + 10);
      en.crc = detail::rd32(h + 16);
      en.compressed_size = detail::rd32(h + 20);
      en.size = detail::rd32(h + 24);
      const std::uint64_t name_len = detail::rd16(h + 28), extra_len = detail::rd16(h + 30), comment_len = detail::rd16(h + 32);
      std::uint16_t entry_disk = detail::rd16(h + 34);
      en.header_offset = detail::rd32(h + 42);
      const std::uint64_t rec = detail::central_header_size + name_len + extra_len + comment_len;
      if (rec > cd_size - pos) fail(errors::zip_bad_central_dir, "entry " + std::to_string(i) + " runs past the central directory");
      en.name.assign(reinterpret_cast<const char*>(h + detail::central_header_size), static_cast<std::size_t>(name_len));
      check_name(en.name);
      read_zip64_extra(en, entry_disk, std::span<const std::byte>(h + detail::central_header_size + name_len, static_cast<std::size_t>(extra_len)));
      if (entry_disk != 0 && entry_disk != detail::u16_max)
        fail(errors::zip_multi_disk, "entry " + quote(en.name) + " is on disk " + std::to_string(entry_disk));
      pos += rec;
      const std::uint32_t nh = name_hash(en.name);
      if (index_.find(nh, [&](std::uint32_t j) { return entries_[j].name == en.name; }) != statedict::detail::hash_index::npos)
        fail(errors::zip_duplicate_entry, "entry " + quote(en.name) + " appears twice");
      index_.add(nh, entries_.size());
      entries_.push_back(std::move(en));
    }
    check_header_offsets();
    // Data in front of the archive shifts the locator's recorded offset as much as every other
    // one; a different shift is a corrupt locator, which torch's reader (going by the recorded
    // offset) refuses.
    if (recorded_end64 && recorded_end64->first + delta_ != recorded_end64->second)
      fail(errors::zip_bad_zip64, "the ZIP64 locator records its end record at offset " + std::to_string(recorded_end64->first) +
                                      (delta_ ? " (+" + std::to_string(delta_) + " bytes in front of the archive)" : std::string()) +
                                      ", but it is at " + std::to_string(recorded_end64->second));
    if (!options_.defer_local_headers) adopt_data_offsets(data_offsets());
  }

  void check_name(const std::string& name) const {
    if (name.empty()) fail(errors::zip_bad_entry_name, "an entry has an empty name");
    if (name.find('\0') != std::string::npos) fail(errors::zip_bad_entry_name, "entry name " + quote(name) + " contains a NUL byte");
  }

  void read_zip64_extra(Entry& en, std::uint16_t& entry_disk, std::span<const std::byte> extra) const {
    const bool need_size = en.size == detail::u32_max, need_csize = en.compressed_size == detail::u32_max;
    const bool need_offset = en.header_offset == detail::u32_max, need_disk = entry_disk == detail::u16_max;
    bool seen = false;
    std::size_t p = 0;
    while (p < extra.size()) {
      if (extra.size() - p < 4) fail(errors::zip_bad_extra_field, "entry " + quote(en.name) + ": truncated extra field");
      const std::uint16_t id = detail::rd16(extra.data() + p);
      const std::size_t len = detail::rd16(extra.data() + p + 2);
      if (len > extra.size() - p - 4) fail(errors::zip_bad_extra_field, "entry " + quote(en.name) + ": extra field runs past its end");
      if (id == detail::extra_zip64 && !seen) {
        seen = true;
        const std::byte* f = extra.data() + p + 4;
        std::size_t q = 0;
        auto take = [&](std::uint64_t& field, const char* what) {
          if (len - q < 8)
            fail(errors::zip_bad_zip64, "entry " + quote(en.name) + ": ZIP64 extra field lacks the " + what);
          field = detail::rd64(f + q);
          q += 8;
        };
        if (need_size) take(en.size, "uncompressed size");
        if (need_csize) take(en.compressed_size, "compressed size");
        if (need_offset) take(en.header_offset, "local header offset");
        if (need_disk) {
          if (len - q < 4) fail(errors::zip_bad_zip64, "entry " + quote(en.name) + ": ZIP64 extra field lacks the disk number");
          if (detail::rd32(f + q) != 0)
            fail(errors::zip_multi_disk, "entry " + quote(en.name) + " is on disk " + std::to_string(detail::rd32(f + q)));
          entry_disk = 0;
        }
      }
      p += 4 + len;
    }
    if (!seen && (need_size || need_csize || need_offset || need_disk)) {
      // 0xFFFFFFFF without a ZIP64 field is a genuine value only for sizes (a 4 GiB - 1 entry).
      if (need_offset || need_disk)
        fail(errors::zip_bad_zip64, "entry " + quote(en.name) + " has escape values but no ZIP64 extra field");
    }
  }

  /// Makes every local header offset relative to the source and checks that the fixed part of
  /// the header lies before the central directory.
  void check_header_offsets() {
    for (Entry& en : entries_) {
      if (en.header_offset > max_size - delta_)
        fail(errors::zip_entry_out_of_bounds, "entry " + quote(en.name) + ": header offset overflows");
      const std::uint64_t h = en.header_offset + delta_;
      if (h > cd_offset_ || cd_offset_ - h < detail::local_header_size)
        fail(errors::zip_entry_out_of_bounds, "entry " + quote(en.name) + ": local header at offset " + std::to_string(h) +
                                                  " is not before the central directory (offset " +
                                                  std::to_string(cd_offset_) + ")");
      en.header_offset = h;
    }
  }

  /// Where the fixed header and the name of `en` end, cut at the central directory (checked when
  /// parsed).
  [[nodiscard]] std::uint64_t header_end(const Entry& en) const noexcept {
    return en.header_offset + std::min<std::uint64_t>(detail::local_header_size + en.name.size(), cd_offset_ - en.header_offset);
  }

  /// Parses the local header of `en` from `lh`: its fixed part and name, or as much of them as
  /// precedes the central directory (check_header_offsets checked that the fixed part does; the
  /// name is compared only once the header is known to end before it). Returns the data offset.
  [[nodiscard]] std::uint64_t locate_data(const Entry& en, const std::byte* lh) const {
    const std::uint64_t h = en.header_offset;
    if (detail::rd32(lh) != detail::sig_local)
      fail(errors::zip_bad_local_header, "entry " + quote(en.name) + ": no local header signature at offset " + std::to_string(h));
    const std::uint64_t name_len = detail::rd16(lh + 26), extra_len = detail::rd16(lh + 28);
    const std::uint64_t data = h + detail::local_header_size + name_len + extra_len;
    if (data > cd_offset_)
      fail(errors::zip_bad_local_header, "entry " + quote(en.name) + ": local header runs into the central directory");
    if (name_len != en.name.size() ||
        std::memcmp(lh + detail::local_header_size, en.name.data(), en.name.size()) != 0)
      fail(errors::zip_bad_local_header, "entry " + quote(en.name) + ": local header names another entry");
    if (en.stored() && en.compressed_size != en.size)
      fail(errors::zip_size_mismatch, "stored entry " + quote(en.name) + " has compressed size " +
                                          std::to_string(en.compressed_size) + " but size " + std::to_string(en.size));
    if (en.compressed_size > cd_offset_ - data)
      fail(errors::zip_entry_out_of_bounds, "entry " + quote(en.name) + ": " + std::to_string(en.compressed_size) +
                                                " bytes at offset " + std::to_string(data) +
                                                " run past the start of the central directory (offset " +
                                                std::to_string(cd_offset_) + ")");
    return data;
  }

  std::shared_ptr<const ByteSource> source_;
  read_options options_{};
  /// Bytes of deflated entries inflated (claim_inflated); shared by moved-from copies, atomic so
  /// that threads reading entries of one archive count them together.
  std::shared_ptr<std::atomic<std::uint64_t>> inflated_ = std::make_shared<std::atomic<std::uint64_t>>(0);
  std::vector<Entry> entries_;
  [[nodiscard]] static std::uint32_t name_hash(std::string_view s) noexcept {
    return statedict::detail::hash_index::mix(std::hash<std::string_view>{}(s));
  }
  statedict::detail::hash_index index_;  ///< entries_ by name
  std::uint64_t delta_ = 0;
  std::uint64_t cd_offset_ = 0;
  bool zip64_ = false;
};

// =============================================================================================
// Writing

struct write_options {
  /// Every entry's data starts at a multiple of this (torch: 64). A power of two, <= 4096.
  std::uint64_t alignment = 64;
  /// Entries whose size or local header offset reach this get ZIP64 fields (torch/miniz:
  /// 0xFFFFFFFF). Tests lower it to exercise the ZIP64 paths on small archives.
  std::uint64_t zip64_threshold = 0xFFFFFFFFU;
};

/// What to put in the archive: a name and a byte count per entry, in file order.
struct EntrySpec {
  std::string name;
  std::uint64_t size = 0;
};

/// Where one entry lives in the output.
struct EntryLayout {
  std::string name;
  std::uint64_t header_offset = 0;      ///< local header
  std::uint64_t data_offset = 0;        ///< first data byte (a multiple of the alignment)
  std::uint64_t size = 0;
  std::uint64_t descriptor_offset = 0;  ///< data descriptor, right after the data
  std::uint16_t padding = 0;            ///< bytes of 'Z' in the FB extra field
  bool zip64 = false;                   ///< size or header offset needs ZIP64 fields
  [[nodiscard]] std::uint64_t descriptor_size() const noexcept { return zip64 ? 24 : 16; }
  [[nodiscard]] std::uint64_t end_offset() const noexcept { return descriptor_offset + descriptor_size(); }
};

/// The byte layout of a whole archive, known before anything is written.
struct Layout {
  std::vector<EntryLayout> entries;
  std::uint64_t central_offset = 0;  ///< start of the central directory
  std::uint64_t central_size = 0;
  std::uint64_t end64_offset = 0;    ///< ZIP64 end record (followed by the locator and the end record)
  std::uint64_t total_size = 0;      ///< file size
  write_options options{};
};

namespace detail {
inline bool needs_zip64(std::uint64_t size, std::uint64_t header_offset, const write_options& o) noexcept {
  return size >= o.zip64_threshold || header_offset >= o.zip64_threshold;
}
inline std::uint64_t zip64_local_extra(std::uint64_t size, std::uint64_t header_offset, const write_options& o) noexcept {
  // miniz puts the 64-bit sizes (16 bytes) and/or the header offset (8 bytes) after a 4-byte header.
  if (!needs_zip64(size, header_offset, o)) return 0;
  return 4U + (size >= o.zip64_threshold ? 16U : 0U) + (header_offset >= o.zip64_threshold ? 8U : 0U);
}
inline std::uint64_t central_entry_size(const EntryLayout& e, const write_options& o) noexcept {
  return central_header_size + e.name.size() + zip64_local_extra(e.size, e.header_offset, o);
}
}  // namespace detail

/// Computes where every entry goes. `base` is the offset of the archive's first byte in the output
/// file (alignment is relative to the archive start, as torch does for archives written to a stream).
inline Layout plan(std::span<const EntrySpec> specs, const write_options& options = {}) {
  const auto& o = options;
  if (o.alignment == 0 || o.alignment > 4096 || (o.alignment & (o.alignment - 1)) != 0)
    throw_error(errors::zip_bad_writer_input, "alignment " + std::to_string(o.alignment) + " is not a power of two <= 4096");
  Layout L;
  L.options = o;
  L.entries.reserve(specs.size());
  std::uint64_t cursor = 0;
  for (const EntrySpec& s : specs) {
    if (s.name.empty() || s.name.size() > 0xFFFF || s.name.find('\0') != std::string::npos)
      throw_error(errors::zip_bad_writer_input, "entry name " + quote(s.name) + " is empty, too long or contains NUL");
    EntryLayout e;
    e.name = s.name;
    e.size = s.size;
    e.header_offset = cursor;
    e.zip64 = detail::needs_zip64(s.size, cursor, o);
    const std::uint64_t z64 = detail::zip64_local_extra(s.size, cursor, o);
    // The FB field is 4 bytes of header plus padding; torch counts its header even when no
    // padding is needed.
    const std::uint64_t unpadded = checked_add(cursor, detail::local_header_size + s.name.size() + z64 + 4, "archive size");
    const std::uint64_t pad = (o.alignment - unpadded % o.alignment) % o.alignment;
    e.padding = static_cast<std::uint16_t>(pad);
    e.data_offset = unpadded + pad;
    e.descriptor_offset = checked_add(e.data_offset, s.size, "archive size");
    cursor = e.end_offset();
    L.entries.push_back(std::move(e));
  }
  L.central_offset = cursor;
  for (const auto& e : L.entries) cursor = checked_add(cursor, detail::central_entry_size(e, o), "archive size");
  L.central_size = cursor - L.central_offset;
  L.end64_offset = cursor;
  L.total_size = checked_add(cursor, detail::end64_size + detail::locator64_size + detail::end_size, "archive size");
  return L;
}

inline Layout plan(std::initializer_list<EntrySpec> specs, const write_options& options = {}) {
  return plan(std::span<const EntrySpec>(specs.begin(), specs.size()), options);
}

/// Where plan() (and torch's writer) puts the data of an entry with this header offset, name and
/// size: after the local header, the name, any ZIP64 field and the FB padding. A prediction for
/// a reader that has not read the local header yet (Archive::read_options::defer_local_headers);
/// an archive from another writer may differ, so only the header says for sure.
inline std::uint64_t written_data_offset(const Archive& a, const Entry& e, const write_options& o = {}) {
  if (o.alignment == 0 || o.alignment > 4096 || (o.alignment & (o.alignment - 1)) != 0)
    throw_error(errors::zip_bad_writer_input, "alignment " + std::to_string(o.alignment) + " is not a power of two <= 4096");
  const std::uint64_t at = e.header_offset - std::min(e.header_offset, a.prefix_bytes());  // archive-relative, as plan() counts
  const std::uint64_t z64 = detail::zip64_local_extra(e.size, at, o);
  const std::uint64_t unpadded = checked_add(at, detail::local_header_size + e.name.size() + z64 + 4, "data offset");
  const std::uint64_t pad = (o.alignment - unpadded % o.alignment) % o.alignment;
  return checked_add(checked_add(unpadded, pad, "data offset"), a.prefix_bytes(), "data offset");
}

/// The local header of an entry, with its ZIP64 and FB padding extra fields (torch's bytes: version
/// 0, flags 0x0808 = UTF-8 names + data descriptor, stored, zero time, zero CRC and sizes).
inline std::vector<std::byte> local_header_bytes(const EntryLayout& e, const write_options& o = {}) {
  std::vector<std::byte> out;
  const std::uint64_t z64 = detail::zip64_local_extra(e.size, e.header_offset, o);
  const std::uint64_t extra_len = z64 + 4 + e.padding;
  out.reserve(static_cast<std::size_t>(detail::local_header_size + e.name.size() + extra_len));
  detail::wr32(out, detail::sig_local);
  detail::wr16(out, 0);       // version needed
  detail::wr16(out, 0x0808);  // flags
  detail::wr16(out, 0);       // stored
  detail::wr16(out, 0);       // time
  detail::wr16(out, 0);       // date
  detail::wr32(out, 0);       // crc (in the descriptor)
  detail::wr32(out, 0);       // compressed size
  detail::wr32(out, 0);       // size
  detail::wr16(out, e.name.size());
  detail::wr16(out, extra_len);
  detail::wrstr(out, e.name);
  if (z64) {
    detail::wr16(out, detail::extra_zip64);
    detail::wr16(out, z64 - 4);
    if (e.size >= o.zip64_threshold) {
      detail::wr64(out, e.size);
      detail::wr64(out, e.size);
    }
    if (e.header_offset >= o.zip64_threshold) detail::wr64(out, e.header_offset);
  }
  detail::wr16(out, detail::extra_padding);
  detail::wr16(out, e.padding);
  out.insert(out.end(), e.padding, std::byte{'Z'});
  return out;
}

/// The data descriptor that follows an entry's data.
inline std::vector<std::byte> descriptor_bytes(const EntryLayout& e, std::uint32_t crc) {
  std::vector<std::byte> out;
  detail::wr32(out, detail::sig_descriptor);
  detail::wr32(out, crc);
  if (e.zip64) {
    detail::wr64(out, e.size);
    detail::wr64(out, e.size);
  } else {
    detail::wr32(out, e.size);
    detail::wr32(out, e.size);
  }
  return out;
}

/// Central directory, ZIP64 end record, locator and end record, given every entry's CRC-32.
inline std::vector<std::byte> tail_bytes(const Layout& L, std::span<const std::uint32_t> crcs) {
  if (crcs.size() != L.entries.size())
    throw_error(errors::zip_bad_writer_input, std::to_string(crcs.size()) + " CRCs for " + std::to_string(L.entries.size()) + " entries");
  const auto& o = L.options;
  std::vector<std::byte> out;
  out.reserve(static_cast<std::size_t>(L.total_size - L.central_offset));
  for (std::size_t i = 0; i < L.entries.size(); ++i) {
    const EntryLayout& e = L.entries[i];
    const bool big_size = e.size >= o.zip64_threshold, big_offset = e.header_offset >= o.zip64_threshold;
    const std::uint64_t z64 = detail::zip64_local_extra(e.size, e.header_offset, o);
    detail::wr32(out, detail::sig_central);
    detail::wr16(out, 0);  // version made by
    detail::wr16(out, 0);  // version needed
    detail::wr16(out, 0x0808);
    detail::wr16(out, 0);  // stored
    detail::wr16(out, 0);
    detail::wr16(out, 0);
    detail::wr32(out, crcs[i]);
    detail::wr32(out, big_size ? detail::u32_max : e.size);
    detail::wr32(out, big_size ? detail::u32_max : e.size);
    detail::wr16(out, e.name.size());
    detail::wr16(out, z64);
    detail::wr16(out, 0);  // comment
    detail::wr16(out, 0);  // disk
    detail::wr16(out, 0);  // internal attributes
    detail::wr32(out, 0);  // external attributes
    detail::wr32(out, big_offset ? detail::u32_max : e.header_offset);
    detail::wrstr(out, e.name);
    if (z64) {
      detail::wr16(out, detail::extra_zip64);
      detail::wr16(out, z64 - 4);
      if (big_size) {
        detail::wr64(out, e.size);
        detail::wr64(out, e.size);
      }
      if (big_offset) detail::wr64(out, e.header_offset);
    }
  }
  const std::uint64_t n = L.entries.size();
  // ZIP64 end record (torch always writes it), its locator, then the classic end record with
  // escape values where a field does not fit.
  detail::wr32(out, detail::sig_end64);
  detail::wr64(out, detail::end64_size - 12);
  detail::wr16(out, 0x031e);  // made by: UNIX, 3.0 (as miniz)
  detail::wr16(out, 0x002d);  // needed: 4.5 (ZIP64)
  detail::wr32(out, 0);
  detail::wr32(out, 0);
  detail::wr64(out, n);
  detail::wr64(out, n);
  detail::wr64(out, L.central_size);
  detail::wr64(out, L.central_offset);
  detail::wr32(out, detail::sig_locator64);
  detail::wr32(out, 0);
  detail::wr64(out, L.end64_offset);
  detail::wr32(out, 1);
  detail::wr32(out, detail::sig_end);
  detail::wr16(out, 0);
  detail::wr16(out, 0);
  detail::wr16(out, std::min<std::uint64_t>(n, detail::u16_max));
  detail::wr16(out, std::min<std::uint64_t>(n, detail::u16_max));
  detail::wr32(out, std::min<std::uint64_t>(L.central_size, detail::u32_max));
  detail::wr32(out, L.central_offset >= o.zip64_threshold ? detail::u32_max : L.central_offset);
  detail::wr16(out, 0);
  return out;
}

/// Combines CRC-32s of pieces of one entry reported in any order (by several threads) into the
/// entry's CRC. Pieces must tile [0, size) exactly; `complete()` says whether they do.
class CrcPieces {
 public:
  struct Piece {
    std::uint64_t offset;
    std::uint64_t length;
    std::uint32_t crc;
  };
  void add(std::uint64_t offset, std::uint64_t length, std::uint32_t crc) { pieces_.push_back({offset, length, crc}); }
  [[nodiscard]] bool empty() const noexcept { return pieces_.empty(); }
  /// Sorts the pieces; true when they tile [0, size) without gap or overlap.
  [[nodiscard]] bool complete(std::uint64_t size) {
    std::sort(pieces_.begin(), pieces_.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
    std::uint64_t at = 0;
    for (const Piece& p : pieces_) {
      if (p.offset != at) return false;
      at += p.length;
    }
    return at == size;
  }
  /// The combined CRC (call after complete() returned true).
  [[nodiscard]] std::uint32_t combined() const noexcept {
    std::uint32_t c = 0;
    for (const Piece& p : pieces_) c = crc32_combine(c, p.crc, p.length);
    return c;
  }
  [[nodiscard]] const std::vector<Piece>& pieces() const noexcept { return pieces_; }

 private:
  std::vector<Piece> pieces_;
};

/// Sequential streaming writer: entries in layout order, each as a series of write() calls, with
/// the CRC computed on the way. Nothing is buffered beyond the caller's blocks.
class Writer {
 public:
  /// Writes into `out` starting at its current position (the archive's byte 0).
  Writer(OutputFile& out, Layout layout) : out_(out), layout_(std::move(layout)), base_(out.position()) {
    crcs_.resize(layout_.entries.size());
  }

  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }

  /// Starts the next entry (writes its local header).
  void begin_entry() {
    if (open_ || next_ >= layout_.entries.size())
      throw_error(errors::zip_writer_order, "begin_entry: no further entry in the layout or an entry is still open");
    const EntryLayout& e = layout_.entries[next_];
    expect_position(e.header_offset);
    out_.write(local_header_bytes(e, layout_.options));
    crc_ = 0;
    written_ = 0;
    open_ = true;
  }
  /// Appends data to the open entry.
  void write(std::span<const std::byte> bytes) {
    if (!open_) throw_error(errors::zip_writer_order, "write outside an entry");
    const EntryLayout& e = layout_.entries[next_];
    if (bytes.size() > e.size - written_)
      throw_error(errors::zip_writer_order, "entry " + quote(e.name) + ": more than its " + std::to_string(e.size) + " bytes");
    crc_ = crc32(bytes, crc_);
    out_.write(bytes);
    written_ += bytes.size();
  }
  /// Ends the open entry (writes its data descriptor).
  void end_entry() {
    if (!open_) throw_error(errors::zip_writer_order, "end_entry without begin_entry");
    const EntryLayout& e = layout_.entries[next_];
    if (written_ != e.size)
      throw_error(errors::zip_writer_order, "entry " + quote(e.name) + ": " + std::to_string(written_) + " of " +
                                                std::to_string(e.size) + " bytes written");
    out_.write(descriptor_bytes(e, crc_));
    crcs_[next_++] = crc_;
    open_ = false;
  }
  /// Writes a whole entry.
  void entry(std::span<const std::byte> bytes) {
    begin_entry();
    write(bytes);
    end_entry();
  }
  /// Writes the central directory and end records; the archive is complete.
  void finish() {
    if (open_ || next_ != layout_.entries.size())
      throw_error(errors::zip_writer_order, "finish: " + std::to_string(layout_.entries.size() - next_) + " entries not written");
    expect_position(layout_.central_offset);
    out_.write(tail_bytes(layout_, crcs_));
  }

 private:
  void expect_position(std::uint64_t rel) const {
    if (out_.position() != base_ + rel)
      throw_error(errors::zip_writer_order, "output at offset " + std::to_string(out_.position() - base_) +
                                                ", the layout expects " + std::to_string(rel));
  }

  OutputFile& out_;
  Layout layout_;
  std::uint64_t base_;
  std::vector<std::uint32_t> crcs_;
  std::size_t next_ = 0;
  std::uint32_t crc_ = 0;
  std::uint64_t written_ = 0;
  bool open_ = false;
};

}  // namespace zip
}  // namespace statedict::inline v0
