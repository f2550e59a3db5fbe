// statedict: FSDP flat parameters as OLMo's LocalShardedCheckpointer saves them, described as one
// consolidated state.
// SPDX-License-Identifier: MIT
//
// A checkpoint folder (`step<N>/`) holds, per rank r of W:
//   model/rank<r>.pt   {"modules": [{"name": <FSDP module name>, "handles": [{"flat_param.data": <this
//                      rank's shard>, "flat_param._fqns": ..., "flat_param._shapes": ..., ...}]}]}
//   optim/rank<r>.pt   the rank's torch optimizer state_dict (param_groups carry "param_names")
//   train/rank<r>.pt   the trainer state (steps, RNG states)
//   metadata.yaml      "world_size: W"
// `fsdp::detect(dir)` finds one from its content; `fsdp::describe(dir, options)` returns what
// OLMo's `unshard_checkpoint` produces: every original parameter, whole, named
// `<module name without "_fsdp_wrapped_module.">.<fqn>`, in order of first appearance (rank 0
// first), in the flat parameter's dtype; with `with_optimizer`, the optimizer state keyed by
// parameter name (`optim.state.<name>.<key>`, `optim.param_groups`), for `use_orig_params=True`
// runs (state per original parameter) and also for `use_orig_params=False` runs (state per flat
// parameter, laid out like it), which OLMo cannot unshard; with `with_train_state`, rank 0's
// trainer values (`train.*`) that hold no tensor.
//
// Both forms of the shard metadata are read: torch <= 2.0 (`_shard_param_offsets`,
// `_shard_indices`) and torch >= 2.1 (`_shard_param_infos`, `_numels_with_padding`). Every rank's
// metadata is checked against the placement rule (shard/layout.hpp fsdp_flat_param, fsdp_shard,
// fsdp_shard_param_infos, fsdp_legacy_shard_metadata, from torch/distributed/fsdp/_flat_param.py
// and 1.13's flat_param.py), so the chunks come from a rule the file is proven to follow; the
// right padding of each shard must be zero (OLMo's check). Facts and sources:
// docs/notes/zero-fsdp-layouts.md sections 8 and 9, docs/formats/fsdp.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../io/file.hpp"
#include "../io/torch_file.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/layout.hpp"
#include "detail/files.hpp"
#include "format.hpp"
#include "optim_shard.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id fsdp_not_found       {760, error_kind::format,      "fsdp.not_found"};
inline constexpr error_id fsdp_bad_model_file  {761, error_kind::format,      "fsdp.bad_model_file"};
inline constexpr error_id fsdp_world_size      {762, error_kind::format,      "fsdp.world_size"};
inline constexpr error_id fsdp_metadata        {763, error_kind::format,      "fsdp.metadata"};
inline constexpr error_id fsdp_shard_size      {764, error_kind::format,      "fsdp.shard_size"};
inline constexpr error_id fsdp_padding         {765, error_kind::format,      "fsdp.nonzero_padding"};
inline constexpr error_id fsdp_ranks_differ    {766, error_kind::format,      "fsdp.ranks_differ"};
inline constexpr error_id fsdp_bad_optim_file  {767, error_kind::format,      "fsdp.bad_optim_file"};
inline constexpr error_id fsdp_unknown_param   {768, error_kind::format,      "fsdp.unknown_param"};
inline constexpr error_id fsdp_duplicate_name  {769, error_kind::format,      "fsdp.duplicate_name"};
inline constexpr error_id fsdp_no_names        {770, error_kind::unsupported, "fsdp.no_names"};
inline constexpr error_id fsdp_dtype           {771, error_kind::format,      "fsdp.dtype"};
inline constexpr error_id fsdp_limit           {772, error_kind::limit,       "fsdp.limit"};
inline constexpr error_id fsdp_bad_option      {773, error_kind::usage,       "fsdp.bad_option"};
inline constexpr error_id fsdp_state_placement {774, error_kind::format,      "fsdp.state_placement"};
// clang-format on
}  // namespace errors

namespace fsdp {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Ranks (model/rank<N>.pt files).
  std::uint64_t max_ranks = std::uint64_t{1} << 16;
  /// FSDP modules, flat parameters and original parameters in one rank file.
  std::uint64_t max_entries = std::uint64_t{1} << 24;
  /// Bytes of metadata.yaml.
  std::uint64_t max_metadata_bytes = std::uint64_t{1} << 16;
  /// Limits of the torch.save reader.
  torch::limits torch{};
};

struct options {
  /// dtype of every output parameter; unset: the flat parameter's (OLMo's output).
  std::optional<statedict::dtype> dtype;
  /// Also describe the optimizer state keyed by parameter name, and the param groups.
  bool with_optimizer = false;
  /// Also keep rank 0's trainer state values (`train.<key>`; entries holding tensors, the per-rank
  /// RNG states, are left out).
  bool with_train_state = false;
  read_mode mode = read_mode::mmap;
  fsdp::limits limits{};
};

