// statedict: flatten a Value tree into named tensors plus a JSON skeleton, and back.
// SPDX-License-Identifier: MIT
//
// `flatten(tree)` gives an ordered `name -> TensorView` list (the tensors, in tree pre-order) and a
// JSON skeleton holding everything else: container kinds, key types, non-tensor leaves, and which
// tensors are the same view (aliases) or views into another tensor's elements (view_of).
// `unflatten(tensors, skeleton)` gives back a tree equal to the original, for every tree. The
// skeleton format, the naming rule and the alias rule are documented in docs/flatten.md; in short:
//
//   {"statedict_skeleton": 1, "root": NODE}
//   NODE := null | true | false | <JSON integer> | <finite JSON float> | "<string>"
//         | {"float": "nan" | "inf" | "-inf" | "0x<16 hex digits>"} | {"bytes": "<base64>"}
//         | {"str_bytes": "<base64>"}          (a string that is not valid UTF-8; also as a dict KEY)
//         | {"tensor": NAME, "dtype": "F32", "shape": [..]}
//         | {"alias": NAME}
//         | {"view_of": NAME, "dtype": "F32", "offset": k, "shape": [..], "strides": [..]}
//         | {"dict": [[KEY, NODE], ...]} | {"list": [NODE...]} | {"tuple": [NODE...]}
//         | {"object": {"module": M, "name": N, "how": "global"|"reduce"|"newobj",
//                       "args": [NODE...], "state": [NODE...], "items": [NODE...]}}
//
// A skeleton is input from files: every function that reads one validates it and throws a
// statedict error naming the node (never crashes); all walks are iterative, so nesting depth is
// bounded only by memory.
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

#include "dtype.hpp"
#include "error.hpp"
#include "hash_index.hpp"
#include "shape.hpp"
#include "tensor.hpp"
#include "value.hpp"
#include "visit.hpp"

namespace statedict::inline v0 {

/// Error ids of flatten / unflatten (200-219).
namespace errors {
// clang-format off
inline constexpr error_id flat_malformed       {200, error_kind::format,      "flatten.malformed"};        ///< skeleton JSON does not follow the format
inline constexpr error_id flat_version         {201, error_kind::unsupported, "flatten.version"};          ///< "statedict_skeleton" is not 1
inline constexpr error_id flat_missing_tensor  {202, error_kind::key,         "flatten.missing_tensor"};   ///< skeleton names a tensor the map lacks
inline constexpr error_id flat_extra_tensor    {203, error_kind::key,         "flatten.extra_tensor"};     ///< the map has a tensor no tensor node declares
inline constexpr error_id flat_tensor_dtype    {204, error_kind::type,        "flatten.tensor_dtype"};     ///< map tensor's dtype differs from the skeleton's
inline constexpr error_id flat_tensor_shape    {205, error_kind::shape,       "flatten.tensor_shape"};     ///< map tensor's shape differs from the skeleton's
inline constexpr error_id flat_duplicate_name  {206, error_kind::key,         "flatten.duplicate_name"};   ///< a name declared twice, or twice in the map
inline constexpr error_id flat_bad_alias       {207, error_kind::format,      "flatten.bad_alias"};        ///< alias / view_of target not declared earlier
inline constexpr error_id flat_view_bounds     {208, error_kind::format,      "flatten.view_out_of_bounds"}; ///< view_of reaches outside its base
inline constexpr error_id flat_view_base       {209, error_kind::format,      "flatten.view_base"};        ///< view_of base not contiguous, or another dtype
inline constexpr error_id flat_duplicate_key   {210, error_kind::format,      "flatten.duplicate_key"};    ///< a skeleton dict repeats a key
// clang-format on
}  // namespace errors

/// Tensors by name, in order.
using NamedTensors = std::vector<std::pair<std::string, TensorView>>;

namespace detail {
struct skeleton_tape;
}

/// A skeleton document (docs/flatten.md). One made by `flatten` is held in a compact form (a node
/// array and a string pool, a few allocations in all) that `unflatten` reads directly; its JSON
/// DOM is built only when something asks for it (`json()`, the implicit conversion, `dump()`),
/// once, safely from several threads. One made from JSON (read from a file, or built by hand) is
/// that JSON. Either way `json()` is the same document and `unflatten` gives the same tree.
class Skeleton {
 public:
  /// The null skeleton: a flat dict of the map's tensors in order.
  Skeleton() = default;
  /// A skeleton document (validated by whatever reads it, as any skeleton).
  Skeleton(nlohmann::json doc) : doc_(std::move(doc)) {}  // NOLINT(google-explicit-constructor)
  explicit Skeleton(std::shared_ptr<const detail::skeleton_tape> tape) : tape_(std::move(tape)) {}

  Skeleton(const Skeleton& o) : tape_(o.tape_), doc_(o.tape_ ? nlohmann::json() : o.doc_) {}
  Skeleton(Skeleton&& o) noexcept
      : tape_(std::move(o.tape_)), doc_(std::move(o.doc_)), cache_(o.cache_.exchange(nullptr)) {}
  Skeleton& operator=(const Skeleton& o) {
    if (this != &o) *this = Skeleton(o);
    return *this;
  }
  Skeleton& operator=(Skeleton&& o) noexcept {
    if (this != &o) {
      delete cache_.exchange(o.cache_.exchange(nullptr));
      tape_ = std::move(o.tape_);
      doc_ = std::move(o.doc_);
    }
    return *this;
  }
  ~Skeleton() { delete cache_.load(); }

  /// The document (built from the compact form on first use).
  [[nodiscard]] const nlohmann::json& json() const;
  operator const nlohmann::json&() const { return json(); }  // NOLINT(google-explicit-constructor)
  /// The document, for editing (the compact form is dropped).
  nlohmann::json& mutable_json();
  /// The document, moved out (built without keeping a copy when it was not built yet).
  [[nodiscard]] nlohmann::json take_json() &&;
  /// True for the null skeleton.
  [[nodiscard]] bool is_null() const noexcept { return !tape_ && doc_.is_null(); }
  /// The compact JSON text, `skeleton_dump(json())` byte for byte (written from the compact form
  /// without the document when it holds no opaque object).
  [[nodiscard]] std::string dump() const;
  /// The compact form, when this skeleton was made by flatten and not edited since.
  [[nodiscard]] const detail::skeleton_tape* tape() const noexcept { return tape_.get(); }

  friend bool operator==(const Skeleton& a, const Skeleton& b) { return a.json() == b.json(); }
  friend bool operator==(const Skeleton& a, const nlohmann::json& b) { return a.json() == b; }

 private:
  std::shared_ptr<const detail::skeleton_tape> tape_;
  nlohmann::json doc_;                                   // when there is no tape
  mutable std::atomic<nlohmann::json*> cache_{nullptr};  // the tape's document, once built
};

/// What `flatten` returns: the tensors (unique names, tree pre-order) and the skeleton.
struct FlatStateDict {
  NamedTensors tensors;
  Skeleton skeleton;

