// statedict: the Value tree, the in-memory form of a state dict.
// SPDX-License-Identifier: MIT
//
// A Value is None, bool, int64, double, string, bytes, a tensor (a TensorView), list, tuple, dict
// (insertion-ordered; keys are int64 or string, as in optimizer `state`), or an opaque object: a
// pickled Python object statedict keeps without interpreting (class, constructor arguments, state).
//
// Destroying and comparing trees is iterative, so a tree 200,000 levels deep cannot overflow the
// stack. Copying is recursive: readers cap nesting depth (see each reader's limits).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "error.hpp"
#include "hash_index.hpp"
#include "tensor.hpp"

namespace statedict::inline v0 {

class Value;

/// A dict key: an int64 or a string. `1` and `"1"` are different keys.
class Key {
 public:
  Key(std::int64_t i) : v_(i) {}                                   // NOLINT(google-explicit-constructor)
  template <class I, class = std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool> &&
                                              !std::is_same_v<I, std::int64_t>>>
  Key(I i) : v_(static_cast<std::int64_t>(i)) {}                   // NOLINT(google-explicit-constructor)
  Key(std::string s) : v_(std::move(s)) {}                         // NOLINT(google-explicit-constructor)
  // Built in place: no temporary string moved into the variant.
  Key(std::string_view s) : v_(std::in_place_index<1>, s) {}       // NOLINT(google-explicit-constructor)
  Key(const char* s) : v_(std::in_place_index<1>, s) {}            // NOLINT(google-explicit-constructor)

  [[nodiscard]] bool is_int() const noexcept { return v_.index() == 0; }
  [[nodiscard]] bool is_string() const noexcept { return v_.index() == 1; }
  [[nodiscard]] std::int64_t as_int() const {
    if (!is_int()) throw_error(errors::value_kind, "key " + quote(std::get<1>(v_)) + " is a string, not an int");
    return std::get<0>(v_);
  }
  [[nodiscard]] const std::string& as_string() const {
    if (!is_string()) throw_error(errors::value_kind, "key " + std::to_string(std::get<0>(v_)) + " is an int, not a string");
    return std::get<1>(v_);
  }
  /// Python's `str(key)`: the decimal int or the string itself.
  [[nodiscard]] std::string str() const { return is_int() ? std::to_string(std::get<0>(v_)) : std::get<1>(v_); }

  friend bool operator==(const Key&, const Key&) = default;
  friend auto operator<=>(const Key&, const Key&) = default;
  [[nodiscard]] std::size_t hash() const noexcept {
    return is_int() ? std::hash<std::int64_t>{}(std::get<0>(v_)) : std::hash<std::string>{}(std::get<1>(v_)) ^ 0x9e3779b97f4a7c15ULL;
  }

 private:
  std::variant<std::int64_t, std::string> v_;
};

struct KeyHash {
  std::size_t operator()(const Key& k) const noexcept { return k.hash(); }
};

/// A path from the root to a node: dict keys and list/tuple indices (indices are int keys).
using Path = std::vector<Key>;

/// Python's dotted name of a path: `str(key)` joined with '.' (the DCP / Hugging Face convention).
inline std::string dotted(const Path& p) {
  std::string s;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (i) s += '.';
    s += p[i].str();
  }
  return s;
}

/// Raw bytes (Python `bytes`), distinct from text.
struct Bytes {
  std::vector<std::uint8_t> data;
  friend bool operator==(const Bytes&, const Bytes&) = default;
};

using List = std::vector<Value>;

/// Insertion-ordered dict with int/string keys. Assigning an existing key replaces the value in place.
class Dict {
 public:
  using item = std::pair<Key, Value>;
  using iterator = std::vector<item>::iterator;
  using const_iterator = std::vector<item>::const_iterator;

  Dict() = default;
  Dict(std::initializer_list<item> items);
  Dict(const Dict& o);
  Dict(Dict&& o) noexcept = default;
  Dict& operator=(const Dict& o);
  Dict& operator=(Dict&& o) noexcept = default;
  ~Dict() = default;