/// What detect() found.
struct detection {
  bool found = false;
  /// The rule that matched, or what was looked for and found.
  std::string rule;
  std::filesystem::path step_dir;
  std::uint32_t world_size = 0;
  /// world_size in metadata.yaml (nullopt when absent).
  std::optional<std::uint64_t> metadata_world_size;
  std::vector<std::filesystem::path> model_files, optim_files, train_files;  ///< rank order
};

namespace detail {

/// `rank<N>.pt` files of a folder, by N; empty (with `why`) unless they are exactly rank0 ..
/// rank<W-1> and at most `max`.
inline std::vector<std::filesystem::path> rank_files(const std::filesystem::path& dir, std::string& why, std::uint64_t max) {
  const auto found = formats::detail::rank_files(dir);
  if (auto gap = formats::detail::rank_gap(found, dir)) {
    why = *gap;
    return {};
  }
  if (found.size() > max) {
    why = quote(dir.string()) + " has more rank files than limits::max_ranks";
    return {};
  }
  std::vector<std::filesystem::path> out;
  for (const auto& f : found) out.push_back(f.second);
  return out;
}

/// `world_size: N` at the top level of OLMo's metadata.yaml (OmegaConf's dump of
/// _LocalShardedCheckpointerMetadata).
inline std::optional<std::uint64_t> yaml_world_size(const std::filesystem::path& p, std::uint64_t max_bytes) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(p, ec);
  if (ec || size > max_bytes) return std::nullopt;
  std::ifstream f(p, std::ios::binary);
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("world_size:", 0) != 0) continue;
    std::string v = line.substr(11);
    if (auto hash = v.find('#'); hash != std::string::npos) v.resize(hash);
    while (!v.empty() && (v.back() == ' ' || v.back() == '\r' || v.back() == '\t')) v.pop_back();
    std::size_t i = 0;
    while (i < v.size() && (v[i] == ' ' || v[i] == '\t')) ++i;
    v = v.substr(i);
    if (v.empty() || v.size() > 9 || v.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
    return std::stoull(v);
  }
  return std::nullopt;
}

}  // namespace detail

/// Looks at `dir` (a `step<N>` folder, or a folder whose `latest` links to one): `model/rank<N>.pt`
/// files for ranks 0 .. W-1 that begin like torch.save files, `optim/` and `train/` rank files when
/// present, and `metadata.yaml`'s world_size. Names alone do not decide: describe() then checks
/// that the model files hold FSDP flat parameters and their shard metadata.
inline detection detect(const std::filesystem::path& dir, const limits& lim = {}) {
  detection d;
  std::error_code ec;
  std::filesystem::path step = dir;
  if (!std::filesystem::is_directory(step / "model", ec) && std::filesystem::is_directory(dir / "latest" / "model", ec))
    step = dir / "latest";
  std::string why;
  if (!std::filesystem::is_directory(step / "model", ec)) {
    d.rule = "looked for an OLMo local sharded checkpoint (model/rank<N>.pt files) in " + quote(dir.string()) +
             ": there is no 'model' folder";
    return d;
  }
  auto model = detail::rank_files(step / "model", why, lim.max_ranks);
  if (model.empty()) {
    d.rule = "looked for an OLMo local sharded checkpoint (model/rank<N>.pt files): " + why;
    return d;
  }
  for (const auto& p : model)
    if (!formats::detail::begins_like_torch_file(p)) {
      d.rule = "looked for an OLMo local sharded checkpoint: " + quote(p.string()) + " does not begin like a torch.save file";
      return d;
    }
  d.found = true;
  d.step_dir = step;
  d.world_size = static_cast<std::uint32_t>(model.size());
  d.model_files = std::move(model);
  std::string ignored;
  if (std::filesystem::is_directory(step / "optim", ec)) d.optim_files = detail::rank_files(step / "optim", ignored, lim.max_ranks);
  if (std::filesystem::is_directory(step / "train", ec)) d.train_files = detail::rank_files(step / "train", ignored, lim.max_ranks);
  if (std::filesystem::is_regular_file(step / "metadata.yaml", ec))
    d.metadata_world_size = detail::yaml_world_size(step / "metadata.yaml", lim.max_metadata_bytes);
  d.rule = "model/rank0.pt .. rank" + std::to_string(d.world_size - 1) + ".pt are torch.save files (OLMo's local sharded "
           "checkpointer)";
  if (d.metadata_world_size) d.rule += ", metadata.yaml says world_size: " + std::to_string(*d.metadata_world_size);
  return d;
}

/// The files of one checkpoint, loaded (tests build them by hand; describe(dir) loads them).
struct Inputs {
  std::vector<optim_shard::LoadedFile> model;  ///< model/rank<r>.pt, rank order
  std::vector<optim_shard::LoadedFile> optim;  ///< optim/rank<r>.pt (needed with with_optimizer)
  std::vector<optim_shard::LoadedFile> train;  ///< train/rank<r>.pt (rank 0 used with with_train_state)
  std::optional<std::uint64_t> metadata_world_size;
};

