// statedict: the skeleton's JSON nodes, and the compact form flatten builds (skeleton_tape) with
// its conversions to a JSON document and to compact JSON text.
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

#include "../dtype.hpp"
#include "../error.hpp"
#include "../shape.hpp"
#include "../value.hpp"
#include "text.hpp"

namespace statedict::inline v0::detail {

using json = nlohmann::json;

/// A JSON string node, or {"str_bytes": base64} when `s` is not valid UTF-8.
inline json encode_string(std::string_view s) {
  if (valid_utf8(s)) return json(std::string(s));
  json j(json::value_t::object);
  j.get_ref<json::object_t&>().emplace("str_bytes", base64_encode(s));
  return j;
}

inline json encode_key(const Key& k) {
  if (k.is_int()) return json(k.as_int());
  return encode_string(k.as_string());
}

/// A finite double as a JSON float; a non-finite one as {"float": "nan" | "inf" | "-inf" | "0x..."}.
inline json encode_double(double d) {
  if (std::isfinite(d)) return json(d);
  const auto bits = std::bit_cast<std::uint64_t>(d);
  std::string s;
  if (bits == 0x7ff0000000000000ULL) s = "inf";
  else if (bits == 0xfff0000000000000ULL) s = "-inf";
  else if (bits == 0x7ff8000000000000ULL) s = "nan";
  else {
    static constexpr char hex[] = "0123456789abcdef";
    s = "0x";
    for (int sh = 60; sh >= 0; sh -= 4) s += hex[(bits >> sh) & 15U];
  }
  json j(json::value_t::object);
  j.get_ref<json::object_t&>().emplace("float", std::move(s));
  return j;
}

inline json shape_json(const dim_t* d, std::size_t n) {
  json::array_t a;
  a.reserve(n);
  for (std::size_t i = 0; i < n; ++i) a.emplace_back(d[i]);
  return json(std::move(a));
}
inline json shape_json(const shape_t& s) { return shape_json(s.data(), s.size()); }

// Node members are inserted in key order with a hint at the end: no string comparisons.
inline json tensor_node(std::string_view name, statedict::dtype dt, const dim_t* shape, std::size_t rank) {
  json j(json::value_t::object);
  auto& o = j.get_ref<json::object_t&>();
  o.emplace_hint(o.end(), "dtype", std::string(statedict::name(dt)));
  o.emplace_hint(o.end(), "shape", shape_json(shape, rank));
  o.emplace_hint(o.end(), "tensor", std::string(name));
  return j;
}

inline json alias_node(std::string_view target) {
  json j(json::value_t::object);
  j.get_ref<json::object_t&>().emplace("alias", std::string(target));
  return j;
}

inline json view_node(std::string_view base, statedict::dtype dt, dim_t offset, const dim_t* shape, const dim_t* strides,
                      std::size_t rank) {
  json j(json::value_t::object);
  auto& o = j.get_ref<json::object_t&>();
  o.emplace_hint(o.end(), "dtype", std::string(statedict::name(dt)));
  o.emplace_hint(o.end(), "offset", offset);
  o.emplace_hint(o.end(), "shape", shape_json(shape, rank));
  o.emplace_hint(o.end(), "strides", shape_json(strides, rank));
  o.emplace_hint(o.end(), "view_of", std::string(base));
  return j;
}

/// Node kinds of the skeleton format.
enum class snode : std::uint8_t { none, boolean, integer, floating, string, bytes, tensor, alias, view, list, tuple, dict, object };

/// The compact form of a skeleton made by flatten: its nodes in pre-order in one array, their
/// strings back to back in one pool, and one record per tensor-like node. Only flatten makes one,
/// so it is well formed by construction, its dict keys unique as the Dict's were (unflatten still
/// checks it against the tensor map).
struct skeleton_tape {
  struct node {
    std::uint64_t a;    // integer, floating: the bits; string, bytes: pool offset; tensor: leaf index
                        // (every tensor-like node is a `tensor` node here; its leaf says which kind);
                        // list, tuple, dict: child count; object: args count
    std::uint32_t b;    // string, bytes: length, or long_string; object: state count
    snode kind;
    std::uint8_t flag;  // boolean: the value; object: its object_build
  };
  /// A string of 2^32 - 1 bytes or more: its length is stored in the pool, 8 bytes before it.
  static constexpr std::uint32_t long_string = UINT32_MAX;
  // 16 bytes: a tape holds several nodes per tensor, written once and read once, so its size is
  // memory traffic (and what growing the array copies).
  static_assert(sizeof(node) == 16);
  // A dict's children come as (key, value) node pairs, the key an integer or string node. An
  // object node is followed by a `none` node whose `a` is its items count, then its module and
  // name as string nodes, then its args, state and items.
  struct leaf {
    snode kind;            // tensor, alias or view
    statedict::dtype dtype;
    std::uint32_t rank;
    std::uint32_t target;  // alias, view: the leaf of the tensor node they name
    std::uint64_t name;    // tensor: its name, at pool offset `name`, `name_len` bytes
    std::uint64_t name_len;
    std::uint64_t dims;    // tensor: its shape; view: its shape, then its strides; from dims[this]
    dim_t offset;          // view: element offset into its base
  };
  std::vector<node> nodes;
  std::string pool;
  std::vector<leaf> leaves;
  std::vector<dim_t> dims;

