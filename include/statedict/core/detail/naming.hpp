// statedict: the naming rule of flatten (docs/flatten.md): dotted names, quoted names where dotted
// ones collide, and the assignment of unique names to a group of paths.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../value.hpp"
#include "text.hpp"

namespace statedict::inline v0::detail {

// ------------------------------------------------------------------------------------------------
// Names

/// A string key is written bare in a quoted name unless it is empty, contains '.' or '[', looks
/// like an int (optional '-', then digits only), or is not valid UTF-8.
inline bool bare_segment(const Key& k) {
  if (k.is_int()) return true;
  const std::string& s = k.as_string();
  if (s.empty() || !valid_utf8(s)) return false;
  if (s.find_first_of(".[") != std::string::npos) return false;
  std::size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return true;
  for (; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return true;
  return false;
}

/// The quoted name of a path, used where dotted names collide (or are not valid UTF-8): segments
/// joined by '.', a string key that is not bare written as `["<JSON-escaped string>"]` with no '.'
/// before it (bytes that are not UTF-8 written as \xNN, so names are always valid UTF-8).
/// `state.1.exp_avg` (int key 1) vs `state["1"].exp_avg` (string key "1").
inline std::string quoted_name(const Path& p) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (bare_segment(p[i])) {
      if (i) out += '.';
      out += p[i].str();
      continue;
    }
    out += "[\"";
    const std::string& str = p[i].as_string();
    for (std::size_t j = 0; j < str.size();) {
      const auto c = static_cast<unsigned char>(str[j]);
      const std::size_t len = utf8_seq(str, j);
      if (len == 0) {  // a byte that is not UTF-8: \xNN keeps the name valid UTF-8
        out += "\\x";
        out += hex[c >> 4];
        out += hex[c & 15];
        ++j;
        continue;
      }
      if (c == '"' || c == '\\') {
        out += '\\';
        out += str[j];
      } else if (c < 0x20) {
        out += "\\u00";
        out += hex[c >> 4];
        out += hex[c & 15];
      } else {
        out.append(str, j, len);
      }
      j += len;
    }
    out += "\"]";
  }
  return out;
}

/// mark_repeats' default hash: 8 bytes a step, each mixed by a multiply and a shift. Its only
/// job is to spread names over the radix sort's buckets (equal hashes are compared by name);
/// std::hash spends about three times as long on a typical 30-byte tensor name.
struct name_hash {
  std::size_t operator()(std::string_view s) const noexcept {
    std::uint64_t h = (s.size() + 1) * 0x9e3779b97f4a7c15ULL;
    const char* p = s.data();
    std::size_t n = s.size();
    auto step = [&h](std::uint64_t w) {
      h = (h ^ w) * 0xbf58476d1ce4e5b9ULL;
      h ^= h >> 31;
    };
    for (; n >= 8; p += 8, n -= 8) {
      std::uint64_t w;
      std::memcpy(&w, p, 8);
      step(w);
    }
    if (n != 0) {
      std::uint64_t w = 0;
      std::memcpy(&w, p, n);
      step(w);
    }
    return static_cast<std::size_t>(h);
  }
};

/// Sets `repeated[i]` for every i < n whose `name(i)` equals another's; returns whether any does.
/// Sorts (hash, i) pairs by hash (radix, in sequential passes: a hash table of 100k names costs a
/// cache miss per name), then compares names only within runs of equal hashes, sorted by name
/// there: O(n) for distinct hashes and O(n log n) whatever the names.
template <class Name, class Hash = name_hash>
bool mark_repeats(std::size_t n, Name&& name, std::vector<std::uint8_t>& repeated, Hash hash = {}) {
  if (n < 2) return false;
  if (n > UINT32_MAX) throw_error(errors::out_of_range, "more than 2^32 names");
  std::vector<std::uint64_t> keyed(n);
  for (std::size_t i = 0; i < n; ++i)
    keyed[i] = static_cast<std::uint64_t>(hash_index::mix(hash(name(i)))) << 32 | i;
  // LSD radix sort on the upper 32 bits, 11 bits a pass.
  constexpr unsigned bits = 11;
  constexpr std::size_t buckets = std::size_t{1} << bits;
  std::vector<std::size_t> count(3 * buckets, 0);
  auto digit = [](std::uint64_t k, unsigned d) { return static_cast<std::size_t>(k >> (32 + bits * d)) & (buckets - 1); };
  for (const std::uint64_t k : keyed)
    for (unsigned d = 0; d < 3; ++d) ++count[d * buckets + digit(k, d)];
  std::vector<std::uint64_t> tmp(n);
  for (unsigned d = 0; d < 3; ++d) {
    std::size_t* c = count.data() + d * buckets;
    std::size_t sum = 0;
    for (std::size_t b = 0; b < buckets; ++b) sum += std::exchange(c[b], sum);
    for (const std::uint64_t k : keyed) tmp[c[digit(k, d)]++] = k;
    keyed.swap(tmp);
  }
  bool any = false;
  std::vector<std::uint32_t> run;
  for (std::size_t a = 0; a < n;) {
    std::size_t b = a + 1;
    while (b < n && keyed[b] >> 32 == keyed[a] >> 32) ++b;
    if (b - a > 1) {
      run.clear();
      for (std::size_t k = a; k < b; ++k) run.push_back(static_cast<std::uint32_t>(keyed[k]));
      std::sort(run.begin(), run.end(), [&](std::uint32_t x, std::uint32_t y) { return name(x) < name(y); });
      for (std::size_t k = 1; k < run.size(); ++k)
        if (name(run[k]) == name(run[k - 1])) repeated[run[k]] = repeated[run[k - 1]] = 1, any = true;
    }
    a = b;
  }
  return any;
}

