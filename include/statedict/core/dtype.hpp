// statedict: element types, their names in every format, and exact float conversions.
// SPDX-License-Identifier: MIT
#pragma once

#include <array>
#include <bit>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "error.hpp"

namespace statedict::inline v0 {

/// Element types: every dtype of safetensors and of PyTorch's torch.save files. C128, C32 and the
/// bits types are PyTorch's only (safetensors cannot store them); F6_E2M3_X4 and F6_E3M2_X4 are
/// safetensors' only (PyTorch has no 6-bit dtype). New dtypes are appended, so the numbering of
/// the older ones never changes.
enum class dtype : std::uint8_t {
  BOOL,
  U8,
  I8,
  I16,
  U16,
  I32,
  U32,
  I64,
  U64,
  F16,
  BF16,
  F32,
  F64,
  F8_E4M3,
  F8_E5M2,
  C64,
  C128,
  F8_E4M3FNUZ,  ///< torch.float8_e4m3fnuz: bias 8, NaN = 0x80 only, no infinities, no -0
  F8_E5M2FNUZ,  ///< torch.float8_e5m2fnuz: bias 16, NaN = 0x80 only, no infinities, no -0
  F8_E8M0,      ///< torch.float8_e8m0fnu: 2^(x - 127), unsigned, 0xff = NaN (OCP MX scales)
  F4_X2,        ///< torch.float4_e2m1fn_x2: one byte, two packed e2m1 values (safetensors F4)
  F6_E2M3_X4,   ///< safetensors F6_E2M3: three bytes, four packed 6-bit values
  F6_E3M2_X4,   ///< safetensors F6_E3M2: three bytes, four packed 6-bit values
  C32,          ///< torch.complex32 (chalf): two f16
  BITS8,        ///< torch.bits8 and the other bits types: opaque bit containers
  BITS16,
  BITS1X8,
  BITS2X4,
  BITS4X2,
};

inline constexpr std::size_t dtype_count = 29;

/// Everything statedict knows about one dtype.
struct dtype_info {
  dtype id;
  std::uint8_t itemsize;              ///< bytes per element
  std::string_view name;              ///< safetensors name ("F32"), or statedict's own (C128, F4_X2, ...)
  std::string_view torch_name;        ///< `torch.<name>` global ("float32"); empty: PyTorch has no such dtype
  std::string_view storage_name;      ///< legacy typed storage class ("FloatStorage"); empty: UntypedStorage only
  std::int8_t safetensors_rank;       ///< position in safetensors' Dtype enum (its write order); -1: not storable
  bool is_floating;                   ///< real floating point that core/cast.hpp converts element by element
  bool is_complex;
  bool is_signed;                     ///< signed integer or floating
  /// Bytes swapped together when the element is stored in the other byte order: the itemsize for
  /// numbers, the component size for complex, 1 for byte-packed types.
  std::uint8_t swap_unit;
  /// Values one element packs (F4_X2: 2, F6_*_X4: 4): safetensors counts values, not elements, in
  /// the last dimension of these.
  std::uint8_t packed;
};

namespace detail {
// safetensors' Dtype enum order is BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0,
// F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64; its writer sorts
// by that position, descending.
// clang-format off
inline constexpr std::array<dtype_info, dtype_count> dtype_table{{
  {dtype::BOOL,        1, "BOOL",        "bool",            "BoolStorage",          0,  false, false, false, 1, 1},
  {dtype::U8,          1, "U8",          "uint8",           "ByteStorage",          4,  false, false, false, 1, 1},
  {dtype::I8,          1, "I8",          "int8",            "CharStorage",          5,  false, false, true,  1, 1},
  {dtype::I16,         2, "I16",         "int16",           "ShortStorage",         11, false, false, true,  2, 1},
  {dtype::U16,         2, "U16",         "uint16",          "",                     12, false, false, false, 2, 1},
  {dtype::I32,         4, "I32",         "int32",           "IntStorage",           15, false, false, true,  4, 1},
  {dtype::U32,         4, "U32",         "uint32",          "",                     16, false, false, false, 4, 1},
  {dtype::I64,         8, "I64",         "int64",           "LongStorage",          20, false, false, true,  8, 1},
  {dtype::U64,         8, "U64",         "uint64",          "",                     21, false, false, false, 8, 1},
  {dtype::F16,         2, "F16",         "float16",         "HalfStorage",          13, true,  false, true,  2, 1},
  {dtype::BF16,        2, "BF16",        "bfloat16",        "BFloat16Storage",      14, true,  false, true,  2, 1},
  {dtype::F32,         4, "F32",         "float32",         "FloatStorage",         17, true,  false, true,  4, 1},
  {dtype::F64,         8, "F64",         "float64",         "DoubleStorage",        19, true,  false, true,  8, 1},
  {dtype::F8_E4M3,     1, "F8_E4M3",     "float8_e4m3fn",   "",                     7,  true,  false, true,  1, 1},
  {dtype::F8_E5M2,     1, "F8_E5M2",     "float8_e5m2",     "",                     6,  true,  false, true,  1, 1},
  {dtype::C64,         8, "C64",         "complex64",       "ComplexFloatStorage",  18, false, true,  true,  4, 1},
  {dtype::C128,       16, "C128",        "complex128",      "ComplexDoubleStorage", -1, false, true,  true,  8, 1},
  {dtype::F8_E4M3FNUZ, 1, "F8_E4M3FNUZ", "float8_e4m3fnuz", "",                     9,  true,  false, true,  1, 1},
  {dtype::F8_E5M2FNUZ, 1, "F8_E5M2FNUZ", "float8_e5m2fnuz", "",                     10, true,  false, true,  1, 1},
  {dtype::F8_E8M0,     1, "F8_E8M0",     "float8_e8m0fnu",  "",                     8,  true,  false, false, 1, 1},
  {dtype::F4_X2,       1, "F4_X2",       "float4_e2m1fn_x2", "",                    1,  false, false, true,  1, 2},
  {dtype::F6_E2M3_X4,  3, "F6_E2M3_X4",  "",                "",                     2,  false, false, true,  1, 4},
  {dtype::F6_E3M2_X4,  3, "F6_E3M2_X4",  "",                "",                     3,  false, false, true,  1, 4},
  {dtype::C32,         4, "C32",         "complex32",       "",                     -1, false, true,  true,  2, 1},
  {dtype::BITS8,       1, "BITS8",       "bits8",           "",                     -1, false, false, false, 1, 1},
  {dtype::BITS16,      2, "BITS16",      "bits16",          "",                     -1, false, false, false, 2, 1},
  {dtype::BITS1X8,     1, "BITS1X8",     "bits1x8",         "",                     -1, false, false, false, 1, 1},
  {dtype::BITS2X4,     1, "BITS2X4",     "bits2x4",         "",                     -1, false, false, false, 1, 1},
  {dtype::BITS4X2,     1, "BITS4X2",     "bits4x2",         "",                     -1, false, false, false, 1, 1},
}};
// clang-format on
static_assert([] {
  for (std::size_t i = 0; i < dtype_table.size(); ++i)
    if (static_cast<std::size_t>(dtype_table[i].id) != i) return false;
  return true;
}(), "dtype_table is indexed by dtype");
}  // namespace detail

constexpr const dtype_info& info(dtype t) noexcept { return detail::dtype_table[static_cast<std::size_t>(t)]; }
constexpr std::size_t itemsize(dtype t) noexcept { return info(t).itemsize; }
/// The safetensors name, used everywhere statedict prints a dtype ("F32", "BF16", ...).
constexpr std::string_view name(dtype t) noexcept { return info(t).name; }
constexpr bool is_floating(dtype t) noexcept { return info(t).is_floating; }

/// Parses a safetensors dtype name ("F32"). Unknown names give nullopt.
constexpr std::optional<dtype> dtype_from_name(std::string_view n) noexcept {
  for (const auto& i : detail::dtype_table)
    if (i.name == n) return i.id;
  return std::nullopt;
}

/// Parses a PyTorch dtype name as pickled (`torch.float32` global -> "float32"), including the
/// aliases PyTorch accepts ("float", "half", "long", "cfloat", ...).
constexpr std::optional<dtype> dtype_from_torch_name(std::string_view n) noexcept {
  for (const auto& i : detail::dtype_table)
    if (!i.torch_name.empty() && i.torch_name == n) return i.id;
  struct alias {
    std::string_view n;
    dtype t;
  };
  constexpr alias aliases[] = {{"float", dtype::F32},  {"double", dtype::F64},    {"half", dtype::F16},
                               {"long", dtype::I64},   {"int", dtype::I32},       {"short", dtype::I16},
                               {"cfloat", dtype::C64}, {"cdouble", dtype::C128},  {"chalf", dtype::C32}};
  for (const auto& a : aliases)
    if (a.n == n) return a.t;
  return std::nullopt;
}

/// Parses a legacy typed storage class name ("FloatStorage").
constexpr std::optional<dtype> dtype_from_storage_name(std::string_view n) noexcept {
  for (const auto& i : detail::dtype_table)
    if (!i.storage_name.empty() && i.storage_name == n) return i.id;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Element types for typed access. The 16- and 8-bit floats are bit containers; arithmetic goes
// through float with the exact conversions below.

struct bfloat16 {
  std::uint16_t bits;
  friend constexpr bool operator==(bfloat16, bfloat16) = default;
};
struct float16 {
  std::uint16_t bits;
  friend constexpr bool operator==(float16, float16) = default;
};
struct float8_e4m3 {
  std::uint8_t bits;
  friend constexpr bool operator==(float8_e4m3, float8_e4m3) = default;
};
struct float8_e5m2 {
  std::uint8_t bits;
  friend constexpr bool operator==(float8_e5m2, float8_e5m2) = default;
};

namespace detail {
template <class T>
struct dtype_of_impl;
// clang-format off
template <> struct dtype_of_impl<bool> { static constexpr dtype value = dtype::BOOL; };
template <> struct dtype_of_impl<std::uint8_t> { static constexpr dtype value = dtype::U8; };
template <> struct dtype_of_impl<std::int8_t> { static constexpr dtype value = dtype::I8; };
template <> struct dtype_of_impl<std::int16_t> { static constexpr dtype value = dtype::I16; };
template <> struct dtype_of_impl<std::uint16_t> { static constexpr dtype value = dtype::U16; };
template <> struct dtype_of_impl<std::int32_t> { static constexpr dtype value = dtype::I32; };
template <> struct dtype_of_impl<std::uint32_t> { static constexpr dtype value = dtype::U32; };
template <> struct dtype_of_impl<std::int64_t> { static constexpr dtype value = dtype::I64; };
template <> struct dtype_of_impl<std::uint64_t> { static constexpr dtype value = dtype::U64; };
template <> struct dtype_of_impl<float16> { static constexpr dtype value = dtype::F16; };
template <> struct dtype_of_impl<bfloat16> { static constexpr dtype value = dtype::BF16; };
template <> struct dtype_of_impl<float> { static constexpr dtype value = dtype::F32; };
template <> struct dtype_of_impl<double> { static constexpr dtype value = dtype::F64; };
template <> struct dtype_of_impl<float8_e4m3> { static constexpr dtype value = dtype::F8_E4M3; };
template <> struct dtype_of_impl<float8_e5m2> { static constexpr dtype value = dtype::F8_E5M2; };
template <> struct dtype_of_impl<std::complex<float>> { static constexpr dtype value = dtype::C64; };
template <> struct dtype_of_impl<std::complex<double>> { static constexpr dtype value = dtype::C128; };
// clang-format on
}  // namespace detail

/// The dtype of a C++ element type: `dtype_of<float>` is F32.
template <class T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

template <class T>
concept element_type = requires { detail::dtype_of_impl<std::remove_cv_t<T>>::value; };

// ---------------------------------------------------------------------------------------------
// Exact conversions, bit for bit what PyTorch 1.13 computes on a CPU (c10/util/BFloat16.h, Half.h,
// Float8_e4m3fn.h, Float8_e5m2.h, and ATen's vectorised cast kernel): round to nearest, ties to
// even. tests/interop-dtype.cpp checks them against tables written by PyTorch itself.
//
// The 16-bit conversions are written without branches (selects only), so that loops over them
// vectorise: cast_run converts multi-gigabyte checkpoints with them.

static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559,
              "statedict's float conversions assume IEEE 754 binary32/binary64 with round-to-nearest");

/// The bf16 bits PyTorch writes for a NaN. Its CPU tensor cast from f32 or f64 (ATen's vectorised
/// kernel, `tensor.to(torch.bfloat16)`) writes 0xffff whatever the NaN; the scalar
/// `c10::BFloat16(float)`, which the tensor cast uses from f16 (and which `torch.tensor(nan,
/// dtype=torch.bfloat16)` uses), writes 0x7fc0.
inline constexpr std::uint16_t bf16_nan_vectorised = 0xffff;
inline constexpr std::uint16_t bf16_nan_scalar = 0x7fc0;

/// f32 -> bf16; overflow rounds to inf. A NaN becomes `nan` (default: what `tensor.to(torch.bfloat16)`
/// writes for an f32 tensor, see bf16_nan_vectorised).
constexpr std::uint16_t bf16_from_f32(float f, std::uint16_t nan = bf16_nan_vectorised) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto rounded = static_cast<std::uint16_t>((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
  return (u & 0x7fffffffU) > 0x7f800000U ? nan : rounded;
}

/// bf16 -> f32, exact (NaN payloads kept, as PyTorch does: a bf16 is the top half of an f32).
constexpr float f32_from_bf16(std::uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

/// f32 -> f16 (IEEE binary16). NaN keeps its sign and becomes 0x7e00; from 65520 up rounds to inf.
constexpr std::uint16_t f16_from_f32(float f) noexcept {
  // Written as straight-line code that combines candidates with masks: with a branch, or a select
  // the compiler turns into one, GCC sinks the float addition below into it and then refuses to
  // vectorise the loop (a float operation "could trap").
  const auto u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000U;
  const std::uint32_t a = u & 0x7fffffffU;
  // Normal f16: rebias the exponent 127 -> 15 and round away 13 bits. Clamping at 65520 (0x477ff000,
  // which rounds to 0x7c00) sends everything larger, infinities and NaNs included, to inf.
  const std::uint32_t c = a < 0x477ff000U ? a : 0x477ff000U;
  const std::uint32_t r = c - 0x38000000U;
  const std::uint32_t normal = (r + 0x0fffU + ((r >> 13) & 1U)) >> 13;
  // Subnormal f16 (|f| < 2^-14): adding 0.5 leaves |f| rounded (to nearest even, by the FPU) to a
  // multiple of 2^-24, the f16 subnormal step, in the low mantissa bits of the sum. 0x3f000000 is 0.5.
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(std::bit_cast<float>(a) + 0.5F) - 0x3f000000U;
  const std::uint32_t is_subnormal = 0U - static_cast<std::uint32_t>(a < 0x38800000U);
  const std::uint32_t is_nan = 0U - static_cast<std::uint32_t>(a > 0x7f800000U);
  const std::uint32_t out = (subnormal & is_subnormal) | (normal & ~is_subnormal) | (is_nan & 0x0200U);  // NaN: 0x7e00
  return static_cast<std::uint16_t>(sign | out);
}

/// f16 -> f32, exact. A NaN keeps its sign and payload and becomes quiet (the quiet bit set), as
/// PyTorch's conversion (and the x86 F16C instruction) does. Straight-line, like f16_from_f32.
constexpr float f32_from_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t e = h & 0x7c00U;
  const std::uint32_t m = h & 0x3ffU;
  // Normal: rebias the exponent 15 -> 127. Subnormal (and zero): m * 2^-24, exact in f32.
  const std::uint32_t normal = (static_cast<std::uint32_t>(h & 0x7fffU) << 13) + 0x38000000U;
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(static_cast<float>(m) * 0x1p-24F);
  const std::uint32_t is_subnormal = 0U - static_cast<std::uint32_t>(e == 0);
  const std::uint32_t is_inf_nan = 0U - static_cast<std::uint32_t>(e == 0x7c00U);
  const std::uint32_t is_nan = is_inf_nan & (0U - static_cast<std::uint32_t>(m != 0));
  std::uint32_t out = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  out += is_inf_nan & 0x38000000U;  // inf/NaN: the rebiased exponent 143 becomes 255
  out |= is_nan & 0x400000U;        // quiet bit
  return std::bit_cast<float>(sign | out);
}

namespace detail {
/// Rounds |f| (bits `a`, finite, below the format's overflow threshold) to a small float format
/// with `mbits` mantissa bits and exponent bias `bias`; returns the unsigned encoding.
constexpr std::uint32_t round_to_small_float(std::uint32_t a, unsigned mbits, unsigned bias) noexcept {
  const std::uint32_t min_normal_exp = 127U - bias + 1U;  // f32 exponent of the format's smallest normal
  const std::uint32_t e = a >> 23;
  if (e >= min_normal_exp) {
    const unsigned drop = 23U - mbits;
    const std::uint32_t r = a - ((127U - bias) << 23);
    return (r + ((1U << (drop - 1U)) - 1U) + ((r >> drop) & 1U)) >> drop;
  }
  // Subnormal in the target (or zero): value = q * 2^(1 - bias - mbits).
  if (e == 0) return 0;  // f32 subnormals are far below every small format's range
  const std::uint32_t m = (a & 0x7fffffU) | 0x800000U;
  // f32 value = m * 2^(e - 150); q = m * 2^(e - 150 - (1 - bias - mbits)).
  const std::int32_t shift = 150 - static_cast<std::int32_t>(e) + 1 - static_cast<std::int32_t>(bias) -
                             static_cast<std::int32_t>(mbits);
  if (shift >= 25) return 0;  // below half of the smallest subnormal
  const auto s = static_cast<std::uint32_t>(shift);
  std::uint32_t q = m >> s;
  const std::uint32_t rem = m & ((1U << s) - 1U);
  const std::uint32_t half = 1U << (s - 1U);
  if (rem > half || (rem == half && (q & 1U))) ++q;
  return q;
}
}  // namespace detail

/// f32 -> float8_e4m3fn (OCP FP8 E4M3: no infinities, NaN = S.1111.111, max 448). As in PyTorch,
/// NaN, infinities and values that round beyond 448 all become NaN (0x7f with the sign).
constexpr std::uint8_t f8e4m3_from_f32(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80U);
  const std::uint32_t a = u & 0x7fffffffU;
  if (a >= 0x43f00000U) return static_cast<std::uint8_t>(sign | 0x7fU);  // >= 480 (or inf/NaN)
  return static_cast<std::uint8_t>(sign | detail::round_to_small_float(a, 3, 7));
}

/// float8_e4m3fn -> f32, exact. NaN gives 0x7ff00000 with the sign, as PyTorch does.
constexpr float f32_from_f8e4m3(std::uint8_t x) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(x & 0x80U) << 24;
  const std::uint32_t e = (x >> 3) & 0xfU;
  std::uint32_t m = x & 7U;
  if (e == 0xf && m == 7) return std::bit_cast<float>(sign | 0x7ff00000U);
  if (e != 0) return std::bit_cast<float>(sign | ((e + 120U) << 23) | (m << 20));
  if (m == 0) return std::bit_cast<float>(sign);
  std::uint32_t exp = 121;
  while ((m & 8U) == 0) {
    m <<= 1;
    --exp;
  }
  return std::bit_cast<float>(sign | (exp << 23) | ((m & 7U) << 20));
}

