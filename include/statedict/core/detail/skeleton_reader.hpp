// statedict: reading skeleton documents: node classification, decoding of scalars and keys, and an
// iterative cursor over the nodes, each step validated (a skeleton is input from files).
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
#include "skeleton_tape.hpp"
#include "text.hpp"

namespace statedict::inline v0::detail {

// ------------------------------------------------------------------------------------------------
// Reading skeletons

[[noreturn]] inline void malformed(std::string detail) { throw_error(errors::flat_malformed, std::move(detail)); }


struct snode_info {
  snode kind;
  const json* node;  ///< the node itself
  const json* body;  ///< the value under the node's discriminating key (the node itself for scalars)
};

inline bool is_container(snode k) noexcept { return k == snode::list || k == snode::tuple || k == snode::dict || k == snode::object; }

/// The kind a node-object key announces; `none` for other keys (ignored, for forward compatibility).
inline snode discriminator(std::string_view k) noexcept {
  switch (k.size()) {
    case 4:
      if (k == "dict") return snode::dict;
      if (k == "list") return snode::list;
      break;
    case 5:
      if (k == "float") return snode::floating;
      if (k == "bytes") return snode::bytes;
      if (k == "alias") return snode::alias;
      if (k == "tuple") return snode::tuple;
      break;
    case 6:
      if (k == "tensor") return snode::tensor;
      if (k == "object") return snode::object;
      break;
    case 7:
      if (k == "view_of") return snode::view;
      break;
    case 9:
      if (k == "str_bytes") return snode::string;
      break;
    default: break;
  }
  return snode::none;
}

inline snode_info classify(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return {snode::none, &j, &j};
    case json::value_t::boolean: return {snode::boolean, &j, &j};
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return {snode::integer, &j, &j};
    case json::value_t::number_float: return {snode::floating, &j, &j};
    case json::value_t::string: return {snode::string, &j, &j};
    case json::value_t::object: {
      snode kind = snode::none;
      const json* body = nullptr;
      const std::string* key = nullptr;
      for (const auto& [k, v] : j.get_ref<const json::object_t&>()) {
        const snode d = discriminator(k);
        if (d == snode::none) continue;
        if (body) malformed("a node has both " + quote(*key) + " and " + quote(k));
        kind = d;
        body = &v;
        key = &k;
      }
      if (!body) malformed("a node object has none of the keys float, bytes, str_bytes, tensor, alias, view_of, dict, list, tuple, object");
      bool ok = false;
      switch (kind) {
        case snode::list:
        case snode::tuple:
        case snode::dict: ok = body->is_array(); break;
        case snode::object: ok = body->is_object(); break;
        default: ok = body->is_string(); break;
      }
      if (!ok) malformed("the value of " + quote(*key) + " is a JSON " + std::string(body->type_name()));
      return {kind, &j, body};
    }
    default: malformed("a node is a JSON " + std::string(j.type_name()));
  }
}

/// A JSON integer as int64 (JSON unsigned integers above 2^63-1 are out of range).
inline std::int64_t json_int(const json& j, std::string_view what) {
  if (j.is_number_unsigned()) {
    const auto u = j.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(INT64_MAX)) malformed(std::string(what) + " " + std::to_string(u) + " exceeds 2^63-1");
    return static_cast<std::int64_t>(u);
  }
  if (!j.is_number_integer()) malformed(std::string(what) + " is a JSON " + std::string(j.type_name()) + ", not an integer");
  return j.get<std::int64_t>();
}

inline std::string decode_str_bytes(const json& b64) {
  std::vector<std::uint8_t> raw;
  if (!base64_decode(b64.get_ref<const std::string&>(), raw)) malformed("\"str_bytes\" is not valid base64");
  return std::string(raw.begin(), raw.end());
}

