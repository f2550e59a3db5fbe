// statedict: fairscale FullyShardedDataParallel rank files as fairseq and metaseq save them (OPT's
// released checkpoints among them), described as one consolidated state.
// SPDX-License-Identifier: MIT
//
// A checkpoint is a family of torch.save files `<stem>-shard0.pt` .. `<stem>-shard{W-1}.pt`, one per
// data-parallel rank (`checkpoint_last-shard0.pt`, metaseq's `checkpoint_last-model_part-0-shard0.pt`).
// Each holds the rank's shards of the FSDP flat parameters in `model` (`flat_param_0`,
// `decoder.layers.N.flat_param_0`, ...), the metadata to unflatten them (`fsdp_metadata` for
// fairseq, `shard_metadata` for metaseq; formats/detail/fairscale_meta.hpp reads both schemas), and
// the rank's optimizer state over its shards (`last_optimizer_state`). `fairscale::describe` gives:
//   - every parameter, whole, named `<unit path>.<name>`, its chunks the ranks' pieces with each
//     rank's padding left out; experts (no_broadcast_optim_state units) from rank 0;
//   - the tied names of every unit (`shared_param_info`) as aliases: fairscale's own
//     consolidate_shard_weights restores only the last unit's, so metaseq's tied output projection
//     goes missing there;
//   - the buffers (`buffer_names`) from rank 0;
//   - with `with_optimizer`, the Adam state keyed by parameter name (`optim.state.<name>.<key>`),
//     moments unpadded and split like the weights, `step` checked equal on every rank,
//     `optim.param_groups` with names, and the other optimizer keys (`optim.loss_scale`), checked
//     equal on every rank.
// The files pickle argparse.Namespace and numpy objects; they are read as data (never called). No
// tensor byte is read except 0-dim optimizer state. Facts and sources: docs/formats/fairscale.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/value.hpp"
#include "../io/file.hpp"
#include "../io/torch_file.hpp"
#include "../shard/checkpoint.hpp"
#include "detail/fairscale_meta.hpp"
#include "detail/files.hpp"
#include "format.hpp"
#include "optim_shard.hpp"

namespace statedict::inline v0::fairscale {

/// Caps on hostile input; each error names the field to raise.
struct limits {
  /// Ranks (rank files of one family).
  std::uint64_t max_ranks = std::uint64_t{1} << 16;
  /// FSDP units, flat parameters and parameter names of one rank file.
  std::uint64_t max_entries = std::uint64_t{1} << 24;
  /// Limits of the torch.save reader.
  torch::limits torch{};
};

struct options {
  /// Also describe the optimizer state (`last_optimizer_state`) keyed by parameter name.
  bool with_optimizer = false;
  read_mode mode = read_mode::mmap;
  fairscale::limits limits{};
};

/// What detect() found.
struct detection {
  bool found = false;
  /// The rule that matched, or what was looked for and found.
  std::string rule;
  /// Several families in one folder (detect() then names them; describe() refuses).
  bool ambiguous = false;
  /// A family whose ranks are not 0 .. W-1 (describe() says which is missing).
  bool missing_rank = false;
  std::vector<std::filesystem::path> files;  ///< rank order
};

namespace detail {

/// `<stem>-shard<N>.pt` -> (stem, N); files naming an expert rank (`rank-N`) are not rank files.
inline std::optional<std::pair<std::string, std::uint64_t>> shard_name(const std::string& file) {
  static const std::regex re(R"((.*)-shard(\d+)\.pt)");
  static const std::regex expert(R"(rank-\d+)");
  std::smatch m;
  if (!std::regex_match(file, m, re) || std::regex_search(file, expert)) return std::nullopt;
  const auto n = formats::detail::plain_number(m[2].str());
  if (!n) return std::nullopt;
  return std::make_pair(m[1].str(), *n);
}

/// The family of `stem` in `dir`: its files by rank, contiguous from 0 (`why` says what is wrong,
/// `gap` whether a rank is missing).
inline std::vector<std::filesystem::path> family(const std::filesystem::path& dir, const std::string& stem, std::uint64_t max_ranks,
                                                 std::string& why, bool& gap) {
  std::map<std::uint64_t, std::filesystem::path> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    auto s = shard_name(it->path().filename().string());
    if (s && s->first == stem) found.emplace(s->second, it->path());
  }
  if (found.size() > max_ranks) {
    why = "more rank files than limits::max_ranks";
    return {};
  }
  std::vector<std::filesystem::path> out;
  for (const auto& [r, p] : found) {
    if (r != out.size()) {
      gap = true;
      why = quote(stem + "-shard" + std::to_string(out.size()) + ".pt") + " is missing, but " + quote(p.filename().string()) + " exists";
      return {};
    }
    out.push_back(p);
  }
  if (out.empty()) why = "no " + quote(stem + "-shard0.pt");
  return out;
}

/// True when rank file `p` is a dict with `model` and fairscale's metadata (its pickle only).
inline bool holds_fsdp_metadata(const std::filesystem::path& p, const limits& lim) {
  try {
    const auto f = formats::detail::load_rank_file(p, read_mode::pread, lim.torch, "");
    if (!f.tree.is_dict()) return false;
    const Dict& d = f.tree.as_dict();
    return d.contains("model") && (d.contains("shard_metadata") || d.contains("fsdp_metadata"));
  } catch (const error&) {
    return false;
  }
}

}  // namespace detail

