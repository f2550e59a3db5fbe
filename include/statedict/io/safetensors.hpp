// statedict: safetensors files: a validated zero-copy reader and a streaming, atomic writer.
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
// Writing: `safetensors::write(path, inputs, options)` computes the header from names, dtypes and
// shapes first (`safetensors::layout`, also usable on its own), then streams each tensor's bytes in
// file order from its view or byte source, casting on the fly when asked, through a fixed-size
// buffer; the file appears atomically. The output is byte-identical to the reference writer's
// (`serialize_to_file`) for the same tensors and metadata.
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
    {"F4", 4, std::nullopt},
    {"F6_E2M3", 6, std::nullopt},
    {"F6_E3M2", 6, std::nullopt},
    {"U8", 8, statedict::dtype::U8},
    {"I8", 8, statedict::dtype::I8},
    {"F8_E5M2", 8, statedict::dtype::F8_E5M2},
    {"F8_E4M3", 8, statedict::dtype::F8_E4M3},
    {"F8_E8M0", 8, std::nullopt},
    {"F8_E4M3FNUZ", 8, std::nullopt},
    {"F8_E5M2FNUZ", 8, std::nullopt},
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
  std::string_view dtype_name;             ///< the reference's name ("F32", "F8_E8M0", ...)
  std::optional<statedict::dtype> dtype;   ///< nullopt for the dtypes statedict lacks (see dtype_table)
  std::uint8_t dtype_bits = 0;
  shape_t shape;
  std::uint64_t begin = 0;  ///< byte offsets relative to the data section (data_offsets)
  std::uint64_t end = 0;
  [[nodiscard]] std::uint64_t nbytes() const noexcept { return end - begin; }
};

struct open_options {
  read_mode mode = read_mode::mmap;
  limits lim{};
};

