// statedict: Megatron-LM checkpoints: the legacy per-rank layout (tensor- and pipeline-parallel
// rank files) and Megatron-core's torch_dist, read as one merged model; the legacy layout written
// for any TP / PP size.
// SPDX-License-Identifier: MIT
//
//   megatron::detect(dir)            -> detection (legacy or torch_dist, the rule that matched)
//   megatron::describe(dir, options) -> ShardedCheckpoint: the full model, each tensor's chunks
//                                       pointing into the rank files (placements encode the TP
//                                       split; PP stages renumbered to global layers); with
//                                       `with_optimizer` the optimizer state keyed by name
//   megatron::write(ck, dir, write_options{tp, pp})
//                                    -> the legacy layout for that TP / PP, through the planner
//
// The TP split of each tensor comes from a rule table of name patterns (megatron::default_rules(),
// overridable: options::rules); a tensor no rule names must be equal on every TP rank (compared),
// otherwise describe() fails naming it. Facts and sources: tests/python/layouts/megatron.md;
// the user page: docs/formats/megatron.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/value.hpp"
#include "../io/file.hpp"
#include "../shard/checkpoint.hpp"
#include "detail/files.hpp"
#include "detail/safetensors_write.hpp"
#include "detail/megatron_dist.hpp"
#include "detail/megatron_legacy.hpp"
#include "detail/megatron_optim.hpp"
#include "detail/megatron_place.hpp"
#include "detail/megatron_rules.hpp"
#include "detail/megatron_write.hpp"
#include "format.hpp"
#include "optim_shard.hpp"

namespace statedict::inline v0::megatron {

/// How describe() reads a checkpoint.
struct options {
  /// Also the optimizer state: `optimizer.state.<param>.<key>` (exp_avg, exp_avg_sq, fp32_param,
  /// step; sharded like the parameter) and `optimizer.param_groups`.
  bool with_optimizer = false;
  /// Cut the vocabulary-parallel tensors (word embeddings, output layer, their optimizer state) to
  /// this many rows; unset: the padded rows as stored.
  std::optional<std::uint64_t> true_vocab_size;
  /// Partition rules tried before the built-in ones (default_rules()), first match wins.
  std::vector<rule> rules;
  /// Use default_rules() after `rules`.
  bool default_rules = true;
  read_mode mode = read_mode::mmap;
  megatron::limits limits{};
};

/// What detect() found.
struct detection {
  bool found = false;
  /// Not readable, but named like a Megatron checkpoint (a tracker file): describe() says why.
  bool damaged = false;
  std::string rule;
  bool torch_dist = false;
  std::filesystem::path iteration_dir;
  /// The iteration latest_checkpointed_iteration.txt names (none: `release`, or no tracker).
  std::optional<std::uint64_t> iteration;
};

/// Looks at `dir`: a tracker file (latest_checkpointed_iteration.txt) naming an iteration folder,
/// or an iteration folder itself, holding metadata.json with sharded_backend torch_dist, or
/// mp_rank_* folders with model_optim_rng.pt. Never throws.
inline detection detect(const std::filesystem::path& dir, const limits& lim = {}) {
  detection d;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    d.rule = "not a directory";
    return d;
  }
  detail::iteration_dir it;
  try {
    it = detail::find_iteration(dir, lim);
  } catch (const error& e) {
    d.damaged = true;
    d.rule = "latest_checkpointed_iteration.txt is unreadable: " + e.detail();
    return d;
  }
  if (!std::filesystem::is_directory(it.dir, ec)) {
    d.damaged = it.tracker;
    d.rule = "latest_checkpointed_iteration.txt names " + quote(it.dir.filename().string()) + ", which is not a folder";
    return d;
  }
  d.iteration_dir = it.dir;
  d.iteration = it.iteration;
  if (auto b = detail::sharded_backend(it.dir, lim)) {
    d.found = *b == "torch_dist";
    d.damaged = !d.found;
    d.torch_dist = true;
    d.rule = "megatron: metadata.json with sharded_backend " + quote(*b) + (d.found ? " (Megatron-core distributed checkpoint)" : "");
    return d;
  }
  std::size_t ranks = 0;
  for (std::filesystem::directory_iterator i(it.dir, ec), end; !ec && i != end && ranks < 2; i.increment(ec))
    if (detail::parse_rank_dir(i->path().filename().string()) && std::filesystem::is_regular_file(i->path() / "model_optim_rng.pt", ec)) ++ranks;
  if (ranks == 0) {
    d.damaged = it.tracker;
    d.rule = "looked for Megatron-LM mp_rank_*/model_optim_rng.pt folders or a torch_dist metadata.json in " + quote(it.dir.string()) + ": none";
    return d;
  }
  d.found = true;
  d.rule = std::string("megatron: mp_rank_* folders with model_optim_rng.pt") + (it.tracker ? " (latest_checkpointed_iteration.txt names " +
                                                                                                      quote(it.dir.filename().string()) + ")"
                                                                                                : "");
  return d;
}

