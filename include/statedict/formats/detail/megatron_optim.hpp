// statedict: the optimizer state of Megatron-LM legacy checkpoints keyed by parameter name, each
// moment sharded like its parameter (formats/megatron.hpp is the public header).
// SPDX-License-Identifier: MIT
//
// Three forms (tests/python/layouts/megatron.md sections 2.7 and 2.8):
//   - FP32Optimizer: `optimizer` is the torch optimizer's state dict;
//   - Float16OptimizerWithFloat16Params: {'optimizer': torch state dict, 'fp32_from_fp16_params':
//     [[fp32 master per param] per group], 'grad_scaler': ...};
//   - DistributedOptimizer: {'optimizer': {'param_groups': [...]}} and, beside the rank file,
//     distrib_optim.pt: per model chunk one flat fp32 buffer of each of param / exp_avg /
//     exp_avg_sq, holding the chunk's parameters in reverse order, 64-aligned, in buckets, with
//     no names (param_and_grad_buffer.py _ParamAndGradBuffer; get_parameter_state_dp_zero).
// Which state belongs to which parameter follows from Megatron's rule for param groups
// (megatron/core/optimizer/__init__.py _get_param_groups): walking named_parameters() of every
// model chunk, a parameter goes to the group of (wd_mult, lr_mult, is_expert_parallel,
// is_decoupled_lr), wd_mult 0 for biases and 1-d parameters; groups in order of first appearance;
// torch numbers parameters group by group. Every count, shape and wd_mult is checked against it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"
#include "../optim_shard.hpp"
#include "megatron_legacy.hpp"
#include "megatron_place.hpp"

namespace statedict::inline v0::megatron::detail {

/// A param group of the merged state: its hyperparameters (first rank's) and its parameters.
struct merged_group {
  double wd_mult = 1.0;
  Dict hyper;
  std::vector<std::string> params;  ///< canonical names, model order (set at the end)
  std::set<std::string> members;
};

/// Optimizer state being assembled over all rank files.
struct optim_read {
  /// `optimizer.state.<param>.<key>` -> TP pieces (sharded like the parameter).
  std::map<std::string, assembly> tensors;
  /// param -> its state keys, in order of first appearance.
  std::map<std::string, std::vector<std::string>> keys;
  /// `<param>.<key>` -> a non-tensor state value (apex's int step), equal on every TP rank.
  std::map<std::string, Value> values;
  std::vector<merged_group> groups;
  std::deque<Value> views;  ///< tensors made here (slices of distrib_optim.pt buffers)
  std::deque<optim_shard::LoadedFile> files;  ///< the distrib_optim.pt files the views point into
};

/// wd_mult of a parameter by Megatron's rule.
inline double wd_mult_of(const param_ref& p) { return (formats::detail::ends_with(p.name, ".bias") || p.view->rank() == 1) ? 0.0 : 1.0; }

/// The params of a rank file in named_parameters() order, grouped by the rule: (wd_mult, indices).
inline std::vector<std::pair<double, std::vector<std::size_t>>> rule_groups(const std::vector<param_ref>& params) {
  std::vector<std::pair<double, std::vector<std::size_t>>> g;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double wd = wd_mult_of(params[i]);
    auto it = std::find_if(g.begin(), g.end(), [&](const auto& x) { return x.first == wd; });
    if (it == g.end()) {
      g.emplace_back(wd, std::vector<std::size_t>{});
      it = std::prev(g.end());
    }
    it->second.push_back(i);
  }
  return g;
}

