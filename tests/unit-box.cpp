// Placement algebra (shard/box.hpp) and the coverage sweep (shard/cover.hpp), checked against
// brute-force enumeration of elements on random shapes.
#include <doctest/doctest.h>

#include <statedict/shard/box.hpp>
#include <statedict/shard/cover.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

using namespace statedict;

namespace {

std::vector<shape_t> all_indices(const shape_t& shape) {
  std::vector<shape_t> out;
  const std::uint64_t n = numel(shape);
  for (std::uint64_t i = 0; i < n; ++i) out.push_back(multi_index(shape, i));
  return out;
}

bool in_box(const Box& b, const shape_t& idx) {
  for (std::size_t d = 0; d < idx.size(); ++d)
    if (idx[d] < b.offsets[d] || idx[d] >= b.offsets[d] + b.sizes[d]) return false;
  return true;
}

shape_t random_shape(std::mt19937_64& rng, std::size_t max_rank = 4, dim_t max_dim = 6) {
  const std::size_t r = rng() % (max_rank + 1);
  shape_t s(r);
  for (auto& d : s) d = static_cast<dim_t>(rng() % static_cast<std::uint64_t>(max_dim + 1));
  return s;
}

Box random_box(std::mt19937_64& rng, const shape_t& shape) {
  Box b{shape_t(shape.size()), shape_t(shape.size())};
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const auto n = static_cast<std::uint64_t>(shape[d]);
    const std::uint64_t lo = n ? rng() % (n + 1) : 0;
    const std::uint64_t hi = lo + (n - lo ? rng() % (n - lo + 1) : 0);
    b.offsets[d] = static_cast<dim_t>(lo);
    b.sizes[d] = static_cast<dim_t>(hi - lo);
  }
  return b;
}

std::vector<std::uint64_t> box_linear(const Box& b, const shape_t& shape) {
  std::vector<std::uint64_t> out;
  for (const auto& idx : all_indices(shape))
    if (in_box(b, idx)) out.push_back(linear_index(shape, idx));
  return out;
}

}  // namespace

TEST_CASE("linear and multi-indices are inverse") {
  const shape_t s{3, 4, 5};
  for (std::uint64_t i = 0; i < 60; ++i) CHECK(linear_index(s, multi_index(s, i)) == i);
  CHECK(multi_index(s, 23) == shape_t{1, 0, 3});
  CHECK(linear_index(shape_t{}, shape_t{}) == 0);
}

TEST_CASE("box and flat range intersections") {
  Box a{{0, 2}, {4, 3}}, b{{2, 0}, {5, 4}};
  auto i = intersect(a, b);
  REQUIRE(i);
  CHECK(*i == Box{{2, 2}, {2, 2}});
  CHECK_FALSE(intersect(Box{{0}, {2}}, Box{{2}, {2}}));
  CHECK(intersect(FlatRange{3, 9}, FlatRange{5, 20}) == FlatRange{5, 9});
  CHECK_FALSE(intersect(FlatRange{3, 5}, FlatRange{5, 20}));
  CHECK(contains(Box{{0, 0}, {4, 4}}, Box{{1, 1}, {2, 3}}));
  CHECK_FALSE(contains(Box{{0, 0}, {4, 4}}, Box{{1, 1}, {4, 1}}));
}

TEST_CASE("flat ranges cut into at most 2n-1 boxes, in row-major order") {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 600; ++iter) {
    const shape_t shape = random_shape(rng);
    const std::uint64_t n = numel(shape);
    const std::uint64_t b = n ? rng() % (n + 1) : 0;
    const std::uint64_t e = b + (n - b ? rng() % (n - b + 1) : 0);
    const auto boxes = to_boxes(FlatRange{b, e}, shape);
    CHECK(boxes.size() <= std::max<std::size_t>(1, 2 * shape.size() - (shape.empty() ? 0 : 1)));
    std::vector<std::uint64_t> got;
    for (const Box& x : boxes) {
      for (auto v : box_linear(x, shape)) got.push_back(v);
      CHECK_FALSE(is_empty(x));
    }
    std::vector<std::uint64_t> want;
    for (std::uint64_t v = b; v < e; ++v) want.push_back(v);
    CHECK(got == want);  // exact tiling, boxes in increasing order
  }
}