/// A dict KEY: JSON string, JSON integer, or {"str_bytes": base64}.
inline Key decode_key(const json& k) {
  if (k.is_string()) return Key(k.get_ref<const std::string&>());
  if (k.is_number_integer()) return Key(json_int(k, "an int key"));
  if (k.is_object() && k.size() == 1) {
    auto it = k.find("str_bytes");
    if (it != k.end() && it->is_string()) return Key(decode_str_bytes(*it));
  }
  malformed("a dict key is a JSON " + std::string(k.type_name()) + "; keys are strings, integers or {\"str_bytes\": ...}");
}

inline std::string decode_string(const snode_info& n) {
  if (n.node == n.body) return n.body->get_ref<const std::string&>();
  return decode_str_bytes(*n.body);
}

inline double decode_float(const snode_info& n) {
  if (n.node == n.body) return n.body->get<double>();
  const std::string& s = n.body->get_ref<const std::string&>();
  if (s == "nan") return std::bit_cast<double>(0x7ff8000000000000ULL);
  if (s == "inf") return std::bit_cast<double>(0x7ff0000000000000ULL);
  if (s == "-inf") return std::bit_cast<double>(0xfff0000000000000ULL);
  if (s.size() == 18 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    std::uint64_t bits = 0;
    auto r = std::from_chars(s.data() + 2, s.data() + s.size(), bits, 16);
    if (r.ec == std::errc() && r.ptr == s.data() + s.size() && s[2] != '+' && s[2] != '-') return std::bit_cast<double>(bits);
  }
  malformed("\"float\" is " + quote(s) + "; expected \"nan\", \"inf\", \"-inf\" or \"0x\" and 16 hex digits");
}

/// A scalar leaf node (None, bool, int, float, str, bytes) as a Value.
inline Value decode_scalar(const snode_info& n) {
  switch (n.kind) {
    case snode::none: return Value();
    case snode::boolean: return Value(n.body->get<bool>());
    case snode::integer: return Value(json_int(*n.body, "an integer"));
    case snode::floating: return Value(decode_float(n));
    case snode::string: return Value(decode_string(n));
    case snode::bytes: {
      Bytes b;
      if (!base64_decode(n.body->get_ref<const std::string&>(), b.data)) malformed("\"bytes\" is not valid base64");
      return Value(std::move(b));
    }
    default: malformed("internal: not a scalar node");
  }
}

/// The member `key` of a node object, required to have JSON type `t`.
inline const json& member(const json& node, const char* key, json::value_t t, const char* what) {
  const auto& o = node.get_ref<const json::object_t&>();
  auto it = o.find(key);
  if (it == o.end()) malformed(std::string(what) + " has no " + quote(key));
  const bool ok = t == json::value_t::number_integer ? it->second.is_number_integer() : it->second.type() == t;
  if (!ok) malformed(std::string(what) + ": " + quote(key) + " is a JSON " + std::string(it->second.type_name()));
  return it->second;
}

inline statedict::dtype member_dtype(const json& node, const char* what) {
  const std::string& s = member(node, "dtype", json::value_t::string, what).get_ref<const std::string&>();
  auto d = dtype_from_name(s);
  if (!d) malformed(std::string(what) + ": unknown dtype " + quote(s));
  return *d;
}

inline shape_t dims(const json& arr, const char* key, const char* what) {
  const auto& a = arr.get_ref<const json::array_t&>();
  shape_t s;
  s.reserve(a.size());
  for (const json& d : a) {
    const std::int64_t x = json_int(d, std::string(what) + " " + key + " entry");
    if (x < 0) malformed(std::string(what) + ": " + key + " has a negative entry " + std::to_string(x));
    s.push_back(x);
  }
  return s;
}

inline shape_t member_dims(const json& node, const char* key, const char* what) {
  return dims(member(node, key, json::value_t::array, what), key, what);
}

inline ViewSpec decode_view(const snode_info& n) {
  ViewSpec s;
  s.dtype = member_dtype(*n.node, "a view_of node");
  s.offset = json_int(member(*n.node, "offset", json::value_t::number_integer, "a view_of node"), "a view_of offset");
  if (s.offset < 0) malformed("a view_of node has a negative offset");
  s.shape = member_dims(*n.node, "shape", "a view_of node");
  s.strides = member_dims(*n.node, "strides", "a view_of node");
  if (s.shape.size() != s.strides.size())
    malformed("a view_of node has " + std::to_string(s.shape.size()) + " sizes and " + std::to_string(s.strides.size()) + " strides");
  return s;
}

