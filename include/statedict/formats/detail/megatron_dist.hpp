// statedict: Megatron-core `torch_dist` checkpoints (formats/megatron.hpp is the public header): a
// torch.distributed.checkpoint directory of global tensors, read with the DCP reader's parser
// (its `.metadata` may pickle Megatron's MCoreMetadata subclass, read as data), stacked layers
// unstacked into per-layer tensors by placements, SwiGLU's per-layer `_w` / `_v` keys joined.
// SPDX-License-Identifier: MIT
//
//   iter_XXXXXXX/metadata.json   {"sharded_backend": "torch_dist", ...}
//               /.metadata       DCP Metadata (core_v0.15.0: megatron...strategies.torch.MCoreMetadata)
//               /__<rank>_<i>.distcp
//               /common.pt       the non-sharded state (up to core_v0.18; core_v0.19: the DCP
//                                byte item common_state/shard_0_1 holding [that dict])
//
// Keys: `decoder.layers.<name>` with a leading layer axis (the default), or
// `decoder.layers.<i>.<name>` (singleton_local_shards); optimizer moments
// `optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>` sharded like the model key.
// Sources: dist_checkpointing/serialization.py, strategies/torch.py (MCoreMetadata, ShardedObject
// keys), transformer/transformer_block.py (sharded_pp_offset), transformer/mlp.py
// (apply_swiglu_sharded_factory); tests/python/layouts/megatron.md section 3.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/cover.hpp"
#include "../dcp.hpp"
#include "megatron_legacy.hpp"
#include "megatron_rules.hpp"
#include "torch_refs.hpp"

namespace statedict::inline v0::megatron::detail {

inline constexpr std::string_view mcore_metadata_module = "megatron.core.dist_checkpointing.strategies.torch";

/// metadata.json's sharded_backend (Megatron-core's checkpoint config), or nullopt when the folder
/// has no metadata.json of that form (other tools write files of that name too).
inline std::optional<std::string> sharded_backend(const std::filesystem::path& dir, const limits& lim) {
  bool big = false;
  const auto text = small_file(dir / "metadata.json", lim.max_small_file_bytes, big);
  if (!text) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("sharded_backend") || !j["sharded_backend"].is_string()) return std::nullopt;
  return j["sharded_backend"].get<std::string>();
}

/// `.metadata` parsed with the DCP reader; Megatron's MCoreMetadata is read as the Metadata it
/// extends (its extra field, mcore_data, is not used).
inline dcp::Metadata dist_metadata(const std::filesystem::path& dir, const limits& lim, std::string& cls) {
  Value v = dcp::detail::load_metadata_value(dir, lim.dcp);
  cls = v.is_object() ? v.as_object().qualified() : std::string(to_string(v.kind()));
  if (v.is_object() && v.as_object().module == mcore_metadata_module && v.as_object().name == "MCoreMetadata") {
    v.as_object().module = dcp::detail::mod_2;
    v.as_object().name = "Metadata";
  }
  return dcp::parse_metadata(v, lim.dcp, (dir / ".metadata").string());
}

/// The common state dict a `common_state` byte item holds: `[dict]`, as torch.save wrote it, or
/// (torch 2.x DCP writing a BytesIO value) a pickled io.BytesIO whose bytes are that torch.save
/// archive, read here as a torch.save file of its own (kept in `keep` while describing).
inline Value common_item(const Value& item, const limits& lim, const std::string& where, std::optional<optim_shard::LoadedFile>& keep) {
  const Value* v = &item;
  if (po::is_class(item, {"_io.BytesIO"})) {
    const Object& o = item.as_object();
    if (o.state.size() != 1 || !o.state[0].is_tuple() || o.state[0].as_list().empty() || !o.state[0].as_list()[0].is_bytes())
      throw_error(errors::mg_torch_dist, where, "holds an io.BytesIO without its bytes (expected the state (bytes, position, dict))");
    const auto& b = o.state[0].as_list()[0].as_bytes().data;
    auto src = MemorySource::copy_of(where, std::as_bytes(std::span<const std::uint8_t>(b.data(), b.size())));
    torch::load_options lo;
    lo.limits = lim.torch;
    lo.keep_unknown_objects = true;
    try {
      torch::File f = torch::read(src, lo);
      keep = optim_shard::LoadedFile{where, f.source, std::move(f.value), f.view_base};
    } catch (error& e) {
      e.add_context(where);
      throw;
    }
    v = &keep->tree;
  }
  if (!v->is_sequence() || v->as_list().size() != 1 || !v->as_list()[0].is_dict())
    throw_error(errors::mg_torch_dist, where, "holds " + po::kind_of(*v) + ", expected [the common state dict]");
  return v->as_list()[0];
}