  // (Bodies that touch items_ are defined after Value is complete.)
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] bool empty() const noexcept;
  iterator begin() noexcept;
  iterator end() noexcept;
  const_iterator begin() const noexcept;
  const_iterator end() const noexcept;
  [[nodiscard]] const std::vector<item>& items() const noexcept { return items_; }

  [[nodiscard]] Value* find(const Key& k);
  [[nodiscard]] const Value* find(const Key& k) const;
  [[nodiscard]] bool contains(const Key& k) const { return find(k) != nullptr; }
  /// The value at k; throws errors::missing_key.
  Value& at(const Key& k);
  const Value& at(const Key& k) const;
  /// d[k] = v: replaces in place or appends.
  Value& set(Key k, Value v);
  /// Appends; throws errors::duplicate_key when k exists.
  Value& insert(Key k, Value v);
  /// Appends without looking k up, for callers that have ruled out duplicates themselves (a
  /// reader checking keys its own way); a key appended twice breaks the dict.
  Value& append_unchecked(Key k, Value v);
  /// d.setdefault(k, None)
  Value& operator[](const Key& k);
  /// Removes k (keeping the order of the rest); returns whether it was there.
  bool erase(const Key& k);
  void reserve(std::size_t n);

  friend bool operator==(const Dict& a, const Dict& b);

 private:
  static constexpr std::size_t index_threshold = 16;
  [[nodiscard]] std::ptrdiff_t position(const Key& k) const;
  void index_new_last() const;

  std::vector<item> items_;
  // Built by the first lookup once there are index_threshold items, kept up to date by appends.
  mutable detail::hash_index index_;
};

/// How a pickled object was made (so it can be written back the same way).
enum class object_build : std::uint8_t {
  global,  ///< a reference to a class or function itself (`torch.float32`, `torch.device`)
  reduce,  ///< callable(*args)
  newobj,  ///< cls.__new__(cls, *args)
};

/// A pickled Python object kept but not interpreted: never executed.
struct Object {
  std::string module;  ///< e.g. "torch.distributed.checkpoint.metadata"
  std::string name;    ///< e.g. "Metadata"
  object_build how = object_build::reduce;
  List args;           ///< constructor arguments
  List state;          ///< empty, or one Value: the BUILD (`__setstate__`) state
  List items;          ///< elements appended (lists, sets) or (key, value) tuples set (dicts) on the object
  [[nodiscard]] std::string qualified() const { return module + "." + name; }
  friend bool operator==(const Object& a, const Object& b);
};

enum class value_kind : std::uint8_t { none, boolean, integer, floating, string, bytes, tensor, list, tuple, dict, object };

constexpr std::string_view to_string(value_kind k) noexcept {
  constexpr std::string_view names[] = {"None", "bool", "int", "float", "str", "bytes", "tensor", "list", "tuple", "dict", "object"};
  return names[static_cast<std::size_t>(k)];
}

static_assert(std::is_nothrow_move_constructible_v<TensorView> && std::is_nothrow_move_constructible_v<Object>,
              "Value(TensorView&&) and Value(Object&&) are noexcept");