/// A string member of a node object: a JSON string or {"str_bytes": base64}.
inline std::string member_string(const json& node, const char* key, const char* what) {
  const auto& o = node.get_ref<const json::object_t&>();
  auto it = o.find(key);
  if (it == o.end()) malformed(std::string(what) + " has no " + quote(key));
  if (it->second.is_string()) return it->second.get_ref<const std::string&>();
  if (it->second.is_object()) {
    const snode_info n = classify(it->second);
    if (n.kind == snode::string) return decode_string(n);
  }
  malformed(std::string(what) + ": " + quote(key) + " is not a string");
}

inline Object decode_object_header(const json& body) {
  Object o;
  o.module = member_string(body, "module", "an object node");
  o.name = member_string(body, "name", "an object node");
  const std::string& how = member(body, "how", json::value_t::string, "an object node").get_ref<const std::string&>();
  if (how == "global") o.how = object_build::global;
  else if (how == "reduce") o.how = object_build::reduce;
  else if (how == "newobj") o.how = object_build::newobj;
  else malformed("an object node has \"how\" " + quote(how) + "; expected global, reduce or newobj");
  return o;
}

/// Where a node sits in its parent.
enum class slot_kind : std::uint8_t { root, index, dict, args, state, items };

/// Iterates a skeleton's nodes in pre-order without recursion, as events: `enter` (a container,
/// before its children), `leaf`, `leave` (after a container's children), `done`. Validates the
/// structure it walks (node kinds, dict pairs and keys, object parts); leaf contents are decoded
/// by the caller.
class skeleton_cursor {
 public:
  enum class ev : std::uint8_t { leaf, enter, leave, done };
  struct event {
    ev type;
    snode_info node;
    slot_kind slot;
    std::size_t index;   ///< list index, or index within an object part
    std::size_t part_size;  ///< size of the object part (for "state" paths)
    Key key;             ///< the dict key (slot_kind::dict), else 0
  };

  explicit skeleton_cursor(const json& root) : root_(&root) {}

  event next() {
    if (!started_) {
      started_ = true;
      snode_info n = classify(*root_);
      if (is_container(n.kind)) push(n);
      return {is_container(n.kind) ? ev::enter : ev::leaf, n, slot_kind::root, 0, 0, Key(0)};
    }
    if (stack_.empty()) return {ev::done, {snode::none, nullptr, nullptr}, slot_kind::root, 0, 0, Key(0)};
    frame& f = stack_.back();
    if (f.next == f.size) {
      snode_info n = f.info;
      stack_.pop_back();
      return {ev::leave, n, slot_kind::root, 0, 0, Key(0)};
    }
    const std::size_t i = f.next++;
    const json* child = nullptr;
    event e{ev::leaf, {}, slot_kind::index, i, 0, Key(0)};
    switch (f.info.kind) {
      case snode::list:
      case snode::tuple: child = &(*f.parts[0])[i]; break;
      case snode::dict: {
        const json& pair = (*f.parts[0])[i];
        if (!pair.is_array() || pair.size() != 2) malformed("a dict entry is not a [KEY, NODE] pair");
        e.slot = slot_kind::dict;
        e.key = decode_key(pair[0]);
        child = &pair[1];
        break;
      }
      default: {
        std::size_t j = i;
        std::size_t p = 0;
        while (j >= f.part_size[p]) j -= f.part_size[p++];
        child = &(*f.parts[p])[j];
        e.slot = p == 0 ? slot_kind::args : p == 1 ? slot_kind::state : slot_kind::items;
        e.index = j;
        e.part_size = f.part_size[p];
        break;
      }
    }
    e.node = classify(*child);
    if (is_container(e.node.kind)) {
      e.type = ev::enter;
      push(e.node);  // `f` is dangling from here on
    }
    return e;
  }