TEST_CASE("runs of a box are maximal and in order") {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 400; ++iter) {
    const shape_t shape = random_shape(rng);
    const Box b = random_box(rng, shape);
    std::vector<std::uint64_t> got;
    std::uint64_t prev_end = 0;
    bool first = true;
    for_each_run(b, shape, [&](std::uint64_t s, std::uint64_t c) {
      CHECK(c > 0);
      if (!first) CHECK(s > prev_end);  // a gap between consecutive runs: maximal
      for (std::uint64_t k = 0; k < c; ++k) got.push_back(s + k);
      prev_end = s + c;
      first = false;
    });
    CHECK(got == box_linear(b, shape));
  }
}

TEST_CASE("runs of the intersection of any two regions") {
  std::mt19937_64 rng(13);
  for (int iter = 0; iter < 300; ++iter) {
    const shape_t shape = random_shape(rng, 3, 5);
    const std::uint64_t n = numel(shape);
    auto region = [&]() -> ChunkRegion {
      if (rng() % 2) return random_box(rng, shape);
      const std::uint64_t b = n ? rng() % (n + 1) : 0;
      return FlatRange{b, b + (n - b ? rng() % (n - b + 1) : 0)};
    };
    const ChunkRegion a = region(), c = region();
    auto elems = [&](const ChunkRegion& r) {
      std::set<std::uint64_t> s;
      if (const auto* f = std::get_if<FlatRange>(&r))
        for (std::uint64_t v = f->begin; v < f->end; ++v) s.insert(v);
      else
        for (auto v : box_linear(std::get<Box>(r), shape)) s.insert(v);
      return s;
    };
    const auto ea = elems(a), ec = elems(c);
    std::vector<std::uint64_t> want;
    std::set_intersection(ea.begin(), ea.end(), ec.begin(), ec.end(), std::back_inserter(want));
    std::vector<std::uint64_t> got;
    std::uint64_t prev_end = 0;
    bool first = true;
    for_each_run(a, c, shape, [&](std::uint64_t s, std::uint64_t k) {
      if (!first) CHECK(s > prev_end);
      for (std::uint64_t j = 0; j < k; ++j) got.push_back(s + j);
      prev_end = s + k;
      first = false;
    });
    CHECK(got == want);
  }
}

TEST_CASE("regions are checked against the tensor shape") {
  const shape_t s{4, 5};
  CHECK_NOTHROW(check_region(Box{{1, 0}, {3, 5}}, s, "c"));
  CHECK_NOTHROW(check_region(FlatRange{0, 20}, s, "c"));
  auto id_of = [&](const ChunkRegion& r, const shape_t& shape) {
    try {
      check_region(r, shape, "chunk 3");
    } catch (const error& e) {
      return e.id();
    }
    return 0;
  };
  CHECK(id_of(Box{{1, 0}, {4, 5}}, s) == errors::bad_region.id);
  CHECK(id_of(Box{{0}, {4}}, s) == errors::bad_region.id);
  CHECK(id_of(Box{{-1, 0}, {1, 5}}, s) == errors::bad_region.id);
  CHECK(id_of(Box{{0, 0}, {1, -5}}, s) == errors::bad_region.id);
  CHECK(id_of(FlatRange{3, 21}, s) == errors::bad_region.id);
  CHECK(id_of(FlatRange{5, 3}, s) == errors::bad_region.id);
  // Hostile: offsets near 2^63 cannot overflow the bound check.
  const dim_t big = std::numeric_limits<dim_t>::max();
  CHECK(id_of(Box{{big, 0}, {big, 5}}, s) == errors::bad_region.id);
  CHECK(id_of(Box{{0}, {1}}, shape_t{big, big}) == errors::overflow.id);  // numel overflows
  CHECK(id_of(Box{}, shape_t(100, 1)) == errors::too_many_dims.id);
}