  /// The tensor named `name`, or nullptr (a linear search).
  [[nodiscard]] const TensorView* find(std::string_view name) const {
    for (const auto& [n, v] : tensors)
      if (n == name) return &v;
    return nullptr;
  }
};

/// Where a `view_of` node's elements are: element offset, shape and strides over the row-major
/// flat index of its (contiguous) base tensor.
struct ViewSpec {
  statedict::dtype dtype = statedict::dtype::F32;
  dim_t offset = 0;
  shape_t shape;
  shape_t strides;
  friend bool operator==(const ViewSpec&, const ViewSpec&) = default;
};

/// The view `spec` of `base`. Throws flat_view_base when base is not contiguous or has another
/// dtype, flat_view_bounds when an element would fall outside base.
inline TensorView view_into(const TensorView& base, const ViewSpec& spec) {
  if (spec.dtype != base.dtype())
    throw_error(errors::flat_view_base, "a " + std::string(name(spec.dtype)) + " view of a " +
                                            std::string(name(base.dtype())) + " tensor");
  if (!base.is_contiguous())
    throw_error(errors::flat_view_base, "the base tensor is not contiguous (strides " + to_string(base.strides()) + ")");
  if (spec.shape.size() != spec.strides.size())
    throw_error(errors::flat_view_bounds, "shape " + to_string(spec.shape) + " and strides " + to_string(spec.strides) +
                                              " have different lengths");
  auto bounds = [&](const std::string& why) {
    throw_error(errors::flat_view_bounds, "view at offset " + std::to_string(spec.offset) + " with shape " +
                                              to_string(spec.shape) + " and strides " + to_string(spec.strides) + " " +
                                              why + " of a base of " + std::to_string(base.numel()) + " elements");
  };
  if (spec.offset < 0) bounds("starts before the start");
  for (std::size_t i = 0; i < spec.shape.size(); ++i)
    if (spec.shape[i] < 0 || spec.strides[i] < 0) bounds("has a negative size or stride: it is outside");
  bool empty = false;
  for (dim_t d : spec.shape) empty = empty || d == 0;
  const auto off = static_cast<std::uint64_t>(spec.offset);
  if (empty) {
    if (off > base.numel()) bounds("starts past the end");
  } else {
    std::uint64_t last = off;
    bool overflow = false;
    for (std::size_t i = 0; i < spec.shape.size() && !overflow; ++i) {
      std::uint64_t step = 0;
      overflow = __builtin_mul_overflow(static_cast<std::uint64_t>(spec.shape[i] - 1),
                                        static_cast<std::uint64_t>(spec.strides[i]), &step) ||
                 __builtin_add_overflow(last, step, &last);
    }
    if (overflow || last >= base.numel()) bounds("reaches past the end");
  }
  const std::byte* data = base.data() == nullptr ? nullptr : base.data() + off * base.itemsize();
  return TensorView(spec.dtype, spec.shape, spec.strides, data, base.owner());
}

// ================================================================================================
// Encoding details shared by flatten and unflatten.

namespace detail {

using json = nlohmann::json;

inline constexpr char b64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (RFC 4648 section 4).
inline std::string base64_encode(const std::uint8_t* p, std::size_t n) {
  std::string out;
  out.reserve((n + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (std::uint32_t{p[i + 1]} << 8) | p[i + 2];
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += b64_alphabet[(v >> 6) & 63];
    out += b64_alphabet[v & 63];
  }
  if (n - i == 1) {
    const std::uint32_t v = std::uint32_t{p[i]} << 16;
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += "==";
  } else if (n - i == 2) {
    const std::uint32_t v = (std::uint32_t{p[i]} << 16) | (std::uint32_t{p[i + 1]} << 8);
    out += b64_alphabet[(v >> 18) & 63];
    out += b64_alphabet[(v >> 12) & 63];
    out += b64_alphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

inline std::string base64_encode(std::string_view s) {
  return base64_encode(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
}

/// Strict base64 decoding: length a multiple of 4, '=' only as final padding, no whitespace, and
/// unused bits zero (so every byte string has exactly one encoding). Returns false on bad input.
inline bool base64_decode(std::string_view s, std::vector<std::uint8_t>& out) {
  out.clear();
  if (s.size() % 4 != 0) return false;
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.reserve(s.size() / 4 * 3);
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s[i + static_cast<std::size_t>(k)];
      if (c == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad) return false;  // data after padding
      v[k] = val(c);
      if (v[k] < 0) return false;
    }
    const auto w = (static_cast<std::uint32_t>(v[0]) << 18) | (static_cast<std::uint32_t>(v[1]) << 12) |
                   (static_cast<std::uint32_t>(v[2]) << 6) | static_cast<std::uint32_t>(v[3]);
    out.push_back(static_cast<std::uint8_t>(w >> 16));
    if (pad == 2) {
      if ((w & 0xffffU) != 0) return false;
      break;
    }
    out.push_back(static_cast<std::uint8_t>((w >> 8) & 0xffU));
    if (pad == 1) {
      if ((w & 0xffU) != 0) return false;
      break;
    }
    out.push_back(static_cast<std::uint8_t>(w & 0xffU));
  }
  return true;
}

/// Length of the well-formed UTF-8 sequence at s[i] (no overlong forms, no surrogates, at most
/// U+10FFFF), or 0 when none starts there.
inline std::size_t utf8_seq(std::string_view s, std::size_t i) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  const unsigned c = p[i];
  if (c < 0x80) return 1;
  std::size_t len = 0;
  unsigned lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) len = 2;
  else if (c == 0xe0) len = 3, lo = 0xa0;
  else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
  else if (c == 0xed) len = 3, hi = 0x9f;
  else if (c == 0xf0) len = 4, lo = 0x90;
  else if (c >= 0xf1 && c <= 0xf3) len = 4;
  else if (c == 0xf4) len = 4, hi = 0x8f;
  else return 0;
  if (n - i < len) return 0;
  if (p[i + 1] < lo || p[i + 1] > hi) return 0;
  for (std::size_t k = 2; k < len; ++k)
    if (p[i + k] < 0x80 || p[i + k] > 0xbf) return 0;
  return len;
}

/// Well-formed UTF-8: what a JSON writer such as nlohmann::json::dump accepts.
inline bool valid_utf8(std::string_view s) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {  // ASCII fast path
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w & 0x8080808080808080ULL) break;
  }
  while (i < n) {
    const std::size_t len = utf8_seq(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

/// Whether every byte of `s` is below 0x80, 8 bytes a step.
inline bool is_ascii(std::string_view s) noexcept {
  std::uint64_t any = 0;
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    any |= w;
  }
  for (; i < s.size(); ++i) any |= static_cast<unsigned char>(s[i]);
  return (any & 0x8080808080808080ULL) == 0;
}

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

inline json view_node(std::string_view base, const ViewSpec& s) {
  if (s.shape.size() != s.strides.size()) throw_error(errors::flat_view_bounds, "a view's shape and strides have different lengths");
  return view_node(base, s.dtype, s.offset, s.shape.data(), s.strides.data(), s.shape.size());
}

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

/// Appends `s` as a JSON string the way nlohmann::json::dump() (and serde_json) write valid UTF-8:
/// `"` and `\` escaped, control characters as \b \t \n \f \r or \u00xx (lower-case hex),
/// everything else raw. The caller checks that `s` is UTF-8.
inline void append_json_string(std::string& out, std::string_view s) {
  // Bytes each input byte becomes: 1, 2 (\" \\ \b \t \n \f \r) or 6 (\u00xx).
  static constexpr auto width = [] {
    std::array<std::uint8_t, 256> w{};
    for (std::size_t c = 0; c < 256; ++c) w[c] = c < 0x20 ? 6 : 1;
    for (const char c : {'"', '\\', '\b', '\t', '\n', '\f', '\r'}) w[static_cast<unsigned char>(c)] = 2;
    return w;
  }();
  static constexpr char hex[] = "0123456789abcdef";
  std::size_t n = s.size() + 2;
  for (const char ch : s) n += width[static_cast<unsigned char>(ch)] - 1U;
  const std::size_t at = out.size();
  out.resize(at + n);  // one growth, then raw writes: skeletons in metadata are mostly quotes
  char* w = out.data() + at;
  *w++ = '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (width[c] == 1) {
      *w++ = ch;
      continue;
    }
    *w++ = '\\';
    switch (c) {
      case '"': *w++ = '"'; break;
      case '\\': *w++ = '\\'; break;
      case '\b': *w++ = 'b'; break;
      case '\t': *w++ = 't'; break;
      case '\n': *w++ = 'n'; break;
      case '\f': *w++ = 'f'; break;
      case '\r': *w++ = 'r'; break;
      default:
        *w++ = 'u';
        *w++ = '0';
        *w++ = '0';
        *w++ = hex[c >> 4];
        *w++ = hex[c & 15];
    }
  }
  *w = '"';
}

inline void append_int(std::string& out, std::int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, static_cast<std::size_t>(r.ptr - buf));
}

inline void append_uint(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, static_cast<std::size_t>(r.ptr - buf));
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

// ------------------------------------------------------------------------------------------------
// An open-addressing hash index over strings owned elsewhere (no allocation per entry).

class name_index {
 public:
  static constexpr std::uint32_t npos = UINT32_MAX;