namespace detail {

using optim_shard::Access;

using formats::detail::file_ctx;

/// OLMo's name of an FSDP module's parameters: the module name with every
/// "_fsdp_wrapped_module." removed (olmo/checkpoint.py _iter_flat_param_shards).
inline std::string strip_wrapper(std::string s) {
  static constexpr std::string_view w = "_fsdp_wrapped_module.";
  for (std::size_t at = s.find(w); at != std::string::npos; at = s.find(w, at)) s.erase(at, w.size());
  return s;
}

/// One original parameter of a flat parameter.
struct param {
  std::string fqn;   ///< as the handle lists it
  std::string name;  ///< output name (prefix + fqn)
  shape_t shape;
  std::uint64_t numel = 0;
};

/// One flat parameter (handle) on one rank.
struct handle_rank {
  const TensorView* data = nullptr;
  std::uint64_t numel_padded = 0;
  std::string where;
};

/// One flat parameter, over all ranks.
struct handle {
  std::string module;  ///< FSDP module name as saved
  std::size_t index = 0;  ///< position in the module's handles
  std::vector<param> params;
  layout::FsdpFlatParam flat;  ///< the layout the metadata was checked against
  bool legacy = false;        ///< torch <= 2.0 fields
  std::vector<std::vector<layout::FlatPiece>> pieces;  ///< per param
  std::vector<handle_rank> ranks;
  statedict::dtype dt = statedict::dtype::F32;
  std::uint64_t shard_numel = 0;
};

inline std::int64_t opt_int(const Value& v, const Access& a, std::string_view what) {
  return v.is_none() ? -1 : a.integer(v, what);
}

/// Checks one rank's saved metadata of a handle against the placement rule, and records the
/// handle's layout on rank 0.
inline void check_handle(handle& h, const Dict& hd, std::uint32_t r, std::uint32_t W, const Access& a,
                         const std::string& hw, optim_shard::SourceTable& table) {
  auto key = [&](std::string_view k) { return std::string("flat_param.") + std::string(k); };
  auto field = [&](std::string_view k) -> const Value& { return a.at(hd, key(k), hw); };
  const TensorView& data = a.tensor(field("data"), hw + "[" + quote(key("data")) + "]");
  if (data.rank() != 1) a.fail(hw + ": flat_param.data has shape " + to_string(data.shape()) + ", expected 1-d");
  if (!is_floating(data.dtype()))
    throw_error(errors::fsdp_dtype, a.where, hw + ": flat_param.data is " + std::string(name(data.dtype())));
  // Names: _fqns (torch >= 2.0), _prefixed_param_names (1.13).
  const Value* fq = hd.find(key("_fqns"));
  if (!fq) fq = hd.find(key("_prefixed_param_names"));
  if (!fq)
    throw_error(errors::fsdp_no_names, a.where,
                hw + " has neither flat_param._fqns nor flat_param._prefixed_param_names: the parameters of this "
                     "flat parameter cannot be named");
  std::vector<std::string> fqns;
  for (const Value& v : a.list(*fq, hw + " _fqns")) fqns.push_back(a.string(v, hw + " _fqns entry"));
  std::vector<shape_t> shapes;
  for (const Value& v : a.list(field("_shapes"), hw + " _shapes")) shapes.push_back(a.shape(v, hw + " _shapes entry"));
  if (fqns.size() != shapes.size())
    throw_error(errors::fsdp_metadata, a.where,
                hw + ": " + std::to_string(fqns.size()) + " names but " + std::to_string(shapes.size()) + " shapes");
  std::vector<std::uint64_t> numels;
  for (const auto& s : shapes) numels.push_back(numel(s));
  if (const Value* nv = hd.find(key("_numels"))) {
    const List& l = a.list(*nv, hw + " _numels");
    bool ok = l.size() == numels.size();
    for (std::size_t i = 0; ok && i < l.size(); ++i) ok = l[i].is_int() && static_cast<std::uint64_t>(l[i].as_int()) == numels[i];
    if (!ok) throw_error(errors::fsdp_metadata, a.where, hw + ": flat_param._numels does not match flat_param._shapes");
  }
  const std::int64_t padded = a.integer(field("_shard_numel_padded"), hw + " _shard_numel_padded");
  if (padded < 0) a.fail(hw + ": negative _shard_numel_padded");

  if (r == 0) {
    h.dt = data.dtype();
    for (std::size_t i = 0; i < fqns.size(); ++i) {
      const std::string prefix = strip_wrapper(h.module);
      h.params.push_back(param{fqns[i], prefix.empty() ? fqns[i] : prefix + "." + fqns[i], shapes[i], numels[i]});
    }
    h.legacy = hd.contains(key("_shard_indices"));
    if (h.legacy) {
      h.flat = layout::fsdp_flat_param(numels, W, 0);
    } else {
      // _numels_with_padding tells whether use_orig_params alignment padding is there.
      std::vector<std::uint64_t> nwp;
      if (const Value* v = hd.find(key("_numels_with_padding"))) {
        for (const Value& x : a.list(*v, hw + " _numels_with_padding")) {
          const std::int64_t n = a.integer(x, hw + " _numels_with_padding entry");
          if (n < 0) a.fail(hw + ": negative _numels_with_padding entry");
          nwp.push_back(static_cast<std::uint64_t>(n));
        }
        const auto plain = layout::fsdp_flat_param(numels, W, 0);
        const auto aligned = layout::fsdp_flat_param(numels, W, layout::fsdp_aligned_numel(data.dtype()));
        if (nwp == aligned.numels_with_padding) h.flat = aligned;
        else if (nwp == plain.numels_with_padding) h.flat = plain;
        else
          throw_error(errors::fsdp_metadata, a.where,
                      hw + ": flat_param._numels_with_padding follows neither FSDP's flattening without padding nor "
                           "its alignment of each parameter to 16 bytes and of the end to the world size (" +
                          std::to_string(W) + ")");
      } else {
        h.flat = layout::fsdp_flat_param(numels, W, 0);
      }
    }
    h.shard_numel = layout::fsdp_shard(h.flat.numel, 0, W).numel;
    h.pieces = layout::fsdp_pieces(h.flat, W);
  } else {
    if (data.dtype() != h.dt)
      throw_error(errors::fsdp_ranks_differ, a.where, hw + ": flat_param.data is " + std::string(name(data.dtype())) +
                                                          ", rank 0's is " + std::string(name(h.dt)));
    bool same = fqns.size() == h.params.size();
    for (std::size_t i = 0; same && i < fqns.size(); ++i) same = fqns[i] == h.params[i].fqn && shapes[i] == h.params[i].shape;
    if (!same) throw_error(errors::fsdp_ranks_differ, a.where, hw + ": parameter names or shapes differ from rank 0's");
    if (h.legacy != hd.contains(key("_shard_indices")))
      throw_error(errors::fsdp_ranks_differ, a.where, hw + ": metadata fields differ from rank 0's");
  }

  const layout::FsdpShard sh = layout::fsdp_shard(h.flat.numel, r, W);
  if (data.numel() != sh.numel)
    throw_error(errors::fsdp_shard_size, a.where,
                hw + ": flat_param.data has " + std::to_string(data.numel()) + " elements; a flat parameter of " +
                    std::to_string(h.flat.numel) + " elements over " + std::to_string(W) +
                    " ranks has shards of ceil(" + std::to_string(h.flat.numel) + "/" + std::to_string(W) +
                    ") = " + std::to_string(sh.numel) + " (HYBRID_SHARD checkpoints, whose shard group is smaller than "
                    "the world, are not read)");
  if (static_cast<std::uint64_t>(padded) != sh.numel_padded)
    throw_error(errors::fsdp_metadata, a.where,
                hw + ": _shard_numel_padded is " + std::to_string(padded) + ", the rule gives rank " + std::to_string(r) +
                    " " + std::to_string(sh.numel_padded));

  if (h.legacy) {
    const auto expect = layout::fsdp_legacy_shard_metadata(numels, r, W);
    const List& offs = a.list(field("_shard_param_offsets"), hw + " _shard_param_offsets");
    const List& idx = a.list(field("_shard_indices"), hw + " _shard_indices");
    bool ok = offs.size() == expect.param_offsets.size() && idx.size() == 2 && idx[0].is_int() && idx[1].is_int() &&
              idx[0].as_int() == expect.indices.first && idx[1].as_int() == expect.indices.second;
    for (std::size_t i = 0; ok && i < offs.size(); ++i) {
      const Value& p = offs[i];
      ok = p.is_sequence() && p.as_list().size() == 2 && p.as_list()[0].is_int() && p.as_list()[1].is_int() &&
           p.as_list()[0].as_int() == expect.param_offsets[i].first && p.as_list()[1].as_int() == expect.param_offsets[i].second;
    }
    if (!ok)
      throw_error(errors::fsdp_metadata, a.where,
                  hw + ": _shard_param_offsets / _shard_indices differ from what torch <= 2.0 computes for rank " +
                      std::to_string(r) + " of " + std::to_string(W) + " (flat_param.py _get_shard_metadata)");
  } else {
    const auto expect = layout::fsdp_shard_param_infos(h.flat, r, W);
    const List& infos = a.list(field("_shard_param_infos"), hw + " _shard_param_infos");
    if (infos.size() != expect.size())
      throw_error(errors::fsdp_metadata, a.where,
                  hw + ": " + std::to_string(infos.size()) + " _shard_param_infos for " + std::to_string(expect.size()) +
                      " parameters");
    for (std::size_t i = 0; i < infos.size(); ++i) {
      const Value& v = infos[i];
      const List* f = nullptr;
      if (v.is_object() && v.as_object().name == "_ShardParamInfo") f = &v.as_object().args;
      else if (v.is_sequence()) f = &v.as_list();
      if (!f || f->size() != 5 || !(*f)[0].is_bool())
        a.fail(hw + ": _shard_param_infos[" + std::to_string(i) + "] is not a _ShardParamInfo(in_shard, offset_in_shard, "
                    "numel_in_shard, intra_param_start_idx, intra_param_end_idx)");
      const layout::ShardParamInfo& e = expect[i];
      bool ok = (*f)[0].as_bool() == e.in_shard;
      if (ok && e.in_shard)
        ok = opt_int((*f)[1], a, "offset_in_shard") == e.offset_in_shard &&
             opt_int((*f)[2], a, "numel_in_shard") == e.numel_in_shard &&
             opt_int((*f)[3], a, "intra_param_start_idx") == e.intra_param_start_idx &&
             opt_int((*f)[4], a, "intra_param_end_idx") == e.intra_param_end_idx;
      if (!ok)
        throw_error(errors::fsdp_metadata, a.where,
                    hw + ": _shard_param_infos[" + std::to_string(i) + "] (" + quote(h.params[i].fqn) +
                        ") differs from what FSDP computes for rank " + std::to_string(r) + " of " + std::to_string(W) +
                        (e.in_shard ? " (in_shard, offset " + std::to_string(e.offset_in_shard) + ", " +
                                          std::to_string(e.numel_in_shard) + " elements from " +
                                          std::to_string(e.intra_param_start_idx) + ")"
                                    : " (not in shard)"));
    }
  }

  // OLMo: "if _shard_numel_padded > 0, the last that many elements must be 0" (+0 or -0). The
  // padding bytes (at most one shard) are read through the file.
  if (sh.numel_padded > 0) {
    const std::size_t item = data.itemsize();
    const std::uint64_t first = data.numel() - sh.numel_padded;
    const Tensor pad = table.materialize(data.narrow(0, static_cast<dim_t>(first), static_cast<dim_t>(sh.numel_padded)),
                                         a.where + ": " + hw + " flat_param.data");
    for (std::uint64_t i = 0; i < sh.numel_padded; ++i) {
      const std::byte* p = pad.data() + i * item;
      for (std::size_t k = 0; k < item; ++k)
        if (p[k] != std::byte{0} && !(k + 1 == item && p[k] == std::byte{0x80}))
          throw_error(errors::fsdp_padding, a.where,
                      hw + ": element " + std::to_string(first + i) + " of flat_param.data is right padding (the last " +
                          std::to_string(sh.numel_padded) + ") and is not zero");
    }
  }
  h.ranks[r] = handle_rank{&data, sh.numel_padded, a.where + ": " + hw};
}

/// Parses every rank's model file into the handles (rank 0's order).
inline std::vector<handle> read_handles(const std::vector<optim_shard::LoadedFile>& files, const limits& lim,
                                        optim_shard::SourceTable& table) {
  const auto W = static_cast<std::uint32_t>(files.size());
  std::vector<handle> hs;
  for (std::uint32_t r = 0; r < W; ++r) {
    Access a{errors::fsdp_bad_model_file, file_ctx(files[r])};
    const Dict& top = a.dict(files[r].tree, "the model file");
    const List& mods = a.list(a.at(top, "modules", "the model file (not an OLMo local sharded model file?)"), "modules");
    if (mods.size() > lim.max_entries) throw_error(errors::fsdp_limit, a.where, "more modules than limits::max_entries");
    std::size_t k = 0;
    for (std::size_t mi = 0; mi < mods.size(); ++mi) {
      const Dict& md = a.dict(mods[mi], "modules[" + std::to_string(mi) + "]");
      const std::string& mname = a.string(a.at(md, "name", "modules[" + std::to_string(mi) + "]"), "module name");
      const List& hl = a.list(a.at(md, "handles", "modules[" + std::to_string(mi) + "]"), "handles");
      for (std::size_t hi = 0; hi < hl.size(); ++hi, ++k) {
        const std::string hw = "module " + quote(mname) + " handle " + std::to_string(hi);
        if (r == 0) {
          if (hs.size() >= lim.max_entries) throw_error(errors::fsdp_limit, a.where, "more handles than limits::max_entries");
          hs.push_back(handle{});
          hs.back().module = mname;
          hs.back().index = hi;
          hs.back().ranks.resize(W);
        } else if (k >= hs.size() || hs[k].module != mname || hs[k].index != hi) {
          throw_error(errors::fsdp_ranks_differ, a.where,
                      "modules and handles differ from rank 0's (at " + hw + ")");
        }
        check_handle(hs[k], a.dict(hl[hi], hw), r, W, a, hw, table);
      }
    }
    if (k != hs.size())
      throw_error(errors::fsdp_ranks_differ, a.where, std::to_string(k) + " flat parameters, rank 0 has " + std::to_string(hs.size()));
  }
  return hs;
}

/// A parameter of the output, where it is.
struct located {
  std::size_t h = 0, p = 0;
};

}  // namespace detail

