// statedict: C++ structs <-> Value (a dict with the field names as keys), by reflection.
// SPDX-License-Identifier: MIT
//
//   struct Optim { double lr; std::array<double, 2> betas; std::optional<int> step; };
//   struct Checkpoint { std::map<std::string, statedict::TensorView> model; Optim optim; std::string note; };
//
//   statedict::Value v = statedict::to_value(ckpt);           // {"model": {...}, "optim": {"lr": ..., ...}, ...}
//   auto back = statedict::from_value<Checkpoint>(v);         // throws naming the field: field 'optim.betas'
//
// Field names come from Boost.Describe when the struct is described (BOOST_DESCRIBE_STRUCT), and
// otherwise, for aggregates, from Boost.PFR (fields by index) plus a small compile-time name
// extractor (see docs/reflect.md: how it works, the compile-time self-check, and how to turn it off).
//
// Member types and their Values:
//   bool -> bool;  integers, enums -> int (range-checked both ways);  float, double -> float (an int
//   is accepted when reading, as Python does for hyper-parameters);  std::string -> str;  Bytes -> bytes;
//   TensorView -> tensor (no copy either way);  Tensor -> tensor (reading copies into a new Tensor);
//   Value -> itself;  std::optional<T> -> None or T (a missing field reads as nullopt);
//   std::vector<T> -> list;  std::array<T, N>, std::pair, std::tuple -> tuple (reading accepts a
//   list or tuple of the right length);  std::map<std::string or integer, T> -> dict;
//   aggregates and described structs -> dict, recursively.
// Anything else fails to compile with one static_assert that names the problem and the fix;
// statedict::value_codec<T> is the customisation point for your own types.
//
// This header needs Boost (PFR and Describe, header-only, Boost >= 1.81) and is not included by
// <statedict/statedict.hpp>.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/describe/members.hpp>
#include <boost/describe/modifiers.hpp>
#include <boost/mp11/algorithm.hpp>
#include <boost/pfr/core.hpp>
#include <boost/pfr/tuple_size.hpp>

#include "core/error.hpp"
#include "core/tensor.hpp"
#include "core/value.hpp"

// The name extractor needs __PRETTY_FUNCTION__ (GCC, Clang). Elsewhere, or when defined by the
// user, only Boost.Describe names structs.
#if !defined(STATEDICT_REFLECT_NO_NAME_EXTRACTOR) && !defined(__GNUC__) && !defined(__clang__)
#define STATEDICT_REFLECT_NO_NAME_EXTRACTOR
#endif

