// statedict: the metadata of fairscale FSDP rank files (`local_metadata_dict()`, saved by fairseq as
// `fsdp_metadata` and by metaseq as `shard_metadata`) in both schemas, checked against FSDP's
// sharding rule, and the pieces each rank holds of every parameter.
// SPDX-License-Identifier: MIT
//
// New schema (fairscale >= 0.3.9): per FSDP unit {"fsdp_path", "params": {backing name: {"names",
// "shapes", "numels", "padding"}}, "no_broadcast_optim_state", "shared_param_info": [(src, dst)]}.
// Old schema (0.3.7, 0.3.8): per unit {"fsdp_path", "is_flat", "num_padded", "param_names",
// "param_shapes", "param_numels", "no_broadcast_optim_state"}, the flat tensor stored as
// `flat_param` (0.3.7) or `flat_param_0` (0.3.8), no tie information. Every backing tensor (a flat
// parameter, or a parameter FSDP did not flatten) is sharded by `torch.flatten(t).chunk(W)`, each
// rank's chunk right-padded to the length of the first: with T elements, S = ceil(T / W), rank r
// holds [r*S, r*S + v_r), v_r = clamp(T - r*S, 0, S), padding S - v_r. Units with
// no_broadcast_optim_state (experts) are not sharded: every rank holds a whole, different tensor,
// and rank 0's is the one kept (fairscale's rule). docs/formats/fairscale.md has the sources.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/value.hpp"
#include "../../shard/layout.hpp"
#include "../optim_shard.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id fairscale_not_found     {930, error_kind::format, "fairscale.not_found"};
inline constexpr error_id fairscale_missing_rank  {931, error_kind::format, "fairscale.missing_rank"};
inline constexpr error_id fairscale_ambiguous     {932, error_kind::usage,  "fairscale.ambiguous"};
inline constexpr error_id fairscale_bad_file      {933, error_kind::format, "fairscale.bad_file"};
inline constexpr error_id fairscale_bad_metadata  {934, error_kind::format, "fairscale.bad_metadata"};
inline constexpr error_id fairscale_ranks_differ  {935, error_kind::format, "fairscale.ranks_differ"};
inline constexpr error_id fairscale_padding       {936, error_kind::format, "fairscale.padding"};
inline constexpr error_id fairscale_numel         {937, error_kind::format, "fairscale.numel"};
inline constexpr error_id fairscale_missing_key   {938, error_kind::format, "fairscale.missing_key"};
inline constexpr error_id fairscale_bad_tie       {939, error_kind::format, "fairscale.bad_tie"};
inline constexpr error_id fairscale_duplicate     {940, error_kind::format, "fairscale.duplicate_name"};
inline constexpr error_id fairscale_bad_optimizer {941, error_kind::format, "fairscale.bad_optimizer"};
inline constexpr error_id fairscale_optim_differs {942, error_kind::format, "fairscale.optimizer_differs"};
inline constexpr error_id fairscale_dtype         {943, error_kind::format, "fairscale.dtype"};
inline constexpr error_id fairscale_limit         {944, error_kind::limit,  "fairscale.limit"};
// clang-format on
}  // namespace errors

