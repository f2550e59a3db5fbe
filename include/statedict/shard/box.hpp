// statedict: placement algebra. Boxes and flat ranges of a tensor's index space, their
// intersections, their decomposition into maximal contiguous row-major runs, and the affine map
// from a chunk's global indices to element offsets in its storage (through its stored strides).
// SPDX-License-Identifier: MIT
//
// No file knowledge here. Every function that takes a region or strides from a description checks
// it (regions inside the tensor, checked 64-bit arithmetic), so hostile shapes from files raise
// errors instead of overflowing.
//
// Conventions: a flat range indexes the row-major flattening of the *global* tensor. A chunk's
// storage is addressed in elements; Placement::strides are element strides over the chunk's own
// shape (its box sizes, or {size} for a flat range), empty meaning row-major contiguous.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "checkpoint.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id bad_region  {600, error_kind::format, "shard.bad_region"};
inline constexpr error_id bad_strides {601, error_kind::format, "shard.bad_strides"};
// clang-format on
}  // namespace errors

/// The region of a chunk: an n-d box or a range of the row-major flattened index.
using ChunkRegion = std::variant<Box, FlatRange>;

/// Largest tensor rank the placement algebra accepts (recursion depth of the coverage sweep).
inline constexpr std::size_t max_placement_rank = 64;

namespace detail {
inline std::uint64_t u64(dim_t v) noexcept { return static_cast<std::uint64_t>(v); }
inline dim_t i64(std::uint64_t v) noexcept { return static_cast<dim_t>(v); }
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Indices

/// Row-major linear index of `idx` in `shape` (idx must be inside shape; no checks).
inline std::uint64_t linear_index(std::span<const dim_t> shape, std::span<const dim_t> idx) noexcept {
  std::uint64_t lin = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) lin = lin * detail::u64(shape[d]) + detail::u64(idx[d]);
  return lin;
}

/// Multi-index of row-major linear index `lin` in `shape` (lin < numel(shape)).
inline shape_t multi_index(std::span<const dim_t> shape, std::uint64_t lin) {
  shape_t idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::uint64_t n = detail::u64(shape[d]);
    idx[d] = n ? detail::i64(lin % n) : 0;
    lin = n ? lin / n : 0;
  }
  return idx;
}

// ---------------------------------------------------------------------------------------------
// Boxes and flat ranges

/// The box covering all of `shape`.
inline Box full_box(std::span<const dim_t> shape) {
  return Box{shape_t(shape.size(), 0), shape_t(shape.begin(), shape.end())};
}

/// Number of elements of a box (checked).
inline std::uint64_t numel(const Box& b) { return numel(b.sizes); }

/// True when the box holds no element.
inline bool is_empty(const Box& b) noexcept {
  return std::any_of(b.sizes.begin(), b.sizes.end(), [](dim_t s) { return s <= 0; });
}

/// Number of elements of a region (checked).
inline std::uint64_t region_numel(const ChunkRegion& r) {
  if (const auto* b = std::get_if<Box>(&r)) return numel(*b);
  const auto& f = std::get<FlatRange>(r);
  return f.end >= f.begin ? f.end - f.begin : 0;
}

/// The shape of a chunk's own storage: the box sizes, or {size} of a flat range.
inline shape_t region_shape(const ChunkRegion& r) {
  if (const auto* b = std::get_if<Box>(&r)) return b->sizes;
  return shape_t{detail::i64(std::get<FlatRange>(r).size())};
}

/// True when the region holds every element of a tensor of `shape` (a whole box, or the whole
/// flat range).
inline bool covers_whole(const ChunkRegion& r, std::span<const dim_t> shape) {
  if (const Box* b = std::get_if<Box>(&r))
    return std::equal(b->sizes.begin(), b->sizes.end(), shape.begin(), shape.end()) &&
           std::all_of(b->offsets.begin(), b->offsets.end(), [](dim_t o) { return o == 0; });
  const auto& f = std::get<FlatRange>(r);
  return f.begin == 0 && f.end == numel(shape);
}

/// `inner` lies inside `outer` (same rank). An empty inner box lies inside any box of its rank.
inline bool contains(const Box& outer, const Box& inner) noexcept {
  if (outer.offsets.size() != inner.offsets.size()) return false;
  if (is_empty(inner)) return true;
  for (std::size_t d = 0; d < outer.offsets.size(); ++d)
    if (inner.offsets[d] < outer.offsets[d] ||
        inner.offsets[d] + inner.sizes[d] > outer.offsets[d] + outer.sizes[d])
      return false;
  return true;
}

