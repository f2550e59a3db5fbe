// statedict: the resharding planner. A source description (ShardedCheckpoint) and a destination
// description (Destination) give a Plan: copy operations in bytes, proven before any byte moves.
// SPDX-License-Identifier: MIT
//
// make_plan(src, dst):
//   1. checks every chunk it will use: region inside its tensor, strides, source id, and its bytes
//      inside its source (ByteSource::size) or destination (Destination::sizes);
//   2. proves, per destination chunk, that the source chunks cover each of its elements exactly
//      once (replicas, i.e. identical source regions, count once: the first by (source, offset)
//      is read), and that the destination chunks cover each destination tensor; the proof is the
//      sweep of shard/cover.hpp, not a walk over elements;
//   3. emits copy operations (runs of elements contiguous in both storages, with one level of
//      repetition), merges them into the largest sequential copies and orders them by source
//      and source offset, so each source is read sequentially;
//   4. verifies the result independently at the byte level (verify()): per destination, the bytes
//      written by the operations are exactly the bytes of its chunks, none twice, and every read
//      lies inside its source.
// Errors name the tensor and the first uncovered or doubly covered element as a multi-index.
//
// Elements of a source that no destination chunk needs are never read. Casts follow the value:
// stored source dtype -> source logical dtype -> destination logical dtype -> stored destination
// dtype, each exact (core/cast.hpp); exact widenings followed by another cast are folded away, so
// most copies are a single cast or none.
//
// A plan splits into K parts by destination (assign_parts / select_part): K processes write
// disjoint outputs (docs/slurm.md).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "../core/cast.hpp"
#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "box.hpp"
#include "checkpoint.hpp"
#include "plan_options.hpp"
#include "cover.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id bad_source_id         {604, error_kind::format, "plan.bad_source_id"};
inline constexpr error_id chunk_outside_source  {605, error_kind::format, "plan.chunk_outside_source"};
inline constexpr error_id missing_tensor        {606, error_kind::key,    "plan.missing_tensor"};
inline constexpr error_id tensor_shape_mismatch {607, error_kind::shape,  "plan.shape_mismatch"};
inline constexpr error_id uncovered             {608, error_kind::plan,   "plan.uncovered"};
inline constexpr error_id source_overlap        {609, error_kind::plan,   "plan.source_overlap"};
inline constexpr error_id destination_uncovered {610, error_kind::plan,   "plan.destination_uncovered"};
inline constexpr error_id destination_overlap   {611, error_kind::plan,   "plan.destination_overlap"};
inline constexpr error_id unwritten             {612, error_kind::plan,   "plan.unwritten"};
inline constexpr error_id written_twice         {613, error_kind::plan,   "plan.written_twice"};
inline constexpr error_id read_outside          {614, error_kind::plan,   "plan.read_outside"};
inline constexpr error_id write_outside         {615, error_kind::plan,   "plan.write_outside"};
inline constexpr error_id too_many_ops          {616, error_kind::limit,  "plan.too_many_ops"};
inline constexpr error_id destination_too_small {618, error_kind::plan,   "plan.destination_too_small"};
inline constexpr error_id duplicate_tensor      {619, error_kind::key,    "plan.duplicate_tensor"};
inline constexpr error_id destination_byte_order{117, error_kind::usage,  "core.destination_byte_order"};
// clang-format on
}  // namespace errors

/// One copy: `reps` runs of `count` elements. Run i is read at src_offset + i * src_step bytes of
/// source `src` and written at dst_offset + i * dst_step bytes of destination `dst`. Elements are
/// converted src_dtype -> via[0] -> ... -> via[nvia - 1] -> dst_dtype.
struct CopyOp {
  std::uint32_t tensor = 0;  ///< index into Plan::tensors (the first tensor when merged across tensors)
  std::uint32_t src = 0;
  std::uint32_t dst = 0;
  dtype src_dtype = dtype::F32;
  dtype dst_dtype = dtype::F32;
  std::array<dtype, 2> via{dtype::F32, dtype::F32};
  std::uint8_t nvia = 0;
  std::uint64_t src_offset = 0;
  std::uint64_t dst_offset = 0;
  std::uint64_t count = 0;
  std::uint64_t reps = 1;
  std::uint64_t src_step = 0;
  std::uint64_t dst_step = 0;
  /// The source elements are big-endian (Placement::order): swapped as they are read, before any
  /// cast, so the op is never a plain byte copy.
  bool swap = false;