  /// After an `enter`: skip that container's children (its `leave` comes next).
  void skip() {
    if (!stack_.empty()) stack_.back().next = stack_.back().size;
  }

  /// The path of the node last returned (an undecodable key shows as "?"; next() refuses those).
  [[nodiscard]] Path path() const {
    Path p;
    for (const frame& f : stack_) {
      if (f.next == 0) continue;
      const std::size_t i = f.next - 1;
      switch (f.info.kind) {
        case snode::list:
        case snode::tuple: p.emplace_back(static_cast<std::int64_t>(i)); break;
        case snode::dict: {
          const json& pair = (*f.parts[0])[i];
          try {
            p.push_back(decode_key(pair.at(0)));
          } catch (...) {
            p.emplace_back("?");
          }
          break;
        }
        default: {
          std::size_t j = i;
          std::size_t k = 0;
          while (j >= f.part_size[k]) j -= f.part_size[k++];
          p.emplace_back(k == 0 ? "args" : k == 1 ? "state" : "items");
          if (k != 1 || f.part_size[1] > 1) p.emplace_back(static_cast<std::int64_t>(j));
          break;
        }
      }
    }
    return p;
  }

  [[nodiscard]] std::size_t depth() const noexcept { return stack_.size(); }

 private:
  struct frame {
    snode_info info;
    const json* parts[3];
    std::size_t part_size[3];
    std::size_t next;
    std::size_t size;
  };

  void push(const snode_info& n) {
    frame f{n, {nullptr, nullptr, nullptr}, {0, 0, 0}, 0, 0};
    if (n.kind == snode::object) {
      static constexpr const char* names[3] = {"args", "state", "items"};
      for (int p = 0; p < 3; ++p) {
        const json& a = member(*n.body, names[p], json::value_t::array, "an object node");
        f.parts[p] = &a;
        f.part_size[p] = a.size();
      }
      f.size = f.part_size[0] + f.part_size[1] + f.part_size[2];
    } else {
      f.parts[0] = n.body;
      f.size = n.body->size();
      f.part_size[0] = f.size;
    }
    stack_.push_back(f);
  }

  const json* root_;
  bool started_ = false;
  std::vector<frame> stack_;
};

/// Appends the path keys of an event's node to `p`; returns how many. A dict key is moved into
/// the path (e.key is empty afterwards; read it as p.back()).
inline std::size_t push_event_keys(Path& p, skeleton_cursor::event& e) {
  switch (e.slot) {
    case slot_kind::root: return 0;
    case slot_kind::index: p.emplace_back(static_cast<std::int64_t>(e.index)); return 1;
    case slot_kind::dict: p.push_back(std::move(e.key)); return 1;
    case slot_kind::state:
      p.emplace_back("state");
      if (e.part_size > 1) {
        p.emplace_back(static_cast<std::int64_t>(e.index));
        return 2;
      }
      return 1;
    case slot_kind::args:
    case slot_kind::items:
      p.emplace_back(e.slot == slot_kind::args ? "args" : "items");
      p.emplace_back(static_cast<std::int64_t>(e.index));
      return 2;
  }
  return 0;
}

/// The "root" node of a skeleton document, after checking the header.
inline const json& skeleton_root(const json& skeleton) {
  if (!skeleton.is_object()) malformed("the skeleton is a JSON " + std::string(skeleton.type_name()) + ", not an object");
  auto v = skeleton.find("statedict_skeleton");
  if (v == skeleton.end()) malformed("the skeleton has no \"statedict_skeleton\" version");
  if (!v->is_number_integer()) malformed("\"statedict_skeleton\" is a JSON " + std::string(v->type_name()));
  if (*v != 1)
    throw_error(errors::flat_version, "skeleton version " + v->dump() + "; this statedict reads version 1");
  auto r = skeleton.find("root");
  if (r == skeleton.end()) malformed("the skeleton has no \"root\"");
  return *r;
}

}  // namespace statedict::inline v0::detail
