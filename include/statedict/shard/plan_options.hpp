// statedict: the choices and caps of make_plan (plan_options), and the parts of a plan that several
// processes write (PartSpec, "k/K").
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "../core/error.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id bad_part {617, error_kind::usage, "plan.bad_part"};
// clang-format on
}  // namespace errors

/// Choices and caps of make_plan.
struct plan_options {
  /// Emit CompareOps so the executor checks that replicated copies hold the same values.
  bool check_replicas = false;
  /// Accept source chunks that partially overlap (the one with the lowest (source, offset) wins);
  /// by default a partial overlap is an error (identical regions are replicas and always allowed).
  bool allow_overlapping_sources = false;
  /// Every destination tensor must be covered by its destination chunks.
  bool require_full_destination = true;
  /// Run verify() on the result.
  bool verify = true;
  /// Cap on the number of copy operations before merging (hostile strides could ask for one per
  /// element). About 100 bytes each.
  std::uint64_t max_ops = std::uint64_t{1} << 24;
};

/// Part `index` of `count` (0 <= index < count).
struct PartSpec {
  std::uint32_t index = 0;
  std::uint32_t count = 1;
};

/// Parses "k/K" (0-based k, e.g. "0/4" .. "3/4"); throws errors::bad_part.
inline PartSpec parse_part(std::string_view text) {
  const auto slash = text.find('/');
  auto num = [&](std::string_view s) -> std::uint32_t {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string_view::npos)
      throw_error(errors::bad_part, "part " + quote(text), "expected k/K with 0 <= k < K, e.g. 0/4");
    return static_cast<std::uint32_t>(std::stoul(std::string(s)));
  };
  if (slash == std::string_view::npos) num("");
  PartSpec p{num(text.substr(0, slash)), num(text.substr(slash + 1))};
  if (p.count == 0 || p.index >= p.count)
    throw_error(errors::bad_part, "part " + quote(text), "expected k/K with 0 <= k < K, e.g. 0/4");
  return p;
}

}  // namespace statedict::inline v0
