// statedict: a non-tensor leaf of a state dict as JSON, the form `inspect --json` prints and
// `verify` quotes.
// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "value.hpp"

namespace statedict::inline v0 {

/// `v` as JSON: None, bool, int, float (non-finite as the strings "nan", "inf", "-inf"), str;
/// bytes as {"bytes_hex": ...}; lists and tuples as arrays; an empty dict as {}; an opaque object
/// as {"object": "module.name"}; a tensor as {"tensor": "[shape]"}.
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
    case K::object: return nlohmann::ordered_json{{"object", v.as_object().qualified()}};
    case K::tensor: return nlohmann::ordered_json{{"tensor", to_string(v.as_tensor().shape())}};
  }
  return nullptr;
}

}  // namespace statedict::inline v0