/// Describes loaded files (see Inputs). Format "olmo_local_sharded"; metadata "fsdp.world_size",
/// "fsdp.form" ("torch<=2.0" or "torch>=2.1").
inline ShardedCheckpoint describe(const Inputs& in, const options& opt = {}) {
  using namespace detail;
  if (opt.dtype && !is_floating(*opt.dtype))
    throw_error(errors::fsdp_bad_option, "options.dtype", std::string(statedict::name(*opt.dtype)) + " is not a floating dtype");
  if (in.model.empty()) throw_error(errors::fsdp_world_size, "OLMo checkpoint", "no model/rank<N>.pt file");
  if (in.model.size() > opt.limits.max_ranks)
    throw_error(errors::fsdp_limit, "OLMo checkpoint", std::to_string(in.model.size()) + " ranks, more than limits::max_ranks");
  const auto W = static_cast<std::uint32_t>(in.model.size());
  if (in.metadata_world_size && *in.metadata_world_size != W)
    throw_error(errors::fsdp_world_size, "metadata.yaml",
                "says world_size: " + std::to_string(*in.metadata_world_size) + ", but there are " + std::to_string(W) +
                    " model rank files");
  optim_shard::SourceTable table;
  for (const auto& f : in.model) table.add(f.source, f.base);
  std::vector<handle> hs = read_handles(in.model, opt.limits, table);
  ShardedCheckpoint ckpt;
  optim_shard::SkeletonBuilder skel;

  // Parameters in order of first appearance, rank 0 first (OLMo's unshard output order).
  std::vector<located> order;
  std::unordered_map<std::string, located> by_name;
  auto add = [&](std::size_t hi, std::size_t pi) {
    const param& p = hs[hi].params[pi];
    const auto [it, fresh] = by_name.emplace(p.name, located{hi, pi});
    if (!fresh) {
      if (it->second.h == hi && it->second.p == pi) return;
      auto where = [&](std::size_t h) {
        return "module " + quote(hs[h].module) + " handle " + std::to_string(hs[h].index) + " (flat parameter " +
               std::to_string(h) + ")";
      };
      throw_error(errors::fsdp_duplicate_name, "parameter " + quote(p.name),
                  "is named by " + where(it->second.h) + " and by " + where(hi));
    }
    order.push_back(located{hi, pi});
  };
  for (std::uint32_t r = 0; r < W; ++r)
    for (std::size_t hi = 0; hi < hs.size(); ++hi)
      for (std::size_t pi = 0; pi < hs[hi].params.size(); ++pi) {
        bool here = false;
        for (const auto& pc : hs[hi].pieces[pi]) here = here || pc.rank == r;
        if (here || (r == 0 && hs[hi].params[pi].numel == 0)) add(hi, pi);
      }
  // A parameter held by no rank (impossible under the rule unless empty) still appears: never drop.
  for (std::size_t hi = 0; hi < hs.size(); ++hi)
    for (std::size_t pi = 0; pi < hs[hi].params.size(); ++pi) add(hi, pi);

  for (const located& l : order) {
    const handle& h = hs[l.h];
    const param& p = h.params[l.p];
    std::vector<optim_shard::RankBuffer> bufs(W);
    for (std::uint32_t r = 0; r < W; ++r)
      bufs[r].push_back(optim_shard::Segment{h.ranks[r].data, h.shard_numel, h.ranks[r].where + ": flat_param.data"});
    TensorInfo t{p.name, opt.dtype.value_or(h.dt), p.shape, {}};
    const std::string what = "parameter " + quote(p.name);
    t.chunks = optim_shard::place(h.pieces[l.p], bufs, table, what);
    optim_shard::check_flat_cover(t.chunks, p.numel, errors::fsdp_metadata, what);
    skel.tensor(std::vector<std::string>{p.name}, t);
    ckpt.tensors.push_back(std::move(t));
  }

  if (opt.with_optimizer) {
    if (in.optim.size() != W)
      throw_error(errors::fsdp_world_size, "OLMo checkpoint",
                  std::to_string(in.optim.size()) + " optim/rank<N>.pt files for " + std::to_string(W) + " ranks");
    for (const auto& f : in.optim) table.add(f.source, f.base);
    std::vector<const Dict*> states(W);
    std::vector<const Value*> groups(W);
    std::vector<std::string> wheres(W);
    for (std::uint32_t r = 0; r < W; ++r) {
      Access a{errors::fsdp_bad_optim_file, file_ctx(in.optim[r])};
      wheres[r] = a.where;
      const Dict& top = a.dict(in.optim[r].tree, "the optimizer state");
      states[r] = &a.dict(a.at(top, "state", "the optimizer state"), "state");
      groups[r] = &a.at(top, "param_groups", "the optimizer state");
      (void)a.list(*groups[r], "param_groups");
    }
    // OLMo: param_groups must be equal on every rank.
    optim_shard::check_groups_equal(groups, wheres);
    // ids -> names through zip(param_names, params) (OLMo unshard_checkpoint).
    Access a0{errors::fsdp_bad_optim_file, wheres[0]};
    struct pid_entry {
      std::int64_t id;
      std::string name;
      std::size_t group;
    };
    std::vector<pid_entry> ids;
    const List& g0 = groups[0]->as_list();
    for (std::size_t g = 0; g < g0.size(); ++g) {
      const Dict& gd = a0.dict(g0[g], "param_groups[" + std::to_string(g) + "]");
      const Value* pn = gd.find("param_names");
      if (!pn)
        throw_error(errors::fsdp_unknown_param, wheres[0],
                    "param_groups[" + std::to_string(g) + "] has no param_names (OLMo's get_param_groups adds them); the "
                    "optimizer state cannot be keyed by name");
      const List& names = a0.list(*pn, "param_names");
      const List& pids = a0.list(a0.at(gd, "params", "param_groups"), "params");
      if (names.size() != pids.size())
        a0.fail("param_groups[" + std::to_string(g) + "] lists " + std::to_string(names.size()) + " names for " +
                std::to_string(pids.size()) + " params");
      for (std::size_t i = 0; i < pids.size(); ++i)
        ids.push_back(pid_entry{a0.integer(pids[i], "a param id"), strip_wrapper(a0.string(names[i], "a param name")), g});
    }
    // Flat parameter names (use_orig_params=False): "<FSDP module>._fsdp_wrapped_module._flat_param".
    std::unordered_map<std::string, std::size_t> flat_of;
    for (std::size_t hi = 0; hi < hs.size(); ++hi)
      if (hs[hi].index == 0) flat_of.emplace(strip_wrapper(hs[hi].module.empty() ? "_flat_param" : hs[hi].module + "._flat_param"), hi);

    std::vector<optim_shard::ParamState> params;
    optim_shard::StateFamilies fams;
    std::vector<std::vector<std::string>> group_names(g0.size());
    std::unordered_set<std::int64_t> seen_ids;
    auto state_seg = [&](std::uint32_t r, std::int64_t id, std::uint64_t n, const std::string& what) {
      const Value* st = states[r]->find(Key(id));
      Access a{errors::fsdp_bad_optim_file, wheres[r]};
      return optim_shard::StateSegment{st ? &a.dict(*st, "state[" + std::to_string(id) + "]") : nullptr, n,
                                       wheres[r] + ": state[" + std::to_string(id) + "] (" + what + ")"};
    };
    for (const pid_entry& e : ids) {
      if (!seen_ids.insert(e.id).second) a0.fail("param id " + std::to_string(e.id) + " is listed twice in param_groups");
      if (auto it = by_name.find(e.name); it != by_name.end()) {
        // use_orig_params=True: rank r's state tensors hold exactly its slice of the parameter.
        const handle& h = hs[it->second.h];
        const auto& pcs = h.pieces[it->second.p];
        optim_shard::ParamState ps{e.name, h.params[it->second.p].shape, fams.size(), {}, 0};
        std::vector<std::vector<optim_shard::StateSegment>> fam(W);
        for (std::uint32_t r = 0; r < W; ++r) {
          std::uint64_t n = 0;
          for (const auto& pc : pcs)
            if (pc.rank == r) {
              ps.pieces.push_back(layout::FlatPiece{r, pc.range, 0});
              n = pc.range.size();
            }
          fam[r].push_back(state_seg(r, e.id, n, "parameter " + quote(e.name)));
          if (n == 0 && fam[r][0].state) {
            // OLMo: "no flat param data for {fqn} on rank {r}".
            for (const auto& [k, v] : *fam[r][0].state)
              if (v.is_tensor() && v.as_tensor().rank() > 0 && v.as_tensor().numel() > 0)
                throw_error(errors::fsdp_state_placement, wheres[r],
                            "state[" + std::to_string(e.id) + "] of parameter " + quote(e.name) + " has " +
                                std::to_string(v.as_tensor().numel()) + " elements of " + quote(k.str()) +
                                ", but this rank's shard holds none of the parameter");
          }
        }
        fams.push_back(std::move(fam));
        params.push_back(std::move(ps));
        group_names[e.group].push_back(e.name);
      } else if (auto ft = flat_of.find(e.name); ft != flat_of.end()) {
        // use_orig_params=False: state per flat parameter, laid out like flat_param.data.
        const handle& h = hs[ft->second];
        std::vector<std::vector<optim_shard::StateSegment>> fam(W);
        for (std::uint32_t r = 0; r < W; ++r) fam[r].push_back(state_seg(r, e.id, h.shard_numel, "flat parameter " + quote(e.name)));
        const std::size_t f = fams.size();
        fams.push_back(std::move(fam));
        for (std::size_t pi = 0; pi < h.params.size(); ++pi) {
          params.push_back(optim_shard::ParamState{h.params[pi].name, h.params[pi].shape, f, h.pieces[pi], 0});
          group_names[e.group].push_back(h.params[pi].name);
        }
      } else {
        throw_error(errors::fsdp_unknown_param, wheres[0],
                    "param_groups name " + quote(e.name) + " (id " + std::to_string(e.id) +
                        ") is neither a parameter of the model files nor one of their flat parameters");
      }
    }
    for (std::uint32_t r = 0; r < W; ++r)
      for (const auto& [k, v] : *states[r])
        if (!k.is_int() || !seen_ids.count(k.as_int()))
          throw_error(errors::fsdp_unknown_param, wheres[r], "state key " + k.str() + " is not a param id of param_groups");
    optim_shard::MergedState merged = optim_shard::merge_state(params, fams, table);
    for (TensorInfo& t : merged.tensors) {
      const std::string rest = t.name.substr(std::string("optim.state.").size());
      const auto dot = rest.rfind('.');
      skel.tensor(std::vector<std::string>{"optim", "state", rest.substr(0, dot), rest.substr(dot + 1)}, t);
      ckpt.tensors.push_back(std::move(t));
    }
    for (auto& [n, v] : merged.values) {
      const auto dot = n.rfind('.');
      skel.value(std::vector<std::string>{"optim", "state", n.substr(0, dot), n.substr(dot + 1)}, v);
    }
    for (std::size_t g = 0; g < g0.size(); ++g) {
      const std::vector<std::string> base{"optim", "param_groups", std::to_string(g)};
      List names;
      for (const auto& n : group_names[g]) names.emplace_back(n);
      auto p = base;
      p.push_back("params");
      skel.value(p, Value::list(std::move(names)));
      for (const auto& [k, v] : g0[g].as_dict()) {
        if (k.is_string() && (k.as_string() == "params" || k.as_string() == "param_names")) continue;
        auto q = base;
        q.push_back(k.str());
        skel.value(q, v);
      }
    }
  }

  if (opt.with_train_state && !in.train.empty()) {
    Access a{errors::fsdp_bad_model_file, file_ctx(in.train[0])};
    for (const auto& [k, v] : a.dict(in.train[0].tree, "the trainer state")) {
      if (flatten(v).tensors.empty()) skel.value(std::vector<std::string>{"train", k.str()}, v);
    }
  }

  ckpt.format = "olmo_local_sharded";
  ckpt.skeleton = skel.build();
  ckpt.sources = table.take();
  ckpt.metadata["fsdp.world_size"] = std::to_string(W);
  if (!hs.empty()) ckpt.metadata["fsdp.form"] = hs[0].legacy ? "torch<=2.0" : "torch>=2.1";
  return ckpt;
}