namespace detail {

/// The keys of a rank file that are per-rank state, not carried: model chunks, optimizer, RNG.
inline bool per_rank_key(const std::string& k) {
  if (k == "model" || k == "optimizer" || k == "rng_state") return true;
  if (k.rfind("model", 0) == 0 && k.size() > 5 && k.find_first_not_of("0123456789", 5) == std::string::npos) return true;
  for (const char* r : {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"})
    if (k == r) return true;
  return false;
}

/// The files of a legacy checkpoint, loaded; facts checked the same on every rank.
inline std::vector<rank_file> load_legacy(const detection& d, const options& opt, facts& f) {
  const limits& lim = opt.limits;
  const std::vector<rank_dir> dirs = rank_dirs(d.iteration_dir, lim);
  if (dirs.empty()) throw_error(errors::mg_rank_dirs, "directory " + quote(d.iteration_dir.string()), "has no mp_rank_* folder");
  const std::string context = "Megatron checkpoint " + quote(d.iteration_dir.string());
  std::vector<rank_file> files;
  files.reserve(dirs.size());
  for (const rank_dir& rd : dirs) {
    const auto p = rd.path / "model_optim_rng.pt";
    files.push_back(rank_file{rd, formats::detail::load_rank_file(p, opt.mode, lim.torch, context), "file " + quote(p.string()),
                              static_cast<std::uint32_t>(files.size()), {}});
  }
  f = read_facts(args_of(files[0]), checkpoint_version(files[0]), lim, files[0].where);
  if (args_reader(args_of(files[0]), files[0].where).count("expert_model_parallel_size", lim.max_ranks, "max_ranks").value_or(1) > 1)
    throw_error(errors::mg_unsupported, files[0].where, "args.expert_model_parallel_size > 1: expert parallelism is not supported");
  check_rank_set(dirs, f, d.iteration_dir);
  const auto it0 = file_iteration(files[0]);
  if (d.iteration && it0 && static_cast<std::uint64_t>(*it0) != *d.iteration)
    throw_error(errors::mg_bad_tracker, files[0].where, "records iteration " + std::to_string(*it0) + ", latest_checkpointed_iteration.txt names " +
                                                            std::to_string(*d.iteration));
  for (const rank_file& rf : files) {
    const facts g = read_facts(args_of(rf), checkpoint_version(rf), lim, rf.where);
    if (g.tp != f.tp || g.pp != f.pp || g.vpp != f.vpp || g.num_layers != f.num_layers || g.heads != f.heads || g.groups != f.groups ||
        g.kv_channels != f.kv_channels || g.swiglu != f.swiglu || g.untied != f.untied || g.checkpoint_version != f.checkpoint_version ||
        g.distributed_optimizer != f.distributed_optimizer)
      throw_error(errors::mg_bad_args, rf.where, "args or checkpoint_version differ from " + files[0].where + "'s (parallel sizes or model shape)");
    if (file_iteration(rf) != it0) throw_error(errors::mg_bad_rank_file, rf.where, "records another iteration than " + files[0].where);
  }
  return files;
}

/// The optimizer state of every rank file (those that saved one).
inline optim_read read_optimizers(const std::vector<rank_file>& files, const facts& f, const model_read& m, const options& opt) {
  optim_read o;
  std::size_t with = 0;
  for (const rank_file& rf : files) {
    const Value* opt_v = top_dict(rf).find("optimizer");
    if (!opt_v || opt_v->is_none()) continue;
    ++with;
    std::vector<param_ref> params;
    for (const auto& c : rf.chunks) params.insert(params.end(), c.begin(), c.end());
    if (opt_v->is_sequence()) throw_error(errors::mg_unsupported, rf.where, "optimizer is a list (ChainedOptimizer): not supported");
    if (!f.distributed_optimizer) {
      read_plain(o, rf, *opt_v, params, m.tensors, f.tp);
      continue;
    }
    const optim_shard::Access a{errors::mg_optimizer, rf.where};
    const Dict& inner = a.dict(a.at(a.dict(*opt_v, "optimizer"), "optimizer", "optimizer"), "optimizer.optimizer");
    merge_groups(o, a.list(a.at(inner, "param_groups", "optimizer.optimizer"), "param_groups"), rule_groups(params), params, rf);
    const auto p = rf.dir.path / "distrib_optim.pt";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec))
      throw_error(errors::mg_distrib_optim, "directory " + quote(rf.dir.path.string()), "has no distrib_optim.pt (args.use_distributed_optimizer is set)");
    o.files.push_back(formats::detail::load_rank_file(p, opt.mode, opt.limits.torch, "Megatron checkpoint " + quote(rf.dir.path.string())));
    read_distrib(o, rf, o.files.back(), static_cast<std::uint32_t>(files.size() + o.files.size() - 1), f, m.tensors, f.tp);
  }
  if (with != 0 && with != files.size())
    throw_error(errors::mg_optimizer, files[0].where, "only " + std::to_string(with) + " of " + std::to_string(files.size()) + " rank files hold optimizer state");
  return o;
}

/// Adds the merged optimizer state to the description (after the model).
inline void add_optimizer(ShardedCheckpoint& ck, optim_shard::SkeletonBuilder& skel, optim_read& o, const std::vector<std::string>& order,
                          place_context& c) {
  for (const std::string& name : order) {
    const auto k = o.keys.find(name);
    if (k == o.keys.end()) continue;
    for (const std::string& key : k->second) {
      const std::vector<std::string> path{"optimizer", "state", name, key};
      if (auto it = o.tensors.find("optimizer.state." + name + "." + key); it != o.tensors.end()) {
        TensorInfo t = place(it->second, c);
        skel.tensor(path, t);
        ck.tensors.push_back(std::move(t));
      } else if (auto v = o.values.find(name + "." + key); v != o.values.end()) {
        skel.value(path, v->second);
      }
    }
  }
  for (std::size_t g = 0; g < o.groups.size(); ++g) {
    const std::string gs = std::to_string(g);
    for (const auto& [k, v] : o.groups[g].hyper) skel.value(std::vector<std::string>{"optimizer", "param_groups", gs, k.str()}, v);
    List names;
    for (const std::string& n : order)
      if (o.groups[g].members.count(n)) names.emplace_back(n);
    skel.value(std::vector<std::string>{"optimizer", "param_groups", gs, "params"}, Value::list(std::move(names)));
  }
}

inline ShardedCheckpoint describe_legacy(const detection& d, const options& opt) {
  facts f;
  std::vector<rank_file> files = load_legacy(d, opt, f);
  model_read m = read_models(files, f, opt.rules, opt.default_rules, opt.limits);
  optim_read o;
  if (opt.with_optimizer) o = read_optimizers(files, f, m, opt);
  optim_shard::SourceTable table;
  for (const rank_file& rf : files) table.add(rf.file.source, rf.file.base);
  for (const auto& df : o.files) table.add(df.source, df.base);
  place_context c{&f, opt.true_vocab_size, opt.limits.max_chunks, 0, opt.limits.max_compare_bytes, &table, {}};
  for (const auto& s : table.sources()) c.bases.emplace_back(nullptr, s->size());
  for (std::size_t i = 0; i < files.size(); ++i) c.bases[i].first = files[i].file.base ? files[i].file.base : files[i].file.source->data();
  for (std::size_t i = 0; i < o.files.size(); ++i)
    c.bases[files.size() + i].first = o.files[i].base ? o.files[i].base : o.files[i].source->data();
  ShardedCheckpoint ck;
  optim_shard::SkeletonBuilder skel;
  const std::vector<std::string> order = canonical_order(m);
  bool model_done = false;
  for (const auto& [key, v] : top_dict(files[0])) {
    const std::string k = key.str();
    if (!model_done && (k == "model" || k == "model0")) {
      model_done = true;
      for (const std::string& n : order) {
        TensorInfo t = place(m.tensors.at(n), c);
        skel.tensor(tree_path(n), t);
        ck.tensors.push_back(std::move(t));
      }
    } else if (k == "optimizer") {
      if (opt.with_optimizer) add_optimizer(ck, skel, o, order, c);
    } else if (k == "checkpoint_version") {
      skel.value(std::vector<std::string>{k}, Value(3.0));  // the QKV rows are described in the >= 2.0 order
    } else if (!per_rank_key(k) && !holds_tensor(v)) {
      skel.value(std::vector<std::string>{k}, v);
    }
  }
  ck.format = "megatron";
  ck.skeleton = skel.build();
  ck.sources = table.take();
  ck.metadata["megatron.layout"] = "legacy";
  ck.metadata["megatron.tensor_model_parallel_size"] = std::to_string(f.tp);
  ck.metadata["megatron.pipeline_model_parallel_size"] = std::to_string(f.pp);
  if (f.virtual_pp) ck.metadata["megatron.virtual_pipeline_model_parallel_size"] = std::to_string(f.vpp);
  ck.metadata["megatron.checkpoint_version"] = version_text(f.checkpoint_version);
  if (f.padded_vocab_size) ck.metadata["megatron.padded_vocab_size"] = std::to_string(*f.padded_vocab_size);
  if (opt.true_vocab_size) ck.metadata["megatron.true_vocab_size"] = std::to_string(*opt.true_vocab_size);
  return ck;
}

/// Cuts the rows of a vocabulary tensor's chunks to `rows`.
inline void clip_vocab(TensorInfo& t, std::uint64_t rows) {
  if (t.shape.empty() || rows > static_cast<std::uint64_t>(t.shape[0]))
    throw_error(errors::mg_vocab, "tensor " + quote(t.name), "the true vocabulary size " + std::to_string(rows) + " exceeds its " +
                                                                 (t.shape.empty() ? std::string("0") : std::to_string(t.shape[0])) + " rows");
  t.shape[0] = static_cast<dim_t>(rows);
  std::vector<Chunk> kept;
  for (Chunk& ch : t.chunks) {
    Box& b = std::get<Box>(ch.region);
    const auto off = static_cast<std::uint64_t>(b.offsets[0]);
    if (off >= rows) continue;
    b.sizes[0] = static_cast<dim_t>(std::min<std::uint64_t>(static_cast<std::uint64_t>(b.sizes[0]), rows - off));
    kept.push_back(std::move(ch));  // the rows kept are the box's first ones: same strides
  }
  t.chunks = std::move(kept);
}

inline ShardedCheckpoint describe_dist(const detection& d, const options& opt) {
  const limits& lim = opt.limits;
  const std::filesystem::path& dir = d.iteration_dir;
  std::string cls;
  const dcp::Metadata md = dist_metadata(dir, lim, cls);
  const std::string mdfile = (dir / ".metadata").string();
  dcp::detail::Files files{dir, opt.mode, lim.dcp.max_files, {}, {}};
  // The common state: common.pt, or the common_state byte item ([that dict]).
  Value common;
  std::optional<optim_shard::LoadedFile> common_file;
  std::error_code ec;
  const bool common_pt = std::filesystem::is_regular_file(dir / "common.pt", ec);
  if (common_pt) {
    common_file = formats::detail::load_rank_file(dir / "common.pt", opt.mode, lim.torch, "Megatron checkpoint " + quote(dir.string()));
    common = common_file->tree;
  } else {
    for (const dcp::Entry& e : md.entries) {
      if (e.tensor || e.fqn.rfind("common_state/", 0) != 0) continue;
      const dcp::StorageInfo& si = *md.find(dcp::StorageIndex{e.fqn, std::nullopt});
      const std::string iw = "file " + quote(mdfile) + ": key " + quote(e.fqn);
      common = common_item(dcp::detail::load_item(files.item(files.open(si.relative_path, iw), si, iw), lim.dcp, iw).value, lim, iw, common_file);
    }
  }
  if (!common.is_dict()) throw_error(errors::mg_torch_dist, "directory " + quote(dir.string()), "has neither common.pt nor a common_state item");
  std::optional<facts> f;
  if (const Value* a = common.as_dict().find("args")) {
    const Value* cv = common.as_dict().find("checkpoint_version");
    f = read_facts(*a, cv && (cv->is_double() || cv->is_int()) ? cv->as_number() : 3.0, lim, "common state of " + quote(dir.string()));
  }
  dist_read r;
  std::map<std::string, std::vector<TensorInfo>> optim;  // state key -> per-layer tensors (model names)
  std::uint64_t count = 0;                               // optimizer tensors read
  for (const dcp::Entry& e : md.entries) {
    if (!e.tensor) continue;
    if (e.fqn.rfind("optimizer.", 0) == 0) {
      if (!opt.with_optimizer) continue;
      const auto ok = optimizer_key(e.fqn);
      if (!ok)
        throw_error(errors::mg_unsupported, "file " + quote(mdfile) + ": key " + quote(e.fqn),
                    "is distributed-optimizer state in a flattened or per-bucket form: not supported (only optimizer.state.<moment>.<model key>)");
      for (TensorInfo& t : per_layer(dist_tensor(e, md, files, lim, mdfile), ok->first, r, lim)) {
        optim[ok->second].push_back(std::move(t));
        ++count;
      }
    } else {
      for (TensorInfo& t : per_layer(dist_tensor(e, md, files, lim, mdfile), e.fqn, r, lim)) r.model.push_back(std::move(t));
    }
    if (r.model.size() + count > lim.max_tensors)
      throw_error(errors::mg_limit, "file " + quote(mdfile), "more tensors than limits::max_tensors");
  }
  if (f && r.stacked && r.layers != f->num_layers)
    throw_error(errors::mg_torch_dist, "file " + quote(mdfile), "stacks " + std::to_string(r.layers) + " layers, args.num_layers is " + std::to_string(f->num_layers));
  join_pairs(r.model, r);
  order_model(r.model);
  std::map<std::string, std::size_t> model_at;
  for (std::size_t i = 0; i < r.model.size(); ++i) model_at.emplace(r.model[i].name, i);
  const auto trim = [&](TensorInfo& t, const std::string& model_name) {
    if (opt.true_vocab_size && rule_for(model_name, opt.rules, opt.default_rules) == split::vocab) clip_vocab(t, *opt.true_vocab_size);
  };
  ShardedCheckpoint ck;
  optim_shard::SkeletonBuilder skel;
  for (const auto& [k, v] : common.as_dict())
    if (k.str() != "optimizer" && !holds_tensor(v)) skel.value(std::vector<std::string>{k.str()}, v);
  for (TensorInfo& t : r.model) {
    trim(t, t.name);
    skel.tensor(std::vector<std::string>{t.name}, t);
  }
  std::vector<TensorInfo> states;
  std::vector<std::pair<std::size_t, std::size_t>> rank;  // (model index, key index)
  std::size_t key_index = 0;
  for (const char* key : {"exp_avg", "exp_avg_sq", "fp32_param"}) {
    auto it = optim.find(key);
    if (it != optim.end()) {
      join_pairs(it->second, r);
      for (TensorInfo& t : it->second) {
        const auto m = model_at.find(t.name);
        if (m == model_at.end() || r.model[m->second].shape != t.shape)
          throw_error(errors::mg_unsupported, "file " + quote(mdfile) + ": optimizer state " + quote(std::string(key) + " of " + t.name),
                      "has no model tensor of its shape (a reformulated distributed-optimizer layout): not supported");
        trim(t, t.name);
        t.name = "optimizer.state." + t.name + "." + key;
        rank.emplace_back(m->second, key_index);
        states.push_back(std::move(t));
      }
    }
    ++key_index;
  }
  std::vector<std::size_t> idx(states.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return rank[a] < rank[b]; });
  ck.tensors = std::move(r.model);
  for (std::size_t i : idx) {
    TensorInfo& t = states[i];
    const std::string rest = t.name.substr(16);  // after "optimizer.state."
    const auto dot = rest.rfind('.');
    skel.tensor(std::vector<std::string>{"optimizer", "state", rest.substr(0, dot), rest.substr(dot + 1)}, t);
    ck.tensors.push_back(std::move(t));
  }
  if (opt.with_optimizer)
    if (const Value* od = common.as_dict().find("optimizer"); od && od->is_dict())
      if (const Value* in = od->as_dict().find("optimizer"); in && in->is_dict())
        if (const Value* pg = in->as_dict().find("param_groups"); pg && !holds_tensor(*pg)) skel.value(std::vector<std::string>{"optimizer", "param_groups"}, *pg);
  ck.format = "megatron_torch_dist";
  ck.skeleton = skel.build();
  ck.sources = std::move(files.sources);
  ck.metadata["megatron.layout"] = "torch_dist";
  ck.metadata["megatron.layers"] = r.stacked ? "stacked" : "per_layer";
  ck.metadata["megatron.metadata_class"] = cls;
  ck.metadata["megatron.common"] = common_pt ? "common.pt" : "common_state";
  if (opt.true_vocab_size) ck.metadata["megatron.true_vocab_size"] = std::to_string(*opt.true_vocab_size);
  return ck;
}

}  // namespace detail

