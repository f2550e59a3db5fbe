// statedict: visitors over a Value tree: walk every node with its path, transform, fold, and find
// nodes by path or by dotted name.
// SPDX-License-Identifier: MIT
//
// Paths. The path of a node is the list of keys from the root to it (`Path`, core/value.hpp):
//   - a dict child:          its key (int or string, as stored);
//   - a list or tuple child: its index, as an int key;
//   - an opaque object's children (core/value.hpp `Object`) take two keys or one:
//       args[i]  -> "args", i
//       state[0] -> "state"          (the BUILD state; readers store at most one)
//       items[i] -> "items", i
//     An Object whose `state` holds more than one value (no reader makes one) uses "state", i.
// So `{"sched": Object{args: [3], state: [{"lr": 0.1}]}}` has the paths
// `sched.args.0` and `sched.state.lr` (as dotted names). A path is only meaningful with its tree:
// "args" after an object node means the object's arguments, after a dict node a dict key.
//
// Every function here is iterative (an explicit stack), so a tree 200,000 levels deep is fine.
// Order is pre-order: a node before its children, children in container order (dict insertion
// order; for objects args, then state, then items).
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "error.hpp"
#include "value.hpp"

namespace statedict::inline v0 {

/// What a visit callback asks for after seeing a node.
enum class visit_control : std::uint8_t {
  descend,  ///< visit this node's children (the default; a callback returning void means this)
  skip,     ///< do not visit this node's children
  stop,     ///< end the walk now
};

namespace detail {

/// Number of children of a node (0 for leaves).
inline std::size_t child_count(const Value& v) noexcept {
  switch (v.kind()) {
    case value_kind::list:
    case value_kind::tuple: return v.as_list().size();
    case value_kind::dict: return v.as_dict().size();
    case value_kind::object: {
      const Object& o = v.as_object();
      return o.args.size() + o.state.size() + o.items.size();
    }
    default: return 0;
  }
}

/// Appends the path keys of child `i` of object `o` to `path`.
inline void push_object_keys(const Object& o, std::size_t i, Path& path) {
  if (i < o.args.size()) {
    path.emplace_back("args");
    path.emplace_back(static_cast<std::int64_t>(i));
    return;
  }
  i -= o.args.size();
  if (i < o.state.size()) {
    path.emplace_back("state");
    if (o.state.size() > 1) path.emplace_back(static_cast<std::int64_t>(i));
    return;
  }
  path.emplace_back("items");
  path.emplace_back(static_cast<std::int64_t>(i - o.state.size()));
}

/// Child `i` of a container (i < child_count), with its key(s) appended to `path`.
template <class V>
V& child_at(V& v, std::size_t i, Path& path) {
  switch (v.kind()) {
    case value_kind::list:
    case value_kind::tuple:
      path.emplace_back(static_cast<std::int64_t>(i));
      return v.as_list()[i];
    case value_kind::dict: {
      auto& item = *(v.as_dict().begin() + static_cast<std::ptrdiff_t>(i));
      path.push_back(item.first);
      return item.second;
    }
    default: {
      auto& o = v.as_object();
      push_object_keys(o, i, path);
      if (i < o.args.size()) return o.args[i];
      i -= o.args.size();
      if (i < o.state.size()) return o.state[i];
      return o.items[i - o.state.size()];
    }
  }
}

inline void pop_keys(Path& path, std::size_t n) { path.erase(path.end() - static_cast<std::ptrdiff_t>(n), path.end()); }

template <class V, class F>
visit_control call_visitor(F& f, const Path& path, V& node) {
  using R = std::invoke_result_t<F&, const Path&, V&>;
  if constexpr (std::is_void_v<R>) {
    f(path, node);
    return visit_control::descend;
  } else {
    static_assert(std::is_same_v<std::remove_cvref_t<R>, visit_control>,
                  "a visit callback returns void or statedict::visit_control");
    return f(path, node);
  }
}

template <class V, class F>
void walk(V& root, F& f) {
  Path path;
  visit_control c = call_visitor<V>(f, path, root);
  if (c != visit_control::descend || child_count(root) == 0) return;
  struct frame {
    V* node;
    std::size_t next;
    std::size_t nkeys;  // keys this node added to the path
  };
  std::vector<frame> stack;
  stack.push_back({&root, 0, 0});
  while (!stack.empty()) {
    frame& top = stack.back();
    if (top.next == child_count(*top.node)) {
      pop_keys(path, top.nkeys);
      stack.pop_back();
      continue;
    }
    const std::size_t before = path.size();
    V& child = child_at(*top.node, top.next++, path);
    c = call_visitor<V>(f, path, child);
    if (c == visit_control::stop) return;
    if (c == visit_control::descend && child_count(child) != 0)
      stack.push_back({&child, 0, path.size() - before});  // `top` is dangling from here on
    else
      pop_keys(path, path.size() - before);
  }
}

/// A copy of a leaf, or an empty container of the same kind (and object header).
inline Value shallow_copy(const Value& v) {
  switch (v.kind()) {
    case value_kind::list:
    case value_kind::tuple: {
      List l;
      l.reserve(v.as_list().size());
      return v.is_list() ? Value::list(std::move(l)) : Value::tuple(std::move(l));
    }
    case value_kind::dict: {
      Dict d;
      d.reserve(v.as_dict().size());
      return Value(std::move(d));
    }
    case value_kind::object: {
      const Object& o = v.as_object();
      Object c{o.module, o.name, o.how, {}, {}, {}};
      c.args.reserve(o.args.size());
      c.state.reserve(o.state.size());
      c.items.reserve(o.items.size());
      return Value(std::move(c));
    }
    default: return v;
  }
}

/// Appends an empty slot for child `i` of `src` (a container) to `dst` (its shallow copy).
inline Value& append_child_slot(const Value& src, std::size_t i, Value& dst) {
  switch (src.kind()) {
    case value_kind::list:
    case value_kind::tuple: return dst.as_list().emplace_back();
    case value_kind::dict: return dst.as_dict().insert((src.as_dict().begin() + static_cast<std::ptrdiff_t>(i))->first, Value());
    default: {
      const Object& o = src.as_object();
      Object& d = dst.as_object();
      if (i < o.args.size()) return d.args.emplace_back();
      i -= o.args.size();
      if (i < o.state.size()) return d.state.emplace_back();
      return d.items.emplace_back();
    }
  }
}

/// True when `s` is what `std::to_string` prints for some int64 (so an int key could print alike).
inline bool parse_canonical_int(std::string_view s, std::int64_t& out) noexcept {
  if (s.empty() || s.size() > 20) return false;
  const char* b = s.data();
  const char* e = s.data() + s.size();
  auto [p, ec] = std::from_chars(b, e, out);
  if (ec != std::errc() || p != e) return false;
  return std::to_string(out) == s;
}

}  // namespace detail

/// Calls `f(path, node)` for every node of `root` in pre-order, the root first (with an empty path).
/// `f` returns void (always descend) or a visit_control. The path reference is valid only during
/// the call.
template <class F>
void visit(const Value& root, F&& f) {
  detail::walk<const Value>(root, f);
}

/// As above, with mutable nodes: `f(path, node)` may change or replace `node` (its children are
/// then those of the new node). It must not change the node's ancestors or siblings.
template <class F>
void visit(Value& root, F&& f) {
  detail::walk<Value>(root, f);
}

/// A new tree built from `root`: `f(path, node)` is called in pre-order and returns
/// `std::optional<Value>`: nullopt keeps the node (a leaf is copied; a container is rebuilt from
/// its children, which are visited next), a Value replaces the node and its whole subtree (the
/// replacement is not visited).
template <class F>
Value transform(const Value& root, F&& f) {
  Path path;
  {
    std::optional<Value> r = f(std::as_const(path), root);
    if (r) return std::move(*r);
  }
  Value out = detail::shallow_copy(root);
  if (detail::child_count(root) == 0) return out;
  struct frame {
    const Value* src;
    Value* dst;
    std::size_t next;
    std::size_t nkeys;
  };
  std::vector<frame> stack;
  stack.push_back({&root, &out, 0, 0});
  while (!stack.empty()) {
    frame& top = stack.back();
    if (top.next == detail::child_count(*top.src)) {
      detail::pop_keys(path, top.nkeys);
      stack.pop_back();
      continue;
    }
    const std::size_t i = top.next++;
    const std::size_t before = path.size();
    const Value& child = detail::child_at(*top.src, i, path);
    // The slot is appended after the callback runs, so a throwing callback leaves no hole.
    std::optional<Value> r = f(std::as_const(path), child);
    Value& slot = detail::append_child_slot(*top.src, i, *top.dst);
    if (r) {
      slot = std::move(*r);
      detail::pop_keys(path, path.size() - before);
      continue;
    }
    slot = detail::shallow_copy(child);
    if (detail::child_count(child) != 0)
      stack.push_back({&child, &slot, 0, path.size() - before});  // `top` is dangling from here on
    else
      detail::pop_keys(path, path.size() - before);
  }
  return out;
}

/// A deep copy made without recursion (Value's copy constructor recurses; use this for trees from
/// untrusted input of unknown depth).
inline Value copy_tree(const Value& root) {
  return transform(root, [](const Path&, const Value&) { return std::optional<Value>(); });
}

/// Folds `f(acc, path, node) -> acc` over every node in pre-order.
template <class T, class F>
T fold(const Value& root, T init, F&& f) {
  visit(root, [&](const Path& p, const Value& v) { init = f(std::move(init), p, v); });
  return init;
}

/// The node at `path` (see the top of this file for object paths), or nullptr.
inline const Value* find_path(const Value& root, const Path& path) {
  const Value* v = &root;
  for (std::size_t i = 0; i < path.size(); ++i) {
    const Key& k = path[i];
    switch (v->kind()) {
      case value_kind::list:
      case value_kind::tuple: {
        if (!k.is_int()) return nullptr;
        const List& l = v->as_list();
        if (k.as_int() < 0 || static_cast<std::uint64_t>(k.as_int()) >= l.size()) return nullptr;
        v = &l[static_cast<std::size_t>(k.as_int())];
        break;
      }
      case value_kind::dict:
        v = v->as_dict().find(k);
        if (!v) return nullptr;
        break;
      case value_kind::object: {
        if (!k.is_string()) return nullptr;
        const Object& o = v->as_object();
        const std::string& part = k.as_string();
        const List* l = nullptr;
        if (part == "args") l = &o.args;
        else if (part == "items") l = &o.items;
        else if (part == "state") l = &o.state;
        else return nullptr;
        if (l == &o.state && o.state.size() == 1) {
          v = &o.state[0];
          break;
        }
        if (++i == path.size() || !path[i].is_int()) return nullptr;
        const std::int64_t idx = path[i].as_int();
        if (idx < 0 || static_cast<std::uint64_t>(idx) >= l->size()) return nullptr;
        v = &(*l)[static_cast<std::size_t>(idx)];
        break;
      }
      default: return nullptr;
    }
  }
  return v;
}

inline Value* find_path(Value& root, const Path& path) {
  return const_cast<Value*>(find_path(std::as_const(root), path));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
}

/// Every path of `root` whose dotted name (`dotted(path)`) is `name`: the inverse of `dotted`,
/// which needs the tree because a dotted name alone does not say whether "1" is an int or a
/// string key, nor where a key containing '.' begins and ends. Pre-order; each node is visited at
/// most once, so the cost is linear in the size of the tree.
inline std::vector<Path> match_dotted(const Value& root, std::string_view name) {
  std::vector<Path> out;
  struct item {
    const Value* node;
    std::size_t pos;  // name[0, pos) is the dotted name of `path`
    Path path;
  };
  std::vector<item> work;
  work.push_back({&root, 0, {}});
  while (!work.empty()) {
    item it = std::move(work.back());
    work.pop_back();
    if (it.pos == name.size()) out.push_back(it.path);
    // Below a non-root node every name grows by at least the '.' separator.
    if (it.pos == name.size() && !it.path.empty()) continue;
    // Children are pushed in reverse so that they pop, and match, in pre-order.
    for (std::size_t i = detail::child_count(*it.node); i-- > 0;) {
      Path p = it.path;
      const Value& child = detail::child_at(*it.node, i, p);
      std::size_t pos = it.pos;
      bool ok = true;
      for (std::size_t k = it.path.size(); k < p.size() && ok; ++k) {
        if (k > 0) {
          ok = pos < name.size() && name[pos] == '.';
          ++pos;
        }
        const std::string s = p[k].str();
        ok = ok && name.substr(pos).starts_with(s);
        pos += s.size();
      }
      if (ok) work.push_back({&child, pos, std::move(p)});
    }
  }
  return out;
}

/// The one path of `root` whose dotted name is `name`, or nullopt when no node or more than one
/// node has that name (keys containing dots, int and string keys that print alike).
inline std::optional<Path> undotted(const Value& root, std::string_view name) {
  std::vector<Path> m = match_dotted(root, name);
  if (m.size() != 1) return std::nullopt;
  return std::move(m.front());
}

/// The node of `root` whose dotted name is `name` ("model.layers.0.weight"), or nullptr when no
/// node or more than one has it (undotted).
inline const Value* find_dotted(const Value& root, std::string_view name) {
  const std::optional<Path> p = undotted(root, name);
  return p ? find_path(root, *p) : nullptr;
}
inline Value* find_dotted(Value& root, std::string_view name) {
  return const_cast<Value*>(find_dotted(std::as_const(root), name));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
}

}  // namespace statedict::inline v0