/// Assigns unique names to a group of n nodes in pre-order (docs/flatten.md, "Names"):
///   1. the dotted name `dotted(i)`, when no other node of the group has the same dotted name and
///      it is valid UTF-8;
///   2. otherwise the quoted name `quoted(i)`;
///   3. either way, if the name is already taken (by a fixed name or an earlier node), the first
///      free of `NAME#2`, `NAME#3`, ...
/// `fixed[i]`, when given and non-null, is a name the node already has (tensor nodes of a skeleton).
/// `ascii`: the caller knows every dotted name is ASCII (so valid UTF-8).
/// Returns nullopt when the names are simply the dotted names (all unique, none fixed).
template <class Dotted, class Quoted>
std::optional<std::vector<std::string>> assign_names(std::size_t n, Dotted&& dotted, const std::vector<const std::string*>& fixed,
                                                     Quoted&& quoted, bool ascii = false) {
  std::vector<std::uint8_t> collides(n, 0);  // or is not valid UTF-8: either way, quote it
  bool any = mark_repeats(n, dotted, collides);
  for (std::size_t i = 0; i < n && !ascii; ++i)
    if (!valid_utf8(dotted(i))) collides[i] = 1, any = true;
  if (!any && fixed.empty()) return std::nullopt;
  std::unordered_set<std::string> used;
  used.reserve(n * 2);
  for (const std::string* f : fixed)
    if (f) used.insert(*f);
  std::vector<std::string> names(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (i < fixed.size() && fixed[i]) {
      names[i] = *fixed[i];
      continue;
    }
    std::string cand = collides[i] ? std::string(quoted(i)) : std::string(dotted(i));
    if (used.count(cand)) {
      for (std::uint64_t k = 2;; ++k) {
        std::string c = cand + "#" + std::to_string(k);
        if (!used.count(c)) {
          cand = std::move(c);
          break;
        }
      }
    }
    used.insert(cand);
    names[i] = std::move(cand);
  }
  return names;
}

/// Stable sort by address: equal addresses keep their pre-order. Leaves usually come in a few
/// ascending runs (a file's storages in first-use order: one run; a model and its optimizer
/// state carved from two buffers: two), which are merged; otherwise an LSD radix sort, a byte at
/// a time, over the bytes in which the addresses differ.
inline void address_sort(std::vector<std::pair<std::uintptr_t, std::uint32_t>>& v) {
  using entry = std::pair<std::uintptr_t, std::uint32_t>;
  constexpr std::size_t max_runs = 8;
  std::array<std::size_t, max_runs + 1> run{};
  std::size_t runs = 1;
  std::uintptr_t differ = 0;
  for (std::size_t i = 1; i < v.size(); ++i) {
    differ |= v[i].first ^ v[0].first;
    if (v[i].first < v[i - 1].first) {
      if (runs < max_runs) run[runs] = i;
      ++runs;
    }
  }
  if (runs == 1) return;
  auto by_address = [](const entry& a, const entry& b) { return a.first < b.first; };
  if (runs <= max_runs) {
    // Left to right: everything merged so far precedes the next run in pre-order, and
    // inplace_merge keeps the first range's elements first among equals.
    run[runs] = v.size();
    for (std::size_t r = 1; r < runs; ++r)
      std::inplace_merge(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(run[r]),
                         v.begin() + static_cast<std::ptrdiff_t>(run[r + 1]), by_address);
    return;
  }
  std::vector<entry> tmp(v.size());
  for (std::size_t d = 0; d < sizeof(std::uintptr_t); ++d) {
    if (((differ >> (8 * d)) & 255U) == 0) continue;  // every address has the same byte here
    std::array<std::size_t, 256> count{};
    for (const auto& e : v) ++count[(e.first >> (8 * d)) & 255U];
    std::size_t sum = 0;
    for (auto& x : count) sum += std::exchange(x, sum);
    for (const auto& e : v) tmp[count[(e.first >> (8 * d)) & 255U]++] = e;
    v.swap(tmp);
  }
}

}  // namespace statedict::inline v0::detail
