// statedict: Hugging Face checkpoint directories (safetensors shards and an index) as a format
// plug-in, and their writers: every shard of one output is one destination of a single plan, so
// the executor streams them all in bounded memory.
// SPDX-License-Identifier: MIT
//
// Reading and the split rule are io/hf_sharded.hpp. A checkpoint that fits in one shard is one
// `model.safetensors` and no index; otherwise `model-0000k-of-0000n.safetensors` and
// `model.safetensors.index.json`, the skeleton of a nested tree in the index metadata. The
// directory appears atomically, or, with save_options::part, each file does (docs/slurm.md).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../exec/executor.hpp"
#include "../exec/sink.hpp"
#include "../io/file.hpp"
#include "../io/hf_sharded.hpp"
#include "../io/safetensors.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "../shard/views.hpp"
#include "../io/torch_file.hpp"
#include "detail/files.hpp"
#include "detail/hf_shards.hpp"
#include "detail/safetensors_write.hpp"
#include "detail/write_files.hpp"
#include "format.hpp"
#include "transform.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id convert_part {794, error_kind::usage, "convert.part"};
// clang-format on
}  // namespace errors

namespace formats::detail {

/// A Hugging Face directory to write: `ck` holds exactly the tensors to store, `shards` says which
/// go where, `shard_metadata[k]` is shard k's `__metadata__`, `index_metadata` the index's (beside
/// total_size), written only when there are several shards.
struct hf_output {
  const ShardedCheckpoint& ck;
  const hf::ShardPlan& shards;
  std::vector<std::map<std::string, std::string>> shard_metadata;
  std::map<std::string, std::string> index_metadata;
};

inline std::vector<std::string> write_hf_dir(const hf_output& o, const std::filesystem::path& dir, const save_options& opt) {
  const bool sharded = o.shards.is_sharded();
  if ((opt.part || opt.index_only) && !sharded)
    throw_error(errors::convert_part, "--part", "the output fits in one file (" + std::string(hf::single_name) + "): nothing to split");

  // Layout of every shard, then one destination per shard.
  Destination dst;
  std::vector<safetensors::Layout> layouts;
  for (std::uint32_t k = 0; k < o.shards.shards.size(); ++k) {
    std::vector<TensorInfo> in_shard;
    for (std::size_t i : o.shards.shards[k].items) in_shard.push_back(o.ck.tensors[i]);
    layouts.push_back(safetensors::layout(specs_of(in_shard), o.shard_metadata.at(k)));
    dst.names.push_back(o.shards.shards[k].filename);
    dst.sizes.push_back(layouts.back().file_size);
    for (const auto& e : layouts.back().entries)
      dst.tensors.push_back(whole_at(in_shard[e.index], k, layouts.back().data_start() + e.begin));
  }
  file_set files;
  files.dst = std::move(dst);
  files.prepare = [&](std::size_t d, OutputFile& f, FileSink&) { f.write(layouts[d].header); };
  if (sharded) {
    files.index_name = std::string(hf::index_name);
    files.index_bytes = [&] {
      std::vector<std::pair<std::string, std::string>> weight_map;
      for (const auto& s : o.shards.shards)
        for (std::size_t i : s.items) weight_map.emplace_back(o.ck.tensors[i].name, s.filename);
      const std::string text = hf::index_json(o.shards.total_size, o.index_metadata, weight_map);
      const auto* b = reinterpret_cast<const std::byte*>(text.data());
      return std::vector<std::byte>(b, b + text.size());
    };
  }
  files.what = "Hugging Face checkpoint";
  files.file_kind = "shard";
  files.part_error = &errors::convert_part;
  return write_file_set(o.ck, files, dir, opt);
}

inline hf::ShardPlan shard_plan_of(const ShardedCheckpoint& ck, const save_options& opt) {
  std::vector<hf::ShardItem> items;
  items.reserve(ck.tensors.size());
  for (const TensorInfo& t : ck.tensors) items.push_back({t.name, byte_size(t.shape, itemsize(t.dtype)), std::nullopt});
  return hf::plan_shards(items, opt.max_shard_size.value_or(hf::default_max_shard_size));
}

}  // namespace formats::detail

