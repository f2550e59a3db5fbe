// statedict: Hugging Face sharded safetensors checkpoints (a directory of shards and an index).
// SPDX-License-Identifier: MIT
//
// Layout (huggingface_hub `save_torch_state_dict`): `model-00001-of-00003.safetensors`, ... and
// `model.safetensors.index.json` = {"metadata": {"total_size": N, ...}, "weight_map": {tensor: file}};
// a checkpoint that fits in one shard is a single `model.safetensors` and no index.
//
// Writing (formats/hf.hpp) splits with huggingface_hub's `split_state_dict_into_shards_factory`
// rule, `plan_shards` here (one greedy pass in input order; a tensor larger than the maximum goes
// alone into a shard of its own, placed before the shard still open; sizes in decimal units), and
// writes the index with `index_json`.
//
// Reading: `hf::Checkpoint::open(dir or index file)` validates the index against the shards
// (every weight_map entry is in its file, no tensor in two files, no tensor missing from the index,
// no shard name that leaves the directory) and presents all shards as one map and one
// ShardedCheckpoint (format "hf_sharded", one source per shard). docs/safetensors.md has the details.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/error.hpp"
#include "../shard/checkpoint.hpp"
#include "file.hpp"
#include "safetensors.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id hf_index_json          {350, error_kind::format,   "hf.index_json"};          // not JSON / too large / too deep
inline constexpr error_id hf_index_schema        {351, error_kind::format,   "hf.index_schema"};        // weight_map missing or not {str: str}
inline constexpr error_id hf_index_duplicate     {352, error_kind::format,   "hf.index_duplicate"};     // a key twice in one JSON object
inline constexpr error_id hf_missing_tensor      {353, error_kind::format,   "hf.missing_tensor"};      // weight_map entry not in its file
inline constexpr error_id hf_tensor_in_two_files {354, error_kind::format,   "hf.tensor_in_two_files"};
inline constexpr error_id hf_unlisted_tensor     {355, error_kind::format,   "hf.unlisted_tensor"};     // in a shard, not in the index
inline constexpr error_id hf_bad_shard_name      {356, error_kind::security, "hf.bad_shard_name"};      // a path, not a file name
inline constexpr error_id hf_not_a_checkpoint    {357, error_kind::usage,    "hf.not_a_checkpoint"};
inline constexpr error_id hf_bad_max_shard_size  {358, error_kind::usage,    "hf.bad_max_shard_size"};
inline constexpr error_id hf_shard_content       {335, error_kind::format,   "hf.shard_content"};       // a shard holding more than named tensors
// clang-format on
}  // namespace errors

