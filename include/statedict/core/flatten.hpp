// statedict: flatten a Value tree into named tensors plus a skeleton, and back.
// SPDX-License-Identifier: MIT
//
// `flatten(tree)` gives an ordered `name -> TensorView` list (the tensors, in tree pre-order) and a
// skeleton holding everything else (core/skeleton.hpp; its format, the naming rule and the alias
// rule are in docs/flatten.md). `unflatten(tensors, skeleton)` gives back a tree equal to the
// original, for every tree. Also the questions a skeleton answers without rebuilding the tree:
// its tensor nodes, its aliases, its non-tensor values.
//
// A skeleton is input from files: every function that reads one validates it and throws a
// statedict error naming the node (never crashes); all walks are iterative, so nesting depth is
// bounded only by memory.
#pragma once

#include "config.hpp"
#include "detail/defines_facade.hpp"

#include <deque>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "detail/flattener.hpp"
#include "detail/skeleton_query.hpp"
#include "detail/unflatten.hpp"
#include "flat_state_dict.hpp"
#include "skeleton.hpp"
#include "tensor.hpp"
#include "value.hpp"

namespace statedict::inline v0 {

/// Flattens a tree: its tensors by name, in pre-order, plus the skeleton (docs/flatten.md).
/// Tensors reached twice as the very same view become `alias` nodes; views whose bytes lie inside
/// an earlier contiguous tensor of the same dtype become `view_of` nodes; each is stored once.
STATEDICT_API FlatStateDict flatten(const Value& tree) { return detail::flattener().run(tree); }

/// Rebuilds the tree from any name -> tensor collection (a NamedTensors list, std::map or
/// std::unordered_map of TensorView or Tensor, ...) and a skeleton. The result equals (==) the
/// flattened tree. Throws a statedict error naming the node or tensor when they do not match:
/// flat_malformed, flat_version, flat_missing_tensor, flat_extra_tensor, flat_tensor_dtype,
/// flat_tensor_shape, flat_duplicate_name, flat_bad_alias, flat_view_bounds, flat_view_base,
/// flat_duplicate_key. A null skeleton means a flat dict of the tensors in order.
template <detail::named_tensor_range Tensors>
Value unflatten(const Tensors& tensors, const nlohmann::json& skeleton) {
  detail::tensor_table tt;
  std::deque<TensorView> converted;
  detail::fill_table(tt, tensors, converted);
  return detail::unflatten_impl(tt, skeleton);
}

/// unflatten for a Skeleton: one made by flatten is read in its compact form (no JSON is built
/// unless the map does not match it, to report the mismatch exactly as for its JSON document).
template <detail::named_tensor_range Tensors, class S>
  requires std::same_as<S, Skeleton>
Value unflatten(const Tensors& tensors, const S& skeleton) {
  const detail::skeleton_tape* tape = skeleton.tape();
  if (!tape) return unflatten(tensors, skeleton.json());
  detail::tensor_table tt;
  tt.defer_index();
  std::deque<TensorView> converted;
  detail::fill_table(tt, tensors, converted);
  try {
    Value v = detail::build_from_tape(*tape, tt);
    bool all = true;
    for (std::uint32_t i = 0; i < tt.size() && all; ++i) all = tt.declared(i);
    if (all) return v;
  } catch (const detail::tape_mismatch&) {
  } catch (const error&) {
  }
  tt.reset();
  return detail::unflatten_impl(tt, skeleton.json());  // throws the error, with the node's path
}

STATEDICT_API Value unflatten(const FlatStateDict& flat) { return unflatten(flat.tensors, flat.skeleton); }

/// unflatten of a name -> tensor list and a skeleton's JSON document (a skeleton read from a file).
STATEDICT_API Value unflatten(const NamedTensors& tensors, const nlohmann::json& skeleton) {
  return unflatten<NamedTensors>(tensors, skeleton);
}

/// The skeleton of a flat dict of named tensors in order: what a plain safetensors file is.
/// Elements are (name, TensorView-or-Tensor) pairs, or records with `.name`, `.dtype` and `.shape`
/// (such as ShardedCheckpoint's TensorInfo). No alias detection: build a Dict and flatten it for that.
template <class Range>
nlohmann::json flat_skeleton(const Range& tensors) {
  using json = nlohmann::json;
  json::array_t pairs;
  if constexpr (requires { tensors.size(); }) pairs.reserve(tensors.size());
  for (const auto& t : tensors) {
    json node(json::value_t::object);
    auto& o = node.get_ref<json::object_t&>();
    std::string name;
    if constexpr (requires { t.name; t.dtype; t.shape; }) {
      name = std::string(t.name);
      o.emplace("dtype", std::string(statedict::name(t.dtype)));
      o.emplace("shape", detail::shape_json(t.shape));
    } else {
      name = std::string(t.first);
      const TensorView v(t.second);
      o.emplace("dtype", std::string(statedict::name(v.dtype())));
      o.emplace("shape", detail::shape_json(v.shape()));
    }
    o.emplace("tensor", name);
    json pair = json::array_t(2);
    pair[0] = detail::encode_string(name);
    pair[1] = std::move(node);
    pairs.push_back(std::move(pair));
  }
  json root(json::value_t::object);
  root.get_ref<json::object_t&>().emplace("dict", std::move(pairs));
  json skel(json::value_t::object);
  skel.get_ref<json::object_t&>().emplace("statedict_skeleton", 1);
  skel.get_ref<json::object_t&>().emplace("root", std::move(root));
  return skel;
}

/// A tensor node of a skeleton: the name it has in the tensor map, its dtype and shape.
struct SkeletonTensor {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  friend bool operator==(const SkeletonTensor&, const SkeletonTensor&) = default;
};

/// The tensor nodes of a skeleton in pre-order (the tensors a writer must store).
inline std::vector<SkeletonTensor> skeleton_tensors(const nlohmann::json& skeleton) {
  std::vector<SkeletonTensor> out;
  detail::skeleton_cursor cur(detail::skeleton_root(skeleton));
  try {
    for (;;) {
      auto e = cur.next();
      if (e.type == detail::skeleton_cursor::ev::done) break;
      if (e.type != detail::skeleton_cursor::ev::leaf || e.node.kind != detail::snode::tensor) continue;
      out.push_back({e.node.body->get<std::string>(), detail::member_dtype(*e.node.node, "a tensor node"),
                     detail::member_dims(*e.node.node, "shape", "a tensor node")});
    }
  } catch (error& err) {
    err.add_context("skeleton node " + quote(dotted(cur.path())));
    throw;
  }
  return out;
}

/// The alias and view_of nodes of a skeleton as (name, target) pairs in pre-order: `name` is the
/// node's own name (the naming rule of docs/flatten.md, unique among tensor names), `target` the
/// map name of the tensor whose storage it shares.
inline std::vector<std::pair<std::string, std::string>> skeleton_aliases(const nlohmann::json& skeleton) {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& t : detail::list_tensorish(skeleton))
    if (t.kind != detail::snode::tensor) out.emplace_back(std::move(t.name), std::move(t.target));
  return out;
}