namespace detail {

/// True when [s, s + n) is valid UTF-8 (Rust's `str::from_utf8` rules: no overlong forms, no
/// surrogates, nothing above U+10FFFF); otherwise `bad_at` is the offset of the first bad byte.
inline bool valid_utf8(const unsigned char* s, std::size_t n, std::size_t& bad_at) noexcept {
  std::size_t i = 0;
  while (i < n) {
    while (i + 8 <= n) {
      std::uint64_t w;
      std::memcpy(&w, s + i, 8);
      if ((w & 0x8080808080808080ULL) != 0) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c == 0xE0) {
      need = 2, lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      need = 2;
    } else if (c == 0xED) {
      need = 2, hi = 0x9F;
    } else if (c == 0xF0) {
      need = 3, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      need = 3;
    } else if (c == 0xF4) {
      need = 3, hi = 0x8F;
    } else {
      bad_at = i;
      return false;
    }
    if (i + need >= n) {  // not enough bytes left
      bad_at = i;
      return false;
    }
    if (s[i + 1] < lo || s[i + 1] > hi) {
      bad_at = i;
      return false;
    }
    for (std::size_t k = 2; k <= need; ++k)
      if ((s[i + k] & 0xC0) != 0x80) {
        bad_at = i;
        return false;
      }
    i += need + 1;
  }
  return true;
}

inline bool valid_utf8(std::string_view s) noexcept {
  std::size_t bad = 0;
  return valid_utf8(reinterpret_cast<const unsigned char*>(s.data()), s.size(), bad);
}

// JSON text as serde_json writes it (the same as nlohmann's dump() for UTF-8).
using statedict::detail::append_json_string;
using statedict::detail::append_uint;

/// A one-line, bounded, printable rendering of a JSON parser message (it may quote input bytes).
inline std::string sanitize_message(std::string_view m) {
  std::string q = quote(m, 240);
  return q.substr(1, q.size() - 2);
}

/// The "C" locale, so that number parsing never depends on the program's global locale.
inline locale_t c_locale() {
  static const locale_t loc = ::newlocale(LC_ALL_MASK, "C", static_cast<locale_t>(nullptr));
  return loc;
}

/// A strict JSON (RFC 8259) reader with serde_json's rules, driving a SAX-style handler: JSON
/// whitespace is ' ', \t, \n, \r; no comments, no trailing commas, no byte-order mark; strings
/// may not hold raw control characters, escapes must be valid and surrogates paired; a number
/// beyond f64 is an error even where its value is ignored. Throws errors::st_header_json with the
/// offset of the problem. Iterative: the handler bounds the nesting depth. The input must already
/// be valid UTF-8.
template <class Handler>
void parse_json(const char* const begin, const std::size_t size, Handler& h, const std::string& where) {
  const char* p = begin;
  const char* const end = begin + size;
  std::string buf;
  std::string numtext;
  std::vector<char> stack;
  auto fail = [&](const char* at, const char* what) {
    throw_error(errors::st_header_json, where,
                "invalid JSON at header byte " + std::to_string(at - begin) + ": " + what);
  };
  auto skip_ws = [&] {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) ++p;
  };
  auto hex4 = [&]() -> std::uint32_t {
    if (end - p < 4) fail(p, "EOF in a \\u escape");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++p) {
      const char c = *p;
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<std::uint32_t>(c - 'A' + 10);
      else fail(p, "invalid \\u escape");
    }
    return v;
  };
  auto put_utf8 = [&](std::uint32_t cp) {
    if (cp < 0x80) {
      buf += static_cast<char>(cp);
    } else if (cp < 0x800) {
      buf += static_cast<char>(0xC0 | (cp >> 6));
      buf += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      buf += static_cast<char>(0xE0 | (cp >> 12));
      buf += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      buf += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      buf += static_cast<char>(0xF0 | (cp >> 18));
      buf += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      buf += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      buf += static_cast<char>(0x80 | (cp & 0x3F));
    }
  };
  // Reads a string (p at the opening quote) into buf.
  auto parse_string = [&] {
    ++p;
    buf.clear();
    const char* run = p;
    for (;;) {
      if (p == end) fail(p, "EOF while parsing a string");
      const auto c = static_cast<unsigned char>(*p);
      if (c == '"') {
        buf.append(run, static_cast<std::size_t>(p - run));
        ++p;
        return;
      }
      if (c < 0x20) fail(p, "control character in a string");
      if (c != '\\') {
        ++p;
        continue;
      }
      buf.append(run, static_cast<std::size_t>(p - run));
      ++p;
      if (p == end) fail(p, "EOF while parsing a string");
      switch (*p++) {
        case '"': buf += '"'; break;
        case '\\': buf += '\\'; break;
        case '/': buf += '/'; break;
        case 'b': buf += '\b'; break;
        case 'f': buf += '\f'; break;
        case 'n': buf += '\n'; break;
        case 'r': buf += '\r'; break;
        case 't': buf += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail(p, "lone trailing surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (end - p < 2 || p[0] != '\\' || p[1] != 'u') fail(p, "lone leading surrogate in a \\u escape");
            p += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail(p, "lone leading surrogate in a \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(cp);
          break;
        }
        default: fail(p - 1, "invalid escape");
      }
      run = p;
    }
  };
  auto digit = [&] { return p < end && *p >= '0' && *p <= '9'; };
  auto parse_number = [&] {
    const char* start = p;
    const bool neg = *p == '-';
    if (neg) ++p;
    if (p < end && *p == '0') {
      ++p;
    } else if (digit()) {
      while (digit()) ++p;
    } else {
      fail(p, "invalid number");
    }
    bool integral = true;
    if (p < end && *p == '.') {
      ++p;
      if (!digit()) fail(p, "invalid number");
      while (digit()) ++p;
      integral = false;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
      ++p;
      if (p < end && (*p == '+' || *p == '-')) ++p;
      if (!digit()) fail(p, "invalid number");
      while (digit()) ++p;
      integral = false;
    }
    if (integral && !neg) {
      std::uint64_t v = 0;
      bool fits = true;
      for (const char* q = start; q < p && fits; ++q)
        fits = !__builtin_mul_overflow(v, 10U, &v) && !__builtin_add_overflow(v, static_cast<unsigned>(*q - '0'), &v);
      if (fits) return h.number_unsigned(v);
    }
    numtext.assign(start, p);
    errno = 0;
    const double d = ::strtod_l(numtext.c_str(), nullptr, c_locale());
    if (!std::isfinite(d)) fail(start, "number out of range");
    if (integral) return h.number_integer(0);  // a negative integer (its value never matters)
    return h.number_float(d);
  };
  auto literal = [&](const char* word, std::size_t n) {
    if (static_cast<std::size_t>(end - p) < n || std::memcmp(p, word, n) != 0) fail(p, "expected a value");
    p += n;
  };
  // Reads "key" : (p at the key's quote) and hands the key over.
  auto parse_key = [&] {
    if (p == end || *p != '"') fail(p, p == end ? "EOF while parsing an object" : "key must be a string");
    parse_string();
    h.key(buf);
    skip_ws();
    if (p == end || *p != ':') fail(p, "expected ':'");
    ++p;
  };

  skip_ws();
  if (p == end) fail(p, "EOF while parsing a value");
  for (;;) {
    // A value starts at p (after whitespace).
    skip_ws();
    if (p == end) fail(p, "EOF while parsing a value");
    bool opened = false;
    switch (*p) {
      case '{':
        h.start_object(0);
        ++p;
        skip_ws();
        if (p < end && *p == '}') {
          ++p;
          h.end_object();
        } else {
          stack.push_back('{');
          parse_key();
          opened = true;
        }
        break;
      case '[':
        h.start_array(0);
        ++p;
        skip_ws();
        if (p < end && *p == ']') {
          ++p;
          h.end_array();
        } else {
          stack.push_back('[');
          opened = true;
        }
        break;
      case '"':
        parse_string();
        h.string(buf);
        break;
      case 't': literal("true", 4), h.boolean(true); break;
      case 'f': literal("false", 5), h.boolean(false); break;
      case 'n': literal("null", 4), h.null(); break;
      default:
        if (*p == '-' || (*p >= '0' && *p <= '9')) parse_number();
        else fail(p, "expected a value");
    }
    if (opened) continue;
    // After a complete value: close containers or move to the next element.
    for (;;) {
      skip_ws();
      if (stack.empty()) {
        if (p != end) fail(p, "trailing characters after the JSON value");
        return;
      }
      if (p == end) fail(p, stack.back() == '{' ? "EOF while parsing an object" : "EOF while parsing a list");
      if (*p == ',') {
        ++p;
        if (stack.back() == '{') {
          skip_ws();
          parse_key();
        }
        break;
      }
      if (stack.back() == '{' && *p == '}') {
        ++p;
        stack.pop_back();
        h.end_object();
        continue;
      }
      if (stack.back() == '[' && *p == ']') {
        ++p;
        stack.pop_back();
        h.end_array();
        continue;
      }
      fail(p, stack.back() == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
    }
  }
}

/// Handler for parse_json that reads a safetensors header straight into entries, enforcing the
/// reference's schema (serde: HashMetadata / TensorInfo / Dtype) as it goes.
class header_parser {
 public:
  header_parser(const limits& lim, const std::string& where) : lim_(lim), where_(where) {}

  std::vector<TensorEntry> entries;
  std::optional<std::vector<std::pair<std::string, std::string>>> metadata;

  // --- parse_json's handler interface
  bool null() { return scalar(kind::null, 0); }
  bool boolean(bool) { return scalar(kind::boolean, 0); }
  bool number_integer(std::int64_t) { return scalar(kind::negative, 0); }
  bool number_unsigned(std::uint64_t v) { return scalar(kind::unsigned_int, v); }
  bool number_float(double) { return scalar(kind::floating, 0); }
  bool string(std::string& s) {
    string_ = &s;
    return scalar(kind::string, 0);
  }

  bool start_object(std::size_t) {
    push_check();
    const ctx c = top();
    if (c == ctx::skip || next_ == want::ignored) return push(ctx::skip);
    if (c == ctx::shape) bad_dim("an object");
    if (c == ctx::offsets) bad_offset("an object");
    switch (next_) {
      case want::root: return push(ctx::top);
      case want::tensor:
        cur_ = TensorEntry{};
        cur_.name = std::move(key_);
        fields_ = 0;
        return push(ctx::tensor);
      case want::meta:
        metadata.emplace();
        meta_keys_.clear();
        return push(ctx::meta);
      default: return type_error("an object");
    }
  }

  bool key(std::string& k) {
    switch (top()) {
      case ctx::top:
        if (k == "__metadata__") {
          if (seen_meta_) fail(errors::st_duplicate_key, where_, "key '__metadata__' appears twice in the header");
          seen_meta_ = true;
          next_ = want::meta;
        } else {
          key_ = std::move(k);
          next_ = want::tensor;
        }
        return true;
      case ctx::tensor: {
        unsigned bit = 0;
        if (k == "dtype") {
          bit = 1, next_ = want::dtype;
        } else if (k == "shape") {
          bit = 2, next_ = want::shape;
        } else if (k == "data_offsets") {
          bit = 4, next_ = want::offsets;
        } else {
          next_ = want::ignored;  // serde ignores unknown fields
          return true;
        }
        if (fields_ & bit) fail(errors::st_duplicate_key, tensor_where(), "field " + quote(k) + " appears twice");
        fields_ |= bit;
        return true;
      }
      case ctx::meta:
        if (!meta_keys_.insert(k).second)
          fail(errors::st_duplicate_key, where_ + ": __metadata__", "key " + quote(k) + " appears twice");
        meta_key_ = std::move(k);
        next_ = want::meta_value;
        return true;
      default: return true;  // skip
    }
  }

  bool end_object() {
    const ctx c = top();
    stack_.pop_back();
    if (c == ctx::tensor) {
      if ((fields_ & 1U) == 0) fail(errors::st_tensor_info, tensor_where(), "missing field 'dtype'");
      if ((fields_ & 2U) == 0) fail(errors::st_tensor_info, tensor_where(), "missing field 'shape'");
      if ((fields_ & 4U) == 0) fail(errors::st_tensor_info, tensor_where(), "missing field 'data_offsets'");
      if (entries.size() >= lim_.max_tensors)
        fail(errors::st_too_many_tensors, where_,
             "more than " + std::to_string(lim_.max_tensors) + " tensors (limits::max_tensors)");
      entries.push_back(std::move(cur_));
    }
    after_value();
    return true;
  }

  bool start_array(std::size_t) {
    push_check();
    const ctx c = top();
    if (c == ctx::skip || next_ == want::ignored) return push(ctx::skip);
    if (c == ctx::shape) bad_dim("an array");
    if (c == ctx::offsets) bad_offset("an array");
    switch (next_) {
      case want::shape: return push(ctx::shape);
      case want::offsets:
        offsets_n_ = 0;
        return push(ctx::offsets);
      case want::tensor:
        // serde would also take [dtype, shape, data_offsets] for a struct; statedict does not.
        fail(errors::st_tensor_info, where_ + ": tensor " + quote(key_), "tensor info is an array, not an object");
      default: return type_error("an array");
    }
  }

  bool end_array() {
    const ctx c = top();
    stack_.pop_back();
    if (c == ctx::offsets && offsets_n_ != 2)
      fail(errors::st_tensor_info, tensor_where(),
           "data_offsets has " + std::to_string(offsets_n_) + " elements, expected [begin, end]");
    after_value();
    return true;
  }

  void finish() const {
    if (!stack_.empty() || next_ == want::root) fail(errors::st_header_json, where_, "incomplete JSON");
  }

 private:
  enum class ctx : std::uint8_t { none, top, tensor, shape, offsets, meta, skip };
  enum class want : std::uint8_t { root, key, tensor, meta, meta_value, dtype, shape, offsets, ignored, done };
  enum class kind : std::uint8_t { null, boolean, negative, unsigned_int, floating, string };

  [[noreturn]] static void fail(const error_id& id, const std::string& where, std::string detail) {
    throw_error(id, where, std::move(detail));
  }
  std::string tensor_where() const { return where_ + ": tensor " + quote(cur_.name); }

  ctx top() const noexcept { return stack_.empty() ? ctx::none : stack_.back(); }
  void push_check() const {
    if (stack_.size() >= lim_.max_json_depth)
      fail(errors::st_json_depth, where_,
           "JSON nested deeper than " + std::to_string(lim_.max_json_depth) + " levels (limits::max_json_depth)");
  }
  bool push(ctx c) {
    stack_.push_back(c);
    next_ = c == ctx::skip ? want::ignored : want::key;
    return true;
  }
  /// After a complete value, the containing object expects a key again.
  void after_value() {
    const ctx c = top();
    if (c == ctx::none) next_ = want::done;
    else if (c == ctx::skip) next_ = want::ignored;
    else next_ = want::key;
  }

  [[noreturn]] void bad_dim(const char* what) const {
    fail(errors::st_bad_dim, tensor_where(),
         std::string("shape element is ") + what + ", expected a non-negative integer");
  }
  [[noreturn]] void bad_offset(const char* what) const {
    fail(errors::st_bad_offset_value, tensor_where(),
         std::string("data_offsets element is ") + what + ", expected a non-negative integer");
  }
  [[noreturn]] bool type_error(const char* what) const {
    switch (next_) {
      case want::root: fail(errors::st_header_not_object, where_, std::string("header is ") + what + ", not a JSON object");
      case want::tensor:
        fail(errors::st_tensor_info, where_ + ": tensor " + quote(key_), std::string("tensor info is ") + what + ", not an object");
      case want::meta:
        fail(errors::st_metadata_type, where_, std::string("__metadata__ is ") + what + ", not an object of strings");
      case want::meta_value:
        fail(errors::st_metadata_type, where_ + ": __metadata__ key " + quote(meta_key_),
             std::string("value is ") + what + ", not a string");
      case want::dtype: fail(errors::st_tensor_info, tensor_where(), std::string("dtype is ") + what + ", not a string");
      case want::shape: fail(errors::st_tensor_info, tensor_where(), std::string("shape is ") + what + ", not an array");
      case want::offsets:
        fail(errors::st_tensor_info, tensor_where(), std::string("data_offsets is ") + what + ", not an array");
      default: fail(errors::st_header_json, where_, std::string("unexpected ") + what);
    }
  }
  static const char* describe(kind k) noexcept {
    switch (k) {
      case kind::null: return "null";
      case kind::boolean: return "a boolean";
      case kind::negative: return "a negative integer";
      case kind::unsigned_int: return "an integer";
      case kind::floating: return "a floating-point number";
      case kind::string: return "a string";
    }
    return "a value";
  }

  bool scalar(kind k, std::uint64_t v) {
    const ctx c = top();
    if (c == ctx::skip || next_ == want::ignored) {
      after_value();
      return true;
    }
    if (c == ctx::shape) {
      if (k != kind::unsigned_int) bad_dim(describe(k));
      if (cur_.shape.size() >= lim_.max_rank)
        fail(errors::st_too_many_dims, tensor_where(),
             "more than " + std::to_string(lim_.max_rank) + " dimensions (limits::max_rank)");
      if (v > max_size)
        fail(errors::st_dim_too_large, tensor_where(), "dimension " + std::to_string(v) + " exceeds 2^63-1");
      cur_.shape.push_back(static_cast<dim_t>(v));
      return true;
    }
    if (c == ctx::offsets) {
      if (k != kind::unsigned_int) bad_offset(describe(k));
      if (offsets_n_ >= 2) fail(errors::st_tensor_info, tensor_where(), "data_offsets has more than 2 elements");
      (offsets_n_ == 0 ? cur_.begin : cur_.end) = v;
      ++offsets_n_;
      return true;
    }
    switch (next_) {
      case want::meta:
        if (k == kind::null) {  // Option<HashMap>: null means no metadata
          after_value();
          return true;
        }
        type_error(describe(k));
      case want::meta_value:
        if (k != kind::string) type_error(describe(k));
        metadata->emplace_back(std::move(meta_key_), std::move(*string_));
        after_value();
        return true;
      case want::dtype: {
        if (k != kind::string) type_error(describe(k));
        const int i = dtype_index(*string_);
        if (i < 0) fail(errors::st_unknown_dtype, tensor_where(), "unknown dtype " + quote(*string_));
        const auto& d = dtype_table[static_cast<std::size_t>(i)];
        cur_.dtype_name = d.name;
        cur_.dtype = d.type;
        cur_.dtype_bits = d.bits;
        after_value();
        return true;
      }
      default: type_error(describe(k));
    }
  }

  const limits& lim_;
  const std::string& where_;
  std::vector<ctx> stack_;
  want next_ = want::root;
  std::string key_;
  std::string meta_key_;
  std::unordered_set<std::string> meta_keys_;
  std::string* string_ = nullptr;
  TensorEntry cur_;
  unsigned fields_ = 0;
  unsigned offsets_n_ = 0;
  bool seen_meta_ = false;
};

/// Errors found by reading the parsed JSON against the schema (as opposed to parsing it).
inline bool is_schema_error(const error_id& id) noexcept {
  return id == errors::st_duplicate_key || id == errors::st_tensor_info || id == errors::st_unknown_dtype ||
         id == errors::st_bad_dim || id == errors::st_bad_offset_value || id == errors::st_metadata_type ||
         id == errors::st_header_not_object;
}

/// Parses JSON text for syntax only (with serde_json's depth and number-range rules); throws
/// errors::st_header_json or errors::st_json_depth.
inline void check_syntax(const char* first, std::uint64_t n, const limits& lim, const std::string& where) {
  struct syntax_only {
    const limits& lim;
    const std::string& where;
    std::size_t depth = 0;
    bool null() { return true; }
    bool boolean(bool) { return true; }
    bool number_integer(std::int64_t) { return true; }
    bool number_unsigned(std::uint64_t) { return true; }
    bool number_float(double) { return true; }
    bool string(std::string&) { return true; }
    bool key(std::string&) { return true; }
    bool open() {
      if (depth >= lim.max_json_depth)
        throw_error(errors::st_json_depth, where,
                    "JSON nested deeper than " + std::to_string(lim.max_json_depth) + " levels (limits::max_json_depth)");
      ++depth;
      return true;
    }
    bool start_object(std::size_t) { return open(); }
    bool start_array(std::size_t) { return open(); }
    bool end_object() { return --depth, true; }
    bool end_array() { return --depth, true; }
  } s{lim, where};
  parse_json(first, static_cast<std::size_t>(n), s, where);
}

/// Name -> position index over names stored elsewhere (open addressing, linear probing): two
/// 32-bit words per slot and no per-name allocation, so indexing 100k names stays cache-friendly.
class name_index {
 public:
  static constexpr std::size_t npos = ~std::size_t{0};

  /// Prepares for `n` names.
  void reset(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, slot{0, 0});
    mask_ = cap - 1;
  }
  /// Adds names[i]; returns false when an equal name is already indexed.
  template <class Names>
  bool insert(const Names& names, std::size_t i) {
    const std::string_view key = name_of(names[i]);
    const std::size_t h = std::hash<std::string_view>{}(key);
    const auto tag = static_cast<std::uint32_t>(h >> 32);
    for (std::size_t k = h & mask_;; k = (k + 1) & mask_) {
      slot& sl = slots_[k];
      if (sl.pos == 0) {
        sl = slot{static_cast<std::uint32_t>(i + 1), tag};
        return true;
      }
      if (sl.tag == tag && name_of(names[sl.pos - 1]) == key) return false;
    }
  }
  template <class Names>
  [[nodiscard]] std::size_t find(const Names& names, std::string_view key) const {
    if (slots_.empty()) return npos;
    const std::size_t h = std::hash<std::string_view>{}(key);
    const auto tag = static_cast<std::uint32_t>(h >> 32);
    for (std::size_t k = h & mask_;; k = (k + 1) & mask_) {
      const slot& sl = slots_[k];
      if (sl.pos == 0) return npos;
      if (sl.tag == tag && name_of(names[sl.pos - 1]) == key) return sl.pos - 1;
    }
  }

 private:
  struct slot {
    std::uint32_t pos;  // index + 1; 0 = empty
    std::uint32_t tag;  // high hash bits
  };
  template <class E>
  static std::string_view name_of(const E& e) noexcept {
    return e.name;
  }
  std::vector<slot> slots_;
  std::size_t mask_ = 0;
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
    if (!e.dtype)
      throw_error(errors::st_unsupported_dtype, "file " + quote(name()) + ": tensor " + quote(e.name),
                  "dtype " + std::string(e.dtype_name) + " is valid safetensors but statedict has no such dtype");
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
    if (!e.dtype)
      throw_error(errors::st_unsupported_dtype, "file " + quote(name()) + ": tensor " + quote(e.name),
                  "dtype " + std::string(e.dtype_name) + " is valid safetensors but statedict has no such dtype");
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
    std::size_t bad = 0;
    if (!detail::valid_utf8(h, static_cast<std::size_t>(n), bad))
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
                    std::string(name(s.dtype)) + " cannot be stored in safetensors");
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
    h += name(s.dtype);
    h += "\",\"shape\":[";
    for (std::size_t d = 0; d < s.shape.size(); ++d) {
      if (d) h += ',';
      detail::append_uint(h, static_cast<std::uint64_t>(s.shape[d]));
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

/// One tensor to write: either a view, or contiguous row-major bytes in a byte source (a mapped or
/// pread file; the writer then streams them in blocks, or with copy_file_range when possible).
struct Input {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;  ///< dtype of the data as given
  shape_t shape;
  TensorView view;                                 ///< the data, when `source` is null
  std::shared_ptr<const ByteSource> source;        ///< or: the bytes at `offset` in this source
  std::uint64_t offset = 0;

  static Input of(std::string tensor_name, TensorView v) {
    Input in;
    in.name = std::move(tensor_name);
    in.dtype = v.dtype();
    in.shape = v.shape();
    in.view = std::move(v);
    return in;
  }
  static Input from_source(std::string tensor_name, statedict::dtype t, shape_t dims, std::shared_ptr<const ByteSource> src,
                           std::uint64_t at) {
    Input in;
    in.name = std::move(tensor_name);
    in.dtype = t;
    in.shape = std::move(dims);
    in.source = std::move(src);
    in.offset = at;
    return in;
  }
};

struct write_options {
  /// Cast floating-point tensors to this dtype (F32, BF16, F16, ...); other tensors keep theirs.
  std::optional<statedict::dtype> cast;
  /// The user's `__metadata__` (nullopt: none). Keys "statedict.*" are reserved.
  std::optional<std::map<std::string, std::string>> metadata;
  /// Further names for written tensors: (alias, stored name). Recorded under "statedict.aliases".
  std::vector<std::pair<std::string, std::string>> aliases;
  /// Inputs that are the very same view as an earlier input are written once and recorded as
  /// aliases of it (tied weights). Not done when a skeleton is given (its alias nodes record ties).
  bool dedupe_views = true;
  /// A flatten skeleton to store under "statedict.skeleton" (null: none).
  nlohmann::json skeleton;
  /// Size of the staging buffer used for casts, strided views and pread sources. Small enough to
  /// stay in a core's L2 cache between the cast and the write() that copies it out, which
  /// measured ~2x faster than an 8 MiB buffer for an F32 -> BF16 conversion.
  std::size_t buffer_bytes = std::size_t{256} << 10;
  /// Let the kernel copy uncast bytes between files (copy_file_range) when the source has a file
  /// descriptor. Off by default, as in the executor (exec_options::copy_file_range says why).
  bool copy_file_range = false;
  limits lim{};
};

/// What write() did.
struct write_result {
  Layout layout;
  std::vector<TensorSpec> specs;  ///< the stored tensors (after dedupe and cast), as given to layout()
  std::vector<std::pair<std::string, std::string>> aliases;
  std::optional<std::map<std::string, std::string>> metadata;  ///< the `__metadata__` written
};

namespace detail {

/// The output dtype of an input under `cast`.
inline statedict::dtype out_dtype(statedict::dtype t, const std::optional<statedict::dtype>& cast) {
  return cast && is_floating(t) ? *cast : t;
}

/// Streams bytes into an OutputFile through a fixed staging buffer.
class stream_writer {
 public:
  stream_writer(OutputFile& out, std::size_t buffer_bytes, bool allow_cfr)
      : out_(out), buf_(std::max<std::size_t>(buffer_bytes, 4096)), cfr_(allow_cfr) {}

  void flush() {
    if (fill_) out_.write(std::span<const std::byte>(buf_.data(), fill_));
    fill_ = 0;
  }
  /// Appends raw bytes (large ones go straight to the file).
  void put(const std::byte* p, std::uint64_t n) {
    if (n >= buf_.size() / 2) {
      flush();
      while (n > 0) {
        const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 30));
        out_.write(std::span<const std::byte>(p, take));
        p += take;
        n -= take;
      }
      return;
    }
    if (fill_ + n > buf_.size()) flush();
    std::memcpy(buf_.data() + fill_, p, static_cast<std::size_t>(n));
    fill_ += static_cast<std::size_t>(n);
  }
  /// Appends `count` elements cast from `from` to `to`.
  void put_cast(statedict::dtype from, const std::byte* p, statedict::dtype to, std::uint64_t count) {
    if (from == to) return put(p, count * itemsize(from));
    const std::size_t os = itemsize(to), is = itemsize(from);
    while (count > 0) {
      std::size_t room = (buf_.size() - fill_) / os;
      if (room == 0) {
        flush();
        room = buf_.size() / os;
      }
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(count, room));
      cast_run(from, p, to, buf_.data() + fill_, take);
      fill_ += take * os;
      p += take * is;
      count -= take;
    }
  }
  /// Appends `n` bytes at `offset` of `src`, cast from `from` to `to` (n counts source bytes).
  void put_source(const ByteSource& src, std::uint64_t offset, std::uint64_t n, statedict::dtype from, statedict::dtype to) {
    src.check_range(offset, n, "tensor data");
    if (n == 0) return;
    if (from == to && cfr_ && src.fd() >= 0 && try_copy_file_range(src, offset, n)) return;
    if (const std::byte* d = src.data()) {
      if (const auto* f = dynamic_cast<const InputFile*>(&src)) f->advise(offset, n, access_hint::sequential);
      return put_cast(from, d + offset, to, n / itemsize(from));
    }
    // pread into the first half of the buffer, cast into the second.
    flush();
    const std::size_t is = itemsize(from);
    std::vector<std::byte> in(std::min<std::uint64_t>(n, std::max<std::size_t>(buf_.size() / 2 / is * is, is)));
    while (n > 0) {
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, in.size()));
      src.read(offset, std::span<std::byte>(in.data(), take));
      put_cast(from, in.data(), to, take / is);
      offset += take;
      n -= take;
    }
  }

 private:
  bool try_copy_file_range(const ByteSource& src, std::uint64_t offset, std::uint64_t n) {
    flush();
    auto in_off = static_cast<loff_t>(src.fd_offset() + offset);
    auto out_off = static_cast<loff_t>(out_.position());
    std::uint64_t done = 0;
    while (done < n) {
      const ssize_t r = ::copy_file_range(src.fd(), &in_off, out_.fd(), &out_off,
                                          static_cast<std::size_t>(std::min<std::uint64_t>(n - done, std::uint64_t{1} << 30)), 0);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (done == 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
          cfr_ = false;
          return false;
        }
        throw_error(errors::write_failed, "file " + quote(out_.path().string()), "copy_file_range failed: " + statedict::detail::errno_text(errno));
      }
      if (r == 0)
        throw_error(errors::file_shrank, "file " + quote(src.name()), "ended while copying, shorter than when opened");
      done += static_cast<std::uint64_t>(r);
    }
    out_.seek(out_.position() + n);
    return true;
  }

  OutputFile& out_;
  std::vector<std::byte> buf_;
  std::size_t fill_ = 0;
  bool cfr_;
};

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