namespace statedict::inline v0 {

/// Error ids of reflection (240-259).
namespace errors {
// clang-format off
inline constexpr error_id reflect_kind          {240, error_kind::type,  "reflect.kind"};           ///< a Value of another kind than the member needs
inline constexpr error_id reflect_missing_field {241, error_kind::key,   "reflect.missing_field"};  ///< a dict lacks a (non-optional) field
inline constexpr error_id reflect_unknown_field {242, error_kind::key,   "reflect.unknown_field"};  ///< a dict has a key that names no field
inline constexpr error_id reflect_range         {243, error_kind::type,  "reflect.range"};          ///< a number does not fit the member's type
inline constexpr error_id reflect_length        {244, error_kind::shape, "reflect.length"};         ///< a tuple/array of the wrong length
inline constexpr error_id reflect_key_kind      {245, error_kind::type,  "reflect.key_kind"};       ///< a dict key of the wrong kind for a std::map
// clang-format on
}  // namespace errors

/// Customisation point for types reflect.hpp cannot map by itself. Specialise it as
///
///   template <> struct statedict::value_codec<Mine> {
///     static statedict::Value to(const Mine&);
///     static Mine from(const statedict::Value&);  // throw statedict errors; the field path is added
///   };
template <class T>
struct value_codec;

struct from_value_options {
  /// A dict key that names no field of the struct being read: an error (the default: a typo in a
  /// field name should not go unnoticed), or ignored.
  bool ignore_unknown_fields = false;
};

namespace detail::reflect {

template <class T>
inline constexpr bool this_type_cannot_be_reflected = false;

// ---------------------------------------------------------------------------------------------
// Field names of aggregates, read at compile time from __PRETTY_FUNCTION__ of a function template
// whose argument is the address of a field of a fake object. The object is declared and never
// defined: only addresses of its subobjects are formed, and only during constant evaluation
// (everything here is consteval), so nothing refers to it at run time.

#if !defined(STATEDICT_REFLECT_NO_NAME_EXTRACTOR)
#if defined(__clang__)
#pragma clang diagnostic push
// Both warn that the fake object is used without a definition (-Wundefined-internal for structs
// with internal linkage, such as those in an unnamed namespace); no definition is ever needed.
#pragma clang diagnostic ignored "-Wundefined-var-template"
#pragma clang diagnostic ignored "-Wundefined-internal"
#endif

template <class T>
struct fake_object_wrapper {
  const T value;
};

template <class T>
extern const fake_object_wrapper<T> fake_object;

/// A structural wrapper so that a pointer to a subobject can be a template argument.
template <class F>
struct field_address {
  const F* pointer;
};

template <auto Address>
consteval const char* signature_with() noexcept {
  return __PRETTY_FUNCTION__;
}

/// The identifier right before the wrapper's closing brace: GCC prints
/// `...{(& fake_object<S>.fake_object_wrapper<S>::value.S::beta)}]`, Clang `...{&fake_object.value.beta}]`.
consteval std::string_view member_name_in(std::string_view sig) noexcept {
  const std::size_t close = sig.rfind('}');
  if (close == std::string_view::npos) return {};
  std::size_t end = close;
  while (end > 0 && (sig[end - 1] == ')' || sig[end - 1] == ' ')) --end;
  auto ident = [](char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  std::size_t begin = end;
  while (begin > 0 && ident(sig[begin - 1])) --begin;
  if (begin == end || (sig[begin] >= '0' && sig[begin] <= '9')) return {};
  return sig.substr(begin, end - begin);
}

template <class T, std::size_t I>
consteval std::string_view extracted_field_name() noexcept {
  using F = std::remove_cvref_t<decltype(boost::pfr::get<I>(fake_object<T>.value))>;
  return member_name_in(signature_with<field_address<F>{&boost::pfr::get<I>(fake_object<T>.value)}>());
}

#if defined(__clang__)
#pragma clang diagnostic pop
#endif

/// The name copied into storage of its own, so that nothing at run time points into a signature.
template <class T, std::size_t I>
inline constexpr auto extracted_name_storage = [] {
  constexpr std::string_view n = extracted_field_name<T, I>();
  std::array<char, n.size() + 1> a{};
  for (std::size_t i = 0; i < n.size(); ++i) a[i] = n[i];
  return a;
}();

template <class T, std::size_t... I>
constexpr std::array<std::string_view, sizeof...(I)> extracted_names(std::index_sequence<I...>) noexcept {
  return {std::string_view(extracted_name_storage<T, I>.data(), extracted_name_storage<T, I>.size() - 1)...};
}
#endif  // !STATEDICT_REFLECT_NO_NAME_EXTRACTOR

// ---------------------------------------------------------------------------------------------
// Classification of types

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_std_array : std::false_type {};
template <class T, std::size_t N>
struct is_std_array<std::array<T, N>> : std::true_type {};
template <class T>
struct is_tuple_like : std::false_type {};
template <class... T>
struct is_tuple_like<std::tuple<T...>> : std::true_type {};
template <class A, class B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_map : std::false_type {};
template <class K, class V, class C, class A>
struct is_map<std::map<K, V, C, A>> : std::true_type {};

template <class T>
concept has_user_codec = requires { sizeof(value_codec<T>); };
template <class T>
concept described = boost::describe::has_describe_members<T>::value;
template <class T>
concept integer = std::is_integral_v<T> && !std::is_same_v<T, bool>;
/// The signed/unsigned integer type with T's range (char types are integral but std::in_range
/// and std::to_string do not take them).
template <integer T>
using plain_integer = std::conditional_t<std::is_signed_v<T>, std::make_signed_t<T>, std::make_unsigned_t<T>>;

enum class kind {
  user, value, boolean, integer, enumeration, floating, string, bytes, tensor_view, tensor, optional, vector,
  fixed_tuple, map, described, aggregate,
  // cannot be reflected:
  pointer, string_view, map_key, union_, c_array, reference, not_default_constructible, no_names, other,
};

template <class T>
consteval kind classify() {
  if constexpr (std::is_reference_v<T>) return kind::reference;
  else if constexpr (has_user_codec<T>) return kind::user;
  else if constexpr (std::is_same_v<T, Value>) return kind::value;
  else if constexpr (std::is_same_v<T, bool>) return kind::boolean;
  else if constexpr (integer<T>) return kind::integer;
  else if constexpr (std::is_enum_v<T>) return kind::enumeration;
  else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return kind::floating;
  else if constexpr (std::is_same_v<T, std::string>) return kind::string;
  else if constexpr (std::is_same_v<T, Bytes>) return kind::bytes;
  else if constexpr (std::is_same_v<T, TensorView>) return kind::tensor_view;
  else if constexpr (std::is_same_v<T, Tensor>) return kind::tensor;
  else if constexpr (is_optional<T>::value) return kind::optional;
  else if constexpr (is_vector<T>::value) return kind::vector;
  else if constexpr (is_std_array<T>::value || is_tuple_like<T>::value) return kind::fixed_tuple;
  else if constexpr (is_map<T>::value) {
    using K = typename T::key_type;
    return std::is_same_v<K, std::string> || integer<K> ? kind::map : kind::map_key;
  }
  else if constexpr (std::is_pointer_v<T> || std::is_member_pointer_v<T> || std::is_null_pointer_v<T>) return kind::pointer;
  else if constexpr (std::is_same_v<T, std::string_view>) return kind::string_view;
  else if constexpr (std::is_array_v<T>) return kind::c_array;
  else if constexpr (std::is_union_v<T>) return kind::union_;
  else if constexpr (described<T>) return std::is_default_constructible_v<T> ? kind::described : kind::not_default_constructible;
  else if constexpr (std::is_class_v<T> && std::is_aggregate_v<T>) {
#if defined(STATEDICT_REFLECT_NO_NAME_EXTRACTOR)
    return kind::no_names;
#else
    return kind::aggregate;
#endif
  }
  else return kind::other;
}

// ---------------------------------------------------------------------------------------------
// The walk: a path for error messages, and the options.

struct walker {
  Path path;
  from_value_options options;

  [[nodiscard]] std::string where() const { return path.empty() ? std::string("top level") : "field " + quote(dotted(path)); }
  [[noreturn]] void fail(const error_id& id, std::string detail) const { throw_error(id, where(), std::move(detail)); }
  [[noreturn]] void kind_error(std::string_view expected, const Value& found) const {
    fail(errors::reflect_kind, "expected " + std::string(expected) + ", found " + std::string(to_string(found.kind())));
  }
};

/// Pushes one path element for the lifetime of the scope.
class path_scope {
 public:
  path_scope(walker& w, Key k) : w_(w) { w_.path.push_back(std::move(k)); }
  path_scope(const path_scope&) = delete;
  path_scope& operator=(const path_scope&) = delete;
  ~path_scope() { w_.path.pop_back(); }

 private:
  walker& w_;
};

template <class T, kind K = classify<T>()>
struct codec;

// ---- types that cannot be reflected: exactly one static_assert each (a class template is
// instantiated once per type, so using a type in both directions still reports it once).

template <class T, kind K>
struct rejected {
  static Value to(const T&, walker&) { return Value(); }
  [[noreturn]] static T from(const Value&, walker&) { std::terminate(); }
  static std::string expected() { return {}; }
};

// clang-format off
template <class T> struct codec<T, kind::pointer> : rejected<T, kind::pointer> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: a pointer member cannot go into a state dict (it does not own what it points to). "
    "Fix: hold the value itself, or use std::optional<T>, std::vector<T>, std::string, Tensor or TensorView.");
};
template <class T> struct codec<T, kind::string_view> : rejected<T, kind::string_view> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: a std::string_view member does not own its text, so from_value could not fill it. "
    "Fix: use std::string.");
};
template <class T> struct codec<T, kind::map_key> : rejected<T, kind::map_key> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: std::map keys must be std::string or an integer type (state dict keys are str or int). "
    "Fix: change the key type, or specialise statedict::value_codec for the map.");
};
template <class T> struct codec<T, kind::union_> : rejected<T, kind::union_> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: a union cannot be reflected (which member is active is not known). "
    "Fix: use a struct, or specialise statedict::value_codec for the union.");
};
template <class T> struct codec<T, kind::c_array> : rejected<T, kind::c_array> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: C arrays cannot be reflected. Fix: use std::array<T, N> (a tuple) or std::vector<T> (a list).");
};
template <class T> struct codec<T, kind::reference> : rejected<T, kind::reference> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: reference members cannot be reflected (from_value could not make one). Fix: hold the value.");
};
template <class T> struct codec<T, kind::not_default_constructible> : rejected<T, kind::not_default_constructible> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: from_value fills a described class member by member, so it must be default-constructible. "
    "Fix: add a default constructor, or specialise statedict::value_codec for the class.");
};
template <class T> struct codec<T, kind::no_names> : rejected<T, kind::no_names> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: this aggregate has no field names: STATEDICT_REFLECT_NO_NAME_EXTRACTOR is defined (or the "
    "compiler has no __PRETTY_FUNCTION__). Fix: describe it with BOOST_DESCRIBE_STRUCT(Type, (), (field1, field2, ...)).");
};
template <class T> struct codec<T, kind::other> : rejected<T, kind::other> {
  static_assert(this_type_cannot_be_reflected<T>,
    "statedict/reflect.hpp: this type has no mapping to a Value (the type is named in the instantiation notes). "
    "Supported: bool, integers, enums, float, double, std::string, Bytes, Tensor, TensorView, Value, std::optional, "
    "std::vector, std::array, std::pair, std::tuple, std::map<std::string or integer, T>, and aggregates or "
    "BOOST_DESCRIBE_STRUCT structs of these. Fix: change the member's type, make the class an aggregate or describe "
    "it, or specialise statedict::value_codec<T> (static Value to(const T&); static T from(const Value&)).");
};
// clang-format on