/// Finds the rank files of `path`: a folder with one `<stem>-shard<N>.pt` family, or any file of
/// one. Rank 0's pickle must hold `model` and `shard_metadata` / `fsdp_metadata`. Never throws.
inline detection detect(const std::filesystem::path& path, const limits& lim = {}) {
  detection d;
  std::error_code ec;
  std::filesystem::path dir;
  std::string stem;
  if (std::filesystem::is_directory(path, ec)) {
    dir = path;
    std::set<std::string> stems;
    for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (auto s = detail::shard_name(it->path().filename().string())) stems.insert(s->first);
    if (stems.empty()) {
      d.rule = "looked for fairscale FSDP rank files <stem>-shard<N>.pt: there are none";
      return d;
    }
    if (stems.size() > 1) {
      d.ambiguous = true;
      d.rule = std::to_string(stems.size()) + " families of <stem>-shard<N>.pt files (";
      for (const auto& s : stems) d.rule += (s == *stems.begin() ? "" : ", ") + quote(s);
      d.rule += "); name one of their files";
      return d;
    }
    stem = *stems.begin();
  } else {
    const auto s = detail::shard_name(path.filename().string());
    if (!s) return d;
    dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
    stem = s->first;
  }
  std::string why;
  d.files = detail::family(dir, stem, lim.max_ranks, why, d.missing_rank);
  if (d.files.empty()) {
    d.rule = "fairscale FSDP rank files " + quote(stem) + "-shard<N>.pt: " + why;
    return d;
  }
  if (!formats::detail::begins_like_torch_file(d.files[0]) || !detail::holds_fsdp_metadata(d.files[0], lim)) {
    d.rule = quote(d.files[0].filename().string()) + " is not a torch.save file holding model and shard_metadata / fsdp_metadata";
    d.files.clear();
    return d;
  }
  d.found = true;
  d.rule = "fairscale FSDP rank files " + quote(stem) + "-shard0.pt .. shard" + std::to_string(d.files.size() - 1) +
           ".pt with FSDP shard metadata";
  return d;
}