class Value {
 public:
  Value() noexcept = default;
  Value(std::nullptr_t) noexcept {}                                           // NOLINT(google-explicit-constructor)
  Value(bool b) noexcept : kind_(value_kind::boolean), v_(b) {}             // NOLINT(google-explicit-constructor)
  template <class I, class = std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>>>
  Value(I i) noexcept : kind_(value_kind::integer), v_(static_cast<std::int64_t>(i)) {}  // NOLINT(google-explicit-constructor)
  Value(double d) noexcept : kind_(value_kind::floating), v_(d) {}           // NOLINT(google-explicit-constructor)
  Value(std::string s) : kind_(value_kind::string), v_(std::move(s)) {}      // NOLINT(google-explicit-constructor)
  Value(std::string_view s) : Value(std::string(s)) {}                       // NOLINT(google-explicit-constructor)
  Value(const char* s) : Value(std::string(s)) {}                            // NOLINT(google-explicit-constructor)
  Value(Bytes b) : kind_(value_kind::bytes), v_(std::move(b)) {}             // NOLINT(google-explicit-constructor)
  // A view or object by reference and by rvalue: a copy lands in place (a by-value parameter costs
  // a move on top, per tensor of every tree built and per storage of every torch file read).
  Value(const TensorView& t) : kind_(value_kind::tensor), v_(std::in_place_type<TensorView>, t) {}  // NOLINT(google-explicit-constructor)
  Value(TensorView&& t) noexcept : kind_(value_kind::tensor), v_(std::in_place_type<TensorView>, std::move(t)) {}  // NOLINT(google-explicit-constructor)
  Value(const Tensor& t) : Value(t.view()) {}                                // NOLINT(google-explicit-constructor)
  Value(Dict d) : kind_(value_kind::dict), v_(std::move(d)) {}               // NOLINT(google-explicit-constructor)
  Value(const Object& o) : kind_(value_kind::object), v_(std::in_place_type<Object>, o) {}  // NOLINT(google-explicit-constructor)
  Value(Object&& o) noexcept : kind_(value_kind::object), v_(std::in_place_type<Object>, std::move(o)) {}  // NOLINT(google-explicit-constructor)

  static Value list(List items = {}) { return Value(value_kind::list, std::move(items)); }
  static Value tuple(List items = {}) { return Value(value_kind::tuple, std::move(items)); }

  Value(const Value&) = default;
  Value(Value&& o) noexcept : kind_(o.kind_), v_(std::move(o.v_)) { o.reset_shallow(); }
  Value& operator=(const Value& o) {
    if (this != &o) {
      Value tmp(o);
      *this = std::move(tmp);
    }
    return *this;
  }
  Value& operator=(Value&& o) noexcept {
    if (this != &o) {
      Value old(std::move(*this));  // destroyed iteratively at the end of this scope
      kind_ = o.kind_;
      v_ = std::move(o.v_);
      o.reset_shallow();
    }
    return *this;
  }
  ~Value() { destroy_children(); }

  [[nodiscard]] value_kind kind() const noexcept { return kind_; }
  [[nodiscard]] bool is_none() const noexcept { return kind_ == value_kind::none; }
  [[nodiscard]] bool is_bool() const noexcept { return kind_ == value_kind::boolean; }
  [[nodiscard]] bool is_int() const noexcept { return kind_ == value_kind::integer; }
  [[nodiscard]] bool is_double() const noexcept { return kind_ == value_kind::floating; }
  [[nodiscard]] bool is_string() const noexcept { return kind_ == value_kind::string; }
  [[nodiscard]] bool is_bytes() const noexcept { return kind_ == value_kind::bytes; }
  [[nodiscard]] bool is_tensor() const noexcept { return kind_ == value_kind::tensor; }
  [[nodiscard]] bool is_list() const noexcept { return kind_ == value_kind::list; }
  [[nodiscard]] bool is_tuple() const noexcept { return kind_ == value_kind::tuple; }
  /// list or tuple
  [[nodiscard]] bool is_sequence() const noexcept { return is_list() || is_tuple(); }
  [[nodiscard]] bool is_dict() const noexcept { return kind_ == value_kind::dict; }
  [[nodiscard]] bool is_object() const noexcept { return kind_ == value_kind::object; }
  /// list, tuple, dict or object: a node with children.
  [[nodiscard]] bool is_container() const noexcept { return is_sequence() || is_dict() || is_object(); }

