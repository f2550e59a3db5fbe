// statedict: parsing a safetensors header with the reference reader's rules: a strict JSON scanner
// (serde_json's grammar and recursion limit, duplicate keys found) and the schema checks, each
// violation its own error id (io/safetensors.hpp is the public header).
// SPDX-License-Identifier: MIT
#pragma once

#include <locale.h>

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

#include "../../core/cast.hpp"
#include "../../core/dtype.hpp"
#include "../../core/flatten.hpp"
#include "../../core/hash_index.hpp"
#include "../../core/detail/text.hpp"
#include "../../core/error.hpp"
#include "../../core/sha256.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"
#include "../../shard/checkpoint.hpp"
#include "../file.hpp"

#include "../safetensors.hpp"

namespace statedict::inline v0::safetensors::detail {


using statedict::detail::first_invalid_utf8;
using statedict::detail::valid_utf8;

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

}  // namespace statedict::inline v0::safetensors::detail
