// statedict: an index that finds items kept in the caller's own vector, without copying keys.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "error.hpp"

namespace statedict::inline v0::detail {

/// Positions of items the caller stores (a vector of dict items, of zip entries), found by hash.
/// Open addressing with linear probing over a power-of-two number of slots, at most half full;
/// a slot is `hash << 32 | (position + 1)`, 0 when empty. An equal hash is confirmed by the
/// caller's comparison, so the index holds no key and allocates nothing per item. Growing reuses
/// the stored hashes: no key is hashed twice.
class hash_index {
 public:
  static constexpr std::uint32_t npos = UINT32_MAX;

  hash_index() = default;
  hash_index(const hash_index&) = default;
  hash_index& operator=(const hash_index&) = default;
  hash_index(hash_index&& o) noexcept : slots_(std::move(o.slots_)), count_(std::exchange(o.count_, 0)) { o.slots_.clear(); }
  hash_index& operator=(hash_index&& o) noexcept {
    slots_ = std::move(o.slots_);
    o.slots_.clear();
    count_ = std::exchange(o.count_, 0);
    return *this;
  }
  ~hash_index() = default;

  /// 32 well-mixed bits of a std::hash value (std::hash of an integer is the integer itself).
  [[nodiscard]] static std::uint32_t mix(std::size_t h) noexcept {
    return static_cast<std::uint32_t>((static_cast<std::uint64_t>(h) * 0x9e3779b97f4a7c15ULL) >> 32);
  }

  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  void clear() noexcept {
    slots_.clear();
    count_ = 0;
  }
  /// Room for `n` positions without growing.
  void reserve(std::size_t n) {
    if (n > slots_.size() / 2) grow(n * 2);
  }

  /// Adds `position` under `hash`; the caller has ruled out an equal key.
  void add(std::uint32_t hash, std::size_t position) {
    if (position >= UINT32_MAX - 1) throw_error(errors::overflow, "more than 2^32 - 2 items in one index");
    if (count_ + 1 > slots_.size() / 2) grow(std::max<std::size_t>(32, slots_.size() * 2));
    place(std::uint64_t{hash} << 32 | (position + 1));
    ++count_;
  }

  /// The position added under `hash` for which `same(position)` holds, or npos.
  template <class Same>
  [[nodiscard]] std::uint32_t find(std::uint32_t hash, Same&& same) const {
    if (slots_.empty()) return npos;
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t s = hash & mask;; s = (s + 1) & mask) {
      const std::uint64_t e = slots_[s];
      if (e == 0) return npos;
      if (static_cast<std::uint32_t>(e >> 32) == hash) {
        const auto p = static_cast<std::uint32_t>(e - 1);  // the low half; position + 1 > 0
        if (same(p)) return p;
      }
    }
  }

 private:
  void place(std::uint64_t e) {
    const std::size_t mask = slots_.size() - 1;
    std::size_t s = (e >> 32) & mask;
    while (slots_[s] != 0) s = (s + 1) & mask;
    slots_[s] = e;
  }
  void grow(std::size_t want) {
    std::size_t cap = 32;
    while (cap < want) cap *= 2;
    std::vector<std::uint64_t> old(cap, 0);
    old.swap(slots_);
    for (const std::uint64_t e : old)
      if (e != 0) place(e);
  }

  std::vector<std::uint64_t> slots_;
  std::size_t count_ = 0;
};

}  // namespace statedict::inline v0::detail