/// One global tensor of the DCP checkpoint with its chunks located in the data files (as
/// dcp::describe locates them; distinct boxes must tile the tensor).
inline TensorInfo dist_tensor(const dcp::Entry& e, const dcp::Metadata& md, dcp::detail::Files& files, const limits& lim,
                              const std::string& mdfile) {
  namespace tr = statedict::detail::torch_refs;
  const dcp::TensorMeta& tm = *e.tensor;
  const std::string where = "file " + quote(mdfile) + ": key " + quote(e.fqn);
  TensorInfo ti{e.fqn, tm.dtype, tm.size, {}};
  std::vector<Box> boxes;
  for (const dcp::ChunkMeta& c : tm.chunks) {
    Box b{c.offsets, c.sizes};
    if (std::find(boxes.begin(), boxes.end(), b) != boxes.end()) continue;
    const dcp::StorageInfo& si = *md.find(dcp::StorageIndex{e.fqn, c.offsets});
    const std::string iw = where + ": chunk at " + to_string(c.offsets) + " in " + quote(si.relative_path);
    const std::uint32_t fi = files.open(si.relative_path, iw);
    const tr::Tree t = dcp::detail::load_item(files.item(fi, si, iw), lim.dcp, iw);
    if (!tr::is_ref(t.value)) throw_error(errors::dcp_item_not_tensor, iw, "tensor item holds " + po::kind_of(t.value) + ", not a tensor");
    const tr::TensorRef& r = t.tensors[tr::ref_index(t.value)];
    if (r.dtype != tm.dtype)
      throw_error(errors::dcp_item_dtype, iw, "stored tensor is " + std::string(name(r.dtype)) + ", .metadata says " + std::string(name(tm.dtype)));
    if (r.sizes != c.sizes) throw_error(errors::dcp_item_shape, iw, "stored tensor has size " + to_string(r.sizes) + ", .metadata says " + to_string(c.sizes));
    boxes.push_back(b);
    if (is_empty(b) && !b.sizes.empty()) continue;
    Placement at{fi, checked_add(si.offset, r.byte_offset(), "item offset"), {}, r.dtype};
    if (!is_contiguous(r.sizes, r.strides)) at.strides = r.strides;
    ti.chunks.push_back(Chunk{std::move(b), std::move(at)});
  }
  if (numel(tm.size) > 0)
    if (auto issue = cover(full_box(tm.size), boxes, false))
      throw_error(issue->what == CoverIssue::kind::hole ? errors::dcp_incomplete_tensor : errors::dcp_overlapping_chunks, where,
                  "element " + to_string(issue->index) + " of the tensor of size " + to_string(tm.size) +
                      (issue->what == CoverIssue::kind::hole ? " is in no chunk" : " is in two chunks"));
  return ti;
}

/// True for `decoder.layers.<name>` whose next component is not a layer number: stacked layers.
inline bool stacked_key(std::string_view k) {
  constexpr std::string_view p = "decoder.layers.";
  return k.substr(0, p.size()) == p && k.size() > p.size() && (k[p.size()] < '0' || k[p.size()] > '9');
}

/// The per-layer tensors of a stacked one: layer l is the slice at l of the leading axis, each
/// chunk's part of it placed at the chunk's offset plus l's stride (no copy).
inline std::vector<TensorInfo> unstack(const TensorInfo& t, std::string_view prefix, std::string_view rest) {
  if (t.shape.empty()) throw_error(errors::mg_torch_dist, "key " + quote(t.name), "stacked layer key without a layer axis");
  std::vector<TensorInfo> out;
  const shape_t inner(t.shape.begin() + 1, t.shape.end());
  for (dim_t l = 0; l < t.shape[0]; ++l) out.push_back(TensorInfo{std::string(prefix) + std::to_string(l) + "." + std::string(rest), t.dtype, inner, {}});
  for (const Chunk& c : t.chunks) {
    const Box& b = std::get<Box>(c.region);
    const shape_t own = b.sizes;
    const std::vector<std::uint64_t> st = storage_strides(c, "key " + quote(t.name));
    for (dim_t k = 0; k < b.sizes[0]; ++k) {
      Chunk x;
      x.region = Box{shape_t(b.offsets.begin() + 1, b.offsets.end()), shape_t(own.begin() + 1, own.end())};
      x.at = c.at;
      x.at.byte_offset = checked_add(c.at.byte_offset, checked_mul(checked_mul(static_cast<std::uint64_t>(k), st[0], "offset"), itemsize(c.at.stored), "offset"),
                                     "offset");
      if (!c.at.strides.empty()) x.at.strides = shape_t(c.at.strides.begin() + 1, c.at.strides.end());
      out[static_cast<std::size_t>(b.offsets[0] + k)].chunks.push_back(std::move(x));
    }
  }
  return out;
}