// ---- leaves

template <class T>
struct codec<T, kind::user> {
  static Value to(const T& x, walker& w) {
    try {
      return value_codec<T>::to(x);
    } catch (error& e) {
      if (!w.path.empty()) e.add_context(w.where());
      throw;
    }
  }
  static T from(const Value& v, walker& w) {
    try {
      return value_codec<T>::from(v);
    } catch (error& e) {
      if (!w.path.empty()) e.add_context(w.where());
      throw;
    }
  }
  static std::string expected() { return "a value for a custom codec"; }
};

template <class T>
struct codec<T, kind::value> {
  static Value to(const Value& x, walker&) { return x; }
  static Value from(const Value& v, walker&) { return v; }
  static std::string expected() { return "any value"; }
};

template <class T>
struct codec<T, kind::boolean> {
  static Value to(bool x, walker&) { return Value(x); }
  static bool from(const Value& v, walker& w) {
    if (!v.is_bool()) w.kind_error(expected(), v);
    return v.as_bool();
  }
  static std::string expected() { return "bool"; }
};

/// Integer conversions shared by integer members and integer map keys (`what` prefixes messages).
template <integer T>
std::int64_t int64_of(T x, std::string_view what, const walker& w) {
  const auto i = static_cast<plain_integer<T>>(x);
  if (!std::in_range<std::int64_t>(i))
    w.fail(errors::reflect_range, std::string(what) + std::to_string(i) + " does not fit a state dict int (int64)");
  return static_cast<std::int64_t>(i);
}
template <integer T>
T int_from(std::int64_t i, std::string_view what, const walker& w) {
  using I = plain_integer<T>;
  if (!std::in_range<I>(i))
    w.fail(errors::reflect_range, std::string(what) + std::to_string(i) + " is outside [" +
                                      std::to_string(std::numeric_limits<I>::min()) + ", " +
                                      std::to_string(std::numeric_limits<I>::max()) + "]");
  return static_cast<T>(i);
}