/// f32 -> float8_e5m2 (OCP FP8 E5M2, IEEE-like with inf). NaN -> 0x7f, overflow (>= 61440) -> inf,
/// each with the sign, as PyTorch does.
constexpr std::uint8_t f8e5m2_from_f32(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80U);
  const std::uint32_t a = u & 0x7fffffffU;
  if (a > 0x7f800000U) return static_cast<std::uint8_t>(sign | 0x7fU);
  if (a >= 0x47700000U) return static_cast<std::uint8_t>(sign | 0x7cU);  // >= 61440 rounds to inf
  return static_cast<std::uint8_t>(sign | detail::round_to_small_float(a, 2, 15));
}

/// float8_e5m2 -> f32, exact: it is the top byte of an f16, widened as f32_from_f16 does (so NaNs
/// come out quiet, as in PyTorch).
constexpr float f32_from_f8e5m2(std::uint8_t x) noexcept {
  return f32_from_f16(static_cast<std::uint16_t>(static_cast<std::uint16_t>(x) << 8));
}

/// The f32 bits PyTorch 2.x decodes the NaN code of the fnuz and e8m0 formats to (a signalling
/// NaN with payload 1; tests/interop-dtype2.cpp checks it against torch 2.14's own tables).
inline constexpr std::uint32_t f8_fnuz_nan_f32 = 0x7f800001U;

