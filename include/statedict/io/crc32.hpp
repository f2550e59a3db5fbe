// statedict: CRC-32 (the zip / IEEE 802.3 checksum) with combination of independent pieces.
// SPDX-License-Identifier: MIT
//
// `crc32(bytes)` is the checksum zip records carry (polynomial 0x04C11DB7, reflected, initial and
// final value 0xFFFFFFFF; crc32("123456789") == 0xCBF43926). `crc32(bytes, previous)` continues a
// checksum over a following piece, and `crc32_combine(crc_a, crc_b, length_b)` gives the checksum of
// the concatenation A+B from the checksums of A and B alone, in O(log length_b) time. That is what
// lets threads checksum the regions they write, in any order, and the zip writer combine them.
//
// Speed: on x86-64 CPUs with PCLMULQDQ (every x86-64 CPU since 2010) the bulk of the data is folded
// 64 bytes at a time with carry-less multiplication (detected at run time), 256 bytes at a time on
// CPUs with VPCLMULQDQ and AVX-512F; elsewhere a slice-by-16 table loop is used. bench/bench-torch.cpp measures both.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "../core/config.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STATEDICT_CRC32_CLMUL 1
#include <immintrin.h>
#endif

namespace statedict::inline v0::zip {

namespace detail {

// ---------------------------------------------------------------------------------------------
// Polynomial arithmetic. A CRC value is a polynomial of degree < 32 over GF(2) stored reflected:
// bit 31 - k of the integer is the coefficient of x^k (bit 0 is x^31).

inline constexpr std::uint32_t crc_poly_reflected = 0xEDB88320U;

/// b * x mod P (reflected).
constexpr std::uint32_t crc_mul_x(std::uint32_t b) noexcept { return (b & 1U) ? (b >> 1) ^ crc_poly_reflected : b >> 1; }

/// a * b mod P, both reflected: the sum of b * x^k over the terms x^k of a.
constexpr std::uint32_t crc_mulmod(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t p = 0;
  for (unsigned k = 0; k < 32; ++k) {
    if (a & (0x80000000U >> k)) p ^= b;  // term x^k of a
    b = crc_mul_x(b);                    // b * x^(k+1)
  }
  return p;
}

/// x^(2^k) mod P for k = 0..63, reflected: squaring tables for x^n mod P.
constexpr std::array<std::uint32_t, 64> make_x2k_table() noexcept {
  std::array<std::uint32_t, 64> t{};
  std::uint32_t p = 0x40000000U;  // x^1
  for (auto& v : t) {
    v = p;
    p = crc_mulmod(p, p);
  }
  return t;
}
inline constexpr std::array<std::uint32_t, 64> crc_x2k = make_x2k_table();

/// x^n mod P, reflected.
constexpr std::uint32_t crc_xpow(std::uint64_t n) noexcept {
  std::uint32_t p = 0x80000000U;  // x^0
  for (unsigned k = 0; n; ++k, n >>= 1)
    if (n & 1U) p = crc_mulmod(crc_x2k[k], p);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Slice-by-16 tables: table[j][b] is the CRC contribution of byte b followed by j zero bytes.

using crc_tables = std::array<std::array<std::uint32_t, 256>, 16>;

constexpr crc_tables make_crc_tables() noexcept {
  crc_tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int k = 0; k < 8; ++k) c = (c & 1U) ? (c >> 1) ^ crc_poly_reflected : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t j = 1; j < 16; ++j)
    for (std::size_t b = 0; b < 256; ++b) t[j][b] = (t[j - 1][b] >> 8) ^ t[0][t[j - 1][b] & 0xffU];
  return t;
}
inline constexpr crc_tables crc_table = make_crc_tables();

inline std::uint32_t load_le32(const unsigned char* p) noexcept {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian host (config.hpp)
}

/// Raw register update (no pre/post inversion) over n bytes, slice-by-16.
inline std::uint32_t crc_update_table(std::uint32_t c, const unsigned char* p, std::size_t n) noexcept {
  const auto& t = crc_table;
  while (n >= 16) {
    const std::uint32_t a = load_le32(p) ^ c;
    const std::uint32_t b = load_le32(p + 4);
    const std::uint32_t d = load_le32(p + 8);
    const std::uint32_t e = load_le32(p + 12);
    c = t[15][a & 0xff] ^ t[14][(a >> 8) & 0xff] ^ t[13][(a >> 16) & 0xff] ^ t[12][a >> 24] ^  //
        t[11][b & 0xff] ^ t[10][(b >> 8) & 0xff] ^ t[9][(b >> 16) & 0xff] ^ t[8][b >> 24] ^    //
        t[7][d & 0xff] ^ t[6][(d >> 8) & 0xff] ^ t[5][(d >> 16) & 0xff] ^ t[4][d >> 24] ^       //
        t[3][e & 0xff] ^ t[2][(e >> 8) & 0xff] ^ t[1][(e >> 16) & 0xff] ^ t[0][e >> 24];
    p += 16;
    n -= 16;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xffU];
  return c;
}

#ifdef STATEDICT_CRC32_CLMUL
// Folding with carry-less multiplication. A 16-byte block loaded little-endian holds message bit j
// (j = 0 first, the highest power) at integer bit j; its low and high 64-bit halves L, H stand for
// x^64*rev(L) + rev(H). Multiplying two bit-reversed 64-bit operands with PCLMULQDQ yields x times
// the product in the same 128-bit convention, so moving a block forward by D bits is
//   L * (x^(D+63) mod P) + H * (x^(D-1) mod P),
// with each 32-bit constant placed in the high half of a 64-bit lane, bit-reversed. Nothing here is
// a magic number: the constants come from crc_xpow above. The last 16-byte register is then run
// through the table loop, which performs the final reduction mod P.
constexpr std::uint64_t clmul_constant(std::uint64_t power) noexcept {
  // crc_xpow returns the reflected 32-bit remainder: bit 31-k is x^k. In the 64-bit lane bit i
  // stands for x^(63-i), so x^k sits at bit 63-k: the reflected value shifted left by 32.
  return static_cast<std::uint64_t>(crc_xpow(power)) << 32;
}
inline constexpr std::uint64_t k512_lo = clmul_constant(512 + 63);
inline constexpr std::uint64_t k512_hi = clmul_constant(512 - 1);
inline constexpr std::uint64_t k128_lo = clmul_constant(128 + 63);
inline constexpr std::uint64_t k128_hi = clmul_constant(128 - 1);

__attribute__((target("pclmul,sse4.1"))) inline __m128i clmul_fold(__m128i acc, __m128i k) noexcept {
  const __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);  // L * k_lo
  const __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);  // H * k_hi
  return _mm_xor_si128(lo, hi);
}