/// The intersection of two boxes of the same rank, or nullopt when it is empty.
inline std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.offsets.size() != b.offsets.size()) return std::nullopt;
  Box r{shape_t(a.offsets.size()), shape_t(a.offsets.size())};
  for (std::size_t d = 0; d < a.offsets.size(); ++d) {
    const dim_t lo = std::max(a.offsets[d], b.offsets[d]);
    const dim_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets[d] = lo;
    r.sizes[d] = hi - lo;
  }
  return r;
}

/// The intersection of two flat ranges, or nullopt when it is empty.
inline std::optional<FlatRange> intersect(const FlatRange& a, const FlatRange& b) noexcept {
  const std::uint64_t lo = std::max(a.begin, b.begin), hi = std::min(a.end, b.end);
  if (hi <= lo) return std::nullopt;
  return FlatRange{lo, hi};
}

/// Row-major linear extent [first, last + 1) of a non-empty box.
inline FlatRange linear_extent(const Box& b, std::span<const dim_t> shape) {
  shape_t last(b.offsets.size());
  for (std::size_t d = 0; d < last.size(); ++d) last[d] = b.offsets[d] + b.sizes[d] - 1;
  return FlatRange{linear_index(shape, b.offsets), linear_index(shape, last) + 1};
}

/// Throws errors::bad_region unless `r` is a well-formed region of a tensor of shape `shape`
/// (box of the right rank, offsets and sizes non-negative, inside the shape; flat range ordered and
/// inside numel). `what` names the chunk in the message.
inline void check_region(const ChunkRegion& r, std::span<const dim_t> shape, std::string_view what) {
  if (shape.size() > max_placement_rank)
    throw_error(errors::too_many_dims, std::string(what), "rank " + std::to_string(shape.size()) + " exceeds " +
                                                              std::to_string(max_placement_rank));
  const std::uint64_t total = numel(shape);
  if (const auto* f = std::get_if<FlatRange>(&r)) {
    if (f->begin > f->end || f->end > total)
      throw_error(errors::bad_region, std::string(what),
                  "flat range [" + std::to_string(f->begin) + ", " + std::to_string(f->end) +
                      ") is not inside the " + std::to_string(total) + " elements of shape " + to_string(shape));
    return;
  }
  const auto& b = std::get<Box>(r);
  if (b.offsets.size() != shape.size() || b.sizes.size() != shape.size())
    throw_error(errors::bad_region, std::string(what),
                "box with offsets " + to_string(b.offsets) + " and sizes " + to_string(b.sizes) +
                    " does not have the rank of shape " + to_string(shape));
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (b.offsets[d] < 0 || b.sizes[d] < 0 || b.offsets[d] > shape[d] || b.sizes[d] > shape[d] - b.offsets[d])
      throw_error(errors::bad_region, std::string(what),
                  "box with offsets " + to_string(b.offsets) + " and sizes " + to_string(b.sizes) +
                      " is not inside shape " + to_string(shape) + " (dimension " + std::to_string(d) + ")");
  }
}

namespace detail {
// Emits boxes covering the relative linear range [b, e) of the block spanned by dims d..n-1, in
// row-major order; `prefix` holds the indices of dims < d. At most one box per level on the way in
// (head) and one on the way out (tail), so at most 2n - 1 boxes in all.
template <class F>
void flat_to_boxes_rec(std::span<const dim_t> shape, std::span<const std::uint64_t> block, std::size_t d,
                       std::uint64_t b, std::uint64_t e, shape_t& prefix, F& emit) {
  const std::size_t n = shape.size();
  auto box_at = [&](std::uint64_t first, std::uint64_t count) {
    Box out{shape_t(n, 0), shape_t(shape.begin(), shape.end())};
    for (std::size_t j = 0; j < d; ++j) {
      out.offsets[j] = prefix[j];
      out.sizes[j] = 1;
    }
    out.offsets[d] = i64(first);
    out.sizes[d] = i64(count);
    emit(std::move(out));
  };
  if (d + 1 == n) {
    box_at(b, e - b);
    return;
  }
  const std::uint64_t c = block[d];  // elements per index of dim d
  std::uint64_t i0 = b / c, i1 = e / c;
  const std::uint64_t r0 = b % c, r1 = e % c;
  if (i0 == i1) {  // inside one index of dim d
    prefix[d] = i64(i0);
    flat_to_boxes_rec(shape, block, d + 1, r0, r1, prefix, emit);
    return;
  }
  if (r0 != 0) {  // head: the rest of index i0
    prefix[d] = i64(i0);
    flat_to_boxes_rec(shape, block, d + 1, r0, c, prefix, emit);
    ++i0;
  }
  if (i1 > i0) box_at(i0, i1 - i0);  // whole indices of dim d
  if (r1 != 0) {                     // tail: the start of index i1
    prefix[d] = i64(i1);
    flat_to_boxes_rec(shape, block, d + 1, 0, r1, prefix, emit);
  }
}
}  // namespace detail

