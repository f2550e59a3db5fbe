// statedict: element-wise dtype casts over runs of (possibly misaligned) bytes.
// SPDX-License-Identifier: MIT
//
// Casts that exist: any dtype to itself; between the real floating dtypes (F8_E4M3, F8_E5M2,
// F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0, F16, BF16, F32, F64), rounding exactly as PyTorch (to nearest
// even; a double narrower than f32 is first rounded to f32, as PyTorch's `Half(double)`/
// `BFloat16(double)` do); between the complex dtypes C32, C64, C128. Integer casts are not
// offered: a checkpoint converter must not silently change integer data; nor are casts of the
// packed (F4_X2, F6_*_X4) and bits types, whose elements are not single numbers.
//
// The bytes are those `tensor.to(dtype)` writes in PyTorch 1.13 on an x86 CPU, NaNs included
// (tests/interop-dtype.cpp compares against tables PyTorch wrote): a NaN cast to BF16 from F32 or
// F64 is 0xffff (ATen's vectorised kernel), from F16 or F8 0x7fc0 (c10's scalar conversion); to
// F16 it is 0x7e00 with the sign; F16 -> F32 sets the quiet bit.
#pragma once

#include <bit>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "dtype.hpp"
#include "error.hpp"

namespace statedict::inline v0 {

/// True when `cast_run(from, ..., to, ...)` is defined.
constexpr bool can_cast(dtype from, dtype to) noexcept {
  if (from == to) return true;
  if (is_floating(from) && is_floating(to)) return true;
  return info(from).is_complex && info(to).is_complex;
}

/// Throws errors::unsupported_cast when `from` cannot be cast to `to`.
inline void check_cast(dtype from, dtype to) {
  if (!can_cast(from, to))
    throw_error(errors::unsupported_cast, "no exact cast from " + std::string(name(from)) + " to " + std::string(name(to)) +
                                              " (casts exist between floating dtypes and between complex dtypes)");
}

namespace detail {
template <class T>
inline T load_unaligned(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void store_unaligned(std::byte* p, T v) noexcept {
  std::memcpy(p, &v, sizeof(T));
}

/// How one real floating dtype is stored (its bit container) and converted through f32, which
/// holds every value of the narrower formats exactly.
template <dtype D>
struct float_codec;
template <>
struct float_codec<dtype::F32> {
  using storage = float;
  static constexpr float widen(float x) noexcept { return x; }
  static constexpr float narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f; }
};
template <>
struct float_codec<dtype::BF16> {
  using storage = std::uint16_t;
  static constexpr float widen(std::uint16_t x) noexcept { return f32_from_bf16(x); }
  static constexpr std::uint16_t narrow(float f, std::uint16_t nan) noexcept { return bf16_from_f32(f, nan); }
};
template <>
struct float_codec<dtype::F16> {
  using storage = std::uint16_t;
  static constexpr float widen(std::uint16_t x) noexcept { return f32_from_f16(x); }
  static constexpr std::uint16_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f16_from_f32(f); }
};
template <>
struct float_codec<dtype::F8_E4M3> {
  using storage = std::uint8_t;
  static constexpr float widen(std::uint8_t x) noexcept { return f32_from_f8e4m3(x); }
  static constexpr std::uint8_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f8e4m3_from_f32(f); }
};
template <>
struct float_codec<dtype::F8_E5M2> {
  using storage = std::uint8_t;
  static constexpr float widen(std::uint8_t x) noexcept { return f32_from_f8e5m2(x); }
  static constexpr std::uint8_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f8e5m2_from_f32(f); }
};
template <>
struct float_codec<dtype::F8_E4M3FNUZ> {
  using storage = std::uint8_t;
  static constexpr float widen(std::uint8_t x) noexcept { return f32_from_f8e4m3fnuz(x); }
  static constexpr std::uint8_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f8e4m3fnuz_from_f32(f); }
};
template <>
struct float_codec<dtype::F8_E5M2FNUZ> {
  using storage = std::uint8_t;
  static constexpr float widen(std::uint8_t x) noexcept { return f32_from_f8e5m2fnuz(x); }
  static constexpr std::uint8_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f8e5m2fnuz_from_f32(f); }
};
template <>
struct float_codec<dtype::F8_E8M0> {
  using storage = std::uint8_t;
  static constexpr float widen(std::uint8_t x) noexcept { return f32_from_f8e8m0(x); }
  static constexpr std::uint8_t narrow(float f, std::uint16_t /*bf16 nan*/) noexcept { return f8e8m0_from_f32(f); }
};
template <>
struct float_codec<dtype::F64> {
  using storage = double;
};

