// statedict: transformations of a checkpoint description. No tensor byte is read or written: each
// returns the description of the transformed checkpoint, which any writer then streams.
// SPDX-License-Identifier: MIT
//
//   rename(ck, f)           every leaf (tensor or value) whose dotted name f changes moves to its new
//                           name; optimizer states keyed by parameter names are re-keyed by f too.
//                           Name functions: strip_prefix, add_prefix, rename_prefix, rename_map;
//                           formats/transform_regex.hpp adds rename_regex.
//   filter(ck, keep)        the leaves whose names `keep` accepts (drop: the others; a dropped
//                           list element before a kept one becomes None, so kept ones keep their
//                           index); select(ck, prefixes) is the filter of `--only`
//   cast(ck, dtype)         every floating tensor's dtype (cast_options: also integer-origin buffers,
//                           or keep some); refuses quantized pairs that dequantize() has not replaced
//   dequantize(ck, opt)     block-FP8 and MXFP4 pairs as computed F32 tensors, scales dropped
//   quantize(ck, opt)       selected weights as computed block-FP8 pairs (F8_E4M3 + F32 scale_inv)
//   split(ck, name, ...)    a tensor cut along a dimension into named parts
//   concat(ck, names, ...)  tensors joined along a dimension into one
//   check_consistent(ck)    the skeleton and the tensors agree (every writer checks it first)
//
// Ties and views stay consistent through every transform: each works on the checkpoint's tree
// with a stand-in for each tensor (formats/detail/tree_form.hpp), so a tied name renamed or dropped
// keeps or becomes the tensor, and the skeleton is flatten's own. What cannot be kept consistent
// is refused with an error naming the leaf: two names onto one, a leaf of a list renamed, a split
// of a tied tensor.
#pragma once

#include "../core/config.hpp"
#include "../core/detail/defines_facade.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <span>
#include <string_view>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/subset.hpp"
#include "../io/safetensors.hpp"
#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "detail/dequantize.hpp"
#include "detail/quantize.hpp"
#include "detail/rename_tree.hpp"
#include "transform_types.hpp"
#include "detail/tree_form.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id select_nothing      {793, error_kind::usage,       "convert.select_nothing"};
inline constexpr error_id transform_no_tensor {852, error_kind::key,         "transform.no_such_tensor"};
inline constexpr error_id transform_tied      {853, error_kind::unsupported, "transform.tied_tensor"};
inline constexpr error_id transform_parts     {854, error_kind::usage,       "transform.bad_parts"};
inline constexpr error_id stale_skeleton      {855, error_kind::format,      "transform.stale_skeleton"};
// clang-format on
}  // namespace errors