template <class T>
struct codec<T, kind::integer> {
  static Value to(T x, walker& w) { return Value(int64_of(x, "", w)); }
  static T from(const Value& v, walker& w) {
    if (!v.is_int()) w.kind_error(expected(), v);
    return int_from<T>(v.as_int(), "", w);
  }
  static std::string expected() { return "int"; }
};

template <class T>
struct codec<T, kind::enumeration> {
  using U = std::underlying_type_t<T>;
  static Value to(T x, walker& w) { return codec<U>::to(static_cast<U>(x), w); }
  static T from(const Value& v, walker& w) { return static_cast<T>(codec<U>::from(v, w)); }
  static std::string expected() { return "int"; }
};

template <class T>
struct codec<T, kind::floating> {
  static Value to(T x, walker&) { return Value(static_cast<double>(x)); }
  static T from(const Value& v, walker& w) {
    double d = 0;
    if (v.is_double())
      d = v.as_double();
    else if (v.is_int())
      d = static_cast<double>(v.as_int());
    else
      w.kind_error(expected(), v);
    if constexpr (std::is_same_v<T, float>) {
      // Values from 2^128 - 2^103 up round to inf in f32: refuse instead of changing the number.
      if (std::isfinite(d) && std::fabs(d) >= 0x1.ffffffp127)
        w.fail(errors::reflect_range, std::to_string(d) + " overflows float");
      return static_cast<float>(d);
    } else {
      return d;
    }
  }
  static std::string expected() { return "float (or int)"; }
};