/// Calls emit(Box) for the boxes that tile the flat range `r` of `shape` exactly, in row-major order
/// (at most 2 * rank - 1 boxes; one box for a 0-d tensor). The range must be inside the shape.
template <class F>
void for_each_box(const FlatRange& r, std::span<const dim_t> shape, F&& emit) {
  if (r.end <= r.begin) return;
  if (shape.empty()) {
    emit(Box{});
    return;
  }
  std::vector<std::uint64_t> block(shape.size(), 1);
  for (std::size_t d = shape.size() - 1; d-- > 0;) block[d] = block[d + 1] * detail::u64(shape[d + 1]);
  shape_t prefix(shape.size(), 0);
  detail::flat_to_boxes_rec(shape, block, 0, r.begin, r.end, prefix, emit);
}

/// The boxes that tile a flat range (see for_each_box).
inline std::vector<Box> to_boxes(const FlatRange& r, std::span<const dim_t> shape) {
  std::vector<Box> out;
  for_each_box(r, shape, [&](Box b) { out.push_back(std::move(b)); });
  return out;
}

/// Calls f(first, count) for each maximal contiguous row-major run [first, first + count) of the
/// global tensor that lies in box `b`, in increasing order.
template <class F>
void for_each_run(const Box& b, std::span<const dim_t> shape, F&& f) {
  if (is_empty(b)) return;
  const std::size_t n = shape.size();
  if (n == 0) {
    f(std::uint64_t{0}, std::uint64_t{1});
    return;
  }
  // The run spans the innermost dims that the box covers fully, plus the next one out.
  std::size_t k = n - 1;
  std::uint64_t run = detail::u64(b.sizes[k]);
  while (k > 0 && b.sizes[k] == shape[k]) {
    --k;
    run *= detail::u64(b.sizes[k]);
  }
  // Odometer over dims < k; dim k's start is b.offsets[k].
  shape_t idx(b.offsets.begin(), b.offsets.end());
  for (;;) {
    f(linear_index(shape, idx), run);
    std::size_t d = k;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++idx[d] < b.offsets[d] + b.sizes[d]) break;
      idx[d] = b.offsets[d];
    }
  }
}

/// Calls f(first, count) for each maximal contiguous row-major run of the intersection of two
/// regions of a tensor of shape `shape`, in increasing order.
template <class F>
void for_each_run(const ChunkRegion& a, const ChunkRegion& b, std::span<const dim_t> shape, F&& f) {
  const auto* fa = std::get_if<FlatRange>(&a);
  const auto* fb = std::get_if<FlatRange>(&b);
  if (fa && fb) {
    if (auto i = intersect(*fa, *fb)) f(i->begin, i->size());
    return;
  }
  // Collect the runs of each box part and merge adjacent ones, so that a flat range cut into
  // boxes still yields maximal runs.
  std::vector<Box> pa, pb;
  if (fa) pa = to_boxes(*fa, shape); else pa.push_back(std::get<Box>(a));
  if (fb) pb = to_boxes(*fb, shape); else pb.push_back(std::get<Box>(b));
  std::uint64_t cur = 0, len = 0;
  bool have = false;
  std::vector<FlatRange> runs;
  for (const Box& x : pa)
    for (const Box& y : pb)
      if (auto i = intersect(x, y)) for_each_run(*i, shape, [&](std::uint64_t s, std::uint64_t c) { runs.push_back({s, s + c}); });
  std::sort(runs.begin(), runs.end(), [](const FlatRange& p, const FlatRange& q) { return p.begin < q.begin; });
  for (const FlatRange& r : runs) {
    if (have && r.begin == cur + len) {
      len += r.size();
      continue;
    }
    if (have) f(cur, len);
    cur = r.begin;
    len = r.size();
    have = true;
  }
  if (have) f(cur, len);
}

// ---------------------------------------------------------------------------------------------
// Chunks mapped to their storage

