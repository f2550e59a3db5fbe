// statedict: what the ColossalAI readers share: error ids, caps, the JSON files (metadata, indexes)
// read with a size and depth cap and duplicate keys refused, and the weight files (`.bin` torch.save
// files read lazily, `.safetensors` files) as name -> where the tensor's elements are, no tensor
// byte read.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <deque>
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

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/value.hpp"
#include "../../io/file.hpp"
#include "../../io/pickle_read.hpp"
#include "../../io/safetensors.hpp"
#include "../../io/torch_file.hpp"
#include "../../shard/checkpoint.hpp"
#include "../optim_shard.hpp"
#include "files.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id colossalai_not_found       {910, error_kind::format, "colossalai.not_found"};
inline constexpr error_id colossalai_bad_json        {911, error_kind::format, "colossalai.bad_json"};
inline constexpr error_id colossalai_global_shape    {912, error_kind::format, "colossalai.global_shape"};
inline constexpr error_id colossalai_bad_box         {913, error_kind::format, "colossalai.bad_box"};
inline constexpr error_id colossalai_duplicate_rank  {914, error_kind::format, "colossalai.duplicate_rank"};
inline constexpr error_id colossalai_missing_file    {915, error_kind::format, "colossalai.missing_file"};
inline constexpr error_id colossalai_missing_tensor  {916, error_kind::format, "colossalai.missing_tensor"};
inline constexpr error_id colossalai_shard_shape     {917, error_kind::format, "colossalai.shard_shape"};
inline constexpr error_id colossalai_dtype           {918, error_kind::format, "colossalai.dtype"};
inline constexpr error_id colossalai_hole            {919, error_kind::format, "colossalai.hole"};
inline constexpr error_id colossalai_overlap         {920, error_kind::format, "colossalai.overlap"};
inline constexpr error_id colossalai_bad_index       {921, error_kind::format, "colossalai.bad_index"};
inline constexpr error_id colossalai_bad_optimizer   {922, error_kind::format, "colossalai.bad_optimizer"};
inline constexpr error_id colossalai_param_order     {923, error_kind::format, "colossalai.param_order"};
inline constexpr error_id colossalai_bad_weight_file {924, error_kind::format, "colossalai.bad_weight_file"};
inline constexpr error_id colossalai_limit           {925, error_kind::limit,  "colossalai.limit"};
inline constexpr error_id colossalai_bad_option      {926, error_kind::usage,  "colossalai.bad_option"};
// clang-format on
}  // namespace errors

namespace colossalai {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Bytes of one metadata or index JSON file.
  std::uint64_t max_json_bytes = std::uint64_t{64} << 20;
  /// Files of one checkpoint (metadata, weight and optimizer files).
  std::uint64_t max_files = std::uint64_t{1} << 16;
  /// Entries (parameters per metadata file, index entries, shards of one parameter).
  std::uint64_t max_entries = std::uint64_t{1} << 24;
  /// Bytes of one pickled optimizer value (async optimizer files), read into memory.
  std::uint64_t max_value_bytes = std::uint64_t{1} << 24;
  /// Limits of the torch.save reader (`.bin` files) and of the safetensors parser.
  torch::limits torch{};
  safetensors::limits safetensors{};
};

/// How a ColossalAI checkpoint is read.
struct options {
  /// Also describe the optimizer state of a released (HybridParallelCheckpointIO) checkpoint, keyed
  /// by parameter name.
  bool with_optimizer = false;
  read_mode mode = read_mode::mmap;
  colossalai::limits limits{};
};

