// statedict: transformations of a checkpoint description (no tensor byte is touched): the subset
// of `--only`, the dtype change of `--dtype`, and listing the names the skeleton ties.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
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

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id select_view_sharded {792, error_kind::unsupported, "convert.select_view_sharded"};
inline constexpr error_id select_nothing      {793, error_kind::usage,       "convert.select_nothing"};
// clang-format on
}  // namespace errors

namespace formats {

/// A name the skeleton ties to a stored tensor: an alias of it, or a view into its elements.
struct Tie {
  std::string name;              ///< the tied name (as listed: dotted)
  std::string target;            ///< the stored tensor it refers to
  std::optional<ViewSpec> view;  ///< the elements, for a view; nullopt for an alias
};

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
inline std::vector<Tie> tied_names(const Skeleton& skeleton) {
  if (!statedict::detail::may_hold_aliases(skeleton)) return {};
  return tied_names(skeleton.json());
}

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
inline ShardedCheckpoint expand_ties(ShardedCheckpoint ck, const std::vector<Tie>& ties) {
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

}  // namespace formats
}  // namespace statedict::inline v0
