// `statedict verify`: compare every tensor and value of two checkpoints, whatever their formats and
// layouts, in bounded memory. Also value_json, the JSON form of a non-tensor leaf.
#pragma once

#include <statedict/exec/digest.hpp>
#include <statedict/formats/convert.hpp>
#include <statedict/statedict.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace cli {

namespace sd = statedict;

/// A non-tensor leaf as JSON: None, bool, int, float (non-finite as the strings "nan", "inf",
/// "-inf"), str; bytes as {"bytes_hex": ...}; empty containers as [] or {}; an opaque object as
/// {"object": "module.name"}.
inline nlohmann::ordered_json value_json(const sd::Value& v) {
  using K = sd::value_kind;
  switch (v.kind()) {
    case K::none: return nullptr;
    case K::boolean: return v.as_bool();
    case K::integer: return v.as_int();
    case K::floating: {
      const double d = v.as_double();
      if (std::isnan(d)) return "nan";
      if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
      return d;
    }
    case K::string: return v.as_string();
    case K::bytes: {
      static constexpr char hex[] = "0123456789abcdef";
      std::string h;
      for (auto b : v.as_bytes().data) {
        h += hex[b >> 4];
        h += hex[b & 15];
      }
      return nlohmann::ordered_json{{"bytes_hex", h}};
    }
    case K::list:
    case K::tuple: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& x : v.as_list()) a.push_back(value_json(x));
      return a;
    }
    case K::dict: return nlohmann::ordered_json::object();
    case K::object: return nlohmann::ordered_json{{"object", v.as_object().qualified()}};
    case K::tensor: return nlohmann::ordered_json{{"tensor", sd::to_string(v.as_tensor().shape())}};
  }
  return nullptr;
}

struct verify_options {
  double rtol = 0;
  double atol = 0;
  sd::exec_options exec{};
  std::size_t max_report = 20;
  /// Elements per comparison block.
  std::uint64_t block_elements = std::uint64_t{1} << 19;
};

struct verify_report {
  std::vector<std::string> differences;
  std::size_t omitted = 0;
  std::size_t tensors = 0;
  std::size_t values = 0;
  [[nodiscard]] bool equal() const { return differences.empty() && omitted == 0; }
};