  [[nodiscard]] std::string_view str(std::uint64_t off, std::uint64_t len) const noexcept {
    return std::string_view(pool).substr(static_cast<std::size_t>(off), static_cast<std::size_t>(len));
  }
  [[nodiscard]] std::string_view str(const node& n) const noexcept {
    if (n.b != long_string) return str(n.a, n.b);
    std::uint64_t len = 0;
    std::memcpy(&len, pool.data() + n.a, sizeof len);
    return str(n.a + sizeof len, len);
  }
  /// The map name a tensor-like node declares or refers to.
  [[nodiscard]] std::string_view name(const leaf& l) const noexcept {
    const leaf& named = l.kind == snode::tensor ? l : leaves[l.target];
    return str(named.name, named.name_len);
  }
  std::uint64_t add_str(std::string_view s) {
    const std::uint64_t off = pool.size();
    pool.append(s);
    return off;
  }
  /// Appends a string node's bytes; returns its (a, b). Strings of `limit` bytes or more keep
  /// their length in the pool (the limit is a parameter for tests only).
  std::pair<std::uint64_t, std::uint32_t> add_string_node(std::string_view s, std::uint64_t limit = long_string) {
    if (s.size() < limit) return {add_str(s), static_cast<std::uint32_t>(s.size())};
    const std::uint64_t off = pool.size(), len = s.size();
    pool.append(reinterpret_cast<const char*>(&len), sizeof len);
    pool.append(s);
    return {off, long_string};
  }
};


inline std::string_view how_name(object_build b) noexcept {
  switch (b) {
    case object_build::global: return "global";
    case object_build::reduce: return "reduce";
    case object_build::newobj: return "newobj";
  }
  return "reduce";
}

/// The JSON document of a tape: node for node the document docs/flatten.md prescribes (and that
/// flatten wrote directly before it kept the compact form). Iterative, like every skeleton walk.
inline json tape_to_json(const skeleton_tape& t) {
  json doc(json::value_t::object);
  auto& top = doc.get_ref<json::object_t&>();
  top.emplace("statedict_skeleton", 1);
  json& root = top["root"];
  struct open {
    json* parts[3];
    std::uint64_t size[3];
    std::size_t part;
    std::uint64_t next;
    bool dict;
  };
  std::vector<open> stack;
  std::size_t p = 0;
  auto array_of = [](json::object_t& o, const char* key, std::uint64_t n) -> json& {
    json& a = o[key];
    a = json::array_t(static_cast<std::size_t>(n));
    return a;
  };
  auto put = [&](json& slot) {
    const skeleton_tape::node& n = t.nodes[p++];
    switch (n.kind) {
      case snode::none: break;
      case snode::boolean: slot = n.flag != 0; break;
      case snode::integer: slot = static_cast<std::int64_t>(n.a); break;
      case snode::floating: slot = encode_double(std::bit_cast<double>(n.a)); break;
      case snode::string: slot = encode_string(t.str(n)); break;
      case snode::bytes: {
        const std::string_view b = t.str(n);
        json j(json::value_t::object);
        j.get_ref<json::object_t&>().emplace("bytes", base64_encode(reinterpret_cast<const std::uint8_t*>(b.data()), b.size()));
        slot = std::move(j);
        break;
      }
      case snode::tensor:
      case snode::alias:
      case snode::view: {
        const skeleton_tape::leaf& l = t.leaves[static_cast<std::size_t>(n.a)];
        const dim_t* d = t.dims.data() + l.dims;
        if (l.kind == snode::tensor) slot = tensor_node(t.name(l), l.dtype, d, l.rank);
        else if (l.kind == snode::alias) slot = alias_node(t.name(l));
        else slot = view_node(t.name(l), l.dtype, l.offset, d, d + l.rank, l.rank);
        break;
      }
      case snode::list:
      case snode::tuple:
      case snode::dict: {
        slot = json(json::value_t::object);
        const char* key = n.kind == snode::list ? "list" : n.kind == snode::tuple ? "tuple" : "dict";
        json& a = array_of(slot.get_ref<json::object_t&>(), key, n.a);
        if (n.a) stack.push_back({{&a, nullptr, nullptr}, {n.a, 0, 0}, 0, 0, n.kind == snode::dict});
        break;
      }
      case snode::object: {
        const std::uint64_t items = t.nodes[p++].a;
        const skeleton_tape::node& module = t.nodes[p++];
        const skeleton_tape::node& name = t.nodes[p++];
        slot = json(json::value_t::object);
        json& body = slot.get_ref<json::object_t&>()["object"];
        body = json(json::value_t::object);
        auto& b = body.get_ref<json::object_t&>();
        b.emplace("module", encode_string(t.str(module)));
        b.emplace("name", encode_string(t.str(name)));
        b.emplace("how", std::string(how_name(static_cast<object_build>(n.flag))));
        json& args = array_of(b, "args", n.a);
        json& state = array_of(b, "state", n.b);
        json& its = array_of(b, "items", items);
        if (n.a + n.b + items) stack.push_back({{&args, &state, &its}, {n.a, n.b, items}, 0, 0, false});
        break;
      }
    }
  };
  put(root);
  while (!stack.empty()) {
    open& o = stack.back();
    while (o.part < 3 && o.next == o.size[o.part]) ++o.part, o.next = 0;
    if (o.part == 3) {
      stack.pop_back();
      continue;
    }
    json& slot = (*o.parts[o.part])[static_cast<std::size_t>(o.next++)];
    if (o.dict) {
      slot = json::array_t(2);
      const skeleton_tape::node& k = t.nodes[p++];
      slot[0] = k.kind == snode::integer ? json(static_cast<std::int64_t>(k.a)) : encode_string(t.str(k));
      put(slot[1]);  // `o` may dangle from here on
    } else {
      put(slot);
    }
  }
  return doc;
}

/// The compact JSON text of a tape's document, written straight from the tape: byte for byte
/// `skeleton_dump(tape_to_json(t))` (nlohmann's member order is by key, numbers and strings as its
/// dump() writes them) without building the DOM (about 13 allocations per tensor node). nullopt for
/// a tape that holds an object node (the members of its document come in another order than its
/// parts on the tape) or a tensor name that is not UTF-8 (the JSON way reports it): the caller
/// goes the JSON way then.
inline std::optional<std::string> tape_dump(const skeleton_tape& t) {
  std::string out;
  out.reserve(t.pool.size() * 2 + t.nodes.size() * 8 + t.leaves.size() * 48 + 64);
  auto shape = [&](const dim_t* d, std::size_t n) {
    out += '[';
    for (std::size_t i = 0; i < n; ++i) {
      if (i) out += ',';
      append_int(out, d[i]);
    }
    out += ']';
  };
  auto text = [&](std::string_view s) {  // encode_string's node
    if (valid_utf8(s)) return append_json_string(out, s);
    out += R"({"str_bytes":")";
    out += base64_encode(s);
    out += "\"}";
  };
  struct open {
    std::uint64_t size;
    std::uint64_t next;
    bool dict;
    bool close_pair;  // the container is a dict entry's value: its `]` follows
  };
  std::vector<open> stack;
  std::size_t p = 0;
  // Writes the node at p; false when the JSON way must take over.
  auto put = [&](bool dict_value) -> bool {
    const skeleton_tape::node& n = t.nodes[p++];
    switch (n.kind) {
      case snode::none: out += "null"; break;
      case snode::boolean: out += n.flag != 0 ? "true" : "false"; break;
      case snode::integer: append_int(out, static_cast<std::int64_t>(n.a)); break;
      case snode::floating: out += encode_double(std::bit_cast<double>(n.a)).dump(); break;
      case snode::string: text(t.str(n)); break;
      case snode::bytes: {
        const std::string_view b = t.str(n);
        out += R"({"bytes":")";
        out += base64_encode(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
        out += "\"}";
        break;
      }
      case snode::tensor:
      case snode::alias:
      case snode::view: {
        const skeleton_tape::leaf& l = t.leaves[static_cast<std::size_t>(n.a)];
        const std::string_view name = t.name(l);
        if (!valid_utf8(name)) return false;
        const dim_t* d = t.dims.data() + l.dims;
        if (l.kind == snode::alias) {
          out += R"({"alias":)";
        } else {
          out += R"({"dtype":)";
          append_json_string(out, statedict::name(l.dtype));
          if (l.kind == snode::view) {
            out += R"(,"offset":)";
            append_int(out, l.offset);
          }
          out += R"(,"shape":)";
          shape(d, l.rank);
          if (l.kind == snode::view) {
            out += R"(,"strides":)";
            shape(d + l.rank, l.rank);
          }
          out += l.kind == snode::tensor ? R"(,"tensor":)" : R"(,"view_of":)";
        }
        append_json_string(out, name);
        out += '}';
        break;
      }
      case snode::list:
      case snode::tuple:
      case snode::dict:
        out += n.kind == snode::list ? R"({"list":[)" : n.kind == snode::tuple ? R"({"tuple":[)" : R"({"dict":[)";
        stack.push_back({n.a, 0, n.kind == snode::dict, dict_value});
        return true;
      case snode::object: return false;
    }
    if (dict_value) out += ']';
    return true;
  };
  out += R"({"root":)";
  if (!put(false)) return std::nullopt;
  while (!stack.empty()) {
    open& o = stack.back();
    if (o.next == o.size) {
      out += "]}";
      if (o.close_pair) out += ']';
      stack.pop_back();
      continue;
    }
    if (o.next++) out += ',';
    if (o.dict) {
      out += '[';
      const skeleton_tape::node& k = t.nodes[p++];
      if (k.kind == snode::integer) append_int(out, static_cast<std::int64_t>(k.a));
      else text(t.str(k));
      out += ',';
    }
    if (!put(o.dict)) return std::nullopt;  // `o` may dangle from here on
  }
  out += R"(,"statedict_skeleton":1})";
  return out;
}

}  // namespace statedict::inline v0::detail
