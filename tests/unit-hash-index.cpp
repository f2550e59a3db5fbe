// Unit tests: detail::hash_index, the key-less index behind Dict, zip::Archive and the unflatten
// duplicate check.
#include <doctest/doctest.h>

#include <statedict/core/hash_index.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

using statedict::detail::hash_index;

namespace {

/// The position of `key` in `keys` through the index, or npos.
std::uint32_t lookup(const hash_index& ix, const std::vector<std::string>& keys, const std::string& key, std::uint32_t h) {
  return ix.find(h, [&](std::uint32_t i) { return keys[i] == key; });
}

}  // namespace

TEST_CASE("hash_index finds every added position, also when all hashes collide, across growth") {
  for (const bool collide : {false, true}) {
    CAPTURE(collide);
    hash_index ix;
    std::vector<std::string> keys;
    std::vector<std::uint32_t> hashes;
    CHECK(ix.find(7, [](std::uint32_t) { return true; }) == hash_index::npos);  // empty: no slot to probe
    for (int i = 0; i < 3000; ++i) {
      keys.push_back("k" + std::to_string(i));
      hashes.push_back(collide ? 42U : hash_index::mix(std::hash<std::string>{}(keys.back())));
      ix.add(hashes.back(), keys.size() - 1);
      if (i % 97 == 0)  // every earlier key stays findable while the table grows under it
        for (std::size_t j = 0; j <= static_cast<std::size_t>(i); j += 13)
          REQUIRE(lookup(ix, keys, keys[j], hashes[j]) == j);
    }
    CHECK(ix.size() == 3000);
    for (std::size_t j = 0; j < keys.size(); ++j) CHECK(lookup(ix, keys, keys[j], hashes[j]) == j);
    // Absent keys: same hash as a present one, or a fresh hash.
    CHECK(lookup(ix, keys, "absent", hashes[5]) == hash_index::npos);
    CHECK(lookup(ix, keys, "absent", hash_index::mix(std::hash<std::string>{}("absent"))) == hash_index::npos);
  }
}

TEST_CASE("hash_index: reserve, clear, copies and moves") {
  hash_index ix;
  ix.reserve(100);
  CHECK(ix.empty());
  for (std::uint32_t i = 0; i < 100; ++i) ix.add(hash_index::mix(i), i);
  auto same_as = [](std::uint32_t want) { return [want](std::uint32_t i) { return i == want; }; };
  const hash_index copy = ix;
  CHECK(copy.find(hash_index::mix(57), same_as(57)) == 57);
  hash_index moved = std::move(ix);
  CHECK(moved.size() == 100);
  CHECK(moved.find(hash_index::mix(99), same_as(99)) == 99);
  CHECK(ix.empty());  // NOLINT(bugprone-use-after-move): a moved-from index is empty and usable
  CHECK(ix.find(hash_index::mix(99), same_as(99)) == hash_index::npos);
  ix.add(hash_index::mix(3), 0);
  CHECK(ix.find(hash_index::mix(3), same_as(0)) == 0);
  moved.clear();
  CHECK(moved.empty());
  CHECK(moved.find(hash_index::mix(1), same_as(1)) == hash_index::npos);
}

TEST_CASE("hash_index::mix spreads integer hashes that share their low bits") {
  // std::hash of an int64 is the value itself; keys that are multiples of 2^32 would all probe
  // from slot 0 without mixing.
  std::vector<int> seen(64, 0);
  for (std::uint64_t k = 0; k < 64; ++k) ++seen[hash_index::mix(static_cast<std::size_t>(k << 32)) & 63];
  int used = 0;
  for (int c : seen) used += c > 0;
  CHECK(used > 32);
}