  void reserve(std::size_t n) {
    keys_.reserve(n);
    values_.reserve(n);
    if (n * 2 > slots_.size()) rehash(n * 2);
  }
  [[nodiscard]] static std::size_t hash(std::string_view s) noexcept { return std::hash<std::string_view>{}(s); }
  /// Adds `s` with `value` and returns npos, or returns the value `s` already has.
  std::uint32_t insert(std::string_view s, std::uint32_t value) { return insert(s, value, hash(s)); }
  /// insert, given `h == hash(s)`.
  std::uint32_t insert(std::string_view s, std::uint32_t value, std::size_t h) {
    if ((keys_.size() + 1) * 2 > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t p = h & mask;; p = (p + 1) & mask) {
      slot& sl = slots_[p];
      if (sl.entry == npos) {
        sl = {static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(keys_.size())};
        keys_.push_back(s);
        values_.push_back(value);
        return npos;
      }
      if (sl.hash == static_cast<std::uint32_t>(h) && keys_[sl.entry] == s) return values_[sl.entry];
    }
  }
  /// The value of `s`, or npos.
  [[nodiscard]] std::uint32_t find(std::string_view s) const {
    if (slots_.empty()) return npos;
    const std::size_t h = std::hash<std::string_view>{}(s);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t p = h & mask;; p = (p + 1) & mask) {
      const slot& sl = slots_[p];
      if (sl.entry == npos) return npos;
      if (sl.hash == static_cast<std::uint32_t>(h) && keys_[sl.entry] == s) return values_[sl.entry];
    }
  }

 private:
  struct slot {
    std::uint32_t hash;
    std::uint32_t entry;
  };
  void rehash(std::size_t want) {
    std::size_t cap = 16;
    while (cap < want) cap *= 2;
    slots_.assign(cap, slot{0, npos});
    const std::size_t mask = cap - 1;
    for (std::uint32_t i = 0; i < keys_.size(); ++i) {
      const std::size_t h = std::hash<std::string_view>{}(keys_[i]);
      std::size_t p = h & mask;
      while (slots_[p].entry != npos) p = (p + 1) & mask;
      slots_[p] = {static_cast<std::uint32_t>(h), i};
    }
  }
  std::vector<slot> slots_;
  std::vector<std::string_view> keys_;
  std::vector<std::uint32_t> values_;
};

// ------------------------------------------------------------------------------------------------
// Names

/// A string key is written bare in a quoted name unless it is empty, contains '.' or '[', looks
/// like an int (optional '-', then digits only), or is not valid UTF-8.
inline bool bare_segment(const Key& k) {
  if (k.is_int()) return true;
  const std::string& s = k.as_string();
  if (s.empty() || !valid_utf8(s)) return false;
  if (s.find_first_of(".[") != std::string::npos) return false;
  std::size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return true;
  for (; i < s.size(); ++i)
    if (s[i] < '0' || s[i] > '9') return true;
  return false;
}

/// The quoted name of a path, used where dotted names collide (or are not valid UTF-8): segments
/// joined by '.', a string key that is not bare written as `["<JSON-escaped string>"]` with no '.'
/// before it (bytes that are not UTF-8 written as \xNN, so names are always valid UTF-8).
/// `state.1.exp_avg` (int key 1) vs `state["1"].exp_avg` (string key "1").
inline std::string quoted_name(const Path& p) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (bare_segment(p[i])) {
      if (i) out += '.';
      out += p[i].str();
      continue;
    }
    out += "[\"";
    const std::string& str = p[i].as_string();
    for (std::size_t j = 0; j < str.size();) {
      const auto c = static_cast<unsigned char>(str[j]);
      const std::size_t len = utf8_seq(str, j);
      if (len == 0) {  // a byte that is not UTF-8: \xNN keeps the name valid UTF-8
        out += "\\x";
        out += hex[c >> 4];
        out += hex[c & 15];
        ++j;
        continue;
      }
      if (c == '"' || c == '\\') {
        out += '\\';
        out += str[j];
      } else if (c < 0x20) {
        out += "\\u00";
        out += hex[c >> 4];
        out += hex[c & 15];
      } else {
        out.append(str, j, len);
      }
      j += len;
    }
    out += "\"]";
  }
  return out;
}

/// mark_repeats' default hash: 8 bytes a step, each mixed by a multiply and a shift. Its only
/// job is to spread names over the radix sort's buckets (equal hashes are compared by name);
/// std::hash spends about three times as long on a typical 30-byte tensor name.
struct name_hash {
  std::size_t operator()(std::string_view s) const noexcept {
    std::uint64_t h = (s.size() + 1) * 0x9e3779b97f4a7c15ULL;
    const char* p = s.data();
    std::size_t n = s.size();
    auto step = [&h](std::uint64_t w) {
      h = (h ^ w) * 0xbf58476d1ce4e5b9ULL;
      h ^= h >> 31;
    };
    for (; n >= 8; p += 8, n -= 8) {
      std::uint64_t w;
      std::memcpy(&w, p, 8);
      step(w);
    }
    if (n != 0) {
      std::uint64_t w = 0;
      std::memcpy(&w, p, n);
      step(w);
    }
    return static_cast<std::size_t>(h);
  }
};

/// Sets `repeated[i]` for every i < n whose `name(i)` equals another's; returns whether any does.
/// Sorts (hash, i) pairs by hash (radix, in sequential passes: a hash table of 100k names costs a
/// cache miss per name), then compares names only within runs of equal hashes, sorted by name
/// there: O(n) for distinct hashes and O(n log n) whatever the names.
template <class Name, class Hash = name_hash>
bool mark_repeats(std::size_t n, Name&& name, std::vector<std::uint8_t>& repeated, Hash hash = {}) {
  if (n < 2) return false;
  if (n > UINT32_MAX) throw_error(errors::out_of_range, "more than 2^32 names");
  std::vector<std::uint64_t> keyed(n);
  for (std::size_t i = 0; i < n; ++i)
    keyed[i] = static_cast<std::uint64_t>(hash_index::mix(hash(name(i)))) << 32 | i;
  // LSD radix sort on the upper 32 bits, 11 bits a pass.
  constexpr unsigned bits = 11;
  constexpr std::size_t buckets = std::size_t{1} << bits;
  std::vector<std::size_t> count(3 * buckets, 0);
  auto digit = [](std::uint64_t k, unsigned d) { return static_cast<std::size_t>(k >> (32 + bits * d)) & (buckets - 1); };
  for (const std::uint64_t k : keyed)
    for (unsigned d = 0; d < 3; ++d) ++count[d * buckets + digit(k, d)];
  std::vector<std::uint64_t> tmp(n);
  for (unsigned d = 0; d < 3; ++d) {
    std::size_t* c = count.data() + d * buckets;
    std::size_t sum = 0;
    for (std::size_t b = 0; b < buckets; ++b) sum += std::exchange(c[b], sum);
    for (const std::uint64_t k : keyed) tmp[c[digit(k, d)]++] = k;
    keyed.swap(tmp);
  }
  bool any = false;
  std::vector<std::uint32_t> run;
  for (std::size_t a = 0; a < n;) {
    std::size_t b = a + 1;
    while (b < n && keyed[b] >> 32 == keyed[a] >> 32) ++b;
    if (b - a > 1) {
      run.clear();
      for (std::size_t k = a; k < b; ++k) run.push_back(static_cast<std::uint32_t>(keyed[k]));
      std::sort(run.begin(), run.end(), [&](std::uint32_t x, std::uint32_t y) { return name(x) < name(y); });
      for (std::size_t k = 1; k < run.size(); ++k)
        if (name(run[k]) == name(run[k - 1])) repeated[run[k]] = repeated[run[k - 1]] = 1, any = true;
    }
    a = b;
  }
  return any;
}

