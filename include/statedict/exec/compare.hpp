// statedict: compare every tensor and value of two checkpoints, whatever their formats and
// layouts, in bounded memory (what `statedict verify` runs).
// SPDX-License-Identifier: MIT
//
// Exact comparisons hash both sides first (exec/digest.hpp, one pass over each) and read elements
// only for tensors whose digests differ, to name the first differing element. With a tolerance,
// floating tensors are compared block by block in F64. Tensors only on one side, shapes, dtypes and
// non-tensor values (the skeletons' leaves) are compared too.
#pragma once

#include "../core/config.hpp"
#include "../core/detail/defines_facade.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../core/cast.hpp"
#include "../core/flatten.hpp"
#include "../core/value_json.hpp"
#include "../shard/checkpoint.hpp"
#include "digest.hpp"
#include "executor.hpp"
#include "read.hpp"

namespace statedict::inline v0 {

namespace detail {

/// Elements [begin, end) of `t`, converted to `as`, in a fresh buffer.
inline std::vector<std::byte> read_block(const ShardedCheckpoint& ck, const TensorInfo& t, std::uint64_t begin, std::uint64_t end,
                                         dtype as, const exec_options& exec) {
  std::vector<std::byte> out(static_cast<std::size_t>((end - begin) * itemsize(as)));
  read_elements(ck, t, begin, end, as, out, exec);
  return out;
}

inline std::string index_of(std::uint64_t flat, const shape_t& shape) {
  shape_t idx(shape.size());
  for (std::size_t i = shape.size(); i-- > 0;) {
    const auto n = static_cast<std::uint64_t>(shape[i]);
    idx[i] = static_cast<dim_t>(flat % n);
    flat /= n;
  }
  return to_string(idx);
}

inline double as_double(const std::byte* p) {
  double d;
  std::memcpy(&d, p, sizeof d);
  return d;
}

inline std::string fmt(double d) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", d);
  return buf;
}

}  // namespace detail

