// statedict: exact coverage of a box by other boxes, proven by a sweep (no per-element work).
// SPDX-License-Identifier: MIT
//
// `cover(target, boxes, ...)` decides whether the boxes cover every element of `target`, and
// whether any element is covered twice, and produces a tiling of the target: disjoint boxes, each
// attributed to one input box. It sweeps one dimension at a time: the start and end of every box
// along dimension 0 cut the target into slabs; inside a slab the same boxes are active, so the slab
// is checked once, recursively on the remaining dimensions, with only the active boxes. Adjacent
// slabs with identical sub-tilings are merged, so the tiling stays as coarse as the input.
//
// Cost: O(m log m) per dimension and slab for m active boxes; chunkings along any one dimension,
// flat ranges cut into boxes and regular grids all stay near-linear. The first problem found is the
// row-major first uncovered or doubly covered element, reported as a multi-index.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "box.hpp"

namespace statedict::inline v0 {

/// A problem found by cover(): the row-major first element of the target covered by no box
/// (`hole`) or by two boxes (`overlap`, naming the two boxes by index).
struct CoverIssue {
  enum class kind : std::uint8_t { hole, overlap };
  kind what = kind::hole;
  shape_t index;             ///< the element (global multi-index)
  std::uint32_t first = 0;   ///< overlap: the two boxes (indices into the input span), first < second
  std::uint32_t second = 0;
};

/// One box of a tiling, attributed to input box `which`.
struct CoverTile {
  Box box;
  std::uint32_t which = 0;
  friend bool operator==(const CoverTile&, const CoverTile&) = default;
};

namespace detail {
class coverer {
 public:
  coverer(const Box& target, std::span<const Box> boxes, bool allow_overlap)
      : t_(target), n_(target.offsets.size()), allow_(allow_overlap), where_(target.offsets), scratch_(n_ + 1) {
    clipped_.reserve(boxes.size());
    for (std::size_t i = 0; i < boxes.size(); ++i) {
      auto c = intersect(target, boxes[i]);
      if (!c && !(n_ == 0 && boxes[i].offsets.empty())) continue;
      clipped_.push_back(c ? std::move(*c) : Box{});
      ids_.push_back(static_cast<std::uint32_t>(i));
    }
  }

  std::optional<CoverIssue> run(std::vector<CoverTile>* out) {
    if (is_empty(t_) && n_ > 0) {
      if (out) out->clear();
      return std::nullopt;
    }
    std::vector<std::uint32_t> all(clipped_.size());
    for (std::uint32_t i = 0; i < all.size(); ++i) all[i] = i;
    std::vector<CoverTile> tiles;
    if (!rec(0, all, tiles)) return issue_;
    if (out) {
      for (auto& t : tiles) t.which = ids_[t.which];
      *out = std::move(tiles);
    }
    return std::nullopt;
  }