/// skeleton_aliases of a Skeleton's JSON document.
STATEDICT_API std::vector<std::pair<std::string, std::string>> skeleton_aliases(const Skeleton& skeleton) {
  return skeleton_aliases(skeleton.json());
}

/// The non-tensor leaves of a skeleton as (name, value) pairs in pre-order: None, bool, int,
/// float, str and bytes leaves, and each outermost opaque object holding no tensor as one value.
/// (Empty containers are not leaves.) Names follow the naming rule of docs/flatten.md among the
/// values: the dotted name when unique, else the quoted name (a `#k` suffix as a last resort).
inline std::vector<std::pair<std::string, Value>> skeleton_values(const nlohmann::json& skeleton) {
  using ev = detail::skeleton_cursor::ev;
  // Pass 1: which object nodes hold a tensor, alias or view_of node somewhere below them.
  std::unordered_set<const nlohmann::json*> holds_tensor;
  {
    std::vector<const nlohmann::json*> objects;  // enclosing object nodes
    detail::walk_skeleton<false>(skeleton, [&](const detail::skeleton_cursor::event& e, const Path&, detail::skeleton_cursor&) {
      const detail::snode k = e.node.kind;
      if (k == detail::snode::object) {
        if (e.type == ev::enter) objects.push_back(e.node.node);
        else if (e.type == ev::leave) objects.pop_back();
        return;
      }
      if (e.type != ev::leaf || (k != detail::snode::tensor && k != detail::snode::alias && k != detail::snode::view)) return;
      // Mark the enclosing objects, innermost first, up to one marked before.
      for (auto it = objects.rbegin(); it != objects.rend(); ++it)
        if (!holds_tensor.insert(*it).second) break;
    });
  }
  // Pass 2: the values, each with its path (asked of the cursor for the few nodes kept, rather
  // than kept up to date for every node: a checkpoint is mostly tensors).
  std::vector<Path> paths;
  std::vector<Value> values;
  detail::walk_skeleton<false>(skeleton, [&](const detail::skeleton_cursor::event& e, const Path&, detail::skeleton_cursor& cur) {
    const detail::snode k = e.node.kind;
    if (e.type == ev::enter && k == detail::snode::object && !holds_tensor.count(e.node.node)) {
      paths.push_back(cur.path());
      values.push_back(detail::build_tree(*e.node.node, nullptr));
      cur.skip();
      return;
    }
    if (e.type != ev::leaf || k == detail::snode::tensor || k == detail::snode::alias || k == detail::snode::view) return;
    paths.push_back(cur.path());
    values.push_back(detail::decode_scalar(e.node));
  });
  return detail::named_values(paths, values);
}

/// skeleton_values for a Skeleton: a compact one is read without building its JSON document.
STATEDICT_API std::vector<detail::skeleton_tie> detail::skeleton_ties(const Skeleton& skeleton) {
  std::vector<skeleton_tie> out;
  if (!may_hold_aliases(skeleton)) return out;
  for (const auto& t : list_tensorish(skeleton.json())) {
    if (t.kind == snode::tensor) continue;
    std::optional<ViewSpec> v;
    if (t.kind == snode::view) v = decode_view(classify(*t.node));
    out.push_back({t.name, t.target, std::move(v)});
  }
  return out;
}

STATEDICT_API std::vector<std::pair<std::string, Value>> skeleton_values(const Skeleton& skeleton) {
  const detail::skeleton_tape* t = skeleton.tape();
  if (!t) return skeleton_values(skeleton.json());
  std::vector<Path> paths;
  std::vector<Value> values;
  detail::tape_values(*t, paths, values);
  return detail::named_values(paths, values);
}

}  // namespace statedict::inline v0
