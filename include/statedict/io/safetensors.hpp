// statedict: safetensors files: a validated zero-copy reader, and the layout the writers use.
// SPDX-License-Identifier: MIT
//
// Format (huggingface/safetensors): u64 little-endian N, N bytes of UTF-8 JSON (the header), then
// the data section. The header maps each tensor name to {"dtype", "shape", "data_offsets"} (byte
// offsets into the data section) plus an optional "__metadata__" string-to-string map.
//
// Reading: `safetensors::File::open(path)` maps the file (or reads it with pread), validates the
// header with every rule of the reference reader (`read_metadata`, `Metadata::validate`), each
// violation with its own error id naming the file and the tensor, and exposes the tensors in file
// order as TensorViews into the mapping (no copy; each view keeps the mapping alive).
// `describe()` gives the ShardedCheckpoint of the file; `to_value()` the Value tree.
//
// Writing: `safetensors::layout` computes the header and every tensor's data offsets the
// reference writer (`serialize_to_file`) would produce, before a byte is written; the writers that
// stream the bytes are in formats/safetensors.hpp.
//
// statedict's own `__metadata__` keys (every other key is the user's and is kept as is):
//   "statedict.aliases"   JSON object {alias name: stored tensor name}: tied tensors written once
//   "statedict.skeleton"  the flatten skeleton (core/flatten.hpp) of a nested state, compact JSON
// docs/safetensors.md describes the rules, the ids and where statedict differs from the reference.
#pragma once

#include <fcntl.h>
#include <locale.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/cast.hpp"
#include "../core/dtype.hpp"
#include "../core/flatten.hpp"
#include "../core/hash_index.hpp"
#include "../core/detail/text.hpp"
#include "../core/error.hpp"
#include "../core/sha256.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../shard/checkpoint.hpp"
#include "file.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
// Reader: one id per rule of the reference reader (its error name in brackets), then statedict's own.
inline constexpr error_id st_header_too_large   {301, error_kind::limit,       "safetensors.header_too_large"};   // [HeaderTooLarge]
inline constexpr error_id st_header_too_small   {302, error_kind::format,      "safetensors.header_too_small"};   // [HeaderTooSmall]
inline constexpr error_id st_header_length      {303, error_kind::format,      "safetensors.header_length"};      // [InvalidHeaderLength]
inline constexpr error_id st_header_utf8        {304, error_kind::format,      "safetensors.header_utf8"};        // [InvalidHeader]
inline constexpr error_id st_header_json        {305, error_kind::format,      "safetensors.header_json"};        // [InvalidHeaderDeserialization]: syntax
inline constexpr error_id st_header_not_object  {306, error_kind::format,      "safetensors.header_not_object"};  // [InvalidHeaderDeserialization]
inline constexpr error_id st_json_depth         {307, error_kind::limit,       "safetensors.json_depth"};         // [InvalidHeaderDeserialization]: recursion limit
inline constexpr error_id st_duplicate_key      {308, error_kind::format,      "safetensors.duplicate_key"};      // statedict (reference: last wins)
inline constexpr error_id st_tensor_info        {309, error_kind::format,      "safetensors.tensor_info"};        // [InvalidHeaderDeserialization]: schema
inline constexpr error_id st_unknown_dtype      {310, error_kind::format,      "safetensors.unknown_dtype"};      // [InvalidHeaderDeserialization]
inline constexpr error_id st_bad_dim            {311, error_kind::format,      "safetensors.bad_dim"};            // [InvalidHeaderDeserialization]: not a usize
inline constexpr error_id st_bad_offset_value   {312, error_kind::format,      "safetensors.bad_offset_value"};   // [InvalidHeaderDeserialization]: not a usize
inline constexpr error_id st_metadata_type      {313, error_kind::format,      "safetensors.metadata_type"};      // [InvalidHeaderDeserialization]
inline constexpr error_id st_invalid_offset     {314, error_kind::format,      "safetensors.invalid_offset"};     // [InvalidOffset]
inline constexpr error_id st_overflow           {315, error_kind::format,      "safetensors.overflow"};           // [ValidationOverflow]
inline constexpr error_id st_misaligned_slice   {316, error_kind::format,      "safetensors.misaligned_slice"};   // [MisalignedSlice]
inline constexpr error_id st_size_mismatch      {317, error_kind::format,      "safetensors.size_mismatch"};      // [TensorInvalidInfo]
inline constexpr error_id st_incomplete_buffer  {318, error_kind::format,      "safetensors.incomplete_buffer"};  // [MetadataIncompleteBuffer]
inline constexpr error_id st_too_many_dims      {319, error_kind::limit,       "safetensors.too_many_dims"};      // statedict limit
inline constexpr error_id st_too_many_tensors   {320, error_kind::limit,       "safetensors.too_many_tensors"};   // statedict limit
inline constexpr error_id st_dim_too_large      {321, error_kind::limit,       "safetensors.dim_too_large"};      // statedict: dims are int64
inline constexpr error_id st_unsupported_dtype  {322, error_kind::unsupported, "safetensors.unsupported_dtype"};  // valid, but no statedict dtype
inline constexpr error_id st_statedict_metadata {323, error_kind::format,      "safetensors.statedict_metadata"}; // bad statedict.* metadata
inline constexpr error_id st_no_such_tensor     {324, error_kind::key,         "safetensors.no_such_tensor"};
inline constexpr error_id st_skeleton_depth     {325, error_kind::limit,       "safetensors.skeleton_depth"};     // statedict limit
// Writer.
inline constexpr error_id st_write_dtype        {330, error_kind::unsupported, "safetensors.write_dtype"};        // C128 has no safetensors dtype
inline constexpr error_id st_write_name         {331, error_kind::key,         "safetensors.write_name"};         // duplicate, reserved or non-UTF-8 name
inline constexpr error_id st_write_header_large {332, error_kind::limit,       "safetensors.write_header_too_large"};
inline constexpr error_id st_write_input        {333, error_kind::usage,       "safetensors.write_input"};        // inconsistent input
inline constexpr error_id st_write_metadata     {334, error_kind::usage,       "safetensors.write_metadata"};     // reserved key or non-UTF-8 text
// clang-format on
}  // namespace errors