TEST_CASE("chunk storage: strides, extent and overflow") {
  Chunk c{Box{{0, 0}, {3, 4}}, Placement{0, 0, {1, 3}, dtype::F32}};  // column-major storage
  CHECK(storage_extent(c, "c") == 12);
  c.at.strides = {4};
  CHECK_THROWS_AS(storage_extent(c, "c"), format_error);  // wrong count
  c.at.strides = {-1, 1};
  CHECK_THROWS_AS(storage_extent(c, "c"), format_error);
  Chunk huge{Box{{0}, {3}}, Placement{0, 0, {std::numeric_limits<dim_t>::max()}, dtype::F32}};
  CHECK_THROWS_AS(storage_extent(huge, "c"), limit_error);
  Chunk flat{FlatRange{2, 9}, Placement{0, 0, {3}, dtype::F32}};
  CHECK(storage_extent(flat, "c") == 19);
}

TEST_CASE("mapped boxes give each element's storage offset") {
  std::mt19937_64 rng(17);
  for (int iter = 0; iter < 300; ++iter) {
    const shape_t shape = random_shape(rng, 3, 5);
    const std::uint64_t n = numel(shape);
    Chunk c;
    std::map<std::uint64_t, std::uint64_t> want;  // global linear -> storage offset
    if (rng() % 2 || n == 0) {
      const Box b = random_box(rng, shape);
      shape_t st(shape.size());
      for (auto& v : st) v = static_cast<dim_t>(rng() % 40);
      c = Chunk{b, Placement{0, 0, st, dtype::F32}};
      for (const auto& idx : all_indices(shape))
        if (in_box(b, idx)) {
          std::uint64_t off = 0;
          for (std::size_t d = 0; d < idx.size(); ++d)
            off += static_cast<std::uint64_t>((idx[d] - b.offsets[d]) * st[d]);
          want[linear_index(shape, idx)] = off;
        }
    } else {
      const std::uint64_t b = rng() % (n + 1);
      const std::uint64_t e = b + rng() % (n - b + 1);
      const dim_t s = static_cast<dim_t>(1 + rng() % 3);
      c = Chunk{FlatRange{b, e}, Placement{0, 0, {s}, dtype::F32}};
      for (std::uint64_t v = b; v < e; ++v) want[v] = (v - b) * static_cast<std::uint64_t>(s);
    }
    std::map<std::uint64_t, std::uint64_t> got;
    for (const MappedBox& m : mapped_boxes(c, shape, "c"))
      for (const auto& idx : all_indices(shape))
        if (in_box(m.box, idx)) {
          CHECK(got.count(linear_index(shape, idx)) == 0);
          got[linear_index(shape, idx)] = m.offset_of(idx);
        }
    CHECK(got == want);
    // And back: storage offset -> global index.
    if (!want.empty()) {
      const auto [lin, off] = *std::next(want.begin(), static_cast<std::ptrdiff_t>(rng() % want.size()));
      bool unique = true;
      for (const auto& [l2, o2] : want)
        if (o2 == off && l2 != lin) unique = false;
      if (unique) {
        auto g = global_index_of(c, shape, off);
        REQUIRE(g);
        CHECK(linear_index(shape, *g) == lin);
      }
    }
  }
}

TEST_CASE("storage runs between two mapped boxes match element by element") {
  std::mt19937_64 rng(19);
  for (int iter = 0; iter < 400; ++iter) {
    const shape_t shape = random_shape(rng, 4, 5);
    if (numel(shape) == 0) continue;
    auto make = [&]() {
      MappedBox m;
      m.box = full_box(shape);
      const int kind = static_cast<int>(rng() % 3);
      shape_t st = contiguous_strides(shape);
      if (kind == 1) std::reverse(st.begin(), st.end());  // some permuted layout
      if (kind == 2)
        for (auto& v : st) v = static_cast<dim_t>(rng() % 50);
      m.step.assign(st.begin(), st.end());
      m.base = rng() % 10;
      return m;
    };
    const MappedBox a = make(), b = make();
    const Box g = random_box(rng, shape);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> want, got;
    for (const auto& idx : all_indices(shape))
      if (in_box(g, idx)) want.emplace_back(a.offset_of(idx), b.offset_of(idx));
    for_each_storage_run(g, a, b, [&](const StorageRuns& r) {
      CHECK(r.count > 0);
      for (std::uint64_t i = 0; i < r.reps; ++i)
        for (std::uint64_t k = 0; k < r.count; ++k) got.emplace_back(r.a + i * r.a_step + k, r.b + i * r.b_step + k);
    });
    CHECK(got == want);
  }
  // Contiguous on both sides: one run.
  MappedBox m{full_box(shape_t{4, 6}), {6, 1}, 0};
  int calls = 0;
  for_each_storage_run(Box{{1, 0}, {3, 6}}, m, m, [&](const StorageRuns& r) {
    ++calls;
    CHECK(r.count == 18);
    CHECK(r.reps == 1);
    CHECK(r.a == 6);
  });
  CHECK(calls == 1);
  // Column block: one pattern of 4 runs.
  calls = 0;
  for_each_storage_run(Box{{0, 2}, {4, 3}}, m, m, [&](const StorageRuns& r) {
    ++calls;
    CHECK(r.count == 3);
    CHECK(r.reps == 4);
    CHECK(r.a_step == 6);
  });
  CHECK(calls == 1);
}