/// Raw register update over n >= 64 bytes; returns the register after all whole 16-byte blocks and
/// sets `done` to the number of bytes consumed.
__attribute__((target("pclmul,sse4.1"))) inline std::uint32_t crc_update_clmul(std::uint32_t c, const unsigned char* p,
                                                                                std::size_t n, std::size_t& done) noexcept {
  const __m128i k4 = _mm_set_epi64x(static_cast<long long>(k512_hi), static_cast<long long>(k512_lo));
  const __m128i k1 = _mm_set_epi64x(static_cast<long long>(k128_hi), static_cast<long long>(k128_lo));
  auto load = [](const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i a0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i a1 = load(p + 16);
  __m128i a2 = load(p + 32);
  __m128i a3 = load(p + 48);
  std::size_t i = 64;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm_xor_si128(clmul_fold(a0, k4), load(p + i));
    a1 = _mm_xor_si128(clmul_fold(a1, k4), load(p + i + 16));
    a2 = _mm_xor_si128(clmul_fold(a2, k4), load(p + i + 32));
    a3 = _mm_xor_si128(clmul_fold(a3, k4), load(p + i + 48));
  }
  __m128i a = _mm_xor_si128(clmul_fold(a0, k1), a1);
  a = _mm_xor_si128(clmul_fold(a, k1), a2);
  a = _mm_xor_si128(clmul_fold(a, k1), a3);
  for (; i + 16 <= n; i += 16) a = _mm_xor_si128(clmul_fold(a, k1), load(p + i));
  alignas(16) unsigned char buf[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), a);
  done = i;
  return crc_update_table(0, buf, 16);
}

inline bool have_clmul() noexcept {
  static const bool ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return ok;
}

// The same folding four 512-bit registers at a time (256 bytes per step) with VPCLMULQDQ, on CPUs
// that have it with AVX-512F. Each 128-bit lane folds like the registers above; at the end the
// four registers fold into one (512 bits apart) and its four lanes into one 128-bit register (384,
// 256, 128 bits apart), which the 128-bit code then continues. 3-4x the 128-bit speed: it is what
// zip writers pay per output byte (`convert --to dcp` checksums every record).
inline constexpr std::uint64_t k2048_lo = clmul_constant(2048 + 63);
inline constexpr std::uint64_t k2048_hi = clmul_constant(2048 - 1);
inline constexpr std::uint64_t k384_lo = clmul_constant(384 + 63);
inline constexpr std::uint64_t k384_hi = clmul_constant(384 - 1);
inline constexpr std::uint64_t k256_lo = clmul_constant(256 + 63);
inline constexpr std::uint64_t k256_hi = clmul_constant(256 - 1);

#define STATEDICT_CRC32_VCLMUL_TARGET __attribute__((target("pclmul,sse4.1,avx512f,vpclmulqdq")))