namespace hf {

/// huggingface_hub's MAX_SHARD_SIZE ("5GB").
inline constexpr std::uint64_t default_max_shard_size = 5'000'000'000;
inline constexpr std::string_view index_name = "model.safetensors.index.json";
inline constexpr std::string_view single_name = "model.safetensors";
/// transformers' torch.save shards (`save_pretrained(safe_serialization=False)`, most older Hub
/// checkpoints): `pytorch_model-0000k-of-0000n.bin` and this index, or one `pytorch_model.bin`.
inline constexpr std::string_view bin_index_name = "pytorch_model.bin.index.json";
inline constexpr std::string_view bin_single_name = "pytorch_model.bin";

/// Parses a maximum shard size as huggingface_hub's `parse_size_to_int` does: a number (Python
/// float syntax: "5", "1.5", "2e3") followed by one of the decimal units KB, MB, GB, TB (any
/// case; KB = 1000), surrounding spaces ignored; the byte count is `int(value * unit)` computed
/// in double precision like Python. statedict also accepts a bare integer number of bytes
/// ("1000000", as the Python API takes an int). Binary units ("10KiB", "1GiB") are refused, as
/// huggingface_hub refuses them; so are negative, infinite and NaN sizes.
inline std::uint64_t parse_max_shard_size(std::string_view text) {
  auto bad = [&](const std::string& why) -> std::uint64_t {
    throw_error(errors::hf_bad_max_shard_size, "max shard size " + quote(text), why);
  };
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  std::string_view s = text;
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  if (s.empty()) return bad("is empty");
  if (std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    std::uint64_t v = 0;
    for (char c : s)
      if (__builtin_mul_overflow(v, 10U, &v) || __builtin_add_overflow(v, static_cast<unsigned>(c - '0'), &v))
        return bad("does not fit 64 bits");
    return v;
  }
  if (s.size() < 2) return bad("needs a unit: KB, MB, GB or TB (decimal, as huggingface_hub)");
  std::string unit(s.substr(s.size() - 2));
  for (char& c : unit) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  double mult = 0;
  if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else return bad("unit " + quote(unit) + " not supported: use KB, MB, GB or TB (decimal, as huggingface_hub)");
  std::string_view num = s.substr(0, s.size() - 2);
  while (!num.empty() && is_space(num.back())) num.remove_suffix(1);
  // Python float(): [sign] (digits [. digits] | . digits) [e [sign] digits].
  std::size_t i = 0;
  if (i < num.size() && (num[i] == '+' || num[i] == '-')) ++i;
  std::size_t digits = 0;
  while (i < num.size() && num[i] >= '0' && num[i] <= '9') ++i, ++digits;
  if (i < num.size() && num[i] == '.') {
    ++i;
    while (i < num.size() && num[i] >= '0' && num[i] <= '9') ++i, ++digits;
  }
  if (digits == 0) return bad("is not a number followed by a unit");
  if (i < num.size() && (num[i] == 'e' || num[i] == 'E')) {
    ++i;
    if (i < num.size() && (num[i] == '+' || num[i] == '-')) ++i;
    std::size_t ed = 0;
    while (i < num.size() && num[i] >= '0' && num[i] <= '9') ++i, ++ed;
    if (ed == 0) return bad("is not a number followed by a unit");
  }
  if (i != num.size()) return bad("is not a number followed by a unit");
  const double v = std::strtod(std::string(num).c_str(), nullptr) * mult;
  if (!(v >= 0)) return bad("is negative or not a number");
  if (v >= 18446744073709551616.0) return bad("does not fit 64 bits");
  return static_cast<std::uint64_t>(v);  // truncation, as Python's int()
}

/// One tensor as the splitter sees it.
struct ShardItem {
  std::string name;
  std::uint64_t size = 0;                  ///< bytes on disk
  std::optional<std::uint64_t> storage;    ///< tensors sharing a storage id go to one shard
};

/// Which tensors go to which file.
struct ShardPlan {
  struct Shard {
    std::string filename;
    std::vector<std::size_t> items;  ///< indices into the items, in huggingface_hub's order
  };
  std::vector<Shard> shards;
  /// huggingface_hub's metadata.total_size: each storage counted once.
  std::uint64_t total_size = 0;
  [[nodiscard]] bool is_sharded() const noexcept { return shards.size() > 1; }
};

/// `model-00001-of-00003.safetensors`; `model.safetensors` for a single shard.
inline std::string shard_filename(std::size_t index, std::size_t count) {
  if (count <= 1) return std::string(single_name);
  auto pad5 = [](std::size_t v) {
    std::string s = std::to_string(v);
    return s.size() < 5 ? std::string(5 - s.size(), '0') + s : s;
  };
  return "model-" + pad5(index + 1) + "-of-" + pad5(count) + ".safetensors";
}

/// huggingface_hub's split_state_dict_into_shards_factory, step for step. With no items it gives
/// one empty `model.safetensors` (huggingface_hub gives no file at all).
inline ShardPlan plan_shards(std::span<const ShardItem> items, std::uint64_t max_shard_size = default_max_shard_size) {
  ShardPlan plan;
  std::vector<std::vector<std::size_t>> groups;  // items sharing a storage, first one first
  std::unordered_map<std::uint64_t, std::size_t> group_of;
  std::vector<std::vector<std::size_t>> shards;
  std::vector<std::size_t> current;
  std::uint64_t current_size = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].storage) {
      auto [it, fresh] = group_of.emplace(*items[i].storage, groups.size());
      if (!fresh) {
        groups[it->second].push_back(i);
        continue;
      }
      groups.push_back({i});
    }
    const std::uint64_t size = items[i].size;
    if (size > max_shard_size) {  // alone, ahead of the shard still open
      plan.total_size += size;
      shards.push_back({i});
      continue;
    }
    if (current_size + size > max_shard_size) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += size;
    plan.total_size += size;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  for (const auto& g : groups) {
    if (g.size() < 2) continue;
    for (auto& s : shards)
      if (std::find(s.begin(), s.end(), g[0]) != s.end()) {
        s.insert(s.end(), g.begin() + 1, g.end());
        break;
      }
  }
  if (shards.size() <= 1) {
    ShardPlan::Shard one{std::string(single_name), {}};
    for (std::size_t i = 0; i < items.size(); ++i) one.items.push_back(i);
    plan.shards.push_back(std::move(one));
    return plan;
  }
  for (std::size_t k = 0; k < shards.size(); ++k)
    plan.shards.push_back(ShardPlan::Shard{shard_filename(k, shards.size()), std::move(shards[k])});
  return plan;
}