/// Describes the Megatron-LM checkpoint at `dir` (see the top of this file). Throws
/// errors::mg_not_found with what was looked for when `dir` is not one.
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  const detection d = detect(dir, opt.limits);
  if (!d.found) {
    if (d.damaged && !d.torch_dist) (void)detail::find_iteration(dir, opt.limits);  // the tracker's own error, if that is it
    if (d.torch_dist) throw_error(errors::mg_unsupported, "directory " + quote(d.iteration_dir.string()), d.rule + ": only torch_dist is supported");
    throw_error(errors::mg_not_found, "directory " + quote(dir.string()), d.rule);
  }
  return d.torch_dist ? detail::describe_dist(d, opt) : detail::describe_legacy(d, opt);
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// Megatron-LM: legacy per-rank checkpoints and Megatron-core torch_dist, read merged; the legacy
/// layout written for `write_options::tp` x `pp` (settings `megatron::write_options`).
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "megatron"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "Megatron-LM"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options& opt) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    detection d = megatron::detect(in.path(), opt.settings.get<options>().limits);
    if (d.found) return formats::Detection::match(std::move(d.rule));
    return d.damaged ? formats::Detection::named_like(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.with_optimizer = opt.with_optimizer;
    o.mode = opt.mode;
    return megatron::describe(in.path(), o);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  [[nodiscard]] formats::output_claim claims_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    const write_options& w = opt.settings.get<write_options>();
    return w.tp || w.pp || w.vpp ? formats::output_claim::by_options : formats::output_claim::none;
  }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    formats::detail::refuse_option(opt.max_shard_size.has_value(), "--max-shard-size", "a Megatron-LM checkpoint", "its files are one per rank");
    formats::detail::refuse_option(opt.world_size.has_value(), "--world-size", "a Megatron-LM checkpoint", "its ranks are --tp x --pp");
    formats::detail::refuse_option(opt.part.has_value() || opt.index_only, "--part", "a Megatron-LM checkpoint", "it is written whole");
    check(opt.settings.get<write_options>());
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    write_options o = opt.settings.get<write_options>();
    o.exec = opt.exec;
    o.plan = opt.plan;
    return write(ck, out, o);
  }
};

}  // namespace statedict::inline v0::megatron
