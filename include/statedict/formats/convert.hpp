// statedict: write any described checkpoint (any input format, sharded or not) in any output format.
// SPDX-License-Identifier: MIT
//
// Every writer here computes the output layout first (headers, offsets: nothing read), turns it
// into a Destination, lets the planner prove the copy (every output element written exactly once,
// every read inside its input) and the executor stream it in bounded memory. The output appears
// atomically (io/file.hpp). Also: select(), the `--only PREFIX` subset, and cast(), the `--dtype`
// change of every floating tensor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../exec/executor.hpp"
#include "../exec/sink.hpp"
#include "../io/file.hpp"
#include "../io/hf_sharded.hpp"
#include "../io/safetensors.hpp"
#include "../io/torch_file.hpp"
#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "dcp.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id select_view_sharded {792, error_kind::unsupported, "convert.select_view_sharded"};
inline constexpr error_id select_nothing      {793, error_kind::usage,       "convert.select_nothing"};
inline constexpr error_id convert_part        {794, error_kind::usage,       "convert.part"};
// clang-format on
}  // namespace errors

namespace formats {

namespace detail {
struct tie {
  std::string name;    ///< the tied name's listing name
  std::string target;  ///< the stored tensor it refers to
  std::optional<ViewSpec> view;
};
}  // namespace detail

/// The tied names of a skeleton (aliases and views), with the view's elements for views. For the
/// skeleton of an opened checkpoint (validated when it was read): one without alias or view_of
/// nodes is not walked with paths and names (a tenth of `inspect` of a 10k-tensor .pt).
inline std::vector<detail::tie> tied_names(const nlohmann::json& skeleton) {
  std::vector<detail::tie> out;
  if (!statedict::detail::may_hold_aliases(skeleton)) return out;
  for (const auto& t : statedict::detail::list_tensorish(skeleton)) {
    if (t.kind == statedict::detail::snode::tensor) continue;
    detail::tie x{t.name, t.target, std::nullopt};
    if (t.kind == statedict::detail::snode::view) x.view = statedict::detail::decode_view(statedict::detail::classify(*t.node));
    out.push_back(std::move(x));
  }
  return out;
}
/// tied_names for a Skeleton: a compact one without alias or view nodes (the usual checkpoint) is
/// answered from its leaf records, without building its JSON document.
inline std::vector<detail::tie> tied_names(const Skeleton& skeleton) {
  if (!statedict::detail::may_hold_aliases(skeleton)) return {};
  return tied_names(skeleton.json());
}

/// How the executor runs, and which part of a multi-file output this process writes.
struct write_options {
  exec_options exec{};
  plan_options plan{};
  /// Hugging Face sharded output: largest shard (huggingface_hub's rule; decimal units).
  std::uint64_t max_shard_size = hf::default_max_shard_size;
  /// DCP output: ranks that will load it.
  std::uint32_t world_size = 1;
  /// Multi-file outputs (Hugging Face sharded, DCP): write only the files of part k of K, straight
  /// into the final directory (each file atomically); `index_only` writes only the index (after
  /// checking that every file exists with its planned size), the final step.
  std::optional<PartSpec> part;
  bool index_only = false;
};

// ---------------------------------------------------------------------------------------------
// Transformations of a description

/// Sets every floating tensor's logical dtype to `to` (the executor casts exactly, rounding to
/// nearest even), in the tensors and in the skeleton. Integer, bool and complex tensors keep theirs.
inline void cast(ShardedCheckpoint& ck, dtype to) {
  if (!is_floating(to)) throw_error(errors::unsupported_cast, "--dtype " + std::string(name(to)), "is not a floating dtype");
  for (TensorInfo& t : ck.tensors)
    if (is_floating(t.dtype)) t.dtype = to;
  if (!ck.skeleton.is_null()) safetensors::detail::cast_skeleton(ck.skeleton.mutable_json(), to);
}

namespace detail {
/// Tensor `name`: the elements `v` selects of `base`'s row-major flat index, described in place
/// (base must be stored whole, contiguous, in one chunk: a torch.save or safetensors tensor).
inline TensorInfo view_of(const TensorInfo& base, const std::string& name, const ViewSpec& v) {
  const auto& c = base.chunks;
  const bool whole = c.size() == 1 && c[0].at.strides.empty() && c[0].at.stored == base.dtype &&
                     std::holds_alternative<Box>(c[0].region) && std::get<Box>(c[0].region) == full_box(base.shape);
  if (!whole)
    throw_error(errors::select_view_sharded, "tensor " + quote(name),
                "is a view of " + quote(base.name) + ", which is stored in several pieces");
  TensorInfo t{name, base.dtype, v.shape, {}};
  Chunk ch;
  ch.region = full_box(t.shape);
  ch.at = c[0].at;
  ch.at.byte_offset = checked_add(c[0].at.byte_offset, checked_mul(static_cast<std::uint64_t>(v.offset), itemsize(base.dtype)));
  ch.at.strides = v.strides;
  t.chunks = {ch};
  return t;
}
}  // namespace detail

/// The checkpoint with every tied name of its skeleton (an alias of a tensor, or a view into one)
/// listed as a tensor of its own, reading the same bytes: what inspect and verify show, so that
/// a tied name compares equal to the same tensor stored untied.
/// `ties` are tied_names(ck.skeleton), for callers that list them too.
inline ShardedCheckpoint expand_ties(ShardedCheckpoint ck, const std::vector<detail::tie>& ties) {
  std::vector<TensorInfo> extra;
  for (const auto& t : ties) {
    const TensorInfo* base = ck.find(t.target);
    if (!base) throw_error(errors::flat_missing_tensor, "tensor " + quote(t.target), "the skeleton names it but the checkpoint lacks it");
    if (t.view) {
      extra.push_back(detail::view_of(*base, t.name, *t.view));
    } else {
      TensorInfo a = *base;
      a.name = t.name;
      extra.push_back(std::move(a));
    }
  }
  if (extra.empty()) return ck;
  for (auto& t : extra) ck.tensors.push_back(std::move(t));
  ck.reindex();
  return ck;
}
inline ShardedCheckpoint expand_ties(ShardedCheckpoint ck) {
  if (ck.skeleton.is_null()) return ck;
  const auto ties = tied_names(ck.skeleton);
  return expand_ties(std::move(ck), ties);
}

/// The tensors and values under the given dotted-name prefixes ("model" keeps "model.w" and
/// "model", not "models.w"; see name_prefix_filter). A tied name whose target is dropped becomes a
/// tensor of its own.
inline ShardedCheckpoint select(const ShardedCheckpoint& ck, const std::vector<std::string>& prefixes) {
  if (prefixes.empty()) return ck;
  const PathFilter keep = name_prefix_filter(prefixes);
  ShardedCheckpoint out;
  out.format = ck.format;
  out.sources = ck.sources;
  out.metadata = ck.metadata;
  if (ck.skeleton.is_null()) {
    for (const TensorInfo& t : ck.tensors) {
      Path p;
      p.emplace_back(t.name);  // a flat dict: the name is one key
      if (keep(p)) out.tensors.push_back(t);
    }
  } else {
    SkeletonSubset sub = skeleton_subset(ck.skeleton, keep);
    out.skeleton = std::move(sub.skeleton);
    for (const SubsetTensor& st : sub.tensors) {
      const TensorInfo* src = ck.find(st.source);
      if (!src) throw_error(errors::flat_missing_tensor, "tensor " + quote(st.source), "the skeleton names it but the checkpoint lacks it");
      TensorInfo t = *src;
      t.name = st.name;
      if (st.view) t = detail::view_of(*src, st.name, *st.view);
      out.tensors.push_back(std::move(t));
    }
  }
  if (out.tensors.empty() && (out.skeleton.is_null() || skeleton_values(out.skeleton).empty()))
    throw_error(errors::select_nothing, "--only", "no tensor or value matches the given prefixes");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writers

namespace detail {

/// One destination chunk holding all of tensor `t` at `offset` of destination `dest`, row-major.
inline TensorInfo whole_at(const TensorInfo& t, std::uint32_t dest, std::uint64_t offset) {
  TensorInfo d{t.name, t.dtype, t.shape, {}};
  d.chunks.push_back(Chunk{full_box(t.shape), Placement{dest, offset, {}, t.dtype}});
  return d;
}

/// The safetensors `__metadata__` for a described checkpoint: its string metadata (which carries
/// e.g. a torch file's module attributes, so they come back when converted again), "format": "pt"
/// unless it has a format, and the skeleton when the tree is not a flat dict of its tensors.
inline std::map<std::string, std::string> safetensors_metadata(const ShardedCheckpoint& ck, bool with_skeleton) {
  std::map<std::string, std::string> md;
  for (const auto& [k, v] : ck.metadata)
    if (k != safetensors::aliases_key && k != safetensors::skeleton_key) md[k] = v;
  md.emplace("format", "pt");
  if (with_skeleton && !ck.skeleton.is_null()) md[std::string(safetensors::skeleton_key)] = ck.skeleton.dump();
  return md;
}

inline std::vector<safetensors::TensorSpec> specs_of(const std::vector<TensorInfo>& tensors) {
  std::vector<safetensors::TensorSpec> s;
  s.reserve(tensors.size());
  for (const TensorInfo& t : tensors) s.push_back({t.name, t.dtype, t.shape});
  return s;
}

inline void run(const Plan& plan, const ShardedCheckpoint& ck, std::vector<Sink*> sinks, const write_options& opt) {
  (void)execute(plan, ck, sinks, opt.exec);
}
}  // namespace detail

/// Writes one .safetensors file. Tensors the skeleton ties (aliases, views) are stored once.
inline void write_safetensors(const ShardedCheckpoint& ck, const std::filesystem::path& path, const write_options& opt = {}) {
  const safetensors::Layout lay = safetensors::layout(detail::specs_of(ck.tensors), detail::safetensors_metadata(ck, true));
  Destination dst;
  dst.names.push_back(path.filename().string());
  dst.sizes.push_back(lay.file_size);
  for (const safetensors::LayoutEntry& e : lay.entries)
    dst.tensors.push_back(detail::whole_at(ck.tensors[e.index], 0, lay.data_start() + e.begin));
  const Plan plan = make_plan(ck, dst, opt.plan);
  OutputFile out = OutputFile::create(path);
  out.write(lay.header);
  FileSink sink(out);
  detail::run(plan, ck, {&sink}, opt);
  out.commit();
}

/// Writes a Hugging Face checkpoint directory: shards split by huggingface_hub's rule,
/// `model.safetensors.index.json` (the skeleton in its metadata when the tree is nested), or one
/// `model.safetensors` when everything fits. With `opt.part`, only that part's shard files are
/// written, each atomically, into `dir`; with `opt.index_only`, only the index.
inline std::vector<std::string> write_hf(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const write_options& opt = {}) {
  std::vector<hf::ShardItem> items;
  items.reserve(ck.tensors.size());
  for (const TensorInfo& t : ck.tensors) items.push_back({t.name, byte_size(t.shape, itemsize(t.dtype)), std::nullopt});
  const hf::ShardPlan sp = hf::plan_shards(items, opt.max_shard_size);
  const bool sharded = sp.is_sharded();
  if ((opt.part || opt.index_only) && !sharded)
    throw_error(errors::convert_part, "--part", "the output fits in one file (" + std::string(hf::single_name) + "): nothing to split");

  // Layout of every shard, then one destination per shard.
  Destination dst;
  std::vector<safetensors::Layout> layouts;
  for (std::uint32_t k = 0; k < sp.shards.size(); ++k) {
    std::vector<TensorInfo> in_shard;
    for (std::size_t i : sp.shards[k].items) in_shard.push_back(ck.tensors[i]);
    std::map<std::string, std::string> md{{"format", "pt"}};
    if (!sharded) md = detail::safetensors_metadata(ck, true);
    layouts.push_back(safetensors::layout(detail::specs_of(in_shard), md));
    dst.names.push_back(sp.shards[k].filename);
    dst.sizes.push_back(layouts.back().file_size);
    for (const auto& e : layouts.back().entries)
      dst.tensors.push_back(detail::whole_at(in_shard[e.index], k, layouts.back().data_start() + e.begin));
  }
  auto index_text = [&] {
    std::vector<std::pair<std::string, std::string>> weight_map;
    for (const auto& s : sp.shards)
      for (std::size_t i : s.items) weight_map.emplace_back(ck.tensors[i].name, s.filename);
    std::map<std::string, std::string> md;
    if (!ck.skeleton.is_null()) md[std::string(safetensors::skeleton_key)] = ck.skeleton.dump();
    return hf::index_json(sp.total_size, md, weight_map);
  };

  std::vector<std::string> written;
  if (opt.index_only) {
    std::filesystem::create_directories(dir);
    std::vector<PlannedFile> planned;
    for (std::size_t k = 0; k < dst.names.size(); ++k) planned.push_back({dst.names[k], dst.sizes[k]});
    check_parts_written(dir, planned, errors::convert_part, "Hugging Face checkpoint", "shard");
    OutputFile f = OutputFile::create(dir / std::string(hf::index_name));
    f.write(index_text());
    f.commit();
    return {std::string(hf::index_name)};
  }
  Plan plan = make_plan(ck, dst, opt.plan);
  std::vector<bool> mine(dst.names.size(), true);
  if (opt.part) {
    const auto parts = assign_parts(plan, opt.part->count);
    for (std::size_t d = 0; d < mine.size(); ++d) mine[d] = parts[d] == opt.part->index;
    plan = select_part(plan, *opt.part);
  }
  std::optional<OutputDir> outdir;
  if (!opt.part) outdir.emplace(OutputDir::create(dir));
  else std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<OutputFile>> files(dst.names.size());
  std::vector<std::unique_ptr<FileSink>> sinks(dst.names.size());
  std::vector<Sink*> ptrs(dst.names.size(), nullptr);
  for (std::size_t d = 0; d < dst.names.size(); ++d) {
    if (!mine[d]) continue;
    files[d] = std::make_unique<OutputFile>(outdir ? outdir->create_file(dst.names[d]) : OutputFile::create(dir / dst.names[d]));
    files[d]->write(layouts[d].header);
    sinks[d] = std::make_unique<FileSink>(*files[d]);
    ptrs[d] = sinks[d].get();
  }
  detail::run(plan, ck, ptrs, opt);
  for (std::size_t d = 0; d < dst.names.size(); ++d)
    if (files[d]) {
      files[d]->commit();
      written.push_back(dst.names[d]);
    }
  if (outdir) {
    if (sharded) {
      OutputFile f = outdir->create_file(std::string(hf::index_name));
      f.write(index_text());
      f.commit();
      written.emplace_back(hf::index_name);
    }
    outdir->commit();
  }
  return written;
}

/// Writes a torch.save file that torch.load reads back as the checkpoint's tree (its skeleton;
/// a flat dict when it has none). Storage CRCs are computed as the bytes are written.
inline void write_torch(const ShardedCheckpoint& ck, const std::filesystem::path& path, const write_options& opt = {}) {
  torch::save_options so;
  so.archive_name = torch::archive_name_for(path.filename());
  torch::SavePlan sp = torch::plan_save(ck, so);
  const Destination dst = sp.destination(path.filename().string());
  std::vector<FlatRange> regions = sp.storage_ranges();
  std::sort(regions.begin(), regions.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  const Plan plan = make_plan(ck, dst, opt.plan);
  torch::PlannedWriter w(path, std::move(sp));
  FileSink sink(w.file());
  sink.track_crc32(regions);
  detail::run(plan, ck, {&sink}, opt);
  for (std::size_t i = 0; i < regions.size(); ++i)
    if (regions[i].size()) w.report_file_crc(regions[i].begin, regions[i].size(), sink.crc32(i));
  w.finish();
}

/// Writes a DCP checkpoint for `opt.world_size` ranks (formats/dcp.hpp).
inline void write_dcp(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const write_options& opt = {}) {
  dcp::write_options o;
  o.world_size = opt.world_size;
  o.exec = opt.exec;
  o.plan = opt.plan;
  o.part = opt.part;
  o.index_only = opt.index_only;
  dcp::write(ck, dir, o);
}

}  // namespace formats
}  // namespace statedict::inline v0