namespace detail {
/// Appends `s` as Python's json.dumps (ensure_ascii=True) writes a string.
inline void append_python_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  auto u4 = [&](std::uint32_t v) {
    out += "\\u";
    for (int sh = 12; sh >= 0; sh -= 4) out += hex[(v >> sh) & 15U];
  };
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; ++i; continue;
      case '\\': out += "\\\\"; ++i; continue;
      case '\n': out += "\\n"; ++i; continue;
      case '\r': out += "\\r"; ++i; continue;
      case '\t': out += "\\t"; ++i; continue;
      case '\b': out += "\\b"; ++i; continue;
      case '\f': out += "\\f"; ++i; continue;
      default: break;
    }
    if (c < 0x80) {
      u4(c);
      ++i;
      continue;
    }
    // Decode one UTF-8 sequence (the input was validated as UTF-8).
    std::uint32_t cp = 0;
    std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    cp = c & (len == 4 ? 0x07U : len == 3 ? 0x0FU : 0x1FU);
    for (std::size_t k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3FU);
    i += len;
    if (cp >= 0x10000) {
      cp -= 0x10000;
      u4(0xD800 + (cp >> 10));
      u4(0xDC00 + (cp & 0x3FF));
    } else {
      u4(cp);
    }
  }
  out += '"';
}
}  // namespace detail

/// The index file's text exactly as huggingface_hub writes it: json.dumps(index, indent=2).
inline std::string index_json(std::uint64_t total_size, const std::map<std::string, std::string>& metadata,
                              const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string out = "{\n  \"metadata\": {\n    \"total_size\": ";
  auto tot = metadata.find("total_size");  // a user value replaces it in place, as a dict update does
  if (tot != metadata.end()) detail::append_python_json_string(out, tot->second);
  else out += std::to_string(total_size);
  for (const auto& [k, v] : metadata) {
    if (k == "total_size") continue;
    out += ",\n    ";
    detail::append_python_json_string(out, k);
    out += ": ";
    detail::append_python_json_string(out, v);
  }
  out += "\n  },\n  \"weight_map\": {";
  bool first = true;
  for (const auto& [name, file] : weight_map) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    detail::append_python_json_string(out, name);
    out += ": ";
    detail::append_python_json_string(out, file);
  }
  out += first ? "}\n}" : "\n  }\n}";
  return out;
}

struct open_options {
  read_mode mode = read_mode::mmap;
  safetensors::limits lim{};
  /// Largest index file read (huggingface_hub has no cap).
  std::uint64_t max_index_bytes = 100'000'000;
};