namespace {
// Brute-force coverage: per element, the boxes that hold it.
std::map<std::uint64_t, std::vector<std::uint32_t>> holders(const Box& target, const std::vector<Box>& boxes,
                                                            const shape_t& shape) {
  std::map<std::uint64_t, std::vector<std::uint32_t>> h;
  for (const auto& idx : all_indices(shape)) {
    if (!in_box(target, idx)) continue;
    auto& v = h[linear_index(shape, idx)];
    for (std::uint32_t i = 0; i < boxes.size(); ++i)
      if (in_box(boxes[i], idx)) v.push_back(i);
  }
  return h;
}
}  // namespace

TEST_CASE("cover: tilings, holes and overlaps against brute force") {
  std::mt19937_64 rng(23);
  int holes = 0, overlaps = 0, tilings = 0, whole = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const shape_t shape = random_shape(rng, 3, 6);
    const Box target = rng() % 3 ? full_box(shape) : random_box(rng, shape);
    std::vector<Box> boxes;
    if (rng() % 2) {
      // A grid: random cuts per dimension, then maybe drop or duplicate or grow a cell.
      std::vector<std::vector<dim_t>> cuts(shape.size());
      for (std::size_t d = 0; d < shape.size(); ++d) {
        cuts[d] = {0, shape[d]};
        for (int k = 0; k < 2; ++k) cuts[d].push_back(static_cast<dim_t>(rng() % static_cast<std::uint64_t>(shape[d] + 1)));
        std::sort(cuts[d].begin(), cuts[d].end());
        cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
      }
      std::vector<std::size_t> pos(shape.size(), 0);
      for (;;) {
        Box b{shape_t(shape.size()), shape_t(shape.size())};
        bool ok = true;
        for (std::size_t d = 0; d < shape.size(); ++d) {
          if (cuts[d].size() < 2) ok = false;
          else {
            b.offsets[d] = cuts[d][pos[d]];
            b.sizes[d] = cuts[d][pos[d] + 1] - cuts[d][pos[d]];
          }
        }
        if (ok) boxes.push_back(b);
        std::size_t d = shape.size();
        bool done = true;
        while (d-- > 0) {
          if (cuts[d].size() >= 2 && ++pos[d] + 1 < cuts[d].size()) {
            done = false;
            break;
          }
          pos[d] = 0;
        }
        if (done) break;
      }
      const int mutate = static_cast<int>(rng() % 4);
      if (mutate == 1 && !boxes.empty()) boxes.erase(boxes.begin() + static_cast<std::ptrdiff_t>(rng() % boxes.size()));
      if (mutate == 2 && !boxes.empty()) boxes.push_back(random_box(rng, shape));
      std::shuffle(boxes.begin(), boxes.end(), rng);
    } else if (rng() % 4) {
      const std::size_t k = rng() % 5;
      for (std::size_t i = 0; i < k; ++i) boxes.push_back(random_box(rng, shape));
    } else {
      // The target itself (cover's shortcut), maybe with another box.
      boxes.push_back(target);
      if (rng() % 2) boxes.insert(boxes.begin() + static_cast<std::ptrdiff_t>(rng() % 2), random_box(rng, shape));
      ++whole;
    }
    const auto h = holders(target, boxes, shape);
    std::optional<std::uint64_t> first_hole, first_double;
    for (const auto& [lin, v] : h) {
      if (v.empty() && !first_hole) first_hole = lin;
      if (v.size() > 1 && !first_double) first_double = lin;
    }
    for (bool allow : {false, true}) {
      std::vector<CoverTile> tiles;
      const auto issue = cover(target, boxes, allow, &tiles);
      // The shortcut and the sweep agree.
      std::vector<CoverTile> swept;
      const auto swept_issue = detail::coverer(target, boxes, allow).run(&swept);
      REQUIRE(issue.has_value() == swept_issue.has_value());
      if (!issue) CHECK(tiles == swept);
      std::optional<std::uint64_t> first_bad = first_hole;
      if (!allow && first_double && (!first_bad || *first_double < *first_bad)) first_bad = first_double;
      if (!first_bad) {
        REQUIRE_FALSE(issue);
        ++tilings;
        // The tiles partition the target; each element comes from its lowest-index holder.
        std::map<std::uint64_t, std::uint32_t> owner;
        for (const auto& t : tiles) {
          CHECK(contains(boxes[t.which], t.box));
          for (auto lin : box_linear(t.box, shape)) {
            CHECK(owner.count(lin) == 0);
            owner[lin] = t.which;
          }
        }
        CHECK(owner.size() == h.size());
        for (const auto& [lin, v] : h) CHECK(owner[lin] == v.front());
      } else {
        REQUIRE(issue);
        CHECK(linear_index(shape, issue->index) == *first_bad);
        if (first_hole && *first_bad == *first_hole) {
          CHECK(issue->what == CoverIssue::kind::hole);
          ++holes;
        } else {
          CHECK(issue->what == CoverIssue::kind::overlap);
          CHECK(issue->first < issue->second);
          CHECK(in_box(boxes[issue->first], issue->index));
          CHECK(in_box(boxes[issue->second], issue->index));
          ++overlaps;
        }
      }
    }
  }
  CHECK(holes > 50);
  CHECK(overlaps > 50);
  CHECK(tilings > 50);
  CHECK(whole > 50);
}