/// Detects and describes the checkpoint at `dir` (see detect()). Throws errors::fsdp_not_found
/// with what was looked for when `dir` is not one.
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  const detection d = detect(dir, opt.limits);
  if (!d.found) throw_error(errors::fsdp_not_found, "directory " + quote(dir.string()), d.rule);
  const std::string context = "OLMo checkpoint " + quote(d.step_dir.string());
  auto load = [&](const std::filesystem::path& p) { return formats::detail::load_rank_file(p, opt.mode, opt.limits.torch, context); };
  Inputs in;
  in.metadata_world_size = d.metadata_world_size;
  for (const auto& p : d.model_files) in.model.push_back(load(p));
  if (opt.with_optimizer) {
    if (d.optim_files.size() != d.model_files.size())
      throw_error(errors::fsdp_world_size, "directory " + quote(d.step_dir.string()),
                  std::to_string(d.optim_files.size()) + " optim/rank<N>.pt files for " +
                      std::to_string(d.model_files.size()) + " model rank files");
    for (const auto& p : d.optim_files) in.optim.push_back(load(p));
  }
  if (opt.with_train_state && !d.train_files.empty()) in.train.push_back(load(d.train_files[0]));
  return describe(in, opt);
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// OLMo's local sharded checkpoints (`model/rank<N>.pt` of FSDP flat parameters, `optim/`,
/// `train/`): consolidated into named parameters and, on request, optimizer state.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "fsdp"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "FSDP flat parameters"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    detection d = fsdp::detect(in.path(), opt.settings.get<options>().limits);
    return d.found ? formats::Detection::match(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.dtype = opt.dtype;
    o.with_optimizer = opt.with_optimizer;
    o.with_train_state = o.with_train_state || opt.with_optimizer;
    o.mode = opt.mode;
    return fsdp::describe(in.path(), o);
  }
  [[nodiscard]] bool applies_dtype() const noexcept override { return true; }
};

}  // namespace fsdp
}  // namespace statedict::inline v0
