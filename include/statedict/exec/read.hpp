// statedict: random access to one tensor of any (sharded) checkpoint, without consolidating the rest.
// SPDX-License-Identifier: MIT
//
// `read_elements(ck, t, begin, end, as, out)` copies elements [begin, end) of tensor `t` (its
// row-major flat index) into a caller buffer, converted to `as`. Only the chunks that hold those
// elements are read, through the planner (coverage proven) and the executor (bounded memory), so
// the time is that of the bytes asked for plus the description that open() already built. The
// helpers read whole tensors, rows (dim-0 slices) or an owning Tensor.
#pragma once

#include "../core/config.hpp"
#include "../core/detail/defines_facade.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/tensor.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "executor.hpp"
#include "sink.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id read_range  {657, error_kind::usage, "exec.read_range"};
inline constexpr error_id read_buffer {658, error_kind::usage, "exec.read_buffer"};
// clang-format on
}  // namespace errors

/// Elements [begin, end) of tensor `t` of `ck` (row-major flat index), converted to `as` (any cast
/// core/cast.hpp has), into `out`, which must hold exactly (end - begin) * itemsize(as) bytes.
STATEDICT_API void read_elements(const ShardedCheckpoint& ck, const TensorInfo& t, std::uint64_t begin, std::uint64_t end, dtype as,
                          std::span<std::byte> out, const exec_options& opt = {}) {
  const std::uint64_t n = numel(t.shape);
  if (begin > end || end > n)
    throw_error(errors::read_range, "tensor " + quote(t.name),
                "elements [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + std::to_string(n));
  const std::uint64_t bytes = checked_mul(end - begin, itemsize(as), "read size");
  if (out.size() != bytes)
    throw_error(errors::read_buffer, "tensor " + quote(t.name),
                "a buffer of " + std::to_string(out.size()) + " bytes for " + std::to_string(bytes) + " bytes of elements");
  if (bytes == 0) return;
  Destination d;
  d.names.push_back(t.name);
  d.sizes.push_back(bytes);
  TensorInfo x{t.name, as, t.shape, {}};
  x.chunks.push_back(Chunk{FlatRange{begin, end}, Placement{0, 0, {}, as}});
  d.tensors.push_back(std::move(x));
  plan_options po;
  po.require_full_destination = false;
  const Plan plan = make_plan(ck, d, po);
  SpanSink sink(t.name, out);
  std::vector<Sink*> sinks{&sink};
  exec_options e = opt;
  e.progress = {};
  (void)execute(plan, ck, sinks, e);
}

/// The tensor named `name` (throws errors::missing_tensor when there is none).
STATEDICT_API const TensorInfo& tensor_named(const ShardedCheckpoint& ck, std::string_view name) {
  const TensorInfo* t = ck.find(name);
  if (!t) throw_error(errors::missing_tensor, "tensor " + quote(name), "is not in the checkpoint (" + ck.format + ")");
  return *t;
}

/// Rows [row_begin, row_end) of tensor `name` (a slice along dim 0; a 0-d tensor has one row) into
/// `out`, converted to `as` (default: the tensor's dtype).
STATEDICT_API void read_rows(const ShardedCheckpoint& ck, std::string_view name, std::uint64_t row_begin, std::uint64_t row_end,
                      std::span<std::byte> out, std::optional<dtype> as = std::nullopt, const exec_options& opt = {}) {
  const TensorInfo& t = tensor_named(ck, name);
  const std::uint64_t rows = t.shape.empty() ? 1 : static_cast<std::uint64_t>(t.shape[0]);
  if (row_begin > row_end || row_end > rows)
    throw_error(errors::read_range, "tensor " + quote(t.name),
                "rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) + ") of " + std::to_string(rows));
  const std::uint64_t per_row = rows == 0 ? 0 : numel(t.shape) / rows;
  read_elements(ck, t, row_begin * per_row, row_end * per_row, as.value_or(t.dtype), out, opt);
}

/// All of tensor `name`, as an owning contiguous Tensor (converted to `as` when given).
STATEDICT_API Tensor read_tensor(const ShardedCheckpoint& ck, std::string_view name, std::optional<dtype> as = std::nullopt,
                          const exec_options& opt = {}) {
  const TensorInfo& t = tensor_named(ck, name);
  Tensor x(as.value_or(t.dtype), t.shape);
  read_elements(ck, t, 0, numel(t.shape), x.dtype(), std::span<std::byte>(x.data(), static_cast<std::size_t>(x.nbytes())), opt);
  return x;
}

}  // namespace statedict::inline v0