  [[nodiscard]] std::uint64_t elements() const noexcept { return count * reps; }
  [[nodiscard]] std::uint64_t src_bytes() const noexcept { return elements() * itemsize(src_dtype); }
  [[nodiscard]] std::uint64_t dst_bytes() const noexcept { return elements() * itemsize(dst_dtype); }
  /// True when no conversion happens (a byte copy).
  [[nodiscard]] bool plain() const noexcept { return nvia == 0 && src_dtype == dst_dtype && (!swap || info(src_dtype).swap_unit == 1); }
  friend bool operator==(const CopyOp&, const CopyOp&) = default;
};

/// A comparison of two replicas of the same elements (plan_options::check_replicas): `reps` runs
/// of `count` elements at a_offset + i * a_step of source `a` and b_offset + i * b_step of source
/// `b`, compared after converting both to the tensor's logical dtype.
struct CompareOp {
  std::uint32_t tensor = 0;
  std::uint32_t a = 0, b = 0;
  dtype a_dtype = dtype::F32, b_dtype = dtype::F32, logical = dtype::F32;
  std::uint64_t a_offset = 0, b_offset = 0;
  std::uint64_t count = 0, reps = 1;
  std::uint64_t a_step = 0, b_step = 0;
  bool a_swap = false, b_swap = false;  ///< big-endian elements (swapped before comparing)
  shape_t first_index;  ///< global index of the first element compared (for messages)
};

/// The copy operations that turn a source checkpoint into a destination layout.
struct Plan {
  /// The destination tensors with their destination chunks (Placement::source = destination).
  std::vector<TensorInfo> tensors;
  std::vector<std::string> source_names;
  std::vector<std::uint64_t> source_sizes;
  std::vector<std::string> destination_names;
  /// Bytes of each destination: the declared size, or as far as its chunks reach.
  std::vector<std::uint64_t> destination_sizes;
  /// Ordered by (source, source offset): each source is read front to back.
  std::vector<CopyOp> ops;
  std::vector<CompareOp> checks;

  /// Bytes written in all.
  [[nodiscard]] std::uint64_t bytes() const noexcept {
    std::uint64_t n = 0;
    for (const auto& o : ops) n += o.dst_bytes();
    return n;
  }
  /// Bytes written into destination `d`.
  [[nodiscard]] std::uint64_t bytes_to(std::uint32_t d) const noexcept {
    std::uint64_t n = 0;
    for (const auto& o : ops)
      if (o.dst == d) n += o.dst_bytes();
    return n;
  }
};


namespace detail {

/// "rank3.distcp at byte 4096"
inline std::string where_in(const std::vector<std::string>& names, std::uint32_t id, std::uint64_t byte) {
  const std::string n = id < names.size() ? quote(names[id]) : ("#" + std::to_string(id));
  return n + " at byte " + std::to_string(byte);
}

inline bool exact_widening(dtype from, dtype to) noexcept {
  if (from == to) return true;
  // E8M0 spans 2^-127 .. 2^127: F16 cannot hold it, the 8-bit exponent types can.
  if (from == dtype::F8_E8M0) return to == dtype::BF16 || to == dtype::F32 || to == dtype::F64;
  if (is_floating(from) && is_floating(to)) return itemsize(to) > itemsize(from);
  return (from == dtype::C64 && to == dtype::C128) || (from == dtype::C32 && (to == dtype::C64 || to == dtype::C128));
}

/// The conversion chain stored -> logical -> destination logical -> destination stored, with
/// identities and folded exact widenings removed. Throws errors::unsupported_cast.
inline std::vector<dtype> cast_chain(dtype a, dtype l, dtype t, dtype b) {
  std::vector<dtype> c{a};
  for (dtype x : {l, t, b})
    if (x != c.back()) c.push_back(x);
  for (std::size_t i = 0; i + 1 < c.size(); ++i) check_cast(c[i], c[i + 1]);
  // X -> Y exact, followed by Y -> Z: X -> Z gives the same value.
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t i = 0; i + 2 < c.size(); ++i)
      if (exact_widening(c[i], c[i + 1]) && can_cast(c[i], c[i + 2])) {
        c.erase(c.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        changed = true;
        break;
      }
    for (std::size_t i = 0; i + 1 < c.size(); ++i)
      if (c[i] == c[i + 1]) {
        c.erase(c.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        changed = true;
        break;
      }
  }
  return c;
}

struct SrcPiece {
  MappedBox m;
  std::uint32_t chunk = 0;
  std::uint32_t source = 0;
  std::uint64_t byte_offset = 0;
  dtype stored = dtype::F32;
  bool swap = false;  // big-endian elements
  FlatRange lin;  // linear extent of m.box
};

struct DstPiece {
  MappedBox m;
  std::uint32_t chunk = 0;
};

inline bool box_less(const Box& a, const Box& b) {
  return std::tie(a.offsets, a.sizes) < std::tie(b.offsets, b.sizes);
}

// ---------------------------------------------------------------------------------------------
// Merging run patterns by start offset (verify, ordered execution)

struct Pattern {
  std::uint64_t offset = 0, len = 0, reps = 1, step = 0;
  std::uint32_t tag = 0;
};

/// Calls f(start, len, tag, rep) for every run of every pattern in increasing start order (ties:
/// by pattern index); stops when f returns false. Memory O(#patterns).
template <class F>
void for_each_run_merged(std::span<const Pattern> pats, F&& f) {
  using item = std::tuple<std::uint64_t, std::uint32_t, std::uint64_t>;  // start, pattern, rep
  std::priority_queue<item, std::vector<item>, std::greater<>> heap;
  for (std::uint32_t i = 0; i < pats.size(); ++i)
    if (pats[i].reps > 0 && pats[i].len > 0) heap.emplace(pats[i].offset, i, 0);
  while (!heap.empty()) {
    auto [start, i, r] = heap.top();
    heap.pop();
    if (!f(start, pats[i].len, pats[i].tag, r)) return;
    if (r + 1 < pats[i].reps) heap.emplace(start + pats[i].step, i, r + 1);
  }
}

}  // namespace detail

