// statedict: ColossalAI's distributed model layout (HybridParallelCheckpointIO with
// gather_dtensor=False, ColossalAI PR 6181): per TP/PP rank a `pytorch_model-meta-dist-XXXXX(.index).json`
// of boxes and the rank's weight files, described as whole parameters.
// SPDX-License-Identifier: MIT
//
// Each metadata file maps a parameter name to {"offsets", "lengths", "global_shape", "file",
// "rank"}: the rank's piece is the leading `lengths` box of the tensor stored under that name in
// `file`, placed at `offsets` of the global tensor. Every parameter listed becomes one tensor whose
// chunks are those boxes (replicated parameters: one chunk per rank, identical boxes); the boxes
// must agree on the global shape and dtype and cover every element, distinct boxes without
// overlapping; an error names the parameter, the ranks and the element. `file` is taken by its
// base name in the checkpoint folder (unsharded saves record the save-time path). Weight tensors
// no metadata lists (buffers) are reported in metadata["colossalai.not_in_metadata"]; the split
// dim of each parameter in metadata["colossalai.partition_dims"] (-1: replicated), which the
// writer reuses. docs/formats/colossalai.md has the rules and their sources.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/cover.hpp"
#include "colossalai_files.hpp"

namespace statedict::inline v0::colossalai::detail {

/// A metadata file name, `pytorch_model-meta-dist-<5 digits>.json` or `.index.json`: its dist id.
inline std::optional<std::uint64_t> dist_meta_id(const std::string& name) {
  static constexpr std::string_view prefix = "pytorch_model-meta-dist-";
  if (name.size() < prefix.size() + 5 || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string digits = name.substr(prefix.size(), 5);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const std::string rest = name.substr(prefix.size() + 5);
  if (rest != ".json" && rest != ".index.json") return std::nullopt;
  return std::stoull(digits);
}

/// A weight file of the distributed layout: `(pytorch_model|model)-dist-XXXXX[-shard-XXXXX].(bin|safetensors)`.
inline bool is_dist_weight_file(const std::string& name) {
  static const std::regex re(R"((pytorch_model|model)-dist-\d{5}(-shard-\d{5})?\.(bin|safetensors))");
  return std::regex_match(name, re);
}

/// The metadata files of `dir`, by dist id then name.
inline std::vector<std::pair<std::uint64_t, std::filesystem::path>> dist_meta_files(const std::filesystem::path& dir) {
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e2;
    if (!it->is_regular_file(e2)) continue;
    if (auto id = dist_meta_id(it->path().filename().string())) out.emplace_back(*id, it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// One rank's piece of a parameter, as a metadata file lists it.
struct DistShard {
  std::int64_t rank = 0;
  shape_t offsets, lengths, global;
  std::string file;       ///< as recorded
  std::string meta_file;  ///< where it is listed
};

/// The pieces of every parameter, in first-listed order (metadata files by dist id).
struct DistListing {
  std::vector<std::string> order;
  std::unordered_map<std::string, std::vector<DistShard>> shards;
  std::vector<std::string> meta_files;
};

inline DistListing list_dist(const std::filesystem::path& dir, const limits& lim) {
  DistListing out;
  const auto metas = dist_meta_files(dir);
  if (metas.empty())
    throw_error(errors::colossalai_not_found, "directory " + quote(dir.string()), "has no pytorch_model-meta-dist-XXXXX(.index).json file");
  if (metas.size() > lim.max_files)
    throw_error(errors::colossalai_limit, "directory " + quote(dir.string()), "more metadata files than limits::max_files");
  std::uint64_t entries = 0;
  for (const auto& [id, path] : metas) {
    const std::string fn = path.filename().string();
    out.meta_files.push_back(fn);
    const std::string at = "file " + quote(path.string());
    const auto doc = read_json(path, lim.max_json_bytes, errors::colossalai_bad_json);
    if (!doc.is_object() || !doc.contains("metadata") || !doc["metadata"].is_object())
      throw_error(errors::colossalai_bad_json, at, "has no \"metadata\" object");
    for (const auto& [name, item] : doc["metadata"].items()) {
      const std::string where = at + ": parameter " + quote(name);
      if (++entries > lim.max_entries) throw_error(errors::colossalai_limit, where, "more entries than limits::max_entries");
      if (!item.is_object()) throw_error(errors::colossalai_bad_json, where, "is not an object");
      for (const char* k : {"offsets", "lengths", "global_shape", "file", "rank"})
        if (!item.contains(k)) throw_error(errors::colossalai_bad_json, where, std::string("has no \"") + k + "\"");
      DistShard s;
      const std::size_t max_rank = lim.torch.max_rank;
      s.offsets = json_dims(item["offsets"], errors::colossalai_bad_json, where, "offsets", max_rank);
      s.lengths = json_dims(item["lengths"], errors::colossalai_bad_json, where, "lengths", max_rank);
      s.global = json_dims(item["global_shape"], errors::colossalai_bad_json, where, "global_shape", max_rank);
      if (!item["file"].is_string()) throw_error(errors::colossalai_bad_json, where, "\"file\" is not a string");
      if (!item["rank"].is_number_integer()) throw_error(errors::colossalai_bad_json, where, "\"rank\" is not an int");
      s.file = item["file"].get<std::string>();
      s.rank = item["rank"].get<std::int64_t>();
      s.meta_file = fn;
      auto [it, fresh] = out.shards.try_emplace(name);
      if (fresh) out.order.push_back(name);
      for (const DistShard& o : it->second)
        if (o.rank == s.rank)
          throw_error(errors::colossalai_duplicate_rank, where,
                      "rank " + std::to_string(s.rank) + " is listed in " + quote(o.meta_file) + " and in " + quote(fn));
      it->second.push_back(std::move(s));
    }
  }
  return out;
}

/// The base name of a recorded `file` (ColossalAI records the save-time path for unsharded saves).
inline std::string base_name(const std::string& recorded) {
  const auto slash = recorded.find_last_of('/');
  return slash == std::string::npos ? recorded : recorded.substr(slash + 1);
}

/// Checks one parameter's boxes against its global shape and proves they cover it (identical
/// boxes are replicas; distinct ones must not overlap).
inline void check_boxes(const std::string& name, const std::vector<DistShard>& shards, const std::string& where) {
  const shape_t& g = shards.front().global;
  for (const DistShard& s : shards) {
    const std::string at = where + " rank " + std::to_string(s.rank) + " (" + quote(s.meta_file) + ")";
    if (s.global != g)
      throw_error(errors::colossalai_global_shape, at,
                  "global_shape " + to_string(s.global) + ", rank " + std::to_string(shards.front().rank) + " says " + to_string(g));
    if (s.offsets.size() != g.size() || s.lengths.size() != g.size())
      throw_error(errors::colossalai_bad_box, at, "offsets " + to_string(s.offsets) + " and lengths " + to_string(s.lengths) +
                                                      " do not have the " + std::to_string(g.size()) + " dimensions of " + to_string(g));
    for (std::size_t d = 0; d < g.size(); ++d)
      if (checked_add(static_cast<std::uint64_t>(s.offsets[d]), static_cast<std::uint64_t>(s.lengths[d]), "box") >
          static_cast<std::uint64_t>(g[d]))
        throw_error(errors::colossalai_bad_box, at, "box at " + to_string(s.offsets) + " of size " + to_string(s.lengths) +
                                                        " reaches outside the global shape " + to_string(g));
  }
  (void)numel(g);
  if (numel(g) == 0) return;
  std::vector<Box> boxes;
  std::vector<std::size_t> owner;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    Box b{shards[i].offsets, shards[i].lengths};
    if (std::find(boxes.begin(), boxes.end(), b) != boxes.end()) continue;
    boxes.push_back(std::move(b));
    owner.push_back(i);
  }
  if (auto issue = cover(full_box(g), boxes, false)) {
    if (issue->what == CoverIssue::kind::hole) {
      std::string ranks;
      for (const DistShard& s : shards) ranks += (ranks.empty() ? "" : ", ") + std::to_string(s.rank);
      throw_error(errors::colossalai_hole, "parameter " + quote(name),
                  "element " + to_string(issue->index) + " of " + to_string(g) + " is in no rank's box (ranks listing it: " + ranks +
                      "; a metadata file is missing?)");
    }
    const DistShard& a = shards[owner[issue->first]];
    const DistShard& b = shards[owner[issue->second]];
    throw_error(errors::colossalai_overlap, "parameter " + quote(name),
                "the boxes of rank " + std::to_string(a.rank) + " (at " + to_string(a.offsets) + ", size " + to_string(a.lengths) +
                    ") and rank " + std::to_string(b.rank) + " (at " + to_string(b.offsets) + ", size " + to_string(b.lengths) +
                    ") overlap at element " + to_string(issue->index));
  }
}

/// The split dim of a parameter's boxes: the first dim where a box is shorter than the global
/// shape; -1 when every box is the whole tensor.
inline int split_dim(const std::vector<DistShard>& shards) {
  const shape_t& g = shards.front().global;
  for (std::size_t d = 0; d < g.size(); ++d)
    for (const DistShard& s : shards)
      if (s.lengths[d] < g[d]) return static_cast<int>(d);
  return -1;
}

/// Describes the distributed layout in `dir` (see the top of this file).
inline ShardedCheckpoint describe_dist(const std::filesystem::path& dir, const options& opt) {
  const DistListing listing = list_dist(dir, opt.limits);
  optim_shard::SourceTable table;
  WeightFiles files(dir, opt.mode, opt.limits, table);
  ShardedCheckpoint ck;
  nlohmann::ordered_json dims = nlohmann::ordered_json::object();
  std::set<std::string> listed;
  for (const std::string& name : listing.order) {
    const auto& shards = listing.shards.at(name);
    const std::string where = "parameter " + quote(name);
    check_boxes(name, shards, where);
    TensorInfo t;
    t.name = name;
    t.shape = shards.front().global;
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const DistShard& s = shards[i];
      const std::string at = where + " rank " + std::to_string(s.rank) + " (" + quote(s.meta_file) + ")";
      const WeightFile& wf = files.get(base_name(s.file), at);
      const Stored* st = wf.find(name);
      if (!st) throw_error(errors::colossalai_missing_tensor, at, "file " + quote(wf.name) + " has no tensor " + quote(name));
      bool fits = st->shape.size() == s.lengths.size();
      for (std::size_t d = 0; fits && d < s.lengths.size(); ++d) fits = st->shape[d] >= s.lengths[d];
      if (!fits)
        throw_error(errors::colossalai_shard_shape, at,
                    "stores " + to_string(st->shape) + " in " + quote(wf.name) + ", smaller than the box lengths " + to_string(s.lengths));
      if (i == 0) t.dtype = st->dtype;
      else if (st->dtype != t.dtype)
        throw_error(errors::colossalai_dtype, at,
                    "stored as " + std::string(statedict::name(st->dtype)) + ", rank " + std::to_string(shards.front().rank) + "'s as " +
                        std::string(statedict::name(t.dtype)));
      if (numel(s.lengths) > 0 || s.lengths.empty()) t.chunks.push_back(box_chunk(*st, s.offsets, s.lengths));
    }
    dims[name] = split_dim(shards);
    listed.insert(name);
    ck.tensors.push_back(std::move(t));
  }
  // Weight tensors no metadata lists: every weight file of the folder is looked at.
  std::error_code ec;
  std::vector<std::string> weight_names;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string fn = it->path().filename().string();
    if (is_dist_weight_file(fn)) weight_names.push_back(fn);
  }
  std::sort(weight_names.begin(), weight_names.end());
  std::set<std::string> unlisted;
  for (const std::string& fn : weight_names)
    for (const auto& [n, s] : files.get(fn, "directory " + quote(dir.string())).tensors)
      if (!listed.count(n)) unlisted.insert(n);
  ck.format = "colossalai_dist";
  ck.sources = table.take();
  ck.metadata["colossalai.layout"] = "distributed (pytorch_model-meta-dist)";
  ck.metadata["colossalai.partition_dims"] = dims.dump();
  if (!unlisted.empty()) {
    std::string s;
    for (const auto& n : unlisted) s += (s.empty() ? "" : ",") + n;
    ck.metadata["colossalai.not_in_metadata"] = s;
  }
  return ck;
}

}  // namespace statedict::inline v0::colossalai::detail