struct prepared {
  std::vector<std::size_t> stored;  // indices of inputs to store
  std::vector<TensorSpec> specs;    // their output specs, same order
  std::vector<std::pair<std::string, std::string>> aliases;
  std::optional<std::map<std::string, std::string>> metadata;
};

inline prepared prepare(std::span<const Input> inputs, const write_options& opt) {
  prepared p;
  if (opt.cast && !is_floating(*opt.cast))
    throw_error(errors::st_write_input, "cast to " + std::string(name(*opt.cast)), "only floating dtypes are cast targets");
  p.aliases = opt.aliases;
  std::unordered_map<const std::byte*, std::vector<std::size_t>> by_ptr;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    if (in.source == nullptr && (in.view.dtype() != in.dtype || in.view.shape() != in.shape))
      throw_error(errors::st_write_input, where_tensor(in.name), "dtype/shape differ from its view's");
    // With a skeleton, ties are the skeleton's business (its alias nodes): store what is given.
    if (opt.dedupe_views && opt.skeleton.is_null() && in.source == nullptr && in.view.numel() != 0) {
      auto& seen = by_ptr[in.view.data()];
      bool dup = false;
      for (std::size_t j : seen)
        if (same_view(inputs[j].view, in.view)) {
          p.aliases.emplace_back(in.name, inputs[j].name);
          dup = true;
          break;
        }
      if (dup) continue;
      seen.push_back(i);
    }
    if (opt.cast) check_cast(in.dtype, out_dtype(in.dtype, opt.cast));
    p.stored.push_back(i);
    p.specs.push_back(TensorSpec{in.name, out_dtype(in.dtype, opt.cast), in.shape});
  }
  p.metadata = opt.metadata;
  if (p.metadata)
    for (const auto& [k, v] : *p.metadata)
      if (k == aliases_key || k == skeleton_key)
        throw_error(errors::st_write_metadata, "__metadata__ key " + quote(k), "reserved for statedict");
  if (!p.aliases.empty()) {
    std::unordered_set<std::string_view> stored;
    for (const auto& s : p.specs) stored.insert(s.name);
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const auto& [alias, target] : p.aliases) {
      if (!stored.count(target))
        throw_error(errors::st_write_input, "alias " + quote(alias), "refers to " + quote(target) + ", which is not written");
      if (stored.count(alias) || j.contains(alias))
        throw_error(errors::st_write_name, "alias " + quote(alias), "the name appears twice");
      if (!valid_utf8(alias)) throw_error(errors::st_write_name, "alias " + quote(alias), "the name is not UTF-8");
      j[alias] = target;
    }
    if (!p.metadata) p.metadata.emplace();
    p.metadata->emplace(std::string(aliases_key), j.dump());
  }
  if (!opt.skeleton.is_null()) {
    if (!p.metadata) p.metadata.emplace();
    if (opt.cast) {
      nlohmann::json sk = opt.skeleton;
      cast_skeleton(sk, *opt.cast);
      p.metadata->emplace(std::string(skeleton_key), sk.dump());
    } else {
      p.metadata->emplace(std::string(skeleton_key), opt.skeleton.dump());
    }
  }
  return p;
}

}  // namespace detail