STATEDICT_CRC32_VCLMUL_TARGET inline __m512i vclmul_fold(__m512i acc, __m512i k, __m512i next) noexcept {
  const __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

/// Raw register update over n >= 256 bytes, like crc_update_clmul.
STATEDICT_CRC32_VCLMUL_TARGET inline std::uint32_t crc_update_vclmul(std::uint32_t c, const unsigned char* p, std::size_t n,
                                                                      std::size_t& done) noexcept {
  const __m128i k1 = _mm_set_epi64x(static_cast<long long>(k128_hi), static_cast<long long>(k128_lo));
  const __m128i k2 = _mm_set_epi64x(static_cast<long long>(k256_hi), static_cast<long long>(k256_lo));
  const __m128i k3 = _mm_set_epi64x(static_cast<long long>(k384_hi), static_cast<long long>(k384_lo));
  // (set, store and load rather than broadcast and extract: GCC 12's versions of those warn.)
  const auto h4 = static_cast<long long>(k512_hi), l4 = static_cast<long long>(k512_lo);
  const auto h16 = static_cast<long long>(k2048_hi), l16 = static_cast<long long>(k2048_lo);
  const __m512i k4 = _mm512_set_epi64(h4, l4, h4, l4, h4, l4, h4, l4);
  const __m512i k16 = _mm512_set_epi64(h16, l16, h16, l16, h16, l16, h16, l16);
  __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, static_cast<long long>(c)));
  __m512i a1 = _mm512_loadu_si512(p + 64);
  __m512i a2 = _mm512_loadu_si512(p + 128);
  __m512i a3 = _mm512_loadu_si512(p + 192);
  std::size_t i = 256;
  for (; i + 256 <= n; i += 256) {
    a0 = vclmul_fold(a0, k16, _mm512_loadu_si512(p + i));
    a1 = vclmul_fold(a1, k16, _mm512_loadu_si512(p + i + 64));
    a2 = vclmul_fold(a2, k16, _mm512_loadu_si512(p + i + 128));
    a3 = vclmul_fold(a3, k16, _mm512_loadu_si512(p + i + 192));
  }
  __m512i a = vclmul_fold(a0, k4, a1);
  a = vclmul_fold(a, k4, a2);
  a = vclmul_fold(a, k4, a3);
  alignas(64) __m128i lane[4];
  _mm512_store_si512(lane, a);
  __m128i r = _mm_xor_si128(clmul_fold(lane[0], k3), clmul_fold(lane[1], k2));
  r = _mm_xor_si128(r, clmul_fold(lane[2], k1));
  r = _mm_xor_si128(r, lane[3]);
  for (; i + 16 <= n; i += 16) r = _mm_xor_si128(clmul_fold(r, k1), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
  alignas(16) unsigned char buf[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), r);
  done = i;
  return crc_update_table(0, buf, 16);
}
#undef STATEDICT_CRC32_VCLMUL_TARGET

inline bool have_vclmul() noexcept {
  static const bool ok = have_clmul() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  return ok;
}
#endif

/// Raw register update, fastest available implementation.
inline std::uint32_t crc_update(std::uint32_t c, const unsigned char* p, std::size_t n, bool allow_simd = true) noexcept {
#ifdef STATEDICT_CRC32_CLMUL
  if (allow_simd && n >= 1024 && have_vclmul()) {
    std::size_t done = 0;
    c = crc_update_vclmul(c, p, n, done);
    p += done;
    n -= done;
  } else if (allow_simd && n >= 256 && have_clmul()) {
    std::size_t done = 0;
    c = crc_update_clmul(c, p, n, done);
    p += done;
    n -= done;
  }
#else
  (void)allow_simd;
#endif
  return crc_update_table(c, p, n);
}

}  // namespace detail

/// CRC-32 of `bytes`, continuing from `previous` (the CRC of the bytes before them; 0 to start).
inline std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t previous = 0) noexcept {
  return ~detail::crc_update(~previous, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

/// Portable table-only version (for tests and for comparing speeds).
inline std::uint32_t crc32_portable(std::span<const std::byte> bytes, std::uint32_t previous = 0) noexcept {
  return ~detail::crc_update(~previous, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), false);
}

/// CRC-32 of the concatenation A+B, given crc_a = crc32(A), crc_b = crc32(B) and length_b = |B|.
constexpr std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t length_b) noexcept {
  // With the 0xFFFFFFFF pre- and post-conditioning, crc(A+B) = crc(A) * x^(8|B|) + crc(B) mod P.
  if (length_b == 0) return crc_a;
  return detail::crc_mulmod(detail::crc_xpow(length_b * 8U), crc_a) ^ crc_b;
}

/// Whether crc32() uses carry-less multiplication on this CPU.
inline bool crc32_accelerated() noexcept {
#ifdef STATEDICT_CRC32_CLMUL
  return detail::have_clmul();
#else
  return false;
#endif
}

}  // namespace statedict::inline v0::zip