/// Records one rank's saved param groups against the rule; merges their hyperparameters.
inline void merge_groups(optim_read& o, const List& saved, const std::vector<std::pair<double, std::vector<std::size_t>>>& rule,
                         const std::vector<param_ref>& params, const rank_file& rf) {
  if (saved.size() != rule.size())
    throw_error(errors::mg_optimizer, rf.where, std::to_string(saved.size()) + " param groups, Megatron's grouping of this rank's " +
                                                    std::to_string(params.size()) + " parameters gives " + std::to_string(rule.size()));
  for (std::size_t g = 0; g < saved.size(); ++g) {
    if (!saved[g].is_dict()) throw_error(errors::mg_optimizer, rf.where, "param_groups[" + std::to_string(g) + "] is not a dict");
    const Dict& gd = saved[g].as_dict();
    if (const Value* wd = gd.find("wd_mult"); wd && (!(wd->is_double() || wd->is_int()) || wd->as_number() != rule[g].first))
      throw_error(errors::mg_optimizer, rf.where, "param_groups[" + std::to_string(g) + "].wd_mult is " + optim_shard::detail::value_text(*wd) +
                                                      ", Megatron's grouping puts its parameters under wd_mult " + std::to_string(rule[g].first));
    Dict hyper;
    for (const auto& [k, v] : gd)
      if (!(k.is_string() && k.as_string() == "params")) hyper.set(k, v);
    auto it = std::find_if(o.groups.begin(), o.groups.end(), [&](const merged_group& m) { return m.wd_mult == rule[g].first; });
    if (it == o.groups.end()) {
      o.groups.push_back(merged_group{rule[g].first, std::move(hyper), {}, {}});
      it = std::prev(o.groups.end());
    } else if (!(it->hyper == hyper)) {
      for (const auto& [k, v] : it->hyper) {
        const Value* x = hyper.find(k);
        if (!x || !(*x == v))
          throw_error(errors::mg_groups_differ, rf.where, "param group of wd_mult " + std::to_string(rule[g].first) + ": " + k.str() + " is " +
                                                              (x ? optim_shard::detail::value_text(*x) : "missing") + ", an earlier rank has " +
                                                              optim_shard::detail::value_text(v));
      }
      throw_error(errors::mg_groups_differ, rf.where, "param group of wd_mult " + std::to_string(rule[g].first) + " has keys an earlier rank's lacks");
    }
    for (std::size_t i : rule[g].second)
      if (!params[i].head) it->members.insert(params[i].name);
  }
}

/// Adds TP rank `tp`'s value of state `key` of parameter `p` (its rule: `how`). A tensor value
/// must outlive the description (a view inside a loaded file, or in optim_read::views).
inline void add_state(optim_read& o, const param_ref& p, const std::optional<split>& how, const std::string& key, const Value& v,
                      std::uint64_t tp, std::uint64_t tps, const std::string& where, std::uint32_t source) {
  auto& keys = o.keys[p.name];
  if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(key);
  if (!v.is_tensor()) {
    const std::string vn = p.name + "." + key;
    auto [it, fresh] = o.values.try_emplace(vn, v);
    if (!fresh && !(it->second == v))
      throw_error(errors::mg_state_differs, "optimizer state " + quote(vn),
                  "is " + optim_shard::detail::value_text(v) + " in " + where + ", another TP rank has " + optim_shard::detail::value_text(it->second));
    return;
  }
  const TensorView& t = v.as_tensor();
  const bool scalar = t.rank() == 0;
  if (!scalar && t.shape() != p.view->shape())
    throw_error(errors::mg_optimizer, where, "state " + quote(key) + " of " + quote(p.name) + " has shape " + to_string(t.shape()) + ", the parameter " +
                                                 to_string(p.view->shape()));
  const std::string tn = "optimizer.state." + p.name + "." + key;
  auto [it, fresh] = o.tensors.try_emplace(tn);
  assembly& a = it->second;
  if (fresh) {
    a.name = tn;
    a.how = scalar ? std::optional<split>(split::replicated) : how;
    a.compare = scalar;  // constant state (step): equal on every TP rank
    a.ranks.assign(tps, piece{});
  }
  if (p.head) {
    if (a.copies.empty()) a.copies.assign(1, std::vector<piece>(tps));
    a.copies[0][tp] = piece{&t, where, source};
  } else {
    if (a.ranks[tp].view) throw_error(errors::mg_duplicate, "optimizer state " + quote(tn), "given twice for TP rank " + std::to_string(tp));
    a.ranks[tp] = piece{&t, where, source};
  }
}

