// Shared helpers of the interop tests of the OLMo mapped safetensors, ColossalAI and fairscale
// layouts: a description as `inspect --json` prints it (to compare with a fixture manifest through
// cli_util.hpp's compare_with_manifest), typed key paths in a skeleton, running the Python
// reference checkers (tests/python/layout_check.py), and error ids of a throwing call.
#pragma once

#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "cli_util.hpp"
#include "test_util.hpp"

namespace layout_test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace statedict;

/// Decimal digits of a little-endian two's complement integer (Python's int beyond int64).
inline std::string decimal(std::vector<std::uint8_t> b) {
  const bool neg = !b.empty() && (b.back() & 0x80U);
  if (neg) {
    unsigned carry = 1;
    for (auto& x : b) {
      const unsigned v = static_cast<unsigned>(static_cast<std::uint8_t>(~x)) + carry;
      x = static_cast<std::uint8_t>(v & 0xffU);
      carry = v >> 8;
    }
  }
  std::string digits;
  std::vector<std::uint8_t> big(b.rbegin(), b.rend());
  while (std::any_of(big.begin(), big.end(), [](std::uint8_t x) { return x != 0; })) {
    unsigned rem = 0;
    for (auto& x : big) {
      const unsigned cur = rem * 256 + x;
      x = static_cast<std::uint8_t>(cur / 10);
      rem = cur % 10;
    }
    digits += static_cast<char>('0' + rem);
  }
  if (digits.empty()) digits = "0";
  if (neg) digits += '-';
  return {digits.rbegin(), digits.rend()};
}

/// A value as inspect --json prints it; ints beyond int64 as the manifests write them.
inline json leaf_json(const Value& v) {
  if (v.is_object() && v.as_object().qualified() == "builtins.int" && v.as_object().args.size() == 1 &&
      v.as_object().args[0].is_bytes())
    return json{{"int", decimal(v.as_object().args[0].as_bytes().data)}};
  return json(value_json(v));
}

/// The description as `inspect --json --hash` would print it: tensors (tied names included) with
/// their SHA-256, values, aliases.
inline json description_json(const ShardedCheckpoint& in) {
  const auto ties = in.skeleton.is_null() ? std::vector<formats::Tie>{} : formats::tied_names(in.skeleton);
  const auto values = in.skeleton.is_null() ? std::vector<std::pair<std::string, Value>>{} : skeleton_values(in.skeleton);
  const ShardedCheckpoint ck = formats::expand_ties(in, ties);
  const auto hashes = sha256_tensors(ck);
  json out{{"tensors", json::object()}, {"values", json::object()}, {"aliases", json::object()}};
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    const auto& t = ck.tensors[i];
    out["tensors"][t.name] = json{{"dtype", std::string(name(t.dtype))}, {"shape", t.shape}, {"sha256", hashes[i].second}};
  }
  for (const auto& [n, v] : values) out["values"][n] = leaf_json(v);
  for (const auto& t : ties) out["aliases"][t.name] = t.target;
  return out;
}

/// Problems between a description and a manifest (tensors bit for bit, values type-aware, every
/// manifest alias tied), ints beyond int64 compared exactly.
inline std::vector<std::string> compare(const ShardedCheckpoint& ck, const json& manifest) {
  cli_test::compare_options o;
  o.lenient_objects = false;
  return cli_test::compare_with_manifest(description_json(ck), manifest, o);
}

/// The node at a typed key path (JSON strings are str keys, JSON integers int keys) in a skeleton
/// document, or nullopt.
inline std::optional<json> skeleton_node(const json& skeleton, const json& keys) {
  const json* node = &skeleton.at("root");
  for (const json& k : keys) {
    if (!node->is_object() || !node->contains("dict")) return std::nullopt;
    const json* next = nullptr;
    for (const json& pair : (*node)["dict"])
      if (pair[0] == k && pair[0].is_string() == k.is_string()) next = &pair[1];
    if (!next) return std::nullopt;
    node = next;
  }
  return *node;
}

using statedict_test::error_of;

/// Runs tests/python/layout_check.py with `args`; its output and exit code.
inline cli_test::run_result layout_check(const std::vector<std::string>& args) {
  std::vector<std::string> argv{cli_test::python, (cli_test::source_dir / "tests/python/layout_check.py").string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return cli_test::run(argv);
}

}  // namespace layout_test