/// Writes the tensors into an open output file, from its current position 0: header first, then
/// each tensor's bytes in file order. Memory: one staging buffer (write_options::buffer_bytes).
inline write_result write_to(OutputFile& out, std::span<const Input> inputs, const write_options& opt = {}) {
  detail::prepared p = detail::prepare(inputs, opt);
  write_result r;
  r.layout = layout(p.specs, p.metadata, opt.lim);
  detail::stream_writer w(out, opt.buffer_bytes, opt.copy_file_range);
  w.put(reinterpret_cast<const std::byte*>(r.layout.header.data()), r.layout.header.size());
  for (const LayoutEntry& e : r.layout.entries) {
    const Input& in = inputs[p.stored[e.index]];
    const statedict::dtype to = p.specs[e.index].dtype;
    try {
      if (in.source) {
        w.put_source(*in.source, in.offset, byte_size(in.shape, itemsize(in.dtype)), in.dtype, to);
      } else {
        in.view.for_each_run([&](const std::byte* ptr, std::uint64_t count) { w.put_cast(in.dtype, ptr, to, count); });
      }
    } catch (error& err) {
      err.add_context(detail::where_tensor(in.name));
      throw;
    }
  }
  w.flush();
  if (out.position() != r.layout.file_size)
    throw_error(errors::write_failed, "file " + quote(out.path().string()),
                "wrote " + std::to_string(out.position()) + " bytes, expected " + std::to_string(r.layout.file_size));
  r.specs = std::move(p.specs);
  r.aliases = std::move(p.aliases);
  r.metadata = std::move(p.metadata);
  return r;
}