/// Compares A and B: the same tensor names, shapes and dtypes (with a tolerance, floating dtypes
/// may differ: values are compared in F64), elements equal (exactly; or |a - b| <= atol + rtol *
/// |b|, NaN matching NaN), and the same non-tensor values.
STATEDICT_API comparison compare(const ShardedCheckpoint& A, const ShardedCheckpoint& B, const compare_options& opt = {}) {
  comparison r;
  auto report = [&](std::string s) {
    if (r.differences.size() < opt.max_report) r.differences.push_back(std::move(s));
    else ++r.omitted;
  };
  const bool tolerant = opt.rtol > 0 || opt.atol > 0;

  // Tensors present on both sides with the same shape; which need an element comparison.
  std::vector<std::pair<const TensorInfo*, const TensorInfo*>> exact, approx;
  for (const auto& ta : A.tensors) {
    const TensorInfo* tb = B.find(ta.name);
    if (!tb) {
      report("tensor " + quote(ta.name) + ": only in A");
      continue;
    }
    ++r.tensors;
    if (ta.shape != tb->shape) {
      report("tensor " + quote(ta.name) + ": shape " + to_string(ta.shape) + " in A, " + to_string(tb->shape) + " in B");
      continue;
    }
    if (ta.dtype != tb->dtype && !(tolerant && is_floating(ta.dtype) && is_floating(tb->dtype))) {
      report("tensor " + quote(ta.name) + ": dtype " + std::string(name(ta.dtype)) + " in A, " +
             std::string(name(tb->dtype)) + " in B");
      continue;
    }
    if (tolerant && is_floating(ta.dtype)) approx.emplace_back(&ta, tb);
    else exact.emplace_back(&ta, tb);
  }
  for (const auto& tb : B.tensors)
    if (!A.find(tb.name)) report("tensor " + quote(tb.name) + ": only in B");

  // Exact: digests first (one pass over each side), then the first differing element of each
  // tensor whose digests differ.
  if (!exact.empty()) {
    std::vector<std::string> names;
    for (const auto& p : exact) names.push_back(p.first->name);
    const auto ha = sha256_tensors(A, opt.exec, names);
    const auto hb = sha256_tensors(B, opt.exec, names);
    for (std::size_t i = 0; i < exact.size(); ++i) {
      if (ha[i].second == hb[i].second) continue;
      const TensorInfo& ta = *exact[i].first;
      const TensorInfo& tb = *exact[i].second;
      const std::uint64_t n = numel(ta.shape);
      const std::size_t item = itemsize(ta.dtype);
      std::string where = "the digests differ";
      for (std::uint64_t b = 0; b < n; b += opt.block_elements) {
        const std::uint64_t e = std::min(n, b + opt.block_elements);
        const auto xa = detail::read_block(A, ta, b, e, ta.dtype, opt.exec);
        const auto xb = detail::read_block(B, tb, b, e, ta.dtype, opt.exec);
        if (std::memcmp(xa.data(), xb.data(), xa.size()) == 0) continue;
        std::uint64_t k = 0;
        while (std::memcmp(xa.data() + k * item, xb.data() + k * item, item) == 0) ++k;
        where = "element " + detail::index_of(b + k, ta.shape) + " differs";
        if (is_floating(ta.dtype) && can_cast(ta.dtype, dtype::F64)) {
          double va = 0, vb = 0;
          cast_run(ta.dtype, xa.data() + k * item, dtype::F64, reinterpret_cast<std::byte*>(&va), 1);
          cast_run(ta.dtype, xb.data() + k * item, dtype::F64, reinterpret_cast<std::byte*>(&vb), 1);
          where += " (A " + detail::fmt(va) + ", B " + detail::fmt(vb) + ")";
        }
        break;
      }
      report("tensor " + quote(ta.name) + ": " + where);
    }
  }

  // With a tolerance: both sides in F64, block by block.
  for (const auto& [ta, tb] : approx) {
    const std::uint64_t n = numel(ta->shape);
    std::uint64_t bad = 0;
    std::string first;
    for (std::uint64_t b = 0; b < n; b += opt.block_elements) {
      const std::uint64_t e = std::min(n, b + opt.block_elements);
      const auto xa = detail::read_block(A, *ta, b, e, dtype::F64, opt.exec);
      const auto xb = detail::read_block(B, *tb, b, e, dtype::F64, opt.exec);
      for (std::uint64_t k = 0; k < e - b; ++k) {
        const double va = detail::as_double(xa.data() + k * 8), vb = detail::as_double(xb.data() + k * 8);
        const bool same = (std::isnan(va) && std::isnan(vb)) || va == vb ||
                          (std::isfinite(va) && std::isfinite(vb) && std::fabs(va - vb) <= opt.atol + opt.rtol * std::fabs(vb));
        if (same) continue;
        if (bad++ == 0)
          first = "element " + detail::index_of(b + k, ta->shape) + " (A " + detail::fmt(va) + ", B " + detail::fmt(vb) + ")";
      }
    }
    if (bad) report("tensor " + quote(ta->name) + ": " + std::to_string(bad) + " element(s) beyond rtol/atol, first " + first);
  }

  // Values.
  std::map<std::string, Value> va, vb;
  if (!A.skeleton.is_null())
    for (auto& [n, v] : skeleton_values(A.skeleton)) va.emplace(n, std::move(v));
  if (!B.skeleton.is_null())
    for (auto& [n, v] : skeleton_values(B.skeleton)) vb.emplace(n, std::move(v));
  for (const auto& [n, v] : va) {
    auto it = vb.find(n);
    if (it == vb.end()) {
      report("value " + quote(n) + ": only in A");
      continue;
    }
    ++r.values;
    if (!(v == it->second)) report("value " + quote(n) + ": " + value_json(v).dump() + " in A, " + value_json(it->second).dump() + " in B");
  }
  for (const auto& [n, v] : vb)
    if (!va.count(n)) report("value " + quote(n) + ": only in B");
  return r;
}

}  // namespace statedict::inline v0