 private:
  // Tiles dims [d, n) of the current slab with the active boxes `act` (local ids, in preference
  // order). Tiles come back full-rank; only dims >= d are meaningful.
  bool rec(std::size_t d, const std::vector<std::uint32_t>& act, std::vector<CoverTile>& out) {
    if (d == n_) {
      if (act.empty()) return fail_hole(d);
      if (act.size() > 1 && !allow_) {
        issue_ = CoverIssue{CoverIssue::kind::overlap, where_, ids_[act[0]], ids_[act[1]]};
        return false;
      }
      out.push_back(CoverTile{Box{shape_t(n_, 0), shape_t(n_, 1)}, act[0]});
      return true;
    }
    const dim_t lo = t_.offsets[d], hi = t_.offsets[d] + t_.sizes[d];
    // Scratch reused across calls at this depth (one call per depth is active at a time).
    auto& sc = scratch_[d];
    auto& cuts = sc.cuts;
    auto& by_start = sc.by_start;
    auto& live = sc.live;
    auto& sub = sc.sub;
    auto& prev_sub = sc.prev_sub;
    cuts.clear();
    live.clear();
    prev_sub.clear();
    cuts.push_back(lo);
    cuts.push_back(hi);
    for (std::uint32_t i : act) {
      cuts.push_back(clipped_[i].offsets[d]);
      cuts.push_back(clipped_[i].offsets[d] + clipped_[i].sizes[d]);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    // Boxes by start along d, for the sweep; the active set is kept in preference order.
    by_start.assign(act.begin(), act.end());
    std::stable_sort(by_start.begin(), by_start.end(),
                     [&](std::uint32_t x, std::uint32_t y) { return clipped_[x].offsets[d] < clipped_[y].offsets[d]; });
    std::size_t next = 0;
    std::size_t prev_begin = 0;  // tiles of the previous slab are out[prev_begin, out.size())
    bool have_prev = false;
    dim_t prev_end = lo;
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      const dim_t a = cuts[c], b = cuts[c + 1];
      // Active in [a, b): start <= a < end (every start and end is a cut).
      std::erase_if(live, [&](std::uint32_t i) { return clipped_[i].offsets[d] + clipped_[i].sizes[d] <= a; });
      while (next < by_start.size() && clipped_[by_start[next]].offsets[d] <= a) {
        const std::uint32_t i = by_start[next++];
        if (clipped_[i].offsets[d] + clipped_[i].sizes[d] > a) live.insert(std::lower_bound(live.begin(), live.end(), i), i);
      }
      where_[d] = a;
      if (live.empty()) return fail_hole(d);
      sub.clear();
      if (!rec(d + 1, live, sub)) return false;
      if (have_prev && prev_end == a && sub == prev_sub) {
        for (std::size_t k = prev_begin; k < out.size(); ++k) out[k].box.sizes[d] += b - a;
      } else {
        prev_begin = out.size();
        for (CoverTile t : sub) {
          t.box.offsets[d] = a;
          t.box.sizes[d] = b - a;
          out.push_back(std::move(t));
        }
        prev_sub.swap(sub);
        have_prev = true;
      }
      prev_end = b;
    }
    where_[d] = t_.offsets[d];
    return true;
  }

  bool fail_hole(std::size_t d) {
    for (std::size_t j = d + 1; j < n_; ++j) where_[j] = t_.offsets[j];
    issue_ = CoverIssue{CoverIssue::kind::hole, where_, 0, 0};
    return false;
  }

  struct scratch {
    std::vector<dim_t> cuts;
    std::vector<std::uint32_t> by_start, live;
    std::vector<CoverTile> sub, prev_sub;
  };
  const Box& t_;
  std::size_t n_;
  bool allow_;
  std::vector<Box> clipped_;
  std::vector<std::uint32_t> ids_;
  shape_t where_;
  CoverIssue issue_;
  std::vector<scratch> scratch_;
};
}  // namespace detail

/// Checks that `boxes` (clipped to `target`) cover every element of `target`, and, unless
/// `allow_overlap`, none twice. On success fills `*tiles` (when given) with a tiling of the target
/// by disjoint boxes, each attributed to the input box that provides it: where boxes overlap, the
/// one with the lowest index wins. Returns the first problem otherwise. Boxes must have the
/// target's rank; a 0-d target is one element.
inline std::optional<CoverIssue> cover(const Box& target, std::span<const Box> boxes, bool allow_overlap,
                                       std::vector<CoverTile>* tiles = nullptr) {
  // The common case, a whole tensor in one chunk, without the sweep's allocations (the sweep gives
  // the same single tile).
  if (boxes.size() == 1 && boxes[0] == target && !is_empty(target)) {
    if (tiles) tiles->assign(1, CoverTile{target, 0});
    return std::nullopt;
  }
  detail::coverer c(target, boxes, allow_overlap);
  return c.run(tiles);
}

}  // namespace statedict::inline v0