/// A box of a chunk's region with the affine map from a global index `g` inside `box` to the
/// element offset in the chunk's storage: `base + sum_d (g[d] - box.offsets[d]) * step[d]`.
/// A box chunk is one MappedBox; a flat range is cut into at most 2n - 1 of them.
struct MappedBox {
  Box box;
  std::vector<std::uint64_t> step;  ///< storage elements per unit of each global dimension
  std::uint64_t base = 0;           ///< storage element offset of box.offsets

  /// Storage element offset of global index `g` (inside box; no checks).
  [[nodiscard]] std::uint64_t offset_of(std::span<const dim_t> g) const noexcept {
    std::uint64_t off = base;
    for (std::size_t d = 0; d < step.size(); ++d) off += detail::u64(g[d] - box.offsets[d]) * step[d];
    return off;
  }
};

namespace detail {
inline std::vector<std::uint64_t> storage_strides(const Chunk& c, const shape_t& own, std::string_view what) {
  if (c.at.strides.empty()) {
    const shape_t s = contiguous_strides(own);
    return std::vector<std::uint64_t>(s.begin(), s.end());
  }
  if (c.at.strides.size() != own.size())
    throw_error(errors::bad_strides, std::string(what),
                "strides " + to_string(c.at.strides) + " do not match the chunk shape " + to_string(own));
  std::vector<std::uint64_t> out(own.size());
  for (std::size_t d = 0; d < own.size(); ++d) {
    if (c.at.strides[d] < 0)
      throw_error(errors::bad_strides, std::string(what), "negative stride in " + to_string(c.at.strides));
    out[d] = u64(c.at.strides[d]);
  }
  return out;
}

inline std::uint64_t storage_extent(const shape_t& own, const std::vector<std::uint64_t>& st, std::string_view what) {
  if (numel(own) == 0) return 0;
  std::uint64_t last = 0;
  for (std::size_t d = 0; d < own.size(); ++d)
    last = checked_add(last, checked_mul(u64(own[d] - 1), st[d], "chunk extent"), "chunk extent");
  const std::uint64_t ext = checked_add(last, 1, "chunk extent");
  if (ext > max_size)
    throw_error(errors::overflow, std::string(what), "chunk extent " + std::to_string(ext) + " exceeds 2^63-1 elements");
  return ext;
}
}  // namespace detail

/// The element strides of a chunk's storage over its own shape (Placement::strides, or row-major
/// contiguous when empty), checked: right count, non-negative.
inline std::vector<std::uint64_t> storage_strides(const Chunk& c, std::string_view what) {
  return detail::storage_strides(c, region_shape(c.region), what);
}

/// Number of storage elements a chunk spans: one past its last addressed element (0 when empty),
/// checked against 64-bit overflow. The region must already be checked (check_region).
inline std::uint64_t storage_extent(const Chunk& c, std::string_view what) {
  const shape_t own = region_shape(c.region);
  return detail::storage_extent(own, detail::storage_strides(c, own, what), what);
}

/// Checks a chunk against its tensor's shape (region and strides) and returns its mapped boxes;
/// with `extent`, also its storage_extent.
inline std::vector<MappedBox> mapped_boxes(const Chunk& c, std::span<const dim_t> shape, std::string_view what,
                                           std::uint64_t* extent = nullptr) {
  check_region(c.region, shape, what);
  const shape_t own = region_shape(c.region);
  auto st = detail::storage_strides(c, own, what);
  const std::uint64_t ext = detail::storage_extent(own, st, what);  // overflow check of the whole addressed range
  if (extent) *extent = ext;
  std::vector<MappedBox> out;
  if (const auto* b = std::get_if<Box>(&c.region)) {
    if (!is_empty(*b)) out.push_back(MappedBox{*b, std::move(st), 0});
    return out;
  }
  const auto& f = std::get<FlatRange>(c.region);
  if (f.end <= f.begin) return out;
  // Flat storage element e holds global linear index f.begin + e; its offset is e * s.
  const std::uint64_t s = st.empty() ? 1 : st[0];
  const shape_t cs = shape.empty() ? shape_t{} : contiguous_strides(shape);
  for_each_box(f, shape, [&](Box b) {
    MappedBox m;
    m.step.resize(shape.size());
    for (std::size_t d = 0; d < shape.size(); ++d) m.step[d] = detail::u64(cs[d]) * s;
    m.base = (linear_index(shape, b.offsets) - f.begin) * s;
    m.box = std::move(b);
    out.push_back(std::move(m));
  });
  return out;
}