/// `<base>_w` and `<base>_v` (SwiGLU's linear_fc1 halves with singleton_local_shards) as one
/// tensor `<base>` = [W; V] along dim 0.
inline TensorInfo join_glu(const TensorInfo& w, const TensorInfo& v, std::string base) {
  if (w.dtype != v.dtype || w.shape != v.shape || w.shape.empty())
    throw_error(errors::mg_torch_dist, "key " + quote(w.name), "is " + std::string(name(w.dtype)) + " " + to_string(w.shape) + ", its partner " + quote(v.name) +
                                                                    " is " + std::string(name(v.dtype)) + " " + to_string(v.shape));
  TensorInfo out{std::move(base), w.dtype, w.shape, w.chunks};
  out.shape[0] = static_cast<dim_t>(checked_mul(static_cast<std::uint64_t>(w.shape[0]), 2, "rows"));
  for (Chunk c : v.chunks) {
    std::get<Box>(c.region).offsets[0] += w.shape[0];
    out.chunks.push_back(std::move(c));
  }
  return out;
}

/// The model key an optimizer key is about and its state key, or nullopt for another optimizer
/// key (the distributed optimizer's flattened or per-bucket forms).
inline std::optional<std::pair<std::string, std::string>> optimizer_key(std::string_view k) {
  for (std::string_view s : {"exp_avg_sq", "exp_avg", "fp32_param"}) {
    const std::string p = "optimizer.state." + std::string(s) + ".";
    if (k.substr(0, p.size()) == p) return std::make_pair(std::string(k.substr(p.size())), std::string(s));
  }
  return std::nullopt;
}

/// Tensors of the torch_dist checkpoint by output name: model keys unstacked and joined, then,
/// with `optimizer`, `optimizer.state.<name>.<key>` for each model tensor.
struct dist_read {
  std::vector<TensorInfo> model;
  std::vector<TensorInfo> optimizer;
  bool stacked = false, per_layer_glu = false;
  std::uint64_t layers = 0;
};

/// Per-layer tensors of one key: unstacked when stacked, as is otherwise.
inline std::vector<TensorInfo> per_layer(TensorInfo t, const std::string& key, dist_read& r, const limits& lim) {
  if (!stacked_key(key)) {
    t.name = key;
    return {std::move(t)};
  }
  r.stacked = true;
  const auto layers = static_cast<std::uint64_t>(t.shape.empty() ? 0 : t.shape[0]);
  if (layers > lim.max_layers)
    throw_error(errors::mg_limit, "key " + quote(key), "stacks " + std::to_string(layers) + " layers, more than limits::max_layers");
  if (r.layers != 0 && layers != r.layers)
    throw_error(errors::mg_torch_dist, "key " + quote(key), "stacks " + std::to_string(layers) + " layers, another key " + std::to_string(r.layers));
  r.layers = layers;
  return unstack(t, "decoder.layers.", key.substr(std::string("decoder.layers.").size()));
}

/// Joins `_w` / `_v` pairs in place (the `_w` position keeps the joined tensor).
inline void join_pairs(std::vector<TensorInfo>& ts, dist_read& r) {
  std::map<std::string, std::size_t> at;
  for (std::size_t i = 0; i < ts.size(); ++i) at.emplace(ts[i].name, i);
  std::vector<bool> drop(ts.size(), false);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const std::string& n = ts[i].name;
    const bool w = formats::detail::ends_with(n, ".weight_w") || formats::detail::ends_with(n, ".bias_w");
    const bool v = formats::detail::ends_with(n, ".weight_v") || formats::detail::ends_with(n, ".bias_v");
    if (!w && !v) continue;
    const std::string base = n.substr(0, n.size() - 2);
    const auto partner = at.find(base + (w ? "_v" : "_w"));
    if (partner == at.end()) throw_error(errors::mg_torch_dist, "key " + quote(n), "has no partner " + quote(base + (w ? "_v" : "_w")));
    if (!w) continue;
    r.per_layer_glu = true;
    ts[i] = join_glu(ts[i], ts[partner->second], base);
    drop[partner->second] = true;
  }
  std::vector<TensorInfo> kept;
  for (std::size_t i = 0; i < ts.size(); ++i)
    if (!drop[i]) kept.push_back(std::move(ts[i]));
  ts = std::move(kept);
}

/// Model order: embeddings, layers by number (metadata order inside one), the rest.
inline void order_model(std::vector<TensorInfo>& ts) {
  auto rank = [](const std::string& k) -> std::pair<int, std::uint64_t> {
    if (k.rfind("embedding.", 0) == 0) return {0, 0};
    if (auto l = layer_of(k, "decoder.layers.")) return {1, l->first};
    return {2, 0};
  };
  std::stable_sort(ts.begin(), ts.end(), [&](const TensorInfo& a, const TensorInfo& b) { return rank(a.name) < rank(b.name); });
}

}  // namespace statedict::inline v0::megatron::detail