  [[nodiscard]] bool as_bool() const { return get<bool>(value_kind::boolean); }
  [[nodiscard]] std::int64_t as_int() const { return get<std::int64_t>(value_kind::integer); }
  [[nodiscard]] double as_double() const { return get<double>(value_kind::floating); }
  /// int or float as double (Python's numeric tower for hyper-parameters).
  [[nodiscard]] double as_number() const {
    if (is_int()) return static_cast<double>(as_int());
    return as_double();
  }
  // Accessors. On a temporary Value (a function's result) they return the part by value, moved
  // out, so that `for (auto& [k, v] : torch::load(p).as_dict())` iterates a living dict.
  [[nodiscard]] const std::string& as_string() const& { return get<std::string>(value_kind::string); }
  [[nodiscard]] std::string as_string() && { return std::move(get<std::string>(value_kind::string)); }
  [[nodiscard]] const Bytes& as_bytes() const& { return get<Bytes>(value_kind::bytes); }
  [[nodiscard]] Bytes as_bytes() && { return std::move(get<Bytes>(value_kind::bytes)); }
  [[nodiscard]] const TensorView& as_tensor() const& { return get<TensorView>(value_kind::tensor); }
  [[nodiscard]] TensorView as_tensor() && { return std::move(get<TensorView>(value_kind::tensor)); }
  /// The items of a list or tuple.
  [[nodiscard]] const List& as_list() const& {
    if (!is_sequence()) kind_error(value_kind::list);
    return std::get<List>(v_);
  }
  [[nodiscard]] List& as_list() & {
    if (!is_sequence()) kind_error(value_kind::list);
    return std::get<List>(v_);
  }
  [[nodiscard]] List as_list() && { return std::move(as_list()); }
  [[nodiscard]] const Dict& as_dict() const& { return get<Dict>(value_kind::dict); }
  [[nodiscard]] Dict& as_dict() & { return get<Dict>(value_kind::dict); }
  [[nodiscard]] Dict as_dict() && { return std::move(get<Dict>(value_kind::dict)); }
  [[nodiscard]] const Object& as_object() const& { return get<Object>(value_kind::object); }
  [[nodiscard]] Object& as_object() & { return get<Object>(value_kind::object); }
  [[nodiscard]] Object as_object() && { return std::move(get<Object>(value_kind::object)); }

  /// Dict lookup; throws errors::missing_key or errors::value_kind.
  const Value& operator[](const Key& k) const& { return as_dict().at(k); }
  Value& operator[](const Key& k) & { return as_dict().at(k); }
  Value operator[](const Key& k) && { return std::move(as_dict().at(k)); }
  /// List/tuple element; throws errors::out_of_range.
  const Value& at(std::size_t i) const& {
    const List& l = as_list();
    if (i >= l.size())
      throw_error(errors::out_of_range, "index " + std::to_string(i) + " of a " + std::string(to_string(kind_)) +
                                            " of " + std::to_string(l.size()));
    return l[i];
  }
  Value at(std::size_t i) && { return std::move(const_cast<Value&>(std::as_const(*this).at(i)));  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  }

  /// Deep equality; tensors compare by dtype, shape and element bytes; doubles bitwise.
  friend bool operator==(const Value& a, const Value& b);

 private:
  Value(value_kind k, List items) : kind_(k), v_(std::move(items)) {}

  template <class T>
  const T& get(value_kind k) const {
    if (kind_ != k) kind_error(k);
    return std::get<T>(v_);
  }
  template <class T>
  T& get(value_kind k) {
    if (kind_ != k) kind_error(k);
    return std::get<T>(v_);
  }
  [[noreturn]] void kind_error(value_kind wanted) const {
    throw_error(errors::value_kind, "expected " + std::string(to_string(wanted)) + ", found " + std::string(to_string(kind_)));
  }
  void reset_shallow() noexcept {
    kind_ = value_kind::none;
    v_.template emplace<std::monostate>();
  }
  /// Moves all descendants out into a work list and destroys them one level at a time.
  void destroy_children() noexcept;
  /// Moves this node's children to `out`, leaving the node childless.
  void take_children(std::vector<Value>& out) noexcept;
  [[nodiscard]] bool has_children() const noexcept;

  value_kind kind_ = value_kind::none;
  std::variant<std::monostate, bool, std::int64_t, double, std::string, Bytes, TensorView, List, Dict, Object> v_;
};

// ----------------------------------------------------------------------------------------------
// Dict