/// f32 -> float8_e4m3fnuz (bias 8, no infinities, a single NaN 0x80, no negative zero), as
/// PyTorch 2.x: NaN, infinities and everything that rounds to 256 or beyond become 0x80; values
/// that round to zero become +0 whatever their sign.
constexpr std::uint8_t f8e4m3fnuz_from_f32(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80U);
  const std::uint32_t a = u & 0x7fffffffU;
  if (a >= 0x43800000U) return 0x80;  // >= 256 (or inf/NaN)
  const std::uint32_t r = detail::round_to_small_float(a, 3, 8);
  if (r == 0) return 0;
  if (r > 0x7fU) return 0x80;  // rounded up to 256
  return static_cast<std::uint8_t>(sign | r);
}

/// f32 -> float8_e5m2fnuz (bias 16, otherwise as e4m3fnuz; largest value 57344).
constexpr std::uint8_t f8e5m2fnuz_from_f32(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80U);
  const std::uint32_t a = u & 0x7fffffffU;
  if (a >= 0x47800000U) return 0x80;  // >= 65536 (or inf/NaN)
  const std::uint32_t r = detail::round_to_small_float(a, 2, 16);
  if (r == 0) return 0;
  if (r > 0x7fU) return 0x80;
  return static_cast<std::uint8_t>(sign | r);
}