/// An index file's content: the shard files in order of first appearance and each weight_map
/// entry's file, validated (names are plain file names), and its "metadata" object.
struct Index {
  std::vector<std::string> files;
  std::vector<std::pair<std::string, std::size_t>> listed;  ///< (tensor, index into files), weight_map order
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
};

/// Reads and validates an index file (`at` names it in errors): JSON within max_index_bytes, no
/// duplicate keys, a "weight_map" object of strings that are plain file names.
inline Index read_index(const std::filesystem::path& path, const open_options& opt, const std::string& at) {
  auto f = InputFile::open(path, read_mode::pread);
  if (f->size() > opt.max_index_bytes)
    throw_error(errors::hf_index_json, at,
                "index of " + std::to_string(f->size()) + " bytes exceeds the cap of " + std::to_string(opt.max_index_bytes) +
                    " (open_options::max_index_bytes)");
  std::string text(static_cast<std::size_t>(f->size()), '\0');
  f->read(0, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
  // Duplicate keys are refused (Python's json keeps the last one silently).
  std::vector<std::unordered_set<std::string>> keys;
  auto cb = [&](int depth, nlohmann::ordered_json::parse_event_t ev, nlohmann::ordered_json& parsed) {
    using ev_t = nlohmann::ordered_json::parse_event_t;
    if (depth > 127) throw_error(errors::hf_index_json, at, "JSON nested deeper than 127 levels");
    if (ev == ev_t::object_start) keys.emplace_back();
    else if (ev == ev_t::object_end && !keys.empty()) keys.pop_back();
    else if (ev == ev_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
      throw_error(errors::hf_index_duplicate, at, "key " + quote(parsed.get<std::string>()) + " appears twice in one object");
    return true;
  };
  nlohmann::ordered_json index;
  try {
    index = nlohmann::ordered_json::parse(text, cb);
  } catch (const nlohmann::json::exception& e) {
    throw_error(errors::hf_index_json, at, "invalid JSON: " + safetensors::detail::sanitize_message(e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw_error(errors::hf_index_schema, at, "expected an object with a \"weight_map\" object");
  Index out;
  if (index.contains("metadata")) {
    if (!index["metadata"].is_object()) throw_error(errors::hf_index_schema, at, "\"metadata\" is not an object");
    out.metadata = index["metadata"];
  }
  std::unordered_map<std::string, std::size_t> file_index;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw_error(errors::hf_index_schema, at + ": weight_map " + quote(name), "the file name is not a string");
    const std::string& fn = file.get_ref<const std::string&>();
    if (fn.empty() || fn == "." || fn == ".." || fn.find('/') != std::string::npos || fn.find('\0') != std::string::npos)
      throw_error(errors::hf_bad_shard_name, at + ": weight_map " + quote(name),
                  "shard " + quote(fn) + " is not a plain file name in the checkpoint directory");
    auto [it, fresh] = file_index.emplace(fn, file_index.size());
    if (fresh) out.files.push_back(fn);
    out.listed.emplace_back(name, it->second);
  }
  return out;
}

/// A Hugging Face checkpoint: all shards as one map. Copies share the files.
class Checkpoint {
 public:
  /// One tensor of the checkpoint.
  struct Item {
    std::string name;
    std::size_t file = 0;                             ///< index into files()
    const safetensors::TensorEntry* entry = nullptr;  ///< the stored tensor (the target, for an alias)
    bool alias = false;
  };

  /// Opens a directory (with `model.safetensors.index.json`, or a single `model.safetensors`) or
  /// an index file, and validates the index against the shards.
  static Checkpoint open(const std::filesystem::path& path, const open_options& opt = {}) {
    namespace fs = std::filesystem;
    Checkpoint c;
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      c.dir_ = path;
      if (fs::exists(path / index_name, ec)) {
        c.index_path_ = path / index_name;
      } else if (fs::exists(path / single_name, ec)) {
        c.open_single(path / single_name, opt);
        return c;
      } else {
        throw_error(errors::hf_not_a_checkpoint, "directory " + quote(path.string()),
                    "has neither " + std::string(index_name) + " nor " + std::string(single_name));
      }
    } else {
      c.index_path_ = path;
      c.dir_ = statedict::detail::parent_or_dot(path);
    }
    c.open_index(opt);
    return c;
  }

  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }
  /// The index file; empty for a single-file checkpoint.
  [[nodiscard]] const std::filesystem::path& index_path() const noexcept { return index_path_; }
  [[nodiscard]] const std::vector<safetensors::File>& files() const noexcept { return files_; }
  /// Tensors in index order (weight_map order), then aliases.
  [[nodiscard]] const std::vector<Item>& items() const noexcept { return items_; }
  /// The index's "metadata" object (empty for a single file).
  [[nodiscard]] const nlohmann::ordered_json& index_metadata() const noexcept { return index_metadata_; }

  [[nodiscard]] const Item* find(std::string_view name) const {
    auto it = by_name_.find(std::string(name));
    return it == by_name_.end() ? nullptr : &items_[it->second];
  }
  [[nodiscard]] TensorView view(std::string_view name) const {
    const Item* i = find(name);
    if (!i) throw_error(errors::st_no_such_tensor, where(), "no tensor " + quote(name));
    return files_[i->file].view(*i->entry);
  }

  /// SHA-256 of the tensor's elements (row-major, little-endian), streamed: `inspect --hash`.
  [[nodiscard]] std::string sha256(std::string_view name) const {
    const Item* i = find(name);
    if (!i) throw_error(errors::st_no_such_tensor, where(), "no tensor " + quote(name));
    return files_[i->file].sha256(*i->entry);
  }

  /// {name: tensor} in index order, aliases last (views of their target).
  [[nodiscard]] Value to_flat_dict() const {
    Dict d;
    d.reserve(items_.size());
    for (const Item& i : items_) d.insert(i.name, files_[i.file].view(*i.entry));
    return Value(std::move(d));
  }

  /// format "hf_sharded"; sources = the shard files; one chunk per stored tensor, in index order.
  /// The skeleton is the stored one, or null for a flat dict, or (when shards record aliases) the
  /// flat dict's skeleton with an alias node per alias.
  [[nodiscard]] ShardedCheckpoint describe() const {
    ShardedCheckpoint c;
    c.format = "hf_sharded";
    for (const auto& f : files_) c.sources.push_back(f.source());
    c.skeleton = skeleton_;
    std::vector<std::pair<std::string, std::string>> aliases;
    for (const Item& i : items_) {
      if (i.alias) {
        aliases.emplace_back(i.name, i.entry->name);
        continue;
      }
      const safetensors::File& f = files_[i.file];
      const safetensors::TensorEntry& e = *i.entry;
      if (!e.dtype)
        throw_error(errors::st_unsupported_dtype, "file " + quote(f.name()) + ": tensor " + quote(e.name), safetensors::unsupported_reason(e));
      TensorInfo t;
      t.name = i.name;
      t.dtype = *e.dtype;
      t.shape = e.shape;
      Chunk ch;
      ch.region = Box{shape_t(e.shape.size(), 0), e.shape};
      ch.at.source = static_cast<std::uint32_t>(i.file);
      ch.at.byte_offset = f.data_offset() + e.begin;
      ch.at.stored = *e.dtype;
      t.chunks.push_back(std::move(ch));
      c.tensors.push_back(std::move(t));
    }
    if (c.skeleton.is_null() && !aliases.empty())
      c.skeleton = safetensors::File::flat_skeleton_with_aliases(c.tensors, aliases);
    c.metadata = metadata_;
    return c;
  }

 private:
  std::string where() const { return "checkpoint " + quote((index_path_.empty() ? dir_ : index_path_).string()); }

  void open_single(const std::filesystem::path& file, const open_options& opt) {
    files_.push_back(safetensors::File::open(file, {opt.mode, opt.lim}));
    const auto& f = files_[0];
    for (const auto& e : f.entries()) items_.push_back(Item{e.name, 0, &e, false});
    for (const auto& [alias, target] : f.aliases()) items_.push_back(Item{alias, 0, f.find(target), true});
    skeleton_ = f.skeleton();
    metadata_ = f.metadata();
    index_names();
  }

  void open_index(const open_options& opt) {
    const std::string at = where();
    Index index = read_index(index_path_, opt, at);
    index_metadata_ = std::move(index.metadata);
    names_ = std::move(index.files);
    const std::vector<std::pair<std::string, std::size_t>>& listed = index.listed;
    for (const auto& fn : names_) {
      try {
        files_.push_back(safetensors::File::open(dir_ / fn, {opt.mode, opt.lim}));
      } catch (error& e) {
        e.add_context(at);
        throw;
      }
    }
    // Every weight_map entry is in its file.
    std::unordered_map<std::string, std::size_t> listed_file;
    listed_file.reserve(listed.size());
    for (const auto& [name, k] : listed) {
      const safetensors::TensorEntry* e = files_[k].resolve(name);
      if (!e)
        throw_error(errors::hf_missing_tensor, at + ": tensor " + quote(name),
                    "the index puts it in " + quote(names_[k]) + ", which does not contain it");
      const bool is_alias = files_[k].find(name) == nullptr;
      items_.push_back(Item{name, k, e, is_alias});
      listed_file.emplace(items_.back().name, k);
    }
    // Every tensor of every shard is listed, for that shard only.
    for (std::size_t k = 0; k < files_.size(); ++k) {
      auto check = [&](const std::string& name) {
        auto it = listed_file.find(name);
        if (it == listed_file.end())
          throw_error(errors::hf_unlisted_tensor, at + ": tensor " + quote(name),
                      "is in " + quote(names_[k]) + " but not in the index's weight_map");
        if (it->second != k)
          throw_error(errors::hf_tensor_in_two_files, at + ": tensor " + quote(name),
                      "is in both " + quote(names_[it->second]) + " and " + quote(names_[k]));
      };
      for (const auto& e : files_[k].entries()) check(e.name);
      // Aliases recorded by statedict in a shard are not in the weight_map (as huggingface_hub
      // drops shared tensors from it); they must not clash with another file's tensors.
      for (const auto& [alias, target] : files_[k].aliases()) {
        auto it = listed_file.find(alias);
        if (it != listed_file.end() && it->second != k)
          throw_error(errors::hf_tensor_in_two_files, at + ": tensor " + quote(alias),
                      "is in " + quote(names_[it->second]) + " and an alias in " + quote(names_[k]));
        if (it == listed_file.end()) {
          items_.push_back(Item{alias, k, files_[k].find(target), true});
          listed_file.emplace(items_.back().name, k);
        }
      }
    }
    for (const auto& [k, v] : index_metadata_.items()) {
      if (k == safetensors::skeleton_key) {
        if (!v.is_string()) throw_error(errors::hf_index_schema, at, "metadata \"statedict.skeleton\" is not a string");
        skeleton_ = nlohmann::json::parse(v.get_ref<const std::string&>(), nullptr, false);
        if (skeleton_.is_discarded() || !skeleton_.is_object())
          throw_error(errors::hf_index_schema, at, "metadata \"statedict.skeleton\" is not a JSON object");
        continue;
      }
      metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
    }
    index_names();
  }

  void index_names() {
    by_name_.reserve(items_.size());
    for (std::size_t i = 0; i < items_.size(); ++i) by_name_.emplace(items_[i].name, i);
  }

  std::filesystem::path dir_;
  std::filesystem::path index_path_;
  std::vector<std::string> names_;
  std::vector<safetensors::File> files_;
  std::vector<Item> items_;
  std::unordered_map<std::string, std::size_t> by_name_;
  nlohmann::ordered_json index_metadata_ = nlohmann::ordered_json::object();
  nlohmann::json skeleton_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace hf
}  // namespace statedict::inline v0