/// Names the element held at byte `byte` of destination `d` of `plan`: "tensor 'w' element [3, 17]",
/// or "byte N" when no destination chunk holds it.
inline std::string describe_destination_byte(const Plan& plan, std::uint32_t d, std::uint64_t byte) {
  for (const auto& t : plan.tensors)
    for (const auto& c : t.chunks) {
      if (c.at.source != d || byte < c.at.byte_offset) continue;
      const std::size_t isz = itemsize(c.at.stored);
      std::uint64_t ext = 0;
      try {
        ext = storage_extent(c, t.name);
      } catch (const error&) {
        continue;
      }
      if (byte >= c.at.byte_offset + ext * isz) continue;
      const std::uint64_t e = (byte - c.at.byte_offset) / isz;
      if (auto g = global_index_of(c, t.shape, e)) return "tensor " + quote(t.name) + " element " + to_string(*g);
    }
  return "byte " + std::to_string(byte);
}

/// Checks a plan at the byte level: for each destination, the bytes the operations write are
/// exactly the bytes of its chunks, none written twice, and every read lies inside its source.
/// Throws errors::unwritten, written_twice, write_outside, destination_overlap or read_outside,
/// naming the destination, the tensor and the element.
/// `only`, when not empty, limits the check to the destinations it marks true (a part's plan).
inline void verify(const Plan& plan, const std::vector<bool>& only = {}) {
  using detail::Pattern;
  const std::size_t nd = plan.destination_names.size();
  auto checked = [&](std::uint32_t d) { return only.empty() || (d < only.size() && only[d]); };
  // Reads inside sources.
  for (const CopyOp& o : plan.ops) {
    if (o.src >= plan.source_sizes.size() || o.dst >= nd)
      throw_error(errors::read_outside, "plan", "operation refers to source " + std::to_string(o.src) +
                                                    " / destination " + std::to_string(o.dst) + " that do not exist");
    if (o.reps == 0 || o.count == 0) continue;
    const std::uint64_t last = checked_add(checked_mul(o.reps - 1, o.src_step, "read extent"),
                                           checked_mul(o.count, itemsize(o.src_dtype), "read extent"), "read extent");
    const std::uint64_t end = checked_add(o.src_offset, last, "read extent");
    if (end > plan.source_sizes[o.src])
      throw_error(errors::read_outside, "tensor " + quote(o.tensor < plan.tensors.size() ? plan.tensors[o.tensor].name : "?"),
                  "reads bytes up to " + std::to_string(end) + " of " + quote(plan.source_names[o.src]) + ", which has " +
                      std::to_string(plan.source_sizes[o.src]));
  }
  // Expected and written byte runs per destination.
  std::vector<std::vector<Pattern>> expected(nd), written(nd);
  struct chunk_ref {
    std::uint32_t tensor, chunk;
  };
  std::vector<chunk_ref> refs;
  for (std::uint32_t ti = 0; ti < plan.tensors.size(); ++ti) {
    const TensorInfo& t = plan.tensors[ti];
    for (std::uint32_t ci = 0; ci < t.chunks.size(); ++ci) {
      const Chunk& c = t.chunks[ci];
      if (c.at.source >= nd) continue;
      const std::uint64_t isz = itemsize(c.at.stored);
      const auto tag = static_cast<std::uint32_t>(refs.size());
      refs.push_back({ti, ci});
      const auto boxes = mapped_boxes(c, t.shape, t.name);
      for (const MappedBox& m : boxes) {
        // The storage runs of this part of the chunk (against itself).
        for_each_storage_run(m.box, m, m, [&](const StorageRuns& r) {
          expected[c.at.source].push_back(
              Pattern{c.at.byte_offset + r.a * isz, r.count * isz, r.reps, r.a_step * isz, tag});
        });
      }
    }
  }
  for (std::uint32_t i = 0; i < plan.ops.size(); ++i) {
    const CopyOp& o = plan.ops[i];
    const std::uint64_t isz = itemsize(o.dst_dtype);
    written[o.dst].push_back(Pattern{o.dst_offset, o.count * isz, o.reps, o.dst_step, i});
  }
  for (std::uint32_t d = 0; d < nd; ++d) {
    if (!checked(d)) continue;
    const std::string dest = "destination " + quote(plan.destination_names[d]);
    // Expected intervals, coalesced; two chunks on the same bytes is a destination overlap.
    std::vector<FlatRange> want;
    std::uint32_t prev_tag = 0;
    detail::for_each_run_merged(expected[d], [&](std::uint64_t s, std::uint64_t len, std::uint32_t tag, std::uint64_t) {
      if (!want.empty() && s < want.back().end) {
        const auto& a = refs[prev_tag];
        const auto& b = refs[tag];
        throw_error(errors::destination_overlap, dest,
                    "chunks of tensors " + quote(plan.tensors[a.tensor].name) + " and " + quote(plan.tensors[b.tensor].name) +
                        " share byte " + std::to_string(s) + " (" + describe_destination_byte(plan, d, s) + ")");
      }
      if (!want.empty() && s == want.back().end)
        want.back().end += len;
      else
        want.push_back(FlatRange{s, s + len});
      prev_tag = tag;
      return true;
    });
    // Written intervals, coalesced and compared with the expected ones as they come.
    std::size_t k = 0;
    bool have = false;
    FlatRange cur{};
    auto compare = [&](const FlatRange& w) {
      if (k >= want.size() || w.begin < want[k].begin)
        throw_error(errors::write_outside, dest,
                    "an operation writes byte " + std::to_string(w.begin) + ", which no destination chunk holds");
      if (w.begin > want[k].begin)
        throw_error(errors::unwritten, dest, describe_destination_byte(plan, d, want[k].begin) + " is never written");
      if (w.end < want[k].end)
        throw_error(errors::unwritten, dest, describe_destination_byte(plan, d, w.end) + " is never written");
      if (w.end > want[k].end)
        throw_error(errors::write_outside, dest,
                    "an operation writes byte " + std::to_string(want[k].end) + ", which no destination chunk holds");
      ++k;
    };
    detail::for_each_run_merged(written[d], [&](std::uint64_t s, std::uint64_t len, std::uint32_t, std::uint64_t) {
      if (have && s < cur.end)
        throw_error(errors::written_twice, dest, describe_destination_byte(plan, d, s) + " is written twice");
      if (have && s == cur.end) {
        cur.end += len;
      } else {
        if (have) compare(cur);
        cur = FlatRange{s, s + len};
        have = true;
      }
      return true;
    });
    if (have) compare(cur);
    if (k < want.size())
      throw_error(errors::unwritten, dest, describe_destination_byte(plan, d, want[k].begin) + " is never written");
  }
}