/// One copy pattern in storage elements: `reps` runs of `count` contiguous elements; run i starts
/// at `a + i * a_step` in storage A and `b + i * b_step` in storage B.
struct StorageRuns {
  std::uint64_t a = 0, b = 0;
  std::uint64_t count = 0, reps = 1;
  std::uint64_t a_step = 0, b_step = 0;
};

/// Decomposes box `g` (inside both `a.box` and `b.box`) into copy patterns between the storages of
/// two mapped boxes, in row-major order of `g`: runs are maximal for elements contiguous in both
/// storages, one level of repetition is folded into `reps`, outer dimensions are enumerated.
/// Calls f(StorageRuns) for each pattern.
template <class F>
void for_each_storage_run(const Box& g, const MappedBox& a, const MappedBox& b, F&& f) {
  if (is_empty(g)) return;
  struct level {
    std::uint64_t n, sa, sb;
  };
  if (g.sizes.size() > max_placement_rank)
    throw_error(errors::too_many_dims, "rank " + std::to_string(g.sizes.size()) + " exceeds " +
                                           std::to_string(max_placement_rank));
  // Dimensions of size > 1, outer to inner, merged where both storages continue evenly (on the
  // stack: this runs once per copy pattern).
  std::array<level, max_placement_rank> merged;
  std::size_t nm = 0;
  for (std::size_t d = 0; d < g.sizes.size(); ++d) {
    if (g.sizes[d] <= 1) continue;
    const level l{detail::u64(g.sizes[d]), a.step[d], b.step[d]};
    if (nm > 0 && merged[nm - 1].sa == l.sa * l.n && merged[nm - 1].sb == l.sb * l.n)
      merged[nm - 1] = level{merged[nm - 1].n * l.n, l.sa, l.sb};
    else
      merged[nm++] = l;
  }
  const std::uint64_t a0 = a.offset_of(g.offsets), b0 = b.offset_of(g.offsets);
  if (nm == 0) {
    f(StorageRuns{a0, b0, 1, 1, 0, 0});
    return;
  }
  StorageRuns r;
  std::size_t outer;  // merged levels [0, outer) are enumerated
  const level& in = merged[nm - 1];
  if (in.sa == 1 && in.sb == 1) {
    r.count = in.n;
    if (nm >= 2) {
      const level& rep = merged[nm - 2];
      r.reps = rep.n;
      r.a_step = rep.sa;
      r.b_step = rep.sb;
      outer = nm - 2;
    } else {
      outer = 0;
    }
  } else {
    r.count = 1;
    r.reps = in.n;
    r.a_step = in.sa;
    r.b_step = in.sb;
    outer = nm - 1;
  }
  std::array<std::uint64_t, max_placement_rank> idx{};
  for (;;) {
    StorageRuns x = r;
    x.a = a0;
    x.b = b0;
    for (std::size_t j = 0; j < outer; ++j) {
      x.a += idx[j] * merged[j].sa;
      x.b += idx[j] * merged[j].sb;
    }
    f(x);
    std::size_t j = outer;
    for (;;) {
      if (j == 0) return;
      --j;
      if (++idx[j] < merged[j].n) break;
      idx[j] = 0;
    }
  }
}

/// Global multi-index of storage element `e` of a chunk, or nullopt when `e` is not an element of it
/// (a gap between strided elements). Used to name elements in messages.
inline std::optional<shape_t> global_index_of(const Chunk& c, std::span<const dim_t> shape, std::uint64_t e) {
  const shape_t own = region_shape(c.region);
  if (numel(own) == 0) return std::nullopt;
  std::vector<std::uint64_t> st;
  try {
    st = storage_strides(c, "chunk");
  } catch (const error&) {
    return std::nullopt;
  }
  // Peel dimensions by decreasing stride (exact for row-major and permuted layouts).
  std::vector<std::size_t> order(own.size());
  for (std::size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return st[x] > st[y]; });
  shape_t local(own.size(), 0);
  std::uint64_t rest = e;
  for (std::size_t d : order) {
    if (own[d] <= 1 || st[d] == 0) continue;
    const std::uint64_t q = std::min(rest / st[d], detail::u64(own[d] - 1));
    local[d] = detail::i64(q);
    rest -= q * st[d];
  }
  if (rest != 0) return std::nullopt;
  if (const auto* b = std::get_if<Box>(&c.region)) {
    for (std::size_t d = 0; d < local.size(); ++d) local[d] += b->offsets[d];
    return local;
  }
  const auto& f = std::get<FlatRange>(c.region);
  return multi_index(shape, f.begin + detail::u64(local.empty() ? 0 : local[0]));
}

}  // namespace statedict::inline v0