TEST_CASE("cover is coarse and fast on many chunks") {
  // 200000 slabs along dim 0 of a [200000, 8] tensor: one tile each, no per-element work.
  const shape_t shape{200000, 8};
  std::vector<Box> boxes;
  for (dim_t i = 0; i < 200000; ++i) boxes.push_back(Box{{199999 - i, 0}, {1, 8}});
  std::vector<CoverTile> tiles;
  CHECK_FALSE(cover(full_box(shape), boxes, false, &tiles));
  CHECK(tiles.size() == 200000);
  // Column halves of a huge matrix: two tiles, whatever the row count.
  const shape_t big{std::int64_t{1} << 40, 1024};
  std::vector<Box> halves{Box{{0, 512}, {std::int64_t{1} << 40, 512}}, Box{{0, 0}, {std::int64_t{1} << 40, 512}}};
  tiles.clear();
  CHECK_FALSE(cover(full_box(big), halves, false, &tiles));
  CHECK(tiles.size() == 2);
  halves[0].offsets[1] = 511;
  halves[0].sizes[1] = 513;
  auto issue = cover(full_box(big), halves, false);
  REQUIRE(issue);
  CHECK(issue->what == CoverIssue::kind::overlap);
  CHECK(issue->index == shape_t{0, 511});
  halves[0].offsets[1] = 513;
  halves[0].sizes[1] = 511;
  issue = cover(full_box(big), halves, false);
  REQUIRE(issue);
  CHECK(issue->what == CoverIssue::kind::hole);
  CHECK(issue->index == shape_t{0, 512});
}

TEST_CASE("cover of a 0-d tensor") {
  const Box point{};
  CHECK(cover(point, std::vector<Box>{}, false)->what == CoverIssue::kind::hole);
  std::vector<CoverTile> tiles;
  CHECK_FALSE(cover(point, std::vector<Box>{Box{}}, false, &tiles));
  CHECK(tiles.size() == 1);
  CHECK(cover(point, std::vector<Box>{Box{}, Box{}}, false)->what == CoverIssue::kind::overlap);
  CHECK_FALSE(cover(point, std::vector<Box>{Box{}, Box{}}, true));
}