namespace formats {

/// Writes a Hugging Face checkpoint directory: shards split by huggingface_hub's rule,
/// `model.safetensors.index.json` (the skeleton in its metadata when the tree is nested), or one
/// `model.safetensors` when everything fits. With `opt.part`, only that part's shard files are
/// written, each atomically, into `dir`; with `opt.index_only`, only the index. Returns the names
/// of the files written.
inline std::vector<std::string> write_hf(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const save_options& opt = {}) {
  check_consistent(ck);
  const hf::ShardPlan sp = detail::shard_plan_of(ck, opt);
  detail::hf_output o{ck, sp, {}, {}};
  for (std::size_t k = 0; k < sp.shards.size(); ++k)
    o.shard_metadata.push_back(sp.is_sharded() ? std::map<std::string, std::string>{{"format", "pt"}} : detail::safetensors_metadata(ck, true));
  if (!ck.skeleton.is_null()) o.index_metadata[std::string(safetensors::skeleton_key)] = ck.skeleton.dump();
  return detail::write_hf_dir(o, dir, opt);
}

}  // namespace formats

namespace hf {

struct write_options {
  std::uint64_t max_shard_size = default_max_shard_size;
  /// Cast floating-point tensors to this dtype; sizes are computed after the cast.
  std::optional<statedict::dtype> cast;
  /// The user's metadata: in the index when sharded, in the file (after "format": "pt") when not.
  std::map<std::string, std::string> metadata;
  /// Further names for written tensors: (alias, stored name), recorded in the stored tensor's shard.
  std::vector<std::pair<std::string, std::string>> aliases;
  bool dedupe_views = true;
  /// A flatten skeleton: in the index metadata under "statedict.skeleton" when sharded, in the file
  /// when not.
  nlohmann::json skeleton;
  /// How the bytes are copied (threads, memory budget, copy paths).
  exec_options exec{};
};

struct write_result {
  ShardPlan plan;
  std::vector<std::string> files;  ///< written file names, index last when sharded
  std::vector<std::pair<std::string, std::string>> aliases;
};

/// Writes a Hugging Face checkpoint directory of these tensors atomically: `dir` appears complete
/// or not at all (an existing `dir` is replaced in one step). Views that are the same tensor are
/// stored once and recorded as aliases in the stored tensor's shard.
inline write_result write_sharded(const std::filesystem::path& dir, std::span<const safetensors::Input> inputs,
                                  const write_options& opt = {}) {
  namespace st = safetensors;
  st::write_options base;
  base.cast = opt.cast;
  base.aliases = opt.aliases;
  base.dedupe_views = opt.dedupe_views;
  base.skeleton = opt.skeleton;  // (a skeleton turns deduplication off: its alias nodes record ties)
  // Dedupe and cast once over the whole state, so that aliases are not counted as tensors.
  st::detail::prepared p = st::detail::prepare(inputs, base);
  ShardedCheckpoint ck;
  ck.format = "memory";
  for (std::size_t k = 0; k < p.stored.size(); ++k) {
    const st::Input& in = inputs[p.stored[k]];
    TensorInfo& t = in.source ? add_stored(ck, in.name, in.dtype, in.shape, in.source, in.offset) : add_view(ck, in.name, in.view);
    t.dtype = p.specs[k].dtype;  // the executor casts from the stored dtype
  }
  formats::save_options so;
  so.max_shard_size = opt.max_shard_size;
  so.exec = opt.exec;
  write_result r;
  r.plan = formats::detail::shard_plan_of(ck, so);
  r.aliases = p.aliases;
  const bool sharded = r.plan.is_sharded();

  for (const auto& [key, v] : opt.metadata)
    if (key == st::aliases_key || key == st::skeleton_key)
      throw_error(errors::st_write_metadata, "__metadata__ key " + quote(key), "reserved for statedict");
  std::string skeleton;  // as stored: with the cast applied
  if (!opt.skeleton.is_null()) {
    nlohmann::json sk = opt.skeleton;
    if (opt.cast) st::detail::cast_skeleton(sk, *opt.cast);
    skeleton = sk.dump();
  }
  std::unordered_map<std::string_view, std::size_t> shard_of;
  for (std::size_t k = 0; k < r.plan.shards.size(); ++k)
    for (std::size_t i : r.plan.shards[k].items) shard_of.emplace(p.specs[i].name, k);
  formats::detail::hf_output o{ck, r.plan, {}, {}};
  for (std::size_t k = 0; k < r.plan.shards.size(); ++k) {
    std::map<std::string, std::string> md{{"format", "pt"}};
    if (!sharded) {
      for (const auto& [key, v] : opt.metadata) md[key] = v;
      if (!skeleton.empty()) md[std::string(st::skeleton_key)] = skeleton;
    }
    nlohmann::ordered_json al = nlohmann::ordered_json::object();
    for (const auto& a : p.aliases)
      if (shard_of.at(a.second) == k) al[a.first] = a.second;
    if (!al.empty()) md[std::string(st::aliases_key)] = al.dump();
    o.shard_metadata.push_back(std::move(md));
  }
  if (sharded) {
    o.index_metadata = opt.metadata;
    if (!skeleton.empty()) o.index_metadata[std::string(st::skeleton_key)] = skeleton;
  }
  r.files = formats::detail::write_hf_dir(o, dir, so);
  return r;
}

/// Describes a Hugging Face checkpoint: a directory (`model.safetensors.index.json`,
/// `pytorch_model.bin.index.json`, `model.safetensors` or `pytorch_model.bin`, looked for in that
/// order) or an index file. An index whose shards are all safetensors files is hf::Checkpoint;
/// otherwise each shard is read by its own format (torch.save `.bin` shards, as transformers
/// writes them) and the shards merged (detail::describe_mixed_index).
inline ShardedCheckpoint describe_checkpoint(const std::filesystem::path& path, const open_options& o, const torch::load_options& topt) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path index_path = path;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / index_name, ec)) return Checkpoint::open(path, o).describe();
    if (fs::exists(path / bin_index_name, ec)) {
      index_path = path / bin_index_name;
    } else if (fs::exists(path / single_name, ec)) {
      return Checkpoint::open(path, o).describe();
    } else if (fs::exists(path / bin_single_name, ec)) {
      ShardedCheckpoint ck = torch::describe(InputFile::open(path / bin_single_name, o.mode), topt);
      ck.format = "hf_sharded";
      return ck;
    } else {
      throw_error(errors::hf_not_a_checkpoint, "directory " + quote(path.string()),
                  "has none of " + std::string(index_name) + ", " + std::string(bin_index_name) + ", " + std::string(single_name) +
                      ", " + std::string(bin_single_name));
    }
  }
  const Index index = read_index(index_path, o, "checkpoint " + quote(index_path.string()));
  const fs::path dir = statedict::detail::parent_or_dot(index_path);
  bool all_safetensors = true;
  for (const std::string& fn : index.files) {
    if (!fs::is_regular_file(dir / fn, ec)) continue;  // the reader names the missing shard
    all_safetensors = all_safetensors && !detail::is_torch_file(*InputFile::open(dir / fn, read_mode::pread));
  }
  if (all_safetensors) return Checkpoint::open(index_path, o).describe();
  return detail::describe_mixed_index(index_path, index, o, topt);
}