/// Assigns unique names to a group of n nodes in pre-order (docs/flatten.md, "Names"):
///   1. the dotted name `dotted(i)`, when no other node of the group has the same dotted name and
///      it is valid UTF-8;
///   2. otherwise the quoted name `quoted(i)`;
///   3. either way, if the name is already taken (by a fixed name or an earlier node), the first
///      free of `NAME#2`, `NAME#3`, ...
/// `fixed[i]`, when given and non-null, is a name the node already has (tensor nodes of a skeleton).
/// `ascii`: the caller knows every dotted name is ASCII (so valid UTF-8).
/// Returns nullopt when the names are simply the dotted names (all unique, none fixed).
template <class Dotted, class Quoted>
std::optional<std::vector<std::string>> assign_names(std::size_t n, Dotted&& dotted, const std::vector<const std::string*>& fixed,
                                                     Quoted&& quoted, bool ascii = false) {
  std::vector<std::uint8_t> collides(n, 0);  // or is not valid UTF-8: either way, quote it
  bool any = mark_repeats(n, dotted, collides);
  for (std::size_t i = 0; i < n && !ascii; ++i)
    if (!valid_utf8(dotted(i))) collides[i] = 1, any = true;
  if (!any && fixed.empty()) return std::nullopt;
  std::unordered_set<std::string> used;
  used.reserve(n * 2);
  for (const std::string* f : fixed)
    if (f) used.insert(*f);
  std::vector<std::string> names(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (i < fixed.size() && fixed[i]) {
      names[i] = *fixed[i];
      continue;
    }
    std::string cand = collides[i] ? std::string(quoted(i)) : std::string(dotted(i));
    if (used.count(cand)) {
      for (std::uint64_t k = 2;; ++k) {
        std::string c = cand + "#" + std::to_string(k);
        if (!used.count(c)) {
          cand = std::move(c);
          break;
        }
      }
    }
    used.insert(cand);
    names[i] = std::move(cand);
  }
  return names;
}

/// Stable sort by address: equal addresses keep their pre-order. Leaves usually come in a few
/// ascending runs (a file's storages in first-use order: one run; a model and its optimizer
/// state carved from two buffers: two), which are merged; otherwise an LSD radix sort, a byte at
/// a time, over the bytes in which the addresses differ.
inline void address_sort(std::vector<std::pair<std::uintptr_t, std::uint32_t>>& v) {
  using entry = std::pair<std::uintptr_t, std::uint32_t>;
  constexpr std::size_t max_runs = 8;
  std::array<std::size_t, max_runs + 1> run{};
  std::size_t runs = 1;
  std::uintptr_t differ = 0;
  for (std::size_t i = 1; i < v.size(); ++i) {
    differ |= v[i].first ^ v[0].first;
    if (v[i].first < v[i - 1].first) {
      if (runs < max_runs) run[runs] = i;
      ++runs;
    }
  }
  if (runs == 1) return;
  auto by_address = [](const entry& a, const entry& b) { return a.first < b.first; };
  if (runs <= max_runs) {
    // Left to right: everything merged so far precedes the next run in pre-order, and
    // inplace_merge keeps the first range's elements first among equals.
    run[runs] = v.size();
    for (std::size_t r = 1; r < runs; ++r)
      std::inplace_merge(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(run[r]),
                         v.begin() + static_cast<std::ptrdiff_t>(run[r + 1]), by_address);
    return;
  }
  std::vector<entry> tmp(v.size());
  for (std::size_t d = 0; d < sizeof(std::uintptr_t); ++d) {
    if (((differ >> (8 * d)) & 255U) == 0) continue;  // every address has the same byte here
    std::array<std::size_t, 256> count{};
    for (const auto& e : v) ++count[(e.first >> (8 * d)) & 255U];
    std::size_t sum = 0;
    for (auto& x : count) sum += std::exchange(x, sum);
    for (const auto& e : v) tmp[count[(e.first >> (8 * d)) & 255U]++] = e;
    v.swap(tmp);
  }
}

// ------------------------------------------------------------------------------------------------
// flatten

/// flatten's current dotted path: appends and truncations inline (std::string's are calls, and
/// a walk makes several per node).
class path_buffer {
 public:
  [[nodiscard]] std::size_t size() const noexcept { return len_; }
  [[nodiscard]] std::string_view view() const noexcept { return {buf_.get(), len_}; }
  void truncate(std::size_t n) noexcept { len_ = std::min(n, len_); }
  void push(char c) {
    room(1);
    buf_[len_++] = c;
  }
  void append(std::string_view s) {
    if (s.empty()) return;
    room(s.size());
    std::memcpy(buf_.get() + len_, s.data(), s.size());
    len_ += s.size();
  }
  void append_int(std::int64_t v) {
    room(20);  // "-9223372036854775808"
    const auto r = std::to_chars(buf_.get() + len_, buf_.get() + len_ + 20, v);
    len_ = static_cast<std::size_t>(r.ptr - buf_.get());
  }

 private:
  void room(std::size_t more) {
    if (more <= cap_ - len_) return;
    const std::size_t cap = std::max({len_ + more, 2 * cap_, std::size_t{256}});
    auto b = std::make_unique_for_overwrite<char[]>(cap);
    if (len_) std::memcpy(b.get(), buf_.get(), len_);
    buf_ = std::move(b);
    cap_ = cap;
  }
  std::unique_ptr<char[]> buf_;
  std::size_t len_ = 0, cap_ = 0;
};

class flattener {
 public:
  FlatStateDict run(const Value& root) {
    auto tape = std::make_shared<skeleton_tape>();
    tape_ = tape.get();
    walk(root);
    decide();
    const std::size_t n = leaves_.size();
    std::vector<std::string> quoted;  // computed only when dotted names collide
    auto names = assign_names(
        n, [&](std::size_t i) { return dotted(i); }, {},
        [&](std::size_t i) -> const std::string& {
          if (quoted.empty())
            visit(root, [&](const Path& p, const Value& v) {
              if (v.is_tensor()) quoted.push_back(quoted_name(p));
            });
          return quoted[i];
        },
        is_ascii(arena_));
    FlatStateDict out;
    std::size_t ntensors = 0, room = dims_;  // dims_ counts every leaf's shape; views add strides
    for (std::size_t i = 0; i < n; ++i) {
      ntensors += kind_[i] == leaf_kind::tensor;
      if (kind_[i] == leaf_kind::view) room += leaves_[i].view->rank();
    }
    out.tensors.reserve(ntensors);
    tape->leaves.resize(n);
    tape->dims.resize(room);
    dim_t* dims = tape->dims.data();
    std::size_t at = 0;
    auto put = [&](const shape_t& d) { at = static_cast<std::size_t>(std::copy(d.begin(), d.end(), dims + at) - dims); };
    // Without renamed leaves the tensor names are the dotted names: the arena, copied once.
    const std::uint64_t arena_at = tape->pool.size();
    if (!names) tape->pool += arena_;
    else tape->pool.reserve(tape->pool.size() + arena_.size());
    for (std::size_t i = 0; i < n; ++i) {
      const TensorView& v = *leaves_[i].view;
      skeleton_tape::leaf& l = tape->leaves[i];
      l.dtype = v.dtype();
      l.rank = static_cast<std::uint32_t>(v.shape().size());
      l.dims = at;
      switch (kind_[i]) {
        case leaf_kind::tensor: {
          std::string nm = names ? std::move((*names)[i]) : std::string(dotted(i));
          l.kind = snode::tensor;
          l.name = names ? tape->add_str(nm) : arena_at + name_start_[i];
          l.name_len = nm.size();
          put(v.shape());
          out.tensors.emplace_back(std::move(nm), v);
          break;
        }
        case leaf_kind::alias:
          l.kind = snode::alias;
          l.target = target_[i];
          break;
        case leaf_kind::view:
          l.kind = snode::view;
          l.target = target_[i];
          l.offset = offset_[i];
          put(v.shape());
          put(v.strides());
          break;
      }
    }
    tape->dims.resize(at);
    out.skeleton = Skeleton(std::shared_ptr<const skeleton_tape>(std::move(tape)));
    return out;
  }

 private:
  enum class leaf_kind : std::uint8_t { tensor, alias, view };
  struct leaf {
    const TensorView* view;
  };
  struct frame {
    const Value* node;
    std::size_t next;
    std::size_t size;
    std::size_t prefix_len;
    bool root;
  };

  skeleton_tape* tape_ = nullptr;
  std::vector<leaf> leaves_;
  std::string arena_;                    // the dotted names of all leaves, back to back
  std::vector<std::size_t> name_start_;  // leaf i's name is arena_[name_start_[i], name_start_[i + 1])
  std::vector<leaf_kind> kind_;
  std::vector<std::uint32_t> target_;
  std::vector<dim_t> offset_;
  std::vector<std::uint32_t> rank_;
  std::size_t dims_ = 0;              // room the tape's dims need
  std::vector<std::uintptr_t> end_;  // leaf i's bytes end at end_[i] (extent 0: its start)
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> by_start_;  // (start, leaf) of leaves with bytes
  path_buffer prefix_;

