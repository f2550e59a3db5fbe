// statedict: walks over a skeleton that answer questions about it without rebuilding the tree: its
// tensor-like nodes with their listing names, whether it may hold aliases, its values.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error.hpp"
#include "../skeleton.hpp"
#include "../value.hpp"
#include "../visit.hpp"
#include "naming.hpp"
#include "skeleton_reader.hpp"
#include "skeleton_tape.hpp"
#include "unflatten.hpp"

namespace statedict::inline v0::detail {

/// Walks a skeleton with the path of every node: f(event, path) for leaf and enter events, and
/// for leave events (with the container's path). With `with_path` false the path stays empty (for
/// walks that need none: no key is copied into it).
template <bool with_path = true, class F>
void walk_skeleton(const json& skeleton, F&& f) {
  skeleton_cursor cur(skeleton_root(skeleton));
  Path path;
  std::vector<std::size_t> nkeys;
  try {
    for (;;) {
      auto e = cur.next();
      if (e.type == skeleton_cursor::ev::done) break;
      if (e.type == skeleton_cursor::ev::leave) {
        f(e, std::as_const(path), cur);
        pop_keys(path, nkeys.back());
        nkeys.pop_back();
        continue;
      }
      const std::size_t k = with_path ? push_event_keys(path, e) : 0;
      f(e, std::as_const(path), cur);
      if (e.type == skeleton_cursor::ev::enter) nkeys.push_back(k);
      else pop_keys(path, k);
    }
  } catch (error& err) {
    const Path p = cur.path();
    err.add_context(p.empty() ? std::string("skeleton root") : "skeleton node " + quote(dotted(p)));
    throw;
  }
}

/// Every tensor, alias and view_of node of a skeleton in pre-order, with its listing name:
/// tensor nodes keep their map name; alias and view_of nodes get a name by the flatten naming
/// rule over the same group, so the names of all three are unique together.
struct tensorish {
  snode kind;
  const json* node;
  std::string target;  ///< the map name the node declares or refers to
  std::string name;    ///< listing name (== target for tensor nodes)
  Path path;
};

inline std::vector<tensorish> list_tensorish(const json& skeleton) {
  std::vector<tensorish> out;
  walk_skeleton(skeleton, [&](const skeleton_cursor::event& e, const Path& p, skeleton_cursor&) {
    if (e.type != skeleton_cursor::ev::leaf) return;
    const snode k = e.node.kind;
    if (k != snode::tensor && k != snode::alias && k != snode::view) return;
    out.push_back({k, e.node.node, e.node.body->get<std::string>(), {}, p});
  });
  std::vector<std::string> dotted_names;
  std::vector<const std::string*> fixed;
  dotted_names.reserve(out.size());
  fixed.reserve(out.size());
  for (const auto& t : out) {
    dotted_names.push_back(dotted(t.path));
    fixed.push_back(t.kind == snode::tensor ? &t.target : nullptr);
  }
  auto names = assign_names(
      out.size(), [&](std::size_t i) -> const std::string& { return dotted_names[i]; }, fixed,
      [&](std::size_t i) { return quoted_name(out[i].path); });
  for (std::size_t i = 0; i < out.size(); ++i) out[i].name = names ? std::move((*names)[i]) : dotted_names[i];
  return out;
}

/// Whether any JSON object in `skeleton` has an "alias" or "view_of" member: false means the
/// skeleton has no alias and no view_of node (those are the only nodes with such members), so
/// listing them can be skipped. One pass without paths or names; iterative.
inline bool may_hold_aliases(const nlohmann::json& skeleton) {
  std::vector<const json*> pending{&skeleton};
  while (!pending.empty()) {
    const json* j = pending.back();
    pending.pop_back();
    if (j->is_object()) {
      const auto& o = j->get_ref<const json::object_t&>();
      if (o.count("alias") || o.count("view_of")) return true;
      for (const auto& kv : o)
        if (kv.second.is_structured()) pending.push_back(&kv.second);
    } else if (j->is_array()) {
      for (const auto& c : j->get_ref<const json::array_t&>())
        if (c.is_structured()) pending.push_back(&c);
    }
  }
  return false;
}

/// may_hold_aliases for a Skeleton: exact and without JSON for a compact one (its leaf records
/// say which tensor-like nodes are aliases or views).
inline bool may_hold_aliases(const Skeleton& skeleton) {
  if (const skeleton_tape* t = skeleton.tape())
    return std::any_of(t->leaves.begin(), t->leaves.end(), [](const skeleton_tape::leaf& l) { return l.kind != snode::tensor; });
  return may_hold_aliases(skeleton.json());
}

/// Walks a tape's nodes in pre-order as skeleton_cursor walks a document: `enter`, `leaf`, `leave`,
/// `done` events, node() the tape index of the node entered, met or left, path() its path (the
/// same keys skeleton_cursor::path gives).
class tape_walker {
 public:
  enum class ev : std::uint8_t { leaf, enter, leave, done };
  explicit tape_walker(const skeleton_tape& t) : t_(t) {}

