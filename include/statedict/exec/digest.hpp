// statedict: digests of tensors of any (sharded) checkpoint, streamed through the executor.
// SPDX-License-Identifier: MIT
//
// `sha256_tensors(ckpt)` is what `inspect --hash` prints: for each tensor the SHA-256 of its
// elements in row-major order, little-endian, in its logical dtype, no padding, whatever the
// sharding (every chunk is read once, in place, with the executor's bounded memory). The same
// digest core/sha256.hpp `sha256_hex(view)` gives for a consolidated tensor.
#pragma once

#include "../core/config.hpp"
#include "../core/detail/defines_facade.hpp"

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/plan.hpp"
#include "executor.hpp"
#include "sink.hpp"

namespace statedict::inline v0 {

/// (name, 64 hex digits) for each tensor of `ckpt` named in `names` (every tensor, in checkpoint
/// order, when `names` is empty).
STATEDICT_API std::vector<std::pair<std::string, std::string>> sha256_tensors(const ShardedCheckpoint& ckpt,
                                                                       const exec_options& opt = {},
                                                                       std::span<const std::string> names = {},
                                                                       const plan_options& popt = {}) {
  Destination d;
  auto add = [&](const TensorInfo& t) {
    const auto i = static_cast<std::uint32_t>(d.names.size());
    d.names.push_back(t.name);
    d.sizes.push_back(byte_size(t.shape, itemsize(t.dtype)));
    TensorInfo x{t.name, t.dtype, t.shape, {}};
    x.chunks.push_back(Chunk{full_box(t.shape), Placement{i, 0, {}, t.dtype}});
    d.tensors.push_back(std::move(x));
  };
  if (names.empty()) {
    for (const auto& t : ckpt.tensors) add(t);
  } else {
    for (const auto& n : names) {
      const TensorInfo* t = ckpt.find(n);
      if (!t) throw_error(errors::missing_tensor, "tensor " + quote(n), "is not in the checkpoint");
      add(*t);
    }
  }
  const Plan plan = make_plan(ckpt, d, popt);
  std::vector<std::unique_ptr<Sha256Sink>> sinks;
  std::vector<Sink*> ptrs;
  for (const auto& n : d.names) {
    sinks.push_back(std::make_unique<Sha256Sink>(n));
    ptrs.push_back(sinks.back().get());
  }
  (void)execute(plan, ckpt, ptrs, opt);
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(sinks.size());
  for (std::size_t i = 0; i < sinks.size(); ++i) out.emplace_back(d.names[i], sinks[i]->hex());
  return out;
}

}  // namespace statedict::inline v0