namespace detail {

using optim_shard::Access;

/// Rank files loaded and their metadata merged.
struct Ranks {
  std::vector<optim_shard::LoadedFile> files;
  std::vector<const Dict*> model;
  Layout layout;
  bool metaseq = false;
};

/// Reads every rank's metadata and checks it against rank 0's and against the chunk rule.
inline Ranks read_ranks(std::vector<optim_shard::LoadedFile> files, const limits& lim, optim_shard::SourceTable& table) {
  Ranks rk;
  rk.files = std::move(files);
  const auto W = static_cast<std::uint32_t>(rk.files.size());
  for (std::uint32_t r = 0; r < W; ++r) {
    const auto& f = rk.files[r];
    table.add(f.source, f.base);
    Access a{errors::fairscale_bad_file, formats::detail::file_ctx(f)};
    const Dict& top = a.dict(f.tree, "the rank file");
    rk.model.push_back(&a.dict(a.at(top, "model", "the rank file"), "model"));
    const Value* md = top.find("shard_metadata");
    if (r == 0) rk.metaseq = md != nullptr;
    if (!md) md = top.find("fsdp_metadata");
    if (!md) a.fail("has neither shard_metadata (metaseq) nor fsdp_metadata (fairseq)");
    // 0.3.7 stores flat parameters as `flat_param`, 0.3.8 as `flat_param_0`.
    std::string flat_key = "flat_param_0";
    if (const Value* units = md->is_dict() ? md->as_dict().find("param_metadata") : nullptr; units && units->is_sequence())
      for (const Value& u : units->as_list())
        if (u.is_dict() && u.as_dict().contains("is_flat") && u.as_dict().find("fsdp_path") && u.as_dict().find("fsdp_path")->is_string() &&
            rk.model.back()->contains(join(u.as_dict().find("fsdp_path")->as_string(), "flat_param")))
          flat_key = "flat_param";
    Access m{errors::fairscale_bad_metadata, a.where};
    Layout l = parse(*md, m, flat_key, lim.max_entries);
    if (r == 0) rk.layout = std::move(l);
    else merge_rank(rk.layout, l, r, a.where);
  }
  // Padding and shard lengths against FSDP's chunk rule; one dtype per backing tensor.
  for (const Backing& b : rk.layout.backing) {
    for (std::uint32_t r = 0; r < (b.no_broadcast ? 1U : W); ++r) {
      const std::string where = formats::detail::file_ctx(rk.files[r]) + ": " + quote(b.key);
      const auto [s, held] = b.no_broadcast ? std::make_pair(b.total, b.total) : chunk_rule(b.total, W, r);
      if (b.padding[r] != s - held)
        throw_error(errors::fairscale_padding, where,
                    "padding " + std::to_string(b.padding[r]) + ", FSDP's chunk rule gives " + std::to_string(s - held) + " (" +
                        std::to_string(b.total) + " elements on " + std::to_string(W) + " ranks)");
      const Value* v = rk.model[r]->find(b.key);
      if (!v) throw_error(errors::fairscale_missing_key, formats::detail::file_ctx(rk.files[r]), "model has no " + quote(b.key));
      if (!v->is_tensor() || v->as_tensor().rank() != 1 || static_cast<std::uint64_t>(v->as_tensor().numel()) != s)
        throw_error(errors::fairscale_padding, where,
                    (v->is_tensor() ? "has shape " + to_string(v->as_tensor().shape()) : std::string("is not a tensor")) +
                        ", FSDP's chunk rule gives a 1-d shard of " + std::to_string(s) + " elements");
      if (v->as_tensor().dtype() != rk.model[0]->find(b.key)->as_tensor().dtype())
        throw_error(errors::fairscale_dtype, where, "is " + std::string(name(v->as_tensor().dtype())) + ", rank 0's is " +
                                                        std::string(name(rk.model[0]->find(b.key)->as_tensor().dtype())));
    }
  }
  return rk;
}

/// The consolidated parameters, in metadata order; `names_of[k]` are backing tensor k's names.
struct Params {
  std::vector<TensorInfo> tensors;
  std::vector<std::vector<std::string>> names_of;
  std::vector<std::vector<std::vector<layout::FlatPiece>>> pieces;  ///< [backing][name]
};

inline Params consolidate(const Ranks& rk, optim_shard::SourceTable& table) {
  const auto W = static_cast<std::uint32_t>(rk.files.size());
  Params out;
  std::set<std::string> seen;
  for (const Backing& b : rk.layout.backing) {
    const std::string& upath = rk.layout.units[b.unit].path;
    std::vector<optim_shard::RankBuffer> bufs(b.no_broadcast ? 1U : W);
    const auto [s, held] = b.no_broadcast ? std::make_pair(b.total, b.total) : chunk_rule(b.total, W, 0);
    (void)held;
    for (std::uint32_t r = 0; r < bufs.size(); ++r)
      bufs[r].push_back(optim_shard::Segment{&rk.model[r]->find(b.key)->as_tensor(), s,
                                             formats::detail::file_ctx(rk.files[r]) + ": model[" + quote(b.key) + "]"});
    out.names_of.emplace_back();
    out.pieces.emplace_back();
    for (std::size_t j = 0; j < b.names.size(); ++j) {
      const std::string name = join(upath, b.names[j]);
      if (!seen.insert(name).second)
        throw_error(errors::fairscale_duplicate, "parameter " + quote(name), "is named by two flat parameters");
      auto pcs = pieces(b, j, W);
      TensorInfo t{name, bufs[0][0].view->dtype(), b.shapes[j], {}};
      t.chunks = optim_shard::place(pcs, bufs, table, "parameter " + quote(name));
      optim_shard::check_flat_cover(t.chunks, b.numels[j], errors::fairscale_numel, "parameter " + quote(name));
      out.tensors.push_back(std::move(t));
      out.names_of.back().push_back(name);
      out.pieces.back().push_back(std::move(pcs));
    }
  }
  return out;
}

/// The optimizer state of every rank merged per parameter name (see the top of this file).
inline void add_optimizer(const Ranks& rk, const Params& ps, optim_shard::SourceTable& table, optim_shard::SkeletonBuilder& sk,
                          std::vector<TensorInfo>& tensors) {
  const auto W = static_cast<std::uint32_t>(rk.files.size());
  std::vector<const Dict*> osd(W);
  for (std::uint32_t r = 0; r < W; ++r) {
    Access a{errors::fairscale_bad_optimizer, formats::detail::file_ctx(rk.files[r])};
    osd[r] = &a.dict(a.at(rk.files[r].tree.as_dict(), "last_optimizer_state", "the rank file"), "last_optimizer_state");
    (void)a.dict(a.at(*osd[r], "state", "last_optimizer_state"), "state");
    (void)a.list(a.at(*osd[r], "param_groups", "last_optimizer_state"), "param_groups");
    if (r == 0) continue;
    for (const auto& [k, v] : *osd[0]) {
      if (k.is_string() && k.as_string() == "state") continue;
      const Value* o = osd[r]->find(k);
      if (!o || !(*o == v))
        throw_error(errors::fairscale_optim_differs, a.where, "last_optimizer_state[" + quote(k.str()) + "] differs from rank 0's");
    }
  }
  Access a0{errors::fairscale_bad_optimizer, formats::detail::file_ctx(rk.files[0])};
  const List& groups = osd[0]->at("param_groups").as_list();
  std::vector<std::int64_t> ids;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const Value& id : a0.list(a0.at(a0.dict(groups[g], "a param group"), "params", "a param group"), "params"))
      ids.push_back(a0.integer(id, "a param id"));
  std::vector<std::int64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  bool ids_ok = sorted.size() == rk.layout.backing.size();
  for (std::size_t i = 0; ids_ok && i < sorted.size(); ++i) ids_ok = sorted[i] == static_cast<std::int64_t>(i);
  if (!ids_ok)
    a0.fail("param_groups list " + std::to_string(sorted.size()) + " ids for " + std::to_string(rk.layout.backing.size()) +
            " flat parameters (each of 0 .. " + std::to_string(rk.layout.backing.size()) + " - 1 once expected)");
  // One state family per backing tensor: each rank's state dict laid out like its shard.
  optim_shard::StateFamilies fams;
  std::vector<optim_shard::ParamState> params;
  for (std::size_t k = 0; k < rk.layout.backing.size(); ++k) {
    const Backing& b = rk.layout.backing[k];
    const std::uint64_t s = b.no_broadcast ? b.total : chunk_rule(b.total, W, 0).first;
    std::vector<std::vector<optim_shard::StateSegment>> fam(b.no_broadcast ? 1U : W);
    for (std::uint32_t r = 0; r < fam.size(); ++r) {
      Access a{errors::fairscale_bad_optimizer, formats::detail::file_ctx(rk.files[r])};
      const Value* st = osd[r]->at("state").as_dict().find(Key(static_cast<std::int64_t>(k)));
      fam[r].push_back(optim_shard::StateSegment{st ? &a.dict(*st, "state[" + std::to_string(k) + "]") : nullptr, s,
                                                 a.where + ": state[" + std::to_string(k) + "] (" + quote(b.key) + ")"});
    }
    for (std::size_t j = 0; j < b.names.size(); ++j)
      params.push_back(optim_shard::ParamState{ps.names_of[k][j], b.shapes[j], fams.size(), ps.pieces[k][j], 0});
    fams.push_back(std::move(fam));
  }
  for (std::uint32_t r = 0; r < W; ++r)
    for (const auto& [k, v] : osd[r]->at("state").as_dict())
      if (!k.is_int() || k.as_int() < 0 || static_cast<std::size_t>(k.as_int()) >= rk.layout.backing.size())
        throw_error(errors::fairscale_bad_optimizer, formats::detail::file_ctx(rk.files[r]), "state key " + k.str() + " is not a param id");
  optim_shard::MergedState merged = optim_shard::merge_state(params, fams, table);
  for (TensorInfo& t : merged.tensors) {
    const std::string rest = t.name.substr(std::string("optim.state.").size());
    const auto dot = rest.rfind('.');
    sk.tensor(std::vector<std::string>{"optim", "state", rest.substr(0, dot), rest.substr(dot + 1)}, t);
    tensors.push_back(std::move(t));
  }
  for (auto& [n, v] : merged.values) {
    const auto dot = n.rfind('.');
    sk.value(std::vector<std::string>{"optim", "state", n.substr(0, dot), n.substr(dot + 1)}, v);
  }
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& [k, v] : groups[g].as_dict()) {
      const std::vector<std::string> path{"optim", "param_groups", std::to_string(g), k.str()};
      if (k.is_string() && k.as_string() == "params") {
        List names;
        for (const Value& id : v.as_list())
          for (const auto& n : ps.names_of[static_cast<std::size_t>(id.as_int())]) names.emplace_back(n);
        sk.value(path, Value::list(std::move(names)));
      } else {
        sk.value(path, v);
      }
    }
  for (const auto& [k, v] : *osd[0])
    if (!(k.is_string() && (k.as_string() == "state" || k.as_string() == "param_groups")))
      sk.value(std::vector<std::string>{"optim", k.str()}, v);
}

}  // namespace detail

