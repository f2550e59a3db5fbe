// statedict: pieces every directory-format reader shares: file-name rules (rank files, natural
// order), the torch.save check of a file's first bytes, and loading a rank file's pickle without
// reading its tensors.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../io/file.hpp"
#include "../../io/torch_file.hpp"
#include "../optim_shard.hpp"

namespace statedict::inline v0::formats::detail {

inline bool ends_with(std::string_view s, std::string_view suffix) noexcept {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// True when the file name of `p` ends with `ext` (".pt"), in any letter case.
inline bool has_extension(const std::filesystem::path& p, std::string_view ext) {
  const std::string n = p.filename().string();
  if (n.size() <= ext.size()) return false;
  for (std::size_t i = 0; i < ext.size(); ++i) {
    const char a = n[n.size() - ext.size() + i];
    const char b = ext[i];
    if ((a >= 'A' && a <= 'Z' ? static_cast<char>(a - 'A' + 'a') : a) != b) return false;
  }
  return true;
}

/// Python's str.strip(): leading and trailing whitespace removed.
inline std::string strip(std::string_view s) {
  auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  return std::string(s);
}

/// Python's "natural keys" order: digit runs compare as numbers, the rest as text.
inline bool natural_less(std::string_view a, std::string_view b) {
  std::size_t i = 0, j = 0;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      std::string_view x = a.substr(i, ie - i), y = b.substr(j, je - j);
      while (x.size() > 1 && x[0] == '0') x.remove_prefix(1);
      while (y.size() > 1 && y[0] == '0') y.remove_prefix(1);
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return (a.size() - i) < (b.size() - j);
}

/// An unsigned decimal of 1 to 9 digits without leading zeros ("0" allowed), as a number.
inline std::optional<std::uint64_t> plain_number(std::string_view digits) {
  if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0')) return std::nullopt;
  std::uint64_t r = 0;
  const auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), r);
  if (ec != std::errc() || p != digits.data() + digits.size()) return std::nullopt;
  return r;
}

/// `<prefix><N><suffix>` -> N ("rank3.pt" with prefix "rank" and suffix ".pt" -> 3).
inline std::optional<std::uint64_t> number_in(std::string_view file, std::string_view prefix, std::string_view suffix) {
  if (file.size() <= prefix.size() + suffix.size() || file.substr(0, prefix.size()) != prefix || !ends_with(file, suffix))
    return std::nullopt;
  return plain_number(file.substr(prefix.size(), file.size() - prefix.size() - suffix.size()));
}

/// The `rank<N>.pt` files of a directory, sorted by N.
inline std::vector<std::pair<std::uint64_t, std::filesystem::path>> rank_files(const std::filesystem::path& dir) {
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code ec2;
    if (!it->is_regular_file(ec2)) continue;
    if (auto r = number_in(it->path().filename().string(), "rank", ".pt")) out.emplace_back(*r, it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// What is wrong with a set of rank files that should be rank 0 .. W-1 (nullopt: nothing).
inline std::optional<std::string> rank_gap(const std::vector<std::pair<std::uint64_t, std::filesystem::path>>& files,
                                           const std::filesystem::path& dir) {
  if (files.empty()) return quote(dir.string()) + " has no rank<N>.pt file";
  for (std::size_t i = 0; i < files.size(); ++i)
    if (files[i].first != i)
      return quote(dir.string()) + " has rank" + std::to_string(files[i].first) + ".pt but no rank" + std::to_string(i) + ".pt";
  return std::nullopt;
}

/// True when the file at `p` begins like a torch.save file (torch::kind_of).
inline bool begins_like_torch_file(const std::filesystem::path& p) {
  try {
    const auto f = InputFile::open(p, read_mode::pread);
    std::byte head[16] = {};
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(f->size(), sizeof head));
    f->peek(0, std::span<std::byte>(head, n));
    return torch::kind_of(std::span<const std::byte>(head, n), f->size()) != torch::file_kind::unknown;
  } catch (const error&) {
    return false;
  }
}

/// "file '<name>'": the context of an error about one loaded file.
inline std::string file_ctx(const optim_shard::LoadedFile& f) { return "file " + quote(f.name); }

/// Loads a rank file's pickle without reading its tensors (torch::read_lazily), keeping objects
/// outside the allow-list as data; errors get `context` (the checkpoint) added.
inline optim_shard::LoadedFile load_rank_file(const std::filesystem::path& p, read_mode mode, const torch::limits& lim,
                                              const std::string& context) {
  torch::load_options lo;
  lo.limits = lim;
  lo.keep_unknown_objects = true;  // config objects, loss scalers, numpy RNG states: kept as data, never run
  lo.mode = mode;
  try {
    torch::File f = torch::read_lazily(InputFile::open(p, mode), lo);
    if (f.big_endian)  // its flat buffers would be sliced without their byte order
      throw_error(errors::pt_big_endian, "file " + quote(p.string()),
                  "a rank file written on a big-endian machine (byteorder record) is not supported by this reader");
    return optim_shard::LoadedFile{p.string(), f.source, std::move(f.value), f.view_base};
  } catch (error& e) {
    e.add_context(context);
    throw;
  }
}

}  // namespace statedict::inline v0::formats::detail