  [[nodiscard]] std::string_view dotted(std::size_t i) const {
    return std::string_view(arena_).substr(name_start_[i], name_start_[i + 1] - name_start_[i]);
  }

  void node(snode k, std::uint64_t a = 0, std::uint32_t b = 0, std::uint8_t flag = 0) { tape_->nodes.push_back({a, b, k, flag}); }
  void string_node(snode k, std::string_view s) {
    const auto [a, b] = tape_->add_string_node(s);
    node(k, a, b);
  }

  /// Writes the tape node(s) of a value; for a container, sets up its frame. Returns true for a
  /// container with children.
  bool emit(const Value& v, frame& f) {
    switch (v.kind()) {
      case value_kind::none: node(snode::none); return false;
      case value_kind::boolean: node(snode::boolean, 0, 0, v.as_bool() ? 1 : 0); return false;
      case value_kind::integer: node(snode::integer, static_cast<std::uint64_t>(v.as_int())); return false;
      case value_kind::floating: node(snode::floating, std::bit_cast<std::uint64_t>(v.as_double())); return false;
      case value_kind::string: string_node(snode::string, v.as_string()); return false;
      case value_kind::bytes: {
        const auto& b = v.as_bytes().data;
        string_node(snode::bytes, std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
        return false;
      }
      case value_kind::tensor: {
        const TensorView& t = v.as_tensor();
        const auto li = static_cast<std::uint32_t>(leaves_.size());
        node(snode::tensor, li);
        leaves_.push_back({&t});
        // decide() reads the byte ranges from here rather than from the tree, in address order.
        const std::uint64_t extent = t.extent_bytes();
        dims_ += t.rank();  // a tensor node's shape (views, which are rare, add their strides)
        end_.push_back(start_of(t) + extent);
        if (extent != 0) by_start_.emplace_back(start_of(t), li);
        if (name_start_.empty()) name_start_.push_back(0);
        arena_ += prefix_.view();
        name_start_.push_back(arena_.size());
        return false;
      }
      case value_kind::list:
      case value_kind::tuple: {
        const std::size_t n = v.as_list().size();
        node(v.is_list() ? snode::list : snode::tuple, n);
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
      case value_kind::dict: {
        const std::size_t n = v.as_dict().size();
        node(snode::dict, n);
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
      case value_kind::object: {
        const Object& o = v.as_object();
        if (o.state.size() >= UINT32_MAX)
          throw_error(errors::out_of_range, "an object with " + std::to_string(o.state.size()) + " state values (at most 2^32 - 2)");
        node(snode::object, o.args.size(), static_cast<std::uint32_t>(o.state.size()), static_cast<std::uint8_t>(o.how));
        node(snode::none, o.items.size());
        string_node(snode::string, o.module);
        string_node(snode::string, o.name);
        const std::size_t n = o.args.size() + o.state.size() + o.items.size();
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
    }
    return false;
  }

  void walk(const Value& root) {
    std::vector<frame> stack;
    frame f{};
    if (!emit(root, f)) return;
    f.root = true;
    // A state_dict is mostly one flat dict of tensors: room for that many leaves up front, so that
    // the per-leaf arrays are not copied as they grow (nested trees still grow geometrically).
    leaves_.reserve(f.size);
    end_.reserve(f.size);
    by_start_.reserve(f.size);
    name_start_.reserve(f.size + 1);
    tape_->nodes.reserve(tape_->nodes.size() + f.size + 1);
    stack.push_back(f);
    while (!stack.empty()) {
      frame& top = stack.back();
      if (top.next == top.size) {
        stack.pop_back();
        continue;
      }
      const std::size_t i = top.next++;
      prefix_.truncate(top.prefix_len);
      if (!top.root) prefix_.push('.');
      const Value* child = nullptr;
      switch (top.node->kind()) {
        case value_kind::list:
        case value_kind::tuple:
          child = &top.node->as_list()[i];
          prefix_.append_int(static_cast<std::int64_t>(i));
          break;
        case value_kind::dict: {
          const auto& item = top.node->as_dict().items()[i];
          child = &item.second;
          if (item.first.is_int()) {
            node(snode::integer, static_cast<std::uint64_t>(item.first.as_int()));
            prefix_.append_int(item.first.as_int());
          } else {
            string_node(snode::string, item.first.as_string());
            prefix_.append(item.first.as_string());
          }
          break;
        }
        default: {
          const Object& o = top.node->as_object();
          std::size_t j = i;
          if (j < o.args.size()) {
            child = &o.args[j];
            prefix_.append("args.");
            prefix_.append_int(static_cast<std::int64_t>(j));
            break;
          }
          j -= o.args.size();
          if (j < o.state.size()) {
            child = &o.state[j];
            prefix_.append("state");
            if (o.state.size() > 1) {
              prefix_.push('.');
              prefix_.append_int(static_cast<std::int64_t>(j));
            }
            break;
          }
          j -= o.state.size();
          child = &o.items[j];
          prefix_.append("items.");
          prefix_.append_int(static_cast<std::int64_t>(j));
          break;
        }
      }
      frame nf{};
      if (emit(*child, nf)) stack.push_back(nf);  // `top` is dangling from here on
    }
  }

  // ---- aliases and views (docs/flatten.md, "Aliases and views")

  static std::uintptr_t start_of(const TensorView& v) noexcept { return reinterpret_cast<std::uintptr_t>(v.data()); }

  static std::uint64_t signature(const TensorView& v) noexcept {
    std::uint64_t h = start_of(v) * 0x9e3779b97f4a7c15ULL ^ static_cast<std::uint64_t>(v.dtype());
    auto mix = [&](std::uint64_t x) { h = (h ^ x) * 0x100000001b3ULL + 0x7f4a7c15ULL; };
    for (dim_t d : v.shape()) mix(static_cast<std::uint64_t>(d));
    mix(0xffffULL);
    for (dim_t s : v.strides()) mix(static_cast<std::uint64_t>(s));
    return h;
  }

  void decide() {
    const std::size_t n = leaves_.size();
    kind_.assign(n, leaf_kind::tensor);
    target_.assign(n, 0);
    offset_.assign(n, 0);
    // Zero-element views are never aliased. The rest, sorted by start address, fall into clusters
    // of transitively overlapping byte ranges; only clusters of two or more need any work.
    std::vector<std::pair<std::uintptr_t, std::uint32_t>> order = std::move(by_start_);
    address_sort(order);
    std::size_t b = 0;
    while (b < order.size()) {
      std::uintptr_t max_end = end_[order[b].second];
      std::size_t e = b + 1;
      while (e < order.size() && order[e].first < max_end) {
        max_end = std::max(max_end, end_[order[e].second]);
        ++e;
      }
      if (e - b > 1) cluster(order, b, e);
      b = e;
    }
  }

  /// Makes leaf i a view of the tensor node behind leaf j (which contains it), when i starts a
  /// whole number of elements into that tensor node.
  bool try_view(std::uint32_t i, std::uint32_t j) {
    const std::uint32_t base = kind_[j] == leaf_kind::tensor ? j : target_[j];
    const std::uintptr_t off = start_of(*leaves_[i].view) - start_of(*leaves_[base].view);
    if (off % leaves_[i].view->itemsize() != 0) return false;
    kind_[i] = leaf_kind::view;
    target_[i] = base;
    offset_[i] = static_cast<dim_t>(off / leaves_[i].view->itemsize());
    return true;
  }

  /// Decides aliases and views inside one cluster `order[b, e)` (sorted by start address),
  /// visiting its leaves in pre-order. A prefix-maximum Fenwick tree per dtype over the address
  /// ranks answers "which earlier contiguous leaf with start <= p reaches furthest?" in O(log n).
  void cluster(const std::vector<std::pair<std::uintptr_t, std::uint32_t>>& order, std::size_t b, std::size_t e) {
    const std::size_t k = e - b;
    if (rank_.size() != leaves_.size()) rank_.assign(leaves_.size(), 0);
    std::vector<std::uintptr_t> starts(k);
    std::vector<std::uint32_t> by_index(k);
    for (std::size_t j = 0; j < k; ++j) {
      starts[j] = order[b + j].first;
      by_index[j] = order[b + j].second;
      rank_[order[b + j].second] = static_cast<std::uint32_t>(j);
    }
    std::sort(by_index.begin(), by_index.end());
    using entry = std::pair<std::uintptr_t, std::uint32_t>;  // (end, leaf)
    std::array<std::vector<entry>, dtype_count> fenwick;
    std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> same;  // signature -> tensor leaves
    for (std::uint32_t i : by_index) {
      const TensorView& v = *leaves_[i].view;
      const std::uintptr_t start = start_of(v);
      const std::uintptr_t end = start + v.extent_bytes();
      auto& bucket = same[signature(v)];
      bool done = false;
      for (std::uint32_t t : bucket)
        if (same_view(v, *leaves_[t].view)) {
          kind_[i] = leaf_kind::alias;
          target_[i] = t;
          done = true;
          break;
        }
      if (done) continue;  // its range is already in the tree when it is contiguous
      auto& fw = fenwick[static_cast<std::size_t>(v.dtype())];
      if (!fw.empty()) {
        std::size_t p = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), start) - starts.begin());
        entry best{0, 0};
        for (; p > 0; p &= p - 1) best = std::max(best, fw[p]);
        if (best.first >= end && best.first != 0) {
          // `best` contains this view, and so does the tensor node behind it. When the view is
          // not a whole number of elements from that base (same-dtype views at odd byte offsets,
          // which PyTorch never makes), look for any earlier container it is aligned with.
          if (!try_view(i, best.second))
            for (std::uint32_t j : by_index) {
              if (j >= i) break;
              const TensorView& w = *leaves_[j].view;
              if (w.dtype() == v.dtype() && w.is_contiguous() && start_of(w) <= start &&
                  start_of(w) + w.extent_bytes() >= end && try_view(i, j))
                break;
            }
        }
      }
      if (kind_[i] == leaf_kind::tensor) bucket.push_back(i);
      if (v.is_contiguous()) {
        if (fw.empty()) fw.assign(k + 1, entry{0, 0});
        for (std::size_t p = rank_[i] + 1; p <= k; p += p & (~p + 1)) fw[p] = std::max(fw[p], entry{end, i});
      }
    }
  }
};

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

/// The tensors an unflatten may use, by name. Names are indexed as they are added (a repeated
/// name is an error), or, after defer_index(), only when a lookup needs the index: a map that
/// lists a compact skeleton's tensors in its order never does.
class tensor_table {
 public:
  static constexpr std::uint32_t npos = name_index::npos;