/// Writes a .safetensors file atomically (temporary name, fsync, rename).
inline write_result write(const std::filesystem::path& path, std::span<const Input> inputs, const write_options& opt = {}) {
  OutputFile out = OutputFile::create(path);
  write_result r;
  try {
    r = write_to(out, inputs, opt);
  } catch (error& e) {
    e.add_context("file " + quote(path.string()));
    throw;
  }
  out.commit();
  return r;
}

/// Inputs for every tensor of a ShardedCheckpoint whose elements lie in one contiguous,
/// row-major chunk of one source (what every safetensors file and HF shard is). Throws
/// errors::st_write_input for a tensor split over several chunks (the executor handles those).
inline std::vector<Input> inputs_of(const ShardedCheckpoint& c) {
  std::vector<Input> out;
  out.reserve(c.tensors.size());
  for (const TensorInfo& t : c.tensors) {
    bool whole = t.chunks.size() == 1 && t.chunks[0].at.strides.empty() && t.chunks[0].at.stored == t.dtype;
    if (whole) {
      const auto& reg = t.chunks[0].region;
      if (const Box* b = std::get_if<Box>(&reg))
        whole = b->sizes == t.shape && std::all_of(b->offsets.begin(), b->offsets.end(), [](dim_t o) { return o == 0; });
      else {
        const auto& fr = std::get<FlatRange>(reg);
        whole = fr.begin == 0 && fr.end == numel(t.shape);
      }
    }
    if (!whole)
      throw_error(errors::st_write_input, detail::where_tensor(t.name), "is not one contiguous chunk of one source");
    out.push_back(Input::from_source(t.name, t.dtype, t.shape, c.sources.at(t.chunks[0].at.source), t.chunks[0].at.byte_offset));
  }
  return out;
}