namespace detail {

inline void merge_ops(std::vector<CopyOp>& ops) {
  std::sort(ops.begin(), ops.end(), [](const CopyOp& a, const CopyOp& b) {
    return std::tie(a.src, a.src_offset, a.dst, a.dst_offset) < std::tie(b.src, b.src_offset, b.dst, b.dst_offset);
  });
  // Merged in place (a plan of millions of ops is not copied): ops[0, w) are the merged ones.
  std::size_t w = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const CopyOp& o = ops[i];
    if (w > 0) {
      CopyOp& p = ops[w - 1];
      const bool same = p.src == o.src && p.dst == o.dst && p.src_dtype == o.src_dtype && p.dst_dtype == o.dst_dtype &&
                        p.nvia == o.nvia && p.via == o.via && p.swap == o.swap;
      if (same && p.reps == 1 && o.reps == 1 && o.src_offset == p.src_offset + p.count * itemsize(p.src_dtype) &&
          o.dst_offset == p.dst_offset + p.count * itemsize(p.dst_dtype)) {
        p.count += o.count;
        continue;
      }
      if (same && p.reps > 1 && o.reps > 1 && p.count == o.count && p.src_step == o.src_step &&
          p.dst_step == o.dst_step && o.src_offset == p.src_offset + p.reps * p.src_step &&
          o.dst_offset == p.dst_offset + p.reps * p.dst_step) {
        p.reps += o.reps;
        continue;
      }
    }
    if (w != i) ops[w] = o;
    ++w;
  }
  ops.resize(w);
}

}  // namespace detail