namespace safetensors {

/// `__metadata__` key holding tied tensors: a JSON object {alias name: stored tensor name}.
inline constexpr std::string_view aliases_key = "statedict.aliases";
/// `__metadata__` key holding the flatten skeleton of a nested state (compact JSON text).
inline constexpr std::string_view skeleton_key = "statedict.skeleton";

/// A safetensors dtype as the reference knows it (its `Dtype` enum), with statedict's dtype when
/// statedict handles it.
struct dtype_entry {
  std::string_view name;
  std::uint8_t bits;                     ///< bits per element (F4 = 4, F6_* = 6)
  std::optional<statedict::dtype> type;  ///< nullopt: valid in files, but statedict has no such dtype
};

/// The reference's Dtype enum, in enum order (its writer sorts by this position, descending).
inline constexpr std::array<dtype_entry, 22> dtype_table{{
    {"BOOL", 8, statedict::dtype::BOOL},
    {"F4", 4, statedict::dtype::F4_X2},
    {"F6_E2M3", 6, statedict::dtype::F6_E2M3_X4},
    {"F6_E3M2", 6, statedict::dtype::F6_E3M2_X4},
    {"U8", 8, statedict::dtype::U8},
    {"I8", 8, statedict::dtype::I8},
    {"F8_E5M2", 8, statedict::dtype::F8_E5M2},
    {"F8_E4M3", 8, statedict::dtype::F8_E4M3},
    {"F8_E8M0", 8, statedict::dtype::F8_E8M0},
    {"F8_E4M3FNUZ", 8, statedict::dtype::F8_E4M3FNUZ},
    {"F8_E5M2FNUZ", 8, statedict::dtype::F8_E5M2FNUZ},
    {"I16", 16, statedict::dtype::I16},
    {"U16", 16, statedict::dtype::U16},
    {"F16", 16, statedict::dtype::F16},
    {"BF16", 16, statedict::dtype::BF16},
    {"I32", 32, statedict::dtype::I32},
    {"U32", 32, statedict::dtype::U32},
    {"F32", 32, statedict::dtype::F32},
    {"C64", 64, statedict::dtype::C64},
    {"F64", 64, statedict::dtype::F64},
    {"I64", 64, statedict::dtype::I64},
    {"U64", 64, statedict::dtype::U64},
}};

/// The name a dtype has in a safetensors header: name() except for the packed types, which
/// safetensors names by their values (F4_X2 is "F4", F6_E2M3_X4 "F6_E2M3", F6_E3M2_X4 "F6_E3M2").
constexpr std::string_view file_dtype_name(statedict::dtype t) noexcept {
  switch (t) {
    case statedict::dtype::F4_X2: return "F4";
    case statedict::dtype::F6_E2M3_X4: return "F6_E2M3";
    case statedict::dtype::F6_E3M2_X4: return "F6_E3M2";
    default: return name(t);
  }
}

/// Index into dtype_table of a dtype name, or -1.
inline int dtype_index(std::string_view name) noexcept {
  for (std::size_t i = 0; i < dtype_table.size(); ++i)
    if (dtype_table[i].name == name) return static_cast<int>(i);
  return -1;
}

/// Caps on hostile input. Every default accepts every file the reference reader accepts, except
/// where noted.
struct limits {
  /// Largest header (N) accepted: the reference's MAX_HEADER_SIZE. Also the cap the writer
  /// enforces, so that what statedict writes the reference can read.
  std::uint64_t max_header_bytes = 100'000'000;
  /// Deepest JSON nesting accepted (containers, the top-level object counting as 1): serde_json's
  /// recursion limit, which the reference inherits, allows 127.
  std::size_t max_json_depth = 127;
  /// Most dimensions per tensor. The reference has no cap (only the header size bounds it).
  std::size_t max_rank = 1024;
  /// Most tensors per file (at most 2^32 - 2). The reference has no cap; a 100 MB header holds
  /// about 2 million.
  std::size_t max_tensors = 10'000'000;
  /// Deepest JSON nesting of the flatten skeleton statedict stores in `__metadata__` (a tree nested
  /// N levels is about 2N deep). The skeleton is parsed without recursion, but copying and comparing
  /// a JSON value recurses once per level, so this bounds the stack a hostile skeleton can use.
  /// The default fits every tree the pickle reader accepts (pickle::limits::max_depth 1000).
  std::size_t max_skeleton_depth = 4096;
};

/// One tensor of a file.
struct TensorEntry {
  std::string name;
  std::string_view dtype_name;             ///< the reference's name ("F32", "F4", ...)
  /// statedict's dtype; nullopt when statedict cannot hold the tensor (a packed dtype whose last
  /// dimension does not split into whole elements: see unsupported_reason()).
  std::optional<statedict::dtype> dtype;
  std::uint8_t dtype_bits = 0;
  /// The shape in statedict's elements: the header's, except for the packed dtypes (F4, F6_*),
  /// whose last dimension counts values in the header and elements (2 or 4 values) here, as
  /// PyTorch's float4_e2m1fn_x2 does. `file_shape` is the header's.
  shape_t shape;
  shape_t file_shape;
  std::uint64_t begin = 0;  ///< byte offsets relative to the data section (data_offsets)
  std::uint64_t end = 0;
  [[nodiscard]] std::uint64_t nbytes() const noexcept { return end - begin; }
};

struct open_options {
  read_mode mode = read_mode::mmap;
  limits lim{};
};

/// Why statedict cannot hold entry `e` (its dtype is nullopt).
inline std::string unsupported_reason(const TensorEntry& e) {
  const int values = e.dtype_bits == 4 ? 2 : 4;
  return std::string(e.dtype_name) + to_string(e.file_shape) + ": statedict holds " + std::string(e.dtype_name) +
         " values in elements of " + std::to_string(values) + " (as PyTorch's float4_e2m1fn_x2 holds 2), so the last dimension must be a multiple of " +
         std::to_string(values);
}

}  // namespace safetensors
}  // namespace statedict::inline v0