  /// Index names only when a lookup needs it (and check for repeats then).
  void defer_index() noexcept { deferred_ = true; }
  void reserve(std::size_t n) {
    if (!deferred_) index_.reserve(n);
    names_.reserve(n);
    views_.reserve(n);
  }
  void add(std::string_view name, const TensorView* v) {
    if (!deferred_ && index_.insert(name, static_cast<std::uint32_t>(views_.size())) != npos) repeated(name);
    names_.push_back(name);
    views_.push_back(v);
  }
  /// Reads the entries of a NamedTensors list in place (no copy of its names and views: for a
  /// map of 100k tensors that copy is a pass over every entry's cache lines). Only into an
  /// empty table; `list` must outlive it.
  void adopt(const NamedTensors& list) {
    direct_ = list.data();
    direct_size_ = list.size();
    if (deferred_) return;
    index_.reserve(direct_size_);
    for (std::uint32_t i = 0; i < direct_size_; ++i)
      if (index_.insert(name(i), i) != npos) repeated(name(i));
  }
  /// Builds a deferred index; throws flat_duplicate_name for a repeated name.
  void ensure_index() {
    if (!deferred_) return;
    name_index idx;  // kept only when complete: a later call reports a repeat again
    idx.reserve(size());
    for (std::uint32_t i = 0; i < size(); ++i)
      if (idx.insert(name(i), i) != npos) repeated(name(i));
    index_ = std::move(idx);
    deferred_ = false;
  }
  [[nodiscard]] std::uint32_t find(std::string_view name) {
    ensure_index();
    return index_.find(name);
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
  name_index index_;
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

}  // namespace detail

// ================================================================================================
// Public API

/// Flattens a tree: its tensors by name, in pre-order, plus the skeleton (docs/flatten.md).
/// Tensors reached twice as the very same view become `alias` nodes; views whose bytes lie inside
/// an earlier contiguous tensor of the same dtype become `view_of` nodes; each is stored once.
inline FlatStateDict flatten(const Value& tree) { return detail::flattener().run(tree); }

/// Rebuilds the tree from any name -> tensor collection (a NamedTensors list, std::map or
/// std::unordered_map of TensorView or Tensor, ...) and a skeleton. The result equals (==) the
/// flattened tree. Throws a statedict error naming the node or tensor when they do not match:
/// flat_malformed, flat_version, flat_missing_tensor, flat_extra_tensor, flat_tensor_dtype,
/// flat_tensor_shape, flat_duplicate_name, flat_bad_alias, flat_view_bounds, flat_view_base,
/// flat_duplicate_key. A null skeleton means a flat dict of the tensors in order.
template <detail::named_tensor_range Tensors>
Value unflatten(const Tensors& tensors, const nlohmann::json& skeleton) {
  detail::tensor_table tt;
  std::deque<TensorView> converted;
  detail::fill_table(tt, tensors, converted);
  return detail::unflatten_impl(tt, skeleton);
}

/// unflatten for a Skeleton: one made by flatten is read in its compact form (no JSON is built
/// unless the map does not match it, to report the mismatch exactly as for its JSON document).
template <detail::named_tensor_range Tensors, class S>
  requires std::same_as<S, Skeleton>
Value unflatten(const Tensors& tensors, const S& skeleton) {
  const detail::skeleton_tape* tape = skeleton.tape();
  if (!tape) return unflatten(tensors, skeleton.json());
  detail::tensor_table tt;
  tt.defer_index();
  std::deque<TensorView> converted;
  detail::fill_table(tt, tensors, converted);
  try {
    Value v = detail::build_from_tape(*tape, tt);
    bool all = true;
    for (std::uint32_t i = 0; i < tt.size() && all; ++i) all = tt.declared(i);
    if (all) return v;
  } catch (const detail::tape_mismatch&) {
  } catch (const error&) {
  }
  tt.reset();
  return detail::unflatten_impl(tt, skeleton.json());  // throws the error, with the node's path
}

inline Value unflatten(const FlatStateDict& flat) { return unflatten(flat.tensors, flat.skeleton); }

// ---- Skeleton members that need the tape

inline const nlohmann::json& Skeleton::json() const {
  if (!tape_) return doc_;
  nlohmann::json* p = cache_.load(std::memory_order_acquire);
  if (p) return *p;
  auto fresh = std::make_unique<nlohmann::json>(detail::tape_to_json(*tape_));
  if (cache_.compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel, std::memory_order_acquire)) return *fresh.release();
  return *p;  // another thread built it first
}

inline nlohmann::json& Skeleton::mutable_json() {
  if (tape_) {
    doc_ = std::move(*this).take_json();
    tape_.reset();
  }
  return doc_;
}

inline nlohmann::json Skeleton::take_json() && {
  if (!tape_) return std::move(doc_);
  std::unique_ptr<nlohmann::json> cached(cache_.exchange(nullptr));
  nlohmann::json out = cached ? std::move(*cached) : detail::tape_to_json(*tape_);
  tape_.reset();
  return out;
}

/// The skeleton of a flat dict of named tensors in order: what a plain safetensors file is.
/// Elements are (name, TensorView-or-Tensor) pairs, or records with `.name`, `.dtype` and `.shape`
/// (such as ShardedCheckpoint's TensorInfo). No alias detection: build a Dict and flatten it for that.
template <class Range>
nlohmann::json flat_skeleton(const Range& tensors) {
  using json = nlohmann::json;
  json::array_t pairs;
  if constexpr (requires { tensors.size(); }) pairs.reserve(tensors.size());
  for (const auto& t : tensors) {
    json node(json::value_t::object);
    auto& o = node.get_ref<json::object_t&>();
    std::string name;
    if constexpr (requires { t.name; t.dtype; t.shape; }) {
      name = std::string(t.name);
      o.emplace("dtype", std::string(statedict::name(t.dtype)));
      o.emplace("shape", detail::shape_json(t.shape));
    } else {
      name = std::string(t.first);
      const TensorView v(t.second);
      o.emplace("dtype", std::string(statedict::name(v.dtype())));
      o.emplace("shape", detail::shape_json(v.shape()));
    }
    o.emplace("tensor", name);
    json pair = json::array_t(2);
    pair[0] = detail::encode_string(name);
    pair[1] = std::move(node);
    pairs.push_back(std::move(pair));
  }
  json root(json::value_t::object);
  root.get_ref<json::object_t&>().emplace("dict", std::move(pairs));
  json skel(json::value_t::object);
  skel.get_ref<json::object_t&>().emplace("statedict_skeleton", 1);
  skel.get_ref<json::object_t&>().emplace("root", std::move(root));
  return skel;
}

/// The compact JSON text of a skeleton (or any JSON value), exactly what `skeleton.dump()` gives,
/// without recursion: nlohmann's dump() recurses once per nesting level, which a skeleton of a
/// very deep tree would turn into a stack overflow. Throws nlohmann's type_error on strings that
/// are not UTF-8, as dump() does (flatten never puts one in a skeleton).
inline std::string skeleton_dump(const nlohmann::json& j) {
  using json = nlohmann::json;
  std::string out;
  struct frame {
    const json* v;
    std::size_t next;                       // arrays: next element
    json::object_t::const_iterator it;      // objects: next member
  };
  std::vector<frame> stack;
  auto open = [&](const json& v) {
    if (v.is_array()) {
      out += '[';
      stack.push_back({&v, 0, {}});
    } else if (v.is_object()) {
      out += '{';
      stack.push_back({&v, 0, v.get_ref<const json::object_t&>().begin()});
    } else {
      out += v.dump();  // a scalar: no recursion
    }
  };
  open(j);
  while (!stack.empty()) {
    frame& f = stack.back();
    const json* child = nullptr;
    if (f.v->is_array()) {
      const auto& a = f.v->get_ref<const json::array_t&>();
      if (f.next == a.size()) {
        out += ']';
        stack.pop_back();
        continue;
      }
      if (f.next) out += ',';
      child = &a[f.next++];
    } else {
      const auto& o = f.v->get_ref<const json::object_t&>();
      if (f.it == o.end()) {
        out += '}';
        stack.pop_back();
        continue;
      }
      if (f.it != o.begin()) out += ',';
      out += json(f.it->first).dump();
      out += ':';
      child = &f.it->second;
      ++f.it;
    }
    open(*child);  // `f` is dangling from here on
  }
  return out;
}

inline std::string Skeleton::dump() const {
  if (tape_)
    if (auto text = detail::tape_dump(*tape_)) return std::move(*text);
  return skeleton_dump(json());
}

/// A tensor node of a skeleton: the name it has in the tensor map, its dtype and shape.
struct SkeletonTensor {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  friend bool operator==(const SkeletonTensor&, const SkeletonTensor&) = default;
};

/// The tensor nodes of a skeleton in pre-order (the tensors a writer must store).
inline std::vector<SkeletonTensor> skeleton_tensors(const nlohmann::json& skeleton) {
  std::vector<SkeletonTensor> out;
  detail::skeleton_cursor cur(detail::skeleton_root(skeleton));
  try {
    for (;;) {
      auto e = cur.next();
      if (e.type == detail::skeleton_cursor::ev::done) break;
      if (e.type != detail::skeleton_cursor::ev::leaf || e.node.kind != detail::snode::tensor) continue;
      out.push_back({e.node.body->get<std::string>(), detail::member_dtype(*e.node.node, "a tensor node"),
                     detail::member_dims(*e.node.node, "shape", "a tensor node")});
    }
  } catch (error& err) {
    err.add_context("skeleton node " + quote(dotted(cur.path())));
    throw;
  }
  return out;
}

namespace detail {

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

}  // namespace detail

/// The alias and view_of nodes of a skeleton as (name, target) pairs in pre-order: `name` is the
/// node's own name (the naming rule of docs/flatten.md, unique among tensor names), `target` the
/// map name of the tensor whose storage it shares.
inline std::vector<std::pair<std::string, std::string>> skeleton_aliases(const nlohmann::json& skeleton) {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& t : detail::list_tensorish(skeleton))
    if (t.kind != detail::snode::tensor) out.emplace_back(std::move(t.name), std::move(t.target));
  return out;
}

