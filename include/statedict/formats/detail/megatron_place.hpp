// statedict: Megatron-LM tensor parallelism as placements (formats/megatron.hpp is the public
// header): one logical tensor from the pieces its TP ranks hold, each piece a view into its rank
// file, turned into chunks (a box of the full tensor and where its elements are stored) by the
// tensor's split rule. No element is copied: the QKV row orders of checkpoint_version 0 and 1.0
// become one chunk per head and Q/K/V block (1.0's with a row stride of 3), a SwiGLU rank's
// [W_r; V_r] two chunks, the vocabulary cut by clipping boxes.
// SPDX-License-Identifier: MIT
//
// Sources: tools/checkpoint/loader_megatron.py (concatenation per rule), checkpointing.py
// fix_query_key_value_ordering / _transpose_first_dim (QKV orders), transformer.py
// ParallelAttention (groups per rank); tests/python/layouts/megatron.md sections 2.3 - 2.5.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/tensor.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../optim_shard.hpp"
#include "megatron_rules.hpp"

namespace statedict::inline v0::megatron::detail {

/// One TP rank's copy of a tensor: a view into its file, and the file (for messages).
struct piece {
  const TensorView* view = nullptr;
  std::string where;
  std::uint32_t source = 0;  ///< the description's source holding the view's bytes
};

/// A logical tensor being assembled: its pieces by TP rank, and extra full sets of pieces that must
/// hold the same values (the last stage's copy of tied word embeddings).
struct assembly {
  std::string name;
  std::optional<split> how;  ///< nullopt: no rule matched
  std::vector<piece> ranks;  ///< index: TP rank
  std::vector<std::vector<piece>> copies;
  /// Compare the TP pieces while describing (constant optimizer state such as `step`).
  bool compare = false;
};

/// What placing needs besides the pieces.
struct place_context {
  const facts* f = nullptr;
  std::optional<std::uint64_t> true_vocab_size;  ///< cut vocab-split tensors to this many rows
  std::uint64_t max_chunks = 0;
  std::uint64_t chunks = 0;         ///< chunks made so far
  std::uint64_t compare_budget = 0;  ///< bytes left for comparing tensors without a rule
  optim_shard::SourceTable* table = nullptr;
  /// Per source: the address standing for its byte 0 in the views, and its size.
  std::vector<std::pair<const std::byte*, std::uint64_t>> bases;
};

/// Where the elements of `v` (a view into source `source`) are stored.
inline Placement locate(const TensorView& v, std::uint32_t source, const place_context& c, const std::string& name) {
  Placement at;
  at.source = source;
  at.stored = v.dtype();
  if (!v.is_contiguous()) at.strides = v.strides();
  if (v.numel() == 0) return at;
  if (source >= c.bases.size()) throw_error(errors::mg_bad_rank_file, "tensor " + quote(name), "refers to source " + std::to_string(source) + " of " + std::to_string(c.bases.size()));
  const auto p = reinterpret_cast<std::uintptr_t>(v.data()), b = reinterpret_cast<std::uintptr_t>(c.bases[source].first);
  const std::uint64_t size = c.bases[source].second;
  if (p < b || p - b > size || v.extent_bytes() > size - (p - b))
    throw_error(errors::mg_bad_rank_file, "tensor " + quote(name), "a piece's bytes lie outside the file that holds it");
  at.byte_offset = p - b;
  return at;
}

inline std::string ranks_text(const std::vector<std::size_t>& r) {
  std::string s;
  for (std::size_t i : r) s += (s.empty() ? "" : ", ") + std::to_string(i);
  return s;
}

/// The checks every rule shares: a piece from every TP rank, one dtype and one shape.
inline void check_pieces(const assembly& a, const std::vector<piece>& ranks, std::string_view what) {
  std::vector<std::size_t> missing;
  for (std::size_t r = 0; r < ranks.size(); ++r)
    if (!ranks[r].view) missing.push_back(r);
  if (!missing.empty())
    throw_error(errors::mg_missing, "tensor " + quote(a.name),
                std::string(what) + " missing on TP rank(s) " + ranks_text(missing) + " of " + std::to_string(ranks.size()));
  const TensorView& v0 = *ranks[0].view;
  for (std::size_t r = 1; r < ranks.size(); ++r) {
    const TensorView& v = *ranks[r].view;
    if (v.dtype() != v0.dtype() || v.shape() != v0.shape()) {
      const std::string detail = std::string(what) + " is " + std::string(name(v0.dtype())) + " " + to_string(v0.shape()) + " on TP rank 0 (" +
                                 ranks[0].where + ") but " + std::string(name(v.dtype())) + " " + to_string(v.shape()) + " on TP rank " +
                                 std::to_string(r) + " (" + ranks[r].where + ")";
      if (!a.how)
        throw_error(errors::mg_unknown_differs, "tensor " + quote(a.name),
                    detail + ", and no partition rule names it: add one (megatron::options::rules, --megatron-rule PATTERN=KIND)");
      throw_error(errors::mg_shape, "tensor " + quote(a.name), detail + "; every TP rank of a " + std::string(to_string(*a.how)) +
                                                                     " tensor holds a piece of the same shape");
    }
  }
}

/// True when two views hold the same elements, read through their sources in blocks.
inline bool same_elements(const TensorView& a, const TensorView& b, place_context& c, const std::string& what) {
  const std::uint64_t n = a.nbytes();
  if (n > c.compare_budget)
    throw_error(errors::mg_limit, "tensor " + quote(what),
                "comparing its TP copies needs " + std::to_string(n) + " more bytes than limits::max_compare_bytes allows");
  c.compare_budget -= n;
  if (!a.is_contiguous() || !b.is_contiguous()) {
    const Tensor x = c.table->materialize(a, what), y = c.table->materialize(b, what);
    return equal_bytes(x.view(), y.view());
  }
  constexpr std::uint64_t block = std::uint64_t{4} << 20;
  for (std::uint64_t at = 0; at < n; at += block) {
    const std::uint64_t k = std::min(block, n - at);
    if (c.table->read_bytes(a, at, k, what) != c.table->read_bytes(b, at, k, what)) return false;
  }
  return true;
}

/// A tensor no rule names (then replicated) or constant state: the same on every TP rank,
/// compared now.
inline void check_same(const assembly& a, place_context& c) {
  for (std::size_t r = 1; r < a.ranks.size(); ++r) {
    if (same_elements(*a.ranks[0].view, *a.ranks[r].view, c, a.name)) continue;
    const std::string both = "differs between TP rank 0 (" + a.ranks[0].where + ") and TP rank " + std::to_string(r) + " (" + a.ranks[r].where + ")";
    if (a.how)
      throw_error(errors::mg_state_differs, "tensor " + quote(a.name), both + "; constant state is the same on every rank");
    throw_error(errors::mg_unknown_differs, "tensor " + quote(a.name),
                both + ", and no partition rule names it, so it cannot be merged: add a rule (megatron::options::rules, "
                       "--megatron-rule PATTERN=KIND)");
  }
}

/// The rule actually applied (fc1 resolved by args.swiglu; no rule: replicated once checked).
inline split effective(const assembly& a, const facts& f) {
  if (!a.how) return split::replicated;
  if (*a.how == split::fc1) return f.swiglu ? split::glu : split::column;
  return *a.how;
}

/// The full tensor's shape from one piece's.
inline shape_t full_shape(const assembly& a, split how, const shape_t& s, std::uint64_t tp) {
  shape_t out = s;
  auto need = [&](std::size_t rank) {
    if (s.size() < rank)
      throw_error(errors::mg_shape, "tensor " + quote(a.name),
                  "a " + std::string(to_string(how)) + " tensor needs " + std::to_string(rank) + " dimension(s), the pieces have shape " + to_string(s));
  };
  switch (how) {
    case split::replicated: return out;
    case split::row:
      need(2);
      out[1] = static_cast<dim_t>(checked_mul(static_cast<std::uint64_t>(s[1]), tp, "tensor size"));
      break;
    case split::glu:
      need(1);
      if (s[0] % 2 != 0)
        throw_error(errors::mg_shape, "tensor " + quote(a.name), "a glu piece holds [W_r; V_r], but it has an odd row count " + std::to_string(s[0]));
      [[fallthrough]];
    default:
      need(1);
      out[0] = static_cast<dim_t>(checked_mul(static_cast<std::uint64_t>(s[0]), tp, "tensor size"));
  }
  (void)numel(out);
  return out;
}

/// The box of the full tensor that starts at `offset` along `dim` with the extent of `v`.
inline Box box_at(const TensorView& v, std::size_t dim, std::uint64_t offset) {
  Box b{shape_t(v.rank(), 0), v.shape()};
  b.offsets[dim] = static_cast<dim_t>(offset);
  return b;
}

/// QKV rows of one rank in the >= 2.0 order ([groups, heads/groups + 2, head dim]): as stored
/// for checkpoint_version >= 2.0; from [3, np, hn] (0) or [np, hn, 3] (1.0) one piece per head and
/// Q/K/V block (np = heads / tp, hn = kv_channels).
inline void qkv_pieces(const assembly& a, const TensorView& v, std::uint64_t r, const facts& f,
                       std::vector<std::pair<Box, TensorView>>& out) {
  const std::uint64_t tp = f.tp, hn = f.kv_channels;
  const std::string who = "tensor " + quote(a.name);
  const std::string version = f.checkpoint_version == 0 ? "0" : "1.0";
  if (f.checkpoint_version < 2.0 && f.checkpoint_version != 0 && f.checkpoint_version != 1.0)
    throw_error(errors::mg_qkv_order, who, "checkpoint_version " + version_text(f.checkpoint_version) + " has no known QKV row order");
  if (f.checkpoint_version < 2.0 && f.groups != f.heads)
    throw_error(errors::mg_qkv_order, who, "checkpoint_version " + version + " predates grouped-query attention, but args give " +
                                                std::to_string(f.groups) + " query groups for " + std::to_string(f.heads) + " heads");
  if (f.heads % tp != 0 || f.groups % tp != 0)
    throw_error(errors::mg_shape, who, "TP " + std::to_string(tp) + " does not divide " + std::to_string(f.heads) + " heads in " +
                                            std::to_string(f.groups) + " query groups (each rank holds whole groups)");
  const std::uint64_t np = f.heads / tp, ng = f.groups / tp;
  const auto rows = static_cast<std::uint64_t>(v.shape()[0]);
  const std::uint64_t base = r * rows;
  if (f.checkpoint_version >= 2.0) {
    const std::uint64_t want = (np + 2 * ng) * hn;
    if (rows != want)
      throw_error(errors::mg_shape, who, "a TP rank holds " + std::to_string(rows) + " QKV rows, args give (" + std::to_string(np) +
                                              " + 2 x " + std::to_string(ng) + ") x " + std::to_string(hn) + " = " + std::to_string(want));
    out.emplace_back(box_at(v, 0, base), v);
    return;
  }
  if (rows != 3 * np * hn)
    throw_error(errors::mg_shape, who, "a TP rank holds " + std::to_string(rows) + " QKV rows, args give 3 x " + std::to_string(np) + " x " +
                                            std::to_string(hn));
  if (!v.is_contiguous())
    throw_error(errors::mg_qkv_order, who, "the checkpoint_version " + version + " QKV rows are stored with strides " + to_string(v.strides()) +
                                                ", which cannot be reordered by placements; only contiguous pieces can");
  shape_t split_shape{static_cast<dim_t>(f.checkpoint_version == 0 ? 3 : np), static_cast<dim_t>(f.checkpoint_version == 0 ? np : hn),
                      static_cast<dim_t>(f.checkpoint_version == 0 ? hn : 3)};
  for (std::size_t d = 1; d < v.rank(); ++d) split_shape.push_back(v.shape()[d]);
  const TensorView v4 = v.reshape(split_shape);
  for (std::uint64_t i = 0; i < np; ++i)
    for (std::uint64_t j = 0; j < 3; ++j) {
      // version 0: [3, np, hn]; 1.0: [np, hn, 3] (rows of one head and block at a stride of 3)
      const TensorView block = f.checkpoint_version == 0 ? v4.select(0, static_cast<dim_t>(j)).select(0, static_cast<dim_t>(i))
                                                         : v4.select(0, static_cast<dim_t>(i)).select(1, static_cast<dim_t>(j));
      out.emplace_back(box_at(block, 0, base + (i * 3 + j) * hn), block);
    }
}

/// The (box, view) pieces of TP rank r's view `v` under `how`.
inline void rank_pieces(const assembly& a, split how, const TensorView& v, std::uint64_t r, const facts& f,
                        std::vector<std::pair<Box, TensorView>>& out) {
  switch (how) {
    case split::replicated: out.emplace_back(box_at(v, 0, 0), v); return;
    case split::column:
    case split::vocab: out.emplace_back(box_at(v, 0, r * static_cast<std::uint64_t>(v.shape()[0])), v); return;
    case split::row: out.emplace_back(box_at(v, 1, r * static_cast<std::uint64_t>(v.shape()[1])), v); return;
    case split::qkv: qkv_pieces(a, v, r, f, out); return;
    case split::glu: {
      // [W_r; V_r] -> W_r at rows r*h of [W; V], V_r at rows tp*h + r*h (h = half the rank's rows).
      const dim_t h = v.shape()[0] / 2;
      const auto hu = static_cast<std::uint64_t>(h);
      const TensorView w = v.narrow(0, 0, h), g = v.narrow(0, h, h);
      out.emplace_back(box_at(w, 0, r * hu), w);
      out.emplace_back(box_at(g, 0, checked_add(checked_mul(f.tp, hu, "rows"), r * hu, "rows")), g);
      return;
    }
    case split::fc1: break;  // resolved by effective()
  }
  throw_error(errors::mg_bad_rule, "tensor " + quote(a.name), "rule fc1 reached placement unresolved");
}

/// Clips a piece to the first `rows` rows of the full tensor; false when nothing is left.
inline bool clip_rows(std::pair<Box, TensorView>& p, std::uint64_t rows) {
  const auto off = static_cast<std::uint64_t>(p.first.offsets[0]);
  if (off >= rows) return false;
  const auto n = static_cast<std::uint64_t>(p.first.sizes[0]);
  if (off + n > rows) {
    p.second = p.second.narrow(0, 0, static_cast<dim_t>(rows - off));
    p.first.sizes[0] = static_cast<dim_t>(rows - off);
  }
  return true;
}

/// Places one set of TP pieces (all ranks) as chunks of `t`.
inline void place_set(const assembly& a, split how, const std::vector<piece>& ranks, TensorInfo& t, place_context& c) {
  const facts& f = *c.f;
  std::vector<std::pair<Box, TensorView>> ps;
  for (std::uint64_t r = 0; r < ranks.size(); ++r) {
    ps.clear();
    rank_pieces(a, how, *ranks[r].view, r, f, ps);
    for (auto& p : ps) {
      if (how == split::vocab && c.true_vocab_size && !clip_rows(p, *c.true_vocab_size)) continue;
      if (++c.chunks > c.max_chunks)
        throw_error(errors::mg_limit, "tensor " + quote(a.name), "more chunks than limits::max_chunks (" + std::to_string(c.max_chunks) + ")");
      t.chunks.push_back(Chunk{std::move(p.first), locate(p.second, ranks[r].source, c, a.name)});
    }
  }
}

/// The logical tensor of `a` (name, dtype, full shape, chunks); see the top of this file.
inline TensorInfo place(const assembly& a, place_context& c) {
  const facts& f = *c.f;
  check_pieces(a, a.ranks, "it is");
  if ((!a.how || a.compare) && a.ranks.size() > 1) check_same(a, c);
  const split how = effective(a, f);
  const TensorView& v0 = *a.ranks[0].view;
  TensorInfo t;
  t.name = a.name;
  t.dtype = v0.dtype();
  t.shape = full_shape(a, how, v0.shape(), a.ranks.size());
  if (how == split::vocab && f.padded_vocab_size && static_cast<std::uint64_t>(t.shape[0]) != *f.padded_vocab_size)
    throw_error(errors::mg_shape, "tensor " + quote(a.name),
                std::to_string(a.ranks.size()) + " TP pieces of " + std::to_string(v0.shape()[0]) + " rows make " + std::to_string(t.shape[0]) +
                    " vocabulary rows, args.padded_vocab_size is " + std::to_string(*f.padded_vocab_size));
  if (how == split::vocab && c.true_vocab_size) {
    if (*c.true_vocab_size > static_cast<std::uint64_t>(t.shape[0]))
      throw_error(errors::mg_vocab, "tensor " + quote(a.name),
                  "the true vocabulary size " + std::to_string(*c.true_vocab_size) + " exceeds the " + std::to_string(t.shape[0]) + " rows stored");
    t.shape[0] = static_cast<dim_t>(*c.true_vocab_size);
  }
  place_set(a, how, a.ranks, t, c);
  for (const auto& copy : a.copies) {
    check_pieces(a, copy, "its copy");
    if (copy[0].view->dtype() != v0.dtype() || copy[0].view->shape() != v0.shape())
      throw_error(errors::mg_shape, "tensor " + quote(a.name),
                  "its copy in " + copy[0].where + " is " + std::string(name(copy[0].view->dtype())) + " " + to_string(copy[0].view->shape()) +
                      ", the tensor is " + std::string(name(v0.dtype())) + " " + to_string(v0.shape()) + " per rank");
    place_set(a, how, copy, t, c);  // same boxes: replicas, compared by the planner on request
  }
  return t;
}

}  // namespace statedict::inline v0::megatron::detail
