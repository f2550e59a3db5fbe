// statedict: SHA-256 (FIPS 180-4) of byte streams, incremental, and of a tensor's elements.
// SPDX-License-Identifier: MIT
//
// `Sha256 h; h.update(bytes); ...; h.hex()` hashes any stream in pieces of any size.
// `sha256_hex(view)` is the digest the command line prints for `inspect --hash`: the tensor's
// elements in row-major order, little-endian, no padding, whatever the view's strides (the same
// bytes numpy's `tobytes()` gives for the tensor), so equal tensors hash equal across formats.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "tensor.hpp"

namespace statedict::inline v0 {

/// Incremental SHA-256. Feed bytes with update(), read the digest once with digest() or hex();
/// after that the object must be reset() before reuse.
class Sha256 {
 public:
  using digest_type = std::array<std::uint8_t, 32>;

  Sha256() noexcept { reset(); }

  void reset() noexcept {
    static constexpr std::uint32_t init[8] = {0x6a09e667U, 0xbb67ae85U, 0x3c6ef372U, 0xa54ff53aU,
                                              0x510e527fU, 0x9b05688cU, 0x1f83d9abU, 0x5be0cd19U};
    std::memcpy(state_, init, sizeof state_);
    length_ = 0;
    fill_ = 0;
  }

  Sha256& update(std::span<const std::byte> bytes) noexcept {
    const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
    std::size_t n = bytes.size();
    length_ += n;
    if (fill_ != 0) {
      const std::size_t take = n < 64 - fill_ ? n : 64 - fill_;
      std::memcpy(block_ + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      if (fill_ < 64) return *this;
      compress(block_);
      fill_ = 0;
    }
    while (n >= 64) {
      compress(p);
      p += 64;
      n -= 64;
    }
    if (n != 0) {
      std::memcpy(block_, p, n);
      fill_ = n;
    }
    return *this;
  }
  Sha256& update(std::string_view s) noexcept { return update(std::as_bytes(std::span<const char>(s.data(), s.size()))); }

  /// The 32-byte digest of everything fed so far (finishes the stream).
  digest_type digest() noexcept {
    const std::uint64_t bits = length_ * 8U;
    const std::uint8_t pad = 0x80;
    update(std::as_bytes(std::span<const std::uint8_t>(&pad, 1)));
    const std::uint8_t zero[64] = {};
    const std::size_t zeros = fill_ <= 56 ? 56 - fill_ : 120 - fill_;
    update(std::as_bytes(std::span<const std::uint8_t>(zero, zeros)));
    std::uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
    update(std::as_bytes(std::span<const std::uint8_t>(len, 8)));
    digest_type out{};
    for (std::size_t i = 0; i < 8; ++i)
      for (std::size_t j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * j));
    return out;
  }

  /// The digest as 64 lower-case hex digits (finishes the stream).
  std::string hex() noexcept {
    static constexpr char digits[] = "0123456789abcdef";
    const digest_type d = digest();
    std::string s(64, '0');
    for (std::size_t i = 0; i < 32; ++i) {
      s[2 * i] = digits[d[i] >> 4];
      s[2 * i + 1] = digits[d[i] & 15U];
    }
    return s;
  }

 private:
  static constexpr std::uint32_t rotr(std::uint32_t x, int n) noexcept { return (x >> n) | (x << (32 - n)); }

  void compress(const std::uint8_t* p) noexcept {
    static constexpr std::uint32_t k[64] = {
        0x428a2f98U, 0x71374491U, 0xb5c0fbcfU, 0xe9b5dba5U, 0x3956c25bU, 0x59f111f1U, 0x923f82a4U, 0xab1c5ed5U,
        0xd807aa98U, 0x12835b01U, 0x243185beU, 0x550c7dc3U, 0x72be5d74U, 0x80deb1feU, 0x9bdc06a7U, 0xc19bf174U,
        0xe49b69c1U, 0xefbe4786U, 0x0fc19dc6U, 0x240ca1ccU, 0x2de92c6fU, 0x4a7484aaU, 0x5cb0a9dcU, 0x76f988daU,
        0x983e5152U, 0xa831c66dU, 0xb00327c8U, 0xbf597fc7U, 0xc6e00bf3U, 0xd5a79147U, 0x06ca6351U, 0x14292967U,
        0x27b70a85U, 0x2e1b2138U, 0x4d2c6dfcU, 0x53380d13U, 0x650a7354U, 0x766a0abbU, 0x81c2c92eU, 0x92722c85U,
        0xa2bfe8a1U, 0xa81a664bU, 0xc24b8b70U, 0xc76c51a3U, 0xd192e819U, 0xd6990624U, 0xf40e3585U, 0x106aa070U,
        0x19a4c116U, 0x1e376c08U, 0x2748774cU, 0x34b0bcb5U, 0x391c0cb3U, 0x4ed8aa4aU, 0x5b9cca4fU, 0x682e6ff3U,
        0x748f82eeU, 0x78a5636fU, 0x84c87814U, 0x8cc70208U, 0x90befffaU, 0xa4506cebU, 0xbef9a3f7U, 0xc67178f2U};
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (std::uint32_t{p[4 * i]} << 24) | (std::uint32_t{p[4 * i + 1]} << 16) | (std::uint32_t{p[4 * i + 2]} << 8) |
             std::uint32_t{p[4 * i + 3]};
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3], e = state_[4], f = state_[5],
                  g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  std::uint32_t state_[8];
  std::uint8_t block_[64];
  std::uint64_t length_;
  std::size_t fill_;
};

/// SHA-256 of a byte range, as 64 hex digits.
inline std::string sha256_hex(std::span<const std::byte> bytes) { return Sha256().update(bytes).hex(); }
inline std::string sha256_hex(std::string_view s) { return Sha256().update(s).hex(); }

/// Feeds a tensor's elements to `h`: row-major, little-endian, no padding; strided and misaligned
/// views are fine (each contiguous run is fed as it lies in memory).
inline void update(Sha256& h, const TensorView& v) {
  v.for_each_run([&](const std::byte* p, std::uint64_t count) {
    h.update(std::span<const std::byte>(p, static_cast<std::size_t>(count * v.itemsize())));
  });
}

/// SHA-256 of a tensor's elements (row-major, little-endian, no padding): `inspect --hash`.
inline std::string sha256_hex(const TensorView& v) {
  Sha256 h;
  update(h, v);
  return h.hex();
}

}  // namespace statedict::inline v0
