// statedict: renamings and filters by regular expression (ECMAScript syntax, std::regex), for the
// transforms of formats/transform.hpp. A header of its own: <regex> is heavy to compile, and the
// umbrella header leaves it out.
// SPDX-License-Identifier: MIT
#pragma once

#include <functional>
#include <regex>
#include <string>
#include <string_view>

#include "../core/error.hpp"
#include "transform_types.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id bad_regex {856, error_kind::usage, "transform.bad_regex"};
// clang-format on
}  // namespace errors

namespace formats {

namespace detail {
inline std::regex compile_regex(const std::string& pattern) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw_error(errors::bad_regex, "regular expression " + quote(pattern), e.what());
  }
}
/// `replacement` with `\1`..`\9` written as ECMAScript's `$1`..`$9` (both spellings accepted).
inline std::string ecma_format(const std::string& replacement) {
  std::string out;
  for (std::size_t i = 0; i < replacement.size(); ++i) {
    if (replacement[i] == '\\' && i + 1 < replacement.size() && replacement[i + 1] >= '0' && replacement[i + 1] <= '9') {
      out += '$';
      continue;
    }
    out += replacement[i];
  }
  return out;
}
}  // namespace detail

/// Names that `pattern` matches as a whole get `replacement`, with `$1` (or `\1`) .. for its
/// groups ("^module\.(.*)$" -> "$1"); the others stay.
inline name_map rename_regex(const std::string& pattern, const std::string& replacement) {
  return [re = detail::compile_regex(pattern), fmt = detail::ecma_format(replacement)](std::string_view n) {
    const std::string s(n);
    return std::regex_match(s, re) ? std::regex_replace(s, re, fmt, std::regex_constants::format_first_only) : s;
  };
}

/// True for names that `pattern` matches as a whole (for filter and drop).
inline std::function<bool(std::string_view)> regex_matches(const std::string& pattern) {
  return [re = detail::compile_regex(pattern)](std::string_view n) { return std::regex_match(std::string(n), re); };
}

}  // namespace formats
}  // namespace statedict::inline v0
