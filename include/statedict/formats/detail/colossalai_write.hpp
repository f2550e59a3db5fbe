// statedict: writing ColossalAI's distributed model layout for M tensor-parallel ranks
// (`convert --to colossalai --world-size M`): per rank r, `model-dist-<r>-shard-<k>.safetensors`
// files holding the rank's pieces and `pytorch_model-meta-dist-<r>.index.json` with every
// parameter's box, as ColossalAI's save_sharded_model writes them with safetensors (so its loader
// takes the sharded path and load_dist_model).
// SPDX-License-Identifier: MIT
//
// Each tensor is split on one dim into M equal pieces or kept whole on every rank (ColossalAI
// asserts `global == M * local` on the dim it finds, so uneven splits cannot be saved). The dim:
//   1. save_settings::partition_dims[name] when given (-1: whole on every rank);
//   2. else the dim the source checkpoint split, when it was a ColossalAI distributed checkpoint
//      (metadata "colossalai.partition_dims") and M divides it;
//   3. else, for tensors of 2 or more dims, the first dim M divides; 1-d and 0-d tensors whole.
// ColossalAI's loader then finds, for any receiving rank, the covering boxes. Non-tensor values
// and tied names have no place in this layout (ColossalAI lists a tied parameter once): the
// tensors are written, nothing else. Files are split by size like ColossalAI's StateDictSharder
// (a new file when the next tensor would push a non-empty one past --max-shard-size).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../core/error.hpp"
#include "../../io/safetensors.hpp"
#include "../../shard/checkpoint.hpp"
#include "../format.hpp"
#include "colossalai_files.hpp"
#include "safetensors_write.hpp"
#include "write_files.hpp"

namespace statedict::inline v0::colossalai {

/// How `--to colossalai` splits tensors (formats::save_options::settings).
struct save_settings {
  /// The split dim per tensor name; -1 keeps the tensor whole on every rank. Each given dim must
  /// exist and be divisible by the world size.
  std::map<std::string, int> partition_dims;
};

namespace detail {

inline std::string five(std::uint64_t n) {
  std::string s = std::to_string(n);
  return std::string(s.size() < 5 ? 5 - s.size() : 0, '0') + s;
}

/// The split dim of `t` for `world` ranks (see the top of this file), -1 for whole.
inline int choose_dim(const TensorInfo& t, std::uint32_t world, const save_settings& s, const nlohmann::json& recorded) {
  const auto divisible = [&](int d) { return d >= 0 && static_cast<std::size_t>(d) < t.shape.size() && t.shape[static_cast<std::size_t>(d)] % world == 0 &&
                                             t.shape[static_cast<std::size_t>(d)] >= static_cast<dim_t>(world); };
  if (auto it = s.partition_dims.find(t.name); it != s.partition_dims.end()) {
    const int d = it->second;
    if (d == -1 || world == 1) return -1;
    if (d < 0 || static_cast<std::size_t>(d) >= t.shape.size())
      throw_error(errors::colossalai_bad_option, "partition dim of " + quote(t.name),
                  "dim " + std::to_string(d) + " of a tensor of shape " + to_string(t.shape));
    if (!divisible(d))
      throw_error(errors::colossalai_bad_option, "partition dim of " + quote(t.name),
                  "dim " + std::to_string(d) + " of shape " + to_string(t.shape) + " is not a multiple of " + std::to_string(world) +
                      " ranks (ColossalAI saves even splits only)");
    return d;
  }
  if (world == 1) return -1;
  if (recorded.is_object() && recorded.contains(t.name) && recorded[t.name].is_number_integer()) {
    const int d = recorded[t.name].get<int>();
    if (d == -1) return -1;
    if (divisible(d)) return d;
  }
  if (t.shape.size() < 2) return -1;
  for (std::size_t d = 0; d < t.shape.size(); ++d)
    if (divisible(static_cast<int>(d))) return static_cast<int>(d);
  return -1;
}

/// One file of the output: a rank's shard (its tensors and their boxes) or a metadata file.
struct out_file {
  std::string name;
  std::uint32_t rank = 0;
  std::vector<std::size_t> tensors;  ///< indices into the checkpoint's tensors
  safetensors::Layout layout;
};

}  // namespace detail

/// Writes `ck` as ColossalAI's distributed layout for `opt.world_size` ranks into `dir` (see the
/// top of this file); `--part` writes some of the files, `--part index` checks them.
inline std::vector<std::string> write(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const formats::save_options& opt) {
  const std::uint32_t world = opt.world_size.value_or(1);
  const save_settings& settings = opt.settings.get<save_settings>();
  for (const auto& [n, d] : settings.partition_dims)
    if (!ck.find(n)) throw_error(errors::colossalai_bad_option, "partition dim of " + quote(n), "the checkpoint has no tensor of that name");
  nlohmann::json recorded;
  if (auto it = ck.metadata.find("colossalai.partition_dims"); it != ck.metadata.end())
    recorded = nlohmann::json::parse(it->second, nullptr, false);
  const std::uint64_t cap = opt.max_shard_size.value_or(0);

  std::vector<int> dims(ck.tensors.size());
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) dims[i] = detail::choose_dim(ck.tensors[i], world, settings, recorded);
  auto box_of = [&](std::size_t i, std::uint32_t r) {
    const TensorInfo& t = ck.tensors[i];
    Box b{shape_t(t.shape.size(), 0), t.shape};
    if (dims[i] >= 0) {
      const auto d = static_cast<std::size_t>(dims[i]);
      b.sizes[d] = t.shape[d] / world;
      b.offsets[d] = b.sizes[d] * r;
    }
    return b;
  };

