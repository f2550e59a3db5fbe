// statedict: rebuilding a tree from a tensor map and a skeleton, from its JSON document or from the
// compact form flatten made (core/flatten.hpp is its public face).
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
#include "../hash_index.hpp"
#include "../skeleton.hpp"
#include "../tensor.hpp"
#include "../value.hpp"
#include "skeleton_reader.hpp"
#include "skeleton_tape.hpp"

namespace statedict::inline v0::detail {

/// The tensors an unflatten may use, by name. Names are indexed as they are added (a repeated
/// name is an error), or, after defer_index(), only when a lookup needs the index: a map that
/// lists a compact skeleton's tensors in its order never does.
class tensor_table {
 public:
  static constexpr std::uint32_t npos = hash_index::npos;

  /// Index names only when a lookup needs it (and check for repeats then).
  void defer_index() noexcept { deferred_ = true; }
  void reserve(std::size_t n) {
    if (!deferred_) index_.reserve(n);
    names_.reserve(n);
    views_.reserve(n);
  }
  void add(std::string_view name, const TensorView* v) {
    names_.push_back(name);
    views_.push_back(v);
    if (!deferred_) index(index_, static_cast<std::uint32_t>(views_.size() - 1));
  }
  /// Reads the entries of a NamedTensors list in place (no copy of its names and views: for a
  /// map of 100k tensors that copy is a pass over every entry's cache lines). Only into an
  /// empty table; `list` must outlive it.
  void adopt(const NamedTensors& list) {
    direct_ = list.data();
    direct_size_ = list.size();
    if (deferred_) return;
    index_.reserve(direct_size_);
    for (std::uint32_t i = 0; i < direct_size_; ++i) index(index_, i);
  }
  /// Builds a deferred index; throws flat_duplicate_name for a repeated name.
  void ensure_index() {
    if (!deferred_) return;
    hash_index idx;  // kept only when complete: a later call reports a repeat again
    idx.reserve(size());
    for (std::uint32_t i = 0; i < size(); ++i) index(idx, i);
    index_ = std::move(idx);
    deferred_ = false;
  }
  [[nodiscard]] std::uint32_t find(std::string_view name) {
    ensure_index();
    return index_.find(hash_of(name), [&](std::uint32_t p) { return this->name(p) == name; });
  }
  /// find() for a tensor node: skeletons list their tensor nodes in the order of the map
  /// (flatten writes both in pre-order), so the entry after the previous tensor node's is
  /// tried first. A match there is the only one when names are unique, which add() checks, or,
  /// with a deferred index, the caller (every entry matched this way, each once, by a skeleton
  /// whose tensor names are unique, makes the names unique).
  [[nodiscard]] std::uint32_t find_next(std::string_view name) {
    const std::uint32_t i = next_ < size() && this->name(next_) == name ? next_ : find(name);
    if (i != npos) next_ = i + 1;
    return i;
  }
  [[nodiscard]] std::size_t size() const noexcept { return direct_ ? direct_size_ : views_.size(); }
  [[nodiscard]] std::string_view name(std::uint32_t i) const { return direct_ ? std::string_view(direct_[i].first) : names_[i]; }
  [[nodiscard]] const TensorView& view(std::uint32_t i) const { return direct_ ? direct_[i].second : *views_[i]; }
  [[nodiscard]] bool declared(std::uint32_t i) const { return declared_.size() > i && declared_[i]; }
  void declare(std::uint32_t i) {
    if (declared_.size() != size()) declared_.assign(size(), 0);
    declared_[i] = 1;
  }
  /// Forgets what was declared (to read the same map against a skeleton again), and indexes
  /// the names (throwing for a repeated one, as add() would have).
  void reset() {
    declared_.clear();
    next_ = 0;
    ensure_index();
  }