/// The non-tensor leaves of a skeleton as (name, value) pairs in pre-order: None, bool, int,
/// float, str and bytes leaves, and each outermost opaque object holding no tensor as one value.
/// (Empty containers are not leaves.) Names follow the naming rule of docs/flatten.md among the
/// values: the dotted name when unique, else the quoted name (a `#k` suffix as a last resort).
inline std::vector<std::pair<std::string, Value>> skeleton_values(const nlohmann::json& skeleton) {
  using ev = detail::skeleton_cursor::ev;
  // Pass 1: which object nodes hold a tensor, alias or view_of node somewhere below them.
  std::unordered_set<const nlohmann::json*> holds_tensor;
  {
    std::vector<const nlohmann::json*> objects;  // enclosing object nodes
    detail::walk_skeleton<false>(skeleton, [&](const detail::skeleton_cursor::event& e, const Path&, detail::skeleton_cursor&) {
      const detail::snode k = e.node.kind;
      if (k == detail::snode::object) {
        if (e.type == ev::enter) objects.push_back(e.node.node);
        else if (e.type == ev::leave) objects.pop_back();
        return;
      }
      if (e.type != ev::leaf || (k != detail::snode::tensor && k != detail::snode::alias && k != detail::snode::view)) return;
      // Mark the enclosing objects, innermost first, up to one marked before.
      for (auto it = objects.rbegin(); it != objects.rend(); ++it)
        if (!holds_tensor.insert(*it).second) break;
    });
  }
  // Pass 2: the values, each with its path (asked of the cursor for the few nodes kept, rather
  // than kept up to date for every node: a checkpoint is mostly tensors).
  std::vector<Path> paths;
  std::vector<Value> values;
  detail::walk_skeleton<false>(skeleton, [&](const detail::skeleton_cursor::event& e, const Path&, detail::skeleton_cursor& cur) {
    const detail::snode k = e.node.kind;
    if (e.type == ev::enter && k == detail::snode::object && !holds_tensor.count(e.node.node)) {
      paths.push_back(cur.path());
      values.push_back(detail::build_tree(*e.node.node, nullptr));
      cur.skip();
      return;
    }
    if (e.type != ev::leaf || k == detail::snode::tensor || k == detail::snode::alias || k == detail::snode::view) return;
    paths.push_back(cur.path());
    values.push_back(detail::decode_scalar(e.node));
  });
  return detail::named_values(paths, values);
}

/// skeleton_values for a Skeleton: a compact one is read without building its JSON document.
inline std::vector<std::pair<std::string, Value>> skeleton_values(const Skeleton& skeleton) {
  const detail::skeleton_tape* t = skeleton.tape();
  if (!t) return skeleton_values(skeleton.json());
  std::vector<Path> paths;
  std::vector<Value> values;
  detail::tape_values(*t, paths, values);
  return detail::named_values(paths, values);
}

// ------------------------------------------------------------------------------------------------
// Subsets (`convert --only PREFIX`)

/// A tensor of a subset skeleton: its name there, the map name of the tensor its elements come
/// from, and, when it was a view of a tensor the subset dropped, which elements (`view`).
struct SubsetTensor {
  std::string name;
  std::string source;
  std::optional<ViewSpec> view;
  friend bool operator==(const SubsetTensor&, const SubsetTensor&) = default;
};

struct SkeletonSubset {
  nlohmann::json skeleton;
  std::vector<SubsetTensor> tensors;  ///< in the order of the new skeleton's tensor nodes
};

/// A predicate over node paths.
using PathFilter = std::function<bool(const Path&)>;

/// Keeps a node when its dotted name equals a prefix or continues it at a '.' boundary
/// ("model.layers.1" keeps "model.layers.1.w" but not "model.layers.10.w"; a prefix ending in '.'
/// keeps everything below it). An empty prefix keeps everything.
inline PathFilter name_prefix_filter(std::vector<std::string> prefixes) {
  return [prefixes = std::move(prefixes)](const Path& p) {
    const std::string d = dotted(p);
    for (const auto& pre : prefixes) {
      if (pre.empty() || d == pre) return true;
      if (d.size() > pre.size() && d.compare(0, pre.size(), pre) == 0 && (pre.back() == '.' || d[pre.size()] == '.'))
        return true;
    }
    return false;
  };
}

