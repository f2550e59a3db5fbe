// statedict: element-wise dtype casts over runs of (possibly misaligned) bytes.
// SPDX-License-Identifier: MIT
//
// Casts that exist: any dtype to itself; between the real floating dtypes (F8_E4M3, F8_E5M2, F16,
// BF16, F32, F64), rounding to nearest even exactly as PyTorch (a double narrower than f32 is first
// rounded to f32, as PyTorch's `Half(double)`/`BFloat16(double)` do); C64 <-> C128. Integer casts are
// not offered: a checkpoint converter must not silently change integer data.
#pragma once

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

inline float load_as_f32(dtype t, const std::byte* p) noexcept {
  switch (t) {
    case dtype::F32: return load_unaligned<float>(p);
    case dtype::BF16: return f32_from_bf16(load_unaligned<std::uint16_t>(p));
    case dtype::F16: return f32_from_f16(load_unaligned<std::uint16_t>(p));
    case dtype::F8_E4M3: return f32_from_f8e4m3(load_unaligned<std::uint8_t>(p));
    case dtype::F8_E5M2: return f32_from_f8e5m2(load_unaligned<std::uint8_t>(p));
    case dtype::F64: return static_cast<float>(load_unaligned<double>(p));
    default: return 0.0F;
  }
}

inline void store_from_f32(dtype t, std::byte* p, float f) noexcept {
  switch (t) {
    case dtype::F32: store_unaligned(p, f); break;
    case dtype::BF16: store_unaligned(p, bf16_from_f32(f)); break;
    case dtype::F16: store_unaligned(p, f16_from_f32(f)); break;
    case dtype::F8_E4M3: store_unaligned(p, f8e4m3_from_f32(f)); break;
    case dtype::F8_E5M2: store_unaligned(p, f8e5m2_from_f32(f)); break;
    case dtype::F64: store_unaligned(p, static_cast<double>(f)); break;
    default: break;
  }
}

/// Tight loop for one (from, to) pair, so the compiler can specialise and vectorise it.
template <class Load, class Store>
inline void cast_loop(const std::byte* src, std::size_t src_size, std::byte* dst, std::size_t dst_size, std::size_t n,
                      Load load, Store store) noexcept {
  for (std::size_t i = 0; i < n; ++i) store(dst + i * dst_size, load(src + i * src_size));
}
}  // namespace detail

/// Casts `n` contiguous elements from `src` (dtype `from`) to `dst` (dtype `to`). Neither pointer
/// needs any alignment. The ranges must not overlap unless from == to and src == dst.
inline void cast_run(dtype from, const std::byte* src, dtype to, std::byte* dst, std::size_t n) {
  using namespace detail;
  if (from == to) {
    if (n && src != dst) std::memmove(dst, src, n * itemsize(from));
    return;
  }
  check_cast(from, to);
  const std::size_t ss = itemsize(from), ds = itemsize(to);
  if (info(from).is_complex) {  // C64 <-> C128
    if (from == dtype::C64)
      cast_loop(src, ss, dst, ds, n, load_unaligned<std::complex<float>>, [](std::byte* p, std::complex<float> v) {
        store_unaligned(p, std::complex<double>(v));
      });
    else
      cast_loop(src, ss, dst, ds, n, load_unaligned<std::complex<double>>, [](std::byte* p, std::complex<double> v) {
        store_unaligned(p, std::complex<float>(v));
      });
    return;
  }
  // Hot pairs get their own loops.
  if (from == dtype::F32 && to == dtype::BF16)
    return cast_loop(src, ss, dst, ds, n, load_unaligned<float>,
                     [](std::byte* p, float f) { store_unaligned(p, bf16_from_f32(f)); });
  if (from == dtype::F32 && to == dtype::F16)
    return cast_loop(src, ss, dst, ds, n, load_unaligned<float>,
                     [](std::byte* p, float f) { store_unaligned(p, f16_from_f32(f)); });
  if (from == dtype::BF16 && to == dtype::F32)
    return cast_loop(src, ss, dst, ds, n, load_unaligned<std::uint16_t>,
                     [](std::byte* p, std::uint16_t h) { store_unaligned(p, f32_from_bf16(h)); });
  if (from == dtype::F16 && to == dtype::F32)
    return cast_loop(src, ss, dst, ds, n, load_unaligned<std::uint16_t>,
                     [](std::byte* p, std::uint16_t h) { store_unaligned(p, f32_from_f16(h)); });
  if (to == dtype::F64) {
    for (std::size_t i = 0; i < n; ++i) store_unaligned(dst + i * ds, static_cast<double>(load_as_f32(from, src + i * ss)));
    return;
  }
  // Everything else goes through f32 (exact for every source narrower than F64; F64 sources are
  // rounded to f32 first, as PyTorch does).
  for (std::size_t i = 0; i < n; ++i) store_from_f32(to, dst + i * ds, load_as_f32(from, src + i * ss));
}

}  // namespace statedict::inline v0