  // Shard files per rank, split by size as ColossalAI's StateDictSharder does.
  std::vector<detail::out_file> shards;
  std::vector<double> total_mib(world, 0.0);
  for (std::uint32_t r = 0; r < world; ++r) {
    std::uint64_t used = 0;
    std::uint32_t k = 0;
    shards.push_back(detail::out_file{"model-dist-" + detail::five(r) + "-shard-" + detail::five(k) + ".safetensors", r, {}, {}});
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
      const std::uint64_t bytes = byte_size(box_of(i, r).sizes, itemsize(ck.tensors[i].dtype));
      if (cap && !shards.back().tensors.empty() && used + bytes > cap) {
        ++k;
        used = 0;
        shards.push_back(detail::out_file{"model-dist-" + detail::five(r) + "-shard-" + detail::five(k) + ".safetensors", r, {}, {}});
      }
      used += bytes;
      total_mib[r] += static_cast<double>(bytes) / 1024.0 / 1024.0;
      shards.back().tensors.push_back(i);
    }
  }

  // The destination: every shard file laid out as the reference safetensors writer lays it out.
  formats::detail::file_set fs;
  for (const TensorInfo& t : ck.tensors) fs.dst.tensors.push_back(TensorInfo{t.name, t.dtype, t.shape, {}});
  std::vector<std::string> meta_text(world);
  std::vector<nlohmann::ordered_json> meta(world);
  for (std::uint32_t r = 0; r < world; ++r) {
    meta[r]["checkpoint_version"] = "1.0";
    meta[r]["total_size"] = total_mib[r];
    meta[r]["metadata"] = nlohmann::ordered_json::object();
  }
  for (std::size_t f = 0; f < shards.size(); ++f) {
    detail::out_file& sf = shards[f];
    std::vector<safetensors::TensorSpec> specs;
    for (std::size_t i : sf.tensors) specs.push_back({ck.tensors[i].name, ck.tensors[i].dtype, box_of(i, sf.rank).sizes});
    sf.layout = safetensors::layout(specs, std::map<std::string, std::string>{{"format", "pt"}});
    fs.dst.names.push_back(sf.name);
    fs.dst.sizes.push_back(sf.layout.file_size);
    for (const auto& e : sf.layout.entries) {
      const std::size_t i = sf.tensors[e.index];
      const TensorInfo& t = ck.tensors[i];
      const Box b = box_of(i, sf.rank);
      if (numel(b.sizes) > 0)
        fs.dst.tensors[i].chunks.push_back(Chunk{b, Placement{static_cast<std::uint32_t>(f), sf.layout.data_start() + e.begin, {}, t.dtype}});
      auto& item = meta[sf.rank]["metadata"][t.name];
      item["offsets"] = b.offsets;
      item["lengths"] = b.sizes;
      item["global_shape"] = t.shape;
      item["file"] = sf.name;
      item["rank"] = sf.rank;
    }
  }
  // The metadata files are files of the set too (no tensor bytes), written with their rank's.
  const std::size_t first_meta = fs.dst.names.size();
  for (std::uint32_t r = 0; r < world; ++r) {
    meta_text[r] = meta[r].dump(4);
    fs.dst.names.push_back("pytorch_model-meta-dist-" + detail::five(r) + ".index.json");
    fs.dst.sizes.push_back(meta_text[r].size());
  }
  fs.prepare = [&](std::size_t d, OutputFile& out, FileSink&) {
    if (d < first_meta) {
      out.write(shards[d].layout.header);
    } else {
      const std::string& text = meta_text[d - first_meta];
      out.write(std::span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()), text.size()));
    }
  };
  fs.what = "ColossalAI checkpoint";
  fs.file_kind = "file";
  return formats::detail::write_file_set(ck, fs, dir, opt);
}

}  // namespace statedict::inline v0::colossalai