namespace detail {

/// Elements [begin, end) of tensor `t` of `ck` (row-major), converted to `as`.
inline std::vector<std::byte> read_flat(const sd::ShardedCheckpoint& ck, const sd::TensorInfo& t, std::uint64_t begin,
                                        std::uint64_t end, sd::dtype as, const sd::exec_options& exec) {
  sd::Destination d;
  d.names.push_back("block of " + t.name);
  d.sizes.push_back((end - begin) * sd::itemsize(as));
  sd::TensorInfo x{t.name, as, t.shape, {}};
  x.chunks.push_back(sd::Chunk{sd::FlatRange{begin, end}, sd::Placement{0, 0, {}, as}});
  d.tensors.push_back(std::move(x));
  sd::plan_options po;
  po.require_full_destination = false;
  const sd::Plan plan = sd::make_plan(ck, d, po);
  sd::MemorySink sink("block", d.sizes[0]);
  std::vector<sd::Sink*> sinks{&sink};
  sd::exec_options e = exec;
  e.progress = {};
  (void)sd::execute(plan, ck, sinks, e);
  return std::move(sink.buffer());
}

inline std::string index_of(std::uint64_t flat, const sd::shape_t& shape) {
  sd::shape_t idx(shape.size());
  for (std::size_t i = shape.size(); i-- > 0;) {
    const auto n = static_cast<std::uint64_t>(shape[i]);
    idx[i] = static_cast<sd::dim_t>(flat % n);
    flat /= n;
  }
  return sd::to_string(idx);
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
inline verify_report verify(const sd::ShardedCheckpoint& A, const sd::ShardedCheckpoint& B, const verify_options& opt) {
  verify_report r;
  auto report = [&](std::string s) {
    if (r.differences.size() < opt.max_report) r.differences.push_back(std::move(s));
    else ++r.omitted;
  };
  const bool tolerant = opt.rtol > 0 || opt.atol > 0;

  // Tensors present on both sides with the same shape; which need an element comparison.
  std::vector<std::pair<const sd::TensorInfo*, const sd::TensorInfo*>> exact, approx;
  for (const auto& ta : A.tensors) {
    const sd::TensorInfo* tb = B.find(ta.name);
    if (!tb) {
      report("tensor " + sd::quote(ta.name) + ": only in A");
      continue;
    }
    ++r.tensors;
    if (ta.shape != tb->shape) {
      report("tensor " + sd::quote(ta.name) + ": shape " + sd::to_string(ta.shape) + " in A, " + sd::to_string(tb->shape) + " in B");
      continue;
    }
    if (ta.dtype != tb->dtype && !(tolerant && sd::is_floating(ta.dtype) && sd::is_floating(tb->dtype))) {
      report("tensor " + sd::quote(ta.name) + ": dtype " + std::string(sd::name(ta.dtype)) + " in A, " +
             std::string(sd::name(tb->dtype)) + " in B");
      continue;
    }
    if (tolerant && sd::is_floating(ta.dtype)) approx.emplace_back(&ta, tb);
    else exact.emplace_back(&ta, tb);
  }
  for (const auto& tb : B.tensors)
    if (!A.find(tb.name)) report("tensor " + sd::quote(tb.name) + ": only in B");

  // Exact: digests first (one pass over each side), then the first differing element of each
  // tensor whose digests differ.
  if (!exact.empty()) {
    std::vector<std::string> names;
    for (const auto& p : exact) names.push_back(p.first->name);
    const auto ha = sd::sha256_tensors(A, opt.exec, names);
    const auto hb = sd::sha256_tensors(B, opt.exec, names);
    for (std::size_t i = 0; i < exact.size(); ++i) {
      if (ha[i].second == hb[i].second) continue;
      const sd::TensorInfo& ta = *exact[i].first;
      const sd::TensorInfo& tb = *exact[i].second;
      const std::uint64_t n = sd::numel(ta.shape);
      const std::size_t item = sd::itemsize(ta.dtype);
      std::string where = "the digests differ";
      for (std::uint64_t b = 0; b < n; b += opt.block_elements) {
        const std::uint64_t e = std::min(n, b + opt.block_elements);
        const auto xa = detail::read_flat(A, ta, b, e, ta.dtype, opt.exec);
        const auto xb = detail::read_flat(B, tb, b, e, ta.dtype, opt.exec);
        if (std::memcmp(xa.data(), xb.data(), xa.size()) == 0) continue;
        std::uint64_t k = 0;
        while (std::memcmp(xa.data() + k * item, xb.data() + k * item, item) == 0) ++k;
        where = "element " + detail::index_of(b + k, ta.shape) + " differs";
        if (sd::is_floating(ta.dtype) && sd::can_cast(ta.dtype, sd::dtype::F64)) {
          double va = 0, vb = 0;
          sd::cast_run(ta.dtype, xa.data() + k * item, sd::dtype::F64, reinterpret_cast<std::byte*>(&va), 1);
          sd::cast_run(ta.dtype, xb.data() + k * item, sd::dtype::F64, reinterpret_cast<std::byte*>(&vb), 1);
          where += " (A " + detail::fmt(va) + ", B " + detail::fmt(vb) + ")";
        }
        break;
      }
      report("tensor " + sd::quote(ta.name) + ": " + where);
    }
  }

  // With a tolerance: both sides in F64, block by block.
  for (const auto& [ta, tb] : approx) {
    const std::uint64_t n = sd::numel(ta->shape);
    std::uint64_t bad = 0;
    std::string first;
    for (std::uint64_t b = 0; b < n; b += opt.block_elements) {
      const std::uint64_t e = std::min(n, b + opt.block_elements);
      const auto xa = detail::read_flat(A, *ta, b, e, sd::dtype::F64, opt.exec);
      const auto xb = detail::read_flat(B, *tb, b, e, sd::dtype::F64, opt.exec);
      for (std::uint64_t k = 0; k < e - b; ++k) {
        const double va = detail::as_double(xa.data() + k * 8), vb = detail::as_double(xb.data() + k * 8);
        const bool same = (std::isnan(va) && std::isnan(vb)) || va == vb ||
                          (std::isfinite(va) && std::isfinite(vb) && std::fabs(va - vb) <= opt.atol + opt.rtol * std::fabs(vb));
        if (same) continue;
        if (bad++ == 0)
          first = "element " + detail::index_of(b + k, ta->shape) + " (A " + detail::fmt(va) + ", B " + detail::fmt(vb) + ")";
      }
    }
    if (bad) report("tensor " + sd::quote(ta->name) + ": " + std::to_string(bad) + " element(s) beyond rtol/atol, first " + first);
  }

  // Values.
  std::map<std::string, sd::Value> va, vb;
  if (!A.skeleton.is_null())
    for (auto& [n, v] : sd::skeleton_values(A.skeleton)) va.emplace(n, std::move(v));
  if (!B.skeleton.is_null())
    for (auto& [n, v] : sd::skeleton_values(B.skeleton)) vb.emplace(n, std::move(v));
  for (const auto& [n, v] : va) {
    auto it = vb.find(n);
    if (it == vb.end()) {
      report("value " + sd::quote(n) + ": only in A");
      continue;
    }
    ++r.values;
    if (!(v == it->second)) report("value " + sd::quote(n) + ": " + value_json(v).dump() + " in A, " + value_json(it->second).dump() + " in B");
  }
  for (const auto& [n, v] : vb)
    if (!va.count(n)) report("value " + sd::quote(n) + ": only in B");
  return r;
}

}  // namespace cli