// The header parser (a strict JSON scanner and the schema checks), which needs the types above.
#include "detail/safetensors_header.hpp"

namespace statedict::inline v0 {
namespace safetensors {

namespace detail {

/// Name -> position index over names stored elsewhere (core/hash_index.hpp): `names[i].name`.
class name_index {
 public:
  static constexpr std::size_t npos = ~std::size_t{0};

  /// Prepares for `n` names.
  void reset(std::size_t n) {
    index_.clear();
    index_.reserve(n);
  }
  /// Adds names[i]; returns false when an equal name is already indexed.
  template <class Names>
  bool insert(const Names& names, std::size_t i) {
    const std::string_view key = names[i].name;
    const std::uint32_t h = hash_of(key);
    if (index_.find(h, [&](std::uint32_t p) { return std::string_view(names[p].name) == key; }) != statedict::detail::hash_index::npos) return false;
    index_.add(h, i);
    return true;
  }
  template <class Names>
  [[nodiscard]] std::size_t find(const Names& names, std::string_view key) const {
    const std::uint32_t p = index_.find(hash_of(key), [&](std::uint32_t q) { return std::string_view(names[q].name) == key; });
    return p == statedict::detail::hash_index::npos ? npos : p;
  }

 private:
  static std::uint32_t hash_of(std::string_view s) noexcept { return statedict::detail::hash_index::mix(std::hash<std::string_view>{}(s)); }
  statedict::detail::hash_index index_;
};

/// Everything `File` holds; shared by copies of a File.
struct file_state {
  std::shared_ptr<const ByteSource> source;
  std::string name;
  std::uint64_t header_size = 0;  // N
  std::vector<TensorEntry> entries;
  name_index index;
  std::optional<std::map<std::string, std::string>> raw_metadata;
  std::map<std::string, std::string> metadata;  // without statedict's keys
  std::vector<std::pair<std::string, std::string>> aliases;
  std::unordered_map<std::string_view, std::size_t> alias_index;  // alias -> entry
  nlohmann::json skeleton;
};

}  // namespace detail

/// A validated safetensors file. Copies share the same state (cheap).
class File {
 public:
  /// Opens and validates `path` (mapped by default; `read_mode::pread` reads with positioned reads).
  static File open(const std::filesystem::path& path, const open_options& opt = {}) {
    return open(InputFile::open(path, opt.mode), opt.lim);
  }