inline std::size_t Dict::size() const noexcept { return items_.size(); }
inline bool Dict::empty() const noexcept { return items_.empty(); }
inline Dict::iterator Dict::begin() noexcept { return items_.begin(); }
inline Dict::iterator Dict::end() noexcept { return items_.end(); }
inline Dict::const_iterator Dict::begin() const noexcept { return items_.begin(); }
inline Dict::const_iterator Dict::end() const noexcept { return items_.end(); }
inline void Dict::reserve(std::size_t n) { items_.reserve(n); }

inline Dict::Dict(std::initializer_list<item> items) {
  items_.reserve(items.size());
  for (const auto& it : items) set(it.first, it.second);
}
inline Dict::Dict(const Dict& o) : items_(o.items_) {}
inline Dict& Dict::operator=(const Dict& o) {
  if (this != &o) {
    items_ = o.items_;
    index_.clear();
  }
  return *this;
}

inline std::ptrdiff_t Dict::position(const Key& k) const {
  if (items_.size() < index_threshold) {
    for (std::size_t i = 0; i < items_.size(); ++i)
      if (items_[i].first == k) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }
  if (index_.empty()) {
    index_.reserve(items_.size() + 1);
    for (std::size_t i = 0; i < items_.size(); ++i) index_.add(detail::hash_index::mix(items_[i].first.hash()), i);
  }
  const auto p = index_.find(detail::hash_index::mix(k.hash()), [&](std::uint32_t i) { return items_[i].first == k; });
  return p == detail::hash_index::npos ? -1 : static_cast<std::ptrdiff_t>(p);
}

inline void Dict::index_new_last() const {
  if (!index_.empty()) index_.add(detail::hash_index::mix(items_.back().first.hash()), items_.size() - 1);
}

inline Value* Dict::find(const Key& k) {
  const auto p = position(k);
  return p < 0 ? nullptr : &items_[static_cast<std::size_t>(p)].second;
}
inline const Value* Dict::find(const Key& k) const {
  const auto p = position(k);
  return p < 0 ? nullptr : &items_[static_cast<std::size_t>(p)].second;
}
inline Value& Dict::at(const Key& k) {
  if (Value* v = find(k)) return *v;
  throw_error(errors::missing_key, "no key " + (k.is_int() ? k.str() : quote(k.str())));
}
inline const Value& Dict::at(const Key& k) const {
  if (const Value* v = find(k)) return *v;
  throw_error(errors::missing_key, "no key " + (k.is_int() ? k.str() : quote(k.str())));
}
inline Value& Dict::set(Key k, Value v) {
  if (Value* existing = find(k)) {
    *existing = std::move(v);
    return *existing;
  }
  items_.emplace_back(std::move(k), std::move(v));
  index_new_last();
  return items_.back().second;
}
inline Value& Dict::insert(Key k, Value v) {
  if (find(k)) throw_error(errors::duplicate_key, "key " + (k.is_int() ? k.str() : quote(k.str())) + " already present");
  items_.emplace_back(std::move(k), std::move(v));
  index_new_last();
  return items_.back().second;
}
inline Value& Dict::append_unchecked(Key k, Value v) {
  items_.emplace_back(std::move(k), std::move(v));
  index_new_last();
  return items_.back().second;
}
inline Value& Dict::operator[](const Key& k) {
  if (Value* v = find(k)) return *v;
  items_.emplace_back(k, Value());
  index_new_last();
  return items_.back().second;
}
inline bool Dict::erase(const Key& k) {
  const auto p = position(k);
  if (p < 0) return false;
  items_.erase(items_.begin() + p);
  index_.clear();
  return true;
}

// ----------------------------------------------------------------------------------------------
// Value: iterative destruction and equality

inline bool Value::has_children() const noexcept {
  switch (kind_) {
    case value_kind::list:
    case value_kind::tuple: return !std::get<List>(v_).empty();
    case value_kind::dict: return !std::get<Dict>(v_).empty();
    case value_kind::object: {
      const auto& o = std::get<Object>(v_);
      return !o.args.empty() || !o.state.empty() || !o.items.empty();
    }
    default: return false;
  }
}

