// statedict: layouts. The exact placement rules of the systems that shard checkpoints, each usable
// both to describe existing shards (a reader turns them into TensorInfo chunks) and to produce a
// sharding (a writer turns them into a Destination for the planner).
// SPDX-License-Identifier: MIT
//
// Every rule cites the function it reproduces; docs/planner.md lists them with worked examples.
// Arithmetic is unsigned 64-bit and checked where a product could overflow.
//
//   chunk along a dim   torch.chunk, torch/distributed/_shard/sharding_spec/_internals.py
//                       (get_split_size, get_chunked_dim_size), chunk_sharding_spec.py
//                       (ChunkShardingSpec.build_metadata), DTensor Shard(dim)
//                       (torch/distributed/tensor/placement_types.py _split_tensor,
//                       local_shard_size_and_offset)
//   balanced split      DeepSpeed get_data_parallel_partitions (stage_1_and_2.py) and AutoTP
//                       get_shard_size (module_inject/tp_shard.py, without kv-head grains)
//   FSDP flat params    torch/distributed/fsdp/_flat_param.py (_init_flat_param_and_metadata,
//                       flatten_tensors, _get_unpadded_shard, _get_shard, _get_shard_metadata);
//                       torch 1.13 flat_param.py (_shard_param_offsets, _shard_indices)
//   ZeRO stage 1/2      deepspeed/runtime/utils.py align_dense_tensors, stage_1_and_2.py
//                       (flatten_dense_tensors_aligned, get_data_parallel_partitions, groups_padding)
//   ZeRO stage 3        deepspeed/utils/zero_to_fp32.py zero3_partitioned_param_info and
//                       _zero3_merge_trainable_params
//   files               whole tensors packed into files; the Hugging Face split rule itself
//                       (split_state_dict_into_shards_factory) is io/hf_sharded.hpp plan_shards
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "box.hpp"
#include "checkpoint.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id bad_layout {602, error_kind::usage, "shard.bad_layout"};
// clang-format on
}  // namespace errors

