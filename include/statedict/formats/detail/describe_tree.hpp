// statedict: turning a reader's tree (non-tensor values plus tensor placeholders) into the named
// tensors and the flatten skeleton of a ShardedCheckpoint.
// SPDX-License-Identifier: MIT
//
// Sharded-checkpoint readers build the state dict as a Value tree in which every tensor is a
// placeholder (torch_refs::make_ref(i)) naming an unnamed TensorInfo they described (chunks already
// placed). finish() names the tensors as core/flatten.hpp names tensors (dotted paths; quoted paths
// where dotted names collide), orders them in tree pre-order, and produces the skeleton that
// flatten() would give for the same tree with real tensors, so `unflatten` and `skeleton_values`
// work on the description. A placeholder referenced twice gives two tensors (same chunks).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../shard/checkpoint.hpp"
#include "torch_refs.hpp"

namespace statedict::inline v0::detail::describe_tree {

struct Result {
  std::vector<TensorInfo> tensors;  ///< named, in tree pre-order
  nlohmann::json skeleton;
};

/// `tree` holds placeholders indexing `described`; see the top of this file.
inline Result finish(const Value& tree, const std::vector<TensorInfo>& described) {
  namespace tr = torch_refs;
  std::vector<Path> paths;
  std::vector<std::size_t> which;
  visit(tree, [&](const Path& p, const Value& v) {
    if (!tr::is_ref(v)) return visit_control::descend;
    const std::size_t i = tr::ref_index(v);
    if (i >= described.size()) throw_error(errors::value_kind, "tensor placeholder " + std::to_string(i) + " out of range");
    paths.push_back(p);
    which.push_back(i);
    return visit_control::skip;
  });
  std::vector<std::string> dotted_names;
  dotted_names.reserve(paths.size());
  for (const auto& p : paths) dotted_names.push_back(dotted(p));
  auto assigned = detail::assign_names(
      paths.size(), [&](std::size_t i) -> const std::string& { return dotted_names[i]; }, {},
      [&](std::size_t i) { return detail::quoted_name(paths[i]); });

  Result out;
  out.tensors.reserve(paths.size());
  for (std::size_t k = 0; k < paths.size(); ++k) {
    TensorInfo t = described[which[k]];
    t.name = assigned ? (*assigned)[k] : dotted_names[k];
    out.tensors.push_back(std::move(t));
  }

  // The skeleton: flatten the tree (placeholders are opaque objects there), then turn each
  // placeholder's object node into a tensor node, in the same pre-order.
  out.skeleton = std::move(flatten(tree).skeleton).take_json();
  using json = nlohmann::json;
  std::size_t k = 0;
  std::vector<json*> stack;
  if (out.skeleton.is_object() && out.skeleton.contains("root")) stack.push_back(&out.skeleton["root"]);
  auto push_array = [&](json& arr, bool pairs) {
    if (!arr.is_array()) return;
    for (std::size_t i = arr.size(); i-- > 0;) {
      json& e = arr[i];
      if (pairs) {
        if (e.is_array() && e.size() == 2) stack.push_back(&e[1]);
      } else {
        stack.push_back(&e);
      }
    }
  };
  // A member that is a plain JSON string, else empty: flatten writes names that are not UTF-8
  // as {"str_bytes": ...} objects, which never name a placeholder.
  auto text = [](const json& o, const char* key) -> std::string_view {
    const auto it = o.find(key);
    return it != o.end() && it->is_string() ? std::string_view(it->get_ref<const std::string&>()) : std::string_view();
  };
  while (!stack.empty()) {
    json* n = stack.back();
    stack.pop_back();
    if (!n->is_object()) continue;
    if (auto it = n->find("object"); it != n->end() && it->is_object()) {
      const json& o = *it;
      if (text(o, "module") == tr::ref_module && text(o, "name") == tr::ref_name && text(o, "how") == "reduce") {
        if (k >= out.tensors.size()) throw_error(errors::value_kind, "more tensor placeholders in the skeleton than in the tree");
        const TensorInfo& t = out.tensors[k++];
        json node(json::value_t::object);
        node["tensor"] = t.name;
        node["dtype"] = std::string(name(t.dtype));
        node["shape"] = detail::shape_json(t.shape);
        *n = std::move(node);
        continue;
      }
      json& body = (*n)["object"];
      // pushed in reverse so that args, then state, then items are visited in order
      for (const char* part : {"items", "state", "args"})
        if (body.contains(part)) push_array(body[part], false);
      continue;
    }
    if (auto it = n->find("dict"); it != n->end()) push_array(*it, true);
    else if (auto il = n->find("list"); il != n->end()) push_array(*il, false);
    else if (auto iu = n->find("tuple"); iu != n->end()) push_array(*iu, false);
  }
  if (k != out.tensors.size()) throw_error(errors::value_kind, "tensor placeholders missing from the skeleton");
  return out;
}

}  // namespace statedict::inline v0::detail::describe_tree
