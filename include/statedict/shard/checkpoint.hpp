// statedict: ShardedCheckpoint, the one description every reader produces and every writer consumes.
// SPDX-License-Identifier: MIT
//
// A checkpoint is a list of logical tensors (name, dtype, global shape). Each tensor's elements are
// held by chunks: an n-d box of its index space, or a range of its row-major flattened index, plus
// where those elements are stored (which byte source, at which byte offset, with which element
// strides, in which stored dtype). Padding is simply not covered by any chunk. Elements held by
// several chunks (a bias replicated on every rank) are listed once per copy.
//
// The same structure describes a destination layout (where each element must go), which is what
// the planner (shard/plan.hpp) intersects with a source description.
//
// No file knowledge here: sources are ByteSource objects (core/source.hpp) made by io/ and formats/.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/skeleton.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"

namespace statedict::inline v0 {

/// An n-d box of a tensor's index space: `offsets[d] <= i[d] < offsets[d] + sizes[d]`.
struct Box {
  shape_t offsets;
  shape_t sizes;
  friend bool operator==(const Box&, const Box&) = default;
};

/// A range `[begin, end)` of a tensor's row-major flattened index.
struct FlatRange {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  [[nodiscard]] std::uint64_t size() const noexcept { return end - begin; }
  friend bool operator==(const FlatRange&, const FlatRange&) = default;
};

/// The order of the bytes of each stored element (of each component, for complex dtypes).
enum class byte_order : std::uint8_t {
  little,  ///< what every writer writes and every tensor in memory holds
  big,     ///< a torch.save file written on a big-endian machine (its `byteorder` record)
};

/// Where a chunk's elements are stored.
struct Placement {
  std::uint32_t source = 0;       ///< index into the description's sources (or destinations)
  std::uint64_t byte_offset = 0;  ///< byte offset of the chunk's first element in that source
  /// Element strides over the chunk's own shape (the box sizes, or {size} for a flat range);
  /// empty means row-major contiguous.
  shape_t strides;
  dtype stored = dtype::F32;      ///< element type as stored; the executor casts to the logical dtype
  /// Byte order of the stored elements; the executor swaps big-endian ones as it copies (sources
  /// only: destinations are always little-endian).
  byte_order order = byte_order::little;
  friend bool operator==(const Placement&, const Placement&) = default;
};

/// Some elements of a logical tensor and where they are.
struct Chunk {
  std::variant<Box, FlatRange> region;
  Placement at;
  friend bool operator==(const Chunk&, const Chunk&) = default;
};

/// One logical (global) tensor.
struct TensorInfo {
  std::string name;
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  std::vector<Chunk> chunks;
  /// The dtype the tensor had before its reader converted it (DeepSpeed's integer buffers, made
  /// F32 as zero_to_fp32 makes them); nullopt when the reader kept it.
  std::optional<statedict::dtype> converted_from = std::nullopt;
};

/// Where each element of each tensor must go: the destination side of a plan (shard/plan.hpp).
/// The same TensorInfo/Chunk structure as a ShardedCheckpoint, with Placement::source indexing
/// `names` (output files, ranks, buffers) and Placement::stored the dtype to write. Layouts
/// (shard/layout.hpp) and writers produce it. Bytes that no chunk covers (padding) are left as the
/// sink has them (zero in a fresh file or buffer).
struct Destination {
  std::vector<TensorInfo> tensors;
  /// One name per destination, for messages (a file name, "rank3").
  std::vector<std::string> names;
  /// Byte size of each destination, padding included; empty or 0 means "as far as chunks reach".
  std::vector<std::uint64_t> sizes;
};

/// A whole checkpoint: its tensors, the byte sources they live in, and everything that is not a
/// tensor (the flatten skeleton, see core/flatten.hpp).
struct ShardedCheckpoint {
  /// Detected format ("safetensors", "torch", "hf_sharded", "dcp", "deepspeed_zero3", ...).
  std::string format;
  /// Byte sources that Placement::source indexes.
  std::vector<std::shared_ptr<const ByteSource>> sources;
  /// Logical tensors in checkpoint order; names are unique.
  std::vector<TensorInfo> tensors;
  /// The flatten skeleton (structure, key types, non-tensor values, aliases). Null means a flat
  /// dict of `tensors`, in order. A reader that flattens a tree keeps flatten's compact form, so
  /// describing a checkpoint builds no JSON document unless something asks for one.
  Skeleton skeleton;
  /// Free-form string metadata of the input (safetensors `__metadata__`, format versions, ...).
  std::map<std::string, std::string> metadata;

  /// The tensor named `name`, or nullptr. The name index is rebuilt when tensors are added or
  /// removed; call reindex() after renaming tensors in place.
  [[nodiscard]] const TensorInfo* find(std::string_view name) const {
    if (index_.size() != tensors.size()) reindex();
    auto it = index_.find(name);
    if (it == index_.end()) return nullptr;
    if (tensors[it->second].name != name) {  // renamed in place without reindex(): recover
      reindex();
      it = index_.find(name);
      if (it == index_.end()) return nullptr;
    }
    return &tensors[it->second];
  }
  void reindex() const {
    index_.clear();
    for (std::size_t i = 0; i < tensors.size(); ++i) index_.emplace(tensors[i].name, i);
  }

 private:
  struct name_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  // Looked up by string_view (no key copy per lookup).
  mutable std::unordered_map<std::string, std::size_t, name_hash, std::equal_to<>> index_;
};

}  // namespace statedict::inline v0
