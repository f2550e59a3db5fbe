// statedict: the text operands of pickle protocols 0 and 1 (io/pickle_read.hpp is the public
// header): decimal integers of any size (INT, LONG), quoted byte strings (STRING) and
// raw-unicode-escape text (UNICODE), decoded as Python's unpickler decodes them.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace statedict::inline v0::pickle::detail {

/// A decimal integer (optional '+' or '-', then digits) as little-endian two's complement bytes,
/// one sign byte more than needed at most (normalise_long trims them). False for anything that is
/// not such a number. The caller bounds the text's length first: the work is quadratic in it.
inline bool decimal_to_long(std::string_view s, std::vector<std::uint8_t>& out) {
  out.clear();
  bool negative = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.empty()) return false;
  std::vector<std::uint8_t> mag;  // magnitude, little-endian base 256
  for (const char ch : s) {
    if (ch < '0' || ch > '9') return false;
    unsigned carry = static_cast<unsigned>(ch - '0');
    for (std::uint8_t& b : mag) {
      const unsigned v = b * 10U + carry;
      b = static_cast<std::uint8_t>(v & 0xFFU);
      carry = v >> 8;
    }
    while (carry) {
      mag.push_back(static_cast<std::uint8_t>(carry & 0xFFU));
      carry >>= 8;
    }
  }
  mag.push_back(0);  // room for the sign bit
  if (negative) {    // two's complement: invert, add one
    unsigned carry = 1;
    for (std::uint8_t& b : mag) {
      const unsigned v = (~static_cast<unsigned>(b) & 0xFFU) + carry;
      b = static_cast<std::uint8_t>(v & 0xFFU);
      carry = v >> 8;
    }
  }
  out = std::move(mag);
  return true;
}

inline int hex_digit(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/// The escapes of a Python bytes literal (codecs.escape_decode, what STRING's operand holds
/// between its quotes): \\ \' \" \a \b \f \n \r \t \v, \<newline> (nothing), up to three octal
/// digits (the low 8 bits of their value), \xhh; a backslash before anything else stays, as the
/// character after it. False for a trailing backslash or \x without two hex digits.
inline bool escape_decode(std::string_view s, std::string& out) {
  out.clear();
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i++];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (i == s.size()) return false;
    const char e = s[i++];
    switch (e) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': {
        if (s.size() - i < 2) return false;
        const int hi = hex_digit(s[i]), lo = hex_digit(s[i + 1]);
        if (hi < 0 || lo < 0) return false;
        out += static_cast<char>(hi * 16 + lo);
        i += 2;
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          unsigned v = static_cast<unsigned>(e - '0');
          for (int k = 0; k < 2 && i < s.size() && s[i] >= '0' && s[i] <= '7'; ++k) v = v * 8 + static_cast<unsigned>(s[i++] - '0');
          out += static_cast<char>(v & 0xFFU);
        } else {
          out += '\\';
          --i;  // the character after the backslash is an ordinary one
        }
    }
  }
  return true;
}

/// Appends code point `cp` (at most 0x10FFFF) as UTF-8; surrogates are encoded as three bytes,
/// as Python's "surrogatepass" does (the unpickler's str accepts them).
inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// The raw-unicode-escape codec (UNICODE's operand) into UTF-8: every byte is the code point of
/// its value, except \uXXXX and \UXXXXXXXX after an odd number of backslashes. False for such an
/// escape without its hex digits, or beyond U+10FFFF.
inline bool raw_unicode_escape_decode(std::string_view s, std::string& out) {
  out.clear();
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c != '\\') {
      append_utf8(out, c);
      ++i;
      continue;
    }
    std::size_t run = 0;  // backslashes in a row, all written
    while (i < s.size() && s[i] == '\\') {
      out += '\\';
      ++run;
      ++i;
    }
    if (run % 2 == 0 || i == s.size() || (s[i] != 'u' && s[i] != 'U')) continue;
    out.pop_back();  // that backslash starts the escape
    const std::size_t digits = s[i] == 'u' ? 4 : 8;
    ++i;
    if (s.size() - i < digits) return false;
    std::uint32_t cp = 0;
    for (std::size_t k = 0; k < digits; ++k) {
      const int d = hex_digit(s[i + k]);
      if (d < 0) return false;
      cp = cp * 16 + static_cast<std::uint32_t>(d);
    }
    if (cp > 0x10FFFF) return false;
    append_utf8(out, cp);
    i += digits;
  }
  return true;
}

}  // namespace statedict::inline v0::pickle::detail