 private:
  [[noreturn]] static void repeated(std::string_view name) {
    throw_error(errors::flat_duplicate_name, "tensor map", "the name " + quote(name) + " appears twice");
  }
  static std::uint32_t hash_of(std::string_view s) noexcept { return hash_index::mix(std::hash<std::string_view>{}(s)); }
  /// Adds entry i to `idx`; throws for a name already there.
  void index(hash_index& idx, std::uint32_t i) const {
    const std::string_view n = name(i);
    const std::uint32_t h = hash_of(n);
    if (idx.find(h, [&](std::uint32_t p) { return name(p) == n; }) != npos) repeated(n);
    idx.add(h, i);
  }
  hash_index index_;
  std::vector<std::string_view> names_;
  std::vector<const TensorView*> views_;
  std::vector<std::uint8_t> declared_;
  const NamedTensors::value_type* direct_ = nullptr;  // adopt(): entries read in place
  std::size_t direct_size_ = 0;
  std::uint32_t next_ = 0;  // where find_next looks first
  bool deferred_ = false;
};

inline bool shape_equals(const json& arr, const shape_t& s) {
  const auto& a = arr.get_ref<const json::array_t&>();
  if (a.size() != s.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!a[i].is_number_integer() || a[i] != s[i]) return false;
  return true;
}

/// The Value of a tensor, alias or view_of node, checked against the tensor table.
inline Value decode_tensorish(const snode_info& n, tensor_table& tt) {
  const std::string& name = n.body->get_ref<const std::string&>();
  const std::uint32_t i = n.kind == snode::tensor ? tt.find_next(name) : tt.find(name);
  if (n.kind == snode::tensor) {
    // One pass over the node's members (this is the hot path of unflatten).
    const json* dtype_j = nullptr;
    const json* shape_j = nullptr;
    for (const auto& [k, v] : n.node->get_ref<const json::object_t&>()) {
      if (k == "dtype") dtype_j = &v;
      else if (k == "shape") shape_j = &v;
    }
    if (!dtype_j || !dtype_j->is_string() || !shape_j || !shape_j->is_array()) {
      (void)member(*n.node, "dtype", json::value_t::string, "a tensor node");  // names what is wrong
      (void)member(*n.node, "shape", json::value_t::array, "a tensor node");
    }
    const std::string& dname = dtype_j->get_ref<const std::string&>();
    const std::optional<statedict::dtype> dt = dtype_from_name(dname);
    if (!dt) malformed("a tensor node: unknown dtype " + quote(dname));
    if (i == tensor_table::npos) throw_error(errors::flat_missing_tensor, "tensor " + quote(name) + " is not in the tensor map");
    if (tt.declared(i)) throw_error(errors::flat_duplicate_name, "tensor " + quote(name) + " is declared by two tensor nodes");
    const TensorView& v = tt.view(i);
    if (*dt != v.dtype())
      throw_error(errors::flat_tensor_dtype, "tensor " + quote(name) + " is " + std::string(statedict::name(v.dtype())) +
                                                 " in the tensor map, " + std::string(statedict::name(*dt)) + " in the skeleton");
    if (!shape_equals(*shape_j, v.shape())) {
      (void)dims(*shape_j, "shape", "a tensor node");  // a malformed shape is a format error, not a mismatch
      throw_error(errors::flat_tensor_shape, "tensor " + quote(name) + " has shape " + to_string(v.shape()) +
                                                 " in the tensor map, " + shape_j->dump() + " in the skeleton");
    }
    tt.declare(i);
    return Value(v);
  }
  const char* what = n.kind == snode::alias ? "alias" : "view_of";
  std::optional<ViewSpec> spec;
  if (n.kind == snode::view) spec = decode_view(n);
  if (i == tensor_table::npos)
    throw_error(errors::flat_missing_tensor, std::string(what) + " target " + quote(name) + " is not in the tensor map");
  if (!tt.declared(i))
    throw_error(errors::flat_bad_alias, std::string(what) + " target " + quote(name) + " is not declared by an earlier tensor node");
  if (!spec) return Value(tt.view(i));
  try {
    return Value(view_into(tt.view(i), *spec));
  } catch (error& e) {
    e.add_context("view of " + quote(name));
    throw;
  }
}

/// Detects a repeated key while a Dict is filled with append_unchecked: a linear scan while the
/// dict is small, a hash_index of item positions beyond (no allocation per key).
class key_set {
 public:
  /// True when the dict's last key does not occur earlier in it.
  bool last_is_new(const Dict& d) {
    const auto& items = d.items();
    const std::size_t last = items.size() - 1;
    const Key& k = items[last].first;
    if (last < linear_limit) {
      for (std::size_t j = 0; j < last; ++j)
        if (items[j].first == k) return false;
      return true;
    }
    if (index_.empty()) {
      index_.reserve(d.items().capacity());
      for (std::size_t j = 0; j < last; ++j) index_.add(hash_index::mix(items[j].first.hash()), j);
    }
    const std::uint32_t h = hash_index::mix(k.hash());
    if (index_.find(h, [&](std::uint32_t j) { return items[j].first == k; }) != hash_index::npos) return false;
    index_.add(h, last);
    return true;
  }