namespace detail {
/// Decodes a sign-magnitude float8 with `mbits` mantissa bits and exponent bias `bias` (no special
/// codes: the callers handle NaN), exactly.
constexpr float f32_from_small_float(std::uint8_t x, unsigned mbits, unsigned bias) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(x & 0x80U) << 24;
  const std::uint32_t e = (x & 0x7fU) >> mbits;
  const std::uint32_t m = x & ((1U << mbits) - 1U);
  if (e != 0) return std::bit_cast<float>(sign | ((e + 127U - bias) << 23) | (m << (23U - mbits)));
  // Subnormal: m * 2^(1 - bias - mbits), exact in f32; +-0 for m == 0.
  const float mag = static_cast<float>(m) * std::bit_cast<float>((128U - bias - mbits) << 23);
  return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(mag));
}
}  // namespace detail

/// float8_e4m3fnuz -> f32, exact; 0x80 is NaN (f8_fnuz_nan_f32).
constexpr float f32_from_f8e4m3fnuz(std::uint8_t x) noexcept {
  return x == 0x80 ? std::bit_cast<float>(f8_fnuz_nan_f32) : detail::f32_from_small_float(x, 3, 8);
}
/// float8_e5m2fnuz -> f32, exact; 0x80 is NaN (f8_fnuz_nan_f32).
constexpr float f32_from_f8e5m2fnuz(std::uint8_t x) noexcept {
  return x == 0x80 ? std::bit_cast<float>(f8_fnuz_nan_f32) : detail::f32_from_small_float(x, 2, 16);
}