namespace layout {

// =============================================================================================
// Splitting one dimension

/// A contiguous part [offset, offset + size) of one dimension (or of a flat index).
struct Span {
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  friend constexpr bool operator==(const Span&, const Span&) = default;
};

/// How a dimension of `n` indices splits into `parts`.
enum class split_rule : std::uint8_t {
  /// torch.chunk: parts of ceil(n / parts), the last ones smaller, trailing parts empty
  /// (ChunkShardingSpec, DTensor Shard(dim), FSDP flat shards). The default.
  chunk,
  /// n / parts each, the first n % parts one larger (DeepSpeed get_data_parallel_partitions,
  /// AutoTP get_shard_size, numpy.array_split).
  balanced,
  /// n must divide evenly, else errors::bad_layout (Megatron's ensure_divisibility).
  exact,
};

/// `get_split_size`: the chunk size torch.chunk uses, ceil(n / chunks).
constexpr std::uint64_t split_size(std::uint64_t n, std::uint64_t chunks) noexcept {
  return chunks == 0 ? 0 : n / chunks + (n % chunks != 0 ? 1 : 0);
}

/// `get_chunked_dim_size`: size of chunk `idx`, max(min(n, split * (idx + 1)) - split * idx, 0).
constexpr std::uint64_t chunked_dim_size(std::uint64_t n, std::uint64_t split, std::uint64_t idx) noexcept {
  // split * idx may exceed n; compare before multiplying so that nothing overflows.
  if (split == 0 || idx >= n / split + (n % split != 0 ? 1 : 0)) return 0;
  const std::uint64_t start = split * idx;
  return std::min(n - start, split);
}

/// Number of tensors torch.chunk(n, chunks) returns: ceil(n / split), or `chunks` when n == 0
/// (torch returns `chunks` empty tensors then).
constexpr std::uint64_t chunk_count(std::uint64_t n, std::uint64_t chunks) noexcept {
  if (chunks == 0) return 0;
  if (n == 0) return chunks;
  const std::uint64_t s = split_size(n, chunks);
  return n / s + (n % s != 0 ? 1 : 0);
}

/// Part `idx` of `n` split into `parts` by torch.chunk semantics. Parts past the last non-empty one
/// are empty and placed at offset n, as DTensor's Shard.local_shard_size_and_offset places them
/// (ChunkShardingSpec omits them; FSDP pads them fully).
constexpr Span chunk(std::uint64_t n, std::uint64_t parts, std::uint64_t idx) noexcept {
  const std::uint64_t s = split_size(n, parts);
  const std::uint64_t size = chunked_dim_size(n, s, idx);
  if (size == 0) return Span{n, 0};
  return Span{s * idx, size};
}

/// Part `idx` of `n` split into `parts` with the first n % parts parts one larger.
constexpr Span balanced(std::uint64_t n, std::uint64_t parts, std::uint64_t idx) noexcept {
  if (parts == 0) return Span{};
  const std::uint64_t base = n / parts, extra = n % parts;
  return Span{idx * base + std::min(idx, extra), base + (idx < extra ? 1 : 0)};
}

/// Part `idx` of `n` split into `parts` by `rule`.
inline Span split(std::uint64_t n, std::uint64_t parts, std::uint64_t idx, split_rule rule = split_rule::chunk) {
  if (parts == 0 || idx >= parts)
    throw_error(errors::bad_layout, "part " + std::to_string(idx) + " of " + std::to_string(parts) + " does not exist");
  switch (rule) {
    case split_rule::chunk: return chunk(n, parts, idx);
    case split_rule::balanced: return balanced(n, parts, idx);
    case split_rule::exact:
      if (n % parts != 0)
        throw_error(errors::bad_layout, "size " + std::to_string(n) + " is not divisible by " + std::to_string(parts) +
                                            " (exact split, as Megatron requires)");
      return Span{n / parts * idx, n / parts};
  }
  return Span{};
}

/// The box of part `idx` when `shape` is split along `dim` into `parts`.
inline Box split_box(std::span<const dim_t> shape, std::size_t dim, std::uint64_t parts, std::uint64_t idx,
                     split_rule rule = split_rule::chunk) {
  if (dim >= shape.size())
    throw_error(errors::bad_layout, "split dimension " + std::to_string(dim) + " of shape " + to_string(shape));
  check_shape(shape);
  Box b = full_box(shape);
  const Span s = split(static_cast<std::uint64_t>(shape[dim]), parts, idx, rule);
  b.offsets[dim] = static_cast<dim_t>(s.offset);
  b.sizes[dim] = static_cast<dim_t>(s.size);
  return b;
}

// =============================================================================================
// Flat layouts: parameters flattened into per-rank buffers

/// Where some elements of one parameter live in a rank's flat buffer: the parameter's flat
/// elements `range` are at element `offset` of rank `rank`'s buffer.
struct FlatPiece {
  std::uint32_t rank = 0;
  FlatRange range;
  std::uint64_t offset = 0;
  friend bool operator==(const FlatPiece&, const FlatPiece&) = default;
};

/// Chunks for the pieces of one parameter, given where each rank's buffer starts:
/// `base(rank)` returns the Placement of element 0 of that buffer (source, byte offset, stored
/// dtype); each chunk's byte offset is advanced by piece.offset elements.
template <class Base>
std::vector<Chunk> chunks_from(std::span<const FlatPiece> pieces, Base&& base) {
  std::vector<Chunk> out;
  out.reserve(pieces.size());
  for (const FlatPiece& p : pieces) {
    if (p.range.size() == 0) continue;
    Placement at = base(p.rank);
    at.byte_offset = checked_add(at.byte_offset, checked_mul(p.offset, itemsize(at.stored), "flat offset"), "flat offset");
    at.strides.clear();
    out.push_back(Chunk{p.range, std::move(at)});
  }
  return out;
}

namespace detail {
inline void check_world(std::uint64_t ws, std::string_view what) {
  if (ws == 0) throw_error(errors::bad_layout, std::string(what) + ": world size must be at least 1");
}
inline std::uint64_t sum_checked(std::span<const std::uint64_t> v) {
  std::uint64_t s = 0;
  for (std::uint64_t x : v) s = checked_add(s, x, "flat numel");
  if (s > max_size) throw_error(errors::overflow, "flat numel " + std::to_string(s) + " exceeds 2^63-1");
  return s;
}
inline std::uint64_t align_up(std::uint64_t n, std::uint64_t a) {
  if (a <= 1) return n;
  const std::uint64_t r = n % a;
  return r == 0 ? n : checked_add(n, a - r, "aligned size");
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// FSDP FlatParameter

/// `_get_aligned_numel`: elements per 16 bytes, the alignment FSDP uses with use_orig_params.
constexpr std::uint64_t fsdp_aligned_numel(dtype t) noexcept { return 16 / itemsize(t); }

/// An unsharded FlatParameter (`_init_flat_param_and_metadata`): the original parameters
/// flattened in order, with alignment padding before a parameter whose offset is not a multiple
/// of `aligned_numel`, and (only when aligning) padding at the end to a multiple of the world size.
struct FsdpFlatParam {
  std::vector<std::uint64_t> numels;               ///< `_numels`: one per original parameter
  std::vector<std::uint64_t> numels_with_padding;  ///< `_numels_with_padding`
  std::vector<bool> is_padding;                    ///< `_is_padding_mask`
  std::vector<std::uint64_t> offsets;              ///< start of each original parameter in the flat param
  std::uint64_t numel = 0;                         ///< flat param numel, padding included
};

/// Lays out a FlatParameter. `aligned_numel` is 0 without address alignment (use_orig_params=False,
/// and torch <= 2.0), else fsdp_aligned_numel(dtype).
inline FsdpFlatParam fsdp_flat_param(std::span<const std::uint64_t> numels, std::uint64_t world_size,
                                     std::uint64_t aligned_numel = 0) {
  detail::check_world(world_size, "FSDP flat parameter");
  (void)detail::sum_checked(numels);
  FsdpFlatParam f;
  f.numels.assign(numels.begin(), numels.end());
  std::uint64_t total = 0;
  for (std::uint64_t n : numels) {
    if (aligned_numel > 0) {
      const std::uint64_t pad = aligned_numel - total % aligned_numel;
      if (pad > 0 && pad < aligned_numel) {
        f.numels_with_padding.push_back(pad);
        f.is_padding.push_back(true);
        total = checked_add(total, pad, "flat numel");
      }
    }
    f.offsets.push_back(total);
    f.numels_with_padding.push_back(n);
    f.is_padding.push_back(false);
    total = checked_add(total, n, "flat numel");
  }
  if (aligned_numel > 0) {
    const std::uint64_t pad = world_size - total % world_size;
    if (pad > 0 && pad < world_size) {
      f.numels_with_padding.push_back(pad);
      f.is_padding.push_back(true);
      total = checked_add(total, pad, "flat numel");
    }
  }
  if (total > max_size) throw_error(errors::overflow, "flat numel " + std::to_string(total) + " exceeds 2^63-1");
  f.numel = total;
  return f;
}

/// One rank's shard of a flat parameter (`_get_unpadded_shard` and `_get_shard`): torch.chunk of
/// the flat parameter into world_size parts, right-padded to the first chunk's size.
struct FsdpShard {
  std::uint64_t numel = 0;         ///< sharded flat param numel, padding included (the same on every rank)
  std::uint64_t numel_padded = 0;  ///< `_shard_numel_padded`: zeros at the end of this rank's shard
  std::uint64_t start = 0;         ///< first unsharded index this rank covers: numel * rank
};

inline FsdpShard fsdp_shard(std::uint64_t flat_numel, std::uint64_t rank, std::uint64_t world_size) {
  detail::check_world(world_size, "FSDP shard");
  const std::uint64_t s = split_size(flat_numel, world_size);  // chunks[0].numel()
  const std::uint64_t mine = rank < chunk_count(flat_numel, world_size) ? chunk(flat_numel, world_size, rank).size : 0;
  return FsdpShard{s, s - mine, checked_mul(s, rank, "FSDP shard start")};
}

/// `_ShardParamInfo` (torch >= 2.1): where an original parameter is in one rank's shard.
/// `intra_param_end_idx` is inclusive. All fields are meaningful only when `in_shard`.
struct ShardParamInfo {
  bool in_shard = false;
  std::int64_t offset_in_shard = 0;
  std::int64_t numel_in_shard = 0;
  std::int64_t intra_param_start_idx = 0;
  std::int64_t intra_param_end_idx = 0;
  friend bool operator==(const ShardParamInfo&, const ShardParamInfo&) = default;
};

/// `_get_shard_metadata(unsharded_start_idx, unsharded_end_idx)` for rank `rank` (torch >= 2.1):
/// one entry per original parameter (padding entries skipped). A parameter of numel 0 strictly
/// inside the shard is `in_shard` with numel_in_shard 0, as in the original.
inline std::vector<ShardParamInfo> fsdp_shard_param_infos(const FsdpFlatParam& f, std::uint64_t rank,
                                                          std::uint64_t world_size) {
  const FsdpShard sh = fsdp_shard(f.numel, rank, world_size);
  const auto start = static_cast<std::int64_t>(sh.start);
  const std::int64_t end = start + static_cast<std::int64_t>(sh.numel) - 1;  // inclusive
  std::vector<ShardParamInfo> out;
  std::int64_t pos = 0;
  for (std::size_t i = 0; i < f.numels_with_padding.size(); ++i) {
    const std::int64_t p_start = pos, p_end = pos + static_cast<std::int64_t>(f.numels_with_padding[i]) - 1;
    pos += static_cast<std::int64_t>(f.numels_with_padding[i]);
    if (f.is_padding[i]) continue;
    ShardParamInfo info;
    if (start <= p_end && end >= p_start) {
      info.in_shard = true;
      if (start <= p_start) {
        info.intra_param_start_idx = 0;
        info.offset_in_shard = p_start - start;
      } else {
        info.intra_param_start_idx = start - p_start;
        info.offset_in_shard = 0;
      }
      info.intra_param_end_idx = std::min(p_end, end) - p_start;
      info.numel_in_shard = info.intra_param_end_idx - info.intra_param_start_idx + 1;
    }
    out.push_back(info);
  }
  return out;
}

/// The torch 1.13 / 2.0 form (flat_param.py `_get_shard_metadata`): for the parameters that
/// intersect the shard, inclusive [start, end] offsets inside each (`_shard_param_offsets`), and the
/// inclusive range of their indices (`_shard_indices`, (0, 0) when none). No alignment padding.
struct LegacyShardMetadata {
  std::vector<std::pair<std::int64_t, std::int64_t>> param_offsets;
  std::pair<std::int64_t, std::int64_t> indices{0, 0};
  friend bool operator==(const LegacyShardMetadata&, const LegacyShardMetadata&) = default;
};

inline LegacyShardMetadata fsdp_legacy_shard_metadata(std::span<const std::uint64_t> numels, std::uint64_t rank,
                                                      std::uint64_t world_size) {
  const std::uint64_t total = detail::sum_checked(numels);
  const FsdpShard sh = fsdp_shard(total, rank, world_size);
  const auto start = static_cast<std::int64_t>(sh.start);
  const std::int64_t end = start + static_cast<std::int64_t>(sh.numel) - 1;
  LegacyShardMetadata m;
  std::int64_t pos = 0;
  bool any = false;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::int64_t p_start = pos, p_end = pos + static_cast<std::int64_t>(numels[i]) - 1;
    pos += static_cast<std::int64_t>(numels[i]);
    if (start > p_end || end < p_start) continue;
    const std::int64_t intra_start = start <= p_start ? 0 : start - p_start;
    m.param_offsets.emplace_back(intra_start, std::min(p_end, end) - p_start);
    if (!any) m.indices.first = static_cast<std::int64_t>(i);
    m.indices.second = static_cast<std::int64_t>(i);
    any = true;
  }
  return m;
}

/// For each original parameter, where its elements are: rank r's shard holds
/// param.flatten()[intra_start : intra_end + 1] at shard element offset_in_shard. The shard is the
/// rank's buffer (fsdp_shard().numel elements, numel_padded of them padding at the end).
inline std::vector<std::vector<FlatPiece>> fsdp_pieces(const FsdpFlatParam& f, std::uint64_t world_size) {
  std::vector<std::vector<FlatPiece>> out(f.numels.size());
  for (std::uint64_t r = 0; r < world_size; ++r) {
    const auto infos = fsdp_shard_param_infos(f, r, world_size);
    for (std::size_t i = 0; i < infos.size(); ++i) {
      const ShardParamInfo& s = infos[i];
      if (!s.in_shard || s.numel_in_shard <= 0) continue;
      out[i].push_back(FlatPiece{static_cast<std::uint32_t>(r),
                                 FlatRange{static_cast<std::uint64_t>(s.intra_param_start_idx),
                                           static_cast<std::uint64_t>(s.intra_param_end_idx) + 1},
                                 static_cast<std::uint64_t>(s.offset_in_shard)});
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DeepSpeed ZeRO stage 1 and 2

/// A param group's flat buffer and its data-parallel partitions: the group is flattened and padded
/// at the end to a multiple of `alignment_factor * dp` (align_dense_tensors with
/// nccl_start_alignment_factor = 2), then cut into dp contiguous partitions, the first
/// `padded % dp` one element larger (get_data_parallel_partitions; after the padding the division
/// is exact, so all partitions have padded / dp elements).
struct Zero12Partitions {
  std::uint64_t numel = 0;         ///< the group's real elements
  std::uint64_t padded_numel = 0;  ///< after align_dense_tensors
  std::vector<Span> parts;         ///< one per rank, in the padded flat index
};

inline Zero12Partitions zero12_partitions(std::uint64_t group_numel, std::uint64_t dp,
                                          std::uint64_t alignment_factor = 2) {
  detail::check_world(dp, "ZeRO partitions");
  if (alignment_factor == 0) throw_error(errors::bad_layout, "ZeRO alignment factor must be at least 1");
  Zero12Partitions z;
  z.numel = group_numel;
  z.padded_numel = detail::align_up(group_numel, checked_mul(alignment_factor, dp, "ZeRO alignment"));
  for (std::uint64_t r = 0; r < dp; ++r) z.parts.push_back(balanced(z.padded_numel, dp, r));
  return z;
}

/// `groups_padding[rank]` (stage_1_and_2.py, current DeepSpeed): how many trailing elements of this
/// rank's partition are padding; the saved fp32 partition keeps the first size - padding.
/// (DeepSpeed before the per-rank rule recorded all the padding on the last rank only.)
inline std::uint64_t zero12_group_padding(const Zero12Partitions& z, std::uint64_t rank) {
  const Span p = z.parts.at(static_cast<std::size_t>(rank));
  if (z.numel <= p.offset) return p.size;
  if (z.numel < p.offset + p.size) return p.offset + p.size - z.numel;
  return 0;
}

/// For each parameter of a group (numels in flat order: round_robin_bit16_groups order, which is
/// the order of param_shapes), the pieces each rank's partition holds. Rank buffers are the
/// partitions (element 0 = the partition's first element).
inline std::vector<std::vector<FlatPiece>> zero12_pieces(std::span<const std::uint64_t> numels, std::uint64_t dp,
                                                         std::uint64_t alignment_factor = 2) {
  const Zero12Partitions z = zero12_partitions(detail::sum_checked(numels), dp, alignment_factor);
  std::vector<std::vector<FlatPiece>> out(numels.size());
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::uint64_t p0 = pos, p1 = pos + numels[i];
    pos = p1;
    for (std::size_t r = 0; r < z.parts.size(); ++r) {
      const std::uint64_t s0 = z.parts[r].offset, s1 = s0 + z.parts[r].size;
      const std::uint64_t lo = std::max(p0, s0), hi = std::min(p1, s1);
      if (hi <= lo) continue;
      out[i].push_back(FlatPiece{static_cast<std::uint32_t>(r), FlatRange{lo - p0, hi - p0}, lo - s0});
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DeepSpeed ZeRO stage 3

/// `zero3_partitioned_param_info`: every parameter is padded to a multiple of the world size and
/// rank r holds slice r of ceil(numel / ws) elements.
struct Zero3ParamInfo {
  std::uint64_t partitioned_numel = 0;
  std::uint64_t padding_numel = 0;
  friend constexpr bool operator==(const Zero3ParamInfo&, const Zero3ParamInfo&) = default;
};

constexpr Zero3ParamInfo zero3_partitioned_param_info(std::uint64_t numel, std::uint64_t world_size) noexcept {
  if (world_size == 0) return {};
  const std::uint64_t rem = numel % world_size;
  return Zero3ParamInfo{split_size(numel, world_size), rem ? world_size - rem : 0};
}

/// For each parameter (in param_shapes order; all groups of a rank concatenated, as zero_to_fp32
/// does), the pieces: rank r's buffer holds elements [r * pn, min((r + 1) * pn, numel)) of the
/// parameter at offset sum of the previous parameters' pn.
inline std::vector<std::vector<FlatPiece>> zero3_pieces(std::span<const std::uint64_t> numels, std::uint64_t world_size) {
  detail::check_world(world_size, "ZeRO-3 partitions");
  (void)detail::sum_checked(numels);
  std::vector<std::vector<FlatPiece>> out(numels.size());
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::uint64_t pn = zero3_partitioned_param_info(numels[i], world_size).partitioned_numel;
    for (std::uint64_t r = 0; r < world_size && pn > 0; ++r) {
      const std::uint64_t lo = r * pn;  // < numels[i] + ws, cannot overflow
      if (lo >= numels[i]) break;
      const std::uint64_t hi = std::min(numels[i], lo + pn);
      out[i].push_back(FlatPiece{static_cast<std::uint32_t>(r), FlatRange{lo, hi}, off});
    }
    off = checked_add(off, pn, "ZeRO-3 partition offset");
  }
  return out;
}

// =============================================================================================
// Destinations: a whole sharding, ready for the planner (writers) or as a source description
// (readers, tests). Each destination is one byte buffer (a rank, a file); chunks are packed in
// order, each chunk start aligned to `alignment` bytes.

namespace detail {
inline std::uint64_t itemsize_of(const TensorInfo& t, std::optional<dtype> stored) {
  return itemsize(stored.value_or(t.dtype));
}
inline void check_tensors(std::span<const TensorInfo> tensors) {
  for (const auto& t : tensors) (void)byte_size(t.shape, itemsize(t.dtype));
}
inline Chunk contiguous_chunk(ChunkRegion region, std::uint32_t dest, std::uint64_t offset, dtype stored) {
  return Chunk{std::move(region), Placement{dest, offset, {}, stored}};
}
}  // namespace detail

/// Copies the tensors' names, dtypes and shapes (chunks left empty).
inline std::vector<TensorInfo> specs_of(std::span<const TensorInfo> tensors) {
  std::vector<TensorInfo> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(TensorInfo{t.name, t.dtype, t.shape, {}});
  return out;
}

/// Everything in one buffer, each tensor whole and row-major, in order.
inline Destination single(std::span<const TensorInfo> tensors, std::string name = "consolidated",
                          std::uint64_t alignment = 1, std::optional<dtype> stored = std::nullopt) {
  detail::check_tensors(tensors);
  Destination d;
  d.names = {std::move(name)};
  d.tensors = specs_of(tensors);
  std::uint64_t off = 0;
  for (auto& t : d.tensors) {
    off = detail::align_up(off, alignment);
    const dtype st = stored.value_or(t.dtype);
    t.chunks.push_back(detail::contiguous_chunk(full_box(t.shape), 0, off, st));
    off = checked_add(off, byte_size(t.shape, itemsize(st)), "destination size");
  }
  d.sizes = {off};
  return d;
}

/// Each tensor split along its dimension dims[i] into `world` parts by `rule` (chunk along a dim,
/// DTensor Shard(dim), tensor parallelism); dims[i] < 0 replicates the tensor on every rank. Rank r's
/// buffer holds its part of each tensor in order. Empty parts get no chunk.
inline Destination chunked(std::span<const TensorInfo> tensors, std::span<const int> dims, std::uint32_t world,
                           split_rule rule = split_rule::chunk, std::uint64_t alignment = 1,
                           std::optional<dtype> stored = std::nullopt) {
  detail::check_world(world, "chunked layout");
  detail::check_tensors(tensors);
  if (dims.size() != tensors.size())
    throw_error(errors::bad_layout, "chunked layout: " + std::to_string(dims.size()) + " dims for " +
                                        std::to_string(tensors.size()) + " tensors");
  Destination d;
  for (std::uint32_t r = 0; r < world; ++r) d.names.push_back("rank" + std::to_string(r));
  d.tensors = specs_of(tensors);
  std::vector<std::uint64_t> off(world, 0);
  for (std::size_t i = 0; i < d.tensors.size(); ++i) {
    auto& t = d.tensors[i];
    const dtype st = stored.value_or(t.dtype);
    for (std::uint32_t r = 0; r < world; ++r) {
      Box b = dims[i] < 0 ? full_box(t.shape) : split_box(t.shape, static_cast<std::size_t>(dims[i]), world, r, rule);
      if (is_empty(b)) continue;
      off[r] = detail::align_up(off[r], alignment);
      const std::uint64_t bytes = byte_size(b.sizes, itemsize(st));
      t.chunks.push_back(detail::contiguous_chunk(std::move(b), r, off[r], st));
      off[r] = checked_add(off[r], bytes, "destination size");
    }
  }
  d.sizes = off;
  return d;
}

namespace detail {
// Common builder of flat layouts: groups of tensor indices; per group, pieces per tensor and the
// per-rank element count of the group's slot in each rank buffer.
template <class Pieces>
Destination flat_layout(std::span<const TensorInfo> tensors, std::span<const std::vector<std::size_t>> groups,
                        std::uint32_t world, std::optional<dtype> stored, std::string_view what, Pieces&& pieces_of) {
  check_world(world, what);
  check_tensors(tensors);
  Destination d;
  for (std::uint32_t r = 0; r < world; ++r) d.names.push_back("rank" + std::to_string(r));
  d.tensors = specs_of(tensors);
  std::vector<bool> seen(tensors.size(), false);
  std::vector<std::uint64_t> off(world, 0);  // bytes
  for (const auto& g : groups) {
    if (g.empty()) continue;
    const dtype st = stored.value_or(tensors[g[0]].dtype);
    std::vector<std::uint64_t> numels;
    for (std::size_t i : g) {
      if (i >= tensors.size() || seen[i])
        throw_error(errors::bad_layout, std::string(what) + ": tensor index " + std::to_string(i) + " is out of range or in two groups");
      seen[i] = true;
      if (stored.value_or(tensors[i].dtype) != st)
        throw_error(errors::bad_layout, std::string(what) + ": group mixes dtypes (" + quote(tensors[i].name) + ")");
      numels.push_back(numel(tensors[i].shape));
    }
    std::vector<std::uint64_t> slot(world, 0);  // elements of this group in each rank buffer
    const auto pieces = pieces_of(std::span<const std::uint64_t>(numels), st, slot);
    for (std::size_t k = 0; k < g.size(); ++k) {
      auto& t = d.tensors[g[k]];
      auto chunks = chunks_from(std::span<const FlatPiece>(pieces[k]), [&](std::uint32_t r) {
        return Placement{r, off[r], {}, st};
      });
      for (auto& c : chunks) t.chunks.push_back(std::move(c));
    }
    for (std::uint32_t r = 0; r < world; ++r)
      off[r] = checked_add(off[r], checked_mul(slot[r], itemsize(st), "destination size"), "destination size");
  }
  d.sizes = off;
  return d;
}
}  // namespace detail

/// FSDP: each group is one FlatParameter; rank r's buffer holds its shard of each flat parameter in
/// order (fsdp_shard().numel elements, the padding at the end included). `aligned` turns on the
/// use_orig_params alignment padding.
inline Destination fsdp(std::span<const TensorInfo> tensors, std::span<const std::vector<std::size_t>> groups,
                        std::uint32_t world, bool aligned = false, std::optional<dtype> stored = std::nullopt) {
  return detail::flat_layout(tensors, groups, world, stored, "FSDP layout",
                             [&](std::span<const std::uint64_t> numels, dtype st, std::vector<std::uint64_t>& slot) {
                               const auto f = fsdp_flat_param(numels, world, aligned ? fsdp_aligned_numel(st) : 0);
                               std::fill(slot.begin(), slot.end(), fsdp_shard(f.numel, 0, world).numel);
                               return fsdp_pieces(f, world);
                             });
}

/// ZeRO stage 1/2: each group flattened and padded to a multiple of alignment_factor * dp; rank r's
/// buffer holds its partition of each group in order (padding included).
inline Destination zero12(std::span<const TensorInfo> tensors, std::span<const std::vector<std::size_t>> groups,
                          std::uint32_t dp, std::uint64_t alignment_factor = 2, std::optional<dtype> stored = std::nullopt) {
  return detail::flat_layout(tensors, groups, dp, stored, "ZeRO-1/2 layout",
                             [&](std::span<const std::uint64_t> numels, dtype, std::vector<std::uint64_t>& slot) {
                               const auto z = zero12_partitions(detail::sum_checked(numels), dp, alignment_factor);
                               for (std::size_t r = 0; r < slot.size(); ++r) slot[r] = z.parts[r].size;
                               return zero12_pieces(numels, dp, alignment_factor);
                             });
}

/// ZeRO stage 3: every parameter padded to a multiple of the world size; rank r's buffer holds slice
/// r of each parameter, in order.
inline Destination zero3(std::span<const TensorInfo> tensors, std::span<const std::vector<std::size_t>> groups,
                         std::uint32_t world, std::optional<dtype> stored = std::nullopt) {
  return detail::flat_layout(tensors, groups, world, stored, "ZeRO-3 layout",
                             [&](std::span<const std::uint64_t> numels, dtype, std::vector<std::uint64_t>& slot) {
                               std::uint64_t total = 0;
                               for (std::uint64_t n : numels)
                                 total = checked_add(total, zero3_partitioned_param_info(n, world).partitioned_numel, "ZeRO-3 size");
                               std::fill(slot.begin(), slot.end(), total);
                               return zero3_pieces(numels, world);
                             });
}

/// Whole tensors packed into files: `files[f]` lists the indices of the tensors of file f, in
/// order (for Hugging Face shards, the split of io/hf_sharded.hpp `plan_shards`, which follows
/// huggingface_hub's split_state_dict_into_shards_factory). Every tensor must be in one file.
inline Destination packed(std::span<const TensorInfo> tensors, std::span<const std::vector<std::size_t>> files,
                          std::vector<std::string> names, std::uint64_t alignment = 1,
                          std::optional<dtype> stored = std::nullopt) {
  detail::check_tensors(tensors);
  if (names.size() != files.size())
    throw_error(errors::bad_layout, "packed layout: " + std::to_string(names.size()) + " names for " +
                                        std::to_string(files.size()) + " files");
  Destination d;
  d.tensors = specs_of(tensors);
  d.names = std::move(names);
  d.sizes.assign(files.size(), 0);
  std::vector<bool> placed(tensors.size(), false);
  for (std::size_t f = 0; f < files.size(); ++f)
    for (std::size_t i : files[f]) {
      if (i >= tensors.size() || placed[i])
        throw_error(errors::bad_layout, "packed layout: tensor index " + std::to_string(i) + " is out of range or in two files");
      placed[i] = true;
      auto& t = d.tensors[i];
      const dtype st = stored.value_or(t.dtype);
      d.sizes[f] = detail::align_up(d.sizes[f], alignment);
      t.chunks.push_back(detail::contiguous_chunk(full_box(t.shape), static_cast<std::uint32_t>(f), d.sizes[f], st));
      d.sizes[f] = checked_add(d.sizes[f], byte_size(t.shape, itemsize(st)), "file size");
    }
  for (std::size_t i = 0; i < placed.size(); ++i)
    if (!placed[i]) throw_error(errors::bad_layout, "packed layout: tensor " + quote(tensors[i].name) + " is in no file");
  return d;
}

/// Views a written destination as a checkpoint to read from: the same tensors and chunks, with
/// `sources[i]` holding destination i's bytes.
inline ShardedCheckpoint as_checkpoint(const Destination& d, std::vector<std::shared_ptr<const ByteSource>> sources,
                                       std::string format = "layout") {
  ShardedCheckpoint c;
  c.format = std::move(format);
  c.sources = std::move(sources);
  c.tensors = d.tensors;
  return c;
}

}  // namespace layout
}  // namespace statedict::inline v0