namespace fairscale::detail {

using optim_shard::Access;

/// One tensor the metadata describes, sharded over the ranks (or whole on each, for experts).
struct Backing {
  std::size_t unit = 0;
  std::string key;  ///< its key in the rank's `model` dict
  std::vector<std::string> names;  ///< the parameters it holds, relative to the unit
  std::vector<shape_t> shapes;
  std::vector<std::uint64_t> numels;
  std::uint64_t total = 0;            ///< sum of numels
  std::vector<std::uint64_t> padding;  ///< per rank, as recorded
  bool no_broadcast = false;
};

struct Unit {
  std::string path;  ///< fsdp_path ("" for the root)
  std::vector<std::pair<std::string, std::string>> ties;  ///< (src, dst), relative to the unit
};

/// The layout of a checkpoint, from rank 0's metadata, checked against every rank's.
struct Layout {
  bool old_schema = false;
  std::vector<Unit> units;
  std::vector<Backing> backing;
  std::vector<std::string> buffers;
};

inline std::string join(const std::string& path, const std::string& name) { return path.empty() ? name : path + "." + name; }

/// Non-negative ints of a list or tuple.
inline std::vector<std::uint64_t> counts(const Value& v, const Access& a, const std::string& what) {
  std::vector<std::uint64_t> out;
  for (const Value& x : a.list(v, what)) {
    const std::int64_t n = a.integer(x, what + " entry");
    if (n < 0) a.fail(what + " holds a negative number");
    out.push_back(static_cast<std::uint64_t>(n));
  }
  return out;
}

/// Names, shapes and numels of one backing tensor, checked against each other.
inline void fill(Backing& b, const Value& names, const Value& shapes, const Value& numels, const Access& a, const std::string& what,
                 std::uint64_t max_entries) {
  for (const Value& n : a.list(names, what + " names")) b.names.push_back(a.string(n, what + " name"));
  for (const Value& s : a.list(shapes, what + " shapes")) b.shapes.push_back(a.shape(s, what + " shape"));
  b.numels = counts(numels, a, what + " numels");
  if (b.names.size() > max_entries) throw_error(errors::fairscale_limit, a.where, what + ": more names than limits::max_entries");
  if (b.names.size() != b.shapes.size() || b.names.size() != b.numels.size())
    throw_error(errors::fairscale_numel, a.where,
                what + ": " + std::to_string(b.names.size()) + " names, " + std::to_string(b.shapes.size()) + " shapes, " +
                    std::to_string(b.numels.size()) + " numels");
  for (std::size_t j = 0; j < b.names.size(); ++j) {
    if (numel(b.shapes[j]) != b.numels[j])
      throw_error(errors::fairscale_numel, a.where,
                  what + ": " + quote(b.names[j]) + " has shape " + to_string(b.shapes[j]) + " but numel " + std::to_string(b.numels[j]));
    b.total = checked_add(b.total, b.numels[j], "flat parameter size");
  }
}

/// Parses one rank's metadata (`flat_key`: the old schema's name of flat tensors).
inline Layout parse(const Value& md, const Access& a, const std::string& flat_key, std::uint64_t max_entries) {
  Layout l;
  const Dict& top = a.dict(md, "the FSDP metadata");
  const List& units = a.list(a.at(top, "param_metadata", "the FSDP metadata"), "param_metadata");
  if (units.size() > max_entries) throw_error(errors::fairscale_limit, a.where, "more FSDP units than limits::max_entries");
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::string uw = "param_metadata[" + std::to_string(u) + "]";
    const Dict& ud = a.dict(units[u], uw);
    Unit unit;
    unit.path = a.string(a.at(ud, "fsdp_path", uw), uw + " fsdp_path");
    const Value* nb = Access::opt(ud, "no_broadcast_optim_state");
    if (nb && !nb->is_bool()) a.fail(uw + " no_broadcast_optim_state is not a bool");
    const bool nob = nb && nb->as_bool();
    if (const Value* p = ud.find("params")) {
      for (const auto& [bk, bv] : a.dict(*p, uw + " params")) {
        const std::string bw = uw + " params[" + quote(bk.str()) + "]";
        const Dict& bd = a.dict(bv, bw);
        Backing b;
        b.unit = u;
        b.key = join(unit.path, bk.str());
        b.no_broadcast = nob;
        fill(b, a.at(bd, "names", bw), a.at(bd, "shapes", bw), a.at(bd, "numels", bw), a, bw, max_entries);
        const std::int64_t pad = a.integer(a.at(bd, "padding", bw), bw + " padding");
        if (pad < 0) a.fail(bw + " padding is negative");
        b.padding.push_back(static_cast<std::uint64_t>(pad));
        l.backing.push_back(std::move(b));
      }
      if (const Value* s = Access::opt(ud, "shared_param_info")) {
        for (const Value& t : a.list(*s, uw + " shared_param_info")) {
          const List& pair = a.list(t, uw + " shared_param_info entry");
          if (pair.size() != 2) a.fail(uw + " shared_param_info entry is not a (source, destination) pair");
          unit.ties.emplace_back(a.string(pair[0], uw + " tie source"), a.string(pair[1], uw + " tie destination"));
        }
      }
    } else if (ud.contains("is_flat")) {
      l.old_schema = true;
      const Value& flat = a.at(ud, "is_flat", uw);
      if (!flat.is_bool()) a.fail(uw + " is_flat is not a bool");
      const auto pads = counts(a.at(ud, "num_padded", uw), a, uw + " num_padded");
      const Value& names = a.at(ud, "param_names", uw);
      const Value& shapes = a.at(ud, "param_shapes", uw);
      const Value& numels = a.at(ud, "param_numels", uw);
      if (flat.as_bool()) {
        Backing b;
        b.unit = u;
        b.key = join(unit.path, flat_key);
        b.no_broadcast = nob;
        fill(b, names, shapes, numels, a, uw, max_entries);
        if (!b.names.empty()) {
          if (pads.empty()) a.fail(uw + " num_padded is empty");
          b.padding.push_back(pads[0]);
          l.backing.push_back(std::move(b));
        }
      } else {
        Backing all;
        fill(all, names, shapes, numels, a, uw, max_entries);
        if (pads.size() != all.names.size()) a.fail(uw + " num_padded does not list one padding per parameter");
        for (std::size_t j = 0; j < all.names.size(); ++j) {
          Backing b;
          b.unit = u;
          b.key = join(unit.path, all.names[j]);
          b.no_broadcast = nob;
          b.names = {all.names[j]};
          b.shapes = {all.shapes[j]};
          b.numels = {all.numels[j]};
          b.total = all.numels[j];
          b.padding.push_back(pads[j]);
          l.backing.push_back(std::move(b));
        }
      }
    } else {
      a.fail(uw + " has neither \"params\" (fairscale >= 0.3.9) nor \"is_flat\" (0.3.7, 0.3.8)");
    }
    l.units.push_back(std::move(unit));
  }
  if (const Value* bn = Access::opt(top, "buffer_names"))
    for (const Value& n : a.list(*bn, "buffer_names")) l.buffers.push_back(a.string(n, "a buffer name"));
  return l;
}