namespace detail {

/// make_plan's work for one tensor at a time: the checked source pieces, the checked destination
/// pieces, the tiling of each destination piece by source pieces (copy operations) and the replica
/// comparisons.
class tensor_planner {
 public:
  tensor_planner(const ShardedCheckpoint& src, const Destination& dst, const plan_options& opt, Plan& out)
      : src_(src), dst_(dst), opt_(opt), plan(out), nd(static_cast<std::uint32_t>(dst.names.size())) {}

  void add(std::uint32_t ti) {
    const TensorInfo& t = plan.tensors[ti];
    auto ctx = [&] { return "tensor " + quote(t.name); };  // built only for errors
    if (!seen_.emplace(t.name, ti).second) throw_error(errors::duplicate_tensor, ctx(), "listed twice in the destination");
    const TensorInfo* s = src_.find(t.name);
    if (!s) throw_error(errors::missing_tensor, ctx(), "is not in the source checkpoint (" + src_.format + ")");
    if (s->shape != t.shape)
      throw_error(errors::tensor_shape_mismatch, ctx(),
                  "has shape " + to_string(s->shape) + " in the source but " + to_string(t.shape) + " in the destination");
    if (t.shape.size() > max_placement_rank)
      throw_error(errors::too_many_dims, ctx(), "rank " + std::to_string(t.shape.size()) + " exceeds " +
                                                  std::to_string(max_placement_rank));
    std::vector<std::pair<SrcPiece, SrcPiece>> replicas;  // (kept piece, its replica)
    std::uint64_t max_len = 0;
    const std::vector<SrcPiece> kept = sources(*s, t, replicas, max_len);
    const std::vector<DstPiece> dpieces = destinations(*s, t);
    tile(ti, *s, t, kept, max_len, dpieces);
    compare(ti, *s, t, replicas);
  }

 private:
  /// The source pieces of `s` (its chunks' mapped boxes), checked, without replicas (identical
  /// regions after the first in preference order, kept in `replicas` when they are checked),
  /// sorted by linear extent; `max_len` is the longest extent.
  std::vector<SrcPiece> sources(const TensorInfo& s_ref, const TensorInfo& t, std::vector<std::pair<SrcPiece, SrcPiece>>& replicas,
                                std::uint64_t& max_len) {
    const TensorInfo* s = &s_ref;
    const ShardedCheckpoint& src = src_;
    auto ctx = [&] { return "tensor " + quote(t.name); };
    std::vector<SrcPiece> pieces;
    for (std::uint32_t ci = 0; ci < s->chunks.size(); ++ci) {
      const Chunk& c = s->chunks[ci];
      auto what = [&] { return ctx() + " source chunk " + std::to_string(ci); };  // built only for errors
      if (c.at.source >= src.sources.size())
        throw_error(errors::bad_source_id, what(), "refers to byte source " + std::to_string(c.at.source) + " of " +
                                                       std::to_string(src.sources.size()));
      std::vector<MappedBox> boxes;
      std::uint64_t ext = 0;
      try {
        std::uint64_t elements = 0;
        boxes = mapped_boxes(c, t.shape, {}, &elements);
        ext = checked_mul(elements, itemsize(c.at.stored), "chunk bytes");
      } catch (error& e) {
        e.add_context(what());
        throw;
      }
      const std::uint64_t size = plan.source_sizes[c.at.source];
      if (c.at.byte_offset > size || ext > size - c.at.byte_offset)
        throw_error(errors::chunk_outside_source, what(),
                    "needs bytes [" + std::to_string(c.at.byte_offset) + ", +" + std::to_string(ext) + ") of " +
                        quote(plan.source_names[c.at.source]) + ", which has " + std::to_string(size));
      for (auto& m : boxes) {
        SrcPiece p;
        p.lin = linear_extent(m.box, t.shape);
        p.m = std::move(m);
        p.chunk = ci;
        p.source = c.at.source;
        p.byte_offset = c.at.byte_offset;
        p.stored = c.at.stored;
        p.swap = c.at.order == byte_order::big;
        pieces.push_back(std::move(p));
      }
    }
    std::stable_sort(pieces.begin(), pieces.end(), [](const SrcPiece& a, const SrcPiece& b) {
      if (box_less(a.m.box, b.m.box)) return true;
      if (box_less(b.m.box, a.m.box)) return false;
      return std::tie(a.source, a.byte_offset, a.chunk) < std::tie(b.source, b.byte_offset, b.chunk);
    });
    std::vector<SrcPiece> kept;
    for (auto& p : pieces) {
      if (!kept.empty() && kept.back().m.box == p.m.box) {
        if (opt_.check_replicas) replicas.emplace_back(kept.back(), std::move(p));
        continue;
      }
      kept.push_back(std::move(p));
    }
    // Candidate lookup by linear extent; the cover's preference is (source, offset).
    std::sort(kept.begin(), kept.end(), [](const SrcPiece& a, const SrcPiece& b) {
      return std::tie(a.lin.begin, a.source, a.byte_offset, a.chunk) < std::tie(b.lin.begin, b.source, b.byte_offset, b.chunk);
    });
    for (const auto& p : kept) max_len = std::max(max_len, p.lin.size());
    return kept;
  }