  /// Validates a file held by any byte source (a mapping, a pread file, a buffer, a slice).
  static File open(std::shared_ptr<const ByteSource> src, const limits& lim = {}) {
    File f;
    auto st = std::make_shared<detail::file_state>();
    st->source = std::move(src);
    st->name = st->source->name();
    parse(*st, lim);
    f.s_ = std::move(st);
    return f;
  }

  [[nodiscard]] const std::string& name() const noexcept { return s_->name; }
  [[nodiscard]] const std::shared_ptr<const ByteSource>& source() const noexcept { return s_->source; }
  /// N: the header's length in bytes (JSON and padding).
  [[nodiscard]] std::uint64_t header_size() const noexcept { return s_->header_size; }
  /// Byte offset of the data section in the file: 8 + N.
  [[nodiscard]] std::uint64_t data_offset() const noexcept { return 8 + s_->header_size; }
  /// Tensors in file order (by data offset).
  [[nodiscard]] const std::vector<TensorEntry>& entries() const noexcept { return s_->entries; }
  [[nodiscard]] std::size_t size() const noexcept { return s_->entries.size(); }
  /// The stored tensor named `name`, or nullptr (aliases are not stored tensors; see resolve()).
  [[nodiscard]] const TensorEntry* find(std::string_view name) const {
    const std::size_t i = s_->index.find(s_->entries, name);
    return i == detail::name_index::npos ? nullptr : &s_->entries[i];
  }
  /// The stored tensor `name` refers to, following an alias; nullptr when neither.
  [[nodiscard]] const TensorEntry* resolve(std::string_view name) const {
    if (const TensorEntry* e = find(name)) return e;
    auto it = s_->alias_index.find(name);
    return it == s_->alias_index.end() ? nullptr : &s_->entries[it->second];
  }
  /// `__metadata__` exactly as in the file (nullopt when absent or null).
  [[nodiscard]] const std::optional<std::map<std::string, std::string>>& raw_metadata() const noexcept {
    return s_->raw_metadata;
  }
  /// `__metadata__` without statedict's own keys: the user's metadata.
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return s_->metadata; }
  /// Tied tensors: (alias, stored tensor) pairs recorded by statedict's writer.
  [[nodiscard]] const std::vector<std::pair<std::string, std::string>>& aliases() const noexcept { return s_->aliases; }
  /// The flatten skeleton statedict stored, or null (a plain flat file).
  [[nodiscard]] const nlohmann::json& skeleton() const noexcept { return s_->skeleton; }