/// Describes loaded rank files (rank order). Format "fairscale_fsdp" (fairscale >= 0.3.9 metadata)
/// or "fairscale_fsdp_v03" (0.3.7 / 0.3.8); metadata "fairscale.world_size", "fairscale.writer".
inline ShardedCheckpoint describe(std::vector<optim_shard::LoadedFile> files, const options& opt = {}) {
  using namespace detail;
  if (files.empty()) throw_error(errors::fairscale_not_found, "fairscale checkpoint", "no rank file");
  if (files.size() > opt.limits.max_ranks) throw_error(errors::fairscale_limit, "fairscale checkpoint", "more ranks than limits::max_ranks");
  optim_shard::SourceTable table;
  const Ranks rk = read_ranks(std::move(files), opt.limits, table);
  Params ps = consolidate(rk, table);
  optim_shard::SkeletonBuilder sk;
  for (const TensorInfo& t : ps.tensors) sk.tensor(std::vector<std::string>{t.name}, t);
  // Ties of every unit, paths relative to the unit; a tie of a tie resolves to the stored tensor.
  std::set<std::string> stored;
  for (const TensorInfo& t : ps.tensors) stored.insert(t.name);
  std::map<std::string, std::string> alias;
  for (const Unit& u : rk.layout.units)
    for (const auto& [src, dst] : u.ties) {
      const std::string s = join(u.path, src), d = join(u.path, dst);
      const std::string where = "FSDP unit " + quote(u.path) + ": shared_param_info (" + quote(src) + ", " + quote(dst) + ")";
      std::string target = s;
      if (auto it = alias.find(s); it != alias.end()) target = it->second;
      if (!stored.count(target)) throw_error(errors::fairscale_bad_tie, where, quote(s) + " is not a consolidated parameter");
      if (stored.count(d) || alias.count(d)) throw_error(errors::fairscale_bad_tie, where, quote(d) + " is already a parameter");
      alias.emplace(d, target);
      sk.alias(std::vector<std::string>{d}, target);
    }
  std::vector<TensorInfo> tensors = std::move(ps.tensors);
  for (const std::string& b : rk.layout.buffers) {
    const Value* v = rk.model[0]->find(b);
    if (!v || !v->is_tensor())
      throw_error(errors::fairscale_missing_key, formats::detail::file_ctx(rk.files[0]), "buffer " + quote(b) + " is not a tensor of model");
    if (stored.count(b) || alias.count(b)) throw_error(errors::fairscale_duplicate, "buffer " + quote(b), "is also a parameter");
    TensorInfo t{b, v->as_tensor().dtype(), v->as_tensor().shape(), {}};
    if (v->as_tensor().numel() > 0) t.chunks.push_back(optim_shard::whole_chunk(v->as_tensor(), table, "buffer " + quote(b)));
    sk.tensor(std::vector<std::string>{b}, t);
    tensors.push_back(std::move(t));
  }
  if (opt.with_optimizer) add_optimizer(rk, ps, table, sk, tensors);
  ShardedCheckpoint ck;
  ck.format = rk.layout.old_schema ? "fairscale_fsdp_v03" : "fairscale_fsdp";
  ck.tensors = std::move(tensors);
  ck.skeleton = sk.build();
  ck.sources = table.take();
  ck.metadata["fairscale.world_size"] = std::to_string(rk.files.size());
  ck.metadata["fairscale.writer"] = rk.metaseq ? "metaseq (shard_metadata)" : "fairseq (fsdp_metadata)";
  return ck;
}