inline void Value::take_children(std::vector<Value>& out) noexcept {
  auto move_all = [&](List& l) {
    for (auto& c : l)
      if (c.has_children()) out.push_back(std::move(c));
    l.clear();
  };
  switch (kind_) {
    case value_kind::list:
    case value_kind::tuple: move_all(std::get<List>(v_)); break;
    case value_kind::dict: {
      auto& d = std::get<Dict>(v_);
      for (auto& it : d)
        if (it.second.has_children()) out.push_back(std::move(it.second));
      d = Dict();
      break;
    }
    case value_kind::object: {
      auto& o = std::get<Object>(v_);
      move_all(o.args);
      move_all(o.state);
      move_all(o.items);
      break;
    }
    default: break;
  }
}

inline void Value::destroy_children() noexcept {
  if (!has_children()) return;
  // Allocation failure here would be fatal either way; the vector grows with the tree's width.
  std::vector<Value> work;
  take_children(work);
  while (!work.empty()) {
    Value v = std::move(work.back());
    work.pop_back();
    v.take_children(work);
  }  // each popped node is childless when it dies: no recursion
}

namespace detail {
/// Iterative deep equality over a work list of node pairs (no recursion, any depth).
struct value_equal {
  std::vector<std::pair<const Value*, const Value*>> work;

  bool push_lists(const List& x, const List& y) {
    if (x.size() != y.size()) return false;
    for (std::size_t i = x.size(); i-- > 0;) work.emplace_back(&x[i], &y[i]);
    return true;
  }
  bool push_dicts(const Dict& a, const Dict& b) {
    const auto& dx = a.items();
    const auto& dy = b.items();
    if (dx.size() != dy.size()) return false;
    for (std::size_t i = dx.size(); i-- > 0;) {
      if (dx[i].first != dy[i].first) return false;
      work.emplace_back(&dx[i].second, &dy[i].second);
    }
    return true;
  }
  bool push_objects(const Object& ox, const Object& oy) {
    return ox.module == oy.module && ox.name == oy.name && ox.how == oy.how && push_lists(ox.args, oy.args) &&
           push_lists(ox.state, oy.state) && push_lists(ox.items, oy.items);
  }
  bool run();
};
}  // namespace detail

inline bool operator==(const Object& a, const Object& b) {
  detail::value_equal eq;
  return eq.push_objects(a, b) && eq.run();
}

inline bool operator==(const Dict& a, const Dict& b) {
  detail::value_equal eq;
  return eq.push_dicts(a, b) && eq.run();
}

inline bool operator==(const Value& a, const Value& b) {
  detail::value_equal eq;
  eq.work.emplace_back(&a, &b);
  return eq.run();
}

inline bool detail::value_equal::run() {
  while (!work.empty()) {
    auto [x, y] = work.back();
    work.pop_back();
    if (x->kind() != y->kind()) return false;
    switch (x->kind()) {
      case value_kind::none: break;
      case value_kind::boolean:
        if (x->as_bool() != y->as_bool()) return false;
        break;
      case value_kind::integer:
        if (x->as_int() != y->as_int()) return false;
        break;
      case value_kind::floating:
        if (std::bit_cast<std::uint64_t>(x->as_double()) != std::bit_cast<std::uint64_t>(y->as_double())) return false;
        break;
      case value_kind::string:
        if (x->as_string() != y->as_string()) return false;
        break;
      case value_kind::bytes:
        if (x->as_bytes() != y->as_bytes()) return false;
        break;
      case value_kind::tensor:
        if (!equal_bytes(x->as_tensor(), y->as_tensor())) return false;
        break;
      case value_kind::list:
      case value_kind::tuple:
        if (!push_lists(x->as_list(), y->as_list())) return false;
        break;
      case value_kind::dict:
        if (!push_dicts(x->as_dict(), y->as_dict())) return false;
        break;
      case value_kind::object:
        if (!push_objects(x->as_object(), y->as_object())) return false;
        break;
    }
  }
  return true;
}

}  // namespace statedict::inline v0