  /// The destination pieces of `t` (its chunks' mapped boxes), checked: inside their destination,
  /// castable from the source dtype, covering the tensor when the plan requires it.
  std::vector<DstPiece> destinations(const TensorInfo& s_ref, const TensorInfo& t) {
    const TensorInfo* s = &s_ref;
    const Destination& dst = dst_;
    auto ctx = [&] { return "tensor " + quote(t.name); };
    const Box whole = full_box(t.shape);
    std::vector<DstPiece> dpieces;
    dtype last_checked_stored = dtype::F32;
    for (std::uint32_t ci = 0; ci < t.chunks.size(); ++ci) {
      const Chunk& c = t.chunks[ci];
      auto what = [&] { return ctx() + " destination chunk " + std::to_string(ci); };
      if (c.at.source >= nd)
        throw_error(errors::bad_source_id, what(), "refers to destination " + std::to_string(c.at.source) + " of " +
                                                       std::to_string(nd));
      if (c.at.order != byte_order::little)
        throw_error(errors::destination_byte_order, what(), "is big-endian; statedict writes little-endian elements only");
      std::vector<MappedBox> boxes;
      std::uint64_t ext = 0, end = 0;
      try {
        std::uint64_t elements = 0;
        boxes = mapped_boxes(c, t.shape, {}, &elements);
        ext = checked_mul(elements, itemsize(c.at.stored), "chunk bytes");
        end = checked_add(c.at.byte_offset, ext, "chunk end");
      } catch (error& e) {
        e.add_context(what());
        throw;
      }
      if (ext > 0) {
        const std::uint64_t declared = c.at.source < dst.sizes.size() ? dst.sizes[c.at.source] : 0;
        if (declared != 0 && end > declared)
          throw_error(errors::destination_too_small, what(),
                      "needs bytes up to " + std::to_string(end) + " of " + quote(dst.names[c.at.source]) +
                          ", declared as " + std::to_string(declared) + " bytes");
        plan.destination_sizes[c.at.source] = std::max(plan.destination_sizes[c.at.source], end);
      }
      if (c.at.stored != last_checked_stored || ci == 0) {
        try {
          (void)cast_chain(s->dtype, s->dtype, t.dtype, c.at.stored);
        } catch (error& e) {
          e.add_context(ctx());
          throw;
        }
        last_checked_stored = c.at.stored;
      }
      for (auto& m : boxes) dpieces.push_back(DstPiece{std::move(m), ci});
    }
    if (opt_.require_full_destination) {
      std::vector<Box> dboxes;
      for (const auto& p : dpieces) dboxes.push_back(p.m.box);
      if (auto issue = cover(whole, dboxes, true))
        throw_error(errors::destination_uncovered, ctx(),
                    "element " + to_string(issue->index) + " is in no destination chunk");
    }
    return dpieces;
  }