/// Hugging Face checkpoint directories (an index and its shards, safetensors or transformers'
/// torch.save `.bin` shards, or one `model.safetensors` / `pytorch_model.bin`) and index files:
/// read, validated against the shards; written (safetensors) with huggingface_hub's split rule.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "hf"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "Hugging Face"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options&) const override {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!in.is_directory()) {
      if (formats::detail::ends_with(in.filename(), ".index.json")) return formats::Detection::match("Hugging Face index file");
      return formats::Detection::not_applicable();
    }
    for (const std::string_view f : {index_name, bin_index_name})
      if (fs::exists(in.path() / f, ec)) return formats::Detection::match("Hugging Face sharded: " + std::string(f));
    for (const std::string_view f : {single_name, bin_single_name})
      if (fs::exists(in.path() / f, ec)) return formats::Detection::match("Hugging Face single file: " + std::string(f));
    return formats::Detection::miss("none of " + std::string(index_name) + ", " + std::string(bin_index_name) + ", " +
                                    std::string(single_name) + ", " + std::string(bin_single_name) + " is in the directory");
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    open_options o = opt.settings.get<open_options>();
    o.mode = opt.mode;
    torch::load_options t = opt.settings.get<torch::load_options>();  // the settings the torch format reads its files with
    t.mode = opt.mode;
    return describe_checkpoint(in.path(), o, t);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  [[nodiscard]] formats::output_claim claims_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    return opt.max_shard_size ? formats::output_claim::by_options : formats::output_claim::none;
  }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    formats::detail::refuse_option(opt.world_size.has_value(), "--world-size", "a Hugging Face directory", "it is for DCP output");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    return formats::write_hf(ck, out, opt);
  }
};

}  // namespace hf
}  // namespace statedict::inline v0