namespace detail {

/// The JSON document at `p` (at most `max_bytes`, nested at most 64 levels, no key twice in one
/// object); errors are `id` naming the file.
inline nlohmann::ordered_json read_json(const std::filesystem::path& p, std::uint64_t max_bytes, const error_id& id) {
  const std::string at = "file " + quote(p.string());
  std::shared_ptr<const ByteSource> f;
  try {
    f = InputFile::open(p, read_mode::pread);
  } catch (error& e) {
    e.add_context(at);
    throw;
  }
  if (f->size() > max_bytes)
    throw_error(errors::colossalai_limit, at,
                std::to_string(f->size()) + " bytes of JSON, more than limits::max_json_bytes (" + std::to_string(max_bytes) + ")");
  std::string text(static_cast<std::size_t>(f->size()), '\0');
  f->read(0, std::as_writable_bytes(std::span<char>(text.data(), text.size())));
  std::vector<std::unordered_set<std::string>> keys;
  auto cb = [&](int depth, nlohmann::ordered_json::parse_event_t ev, nlohmann::ordered_json& parsed) {
    using ev_t = nlohmann::ordered_json::parse_event_t;
    if (depth > 64) throw_error(id, at, "JSON nested deeper than 64 levels");
    if (ev == ev_t::object_start) keys.emplace_back();
    else if (ev == ev_t::object_end && !keys.empty()) keys.pop_back();
    else if (ev == ev_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
      throw_error(id, at, "key " + quote(parsed.get<std::string>()) + " appears twice in one object");
    return true;
  };
  try {
    return nlohmann::ordered_json::parse(text, cb);
  } catch (const nlohmann::json::exception& e) {
    throw_error(id, at, std::string("invalid JSON: ") + safetensors::detail::sanitize_message(e.what()));
  }
}

/// A list of non-negative ints of a JSON document (offsets, lengths, shapes).
inline shape_t json_dims(const nlohmann::ordered_json& j, const error_id& id, const std::string& where, std::string_view what,
                         std::size_t max_rank) {
  if (!j.is_array()) throw_error(id, where, std::string(what) + " is not a list");
  if (j.size() > max_rank) throw_error(id, where, std::string(what) + " has " + std::to_string(j.size()) + " dimensions");
  shape_t out;
  for (const auto& x : j) {
    if (!x.is_number_integer() || (x.is_number_integer() && !x.is_number_unsigned() && x.get<std::int64_t>() < 0))
      throw_error(id, where, std::string(what) + " holds " + x.dump() + ", not a non-negative int");
    const std::uint64_t v = x.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(INT64_MAX)) throw_error(id, where, std::string(what) + " holds " + x.dump() + ", too large");
    out.push_back(static_cast<dim_t>(v));
  }
  return out;
}

/// One stored tensor of a weight file: its dtype and shape, the element strides it is stored
/// with, and where its element 0 is.
struct Stored {
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  shape_t strides;  ///< element strides (row-major for safetensors)
  Placement at;     ///< at.strides empty; the executor gets `strides` when a chunk needs them
};

/// A loaded weight file: its tensors by name (non-tensor entries are not listed), in file order.
struct WeightFile {
  std::string name;
  std::vector<std::pair<std::string, Stored>> tensors;
  std::unordered_map<std::string, std::size_t> by_name;
  /// safetensors `__metadata__` (empty for .bin files)
  std::map<std::string, std::string> metadata;
  /// the safetensors file (for pickled entries of async optimizer files)
  std::optional<safetensors::File> st;
  /// the .bin file's tree (optimizer files need its structure)
  std::optional<optim_shard::LoadedFile> bin;

  [[nodiscard]] const Stored* find(const std::string& n) const {
    const auto it = by_name.find(n);
    return it == by_name.end() ? nullptr : &tensors[it->second].second;
  }
};

/// The weight files of one folder, each loaded once, their sources in one table.
class WeightFiles {
 public:
  WeightFiles(std::filesystem::path dir, read_mode mode, const limits& lim, optim_shard::SourceTable& table)
      : dir_(std::move(dir)), mode_(mode), lim_(lim), table_(table) {}