/// One element From -> To, as PyTorch's CPU tensor cast computes it.
template <dtype From, dtype To>
constexpr typename float_codec<To>::storage convert_float(typename float_codec<From>::storage x) noexcept {
  if constexpr (From == To) {
    return x;
  } else if constexpr (To == dtype::F64) {
    return static_cast<double>(float_codec<From>::widen(x));
  } else if constexpr (From == dtype::F64) {
    // Rounded to f32 first, then to the narrower format (PyTorch's `Half(double)` and
    // `BFloat16(double)` take a float): two roundings, which a single rounding can differ from.
    return float_codec<To>::narrow(static_cast<float>(x), bf16_nan_vectorised);
  } else {
    // To bf16, NaN is written as PyTorch writes it for this source: 0xffff by the vectorised f32
    // kernel, 0x7fc0 by the scalar conversion it uses for the narrower sources.
    constexpr std::uint16_t nan = From == dtype::F32 ? bf16_nan_vectorised : bf16_nan_scalar;
    return float_codec<To>::narrow(float_codec<From>::widen(x), nan);
  }
}

/// Casts n elements From -> To between byte buffers of any alignment. Elements go through small
/// aligned blocks on the stack, so the conversion loop itself works on typed, non-aliasing arrays
/// and vectorises; the copies in and out are memcpy.
template <dtype From, dtype To>
inline void cast_floats(const std::byte* src, std::byte* dst, std::size_t n) noexcept {
  using S = typename float_codec<From>::storage;
  using D = typename float_codec<To>::storage;
  constexpr std::size_t block = 1024;
  alignas(64) S in[block];
  alignas(64) D out[block];
  for (std::size_t done = 0; done < n;) {
    const std::size_t k = n - done < block ? n - done : block;
    std::memcpy(in, src + done * sizeof(S), k * sizeof(S));
    for (std::size_t i = 0; i < k; ++i) out[i] = convert_float<From, To>(in[i]);
    std::memcpy(dst + done * sizeof(D), out, k * sizeof(D));
    done += k;
  }
}

template <dtype From>
inline void cast_floats_from(const std::byte* src, dtype to, std::byte* dst, std::size_t n) noexcept {
  switch (to) {
    case dtype::F32: return cast_floats<From, dtype::F32>(src, dst, n);
    case dtype::BF16: return cast_floats<From, dtype::BF16>(src, dst, n);
    case dtype::F16: return cast_floats<From, dtype::F16>(src, dst, n);
    case dtype::F64: return cast_floats<From, dtype::F64>(src, dst, n);
    case dtype::F8_E4M3: return cast_floats<From, dtype::F8_E4M3>(src, dst, n);
    case dtype::F8_E5M2: return cast_floats<From, dtype::F8_E5M2>(src, dst, n);
    case dtype::F8_E4M3FNUZ: return cast_floats<From, dtype::F8_E4M3FNUZ>(src, dst, n);
    case dtype::F8_E5M2FNUZ: return cast_floats<From, dtype::F8_E5M2FNUZ>(src, dst, n);
    case dtype::F8_E8M0: return cast_floats<From, dtype::F8_E8M0>(src, dst, n);
    default: return;  // not floating: refused by check_cast before
  }
}

/// complex32 (two f16) <-> complex64 / complex128, component by component as PyTorch's
/// c10::complex<Half> conversions do (through f32). Unlike the real f32 -> f16 tensor cast, which
/// writes every NaN as 0x7e00, this scalar conversion keeps the top 10 payload bits of a NaN
/// (quiet bit set), as torch 2.14 does.
inline void cast_complex_half(const std::byte* src, dtype from, std::byte* dst, dtype to, std::size_t n) noexcept {
  for (std::size_t i = 0; i < 2 * n; ++i) {
    if (from == dtype::C32) {
      const float f = f32_from_f16(load_unaligned<std::uint16_t>(src + i * 2));
      if (to == dtype::C64) store_unaligned(dst + i * 4, f);
      else store_unaligned(dst + i * 8, static_cast<double>(f));
    } else {
      const float f = from == dtype::C64 ? load_unaligned<float>(src + i * 4) : static_cast<float>(load_unaligned<double>(src + i * 8));
      const auto u = std::bit_cast<std::uint32_t>(f);
      std::uint16_t h = f16_from_f32(f);
      if ((u & 0x7fffffffU) > 0x7f800000U) h = static_cast<std::uint16_t>(((u >> 16) & 0x8000U) | 0x7e00U | ((u >> 13) & 0x3ffU));
      store_unaligned(dst + i * 2, h);
    }
  }
}