  ev next() {
    if (!started_) {
      started_ = true;
      return visit();
    }
    if (stack_.empty()) return ev::done;
    frame& f = stack_.back();
    while (f.part < 3 && f.next == f.size[f.part]) ++f.part, f.next = 0;
    if (f.part == 3) {
      node_ = f.node;
      stack_.pop_back();
      return ev::leave;
    }
    ++f.next;
    if (t_.nodes[f.node].kind == snode::dict) f.key = p_++;
    return visit();  // `f` may dangle from here on
  }
  [[nodiscard]] std::size_t node() const noexcept { return node_; }
  /// After an `enter`: the container's children are not visited (no `leave` either); the walk
  /// goes on at tape index `end`, the node after the container's subtree.
  void skip_to(std::size_t end) {
    stack_.pop_back();
    p_ = end;
  }
  [[nodiscard]] Path path() const {
    Path p;
    for (const frame& f : stack_) {
      if (f.next == 0) continue;
      const std::int64_t i = static_cast<std::int64_t>(f.next - 1);
      switch (t_.nodes[f.node].kind) {
        case snode::dict: {
          const skeleton_tape::node& k = t_.nodes[f.key];
          if (k.kind == snode::integer) p.emplace_back(static_cast<std::int64_t>(k.a));
          else p.emplace_back(t_.str(k));
          break;
        }
        case snode::object:
          p.emplace_back(f.part == 0 ? "args" : f.part == 1 ? "state" : "items");
          if (f.part != 1 || f.size[1] > 1) p.emplace_back(i);
          break;
        default: p.emplace_back(i); break;
      }
    }
    return p;
  }

 private:
  struct frame {
    std::size_t node;
    std::uint64_t size[3];
    std::size_t part;
    std::uint64_t next;
    std::size_t key;  // dict: tape index of the current child's key
  };
  ev visit() {
    node_ = p_;
    const skeleton_tape::node& n = t_.nodes[p_++];
    switch (n.kind) {
      case snode::list:
      case snode::tuple:
      case snode::dict: stack_.push_back({node_, {n.a, 0, 0}, 0, 0, 0}); return ev::enter;
      case snode::object: {
        const std::uint64_t items = t_.nodes[p_].a;
        p_ += 3;  // the items count, the module, the name
        stack_.push_back({node_, {n.a, n.b, items}, 0, 0, 0});
        return ev::enter;
      }
      default: return ev::leaf;
    }
  }

  const skeleton_tape& t_;
  bool started_ = false;
  std::size_t p_ = 0;
  std::size_t node_ = 0;
  std::vector<frame> stack_;
};

/// skeleton_values over a tape: the same (path, value) pairs, in the same order.
inline void tape_values(const skeleton_tape& t, std::vector<Path>& paths, std::vector<Value>& values) {
  using ev = tape_walker::ev;
  // Pass 1: which object nodes hold a tensor-like node somewhere below them.
  std::vector<bool> holds(t.nodes.size(), false);
  {
    std::vector<std::size_t> objects;  // enclosing object nodes
    tape_walker w(t);
    for (ev e = w.next(); e != ev::done; e = w.next()) {
      const snode k = t.nodes[w.node()].kind;
      if (k == snode::object) {
        if (e == ev::enter) objects.push_back(w.node());
        else objects.pop_back();
      } else if (k == snode::tensor) {
        for (auto it = objects.rbegin(); it != objects.rend() && !holds[*it]; ++it) holds[*it] = true;
      }
    }
  }
  // Pass 2: the scalars, and each outermost object without tensors as one value.
  tape_walker w(t);
  for (ev e = w.next(); e != ev::done; e = w.next()) {
    const std::size_t at = w.node();
    const snode k = t.nodes[at].kind;
    if (e == ev::enter && k == snode::object && !holds[at]) {
      paths.push_back(w.path());
      std::size_t end = at;
      values.push_back(build_from_tape(t, nullptr, end));
      w.skip_to(end);
    } else if (e == ev::leaf && k != snode::tensor) {
      paths.push_back(w.path());
      values.push_back(tape_scalar(t, t.nodes[at]));
    }
  }
}

/// (name, value) pairs for skeleton_values: the naming rule of docs/flatten.md among the values.
inline std::vector<std::pair<std::string, Value>> named_values(const std::vector<Path>& paths, std::vector<Value>& values) {
  std::vector<std::string> dotted_names;
  dotted_names.reserve(paths.size());
  for (const auto& p : paths) dotted_names.push_back(dotted(p));
  auto names = assign_names(
      paths.size(), [&](std::size_t i) -> const std::string& { return dotted_names[i]; }, {},
      [&](std::size_t i) { return quoted_name(paths[i]); });
  std::vector<std::pair<std::string, Value>> out;
  out.reserve(values.size());
  for (std::size_t i = 0; i < values.size(); ++i)
    out.emplace_back(names ? std::move((*names)[i]) : std::move(dotted_names[i]), std::move(values[i]));
  return out;
}

}  // namespace statedict::inline v0::detail