  /// The tensor as a view. Mapped or in-memory sources: zero copy, the view keeps the mapping
  /// alive. pread sources: the bytes are read now into a fresh aligned buffer.
  [[nodiscard]] TensorView view(const TensorEntry& e) const {
    if (!e.dtype) throw_error(errors::st_unsupported_dtype, "file " + quote(name()) + ": tensor " + quote(e.name), unsupported_reason(e));
    const std::uint64_t off = data_offset() + e.begin;
    if (const std::byte* base = s_->source->data())
      return TensorView::contiguous(*e.dtype, e.shape, base + off, s_->source->owner());
    Tensor t(*e.dtype, e.shape);
    s_->source->read(off, std::span<std::byte>(t.data(), static_cast<std::size_t>(e.nbytes())));
    return t.view();
  }
  /// SHA-256 (hex) of the tensor's stored bytes, which are its elements row-major and
  /// little-endian: what `inspect --hash` prints. Streams from the source in bounded memory, in
  /// both read modes and for every dtype (those statedict lacks included).
  [[nodiscard]] std::string sha256(const TensorEntry& e) const {
    Sha256 h;
    const std::uint64_t off = data_offset() + e.begin;
    const ByteSource& src = *s_->source;
    if (const std::byte* base = src.data()) {
      if (const auto* f = dynamic_cast<const InputFile*>(&src)) f->advise(off, e.nbytes(), access_hint::sequential);
      h.update(std::span<const std::byte>(base + off, static_cast<std::size_t>(e.nbytes())));
      return h.hex();
    }
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min<std::uint64_t>(e.nbytes(), std::uint64_t{1} << 20)));
    for (std::uint64_t done = 0; done < e.nbytes();) {
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(e.nbytes() - done, buf.size()));
      src.read(off + done, std::span<std::byte>(buf.data(), take));
      h.update(std::span<const std::byte>(buf.data(), take));
      done += take;
    }
    return h.hex();
  }
  /// sha256() of the tensor (or alias) named `name`.
  [[nodiscard]] std::string sha256(std::string_view name) const {
    const TensorEntry* e = resolve(name);
    if (!e) throw_error(errors::st_no_such_tensor, "file " + quote(this->name()), "no tensor " + quote(name));
    return sha256(*e);
  }

  /// The tensor (or alias) named `name`; throws errors::st_no_such_tensor.
  [[nodiscard]] TensorView view(std::string_view name) const {
    const TensorEntry* e = resolve(name);
    if (!e) throw_error(errors::st_no_such_tensor, "file " + quote(this->name()), "no tensor " + quote(name));
    return view(*e);
  }
  [[nodiscard]] TensorView view(std::size_t i) const { return view(s_->entries.at(i)); }

  /// The file as a ShardedCheckpoint: format "safetensors", one source (this file), one chunk per
  /// stored tensor covering its whole box, metadata = the user's `__metadata__`. The skeleton is
  /// the one statedict stored; for a plain file it is null (a flat dict of the tensors in file
  /// order), or, when the file records aliases, the flat dict's skeleton with an alias node per
  /// alias (so ties survive a conversion). Reads no tensor data.
  [[nodiscard]] ShardedCheckpoint describe() const {
    ShardedCheckpoint c;
    c.format = "safetensors";
    c.sources.push_back(s_->source);
    c.tensors.reserve(s_->entries.size());
    for (const TensorEntry& e : s_->entries) c.tensors.push_back(info_of(e, e.name));
    c.skeleton = s_->skeleton;
    if (c.skeleton.is_null() && !s_->aliases.empty()) c.skeleton = flat_skeleton_with_aliases(c.tensors, s_->aliases);
    c.metadata = s_->metadata;
    return c;
  }

  /// The skeleton of a flat dict: the tensors in order, then each alias as an alias node.
  static nlohmann::json flat_skeleton_with_aliases(const std::vector<TensorInfo>& tensors,
                                                   const std::vector<std::pair<std::string, std::string>>& aliases) {
    nlohmann::json sk = flat_skeleton(tensors);
    auto& items = sk["root"]["dict"];
    for (const auto& [alias, target] : aliases) items.push_back(nlohmann::json::array({alias, {{"alias", target}}}));
    return sk;
  }

  /// The file as a Value: without a skeleton, a dict {name: tensor} in file order, then the
  /// aliases (the same view as their target). With a skeleton, use core/flatten.hpp's unflatten
  /// on `tensors()` and `skeleton()`.
  [[nodiscard]] Value to_flat_dict() const {
    Dict d;
    d.reserve(s_->entries.size() + s_->aliases.size());
    for (const TensorEntry& e : s_->entries) d.insert(e.name, view(e));
    for (const auto& [alias, target] : s_->aliases) d.insert(alias, d.at(target));
    return Value(std::move(d));
  }

 private:
  [[nodiscard]] TensorInfo info_of(const TensorEntry& e, const std::string& as) const {
    if (!e.dtype) throw_error(errors::st_unsupported_dtype, "file " + quote(name()) + ": tensor " + quote(e.name), unsupported_reason(e));
    TensorInfo t;
    t.name = as;
    t.dtype = *e.dtype;
    t.shape = e.shape;
    Chunk ch;
    ch.region = Box{shape_t(e.shape.size(), 0), e.shape};
    ch.at.source = 0;
    ch.at.byte_offset = data_offset() + e.begin;
    ch.at.stored = *e.dtype;
    t.chunks.push_back(std::move(ch));
    return t;
  }

  static void parse(detail::file_state& st, const limits& lim) {
    const ByteSource& src = *st.source;
    const std::string where = "file " + quote(st.name);
    const std::uint64_t len = src.size();
    if (len < 8) throw_error(errors::st_header_too_small, where, "file has " + std::to_string(len) + " bytes, fewer than 8");
    std::byte nb[8];
    src.read(0, nb);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<std::uint64_t>(nb[i]);
    if (n > lim.max_header_bytes)
      throw_error(errors::st_header_too_large, where,
                  "header length " + std::to_string(n) + " exceeds the cap of " + std::to_string(lim.max_header_bytes) +
                      " bytes (limits::max_header_bytes)");
    if (n > len - 8)
      throw_error(errors::st_header_length, where,
                  "header length " + std::to_string(n) + " runs past the end of the " + std::to_string(len) + "-byte file");
    st.header_size = n;
    const Region hr = read_region(src, 8, n);
    const auto* h = reinterpret_cast<const unsigned char*>(hr.data);
    const std::size_t bad = detail::first_invalid_utf8(std::string_view(reinterpret_cast<const char*>(h), static_cast<std::size_t>(n)));
    if (bad != std::string_view::npos)
      throw_error(errors::st_header_utf8, where, "header is not UTF-8 (bad byte at header offset " + std::to_string(bad) + ")");
    detail::header_parser p(lim, where);
    const char* first = reinterpret_cast<const char*>(h);
    try {
      detail::parse_json(first, static_cast<std::size_t>(n), p, where);
      p.finish();
    } catch (const error& e) {
      // serde parses the whole text before it checks the schema: a syntax error anywhere wins.
      if (detail::is_schema_error(e.code())) detail::check_syntax(first, n, lim, where);
      throw;
    }

    // File order: by (begin, end), stable (the reference sorts by data_offsets).
    std::vector<std::uint32_t> perm(p.entries.size());
    for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<std::uint32_t>(i);
    bool sorted = true;
    for (std::size_t i = 1; i < p.entries.size() && sorted; ++i)
      if (std::pair(p.entries[i].begin, p.entries[i].end) < std::pair(p.entries[i - 1].begin, p.entries[i - 1].end))
        sorted = false;
    if (sorted) {
      st.entries = std::move(p.entries);
    } else {
      std::stable_sort(perm.begin(), perm.end(), [&](std::uint32_t a, std::uint32_t b) {
        return std::pair(p.entries[a].begin, p.entries[a].end) < std::pair(p.entries[b].begin, p.entries[b].end);
      });
      st.entries.reserve(perm.size());
      for (std::uint32_t i : perm) st.entries.push_back(std::move(p.entries[i]));
    }

    // Names are unique (statedict's rule; the reference keeps the last of duplicates).
    st.index.reset(st.entries.size());
    for (std::size_t i = 0; i < st.entries.size(); ++i)
      if (!st.index.insert(st.entries, i))
        throw_error(errors::st_duplicate_key, where + ": tensor " + quote(st.entries[i].name),
                    "the name appears twice in the header");

    // Metadata::validate, rule by rule in the reference's order.
    std::uint64_t start = 0;
    for (const TensorEntry& e : st.entries) {
      const auto at_ = [&] { return where + ": tensor " + quote(e.name); };
      if (e.begin != start || e.end < e.begin)
        throw_error(errors::st_invalid_offset, at_(),
                    "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "], expected to start at " +
                        std::to_string(start) + " (offsets must be contiguous from 0)");
      start = e.end;
      std::uint64_t numel = 1;
      for (dim_t d : e.shape)
        if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel))
          throw_error(errors::st_overflow, at_(), "element count of shape " + to_string(e.shape) + " overflows 64 bits");
      std::uint64_t bits = 0;
      if (__builtin_mul_overflow(numel, std::uint64_t{e.dtype_bits}, &bits))
        throw_error(errors::st_overflow, at_(),
                    "bit size of " + std::string(e.dtype_name) + to_string(e.shape) + " overflows 64 bits");
      if (bits % 8 != 0)
        throw_error(errors::st_misaligned_slice, at_(),
                    std::string(e.dtype_name) + to_string(e.shape) + " is not a whole number of bytes");
      if (e.end - e.begin != bits / 8)
        throw_error(errors::st_size_mismatch, at_(),
                    std::string(e.dtype_name) + to_string(e.shape) + " needs " + std::to_string(bits / 8) +
                        " bytes, data_offsets give " + std::to_string(e.end - e.begin));
      if (numel > max_size)
        throw_error(errors::st_overflow, at_(), "element count " + std::to_string(numel) + " exceeds 2^63-1");
    }
    // The packed dtypes in statedict's elements (the last dimension divided by the values per element).
    for (TensorEntry& e : st.entries) {
      e.file_shape = e.shape;
      if (!e.dtype || info(*e.dtype).packed == 1) continue;
      const auto per = static_cast<dim_t>(info(*e.dtype).packed);
      if (e.shape.empty() || e.shape.back() % per != 0) e.dtype.reset();
      else e.shape.back() /= per;
    }
    const std::uint64_t data_len = len - 8 - n;
    if (start != data_len)
      throw_error(errors::st_incomplete_buffer, where,
                  "tensor data ends at byte " + std::to_string(start) + " of the data section, which has " +
                      std::to_string(data_len) + " bytes (no holes or trailing bytes allowed)");

    if (p.metadata) {
      st.raw_metadata.emplace();
      for (auto& [k, v] : *p.metadata) st.raw_metadata->emplace(k, v);
      for (const auto& [k, v] : *st.raw_metadata)
        if (k != aliases_key && k != skeleton_key) st.metadata.emplace(k, v);
      read_statedict_metadata(st, where, lim);
    }
  }

  /// Nesting depth of a JSON value (a scalar is 0), without recursion; stops counting past `cap`.
  static std::size_t json_depth(const nlohmann::json& root, std::size_t cap) {
    std::vector<std::pair<const nlohmann::json*, std::size_t>> todo{{&root, 0}};
    std::size_t deepest = 0;
    while (!todo.empty()) {
      const auto [j, d] = todo.back();
      todo.pop_back();
      if (!j->is_structured()) continue;
      deepest = std::max(deepest, d + 1);
      if (deepest > cap) return deepest;
      for (const auto& child : *j) todo.emplace_back(&child, d + 1);
    }
    return deepest;
  }

  static void read_statedict_metadata(detail::file_state& st, const std::string& where, const limits& lim) {
    const auto& md = *st.raw_metadata;
    if (auto it = md.find(std::string(aliases_key)); it != md.end()) {
      const std::string at = where + ": __metadata__ " + quote(aliases_key);
      nlohmann::ordered_json j = nlohmann::ordered_json::parse(it->second, nullptr, false);
      if (!j.is_object()) throw_error(errors::st_statedict_metadata, at, "not a JSON object of strings");
      for (auto& [alias, target] : j.items()) {
        if (!target.is_string()) throw_error(errors::st_statedict_metadata, at, "alias " + quote(alias) + " is not a string");
        const std::string& t = target.get_ref<const std::string&>();
        if (st.index.find(st.entries, t) == detail::name_index::npos)
          throw_error(errors::st_statedict_metadata, at, "alias " + quote(alias) + " refers to a missing tensor " + quote(t));
        if (st.index.find(st.entries, alias) != detail::name_index::npos)
          throw_error(errors::st_statedict_metadata, at, "alias " + quote(alias) + " is also a stored tensor");
        st.aliases.emplace_back(alias, t);
      }
      st.alias_index.reserve(st.aliases.size());
      for (const auto& [alias, target] : st.aliases)
        if (!st.alias_index.emplace(alias, st.index.find(st.entries, target)).second)
          throw_error(errors::st_statedict_metadata, at, "alias " + quote(alias) + " appears twice");
    }
    if (auto it = md.find(std::string(skeleton_key)); it != md.end()) {
      st.skeleton = nlohmann::json::parse(it->second, nullptr, false);
      if (st.skeleton.is_discarded() || !st.skeleton.is_object())
        throw_error(errors::st_statedict_metadata, where + ": __metadata__ " + quote(skeleton_key), "not a JSON object");
      if (json_depth(st.skeleton, lim.max_skeleton_depth) > lim.max_skeleton_depth)
        throw_error(errors::st_skeleton_depth, where + ": __metadata__ " + quote(skeleton_key),
                    "JSON nested deeper than " + std::to_string(lim.max_skeleton_depth) + " levels (limits::max_skeleton_depth)");
    }
  }

  std::shared_ptr<const detail::file_state> s_;
};