/// Finds (detect()) and describes the rank files of `path`.
inline ShardedCheckpoint describe(const std::filesystem::path& path, const options& opt = {}) {
  const detection d = detect(path, opt.limits);
  if (!d.found)
    throw_error(d.ambiguous ? errors::fairscale_ambiguous : d.missing_rank ? errors::fairscale_missing_rank : errors::fairscale_not_found,
                quote(path.string()), d.rule.empty() ? "is not a fairscale FSDP rank file" : d.rule);
  std::vector<optim_shard::LoadedFile> files;
  const std::string ctx = "fairscale checkpoint " + quote(d.files[0].parent_path().string());
  for (const auto& p : d.files) files.push_back(formats::detail::load_rank_file(p, opt.mode, opt.limits.torch, ctx));
  return describe(std::move(files), opt);
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// fairscale FSDP rank files of fairseq and metaseq (`<stem>-shard<N>.pt`): consolidated weights,
/// ties and buffers, and on request the optimizer state.
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "fairscale"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "fairscale FSDP rank files"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    detection d = fairscale::detect(in.path(), opt.settings.get<options>().limits);
    if (d.found) return formats::Detection::match(std::move(d.rule));
    if (d.ambiguous || d.missing_rank) return formats::Detection::named_like(std::move(d.rule));
    return formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.mode = opt.mode;
    o.with_optimizer = o.with_optimizer || opt.with_optimizer;
    return fairscale::describe(in.path(), o);
  }
};

}  // namespace statedict::inline v0::fairscale