 private:
  static constexpr std::size_t linear_limit = 16;
  hash_index index_;
};

/// Builds the Value of skeleton node `root` (a NODE, not the document). Tensor-like nodes need
/// `tt`; without one they are an error.
inline Value build_tree(const json& root, tensor_table* tt) {
  skeleton_cursor cur(root);
  Value result;
  struct open_container {
    Value* value;
    key_set keys;  // for dicts
  };
  std::vector<open_container> stack;
  try {
    for (;;) {
      skeleton_cursor::event e = cur.next();
      if (e.type == skeleton_cursor::ev::done) break;
      if (e.type == skeleton_cursor::ev::leave) {
        stack.pop_back();
        continue;
      }
      Value* slot = &result;
      if (!stack.empty()) {
        Value& parent = *stack.back().value;
        switch (e.slot) {
          case slot_kind::index: slot = &parent.as_list().emplace_back(); break;
          case slot_kind::dict: {
            Dict& d = parent.as_dict();
            slot = &d.append_unchecked(std::move(e.key), Value());
            if (!stack.back().keys.last_is_new(d)) throw_error(errors::flat_duplicate_key, "the dict repeats this key");
            break;
          }
          case slot_kind::args: slot = &parent.as_object().args.emplace_back(); break;
          case slot_kind::state: slot = &parent.as_object().state.emplace_back(); break;
          case slot_kind::items: slot = &parent.as_object().items.emplace_back(); break;
          case slot_kind::root: break;
        }
      }
      const snode_info& n = e.node;
      switch (n.kind) {
        case snode::list:
        case snode::tuple: {
          List l;
          l.reserve(n.body->size());
          *slot = n.kind == snode::list ? Value::list(std::move(l)) : Value::tuple(std::move(l));
          stack.push_back({slot, {}});
          break;
        }
        case snode::dict: {
          Dict d;
          d.reserve(n.body->size());
          *slot = Value(std::move(d));
          stack.push_back({slot, {}});
          break;
        }
        case snode::object: {
          Object o = decode_object_header(*n.body);
          o.args.reserve((*n.body)["args"].size());
          o.state.reserve((*n.body)["state"].size());
          o.items.reserve((*n.body)["items"].size());
          *slot = Value(std::move(o));
          stack.push_back({slot, {}});
          break;
        }
        case snode::tensor:
        case snode::alias:
        case snode::view:
          if (!tt) malformed("internal: a tensor node where none is expected");
          *slot = decode_tensorish(n, *tt);
          break;
        default: *slot = decode_scalar(n); break;
      }
    }
  } catch (error& err) {
    const Path p = cur.path();
    err.add_context(p.empty() ? std::string("skeleton root") : "skeleton node " + quote(dotted(p)));
    throw;
  }
  return result;
}

/// Thrown by the tape path on any mismatch; the caller replays the JSON path, which reports it.
struct tape_mismatch {};

/// The Value of a tape's tensor-like node, checked against the table as decode_tensorish checks
/// a JSON node. `index[l]` is the table entry of leaf l once its tensor node has been read.
inline Value tape_tensorish(const skeleton_tape& t, std::size_t li, tensor_table& tt, std::vector<std::uint32_t>& index) {
  const skeleton_tape::leaf& l = t.leaves[li];
  const dim_t* d = t.dims.data() + l.dims;
  if (l.kind == snode::tensor) {
    const std::uint32_t i = tt.find_next(t.str(l.name, l.name_len));
    if (i == tensor_table::npos || tt.declared(i)) throw tape_mismatch{};
    const TensorView& v = tt.view(i);
    if (v.dtype() != l.dtype || v.shape().size() != l.rank || !std::equal(d, d + l.rank, v.shape().begin())) throw tape_mismatch{};
    tt.declare(i);
    index[li] = i;
    return Value(v);
  }
  const std::uint32_t i = index[l.target];
  if (i == tensor_table::npos) throw tape_mismatch{};
  if (l.kind == snode::alias) return Value(tt.view(i));
  return Value(view_into(tt.view(i), ViewSpec{l.dtype, l.offset, shape_t(d, d + l.rank), shape_t(d + l.rank, d + 2 * l.rank)}));
}

/// The Value of a tape's None, bool, int, float, str or bytes node.
inline Value tape_scalar(const skeleton_tape& t, const skeleton_tape::node& n) {
  switch (n.kind) {
    case snode::boolean: return Value(n.flag != 0);
    case snode::integer: return Value(static_cast<std::int64_t>(n.a));
    case snode::floating: return Value(std::bit_cast<double>(n.a));
    case snode::string: return Value(std::string(t.str(n)));
    case snode::bytes: {
      const std::string_view s = t.str(n);
      Bytes b;
      b.data.assign(reinterpret_cast<const std::uint8_t*>(s.data()), reinterpret_cast<const std::uint8_t*>(s.data()) + s.size());
      return Value(std::move(b));
    }
    default: return Value();
  }
}

/// build_tree over a tape: the same tree and the same checks, without JSON, for the subtree whose
/// node is at `p` (left just past that subtree). Throws tape_mismatch or a statedict error without
/// node context when the table does not match; `tt` may be null for a subtree without tensors.
inline Value build_from_tape(const skeleton_tape& t, tensor_table* tt, std::size_t& p) {
  std::vector<std::uint32_t> index;
  struct open {
    Value* value;
    std::uint64_t size[3];
    std::size_t part;
    std::uint64_t next;
    snode kind;
  };
  std::vector<open> stack;
  open made{};  // what make() last opened: a container whose items follow (kind none: nothing)
  // The Value of the node at p, built where it is returned (each Value is moved once, into its
  // place); a container comes back empty and reserved, and `made` says what it still takes.
  auto make = [&]() -> Value {
    const skeleton_tape::node& n = t.nodes[p++];
    made.kind = snode::none;
    switch (n.kind) {
      case snode::none: return Value();
      case snode::boolean:
      case snode::integer:
      case snode::floating:
      case snode::string:
      case snode::bytes: return tape_scalar(t, n);
      case snode::tensor:
      case snode::alias:
      case snode::view:
        if (!tt) throw tape_mismatch{};
        if (index.empty()) index.assign(t.leaves.size(), tensor_table::npos);
        return tape_tensorish(t, static_cast<std::size_t>(n.a), *tt, index);
      case snode::list:
      case snode::tuple: {
        List l;
        l.reserve(static_cast<std::size_t>(n.a));
        if (n.a) made = {nullptr, {n.a, 0, 0}, 0, 0, n.kind};
        return n.kind == snode::list ? Value::list(std::move(l)) : Value::tuple(std::move(l));
      }
      case snode::dict: {
        Dict d;
        d.reserve(static_cast<std::size_t>(n.a));
        if (n.a) made = {nullptr, {n.a, 0, 0}, 0, 0, n.kind};
        return Value(std::move(d));
      }
      case snode::object: {
        const std::uint64_t items = t.nodes[p++].a;
        Object o;
        o.module = std::string(t.str(t.nodes[p++]));
        o.name = std::string(t.str(t.nodes[p++]));
        o.how = static_cast<object_build>(n.flag);
        o.args.reserve(static_cast<std::size_t>(n.a));
        o.state.reserve(static_cast<std::size_t>(n.b));
        o.items.reserve(static_cast<std::size_t>(items));
        if (n.a + n.b + items) made = {nullptr, {n.a, n.b, items}, 0, 0, n.kind};
        return Value(std::move(o));
      }
    }
    return Value();
  };
  // After `slot` took make()'s Value: its items are read next.
  auto opened = [&](Value& slot) {
    if (made.kind == snode::none) return;
    made.value = &slot;
    stack.push_back(std::move(made));
    made.kind = snode::none;
  };
  Value result = make();
  opened(result);
  while (!stack.empty()) {
    open& o = stack.back();
    while (o.part < 3 && o.next == o.size[o.part]) ++o.part, o.next = 0;
    if (o.part == 3) {
      stack.pop_back();
      continue;
    }
    ++o.next;
    Value& parent = *o.value;
    Value* slot = nullptr;
    switch (o.kind) {
      case snode::dict: {
        const skeleton_tape::node& k = t.nodes[p++];
        Dict& d = parent.as_dict();
        // No repeat check (build_tree makes one): flatten wrote these keys from one Dict, whose
        // keys are unique. The key is made where the argument is (moved once, into the Dict).
        slot = &d.append_unchecked(k.kind == snode::integer ? Key(static_cast<std::int64_t>(k.a)) : Key(t.str(k)), make());
        break;
      }
      case snode::object: {
        Object& obj = parent.as_object();
        slot = &(o.part == 0 ? obj.args : o.part == 1 ? obj.state : obj.items).emplace_back(make());
        break;
      }
      default: slot = &parent.as_list().emplace_back(make()); break;
    }
    opened(*slot);  // `o` may dangle from here on
  }
  return result;
}
inline Value build_from_tape(const skeleton_tape& t, tensor_table& tt) {
  std::size_t p = 0;
  return build_from_tape(t, &tt, p);
}

inline Value unflatten_impl(tensor_table& tt, const json& skeleton) {
  if (skeleton.is_null()) {
    // No skeleton: a flat dict of the tensors, in order (what a plain safetensors file is).
    Dict d;
    d.reserve(tt.size());
    for (std::uint32_t i = 0; i < tt.size(); ++i) d.insert(std::string(tt.name(i)), Value(tt.view(i)));
    return Value(std::move(d));
  }
  Value v = build_tree(skeleton_root(skeleton), &tt);
  for (std::uint32_t i = 0; i < tt.size(); ++i)
    if (!tt.declared(i))
      throw_error(errors::flat_extra_tensor, "tensor map",
                  "tensor " + quote(tt.name(i)) + " is not declared by any tensor node of the skeleton");
  return v;
}

template <class R>
concept named_tensor_range = requires(const R& r) {
  std::begin(r);
  std::end(r);
  requires std::convertible_to<decltype(std::begin(r)->first), std::string_view>;
  requires std::convertible_to<decltype(std::begin(r)->second), TensorView>;
};

/// Adds a collection's tensors to `tt`; entries that are not TensorViews (Tensor, ...) are
/// converted into `converted`, which must outlive `tt`.
template <named_tensor_range Tensors>
void fill_table(tensor_table& tt, const Tensors& tensors, std::deque<TensorView>& converted) {
  if constexpr (std::is_same_v<Tensors, NamedTensors>) {
    if (tensors.size() <= UINT32_MAX) return tt.adopt(tensors);
  }
  if constexpr (requires { tensors.size(); }) tt.reserve(tensors.size());
  for (const auto& entry : tensors) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(entry.second)>, TensorView>)
      tt.add(std::string_view(entry.first), &entry.second);
    else
      tt.add(std::string_view(entry.first), &converted.emplace_back(TensorView(entry.second)));
  }
}

}  // namespace statedict::inline v0::detail
