// statedict: tensors in memory (views, with any strides) as a ShardedCheckpoint, so that writing a
// tree of tensors goes through the same planner and executor as writing any described checkpoint.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/tensor.hpp"
#include "checkpoint.hpp"

namespace statedict::inline v0 {

/// Appends `view` to `ck` as tensor `name`: one chunk, in a MemorySource over exactly the bytes the
/// view spans (kept alive by the view's owner), with the view's strides.
inline TensorInfo& add_view(ShardedCheckpoint& ck, std::string name, const TensorView& view) {
  const auto src = static_cast<std::uint32_t>(ck.sources.size());
  ck.sources.push_back(std::make_shared<MemorySource>(name, view.data(), view.extent_bytes(), view.owner()));
  TensorInfo& t = ck.tensors.emplace_back();
  t.name = std::move(name);
  t.dtype = view.dtype();
  t.shape = view.shape();
  Chunk& c = t.chunks.emplace_back();
  c.region = Box{shape_t(view.rank(), 0), view.shape()};
  c.at.source = src;
  c.at.byte_offset = 0;
  if (!view.is_contiguous()) c.at.strides = view.strides();
  c.at.stored = view.dtype();
  return t;
}

/// Appends tensor `name` stored contiguously, row-major, at `offset` of `source`.
inline TensorInfo& add_stored(ShardedCheckpoint& ck, std::string name, dtype stored, shape_t shape, std::shared_ptr<const ByteSource> source,
                              std::uint64_t offset) {
  const auto src = static_cast<std::uint32_t>(ck.sources.size());
  ck.sources.push_back(std::move(source));
  TensorInfo& t = ck.tensors.emplace_back();
  t.name = std::move(name);
  t.dtype = stored;
  t.shape = std::move(shape);
  Chunk& c = t.chunks.emplace_back();
  c.region = Box{shape_t(t.shape.size(), 0), t.shape};
  c.at.source = src;
  c.at.byte_offset = offset;
  c.at.stored = stored;
  return t;
}

/// A flat checkpoint of named views (null skeleton, format "memory").
inline ShardedCheckpoint describe_views(const NamedTensors& tensors) {
  ShardedCheckpoint ck;
  ck.format = "memory";
  ck.sources.reserve(tensors.size());
  ck.tensors.reserve(tensors.size());
  for (const auto& [n, v] : tensors) add_view(ck, n, v);
  return ck;
}

}  // namespace statedict::inline v0
