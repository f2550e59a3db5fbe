// statedict: the skeleton, everything of a state dict that is not a tensor, and FlatStateDict.
// SPDX-License-Identifier: MIT
//
// core/flatten.hpp turns a tree into named tensors plus a skeleton holding everything else: container
// kinds, key types, non-tensor leaves, and which tensors are the same view (aliases) or views into
// another tensor's elements (view_of). The skeleton format, the naming rule and the alias rule are
// documented in docs/flatten.md; in short:
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
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.hpp"
#ifndef STATEDICT_DECLARATIONS_ONLY
#include "detail/skeleton_tape.hpp"
#else
namespace statedict::inline v0::detail {
struct skeleton_tape;
}  // namespace statedict::inline v0::detail
#endif
#include "dtype.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

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

/// The compact JSON text of a skeleton (or any JSON value), exactly what `skeleton.dump()` gives,
/// without recursion (see its definition below).
STATEDICT_API std::string skeleton_dump(const nlohmann::json& j);

#ifndef STATEDICT_DECLARATIONS_ONLY
/// The compact JSON text of a skeleton (or any JSON value), exactly what `skeleton.dump()` gives,
/// without recursion: nlohmann's dump() recurses once per nesting level, which a skeleton of a
/// very deep tree would turn into a stack overflow. Throws nlohmann's type_error on strings that
/// are not UTF-8, as dump() does (flatten never puts one in a skeleton).
STATEDICT_API std::string skeleton_dump(const nlohmann::json& j) {
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

// ---- Skeleton members

STATEDICT_API const nlohmann::json& Skeleton::json() const {
  if (!tape_) return doc_;
  nlohmann::json* p = cache_.load(std::memory_order_acquire);
  if (p) return *p;
  auto fresh = std::make_unique<nlohmann::json>(detail::tape_to_json(*tape_));
  if (cache_.compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel, std::memory_order_acquire)) return *fresh.release();
  return *p;  // another thread built it first
}

STATEDICT_API nlohmann::json& Skeleton::mutable_json() {
  if (tape_) {
    doc_ = std::move(*this).take_json();
    tape_.reset();
  }
  return doc_;
}

STATEDICT_API nlohmann::json Skeleton::take_json() && {
  if (!tape_) return std::move(doc_);
  std::unique_ptr<nlohmann::json> cached(cache_.exchange(nullptr));
  nlohmann::json out = cached ? std::move(*cached) : detail::tape_to_json(*tape_);
  tape_.reset();
  return out;
}

STATEDICT_API std::string Skeleton::dump() const {
  if (tape_)
    if (auto text = detail::tape_dump(*tape_)) return std::move(*text);
  return skeleton_dump(json());
}

#endif  // STATEDICT_DECLARATIONS_ONLY

}  // namespace statedict::inline v0