  /// The file `name` of the folder (a bare file name), loaded on first use. `tensors_only`: a .bin
  /// file must be a dict of tensors (model files); otherwise any tree is kept (optimizer files).
  const WeightFile& get(const std::string& name, const std::string& where, bool flat_tensors = true) {
    if (auto it = index_.find(name); it != index_.end()) return files_[it->second];
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      throw_error(errors::colossalai_missing_file, where, quote(name) + " is not a file name of the checkpoint folder");
    if (files_.size() >= lim_.max_files)
      throw_error(errors::colossalai_limit, where, "more than limits::max_files (" + std::to_string(lim_.max_files) + ") files");
    const auto p = dir_ / name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec))
      throw_error(errors::colossalai_missing_file, where, "file " + quote(name) + " is not in " + quote(dir_.string()));
    WeightFile wf;
    wf.name = name;
    if (formats::detail::ends_with(name, ".safetensors")) load_safetensors(wf, p);
    else load_bin(wf, p, flat_tensors);
    index_.emplace(name, files_.size());
    files_.push_back(std::move(wf));
    return files_.back();
  }
  /// A tensor of a loaded .bin file's tree (nested ones included), located.
  Stored locate(const TensorView& t, const std::string& what) {
    Stored s;
    s.dtype = t.dtype();
    s.shape = t.shape();
    s.strides = t.strides();
    s.at = table_.locate(t, what);
    s.at.strides.clear();
    return s;
  }
  [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_; }
  [[nodiscard]] const std::deque<WeightFile>& loaded() const noexcept { return files_; }

 private:
  void load_safetensors(WeightFile& wf, const std::filesystem::path& p) {
    safetensors::File f = safetensors::File::open(p, safetensors::open_options{mode_, lim_.safetensors});
    const std::uint32_t src = table_.add(f.source());
    wf.metadata = f.metadata();
    if (f.raw_metadata())
      for (const auto& [k, v] : *f.raw_metadata()) wf.metadata[k] = v;
    for (const auto& e : f.entries()) {
      if (!e.dtype)
        throw_error(errors::colossalai_bad_weight_file, "file " + quote(p.string()) + ": tensor " + quote(e.name),
                    "dtype " + std::string(e.dtype_name) + " has no statedict dtype");
      Stored s;
      s.dtype = *e.dtype;
      s.shape = e.shape;
      s.strides = contiguous_strides(e.shape);
      s.at = Placement{src, checked_add(f.data_offset(), e.begin, "offset"), {}, *e.dtype};
      wf.by_name.emplace(e.name, wf.tensors.size());
      wf.tensors.emplace_back(e.name, std::move(s));
    }
    wf.st = std::move(f);
  }
  void load_bin(WeightFile& wf, const std::filesystem::path& p, bool flat_tensors) {
    optim_shard::LoadedFile lf = formats::detail::load_rank_file(p, mode_, lim_.torch, "ColossalAI checkpoint " + quote(dir_.string()));
    (void)table_.add(lf.source, lf.base);
    const std::string at = "file " + quote(p.string());
    if (!lf.tree.is_dict())
      throw_error(errors::colossalai_bad_weight_file, at, "holds a " + std::string(to_string(lf.tree.kind())) + ", not a dict");
    for (const auto& [k, v] : lf.tree.as_dict()) {
      if (!v.is_tensor()) {
        if (flat_tensors && !k.is_string())
          throw_error(errors::colossalai_bad_weight_file, at, "key " + k.str() + " is not a parameter name");
        continue;
      }
      if (!k.is_string()) throw_error(errors::colossalai_bad_weight_file, at, "tensor under the int key " + k.str());
      Stored s = locate(v.as_tensor(), at + ": tensor " + quote(k.as_string()));
      if (!wf.by_name.emplace(k.as_string(), wf.tensors.size()).second)
        throw_error(errors::colossalai_bad_weight_file, at, "tensor " + quote(k.as_string()) + " appears twice");
      wf.tensors.emplace_back(k.as_string(), std::move(s));
    }
    wf.bin = std::move(lf);
  }

  std::filesystem::path dir_;
  read_mode mode_;
  limits lim_;
  optim_shard::SourceTable& table_;
  std::deque<WeightFile> files_;  // references handed out stay valid
  std::unordered_map<std::string, std::size_t> index_;
};

/// A chunk holding the leading box `[0, lengths)` of stored tensor `s` at `offsets` of its tensor.
inline Chunk box_chunk(const Stored& s, const shape_t& offsets, const shape_t& lengths) {
  Chunk c;
  c.region = Box{offsets, lengths};
  c.at = s.at;
  if (lengths != s.shape || !is_contiguous(s.shape, s.strides)) c.at.strides = s.strides;
  return c;
}

}  // namespace detail
}  // namespace colossalai
}  // namespace statedict::inline v0