// =============================================================================================
// Writer

/// What the layout needs to know of one tensor.
struct TensorSpec {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
};

/// One tensor placed in a file being written.
struct LayoutEntry {
  std::size_t index = 0;  ///< position in the specs given to layout()
  std::uint64_t begin = 0;  ///< data_offsets, relative to the data section
  std::uint64_t end = 0;
};

/// Where everything goes in a file: the header bytes and each tensor's data offsets.
struct Layout {
  /// The file's first `data_start()` bytes: u64 length, JSON, space padding.
  std::string header;
  /// Tensors in file order (the reference's: dtype descending, then name).
  std::vector<LayoutEntry> entries;
  [[nodiscard]] std::uint64_t data_start() const noexcept { return header.size(); }
  /// Total file size.
  std::uint64_t file_size = 0;
};

namespace detail {
inline std::string where_tensor(std::string_view name) { return "tensor " + quote(name); }
}  // namespace detail

/// Computes the header and data offsets the reference writer would produce for these tensors and
/// this `__metadata__` (nullopt: no `__metadata__` key at all). Throws for C128, duplicate or
/// reserved names, non-UTF-8 text, and headers above `lim.max_header_bytes`.
inline Layout layout(std::span<const TensorSpec> specs, const std::optional<std::map<std::string, std::string>>& metadata,
                     const limits& lim = {}) {
  Layout out;
  std::vector<std::size_t> order(specs.size());
  std::vector<std::int8_t> rank(specs.size());
  {
    detail::name_index names;
    names.reset(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& s = specs[i];
      order[i] = i;
      rank[i] = info(s.dtype).safetensors_rank;
      if (rank[i] < 0)
        throw_error(errors::st_write_dtype, detail::where_tensor(s.name),
                    std::string(name(s.dtype)) + " cannot be stored in safetensors (it has no such dtype)");
      if (info(s.dtype).packed != 1 && s.shape.empty())
        throw_error(errors::st_write_dtype, detail::where_tensor(s.name),
                    "a 0-d " + std::string(name(s.dtype)) + " tensor: safetensors counts " + std::string(file_dtype_name(s.dtype)) +
                        " values in the last dimension, which a 0-d tensor does not have");
      if (s.name == "__metadata__")
        throw_error(errors::st_write_name, detail::where_tensor(s.name), "the name is reserved for the metadata");
      if (!detail::valid_utf8(s.name)) throw_error(errors::st_write_name, detail::where_tensor(s.name), "the name is not UTF-8");
      if (!names.insert(specs, i)) throw_error(errors::st_write_name, detail::where_tensor(s.name), "the name appears twice");
      check_shape(s.shape);
    }
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (rank[a] != rank[b]) return rank[a] > rank[b];
    return specs[a].name < specs[b].name;
  });
  std::string& h = out.header;
  h.reserve(64 + specs.size() * 72);
  h.assign(8, '\0');
  h += '{';
  bool first = true;
  if (metadata) {
    h += "\"__metadata__\":{";
    bool mfirst = true;
    for (const auto& [k, v] : *metadata) {
      if (!detail::valid_utf8(k) || !detail::valid_utf8(v))
        throw_error(errors::st_write_metadata, "__metadata__ key " + quote(k), "not UTF-8");
      if (!mfirst) h += ',';
      mfirst = false;
      detail::append_json_string(h, k);
      h += ':';
      detail::append_json_string(h, v);
    }
    h += '}';
    first = false;
  }
  std::uint64_t offset = 0;
  out.entries.reserve(specs.size());
  for (std::size_t i : order) {
    const TensorSpec& s = specs[i];
    const std::uint64_t nbytes = byte_size(s.shape, itemsize(s.dtype));
    if (!first) h += ',';
    first = false;
    detail::append_json_string(h, s.name);
    h += ":{\"dtype\":\"";
    h += file_dtype_name(s.dtype);
    h += "\",\"shape\":[";
    for (std::size_t d = 0; d < s.shape.size(); ++d) {
      if (d) h += ',';
      std::uint64_t dim = static_cast<std::uint64_t>(s.shape[d]);
      if (d + 1 == s.shape.size()) dim = checked_mul(dim, info(s.dtype).packed, "packed last dimension");  // values, not elements
      detail::append_uint(h, dim);
    }
    h += "],\"data_offsets\":[";
    detail::append_uint(h, offset);
    h += ',';
    const std::uint64_t end = checked_add(offset, nbytes, "data section size");
    detail::append_uint(h, end);
    h += "]}";
    out.entries.push_back(LayoutEntry{i, offset, end});
    offset = end;
  }
  h += '}';
  while (h.size() % 8 != 0) h += ' ';
  const std::uint64_t n = h.size() - 8;
  if (n > lim.max_header_bytes)
    throw_error(errors::st_write_header_large, "header",
                std::to_string(n) + " bytes exceed the cap of " + std::to_string(lim.max_header_bytes) +
                    " (readers refuse larger headers)");
  for (int i = 0; i < 8; ++i) h[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.file_size = checked_add(h.size(), offset, "file size");
  return out;
}

