// statedict: text helpers every layer shares: base64, UTF-8 validation, JSON string and number
// writing in the byte-exact form serde_json and nlohmann::json::dump() produce.
// SPDX-License-Identifier: MIT
#pragma once

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace statedict::inline v0::detail {

inline constexpr char b64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (RFC 4648 section 4).
inline std::string base64_encode(const std::uint8_t* p, std::size_t n) {
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (std::uint32_t{p[i + 1]} << 8) | p[i + 2];
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += b64_alphabet[(v >> 6) & 63];
    out += b64_alphabet[v & 63];
  }
  if (n - i == 1) {
    const std::uint32_t v = std::uint32_t{p[i]} << 16;
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += "==";
  } else if (n - i == 2) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (std::uint32_t{p[i + 1]} << 8);
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += b64_alphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

inline std::string base64_encode(std::string_view s) {
  return base64_encode(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
}

/// Strict base64 decoding: length a multiple of 4, '=' only as final padding, no whitespace, and
/// unused bits zero (so every byte string has exactly one encoding). Returns false on bad input.
inline bool base64_decode(std::string_view s, std::vector<std::uint8_t>& out) {
  out.clear();
  if (s.size() % 4 != 0) return false;
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.reserve(s.size() / 4 * 3);
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s[i + static_cast<std::size_t>(k)];
      if (c == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad) return false;  // data after padding
      v[k] = val(c);
      if (v[k] < 0) return false;
    }
    const auto w = (static_cast<std::uint32_t>(v[0]) << 18) | (static_cast<std::uint32_t>(v[1]) << 12) |
                   (static_cast<std::uint32_t>(v[2]) << 6) | static_cast<std::uint32_t>(v[3]);
    out.push_back(static_cast<std::uint8_t>(w >> 16));
    if (pad == 2) {
      if ((w & 0xffffU) != 0) return false;
      break;
    }
    out.push_back(static_cast<std::uint8_t>((w >> 8) & 0xffU));
    if (pad == 1) {
      if ((w & 0xffU) != 0) return false;
      break;
    }
    out.push_back(static_cast<std::uint8_t>(w & 0xffU));
  }
  return true;
}

/// Whether a three-byte encoding of a surrogate code point (U+D800..U+DFFF) counts as well formed:
/// not in strict UTF-8 (Rust, JSON writers), but in what Python's "surrogatepass" decoder accepts
/// (pickled str objects).
enum class utf8_surrogates : bool { refused, allowed };

/// Length of the well-formed UTF-8 sequence at s[i] (no overlong forms, at most U+10FFFF, no
/// surrogates unless allowed), or 0 when none starts there.
inline std::size_t utf8_seq(std::string_view s, std::size_t i, utf8_surrogates sur = utf8_surrogates::refused) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  const unsigned c = p[i];
  if (c < 0x80) return 1;
  std::size_t len = 0;
  unsigned lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) len = 2;
  else if (c == 0xe0) len = 3, lo = 0xa0;
  else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
  else if (c == 0xed) len = 3, hi = sur == utf8_surrogates::allowed ? 0xbf : 0x9f;
  else if (c == 0xf0) len = 4, lo = 0x90;
  else if (c >= 0xf1 && c <= 0xf3) len = 4;
  else if (c == 0xf4) len = 4, hi = 0x8f;
  else return 0;
  if (n - i < len) return 0;
  if (p[i + 1] < lo || p[i + 1] > hi) return 0;
  for (std::size_t k = 2; k < len; ++k)
    if (p[i + k] < 0x80 || p[i + k] > 0xbf) return 0;
  return len;
}

/// The offset of the first byte of `s` that does not start a well-formed UTF-8 sequence (the rules
/// of Rust's `str::from_utf8` and of JSON writers: no overlong forms, no surrogates, nothing above
/// U+10FFFF), or npos when all of `s` is well formed.
inline std::size_t first_invalid_utf8(std::string_view s, utf8_surrogates sur = utf8_surrogates::refused) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    for (; i + 8 <= n; i += 8) {  // ASCII fast path
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ULL) break;
    }
    if (i >= n) break;
    const std::size_t len = utf8_seq(s, i, sur);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

/// Well-formed UTF-8: what a JSON writer such as nlohmann::json::dump accepts.
inline bool valid_utf8(std::string_view s) noexcept { return first_invalid_utf8(s) == std::string_view::npos; }

/// Whether every byte of `s` is below 0x80, 8 bytes a step.
inline bool is_ascii(std::string_view s) noexcept {
  std::uint64_t any = 0;
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    any |= w;
  }
  for (; i < s.size(); ++i) any |= static_cast<unsigned char>(s[i]);
  return (any & 0x8080808080808080ULL) == 0;
}

/// Appends `s` as a JSON string the way nlohmann::json::dump() (and serde_json) write valid UTF-8:
/// `"` and `\` escaped, control characters as \b \t \n \f \r or \u00xx (lower-case hex),
/// everything else raw. The caller checks that `s` is UTF-8.
inline void append_json_string(std::string& out, std::string_view s) {
  // Bytes each input byte becomes: 1, 2 (\" \\ \b \t \n \f \r) or 6 (\u00xx).
  static constexpr auto width = [] {
    std::array<std::uint8_t, 256> w{};
    for (std::size_t c = 0; c < 256; ++c) w[c] = c < 0x20 ? 6 : 1;
    for (const char c : {'"', '\\', '\b', '\t', '\n', '\f', '\r'}) w[static_cast<unsigned char>(c)] = 2;
    return w;
  }();
  static constexpr char hex[] = "0123456789abcdef";
  std::size_t n = s.size() + 2;
  for (const char ch : s) n += width[static_cast<unsigned char>(ch)] - 1U;
  const std::size_t at = out.size();
  out.resize(at + n);  // one growth, then raw writes: skeletons in metadata are mostly quotes
  char* w = out.data() + at;
  *w++ = '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (width[c] == 1) {
      *w++ = ch;
      continue;
    }
    *w++ = '\\';
    switch (c) {
      case '"': *w++ = '"'; break;
      case '\\': *w++ = '\\'; break;
      case '\b': *w++ = 'b'; break;
      case '\t': *w++ = 't'; break;
      case '\n': *w++ = 'n'; break;
      case '\f': *w++ = 'f'; break;
      case '\r': *w++ = 'r'; break;
      default:
        *w++ = 'u';
        *w++ = '0';
        *w++ = '0';
        *w++ = hex[c >> 4];
        *w++ = hex[c & 15];
    }
  }
  *w = '"';
}

inline void append_int(std::string& out, std::int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, static_cast<std::size_t>(r.ptr - buf));
}

inline void append_uint(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, static_cast<std::size_t>(r.ptr - buf));
}

}  // namespace statedict::inline v0::detail
