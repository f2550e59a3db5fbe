// statedict: renaming the leaves of a state-dict tree (formats/transform.hpp rename()).
// SPDX-License-Identifier: MIT
//
// A leaf (a tensor, a non-tensor value, an empty container) is named by its dotted path. When the
// renaming function gives it another name, a dict entry moves: the highest entry above the leaf
// whose leaves the renaming treats alike (each leaf's new name is the entry's new name followed by
// the rest of its own: add_prefix moves whole top-level entries), else the leaf itself. A list,
// tuple or object moves only whole. The entry stays in the deepest dict on its path whose dotted
// name, followed by '.', still begins the new name (the root dict when none does), under the rest
// of the new name as one string key, at the place of the entry it came from. Dicts it leaves
// empty are dropped. Optimizer states ({"state": {...}, "param_groups": [...]}) keyed by
// parameter names are re-keyed by the same function applied to the parameter names, in `state`
// and in every group's "params"; the leaves below such a `state` move only with their parameter.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id rename_collision {850, error_kind::key,         "transform.rename_collision"};
inline constexpr error_id rename_not_dict  {851, error_kind::unsupported, "transform.rename_not_in_dict"};
// clang-format on
}  // namespace errors

namespace formats::detail {

using name_fn = std::function<std::string(std::string_view)>;

/// An optimizer state dict: {"state": dict, "param_groups": [dict with "params": list, ...], ...}.
inline bool is_optimizer_state(const Value& v) {
  if (!v.is_dict()) return false;
  const Value* s = v.as_dict().find("state");
  const Value* g = v.as_dict().find("param_groups");
  if (!s || !s->is_dict() || !g || !g->is_list()) return false;
  for (const Value& group : g->as_list()) {
    const Value* p = group.is_dict() ? group.as_dict().find("params") : nullptr;
    if (!p || !p->is_list()) return false;
  }
  return true;
}

/// Re-keys every optimizer state keyed by parameter names; returns the `state` dicts it saw.
inline std::unordered_set<const Value*> rename_optimizer_params(Value& tree, const name_fn& f) {
  std::vector<Value*> found;
  visit(tree, [&](const Path&, Value& v) {
    if (!is_optimizer_state(v)) return visit_control::descend;
    found.push_back(&v);
    return visit_control::skip;
  });
  std::unordered_set<const Value*> states;
  for (Value* osd : found) {
    Dict& d = osd->as_dict();
    Value& state = d.at("state");
    states.insert(&state);
    Dict renamed;
    renamed.reserve(state.as_dict().size());
    for (auto& [k, v] : state.as_dict()) {
      Key key = k.is_string() ? Key(f(k.as_string())) : k;
      if (renamed.contains(key))
        throw_error(errors::rename_collision, "optimizer state key " + quote(key.str()), "two parameters are renamed to it");
      renamed.insert(std::move(key), std::move(v));
    }
    state = Value(std::move(renamed));
    for (Value& group : d.at("param_groups").as_list())
      for (Value& p : group.as_dict().at("params").as_list())
        if (p.is_string()) p = Value(f(p.as_string()));
  }
  return states;
}

struct leaf_move {
  Path from;          ///< the leaf's path
  std::size_t depth;  ///< the target dict is the node at from[0, depth)
  std::string key;    ///< its new key there
  Value value;        ///< the leaf, once detached
};

/// The leaves of `node` (at `path`, named `name`) as (name, renamed) pairs are checked here: does the
/// renaming change any, and does it treat all alike (each leaf's new name is f(name) followed by
/// the rest of its own), so that the node can move whole?
struct subtree_verdict {
  bool changed = false;
  bool alike = true;
};

inline subtree_verdict judge(const Value& node, const std::string& name, const std::string& renamed, const name_fn& f) {
  subtree_verdict v;
  visit(node, [&](const Path& sub, const Value& x) {
    if (statedict::detail::child_count(x) > 0) return;  // not a leaf
    const std::string rest = sub.empty() ? std::string() : "." + dotted(sub);
    const std::string leaf = name + rest;
    const std::string now = f(leaf);
    v.changed = v.changed || now != leaf;
    v.alike = v.alike && now == renamed + rest;
  });
  return v;
}

/// Plans the moves below the dict at `path` (see the top of this file): an entry whose leaves the
/// renaming changes alike moves whole; otherwise the search goes on inside it.
inline void plan_entries(const Value& tree, const Path& path, const name_fn& f, const std::unordered_set<const Value*>& skip,
                         std::vector<leaf_move>& moves, std::size_t depth_left) {
  if (depth_left == 0) throw_error(errors::overflow, "tree", "nested too deeply to rename");
  const Value& node = *find_path(tree, path);
  auto prefix = [](const Path& p, std::size_t n) { return Path(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(n)); };
  for (const auto& [k, child] : node.as_dict()) {
    Path entry = path;
    entry.push_back(k);
    const std::string name = dotted(entry);
    const std::string renamed = f(name);
    const subtree_verdict v = judge(child, name, renamed, f);
    if (!v.changed) continue;
    if (v.alike && renamed != name) {
      // The deepest dict on the way whose dotted name, and a '.', begins the new name.
      std::size_t depth = 0;
      for (std::size_t n = 1; n < entry.size(); ++n) {
        const std::string at = dotted(prefix(entry, n));
        const Value* d = find_path(tree, prefix(entry, n));
        if (d && d->is_dict() && renamed.size() > at.size() + 1 && renamed.compare(0, at.size(), at) == 0 && renamed[at.size()] == '.')
          depth = n;
      }
      std::string key = depth == 0 ? renamed : renamed.substr(dotted(prefix(entry, depth)).size() + 1);
      if (key.empty()) throw_error(errors::rename_collision, "leaf " + quote(name), "would get an empty name");
      moves.push_back(leaf_move{entry, depth, std::move(key), Value()});
      continue;
    }
    if (skip.count(&child)) continue;  // an optimizer state: re-keyed already
    if (child.is_dict()) {
      plan_entries(tree, entry, f, skip, moves, depth_left - 1);
      continue;
    }
    // A list, tuple or object whose leaves the renaming treats differently: only dicts inside it
    // can have entries moved.
    bool inner = false;
    visit(child, [&](const Path& sub, const Value& x) {
      if (sub.empty() || !x.is_dict()) return visit_control::descend;
      Path p = entry;
      p.insert(p.end(), sub.begin(), sub.end());
      plan_entries(tree, p, f, skip, moves, depth_left - 1);
      inner = true;
      return visit_control::skip;
    });
    if (!inner)
      throw_error(errors::rename_not_dict, "leaf " + quote(name),
                  "is a list, tuple or object whose elements the renaming changes differently (to " + quote(renamed) +
                      " and more): only a dict entry, or a container renamed as a whole, can move");
  }
}

/// The moves the renaming asks for, in pre-order.
inline std::vector<leaf_move> plan_moves(const Value& tree, const name_fn& f, const std::unordered_set<const Value*>& skip) {
  std::vector<leaf_move> moves;
  if (!tree.is_dict()) return moves;
  plan_entries(tree, Path{}, f, skip, moves, 2000);
  return moves;
}

/// Applies `moves` to `tree`.
inline void apply_moves(Value& tree, std::vector<leaf_move>& moves) {
  if (moves.empty()) return;
  auto prefix = [](const Path& p, std::size_t n) { return Path(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(n)); };
  // Each target dict, its keys in their order before any move, and its arrivals by the key of
  // the entry they come from (in pre-order).
  struct target {
    std::vector<Key> order;
    std::map<Key, std::vector<std::size_t>, std::less<>> arrivals;
  };
  std::map<Path, target> targets;
  for (std::size_t i = 0; i < moves.size(); ++i) {
    const Path t = prefix(moves[i].from, moves[i].depth);
    auto [it, fresh] = targets.try_emplace(t);
    if (fresh)
      for (const auto& [k, v] : find_path(tree, t)->as_dict()) it->second.order.push_back(k);
    it->second.arrivals[moves[i].from[moves[i].depth]].push_back(i);
  }
  // Detach, last first (keys, not positions, address the entries, so the others stay valid).
  std::vector<Path> emptied;  // dicts between a moved leaf and its target
  for (std::size_t i = moves.size(); i-- > 0;) {
    leaf_move& m = moves[i];
    Value& parent = *find_path(tree, prefix(m.from, m.from.size() - 1));
    m.value = std::move(parent.as_dict().at(m.from.back()));
    parent.as_dict().erase(m.from.back());
    for (std::size_t k = m.from.size() - 1; k > m.depth; --k) emptied.push_back(prefix(m.from, k));
  }
  // Attach: the arrivals of an entry take its place, before what is left of it.
  for (auto& entry : targets) {
    const auto& path = entry.first;  // not a structured binding: clang 14 lambdas cannot capture one
    auto& t = entry.second;
    Value& node = *find_path(tree, path);
    Dict& d = node.as_dict();
    Dict rebuilt;
    rebuilt.reserve(d.size() + t.arrivals.size());
    auto add = [&](Key k, Value v, const Path* from) {
      if (rebuilt.contains(k))
        throw_error(errors::rename_collision, from ? "leaf " + quote(dotted(*from)) : "entry " + quote(k.str()),
                    "is renamed onto the name of another leaf (" + quote(k.str()) + " in " +
                        (path.empty() ? std::string("the root") : quote(dotted(path))) + ")");
      rebuilt.insert(std::move(k), std::move(v));
    };
    for (const Key& k : t.order) {
      if (auto a = t.arrivals.find(k); a != t.arrivals.end())
        for (std::size_t i : a->second) add(Key(moves[i].key), std::move(moves[i].value), &moves[i].from);
      if (Value* v = d.find(k)) add(k, std::move(*v), nullptr);
    }
    node = Value(std::move(rebuilt));
  }
  // Drop the dicts the moves emptied, deepest first.
  std::sort(emptied.begin(), emptied.end(), [](const Path& x, const Path& y) { return x.size() > y.size(); });
  for (const Path& p : emptied) {
    const Value* v = find_path(tree, p);
    if (!v || !v->is_dict() || !v->as_dict().empty()) continue;
    Value* parent = find_path(tree, prefix(p, p.size() - 1));
    if (parent && parent->is_dict()) parent->as_dict().erase(p.back());
  }
}

/// Renames the leaves of `tree` and the parameters of its optimizer states (see the top of this file).
inline void rename_tree(Value& tree, const name_fn& f) {
  const auto states = rename_optimizer_params(tree, f);
  std::vector<leaf_move> moves = plan_moves(tree, f, states);
  apply_moves(tree, moves);
}

}  // namespace formats::detail
}  // namespace statedict::inline v0