  /// Tiles every destination piece with the source pieces it needs: the copy operations.
  void tile(std::uint32_t ti, const TensorInfo& s_ref, const TensorInfo& t, const std::vector<SrcPiece>& kept, std::uint64_t max_len,
            const std::vector<DstPiece>& dpieces) {
    const TensorInfo* s = &s_ref;
    const Destination& dst = dst_;
    const plan_options& opt = opt_;
    auto ctx = [&] { return "tensor " + quote(t.name); };
    std::vector<std::size_t> cand;
    std::vector<Box> cand_boxes;
    std::vector<CoverTile> tiles;
    std::vector<dtype> chain;
    std::pair<dtype, dtype> chain_key{dtype::F32, dtype::F32};
    bool have_chain = false;
    for (const auto& dp : dpieces) {
      const Chunk& dc = t.chunks[dp.chunk];
      const FlatRange dl = linear_extent(dp.m.box, t.shape);
      cand.clear();
      cand_boxes.clear();
      const std::uint64_t from = dl.begin > max_len ? dl.begin - max_len : 0;
      auto it = std::lower_bound(kept.begin(), kept.end(), from,
                                 [](const SrcPiece& p, std::uint64_t v) { return p.lin.begin < v; });
      for (; it != kept.end() && it->lin.begin < dl.end; ++it) {
        if (it->lin.end <= dl.begin) continue;
        if (!intersect(it->m.box, dp.m.box)) continue;
        cand.push_back(static_cast<std::size_t>(it - kept.begin()));
      }
      // Preference: lowest (source, byte offset) first.
      std::sort(cand.begin(), cand.end(), [&](std::size_t a, std::size_t b) {
        return std::tie(kept[a].source, kept[a].byte_offset, kept[a].chunk, kept[a].lin.begin) <
               std::tie(kept[b].source, kept[b].byte_offset, kept[b].chunk, kept[b].lin.begin);
      });
      for (std::size_t i : cand) cand_boxes.push_back(kept[i].m.box);
      tiles.clear();
      if (auto issue = cover(dp.m.box, cand_boxes, opt.allow_overlapping_sources, &tiles)) {
        if (issue->what == CoverIssue::kind::hole)
          throw_error(errors::uncovered, ctx(),
                      "element " + to_string(issue->index) + " is in no source chunk (needed by " +
                          quote(dst.names[dc.at.source]) + ")");
        const auto& a = kept[cand[issue->first]];
        const auto& b = kept[cand[issue->second]];
        throw_error(errors::source_overlap, ctx(),
                    "element " + to_string(issue->index) + " is in two source chunks that are not replicas: chunk " +
                        std::to_string(a.chunk) + " (" + where_in(plan.source_names, a.source, a.byte_offset) +
                        ") and chunk " + std::to_string(b.chunk) + " (" +
                        where_in(plan.source_names, b.source, b.byte_offset) + ")");
      }
      for (const CoverTile& tile : tiles) {
        const auto& sp = kept[cand[tile.which]];
        if (!have_chain || chain_key.first != sp.stored || chain_key.second != dc.at.stored) {
          chain = cast_chain(sp.stored, s->dtype, t.dtype, dc.at.stored);
          chain_key = {sp.stored, dc.at.stored};
          have_chain = true;
        }
        CopyOp base;
        base.tensor = ti;
        base.src = sp.source;
        base.dst = dc.at.source;
        base.src_dtype = sp.stored;
        base.dst_dtype = dc.at.stored;
        base.swap = sp.swap;
        base.nvia = static_cast<std::uint8_t>(chain.size() > 2 ? chain.size() - 2 : 0);
        if (base.nvia > 2) throw_error(errors::unsupported_cast, ctx(), "conversion chain too long");
        for (std::size_t k = 0; k < base.nvia; ++k) base.via[k] = chain[k + 1];
        const std::uint64_t ssz = itemsize(sp.stored), dsz = itemsize(dc.at.stored);
        for_each_storage_run(tile.box, sp.m, dp.m, [&](const StorageRuns& r) {
          if (++raw_ops > opt.max_ops)
            throw_error(errors::too_many_ops, ctx(),
                        "more than " + std::to_string(opt.max_ops) + " copy operations (plan_options::max_ops)");
          CopyOp o = base;
          o.src_offset = sp.byte_offset + r.a * ssz;
          o.dst_offset = dc.at.byte_offset + r.b * dsz;
          o.count = r.count;
          o.reps = r.reps;
          o.src_step = r.reps > 1 ? r.a_step * ssz : 0;
          o.dst_step = r.reps > 1 ? r.b_step * dsz : 0;
          plan.ops.push_back(o);
        });
      }
    }
  }

  /// Replica comparisons: each dropped replica against the kept piece with the same box.
  void compare(std::uint32_t ti, const TensorInfo& s_ref, const TensorInfo& t, const std::vector<std::pair<SrcPiece, SrcPiece>>& replicas) {
    const TensorInfo* s = &s_ref;
    const plan_options& opt = opt_;
    auto ctx = [&] { return "tensor " + quote(t.name); };
    for (const auto& pair : replicas) {
      const SrcPiece& kp = pair.first;
      const SrcPiece& rp = pair.second;
      (void)cast_chain(rp.stored, s->dtype, s->dtype, s->dtype);
      for_each_storage_run(kp.m.box, kp.m, rp.m, [&](const StorageRuns& r) {
        if (++raw_ops > opt.max_ops)
          throw_error(errors::too_many_ops, ctx(), "more than " + std::to_string(opt.max_ops) + " operations");
        CompareOp c;
        c.tensor = ti;
        c.a = kp.source;
        c.b = rp.source;
        c.a_dtype = kp.stored;
        c.b_dtype = rp.stored;
        c.a_swap = kp.swap;
        c.b_swap = rp.swap;
        c.logical = s->dtype;
        c.a_offset = kp.byte_offset + r.a * itemsize(kp.stored);
        c.b_offset = rp.byte_offset + r.b * itemsize(rp.stored);
        c.count = r.count;
        c.reps = r.reps;
        c.a_step = r.reps > 1 ? r.a_step * itemsize(kp.stored) : 0;
        c.b_step = r.reps > 1 ? r.b_step * itemsize(rp.stored) : 0;
        c.first_index = kp.m.box.offsets;
        plan.checks.push_back(std::move(c));
      });
    }
  }

