// statedict: subsets of a skeleton (`convert --only PREFIX`): the part a path filter selects, with
// aliases and views of dropped tensors turned into tensors of their own.
// SPDX-License-Identifier: MIT
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "error.hpp"
#include "flatten.hpp"
#include "skeleton.hpp"
#include "value.hpp"

namespace statedict::inline v0 {

namespace detail {
inline json view_node(std::string_view base, const ViewSpec& s) {
  if (s.shape.size() != s.strides.size()) throw_error(errors::flat_view_bounds, "a view's shape and strides have different lengths");
  return view_node(base, s.dtype, s.offset, s.shape.data(), s.strides.data(), s.shape.size());
}
}  // namespace detail

/// A tensor of a subset skeleton: its name there, the map name of the tensor its elements come
/// from, and, when it was a view of a tensor the subset dropped, which elements (`view`).
struct SubsetTensor {
  std::string name;
  std::string source;
  std::optional<ViewSpec> view;
  friend bool operator==(const SubsetTensor&, const SubsetTensor&) = default;
};

struct SkeletonSubset {
  nlohmann::json skeleton;
  std::vector<SubsetTensor> tensors;  ///< in the order of the new skeleton's tensor nodes
};

/// A predicate over node paths.
using PathFilter = std::function<bool(const Path&)>;

/// Keeps a node when its dotted name equals a prefix or continues it at a '.' boundary
/// ("model.layers.1" keeps "model.layers.1.w" but not "model.layers.10.w"; a prefix ending in '.'
/// keeps everything below it). An empty prefix keeps everything.
inline PathFilter name_prefix_filter(std::vector<std::string> prefixes) {
  return [prefixes = std::move(prefixes)](const Path& p) {
    const std::string d = dotted(p);
    for (const auto& pre : prefixes) {
      if (pre.empty() || d == pre) return true;
      if (d.size() > pre.size() && d.compare(0, pre.size(), pre) == 0 && (pre.back() == '.' || d[pre.size()] == '.'))
        return true;
    }
    return false;
  };
}

/// The part of a skeleton that `keep` selects (docs/flatten.md, "Subsets"): a leaf (or empty
/// container) is kept when keep(path) is true; a container is kept when something below it is;
/// an opaque object is kept whole or not at all. Dropped list and tuple elements before a kept
/// one become None, so kept elements keep their index. An alias or view_of whose target tensor
/// was dropped becomes a tensor node of its own (its listing name), with `source`/`view` saying
/// where its elements come from. The result's tensor nodes are listed in `tensors`.
inline SkeletonSubset skeleton_subset(const nlohmann::json& skeleton, const PathFilter& keep) {
  using json = nlohmann::json;
  using ev = detail::skeleton_cursor::ev;
  using detail::snode;
  // Pass 1: decide, for every node in pre-order, whether it is kept.
  struct node {
    std::size_t parent;
    std::size_t end;  // one past the last node of its subtree
    snode kind;
    bool kept;
  };
  std::vector<node> nodes;
  std::vector<std::size_t> open;  // indices of enclosing containers
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  detail::walk_skeleton(skeleton, [&](const detail::skeleton_cursor::event& e, const Path& p, detail::skeleton_cursor&) {
    if (e.type == ev::leave) {
      node& c = nodes[open.back()];
      c.end = nodes.size();
      if (c.end == open.back() + 1) c.kept = keep(p);  // an empty container
      open.pop_back();
      return;
    }
    nodes.push_back({open.empty() ? none : open.back(), nodes.size() + 1, e.node.kind, false});
    if (e.type == ev::enter) open.push_back(nodes.size() - 1);
    else nodes.back().kept = keep(p);
  });
  for (std::size_t i = nodes.size(); i-- > 0;)
    if (nodes[i].kept && nodes[i].parent != none) nodes[nodes[i].parent].kept = true;
  if (!nodes.empty()) nodes[0].kept = true;  // the root always stays
  for (std::size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].kind == snode::object && nodes[i].kept)
      for (std::size_t j = i + 1; j < nodes[i].end; ++j) nodes[j].kept = true;

  // Tensor-like nodes: names, and which map names survive as tensor nodes.
  std::vector<detail::tensorish> tl = detail::list_tensorish(skeleton);
  std::unordered_map<std::string, const json*> declared;  // map name -> its tensor node
  for (const auto& t : tl)
    if (t.kind == snode::tensor) declared.emplace(t.target, t.node);