/// The plain (FP32 / Float16) optimizer of one rank file.
inline void read_plain(optim_read& o, const rank_file& rf, const Value& opt, const std::vector<param_ref>& params,
                       const std::map<std::string, assembly>& model, std::uint64_t tps) {
  using optim_shard::Access;
  const Access a{errors::mg_optimizer, rf.where};
  const Dict& od = a.dict(opt, "optimizer");
  const Dict* inner = &od;
  const List* fp32 = nullptr;
  if (!od.contains("param_groups")) {
    inner = &a.dict(a.at(od, "optimizer", "optimizer"), "optimizer.optimizer");
    if (const Value* f = Access::opt(od, "fp32_from_fp16_params")) fp32 = &a.list(*f, "optimizer.fp32_from_fp16_params");
  }
  const List& saved = a.list(a.at(*inner, "param_groups", "the optimizer"), "param_groups");
  const Dict& state = a.dict(a.at(*inner, "state", "the optimizer"), "state");
  const auto rule = rule_groups(params);
  merge_groups(o, saved, rule, params, rf);
  if (fp32 && fp32->size() != rule.size())
    a.fail("fp32_from_fp16_params has " + std::to_string(fp32->size()) + " groups, the param groups " + std::to_string(rule.size()));
  std::set<std::int64_t> used;
  for (std::size_t g = 0; g < rule.size(); ++g) {
    const List& ids = a.list(a.at(saved[g].as_dict(), "params", "param group"), "params");
    if (ids.size() != rule[g].second.size())
      a.fail("param_groups[" + std::to_string(g) + "] lists " + std::to_string(ids.size()) + " params, Megatron's grouping gives " +
             std::to_string(rule[g].second.size()));
    const List* masters = fp32 ? &a.list((*fp32)[g], "fp32_from_fp16_params group") : nullptr;
    if (masters && masters->size() != ids.size()) a.fail("fp32_from_fp16_params[" + std::to_string(g) + "] has the wrong length");
    for (std::size_t j = 0; j < ids.size(); ++j) {
      const param_ref& p = params[rule[g].second[j]];
      const auto& how = model.at(p.name).how;
      const std::int64_t id = a.integer(ids[j], "a param id");
      if (!used.insert(id).second) a.fail("param id " + std::to_string(id) + " is listed twice");
      if (const Value* st = state.find(Key(id))) {
        const Dict& sd = a.dict(*st, "state[" + std::to_string(id) + "]");
        for (const char* k : {"exp_avg", "exp_avg_sq"})
          if (const Value* v = sd.find(k)) add_state(o, p, how, k, *v, rf.dir.tp, tps, rf.where, rf.source);
        if (masters) add_state(o, p, how, "fp32_param", (*masters)[j], rf.dir.tp, tps, rf.where, rf.source);
        for (const auto& [k, v] : sd)
          if (k.is_string() && k.as_string() != "exp_avg" && k.as_string() != "exp_avg_sq")
            add_state(o, p, how, k.as_string(), v, rf.dir.tp, tps, rf.where, rf.source);
      } else if (masters) {
        add_state(o, p, how, "fp32_param", (*masters)[j], rf.dir.tp, tps, rf.where, rf.source);
      }
    }
  }
  for (const auto& [k, v] : state)
    if (!k.is_int() || !used.count(k.as_int())) a.fail("state key " + k.str() + " is not a param id of param_groups");
}

// ---------------------------------------------------------------------------------------------
// distrib_optim.pt

/// One parameter's place in a distrib_optim.pt buffer.
struct buffer_slot {
  std::size_t param = 0;    ///< index into the chunk's params
  std::uint64_t offset = 0;  ///< in the saved (bucket-concatenated) buffer
};

inline std::uint64_t round_up(std::uint64_t x, std::uint64_t d) { return checked_mul((x + d - 1) / d, d, "buffer offset"); }

/// The grad-buffer layout (param_and_grad_buffer.py): params in reverse order, each start padded
/// to 64 elements; a shared embedding closes the current bucket and gets one of its own; a bucket
/// also closes at `bucket_size` elements; bucket ends padded to lcm(dp, 128). Returns the slots in
/// the saved buffer (the buckets' unpadded ranges concatenated) and its length.
inline std::pair<std::vector<buffer_slot>, std::uint64_t> buffer_layout(const std::vector<std::uint64_t>& numels, const std::vector<bool>& shared,
                                                                        std::uint64_t dp, std::optional<std::uint64_t> bucket_size) {
  const std::uint64_t lcm = std::lcm(dp, std::uint64_t{128});
  std::vector<buffer_slot> slots;
  std::uint64_t idx = 0, start = 0, saved = 0;
  bool any = false;
  auto close = [&](std::uint64_t end) {
    saved = checked_add(saved, end - start, "buffer size");
    idx = round_up(end, lcm);
    start = idx;
    any = false;
  };
  for (std::size_t k = numels.size(); k-- > 0;) {
    idx = round_up(idx, 64);
    if (shared[k] && any) close(idx);
    slots.push_back(buffer_slot{k, saved + (idx - start)});
    idx = checked_add(idx, numels[k], "buffer size");
    any = true;
    if (shared[k] || (bucket_size && idx - start >= *bucket_size)) close(idx);
  }
  if (any) saved = checked_add(saved, idx - start, "buffer size");
  return {std::move(slots), saved};
}