/// f32 -> float8_e8m0fnu (a power of two 2^(x - 127), x in 0..254; 0xff is NaN), as PyTorch 2.x:
/// the sign is ignored, NaN and infinities give 0xff, the exponent is rounded to nearest with
/// ties to even where the implicit mantissa bit is the last kept bit (so a normal f32 exactly
/// between two powers of two rounds up, a subnormal one down), and rounding past 2^127 gives 0xff.
constexpr std::uint8_t f8e8m0_from_f32(float f) noexcept {
  const std::uint32_t a = std::bit_cast<std::uint32_t>(f) & 0x7fffffffU;
  const std::uint32_t e = a >> 23;
  if (e == 0xffU) return 0xff;
  const std::uint32_t m = a & 0x7fffffU;
  const bool half = (m & 0x400000U) != 0, rest = (m & 0x3fffffU) != 0;
  const std::uint32_t up = half && (rest || e != 0) ? 1U : 0U;
  return static_cast<std::uint8_t>(e + up);  // 254 + 1 = 0xff: NaN
}

/// float8_e8m0fnu -> f32, exact: 2^(x - 127) (x = 0 is the f32 subnormal 2^-127); 0xff is NaN.
constexpr float f32_from_f8e8m0(std::uint8_t x) noexcept {
  if (x == 0xff) return std::bit_cast<float>(f8_fnuz_nan_f32);
  if (x == 0) return std::bit_cast<float>(0x00400000U);
  return std::bit_cast<float>(static_cast<std::uint32_t>(x) << 23);
}

}  // namespace statedict::inline v0