template <class T>
struct codec<T, kind::string> {
  static Value to(const std::string& x, walker&) { return Value(x); }
  static std::string from(const Value& v, walker& w) {
    if (!v.is_string()) w.kind_error(expected(), v);
    return v.as_string();
  }
  static std::string expected() { return "str"; }
};

template <class T>
struct codec<T, kind::bytes> {
  static Value to(const Bytes& x, walker&) { return Value(x); }
  static Bytes from(const Value& v, walker& w) {
    if (!v.is_bytes()) w.kind_error(expected(), v);
    return v.as_bytes();
  }
  static std::string expected() { return "bytes"; }
};

template <class T>
struct codec<T, kind::tensor_view> {
  static Value to(const TensorView& x, walker&) { return Value(x); }
  static TensorView from(const Value& v, walker& w) {
    if (!v.is_tensor()) w.kind_error(expected(), v);
    return v.as_tensor();
  }
  static std::string expected() { return "tensor"; }
};

template <class T>
struct codec<T, kind::tensor> {
  static Value to(const Tensor& x, walker&) { return Value(x.view()); }
  static Tensor from(const Value& v, walker& w) {
    if (!v.is_tensor()) w.kind_error(expected(), v);
    return Tensor::copy_of(v.as_tensor());
  }
  static std::string expected() { return "tensor"; }
};

// ---- containers

template <class T>
struct codec<T, kind::optional> {
  using U = typename T::value_type;
  static Value to(const T& x, walker& w) { return x ? codec<U>::to(*x, w) : Value(); }
  static T from(const Value& v, walker& w) {
    if (v.is_none()) return std::nullopt;
    return codec<U>::from(v, w);
  }
  static std::string expected() { return "None or " + codec<U>::expected(); }
};

template <class T>
struct codec<T, kind::vector> {
  using U = typename T::value_type;
  static Value to(const T& x, walker& w) {
    List items;
    items.reserve(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      path_scope s(w, i);
      if constexpr (std::is_same_v<U, bool>)
        items.emplace_back(static_cast<bool>(x[i]));
      else
        items.push_back(codec<U>::to(x[i], w));
    }
    return Value::list(std::move(items));
  }
  static T from(const Value& v, walker& w) {
    if (!v.is_sequence()) w.kind_error(expected(), v);
    const List& items = v.as_list();
    T out;
    out.reserve(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      path_scope s(w, i);
      out.push_back(codec<U>::from(items[i], w));
    }
    return out;
  }
  static std::string expected() { return "list (or tuple) of " + codec<U>::expected(); }
};

template <class T>
struct codec<T, kind::fixed_tuple> {
  static constexpr std::size_t n = std::tuple_size_v<T>;
  template <std::size_t I>
  using element = std::remove_cv_t<std::tuple_element_t<I, T>>;

  static Value to(const T& x, walker& w) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      List items;
      items.reserve(n);
      (items.push_back(element_to<I>(x, w)), ...);
      return Value::tuple(std::move(items));
    }(std::make_index_sequence<n>{});
  }
  static T from(const Value& v, walker& w) {
    if (!v.is_sequence()) w.kind_error(expected(), v);
    const List& items = v.as_list();
    if (items.size() != n)
      w.fail(errors::reflect_length, "expected " + std::to_string(n) + " items, found " + std::to_string(items.size()));
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return T{element_from<I>(items[I], w)...};
    }(std::make_index_sequence<n>{});
  }
  static std::string expected() { return "tuple (or list) of " + std::to_string(n); }

 private:
  template <std::size_t I>
  static Value element_to(const T& x, walker& w) {
    path_scope s(w, I);
    return codec<element<I>>::to(std::get<I>(x), w);
  }
  template <std::size_t I>
  static element<I> element_from(const Value& v, walker& w) {
    path_scope s(w, I);
    return codec<element<I>>::from(v, w);
  }
};