template <class From, class To>
inline void cast_complex(const std::byte* src, std::byte* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = load_unaligned<std::complex<From>>(src + i * sizeof(std::complex<From>));
    store_unaligned(dst + i * sizeof(std::complex<To>),
                    std::complex<To>(static_cast<To>(v.real()), static_cast<To>(v.imag())));
  }
}
}  // namespace detail

/// Reverses the byte order of `n` contiguous elements of dtype `t` in place: each element (each
/// component of a complex one) of info(t).swap_unit bytes; nothing for one-byte units. Turns the
/// elements of a big-endian file into little-endian ones (and back).
inline void byteswap_run(dtype t, std::byte* p, std::size_t n) noexcept {
  const std::size_t unit = info(t).swap_unit;
  const std::size_t count = n * (itemsize(t) / unit);
  switch (unit) {
    case 2:
      for (std::size_t i = 0; i < count; ++i) detail::store_unaligned(p + 2 * i, __builtin_bswap16(detail::load_unaligned<std::uint16_t>(p + 2 * i)));
      return;
    case 4:
      for (std::size_t i = 0; i < count; ++i) detail::store_unaligned(p + 4 * i, __builtin_bswap32(detail::load_unaligned<std::uint32_t>(p + 4 * i)));
      return;
    case 8:
      for (std::size_t i = 0; i < count; ++i) detail::store_unaligned(p + 8 * i, __builtin_bswap64(detail::load_unaligned<std::uint64_t>(p + 8 * i)));
      return;
    default: return;  // one-byte units: nothing to swap
  }
}

/// Casts `n` contiguous elements from `src` (dtype `from`) to `dst` (dtype `to`), producing the bytes
/// `tensor.to(dtype)` produces in PyTorch 1.13 on a CPU (NaN encodings included). Neither pointer
/// needs any alignment. The ranges must not overlap unless from == to and src == dst.
inline void cast_run(dtype from, const std::byte* src, dtype to, std::byte* dst, std::size_t n) {
  using namespace detail;
  if (from == to) {
    if (n && src != dst) std::memmove(dst, src, n * itemsize(from));
    return;
  }
  check_cast(from, to);
  switch (from) {
    case dtype::F32: return cast_floats_from<dtype::F32>(src, to, dst, n);
    case dtype::BF16: return cast_floats_from<dtype::BF16>(src, to, dst, n);
    case dtype::F16: return cast_floats_from<dtype::F16>(src, to, dst, n);
    case dtype::F64: return cast_floats_from<dtype::F64>(src, to, dst, n);
    case dtype::F8_E4M3: return cast_floats_from<dtype::F8_E4M3>(src, to, dst, n);
    case dtype::F8_E5M2: return cast_floats_from<dtype::F8_E5M2>(src, to, dst, n);
    case dtype::F8_E4M3FNUZ: return cast_floats_from<dtype::F8_E4M3FNUZ>(src, to, dst, n);
    case dtype::F8_E5M2FNUZ: return cast_floats_from<dtype::F8_E5M2FNUZ>(src, to, dst, n);
    case dtype::F8_E8M0: return cast_floats_from<dtype::F8_E8M0>(src, to, dst, n);
    case dtype::C32: return cast_complex_half(src, from, dst, to, n);
    case dtype::C64:
      if (to == dtype::C32) return cast_complex_half(src, from, dst, to, n);
      return cast_complex<float, double>(src, dst, n);
    case dtype::C128:
      if (to == dtype::C32) return cast_complex_half(src, from, dst, to, n);
      return cast_complex<double, float>(src, dst, n);
    default: return;  // refused by check_cast
  }
}

}  // namespace statedict::inline v0