/// The part of a skeleton that `keep` selects (docs/flatten.md, "Subsets"): a leaf (or empty
/// container) is kept when keep(path) is true; a container is kept when something below it is;
/// an opaque object is kept whole or not at all. Dropped list and tuple elements before a kept
/// one become None, so kept elements keep their index. An alias or view_of whose target tensor
/// was dropped becomes a tensor node of its own (its listing name), with `source`/`view` saying
/// where its elements come from. The result's tensor nodes are listed in `tensors`.
inline SkeletonSubset skeleton_subset(const nlohmann::json& skeleton, const PathFilter& keep) {
  using json = nlohmann::json;
  using ev = detail::skeleton_cursor::ev;
  using detail::snode;
  // Pass 1: decide, for every node in pre-order, whether it is kept.
  struct node {
    std::size_t parent;
    std::size_t end;  // one past the last node of its subtree
    snode kind;
    bool kept;
  };
  std::vector<node> nodes;
  std::vector<std::size_t> open;  // indices of enclosing containers
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  detail::walk_skeleton(skeleton, [&](const detail::skeleton_cursor::event& e, const Path& p, detail::skeleton_cursor&) {
    if (e.type == ev::leave) {
      node& c = nodes[open.back()];
      c.end = nodes.size();
      if (c.end == open.back() + 1) c.kept = keep(p);  // an empty container
      open.pop_back();
      return;
    }
    nodes.push_back({open.empty() ? none : open.back(), nodes.size() + 1, e.node.kind, false});
    if (e.type == ev::enter) open.push_back(nodes.size() - 1);
    else nodes.back().kept = keep(p);
  });
  for (std::size_t i = nodes.size(); i-- > 0;)
    if (nodes[i].kept && nodes[i].parent != none) nodes[nodes[i].parent].kept = true;
  if (!nodes.empty()) nodes[0].kept = true;  // the root always stays
  for (std::size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].kind == snode::object && nodes[i].kept)
      for (std::size_t j = i + 1; j < nodes[i].end; ++j) nodes[j].kept = true;

  // Tensor-like nodes: names, and which map names survive as tensor nodes.
  std::vector<detail::tensorish> tl = detail::list_tensorish(skeleton);
  std::unordered_map<std::string, const json*> declared;  // map name -> its tensor node
  for (const auto& t : tl)
    if (t.kind == snode::tensor) declared.emplace(t.target, t.node);

  // Pass 2: rebuild.
  SkeletonSubset out;
  std::unordered_set<std::string> kept_tensors;
  std::unordered_map<std::string, std::string> promoted;  // dropped map name -> new name
  json root;
  std::vector<json*> stack;
  std::size_t idx = 0, tidx = 0;
  detail::walk_skeleton(skeleton, [&](const detail::skeleton_cursor::event& e, const Path& path, detail::skeleton_cursor& cur) {
    if (e.type == ev::leave) {
      stack.pop_back();
      return;
    }
    const std::size_t me = idx++;
    const bool tensorish = e.node.kind == snode::tensor || e.node.kind == snode::alias || e.node.kind == snode::view;
    const detail::tensorish* t = tensorish ? &tl[tidx++] : nullptr;
    if (!nodes[me].kept) {
      if (e.type == ev::enter) {
        // Skip the subtree, staying aligned with `nodes` and `tl`; the matching leave pops a null.
        for (std::size_t j = me + 1; j < nodes[me].end; ++j)
          if (nodes[j].kind == snode::tensor || nodes[j].kind == snode::alias || nodes[j].kind == snode::view) ++tidx;
        idx = nodes[me].end;
        stack.push_back(nullptr);
        cur.skip();
      }
      return;
    }
    json* slot = &root;
    if (!stack.empty()) {
      json& parent = *stack.back();
      switch (e.slot) {
        case detail::slot_kind::index: {
          json& arr = parent.begin().value();
          while (arr.size() < e.index) arr.push_back(nullptr);
          slot = &arr.emplace_back();
          break;
        }
        case detail::slot_kind::dict: {
          json& arr = parent["dict"];
          json pair = json::array_t(2);
          pair[0] = detail::encode_key(path.back());  // walk_skeleton moved e.key there
          arr.push_back(std::move(pair));
          slot = &arr.back()[1];
          break;
        }
        case detail::slot_kind::args: slot = &parent["object"]["args"].emplace_back(); break;
        case detail::slot_kind::state: slot = &parent["object"]["state"].emplace_back(); break;
        case detail::slot_kind::items: slot = &parent["object"]["items"].emplace_back(); break;
        case detail::slot_kind::root: break;
      }
    }
    if (e.type == ev::enter) {
      json c(json::value_t::object);
      switch (e.node.kind) {
        case snode::list: c["list"] = json::array(); break;
        case snode::tuple: c["tuple"] = json::array(); break;
        case snode::dict: c["dict"] = json::array(); break;
        default: {
          const Object o = detail::decode_object_header(*e.node.body);
          json body(json::value_t::object);
          body["module"] = detail::encode_string(o.module);
          body["name"] = detail::encode_string(o.name);
          body["how"] = std::string(detail::how_name(o.how));
          body["args"] = json::array();
          body["state"] = json::array();
          body["items"] = json::array();
          c["object"] = std::move(body);
          break;
        }
      }
      *slot = std::move(c);
      stack.push_back(slot);
      return;
    }
    if (!t) {
      *slot = *e.node.node;  // a scalar leaf: a small, flat JSON value
      return;
    }
    auto add = [&](const std::string& name, const std::string& source, std::optional<ViewSpec> view) {
      out.tensors.push_back({name, source, std::move(view)});
      kept_tensors.insert(name);
    };
    if (t->kind == snode::tensor) {
      *slot = *e.node.node;
      add(t->target, t->target, std::nullopt);
      return;
    }
    auto it = declared.find(t->target);
    if (it == declared.end())
      throw_error(errors::flat_bad_alias, "target " + quote(t->target) + " is not declared by a tensor node");
    std::string live;  // the name under which the target's elements are in the subset
    if (kept_tensors.count(t->target)) live = t->target;
    else if (auto pr = promoted.find(t->target); pr != promoted.end()) live = pr->second;
    if (t->kind == snode::alias) {
      if (!live.empty()) {
        *slot = detail::alias_node(live);
        return;
      }
      json n(json::value_t::object);
      n["tensor"] = t->name;
      n["dtype"] = it->second->at("dtype");
      n["shape"] = it->second->at("shape");
      *slot = std::move(n);
      add(t->name, t->target, std::nullopt);
      promoted.emplace(t->target, t->name);
      return;
    }
    ViewSpec spec = detail::decode_view(e.node);
    if (!live.empty()) {
      *slot = detail::view_node(live, spec);
      return;
    }
    json n(json::value_t::object);
    n["tensor"] = t->name;
    n["dtype"] = std::string(statedict::name(spec.dtype));
    n["shape"] = detail::shape_json(spec.shape);
    *slot = std::move(n);
    add(t->name, t->target, std::move(spec));
  });
  out.skeleton = json::object();
  out.skeleton["statedict_skeleton"] = 1;
  out.skeleton["root"] = std::move(root);
  return out;
}

/// The part of a flat state dict that `keep` selects (see skeleton_subset): its tensors are views
/// of the input's, never copies.
inline FlatStateDict select(const FlatStateDict& flat, const PathFilter& keep) {
  SkeletonSubset s = skeleton_subset(flat.skeleton, keep);
  std::unordered_map<std::string_view, const TensorView*> index;
  index.reserve(flat.tensors.size());
  for (const auto& [n, v] : flat.tensors) index.emplace(n, &v);
  FlatStateDict out;
  out.tensors.reserve(s.tensors.size());
  for (auto& t : s.tensors) {
    auto it = index.find(t.source);
    if (it == index.end()) throw_error(errors::flat_missing_tensor, "tensor " + quote(t.source) + " is not in the tensor map");
    out.tensors.emplace_back(std::move(t.name), t.view ? view_into(*it->second, *t.view) : *it->second);
  }
  out.skeleton = std::move(s.skeleton);
  return out;
}

}  // namespace statedict::inline v0