template <class T>
struct codec<T, kind::map> {
  using K = typename T::key_type;
  using U = typename T::mapped_type;
  static Value to(const T& x, walker& w) {
    Dict d;
    d.reserve(x.size());
    for (const auto& [k, v] : x) {
      Key key = make_key(k, w);
      path_scope s(w, key);
      d.insert(std::move(key), codec<U>::to(v, w));
    }
    return Value(std::move(d));
  }
  static T from(const Value& v, walker& w) {
    if (!v.is_dict()) w.kind_error(expected(), v);
    T out;
    for (const auto& [k, item] : v.as_dict()) {
      path_scope s(w, k);
      out.emplace(read_key(k, w), codec<U>::from(item, w));
    }
    return out;
  }
  static std::string expected() { return std::string("dict with ") + (integer<K> ? "int" : "str") + " keys"; }

 private:
  static Key make_key(const K& k, walker& w) {
    if constexpr (integer<K>)
      return Key(int64_of(k, "map key ", w));
    else
      return Key(k);
  }
  static K read_key(const Key& k, walker& w) {
    if constexpr (integer<K>) {
      if (!k.is_int()) w.fail(errors::reflect_key_kind, "key " + quote(k.str()) + " is a str; this map has int keys");
      return int_from<K>(k.as_int(), "key ", w);
    } else {
      if (!k.is_string()) w.fail(errors::reflect_key_kind, "key " + k.str() + " is an int; this map has str keys");
      return k.as_string();
    }
  }
};

// ---- structs

/// Shared by described structs and aggregates: the dict checks.
template <std::size_t N>
inline const Dict& struct_dict(const Value& v, const std::array<std::string_view, N>& names, walker& w) {
  if (!v.is_dict()) w.kind_error("dict (a struct's fields)", v);
  const Dict& d = v.as_dict();
  if (!w.options.ignore_unknown_fields) {
    for (const auto& item : d) {
      const Key& k = item.first;
      bool known = false;
      if (k.is_string())
        for (std::string_view n : names) known = known || n == k.as_string();
      if (!known) {
        std::string fields;
        for (std::string_view n : names) fields += (fields.empty() ? "" : ", ") + std::string(n);
        w.fail(errors::reflect_unknown_field,
               "key " + (k.is_int() ? k.str() : quote(k.str())) + " names no field (fields: " + fields + ")");
      }
    }
  }
  return d;
}

/// Reads one field: a missing key is nullopt for std::optional members, an error otherwise.
template <class F>
F read_field(const Dict& d, std::string_view name, walker& w) {
  const Value* v = d.find(Key(name));
  if (v == nullptr) {
    if constexpr (is_optional<F>::value)
      return std::nullopt;
    else
      w.fail(errors::reflect_missing_field, "missing field " + quote(name) + " (" + codec<F>::expected() + ")");
  }
  path_scope s(w, Key(name));
  return codec<F>::from(*v, w);
}

template <class T>
using described_members = boost::describe::describe_members<
    T, boost::describe::mod_public | boost::describe::mod_protected | boost::describe::mod_private | boost::describe::mod_inherited>;

template <class T>
struct codec<T, kind::described> {
  static constexpr std::array<std::string_view, boost::mp11::mp_size<described_members<T>>::value> names() {
    return []<template <class...> class L, class... D>(L<D...>) {
      return std::array<std::string_view, sizeof...(D)>{std::string_view(D::name)...};
    }(described_members<T>{});
  }
  static Value to(const T& x, walker& w) {
    Dict d;
    boost::mp11::mp_for_each<described_members<T>>([&](auto D) {
      using F = std::remove_cvref_t<decltype(x.*D.pointer)>;
      path_scope s(w, Key(D.name));
      d.insert(Key(D.name), codec<F>::to(x.*D.pointer, w));
    });
    return Value(std::move(d));
  }
  static T from(const Value& v, walker& w) {
    const Dict& d = struct_dict(v, names(), w);
    T out{};
    boost::mp11::mp_for_each<described_members<T>>([&](auto D) {
      using F = std::remove_cvref_t<decltype(out.*D.pointer)>;
      out.*D.pointer = read_field<F>(d, D.name, w);
    });
    return out;
  }
  static std::string expected() { return "dict (a struct's fields)"; }
};