/// The one (dtype pair) entry of buffer `v`'s dict in distrib_optim.pt.
inline const Dict& buffer_entry(const Value& v, const std::string& where, std::uint64_t idx) {
  const std::string w = "buffer " + std::to_string(idx);
  const List* items = nullptr;
  if (po::is_class(v, {"builtins.dict", "collections.OrderedDict"}) && v.as_object().args.empty()) items = &v.as_object().items;
  if (!items) throw_error(errors::mg_distrib_optim, where, w + " is " + po::kind_of(v) + ", expected a dict keyed by (param dtype, grad dtype)");
  if (items->size() != 1)
    throw_error(errors::mg_unsupported, where, w + " holds " + std::to_string(items->size()) + " dtype buffers; one (all parameters of one dtype) is supported");
  const Value& kv = (*items)[0];
  if (!kv.is_tuple() || kv.as_list().size() != 2 || !kv.as_list()[1].is_dict())
    throw_error(errors::mg_distrib_optim, where, w + ": expected a (dtypes, dict) item");
  return kv.as_list()[1].as_dict();
}

/// The distributed optimizer's state of one rank file (its distrib_optim.pt).
inline void read_distrib(optim_read& o, const rank_file& rf, const optim_shard::LoadedFile& dist, std::uint32_t source, const facts& f,
                         const std::map<std::string, assembly>& model, std::uint64_t tps) {
  using optim_shard::Access;
  const std::string where = "file " + quote(dist.name);
  const Access a{errors::mg_distrib_optim, where};
  const Dict& d = a.dict(dist.tree, "distrib_optim.pt");
  const Value* coalesced = d.find("buckets_coalesced");
  if (!coalesced || !coalesced->is_bool() || !coalesced->as_bool())
    throw_error(errors::mg_unsupported, where, "has no buckets_coalesced: True (the per-bucket layout before Megatron-core 0.7 is not supported)");
  const bool tied_pp = !f.untied && f.pp > 1;
  for (std::uint64_t v = 0; v < rf.chunks.size(); ++v) {
    const auto& params = rf.chunks[v];
    const Dict& e = buffer_entry(a.at(d, Key(static_cast<std::int64_t>(v)), "distrib_optim.pt"), where, v);
    const bool pre = rf.dir.pp == 0 && v == 0, post = rf.dir.pp + 1 == f.pp && v + 1 == rf.chunks.size();
    std::vector<std::uint64_t> numels;
    std::vector<bool> shared;
    for (const param_ref& p : params) {
      numels.push_back(p.view->numel());
      shared.push_back(tied_pp && formats::detail::ends_with(p.name, "word_embeddings.weight") && (p.head || (pre && !post)));
    }
    const auto [slots, total] = buffer_layout(numels, shared, f.dp, rf.dir.pp == 0 && v == 0 ? f.bucket_size : std::nullopt);
    const std::int64_t stored = a.integer(a.at(e, "numel_unpadded", "buffer"), "numel_unpadded");
    if (stored < 0 || static_cast<std::uint64_t>(stored) != total)
      a.fail("buffer " + std::to_string(v) + ": numel_unpadded " + std::to_string(stored) + ", the layout rebuilt from the model chunk's " +
             std::to_string(params.size()) + " parameters gives " + std::to_string(total));
    for (const auto& [file_key, key] : {std::pair<const char*, const char*>{"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}, {"param", "fp32_param"}}) {
      const Value* bv = e.find(file_key);
      if (!bv) {
        if (std::string_view(file_key) == "param") a.fail("buffer " + std::to_string(v) + " has no 'param'");
        continue;
      }
      const TensorView& flat = a.tensor(*bv, file_key);
      if (flat.rank() != 1 || flat.numel() != total)
        a.fail("buffer " + std::to_string(v) + " " + file_key + " has shape " + to_string(flat.shape()) + ", expected [" + std::to_string(total) + "]");
      for (const buffer_slot& s : slots) {
        const param_ref& p = params[s.param];
        const Value& sl = o.views.emplace_back(flat.narrow(0, static_cast<dim_t>(s.offset), static_cast<dim_t>(p.view->numel())).reshape(p.view->shape()));
        add_state(o, p, model.at(p.name).how, key, sl, rf.dir.tp, tps, where, source);
      }
    }
  }
}

}  // namespace statedict::inline v0::megatron::detail