/// Folds rank r's layout into rank 0's: the same units, backing tensors, names, shapes and numels;
/// only the padding may differ (it is appended).
inline void merge_rank(Layout& l0, const Layout& lr, std::uint32_t r, const std::string& where) {
  auto differ = [&](const std::string& what) {
    throw_error(errors::fairscale_ranks_differ, where, what + " differs from rank 0's (rank " + std::to_string(r) + ")");
  };
  if (lr.old_schema != l0.old_schema) differ("the metadata schema");
  if (lr.units.size() != l0.units.size()) differ("the number of FSDP units");
  for (std::size_t u = 0; u < l0.units.size(); ++u) {
    if (lr.units[u].path != l0.units[u].path) differ("the path of FSDP unit " + std::to_string(u));
    if (lr.units[u].ties != l0.units[u].ties) differ("shared_param_info of unit " + quote(l0.units[u].path));
  }
  if (lr.backing.size() != l0.backing.size()) differ("the number of flat parameters");
  for (std::size_t k = 0; k < l0.backing.size(); ++k) {
    const Backing& a = l0.backing[k];
    const Backing& b = lr.backing[k];
    if (a.key != b.key || a.names != b.names || a.shapes != b.shapes || a.numels != b.numels || a.no_broadcast != b.no_broadcast)
      differ("flat parameter " + quote(a.key));
    l0.backing[k].padding.push_back(b.padding.at(0));
  }
  if (lr.buffers != l0.buffers) differ("buffer_names");
}

/// FSDP's shard of rank r of a T-element tensor over W ranks: (shard length S, elements held v_r).
inline std::pair<std::uint64_t, std::uint64_t> chunk_rule(std::uint64_t total, std::uint32_t world, std::uint32_t r) {
  const std::uint64_t s = total == 0 ? 0 : (total + world - 1) / world;
  const std::uint64_t start = checked_mul(s, r, "shard offset");
  const std::uint64_t held = start >= total ? 0 : std::min(s, total - start);
  return {s, held};
}

/// The pieces of name j of backing tensor b: per rank, the part of [o_j, o_j + m_j) it holds, at
/// its offset in the rank's shard. Experts: all on rank 0.
inline std::vector<layout::FlatPiece> pieces(const Backing& b, std::size_t j, std::uint32_t world) {
  std::uint64_t o = 0;
  for (std::size_t i = 0; i < j; ++i) o += b.numels[i];
  const std::uint64_t e = o + b.numels[j];
  std::vector<layout::FlatPiece> out;
  if (b.no_broadcast) {
    out.push_back(layout::FlatPiece{0, FlatRange{0, b.numels[j]}, o});
    return out;
  }
  for (std::uint32_t r = 0; r < world; ++r) {
    const auto [s, held] = chunk_rule(b.total, world, r);
    const std::uint64_t lo = std::max(o, s * r), hi = std::min(e, s * r + held);
    if (lo < hi) out.push_back(layout::FlatPiece{r, FlatRange{lo - o, hi - o}, lo - s * r});
  }
  return out;
}

}  // namespace fairscale::detail
}  // namespace statedict::inline v0