#if !defined(STATEDICT_REFLECT_NO_NAME_EXTRACTOR)
template <class T>
struct codec<T, kind::aggregate> {
  static constexpr std::size_t n = boost::pfr::tuple_size_v<T>;
  template <std::size_t I>
  using field = std::remove_cv_t<boost::pfr::tuple_element_t<I, T>>;
  static constexpr std::array<std::string_view, n> names() { return extracted_names<T>(std::make_index_sequence<n>{}); }

  static Value to(const T& x, walker& w) {
    Dict d;
    d.reserve(n);
    [&]<std::size_t... I>(std::index_sequence<I...>) { (field_to<I>(x, d, w), ...); }(std::make_index_sequence<n>{});
    return Value(std::move(d));
  }
  static T from(const Value& v, walker& w) {
    const Dict& d = struct_dict(v, names(), w);
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return T{read_field<field<I>>(d, names()[I], w)...};  // braced: evaluated in field order
    }(std::make_index_sequence<n>{});
  }
  static std::string expected() { return "dict (a struct's fields)"; }

 private:
  template <std::size_t I>
  static void field_to(const T& x, Dict& d, walker& w) {
    constexpr std::string_view name = names()[I];
    static_assert(!name.empty(),
                  "statedict/reflect.hpp: could not read the name of a field of this aggregate (a bit-field?). "
                  "Fix: describe the struct with BOOST_DESCRIBE_STRUCT.");
    path_scope s(w, Key(name));
    d.insert(Key(name), codec<field<I>>::to(boost::pfr::get<I>(x), w));
  }
};

// The extractor checks itself on this compiler, once, when the header is included.
namespace selfcheck {
struct inner {
  int x;
};
template <class U>
struct probe {
  inner first;
  U second_field;
  std::map<std::string, std::pair<int, long>> _3rd;
};
}  // namespace selfcheck
static_assert(codec<selfcheck::probe<std::pair<int, std::string>>>::names() ==
                      std::array<std::string_view, 3>{"first", "second_field", "_3rd"} &&
                  codec<selfcheck::inner>::names() == std::array<std::string_view, 1>{"x"},
              "statedict/reflect.hpp: the field-name extractor (__PRETTY_FUNCTION__ of a template whose argument points "
              "into a fake object) does not read field names correctly with this compiler. Fix: describe your structs "
              "with BOOST_DESCRIBE_STRUCT(Type, (), (fields...)) and define STATEDICT_REFLECT_NO_NAME_EXTRACTOR before "
              "including <statedict/reflect.hpp>; please also report the compiler and its version.");
#endif  // !STATEDICT_REFLECT_NO_NAME_EXTRACTOR

}  // namespace detail::reflect

/// The Value of `x`: a dict of its fields for a struct (recursively), see the table at the top of
/// this header. Throws errors::reflect_range when an unsigned integer does not fit int64.
template <class T>
Value to_value(const T& x) {
  detail::reflect::walker w;
  return detail::reflect::codec<T>::to(x, w);
}

/// The T that `v` describes (the inverse of to_value). Errors name the field path and what was
/// expected: `[statedict.type_error.240] field 'optim.betas': expected tuple (or list) of 2, found str`.
template <class T>
T from_value(const Value& v, const from_value_options& options = {}) {
  detail::reflect::walker w{{}, options};
  return detail::reflect::codec<T>::from(v, w);
}

/// The field names reflect.hpp uses for the struct T, in order (Boost.Describe's for described
/// structs, the extracted ones for other aggregates).
template <class T>
  requires(detail::reflect::classify<T>() == detail::reflect::kind::described ||
           detail::reflect::classify<T>() == detail::reflect::kind::aggregate)
constexpr auto field_names() noexcept {
  return detail::reflect::codec<T>::names();
}

}  // namespace statedict::inline v0