/// True when `state` is a plain dict {string name: tensor}, what a safetensors file holds without
/// a skeleton.
inline bool is_flat_tensor_dict(const Value& state) {
  if (!state.is_dict()) return false;
  for (const auto& [k, v] : state.as_dict())
    if (!k.is_string() || !v.is_tensor()) return false;
  return true;
}

/// Writes a whole state (model + optimizer + scalars + strings: any Value tree) into one file. A
/// plain {name: tensor} dict becomes a plain file (entries that are the same view are written once
/// and recorded as aliases); any other tree is flattened (core/flatten.hpp) and its skeleton stored
/// under "statedict.skeleton", next to the user's metadata. `read_state` gives back an equal tree.
inline write_result write_state(const std::filesystem::path& path, const Value& state, write_options opt = {}) {
  std::vector<Input> in;
  if (is_flat_tensor_dict(state)) {
    in.reserve(state.as_dict().size());
    for (const auto& [k, v] : state.as_dict()) in.push_back(Input::of(k.as_string(), v.as_tensor()));
    return write(path, in, opt);
  }
  FlatStateDict flat = flatten(state);
  in.reserve(flat.tensors.size());
  for (const auto& [n, v] : flat.tensors) in.push_back(Input::of(n, v));
  opt.skeleton = std::move(flat.skeleton).take_json();
  opt.dedupe_views = false;  // ties are alias nodes of the skeleton already
  return write(path, in, opt);
}

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
