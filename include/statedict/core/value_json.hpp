// statedict: a non-tensor leaf of a state dict as JSON, the form `inspect --json` prints and
// `verify` quotes.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "value.hpp"

namespace statedict::inline v0 {

namespace detail {

/// Python's repr of a str: single quotes unless the text has one and no double quote, escapes for
/// the quote, backslash, \n \r \t and other control characters (bytes that are not UTF-8 as \xNN).
inline void repr_str(std::string& o, std::string_view s, bool is_bytes) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char q = dq ? '"' : '\'';
  if (is_bytes) o += 'b';
  o += q;
  static constexpr char hex[] = "0123456789abcdef";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == q || ch == '\\') {
      o += '\\';
      o += ch;
    } else if (ch == '\n') {
      o += "\\n";
    } else if (ch == '\r') {
      o += "\\r";
    } else if (ch == '\t') {
      o += "\\t";
    } else if (c < 0x20 || c == 0x7f || (is_bytes && c >= 0x80)) {
      o += "\\x";
      o += hex[c >> 4];
      o += hex[c & 15];
    } else {
      o += ch;
    }
  }
  o += q;
}

/// Python's repr of a float: the shortest digits that read back, with ".0" when they look like
/// an int; nan, inf, -inf.
inline std::string repr_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string t = nlohmann::json(d).dump();
  if (t.find_first_of(".eE") == std::string::npos) t += ".0";
  return t;
}

inline void repr(std::string& o, const Value& v, std::size_t depth);

inline void repr_seq(std::string& o, const List& l, std::size_t depth, const char* open, const char* close, bool tuple) {
  o += open;
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (i) o += ", ";
    repr(o, l[i], depth + 1);
  }
  if (tuple && l.size() == 1) o += ',';
  o += close;
}

inline void repr_dict(std::string& o, const Dict& d, std::size_t depth) {
  o += '{';
  bool first = true;
  for (const auto& [k, x] : d.items()) {
    if (!first) o += ", ";
    first = false;
    if (k.is_int()) o += std::to_string(k.as_int());
    else repr_str(o, k.as_string(), false);
    o += ": ";
    repr(o, x, depth + 1);
  }
  o += '}';
}

/// An object as Python would spell its construction: `module.Name(attr=value, ...)` for an
/// instance whose only state is its attribute dict, `module.name(args...)` for a call, with its
/// state and items after it; `module.name` for the class or function itself.
inline void repr_object(std::string& o, const Object& ob, std::size_t depth) {
  o += ob.qualified();
  if (ob.how == object_build::global) return;
  const bool attrs = ob.args.empty() && ob.items.empty() && ob.state.size() == 1 && ob.state[0].is_dict() &&
                     std::all_of(ob.state[0].as_dict().begin(), ob.state[0].as_dict().end(), [](const auto& kv) { return kv.first.is_string(); });
  if (attrs) {
    o += '(';
    bool first = true;
    for (const auto& [k, x] : ob.state[0].as_dict().items()) {
      if (!first) o += ", ";
      first = false;
      o += k.as_string();
      o += '=';
      repr(o, x, depth + 1);
    }
    o += ')';
    return;
  }
  repr_seq(o, ob.args, depth, "(", ")", false);
  for (const Value& s : ob.state) {
    o += " <state ";
    repr(o, s, depth + 1);
    o += '>';
  }
  if (!ob.items.empty()) {
    o += " <items ";
    repr_seq(o, ob.items, depth, "[", "]", false);
    o += '>';
  }
}

inline void repr(std::string& o, const Value& v, std::size_t depth) {
  if (depth > 64 || o.size() > 100000) {  // a readable line, not the whole of a hostile tree
    o += "...";
    return;
  }
  switch (v.kind()) {
    case value_kind::none: o += "None"; return;
    case value_kind::boolean: o += v.as_bool() ? "True" : "False"; return;
    case value_kind::integer: o += std::to_string(v.as_int()); return;
    case value_kind::floating: o += repr_float(v.as_double()); return;
    case value_kind::string: repr_str(o, v.as_string(), false); return;
    case value_kind::bytes: {
      const auto& b = v.as_bytes().data;
      repr_str(o, std::string_view(reinterpret_cast<const char*>(b.data()), b.size()), true);
      return;
    }
    case value_kind::list: repr_seq(o, v.as_list(), depth, "[", "]", false); return;
    case value_kind::tuple: repr_seq(o, v.as_list(), depth, "(", ")", true); return;
    case value_kind::dict: repr_dict(o, v.as_dict(), depth); return;
    case value_kind::object: repr_object(o, v.as_object(), depth); return;
    case value_kind::tensor: {
      o += "tensor(";
      o += name(v.as_tensor().dtype());
      o += ' ';
      o += to_string(v.as_tensor().shape());
      o += ')';
      return;
    }
  }
}

}  // namespace detail

/// `v` written as Python writes values (`argparse.Namespace(lr=0.1, arch='transformer')`,
/// `(0.9, 0.98)`, `b'\x00'`), objects spelled as calls of their class; nesting below 64 levels
/// and text past 100,000 characters become "...". For people (inspect), not to be parsed.
inline std::string value_repr(const Value& v) {
  std::string o;
  detail::repr(o, v, 0);
  return o;
}

/// `v` as JSON: None, bool, int, float (non-finite as the strings "nan", "inf", "-inf"), str;
/// bytes as {"bytes_hex": ...}; lists and tuples as arrays; an empty dict as {}; an opaque object
/// as {"object": "module.name", "repr": value_repr(v)}; a tensor as {"tensor": "[shape]"}.
inline nlohmann::ordered_json value_json(const Value& v) {
  using K = value_kind;
  switch (v.kind()) {
    case K::none: return nullptr;
    case K::boolean: return v.as_bool();
    case K::integer: return v.as_int();
    case K::floating: {
      const double d = v.as_double();
      if (std::isnan(d)) return "nan";
      if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
      return d;
    }
    case K::string: return v.as_string();
    case K::bytes: {
      static constexpr char hex[] = "0123456789abcdef";
      std::string h;
      for (auto b : v.as_bytes().data) {
        h += hex[b >> 4];
        h += hex[b & 15];
      }
      return nlohmann::ordered_json{{"bytes_hex", h}};
    }
    case K::list:
    case K::tuple: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& x : v.as_list()) a.push_back(value_json(x));
      return a;
    }
    case K::dict: return nlohmann::ordered_json::object();
    case K::object: return nlohmann::ordered_json{{"object", v.as_object().qualified()}, {"repr", value_repr(v)}};
    case K::tensor: return nlohmann::ordered_json{{"tensor", to_string(v.as_tensor().shape())}};
  }
  return nullptr;
}

}  // namespace statedict::inline v0