namespace detail {

/// Rewrites the dtype of every floating-point tensor and view node of a flatten skeleton to `to`,
/// so that the skeleton describes what a cast write stores. Iterative (any depth).
inline void cast_skeleton(nlohmann::json& skeleton, statedict::dtype to) {
  std::vector<nlohmann::json*> work{&skeleton};
  while (!work.empty()) {
    nlohmann::json* j = work.back();
    work.pop_back();
    if (j->is_object()) {
      if ((j->contains("tensor") || j->contains("view_of")) && j->contains("dtype") && (*j)["dtype"].is_string()) {
        const auto d = dtype_from_name((*j)["dtype"].get_ref<const std::string&>());
        if (d && is_floating(*d)) (*j)["dtype"] = std::string(name(to));
      }
      for (auto& [k, v] : j->items()) work.push_back(&v);
    } else if (j->is_array()) {
      for (auto& v : *j) work.push_back(&v);
    }
  }
}

}  // namespace detail

/// The Value tree a file holds: with a statedict skeleton, the tree that was written (unflatten);
/// otherwise a flat dict {name: tensor} in file order, aliases resolved to views of their target.
inline Value read_state(const File& f) {
  if (f.skeleton().is_null()) return f.to_flat_dict();
  NamedTensors t;
  t.reserve(f.size());
  for (const auto& e : f.entries()) t.emplace_back(e.name, f.view(e));
  try {
    return unflatten(t, f.skeleton());
  } catch (error& e) {
    e.add_context("file " + quote(f.name()) + ": __metadata__ " + quote(skeleton_key));
    throw;
  }
}

}  // namespace safetensors
}  // namespace statedict::inline v0