namespace formats {


/// The tied names of a skeleton (aliases and views), with the view's elements for views. For the
/// skeleton of an opened checkpoint (validated when it was read): one without alias or view_of
/// nodes is not walked with paths and names (a tenth of `inspect` of a 10k-tensor .pt).
inline std::vector<Tie> tied_names(const nlohmann::json& skeleton) {
  std::vector<Tie> out;
  if (!statedict::detail::may_hold_aliases(skeleton)) return out;
  for (const auto& t : statedict::detail::list_tensorish(skeleton)) {
    if (t.kind == statedict::detail::snode::tensor) continue;
    Tie x{t.name, t.target, std::nullopt};
    if (t.kind == statedict::detail::snode::view) x.view = statedict::detail::decode_view(statedict::detail::classify(*t.node));
    out.push_back(std::move(x));
  }
  return out;
}
/// tied_names for a Skeleton: a compact one without alias or view nodes (the usual checkpoint) is
/// answered from its leaf records, without building its JSON document.
STATEDICT_API std::vector<Tie> tied_names(const Skeleton& skeleton) {
  if (!statedict::detail::may_hold_aliases(skeleton)) return {};
  return tied_names(skeleton.json());
}

// ---------------------------------------------------------------------------------------------
// Transformations of a description


/// Sets every floating tensor's logical dtype to `to` (the executor casts exactly, rounding to
/// nearest even), in the tensors and in the skeleton. Integer, bool and complex tensors keep theirs.
/// Refuses (errors::dequantize_needed, naming the tensor) to cast a checkpoint holding quantized
/// pairs (detail/dequantize.hpp): block-FP8 weights cast without their scales, or MXFP4 blocks
/// left beside tensors of another dtype, would be silently wrong. dequantize() first, or keep
/// the quantized tensors' dtype (cast_options::keep).
STATEDICT_API void cast(ShardedCheckpoint& ck, dtype to, const cast_options& opt = {}) {
  if (!is_floating(to)) throw_error(errors::unsupported_cast, "--dtype " + std::string(name(to)), "is not a floating dtype");
  for (const auto& p : detail::find_quant_pairs(ck, quant_scheme::any)) {
    const TensorInfo* v = ck.find(p.values);
    const TensorInfo* sc = ck.find(p.scales);
    if (!v || !sc || (opt.keep && opt.keep(v->name))) continue;
    const bool quantized = p.scheme == quant_scheme::fp8_block ? v->dtype == dtype::F8_E4M3 : v->dtype == dtype::U8;
    if (quantized)
      throw_error(errors::dequantize_needed, "tensor " + quote(v->name),
                  std::string("is ") + (p.scheme == quant_scheme::fp8_block ? "block-FP8" : "MXFP4") + " quantized (its scales are " +
                      quote(sc->name) + "): --dtype " + std::string(name(to)) +
                      " would cast it without them; dequantize it (convert --dequantize " +
                      (p.scheme == quant_scheme::fp8_block ? "fp8-block" : "mxfp4") + ") or keep its dtype (--keep-dtype)");
  }
  bool kept = false;  // a floating tensor left as it is (of integer origin, or asked for)
  for (TensorInfo& t : ck.tensors) {
    if (!is_floating(t.dtype)) continue;
    if (opt.keep && opt.keep(t.name)) {
      kept = true;
      continue;
    }
    if (t.converted_from && !is_floating(*t.converted_from) && !opt.integer_origin) {
      kept = true;
      continue;
    }
    t.dtype = to;
  }
  if (ck.skeleton.is_null()) return;
  if (!kept) {
    safetensors::detail::cast_skeleton(ck.skeleton.mutable_json(), to);
    return;
  }
  // Some floating tensors keep their dtype: the skeleton's tensor nodes take each tensor's own.
  detail::tree_form form(ck);
  ck.skeleton = form.result().skeleton;
}

/// The checkpoint with every tied name of its skeleton (an alias of a tensor, or a view into one)
/// listed as a tensor of its own, reading the same bytes: what inspect and verify show, so that
/// a tied name compares equal to the same tensor stored untied.
/// `ties` are tied_names(ck.skeleton), for callers that list them too.
STATEDICT_API ShardedCheckpoint expand_ties(ShardedCheckpoint ck, const std::vector<Tie>& ties) {
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
STATEDICT_API ShardedCheckpoint expand_ties(ShardedCheckpoint ck) {
  if (ck.skeleton.is_null()) return ck;
  const auto ties = tied_names(ck.skeleton);
  return expand_ties(std::move(ck), ties);
}

/// The tensors and values under the given dotted-name prefixes ("model" keeps "model.w" and
/// "model", not "models.w"; see name_prefix_filter). A tied name whose target is dropped becomes a
/// tensor of its own.
STATEDICT_API ShardedCheckpoint select(const ShardedCheckpoint& ck, const std::vector<std::string>& prefixes) {
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
// Structure

/// The checkpoint with its leaves renamed by `f` (see formats/detail/rename_tree.hpp for where a
/// renamed leaf goes): tensors, values, ties, views and optimizer states keyed by parameter name.
STATEDICT_API ShardedCheckpoint rename(const ShardedCheckpoint& ck, const name_map& f) {
  detail::tree_form form(ck);
  detail::rename_tree(form.tree(), f);
  return form.result();
}

/// The leaves whose dotted names `keep` accepts (an opaque object is kept whole when any of its
/// leaves is). Dropped list elements before a kept one become None, so kept ones keep their index;
/// containers left empty go. A tied name whose tensor is dropped becomes the tensor.
STATEDICT_API ShardedCheckpoint filter(const ShardedCheckpoint& ck, const std::function<bool(std::string_view)>& keep) {
  ShardedCheckpoint out;
  out.format = ck.format;
  out.sources = ck.sources;
  out.metadata = ck.metadata;
  if (ck.skeleton.is_null()) {
    for (const TensorInfo& t : ck.tensors)
      if (keep(t.name)) out.tensors.push_back(t);
    return out;
  }
  SkeletonSubset sub = skeleton_subset(ck.skeleton, [&](const Path& p) { return keep(dotted(p)); });
  out.skeleton = std::move(sub.skeleton);
  for (const SubsetTensor& st : sub.tensors) {
    const TensorInfo* src = ck.find(st.source);
    if (!src) throw_error(errors::flat_missing_tensor, "tensor " + quote(st.source), "the skeleton names it but the checkpoint lacks it");
    TensorInfo t = st.view ? detail::view_of(*src, st.name, *st.view) : *src;
    t.name = st.name;
    out.tensors.push_back(std::move(t));
  }
  return out;
}

/// The leaves whose dotted names `pred` does not accept (filter with the opposite).
STATEDICT_API ShardedCheckpoint drop(const ShardedCheckpoint& ck, const std::function<bool(std::string_view)>& pred) {
  return filter(ck, [&](std::string_view n) { return !pred(n); });
}

namespace detail {

/// The tensors of `ck` whose chunks hold the elements of `box` of `t`, shifted by `shift` (added to
/// the region's offsets), as chunks of another tensor: pure placements, no byte moved.
inline std::vector<Chunk> sub_chunks(const TensorInfo& t, const Box& box, const shape_t& shift) {
  std::vector<Chunk> out;
  for (std::size_t ci = 0; ci < t.chunks.size(); ++ci) {
    const Chunk& c = t.chunks[ci];
    for (const MappedBox& m : mapped_boxes(c, t.shape, "tensor " + quote(t.name) + " chunk " + std::to_string(ci))) {
      const auto isect = intersect(m.box, box);
      if (!isect || is_empty(*isect)) continue;
      Chunk piece;
      Box region = *isect;
      for (std::size_t d = 0; d < region.offsets.size(); ++d) region.offsets[d] += shift[d];
      piece.region = std::move(region);
      piece.at = c.at;
      piece.at.byte_offset = checked_add(c.at.byte_offset, checked_mul(m.offset_of(isect->offsets), itemsize(c.at.stored)));
      piece.at.strides.assign(m.step.begin(), m.step.end());
      out.push_back(std::move(piece));
    }
  }
  return out;
}

/// The path of the dict entry holding the placeholder `v` (the same view), or nullopt; throws
/// transform_tied when another leaf shares its elements.
inline Path entry_of(const Value& tree, const TensorView& v, std::string_view name) {
  std::vector<Path> at;
  bool shared = false;
  const auto* lo = v.data();
  const auto* hi = v.data() + std::max<std::uint64_t>(v.nbytes(), 1);
  visit(tree, [&](const Path& p, const Value& x) {
    if (!x.is_tensor()) return;
    const TensorView& y = x.as_tensor();
    if (y.data() >= lo && y.data() < hi) {
      if (same_view(y, v)) at.push_back(p);
      else shared = true;
    }
  });
  if (at.empty()) throw_error(errors::transform_no_tensor, "tensor " + quote(name), "is not in the checkpoint's tree");
  if (at.size() > 1 || shared)
    throw_error(errors::transform_tied, "tensor " + quote(name), "shares its elements with another name: untie it first (expand_ties)");
  const Value* parent = find_path(tree, Path(at[0].begin(), at[0].end() - 1));
  if (!parent || !parent->is_dict()) throw_error(errors::rename_not_dict, "tensor " + quote(name), "is not a dict entry");
  return at[0];
}

}  // namespace detail


/// Tensor `name` cut along `dim` into `parts` (sizes summing to its size there), each a tensor of
/// its own at its name (as rename places names), in the tensor's place; the tensor goes. The
/// parts read the same bytes: nothing is copied until a writer streams them.
STATEDICT_API ShardedCheckpoint split(const ShardedCheckpoint& ck, std::string_view name, std::size_t dim, const std::vector<part>& parts) {
  const TensorInfo* t = ck.find(name);
  if (!t) throw_error(errors::transform_no_tensor, "tensor " + quote(name), "is not in the checkpoint (" + ck.format + ")");
  if (dim >= t->shape.size())
    throw_error(errors::transform_parts, "tensor " + quote(name), "has " + std::to_string(t->shape.size()) + " dimensions; cannot split dim " + std::to_string(dim));
  dim_t total = 0;
  for (const part& p : parts) {
    if (p.size < 0 || p.name.empty()) throw_error(errors::transform_parts, "tensor " + quote(name), "a part needs a name and a size >= 0");
    total = static_cast<dim_t>(checked_add(static_cast<std::uint64_t>(total), static_cast<std::uint64_t>(p.size)));
  }
  if (total != t->shape[dim])
    throw_error(errors::transform_parts, "tensor " + quote(name),
                "parts of " + std::to_string(total) + " along dim " + std::to_string(dim) + " for its " + std::to_string(t->shape[dim]));
  detail::tree_form form(ck);
  const TensorInfo original = *t;
  const Path at = detail::entry_of(form.tree(), *form.placeholder(name), name);
  Value& parent = *find_path(form.tree(), Path(at.begin(), at.end() - 1));
  // The parts, under temporary keys in the tensor's place, then renamed to their names.
  Dict rebuilt;
  std::map<std::string, std::string, std::less<>> names;
  const std::string prefix = at.size() > 1 ? dotted(Path(at.begin(), at.end() - 1)) + "." : std::string();
  for (auto& [k, v] : parent.as_dict()) {
    if (!(k == at.back())) {
      rebuilt.insert(k, std::move(v));
      continue;
    }
    dim_t offset = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      Box box = full_box(original.shape);
      box.offsets[dim] = offset;
      box.sizes[dim] = parts[i].size;
      shape_t shift(original.shape.size(), 0);
      shift[dim] = -offset;
      TensorInfo piece{parts[i].name, original.dtype, box.sizes, detail::sub_chunks(original, box, shift)};
      piece.converted_from = original.converted_from;
      const std::string key = "\x01split " + std::to_string(i);
      names.emplace(prefix + key, parts[i].name);
      rebuilt.insert(Key(key), Value(form.add(std::move(piece))));
      offset += parts[i].size;
    }
  }
  parent = Value(std::move(rebuilt));
  detail::rename_tree(form.tree(), rename_map(std::move(names)));
  return form.result();
}

/// Tensors `names` (same dtype, same shape but along `dim`) joined along `dim` into one tensor
/// `to`, in the place of the first; the parts go. Pure placements: the planner proves the joined
/// tensor covered when a writer streams it.
STATEDICT_API ShardedCheckpoint concat(const ShardedCheckpoint& ck, const std::vector<std::string>& names, std::size_t dim, const std::string& to) {
  if (names.empty()) throw_error(errors::transform_parts, "concat into " + quote(to), "no tensors given");
  std::vector<const TensorInfo*> parts;
  for (const auto& n : names) {
    const TensorInfo* t = ck.find(n);
    if (!t) throw_error(errors::transform_no_tensor, "tensor " + quote(n), "is not in the checkpoint (" + ck.format + ")");
    parts.push_back(t);
  }
  const TensorInfo& first = *parts.front();
  if (dim >= first.shape.size())
    throw_error(errors::transform_parts, "tensor " + quote(first.name), "has no dim " + std::to_string(dim) + " to join along");
  shape_t shape = first.shape;
  shape[dim] = 0;
  for (const TensorInfo* t : parts) {
    bool fits = t->dtype == first.dtype && t->shape.size() == first.shape.size();
    for (std::size_t d = 0; fits && d < first.shape.size(); ++d) fits = d == dim || t->shape[d] == first.shape[d];
    if (!fits)
      throw_error(errors::transform_parts, "tensor " + quote(t->name),
                  std::string(name(t->dtype)) + " " + to_string(t->shape) + " cannot join " + std::string(name(first.dtype)) + " " +
                      to_string(first.shape) + " along dim " + std::to_string(dim));
    shape[dim] = static_cast<dim_t>(checked_add(static_cast<std::uint64_t>(shape[dim]), static_cast<std::uint64_t>(t->shape[dim])));
  }
  TensorInfo joined{to, first.dtype, shape, {}};
  dim_t offset = 0;
  for (const TensorInfo* t : parts) {
    shape_t shift(shape.size(), 0);
    shift[dim] = offset;
    for (Chunk& c : detail::sub_chunks(*t, full_box(t->shape), shift)) joined.chunks.push_back(std::move(c));
    offset += t->shape[dim];
  }
  detail::tree_form form(ck);
  std::vector<Path> at;
  for (const TensorInfo* t : parts) at.push_back(detail::entry_of(form.tree(), *form.placeholder(t->name), t->name));
  // The joined tensor takes the first part's entry (under a temporary key); the others go.
  const std::string key = "\x01concat";
  const std::string prefix = at[0].size() > 1 ? dotted(Path(at[0].begin(), at[0].end() - 1)) + "." : std::string();
  const TensorView placeholder = form.add(std::move(joined));
  for (std::size_t i = at.size(); i-- > 1;) find_path(form.tree(), Path(at[i].begin(), at[i].end() - 1))->as_dict().erase(at[i].back());
  Value& parent = *find_path(form.tree(), Path(at[0].begin(), at[0].end() - 1));
  Dict rebuilt;
  for (auto& [k, v] : parent.as_dict()) {
    if (k == at[0].back()) rebuilt.insert(Key(key), Value(placeholder));
    else rebuilt.insert(k, std::move(v));
  }
  parent = Value(std::move(rebuilt));
  detail::rename_tree(form.tree(), rename_map({{prefix + key, to}}));
  return form.result();
}

/// The checkpoint with its quantized pairs (opt.scheme; docs/formats/quantized.md) replaced by
/// computed tensors of logical dtype F32 that the executor dequantizes while it streams, in its
/// bounded memory; the scale tensors go, every other tensor stays as it is (cast() then sets the
/// output dtype: one more rounding, from the F32 product, as the references do).
///   block-FP8: `N` F8_E4M3 [..., rows, cols] and `N_scale_inv` (`X.weight_scale_inv`) F32 (BF16, F16)
///     [..., ceil(rows / block_rows), ceil(cols / block_cols)] -> `N` F32, float(w) * scale.
///   MXFP4: `X_blocks` U8 [E, N, ..., G, 16] and `X_scales` U8 [E, N, ..., G] -> `X` F32 with the
///     values [E, N, ..., G * 32] with dimensions 1 and 2 swapped (transformers' layout).
/// Shapes, dtypes and names are checked here (a missing or misshapen scale is an error naming the
/// tensor); a scale that is not finite is found while streaming, and the executor's error names it.
STATEDICT_API ShardedCheckpoint dequantize(const ShardedCheckpoint& ck, const dequantize_options& opt = {}) {
  if (opt.block_rows == 0 || opt.block_cols == 0)
    throw_error(errors::dequantize_bad_scale, "block size", "block-FP8 blocks of " + std::to_string(opt.block_rows) + " x " +
                                                              std::to_string(opt.block_cols) + " elements: both must be at least 1");
  const auto pairs = detail::find_quant_pairs(ck, opt.scheme);
  if (pairs.empty()) return ck;
  ShardedCheckpoint out = ck;
  std::map<std::string, std::string, std::less<>> renames;
  std::vector<std::string> dropped;
  std::vector<TensorInfo> replaced;
  auto dims = [](const shape_t& s) { return to_string(s); };
  for (const auto& p : pairs) {
    const TensorInfo* v = ck.find(p.values);
    const TensorInfo* s = ck.find(p.scales);
    const bool fp8 = p.scheme == quant_scheme::fp8_block;
    if (!v)
      throw_error(errors::dequantize_bad_scale, "tensor " + quote(p.scales),
                  "looks like the scales of " + quote(p.values) + ", which is not in the checkpoint");
    if (!s)
      throw_error(errors::dequantize_no_scale, "tensor " + quote(v->name),
                  std::string("is ") + (fp8 ? "F8_E4M3" : "MXFP4 blocks") + " without its scales " + quote(p.scales) + ": cannot dequantize it");
    shape_t values_shape;  // MXFP4: the values before the transpose
    if (fp8) {
      if (v->dtype != dtype::F8_E4M3 || v->shape.size() < 2)
        throw_error(errors::dequantize_bad_blocks, "tensor " + quote(v->name),
                    "is " + std::string(name(v->dtype)) + " " + dims(v->shape) + "; a block-FP8 weight (beside " + quote(s->name) +
                        ") is F8_E4M3 with at least 2 dimensions");
      shape_t want = v->shape;
      want[want.size() - 2] = static_cast<dim_t>((static_cast<std::uint64_t>(want[want.size() - 2]) + opt.block_rows - 1) / opt.block_rows);
      want.back() = static_cast<dim_t>((static_cast<std::uint64_t>(want.back()) + opt.block_cols - 1) / opt.block_cols);
      if ((s->dtype != dtype::F32 && s->dtype != dtype::BF16 && s->dtype != dtype::F16) || s->shape != want)
        throw_error(errors::dequantize_bad_scale, "tensor " + quote(s->name),
                    "is " + std::string(name(s->dtype)) + " " + dims(s->shape) + "; the scales of " + quote(v->name) + " " + dims(v->shape) +
                        " in blocks of " + std::to_string(opt.block_rows) + " x " + std::to_string(opt.block_cols) + " are F32 (or BF16, F16) " + dims(want));
    } else {
      if (v->dtype != dtype::U8 || v->shape.size() < 4 || v->shape.back() != 16)
        throw_error(errors::dequantize_bad_blocks, "tensor " + quote(v->name),
                    "is " + std::string(name(v->dtype)) + " " + dims(v->shape) +
                        "; MXFP4 blocks are U8 [E, N, ..., G, 16] (the dequantized tensor's dimensions 1 and 2 are swapped, as transformers "
                        "does, so it needs at least 3)");
      const shape_t want(v->shape.begin(), v->shape.end() - 1);
      if ((s->dtype != dtype::U8 && s->dtype != dtype::F8_E8M0) || s->shape != want)
        throw_error(errors::dequantize_bad_scale, "tensor " + quote(s->name),
                    "is " + std::string(name(s->dtype)) + " " + dims(s->shape) + "; the scales of " + quote(v->name) + " " + dims(v->shape) +
                        " are U8 " + dims(want) + " (one E8M0 exponent per block of 32 values)");
      if (ck.find(p.output))
        throw_error(errors::dequantize_name_taken, "tensor " + quote(p.output),
                    "is already in the checkpoint: the dequantized " + quote(v->name) + " would take its name");
      values_shape = want;
      values_shape.back() = static_cast<dim_t>(checked_mul(static_cast<std::uint64_t>(want.back()), 32));
    }
    auto vb = detail::whole_bytes(ck, *v, "it");
    auto sb = detail::whole_bytes(ck, *s, "its tensor");
    std::shared_ptr<const ByteSource> src;
    shape_t shape = v->shape;
    if (fp8) {
      src = std::make_shared<detail::fp8_block_source>(v->name, std::move(vb), std::move(sb), s->dtype, v->shape, opt.block_rows, opt.block_cols);
    } else {
      auto mx = std::make_shared<detail::mxfp4_source>(p.output, std::move(vb), std::move(sb), values_shape);
      shape = mx->shape();
      src = std::move(mx);
    }
    out.sources.push_back(std::move(src));
    const auto at = static_cast<std::uint32_t>(out.sources.size() - 1);
    TensorInfo t{v->name, dtype::F32, shape, {Chunk{full_box(shape), Placement{at, 0, {}, dtype::F32}}}};
    t.converted_from = fp8 ? std::optional<dtype>(v->dtype) : std::nullopt;
    replaced.push_back(std::move(t));
    if (p.output != v->name) renames.emplace(v->name, p.output);
    dropped.push_back(s->name);
  }
  if (out.skeleton.is_null()) {
    for (TensorInfo& t : replaced) out.tensors[static_cast<std::size_t>(out.find(t.name) - out.tensors.data())] = std::move(t);
    std::sort(dropped.begin(), dropped.end());
    out = drop(out, [&](std::string_view n) { return std::binary_search(dropped.begin(), dropped.end(), n); });
  } else {
    // A tree (a torch.save file): each quantized tensor's entry gets the computed tensor, the
    // scales' entries go; values, ties to other tensors and the structure stay.
    detail::tree_form form(out);
    for (TensorInfo& t : replaced) {
      const std::string n = t.name;
      const Path at = detail::entry_of(form.tree(), *form.placeholder(n), n);
      *find_path(form.tree(), at) = Value(form.add(std::move(t)));
    }
    for (const std::string& n : dropped) {
      const Path at = detail::entry_of(form.tree(), *form.placeholder(n), n);
      find_path(form.tree(), Path(at.begin(), at.end() - 1))->as_dict().erase(at.back());
    }
    out = form.result();
  }
  if (!renames.empty()) out = rename(out, rename_map(std::move(renames)));
  return out;
}

/// The tensors quantize() takes by default, by name: `X.weight` except embeddings (`embed`,
/// `wte`, `wpe`), `lm_head`, norms (`norm`, `ln_`) and MoE routers (a module named `gate` or
/// `router`); quantize() adds: F32, BF16 or F16 with exactly 2 dimensions (Linear weights).
STATEDICT_API bool default_quantized(std::string_view name) {
  constexpr std::string_view suffix = ".weight";
  if (!detail::quant_ends_with(name, suffix)) return false;
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  for (const std::string_view no : {"embed", "wte", "wpe", "lm_head", "norm", "ln_"})
    if (lower.find(no) != std::string::npos) return false;
  const std::string_view module = std::string_view(lower).substr(0, lower.size() - suffix.size());
  const std::string_view last = module.substr(module.rfind('.') == std::string_view::npos ? 0 : module.rfind('.') + 1);
  return last != "gate" && last != "router";
}

/// The checkpoint with the selected weights (opt.select, else default_quantized() among the 2-D
/// F32 / BF16 / F16 tensors) replaced by block-FP8 pairs as transformers' FineGrainedFP8 and
/// DeepSeek-V3 store them: `N` F8_E4M3 of the same shape and `N_scale_inv` (`X.weight_scale_inv`)
/// F32 [..., ceil(rows / block_rows), ceil(cols / block_cols)], both computed sources that the
/// executor fills while it streams, a band of block rows at a time (detail/quantize.hpp gives the
/// arithmetic). A tensor whose rows or columns are not a multiple of the block stays as it is
/// unless opt.partial_blocks. Every other tensor stays as it is.
/// Errors, before anything is written: a selected tensor of another dtype or with fewer than 2
/// dimensions (quantize.bad_tensor), a scale name already taken (quantize.name_taken), a tensor
/// stored in pieces; while streaming (the executor then commits no file): a value that is not
/// finite, a block whose largest magnitude has no float32 reciprocal (quantize.bad_value).
STATEDICT_API ShardedCheckpoint quantize(const ShardedCheckpoint& ck, const quantize_options& opt = {}) {
  if (opt.block_rows == 0 || opt.block_cols == 0)
    throw_error(errors::quantize_bad_tensor, "block size", "block-FP8 blocks of " + std::to_string(opt.block_rows) + " x " +
                                                             std::to_string(opt.block_cols) + " elements: both must be at least 1");
  auto dims = [](const shape_t& s) { return to_string(s); };
  ShardedCheckpoint out = ck;
  std::vector<std::pair<TensorInfo, TensorInfo>> made;  // (F8 weight, its scales)
  for (const TensorInfo& t : ck.tensors) {
    const bool quantizable = (t.dtype == dtype::F32 || t.dtype == dtype::BF16 || t.dtype == dtype::F16) && t.shape.size() >= 2;
    if (opt.select) {
      if (!opt.select(t.name)) continue;
      if (!quantizable)
        throw_error(errors::quantize_bad_tensor, "tensor " + quote(t.name),
                    "is " + std::string(name(t.dtype)) + " " + dims(t.shape) +
                        "; block-FP8 quantizes F32, BF16 or F16 tensors of at least 2 dimensions (the pattern selects it)");
    } else if (!quantizable || t.shape.size() != 2 || !default_quantized(t.name)) {
      continue;
    }
    const auto rows = static_cast<std::uint64_t>(t.shape[t.shape.size() - 2]), cols = static_cast<std::uint64_t>(t.shape.back());
    if (!opt.partial_blocks && (rows % opt.block_rows != 0 || cols % opt.block_cols != 0)) continue;
    const std::string scale = detail::fp8_scale_name(t.name);
    if (ck.find(scale))
      throw_error(errors::quantize_name_taken, "tensor " + quote(scale),
                  "is already in the checkpoint: the scales of the quantized " + quote(t.name) + " would take its name");
    auto q = std::make_shared<const detail::fp8_quant_blocks>(t.name, detail::whole_bytes(ck, t, "it", "quantizing"), t.dtype, t.shape,
                                                              opt.block_rows, opt.block_cols);
    shape_t sshape = t.shape;
    sshape[sshape.size() - 2] = static_cast<dim_t>(q->scale_rows());
    sshape.back() = static_cast<dim_t>(q->scale_cols());
    out.sources.push_back(std::make_shared<detail::fp8_quant_values_source>(q));
    TensorInfo w{t.name, dtype::F8_E4M3, t.shape, {Chunk{full_box(t.shape), Placement{static_cast<std::uint32_t>(out.sources.size() - 1), 0, {}, dtype::F8_E4M3}}}};
    out.sources.push_back(std::make_shared<detail::fp8_quant_scales_source>(q));
    TensorInfo s{scale, dtype::F32, sshape, {Chunk{full_box(sshape), Placement{static_cast<std::uint32_t>(out.sources.size() - 1), 0, {}, dtype::F32}}}};
    made.emplace_back(std::move(w), std::move(s));
  }
  if (made.empty()) return ck;
  if (out.skeleton.is_null()) {
    for (auto& [w, s] : made) {
      out.tensors[static_cast<std::size_t>(out.find(w.name) - out.tensors.data())] = std::move(w);
      out.tensors.push_back(std::move(s));
    }
    return out;
  }
  // A tree (a torch.save file): the weight's entry gets the quantized tensor, and its dictionary a
  // sibling entry, the weight's key + "_scale_inv", for the scales.
  detail::tree_form form(out);
  for (auto& [w, s] : made) {
    const std::string n = w.name;
    const Path at = detail::entry_of(form.tree(), *form.placeholder(n), n);
    if (at.empty() || !at.back().is_string())
      throw_error(errors::quantize_bad_tensor, "tensor " + quote(n), "is not an entry of a dictionary: its scales have no place beside it");
    const std::string key = at.back().as_string() + "_scale_inv";
    *find_path(form.tree(), at) = Value(form.add(std::move(w)));
    Value* parent = find_path(form.tree(), Path(at.begin(), at.end() - 1));
    if (!parent || !parent->is_dict() || parent->as_dict().contains(key))
      throw_error(errors::quantize_name_taken, "tensor " + quote(n), "has a sibling entry " + quote(key) + " already: its scales would take it");
    parent->as_dict().insert(Key(key), Value(form.add(std::move(s))));
  }
  return form.result();
}


/// Throws errors::stale_skeleton unless the skeleton and the tensors agree: every tensor node
/// names a tensor of the checkpoint with its dtype and shape, and every tensor is named by one
/// (a null skeleton agrees with any tensors). Writers check this before writing a byte.
STATEDICT_API void check_consistent(const ShardedCheckpoint& ck) {
  if (ck.skeleton.is_null()) return;
  std::vector<std::uint8_t> named(ck.tensors.size(), 0);
  auto one = [&](std::string_view n, dtype dt, std::span<const dim_t> shape) {
    const TensorInfo* t = ck.find(n);
    if (!t) throw_error(errors::stale_skeleton, "tensor " + quote(n), "the skeleton names it but the checkpoint has no such tensor");
    if (t->dtype != dt || !std::equal(shape.begin(), shape.end(), t->shape.begin(), t->shape.end()))
      throw_error(errors::stale_skeleton, "tensor " + quote(n),
                  "is " + std::string(name(t->dtype)) + " " + to_string(t->shape) + " in the checkpoint, " + std::string(name(dt)) +
                      " " + to_string(shape_t(shape.begin(), shape.end())) + " in the skeleton");
    auto& seen = named[static_cast<std::size_t>(t - ck.tensors.data())];
    if (seen) throw_error(errors::stale_skeleton, "tensor " + quote(n), "the skeleton declares it twice");
    seen = 1;
  };
  if (const auto* tape = ck.skeleton.tape()) {
    for (const auto& l : tape->leaves)
      if (l.kind == statedict::detail::snode::tensor)
        one(tape->str(l.name, l.name_len), l.dtype, std::span<const dim_t>(tape->dims.data() + l.dims, l.rank));
  } else {
    for (const SkeletonTensor& st : skeleton_tensors(ck.skeleton.json())) one(st.name, st.dtype, st.shape);
  }
  for (std::size_t i = 0; i < named.size(); ++i)
    if (!named[i]) throw_error(errors::stale_skeleton, "tensor " + quote(ck.tensors[i].name), "is in the checkpoint but no node of the skeleton names it");
}

}  // namespace formats
}  // namespace statedict::inline v0