  // Pass 2: rebuild.
  SkeletonSubset out;
  std::unordered_set<std::string> kept_tensors;
  std::unordered_map<std::string, std::string> promoted;  // dropped map name -> new name
  json root;
  std::vector<json*> stack;
  std::size_t idx = 0, tidx = 0;
  detail::walk_skeleton(skeleton, [&](const detail::skeleton_cursor::event& e, const Path& path, detail::skeleton_cursor& cur) {
    if (e.type == ev::leave) {
      stack.pop_back();
      return;
    }
    const std::size_t me = idx++;
    const bool tensorish = e.node.kind == snode::tensor || e.node.kind == snode::alias || e.node.kind == snode::view;
    const detail::tensorish* t = tensorish ? &tl[tidx++] : nullptr;
    if (!nodes[me].kept) {
      if (e.type == ev::enter) {
        // Skip the subtree, staying aligned with `nodes` and `tl`; the matching leave pops a null.
        for (std::size_t j = me + 1; j < nodes[me].end; ++j)
          if (nodes[j].kind == snode::tensor || nodes[j].kind == snode::alias || nodes[j].kind == snode::view) ++tidx;
        idx = nodes[me].end;
        stack.push_back(nullptr);
        cur.skip();
      }
      return;
    }
    json* slot = &root;
    if (!stack.empty()) {
      json& parent = *stack.back();
      switch (e.slot) {
        case detail::slot_kind::index: {
          json& arr = parent.begin().value();
          while (arr.size() < e.index) arr.push_back(nullptr);
          slot = &arr.emplace_back();
          break;
        }
        case detail::slot_kind::dict: {
          json& arr = parent["dict"];
          json pair = json::array_t(2);
          pair[0] = detail::encode_key(path.back());  // walk_skeleton moved e.key there
          arr.push_back(std::move(pair));
          slot = &arr.back()[1];
          break;
        }
        case detail::slot_kind::args: slot = &parent["object"]["args"].emplace_back(); break;
        case detail::slot_kind::state: slot = &parent["object"]["state"].emplace_back(); break;
        case detail::slot_kind::items: slot = &parent["object"]["items"].emplace_back(); break;
        case detail::slot_kind::root: break;
      }
    }
    if (e.type == ev::enter) {
      json c(json::value_t::object);
      switch (e.node.kind) {
        case snode::list: c["list"] = json::array(); break;
        case snode::tuple: c["tuple"] = json::array(); break;
        case snode::dict: c["dict"] = json::array(); break;
        default: {
          const Object o = detail::decode_object_header(*e.node.body);
          json body(json::value_t::object);
          body["module"] = detail::encode_string(o.module);
          body["name"] = detail::encode_string(o.name);
          body["how"] = std::string(detail::how_name(o.how));
          body["args"] = json::array();
          body["state"] = json::array();
          body["items"] = json::array();
          c["object"] = std::move(body);
          break;
        }
      }
      *slot = std::move(c);
      stack.push_back(slot);
      return;
    }
    if (!t) {
      *slot = *e.node.node;  // a scalar leaf: a small, flat JSON value
      return;
    }
    auto add = [&](const std::string& name, const std::string& source, std::optional<ViewSpec> view) {
      out.tensors.push_back({name, source, std::move(view)});
      kept_tensors.insert(name);
    };
    if (t->kind == snode::tensor) {
      *slot = *e.node.node;
      add(t->target, t->target, std::nullopt);
      return;
    }
    auto it = declared.find(t->target);
    if (it == declared.end())
      throw_error(errors::flat_bad_alias, "target " + quote(t->target) + " is not declared by a tensor node");
    std::string live;  // the name under which the target's elements are in the subset
    if (kept_tensors.count(t->target)) live = t->target;
    else if (auto pr = promoted.find(t->target); pr != promoted.end()) live = pr->second;
    if (t->kind == snode::alias) {
      if (!live.empty()) {
        *slot = detail::alias_node(live);
        return;
      }
      json n(json::value_t::object);
      n["tensor"] = t->name;
      n["dtype"] = it->second->at("dtype");
      n["shape"] = it->second->at("shape");
      *slot = std::move(n);
      add(t->name, t->target, std::nullopt);
      promoted.emplace(t->target, t->name);
      return;
    }
    ViewSpec spec = detail::decode_view(e.node);
    if (!live.empty()) {
      *slot = detail::view_node(live, spec);
      return;
    }
    json n(json::value_t::object);
    n["tensor"] = t->name;
    n["dtype"] = std::string(statedict::name(spec.dtype));
    n["shape"] = detail::shape_json(spec.shape);
    *slot = std::move(n);
    add(t->name, t->target, std::move(spec));
  });
  out.skeleton = json::object();
  out.skeleton["statedict_skeleton"] = 1;
  out.skeleton["root"] = std::move(root);
  return out;
}

/// The part of a flat state dict that `keep` selects (see skeleton_subset): its tensors are views
/// of the input's, never copies.
inline FlatStateDict select(const FlatStateDict& flat, const PathFilter& keep) {
  SkeletonSubset s = skeleton_subset(flat.skeleton, keep);
  std::unordered_map<std::string_view, const TensorView*> index;
  index.reserve(flat.tensors.size());
  for (const auto& [n, v] : flat.tensors) index.emplace(n, &v);
  FlatStateDict out;
  out.tensors.reserve(s.tensors.size());
  for (auto& t : s.tensors) {
    auto it = index.find(t.source);
    if (it == index.end()) throw_error(errors::flat_missing_tensor, "tensor " + quote(t.source) + " is not in the tensor map");
    out.tensors.emplace_back(std::move(t.name), t.view ? view_into(*it->second, *t.view) : *it->second);
  }
  out.skeleton = std::move(s.skeleton);
  return out;
}

}  // namespace statedict::inline v0