  const ShardedCheckpoint& src_;
  const Destination& dst_;
  const plan_options& opt_;
  Plan& plan;
  std::uint32_t nd;
  std::unordered_map<std::string_view, std::size_t> seen_;
  std::uint64_t raw_ops = 0;
};

}  // namespace detail

/// Plans the copies that lay `src`'s tensors out as `dst` describes (see the top of this file).
/// Every tensor of `dst` must exist in `src` with the same shape (dtypes may differ: the values are
/// cast exactly). `src.sources` must hold a ByteSource for every source id used.
inline Plan make_plan(const ShardedCheckpoint& src, const Destination& dst, const plan_options& opt = {}) {
  Plan plan;
  for (const auto& s : src.sources) {
    if (!s) throw_error(errors::bad_source_id, "checkpoint", "a byte source is missing (null)");
    plan.source_names.push_back(s->name());
    plan.source_sizes.push_back(s->size());
  }
  plan.destination_names = dst.names;
  const auto nd = static_cast<std::uint32_t>(dst.names.size());
  plan.destination_sizes.assign(nd, 0);
  for (std::uint32_t d = 0; d < nd && d < dst.sizes.size(); ++d) plan.destination_sizes[d] = dst.sizes[d];
  plan.tensors = dst.tensors;
  detail::tensor_planner tp(src, dst, opt, plan);
  for (std::uint32_t ti = 0; ti < plan.tensors.size(); ++ti) tp.add(ti);
  detail::merge_ops(plan.ops);
  if (opt.verify) verify(plan);
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Parts: one plan, K processes

/// The part (0..count-1) that writes each destination: destinations are taken largest first (by
/// bytes written, then by index) and each goes to the part with the fewest bytes so far (then the
/// lowest part). Deterministic: it depends only on the plan.
inline std::vector<std::uint32_t> assign_parts(const Plan& plan, std::uint32_t count) {
  if (count == 0) throw_error(errors::bad_part, "part count must be at least 1");
  const std::size_t nd = plan.destination_names.size();
  std::vector<std::uint64_t> bytes(nd, 0);
  for (const auto& o : plan.ops) bytes[o.dst] += o.dst_bytes();
  std::vector<std::uint32_t> order(nd);
  std::iota(order.begin(), order.end(), 0U);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::uint64_t> load(count, 0);
  std::vector<std::uint32_t> part(nd, 0);
  for (std::uint32_t d : order) {
    const auto best = static_cast<std::uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    part[d] = best;
    load[best] += bytes[d];
  }
  return part;
}

/// The sub-plan of part `p`: only the operations (and replica checks) of the destinations that part
/// writes. Destination sizes and descriptions stay complete, so the final step can write an index.
inline Plan select_part(const Plan& plan, PartSpec p) {
  if (p.count == 0 || p.index >= p.count)
    throw_error(errors::bad_part, "part " + std::to_string(p.index) + "/" + std::to_string(p.count) + " does not exist");
  const auto part = assign_parts(plan, p.count);
  Plan out;
  out.tensors = plan.tensors;
  out.source_names = plan.source_names;
  out.source_sizes = plan.source_sizes;
  out.destination_names = plan.destination_names;
  out.destination_sizes = plan.destination_sizes;
  for (const auto& o : plan.ops)
    if (part[o.dst] == p.index) out.ops.push_back(o);
  // A replica check goes with the part that writes the first destination chunk of its tensor.
  for (const auto& c : plan.checks) {
    const auto& chunks = plan.tensors[c.tensor].chunks;
    const std::uint32_t d = chunks.empty() ? 0 : chunks.front().at.source;
    if (d < part.size() ? part[d] == p.index : p.index == 0) out.checks.push_back(c);
  }
  return out;
}

/// True when destination `d` is written by part `p`.
inline bool in_part(const Plan& plan, std::uint32_t d, PartSpec p) { return assign_parts(plan, p.count).at(d) == p.index; }

}  // namespace statedict::inline v0
