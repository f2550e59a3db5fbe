// statedict: writing DeepSpeed ZeRO checkpoints for any data-parallel world size (formats/deepspeed.hpp
// is the public header): the model-states and optim-states files `engine.save_checkpoint` writes
// for M ranks, from a consolidated checkpoint with its optimizer state keyed by name.
// SPDX-License-Identifier: MIT
//
// Every rank file is a torch.save file planned up front (io/torch_save.hpp) around placeholder
// tensors; each placeholder is a run of flat pieces of the logical tensors (a parameter's
// partition, a group's flat partition of moments), so the whole checkpoint is one Destination that
// make_plan + execute fill from the source in bounded memory. Padding is not covered by any piece
// and is written as zeros, as the engine writes it after a resharded load. The folder appears
// atomically, `latest` last.
//
// The layout rules are the reader's (shard/layout.hpp zero12_partitions, zero3_partitioned_param_info),
// applied for the new world size exactly as the engine computes them (DeepSpeed 0.16.5
// runtime/zero/stage_1_and_2.py __init__, _round_robin_reorder, _get_groups_without_padding,
// _create_param_mapping; runtime/bf16_optimizer.py _setup_for_real_optimizer, state_dict;
// runtime/zero/stage3.py _create_fp16_sub_groups, _rigid_state_dict; runtime/engine.py
// _save_checkpoint, _save_zero_checkpoint, _get_zero_param_shapes). docs/formats/deepspeed.md
// ("Writing") says what each file holds and where each value comes from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../exec/sink.hpp"
#include "../../io/torch_save.hpp"
#include "../../io/zip.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/layout.hpp"
#include "../transform_regex.hpp"
#include "write_files.hpp"

namespace statedict::inline v0::deepspeed::detail {

/// One parameter the optimizer trains, and where its tensors are in the source.
struct w_param {
  std::string name;
  std::size_t tensor = 0;  ///< index of its fp32 master in the source
  shape_t shape;
  std::uint64_t numel = 0;
  std::map<std::string, std::size_t> state;  ///< optimizer state key -> source tensor index
  std::map<std::string, Value> values;       ///< state that is not a tensor (an int step of older torch)
};

/// One optimizer param group: its hyperparameters (everything but `params`) and parameters.
struct w_group {
  Value hyper;                     ///< a Dict
  std::vector<std::size_t> params;  ///< indices into write_input::params, in the engine's original order
  std::vector<std::string> keys;    ///< state keys with a tensor per parameter (exp_avg, ...), in order
  std::vector<std::string> scalar_keys;  ///< 0-dim state (step), the same for the whole group
  std::map<std::string, Value> values;   ///< state that is not a tensor, the same for the whole group
};

struct write_input {
  std::shared_ptr<torch::detail::reservation> space;
  Value root;  ///< the source tree, tensors as placeholders (never read)
  std::vector<w_param> params;
  std::vector<w_group> groups;
  std::vector<std::size_t> frozen;   ///< source tensor indices, in module order
  std::vector<std::size_t> buffers;  ///< source tensor indices, in module order
  std::vector<std::pair<std::string, std::string>> aliases;  ///< (alias, owner)
  std::vector<std::pair<std::string, dtype>> module;  ///< module entries in order, with their dtype
  std::vector<std::string> buffer_names;
  dtype model = dtype::F32;  ///< the engine's module dtype
  Dict carried;              ///< model-states values carried over (engine counters, scheduler, client state, config)
  Dict optimizer;            ///< loss scaler and flags of the ZeRO optimizer
  std::string version = "0.16.5";
  bool round_robin = false;
  std::uint64_t sub_group_size = 1000000000;
  std::uint32_t source_world = 1;
  std::string tag;
};

/// The value at `key` of a dict, or nullptr.
inline const Value* child(const Dict& d, std::string_view key) { return d.find(Key(std::string(key))); }
inline const Value* child(const Value& v, std::string_view key) { return v.is_dict() ? child(v.as_dict(), key) : nullptr; }

/// The items of a container the skeleton builder made (a dict keyed "0", "1", ...) or a list.
inline std::vector<const Value*> items(const Value& v) {
  std::vector<const Value*> out;
  if (v.is_sequence()) {
    for (const Value& x : v.as_list()) out.push_back(&x);
  } else if (v.is_dict()) {
    for (const auto& [k, x] : v.as_dict()) out.push_back(&x);
  }
  return out;
}

/// DeepSpeed's _round_robin_reorder: element i goes to bucket i % W, buckets concatenated.
inline std::vector<std::size_t> round_robin_order(std::size_t n, std::uint64_t w) {
  std::vector<std::size_t> out;
  out.reserve(n);
  for (std::uint64_t b = 0; b < w; ++b)
    for (std::size_t i = static_cast<std::size_t>(b); i < n; i += static_cast<std::size_t>(w)) out.push_back(i);
  return out;
}

/// The param group of a freshly constructed torch AdamW / Adam: its hyperparameters in the order
/// torch stores them (the constructor's defaults), with the user's values.
inline Value fresh_hyper(const fresh_optimizer& f) {
  const bool adamw = f.type == fresh_optimizer::kind::adamw;
  Dict h;
  h.set("lr", f.lr);
  h.set("betas", Value::tuple(List{Value(f.beta1), Value(f.beta2)}));
  h.set("eps", f.eps);
  if (f.weight_decay) h.set("weight_decay", *f.weight_decay);
  else if (adamw) h.set("weight_decay", 1e-2);
  else h.set("weight_decay", 0);
  h.set("amsgrad", f.amsgrad);
  h.set("maximize", f.maximize);
  h.set("foreach", Value());
  h.set("capturable", false);
  h.set("differentiable", false);
  h.set("fused", Value());
  h.set("decoupled_weight_decay", adamw);
  return Value(std::move(h));
}

/// A checkpoint without optimizer state, written with a fresh optimizer (write_options::fresh):
/// every floating tensor is a trained parameter unless a pattern names it frozen or a buffer;
/// tensors that are not floating are buffers. One param group in module order, no state: what
/// the engine saves before its first step (DeepSpeed 0.16.5 keeps torch's lazy state: neither
/// stage_1_and_2.py nor stage3.py initialize_optimizer_states steps the optimizer).
inline void prepare_fresh(const ShardedCheckpoint& ck, const fresh_optimizer& f, bool model_given, write_input& in) {
  struct pattern {
    std::string flag, text;
    std::regex re;
    bool used = false;
  };
  std::vector<pattern> frozen, buffers;
  for (const auto& t : f.frozen) frozen.push_back({"--frozen", t, formats::detail::compile_regex(t), false});
  for (const auto& t : f.buffers) buffers.push_back({"--buffer", t, formats::detail::compile_regex(t), false});
  auto named = [](std::vector<pattern>& ps, const std::string& n) {
    bool any = false;
    for (auto& p : ps)
      if (std::regex_match(n, p.re)) any = p.used = true;
    return any;
  };
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) index.emplace(ck.tensors[i].name, i);
  const std::set<std::string> engine_buffers(in.buffer_names.begin(), in.buffer_names.end());
  const bool engine_module = !in.module.empty();
  std::vector<std::pair<std::string, std::size_t>> order;  // module entries: (name, tensor index or npos for a tie)
  std::set<std::string> listed;
  for (const auto& t : statedict::detail::list_tensorish(ck.skeleton.json())) {
    const bool tensor = t.kind == statedict::detail::snode::tensor;
    const std::string& n = tensor ? t.target : t.name;
    if (n.rfind("optim.", 0) == 0)
      throw_error(errors::ds_write_input, "tensor " + quote(n),
                  "is optimizer state, but the checkpoint has no param groups (optim.param_groups) to say whose");
    if (!listed.insert(n).second) continue;
    if (!tensor) {
      order.emplace_back(n, std::string::npos);
      continue;
    }
    const auto it = index.find(n);
    if (it == index.end()) throw_error(errors::ds_write_input, "tensor " + quote(n), "is in the checkpoint's tree but not in its tensor list");
    const std::size_t i = it->second;
    order.emplace_back(n, i);
    const TensorInfo& ti = ck.tensors[i];
    const bool is_frozen = named(frozen, n);
    const bool is_buffer = named(buffers, n) || engine_buffers.count(n) || !is_floating(ti.dtype);
    if (is_frozen && is_buffer)
      throw_error(errors::ds_write_option, "tensor " + quote(n),
                  is_floating(ti.dtype) ? "is named both frozen (--frozen) and a buffer (--buffer)"
                                        : "is " + std::string(statedict::name(ti.dtype)) + ", so a buffer, and cannot be frozen (--frozen): only floating tensors are parameters");
    if (is_buffer) {
      in.buffers.push_back(i);
      if (!engine_buffers.count(n)) in.buffer_names.push_back(n);
    } else if (is_frozen) {
      in.frozen.push_back(i);
    } else {
      in.params.push_back(w_param{n, i, ti.shape, numel(ti.shape), {}, {}});
    }
  }
  for (const auto* ps : {&frozen, &buffers})
    for (const auto& p : *ps)
      if (!p.used) throw_error(errors::ds_write_option, p.flag + " " + quote(p.text), "matches no tensor of the checkpoint (a pattern matches whole names)");
  if (in.params.empty())
    throw_error(errors::ds_write_input, "the checkpoint", "has no parameter to train: every tensor is frozen (--frozen) or a buffer");
  // The engine's module dtype: the trained parameters' own, as the engine takes the module it is given.
  if (!model_given) {
    in.model = ck.tensors[in.params[0].tensor].dtype;
    for (const w_param& p : in.params)
      if (ck.tensors[p.tensor].dtype != in.model)
        throw_error(errors::ds_write_input, "parameter " + quote(p.name),
                    "is " + std::string(statedict::name(ck.tensors[p.tensor].dtype)) + " while " + quote(in.params[0].name) + " is " +
                        std::string(statedict::name(in.model)) + ": the engine's module has one dtype (read the input with --dtype)");
  }
  if (!engine_module)
    for (const auto& [n, i] : order)
      in.module.emplace_back(n, i != std::string::npos && !is_floating(ck.tensors[i].dtype) ? ck.tensors[i].dtype : in.model);
  w_group g;
  g.hyper = fresh_hyper(f);
  for (std::size_t k = 0; k < in.params.size(); ++k) g.params.push_back(k);
  in.groups.push_back(std::move(g));
}

/// Reads what the writer needs from `ck` (see deepspeed::write).
inline write_input prepare(const ShardedCheckpoint& ck, const write_options& o) {
  write_input in;
  in.root = formats::detail::source_tree(ck, in.space);
  const Value* optim = child(in.root, "optim");
  const Value* pgs = optim ? child(*optim, "param_groups") : nullptr;
  if (o.fresh && o.universal)
    throw_error(errors::ds_write_option, "--fresh-optimizer",
                "writes the rank files (--to deepspeed), for any world size; a universal checkpoint of an optimizer that "
                "has not stepped is not what ds_to_universal.py makes of the engine's files");
  if (pgs && o.fresh)
    throw_error(errors::ds_write_option, "--fresh-optimizer",
                "the input has optimizer state (optim.param_groups), which is written as it is; to start a fresh optimizer, "
                "read the input without it (without --with-optimizer, or with --drop 'optim\\..*')");
  if (!pgs && !o.fresh)
    throw_error(errors::ds_write_input, "the checkpoint",
                "has no optimizer state (optim.param_groups): read a checkpoint that has one with --with-optimizer; for "
                "weights only, --fresh-optimizer adamw:lr=...,betas=.../...,eps=...,weight_decay=... writes the state of a "
                "freshly constructed optimizer (deepspeed::write_options::fresh)");
  const Value* states = optim ? child(*optim, "state") : nullptr;
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) index.emplace(ck.tensors[i].name, i);
  for (const auto& [a, t] : skeleton_aliases(ck.skeleton)) in.aliases.emplace_back(a, t);
  std::set<std::string> alias_names;
  for (const auto& [a, t] : in.aliases) alias_names.insert(a);

  // The engine's own facts, when the input is a DeepSpeed checkpoint (deepspeed.engine metadata).
  Value engine;
  if (auto it = ck.metadata.find("deepspeed.engine"); it != ck.metadata.end()) {
    nlohmann::json j = nlohmann::json::parse(it->second, nullptr, false);
    if (j.is_discarded()) throw_error(errors::ds_write_input, "metadata deepspeed.engine", "is not JSON");
    engine = unflatten(NamedTensors{}, j);
  }
  if (const Value* v = child(engine, "model_states"); v && v->is_dict()) in.carried = v->as_dict();
  if (const Value* v = child(engine, "optimizer"); v && v->is_dict()) in.optimizer = v->as_dict();
  if (const Value* v = child(engine, "round_robin"); v && v->is_bool()) in.round_robin = v->as_bool();
  if (const Value* v = child(engine, "sub_group_size"); v && v->is_int() && v->as_int() > 0)
    in.sub_group_size = static_cast<std::uint64_t>(v->as_int());
  if (const Value* v = child(in.carried, "ds_version"); v && v->is_string()) in.version = v->as_string();
  if (auto it = ck.metadata.find("deepspeed.world_size"); it != ck.metadata.end())
    in.source_world = static_cast<std::uint32_t>(std::stoul("0" + it->second));
  if (auto it = ck.metadata.find("deepspeed.tag"); it != ck.metadata.end()) in.tag = it->second;
  bool model_given = true;
  if (o.model_dtype) {
    in.model = *o.model_dtype;
  } else if (const Value* v = child(engine, "model_dtype"); v && v->is_string()) {
    in.model = dtype_from_name(v->as_string()).value_or(dtype::F32);
  } else {
    model_given = false;
  }
  if (!is_floating(in.model))
    throw_error(errors::ds_write_option, "model dtype", std::string(name(in.model)) + " is not a floating dtype");
  if (o.fresh) {
    if (const Value* v = child(engine, "buffer_names"); v && v->is_sequence())
      for (const Value& n : v->as_list())
        if (n.is_string()) in.buffer_names.push_back(n.as_string());
    if (const Value* v = child(engine, "module"); v && v->is_sequence())
      for (const Value& e : v->as_list())
        if (e.is_sequence() && e.as_list().size() == 2 && e.as_list()[0].is_string() && e.as_list()[1].is_string())
          in.module.emplace_back(e.as_list()[0].as_string(), dtype_from_name(e.as_list()[1].as_string()).value_or(in.model));
    prepare_fresh(ck, *o.fresh, model_given, in);
    return in;
  }

  // Param groups and the optimizer state of each parameter.
  std::set<std::string> trained;
  for (const Value* g : items(*pgs)) {
    w_group grp;
    Dict hyper;
    const Value* names = nullptr;
    if (g->is_dict())
      for (const auto& [k, v] : g->as_dict()) {
        if (k.is_string() && k.as_string() == "params") names = &v;
        else hyper.set(k, v);
      }
    if (!names) throw_error(errors::ds_write_input, "optim.param_groups", "a group has no params");
    grp.hyper = Value(std::move(hyper));
    std::vector<std::size_t> listed;
    for (const Value* n : items(*names)) {
      if (!n->is_string())
        throw_error(errors::ds_write_input, "optim.param_groups", "lists a parameter that is not a name (read the input with its names, as statedict reads DeepSpeed, FSDP and DCP optimizer state)");
      const std::string& name = n->as_string();
      auto it = index.find(name);
      if (it == index.end()) {
        // A model saved under a key of its own ({"model": ..., "optim": ...}, as DCP checkpoints
        // of get_state_dict are): its tensors carry a prefix the optimizer's names do not.
        std::string hint;
        for (const TensorInfo& t : ck.tensors)
          if (t.name.size() > name.size() && t.name.compare(t.name.size() - name.size(), name.size(), name) == 0 &&
              t.name[t.name.size() - name.size() - 1] == '.' && t.name.rfind("optim.", 0) != 0) {
            hint = "; the checkpoint has " + quote(t.name) + " (--strip-prefix " + t.name.substr(0, t.name.size() - name.size()) + ")";
            break;
          }
        throw_error(errors::ds_write_input, "parameter " + quote(name), "is listed by optim.param_groups but is not a tensor of the checkpoint" + hint);
      }
      if (!trained.insert(name).second) throw_error(errors::ds_write_input, "parameter " + quote(name), "is listed by two param groups");
      const TensorInfo& t = ck.tensors[it->second];
      if (!is_floating(t.dtype)) throw_error(errors::ds_write_input, "parameter " + quote(name), "is " + std::string(statedict::name(t.dtype)) + ", not floating");
      w_param p{name, it->second, t.shape, numel(t.shape), {}, {}};
      if (const Value* st = states ? child(*states, name) : nullptr; st && st->is_dict())
        for (const auto& [k, v] : st->as_dict()) {
          const std::string key = k.str();
          if (!v.is_tensor()) {
            bool tensors = false;
            visit(v, [&](const Path&, const Value& x) { tensors = tensors || x.is_tensor(); });
            if (tensors)
              throw_error(errors::ds_write_input, "optim.state." + name + "." + key, "holds tensors inside a container; a flat partition holds tensors or plain values");
            p.values.emplace(key, v);
            continue;
          }
          auto si = index.find("optim.state." + name + "." + key);
          if (si == index.end())
            throw_error(errors::ds_write_input, "optim.state." + name + "." + key, "is a tensor the checkpoint does not list");
          const TensorInfo& s = ck.tensors[si->second];
          if (!s.shape.empty() && s.shape != t.shape)
            throw_error(errors::ds_write_input, "optim.state." + name + "." + key,
                        "has shape " + to_string(s.shape) + "; element-wise state has the parameter's shape " + to_string(t.shape) + ", step-like state none");
          p.state.emplace(key, si->second);
        }
      listed.push_back(in.params.size());
      in.params.push_back(std::move(p));
    }
    if (listed.empty()) continue;  // the engine drops groups with no trainable parameter
    // The group's state keys: every parameter has the same ones (or none: a fresh optimizer).
    const w_param& first = in.params[listed[0]];
    for (const auto& [k, i] : first.state) (ck.tensors[i].shape.empty() ? grp.scalar_keys : grp.keys).push_back(k);
    grp.values = first.values;
    for (std::size_t i : listed) {
      const w_param& p = in.params[i];
      auto same_keys = [](const auto& a, const auto& b) {
        return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) { return x.first == y.first; });
      };
      if (!same_keys(p.state, first.state) || !same_keys(p.values, first.values))
        throw_error(errors::ds_write_input, "parameter " + quote(p.name),
                    "has other optimizer state keys than " + quote(first.name) + " of the same group (a flat partition holds one set)");
      if (p.values != first.values)
        throw_error(errors::ds_write_input, "parameter " + quote(p.name),
                    "has other non-tensor optimizer state than " + quote(first.name) + " of the same group (a flat partition holds one value)");
    }
    // The order the engine flattens the group in is its original order; a round-robin checkpoint
    // lists it in the round-robin order of its own world size, which is undone here.
    if (in.round_robin && in.source_world > 1) {
      const auto rr = round_robin_order(listed.size(), in.source_world);
      std::vector<std::size_t> original(listed.size());
      for (std::size_t k = 0; k < rr.size(); ++k) original[rr[k]] = listed[k];
      listed = std::move(original);
    }
    grp.params = std::move(listed);
    in.groups.push_back(std::move(grp));
  }
  if (in.groups.empty()) throw_error(errors::ds_write_input, "optim.param_groups", "no group lists a parameter");

  // Buffers and frozen parameters: the other model tensors.
  if (const Value* v = child(engine, "buffer_names"); v && v->is_sequence())
    for (const Value& n : v->as_list())
      if (n.is_string()) in.buffer_names.push_back(n.as_string());
  const std::set<std::string> buffer_set(in.buffer_names.begin(), in.buffer_names.end());
  if (const Value* v = child(engine, "module"); v && v->is_sequence())
    for (const Value& e : v->as_list())
      if (e.is_sequence() && e.as_list().size() == 2 && e.as_list()[0].is_string() && e.as_list()[1].is_string())
        in.module.emplace_back(e.as_list()[0].as_string(), dtype_from_name(e.as_list()[1].as_string()).value_or(in.model));
  std::set<std::string> in_module;
  for (const auto& [n, d] : in.module) in_module.insert(n);
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    const TensorInfo& t = ck.tensors[i];
    if (t.name.rfind("optim.", 0) == 0 || trained.count(t.name)) continue;
    if (buffer_set.count(t.name)) {
      in.buffers.push_back(i);
    } else {
      if (!is_floating(t.dtype)) throw_error(errors::ds_write_input, "tensor " + quote(t.name), "is neither a trained parameter, a buffer (buffer_names) nor a floating frozen parameter");
      in.frozen.push_back(i);
    }
    if (!in_module.count(t.name)) in.module.emplace_back(t.name, t.converted_from.value_or(in.model));
  }
  for (const auto& p : in.params)
    if (!in_module.count(p.name)) in.module.emplace_back(p.name, in.model);
  for (const auto& [a, t] : in.aliases)
    if (!in_module.count(a)) in.module.emplace_back(a, in.model);
  // Every module entry the engine had must be there to write (strict load_state_dict).
  for (const auto& [n, d] : in.module)
    if (!index.count(n) && !alias_names.count(n))
      throw_error(errors::ds_write_input, "module entry " + quote(n),
                  "is not in the checkpoint: DeepSpeed's module must be complete for the engine's strict load (stage 1 keeps frozen "
                  "parameters only in module: read it with deepspeed::options::frozen_from_module, --frozen-from-module)");
  return in;
}

/// A rank file being planned: its tree, and which source pieces each placeholder holds.
struct rank_file {
  std::string name;
  Value tree;
  struct piece {
    std::size_t tensor;      ///< source tensor index
    std::variant<Box, FlatRange> region;
    const std::byte* data;   ///< the placeholder
    std::uint64_t element;   ///< first element of the piece in the placeholder
    dtype stored;
  };
  std::vector<piece> pieces;
  torch::SavePlan plan;
};

/// Placeholders in a reservation: one contiguous tensor each, 64-byte aligned.
struct arena {
  std::shared_ptr<torch::detail::reservation> space;
  std::uint64_t capacity = 0, used = 0;
  TensorView make(dtype d, shape_t shape) {
    const std::uint64_t size = checked_add(byte_size(shape, itemsize(d)), 63, "placeholder") / 64 * 64 + 64;
    if (size > capacity - used) throw_error(errors::ds_write_input, "the checkpoint", "its rank files outgrow the space reserved for their placeholders");
    const std::byte* at = space->base() + used;
    used += size;
    return TensorView::contiguous(d, std::move(shape), at, space);
  }
};

inline Value torch_size(const shape_t& s) {
  List dims;
  for (dim_t d : s) dims.emplace_back(static_cast<std::int64_t>(d));
  Object o{"torch", "Size", object_build::reduce, {Value::tuple(std::move(dims))}, {}, {}};
  return Value(std::move(o));
}

inline Value zero_stage_enum(int stage) {
  Object o{"deepspeed.runtime.zero.config", "ZeroStageEnum", object_build::reduce, {Value(stage)}, {}, {}};
  return Value(std::move(o));
}

inline Value fragment_address(std::uint64_t n, std::uint64_t start) {
  Object o{"deepspeed.utils.tensor_fragment", "fragment_address", object_build::newobj, {}, {}, {}};
  o.state.emplace_back(Dict{{"numel", static_cast<std::int64_t>(n)}, {"start", static_cast<std::int64_t>(start)}});
  return Value(std::move(o));
}

inline Value default_loss_scaler() {
  Object o{"deepspeed.runtime.fp16.loss_scaler", "LossScaler", object_build::newobj, {}, {}, {}};
  o.state.emplace_back(Dict{{"cur_scale", 1.0}, {"dynamic", false}});
  return Value(std::move(o));
}

/// The classes a DeepSpeed checkpoint pickles and the engine needs as themselves.
inline std::vector<std::string> engine_classes() {
  return {"deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
          "deepspeed.utils.tensor_fragment.fragment_address", "deepspeed.runtime.zero.config.ZeroStageEnum", "builtins.set"};
}

inline Value carried_or(const Dict& d, std::string_view key, Value fallback) {
  if (const Value* v = d.find(Key(std::string(key)))) return *v;
  return fallback;
}

/// Plans the rank files: their trees with placeholders, and the pieces each placeholder holds.
struct planner {
  const ShardedCheckpoint& ck;
  const write_input& in;
  std::uint32_t M;
  int stage;
  bool bf16_optimizer;
  arena space;
  bool universal = false;  ///< DeepSpeed's universal checkpoint instead of the rank files
  std::vector<rank_file> files;

  rank_file* cur = nullptr;

  /// A placeholder of `shape` in `stored`, filled from pieces added with piece().
  Value holder(dtype stored, shape_t shape) { return Value(space.make(stored, std::move(shape))); }
  void piece(const Value& h, std::size_t tensor, std::variant<Box, FlatRange> region, std::uint64_t element) {
    cur->pieces.push_back(rank_file::piece{tensor, std::move(region), h.as_tensor().data(), element, h.as_tensor().dtype()});
  }
  /// A whole source tensor as a placeholder of its own, in `stored`.
  Value whole(std::size_t tensor, dtype stored) {
    const TensorInfo& t = ck.tensors[tensor];
    Value h = holder(stored, t.shape);
    if (numel(t.shape) > 0) piece(h, tensor, full_box(t.shape), 0);
    return h;
  }
  const TensorInfo& info(std::size_t i) const { return ck.tensors[i]; }
  dtype state_dtype(std::size_t g, const std::string& key) const {
    return info(in.params[in.groups[g].params[0]].state.at(key)).dtype;
  }
  /// The scalar state of a group (step): its first parameter's, as a placeholder.
  Value scalar(std::size_t g, const std::string& key) { return whole(in.params[in.groups[g].params[0]].state.at(key), state_dtype(g, key)); }
  /// Placeholders of `n` elements for group g's element-wise state keys (exp_avg, ...).
  std::map<std::string, Value> moments_of(std::size_t g, std::uint64_t n) {
    std::map<std::string, Value> m;
    for (const auto& k : in.groups[g].keys) m.emplace(k, holder(state_dtype(g, k), shape_t{static_cast<dim_t>(n)}));
    return m;
  }
  /// The torch optimizer's state entry `id` for one flat of group g: its plain values, 0-dim state
  /// and moments; none for a group without state (a fresh optimizer).
  void add_state(Dict& state, std::int64_t id, std::size_t g, const std::map<std::string, Value>& moments) {
    const w_group& grp = in.groups[g];
    if (grp.keys.empty() && grp.scalar_keys.empty() && grp.values.empty()) return;
    Dict st;
    for (const auto& [k, v] : grp.values) st.set(k, v);
    for (const auto& k : grp.scalar_keys) st.set(k, scalar(g, k));
    for (const auto& k : grp.keys) st.set(k, moments.at(k));
    state.set(id, Value(std::move(st)));
  }

  /// The module: every entry in the engine's order, trained parameters from their fp32 masters in
  /// the module dtype (as the engine's bit16 copies are), ties sharing their owner's tensor.
  Value module(bool placeholders_for_params) {
    std::unordered_map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < ck.tensors.size(); ++i) index.emplace(ck.tensors[i].name, i);
    std::map<std::string, std::string> alias_of(in.aliases.begin(), in.aliases.end());
    Dict m;
    std::map<std::string, Value> made;
    for (const auto& [n, d] : in.module) {
      if (alias_of.count(n)) continue;
      const std::size_t i = index.at(n);
      // Stage 3 keeps every parameter (trained or frozen) as an empty tensor in the module.
      const bool buffer = std::find(in.buffers.begin(), in.buffers.end(), i) != in.buffers.end();
      made.emplace(n, placeholders_for_params && !buffer ? holder(d, shape_t{0}) : whole(i, d));
    }
    for (const auto& [n, d] : in.module) {
      auto a = alias_of.find(n);
      const std::string& owner = a == alias_of.end() ? n : a->second;
      auto it = made.find(owner);
      if (it == made.end()) throw_error(errors::ds_write_input, "tied name " + quote(n), "names " + quote(owner) + ", which is not in the module");
      m.set(n, it->second);
    }
    return Value(std::move(m));
  }

  Dict model_states_head(Value module, Value param_shapes, bool frozen_keys, Value frozen_shapes, Value frozen_fragments, bool shared) {
    Dict top;
    top.set("module", std::move(module));
    List bn;
    for (const auto& n : in.buffer_names) bn.emplace_back(n);
    top.set("buffer_names", Value::list(std::move(bn)));
    top.set("optimizer", Value());
    top.set("param_shapes", std::move(param_shapes));
    top.set("frozen_param_shapes", frozen_keys ? std::move(frozen_shapes) : Value());
    Dict sp;
    if (shared)
      for (const auto& [a, t] : in.aliases) sp.set(a, t);
    top.set("shared_params", Value(std::move(sp)));
    top.set("frozen_param_fragments", frozen_keys ? std::move(frozen_fragments) : Value());
    const Dict& c = in.carried;
    top.set("lr_scheduler", carried_or(c, "lr_scheduler", Value()));
    top.set("data_sampler", carried_or(c, "data_sampler", Value()));
    top.set("random_ltd", carried_or(c, "random_ltd", Value()));
    top.set("sparse_tensor_module_names",
            carried_or(c, "sparse_tensor_module_names", Value(Object{"builtins", "set", object_build::reduce, {Value::list()}, {}, {}})));
    top.set("skipped_steps", carried_or(c, "skipped_steps", Value(0)));
    top.set("global_steps", carried_or(c, "global_steps", Value(0)));
    top.set("global_samples", carried_or(c, "global_samples", Value(0)));
    top.set("dp_world_size", static_cast<std::int64_t>(M));
    top.set("mp_world_size", 1);
    top.set("ds_config", carried_or(c, "ds_config", Value(Dict{{"zero_optimization", Dict{{"stage", stage}}},
                                                               {"bf16", Dict{{"enabled", in.model == dtype::BF16}}}})));
    top.set("ds_version", in.version);
    for (const auto& [k, v] : c)  // client state: every other key, as the engine merges it at the top level
      if (!top.contains(k)) top.set(k, v);
    return top;
  }

  Dict optim_file(Dict osd) {
    Dict top;
    top.set("optimizer_state_dict", Value(std::move(osd)));
    top.set("ds_config", carried_or(in.carried, "ds_config", Value(Dict{{"zero_optimization", Dict{{"stage", stage}}}})));
    top.set("ds_version", in.version);
    return top;
  }

  std::string prefix() const { return in.model == dtype::BF16 ? "bf16_" : ""; }

  void add(std::string name, Value tree) {
    cur->name = std::move(name);
    cur->tree = std::move(tree);
  }
  void begin() {
    files.emplace_back();
    cur = &files.back();
  }

  /// Stage 1 and 2 (and the BF16_Optimizer): one model-states file, one optim file per rank.
  void plan12(const std::string& tag) {
    const std::size_t G = in.groups.size();
    std::vector<std::vector<std::size_t>> flat(G);  // params in flat order
    std::vector<layout::Zero12Partitions> z;
    std::vector<std::vector<std::vector<layout::FlatPiece>>> pieces;
    for (std::size_t g = 0; g < G; ++g) {
      const auto& order = in.groups[g].params;
      if (in.round_robin && !bf16_optimizer)
        for (std::size_t k : round_robin_order(order.size(), M)) flat[g].push_back(order[k]);
      else
        flat[g] = order;
      std::vector<std::uint64_t> numels;
      for (std::size_t i : flat[g]) numels.push_back(in.params[i].numel);
      z.push_back(layout::zero12_partitions(layout::detail::sum_checked(numels), M));
      pieces.push_back(layout::zero12_pieces(numels, M));
    }
    // Model states: the whole module, the param shapes in flat order, frozen parameters whole (stage 2).
    begin();
    List shapes;
    for (std::size_t g = 0; g < G; ++g) {
      Dict d;
      for (std::size_t i : flat[g]) d.set(in.params[i].name, torch_size(in.params[i].shape));
      shapes.emplace_back(std::move(d));
    }
    // Frozen parameters are saved apart only when gradients are partitioned (engine
    // _save_checkpoint: zero_optimization_partition_gradients()).
    const bool frozen_keys = stage >= 2 && !bf16_optimizer;
    Dict fshapes, ffrags;
    std::map<std::string, dtype> mod(in.module.begin(), in.module.end());
    if (frozen_keys)
      for (std::size_t i : in.frozen) {
        fshapes.set(info(i).name, torch_size(info(i).shape));
        ffrags.set(info(i).name, whole(i, mod.count(info(i).name) ? mod.at(info(i).name) : in.model));
      }
    Value module = this->module(false);
    add(tag + "/mp_rank_00_model_states.pt", Value(model_states_head(std::move(module), Value::list(std::move(shapes)), frozen_keys,
                                                                     Value(std::move(fshapes)), Value(std::move(ffrags)), true)));
    for (std::uint32_t r = 0; r < M; ++r) {
      begin();
      List parts, paddings, counts, mappings;
      Dict state;
      List groups;
      for (std::size_t g = 0; g < G; ++g) {
        const layout::Span part = z[g].parts[r];
        const std::uint64_t N = z[g].numel;
        const std::uint64_t real = N > part.offset ? std::min(part.size, N - part.offset) : 0;
        const std::uint64_t saved = bf16_optimizer ? part.size : real;
        Value fp32 = holder(dtype::F32, shape_t{static_cast<dim_t>(saved)});
        const std::map<std::string, Value> moments = moments_of(g, part.size);
        for (std::size_t j = 0; j < flat[g].size(); ++j)
          for (const layout::FlatPiece& fp : pieces[g][j]) {
            if (fp.rank != r) continue;
            const w_param& p = in.params[flat[g][j]];
            piece(fp32, p.tensor, fp.range, fp.offset);
            for (const auto& k : in.groups[g].keys) piece(moments.at(k), p.state.at(k), fp.range, fp.offset);
          }
        parts.push_back(std::move(fp32));
        paddings.emplace_back(static_cast<std::int64_t>(bf16_optimizer ? (r + 1 == M ? z[g].padded_numel - N : 0) : part.size - saved));
        counts.emplace_back(static_cast<std::int64_t>(M));
        // param_slice_mappings walk the group in its original order (DeepSpeed _create_param_mapping).
        Dict mapping;
        std::uint64_t off = 0;
        for (std::size_t i : in.groups[g].params) {
          const w_param& p = in.params[i];
          const std::uint64_t lo = std::max(off, part.offset), hi = std::min(off + p.numel, part.offset + part.size);
          if (lo < hi) mapping.set(p.name, fragment_address(hi - lo, lo - part.offset));
          off += p.numel;
        }
        mappings.emplace_back(std::move(mapping));
        add_state(state, static_cast<std::int64_t>(g), g, moments);
        Dict grp = in.groups[g].hyper.as_dict();
        grp.set("params", Value::list(List{Value(static_cast<std::int64_t>(g))}));
        groups.emplace_back(std::move(grp));
      }
      Dict base;
      base.set("state", Value(std::move(state)));
      base.set("param_groups", Value::list(std::move(groups)));
      Dict osd;
      if (!bf16_optimizer) {
        osd.set("loss_scaler", carried_or(in.optimizer, "loss_scaler", default_loss_scaler()));
        osd.set("dynamic_loss_scale", carried_or(in.optimizer, "dynamic_loss_scale", Value(false)));
        osd.set("overflow", carried_or(in.optimizer, "overflow", Value(false)));
      }
      osd.set("clip_grad", carried_or(in.optimizer, "clip_grad", Value(0.0)));
      osd.set("base_optimizer_state", Value(std::move(base)));
      osd.set("single_partition_of_fp32_groups", Value::list(std::move(parts)));
      if (!bf16_optimizer) osd.set("zero_stage", zero_stage_enum(stage));
      osd.set("group_paddings", Value::list(std::move(paddings)));
      osd.set("partition_count", Value::list(std::move(counts)));
      osd.set("ds_version", in.version);
      osd.set("param_slice_mappings", Value::list(std::move(mappings)));
      if (universal) {
        // zero/optimizer_state.pt: rank 0's values that are not partitions, and the param groups
        // (ds_to_universal.py _save_optimizer_state); the partitions go to the per-parameter files.
        Dict common;
        for (const auto& [k, v] : osd)
          if (k.str() != "base_optimizer_state" && k.str() != "param_slice_mappings" && k.str() != "single_partition_of_fp32_groups") common.set(k, v);
        common.set("param_groups", osd.at("base_optimizer_state").as_dict().at("param_groups"));
        cur->pieces.clear();
        add(tag + "/zero/optimizer_state.pt", Value(std::move(common)));
        break;
      }
      add(tag + "/" + prefix() + "zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt", Value(optim_file(std::move(osd))));
    }
  }

  /// The universal checkpoint's per-parameter files (ds_to_universal.py merge_tp_slices,
  /// merge_zero3_slices): zero/<name>/fp32.pt and one file per optimizer state key, the whole
  /// tensor as {'cat_dim': 0, 'param': tensor} (stages 1/2; 0-dim state such as step bare), or
  /// flat and bare (stage 3, which has no file for 0-dim state).
  void plan_universal_params(const std::string& tag) {
    for (std::size_t g = 0; g < in.groups.size(); ++g)
      for (std::size_t i : in.groups[g].params) {
        const w_param& p = in.params[i];
        if (p.name.empty() || p.name == "." || p.name == ".." || p.name.find('/') != std::string::npos || p.name.find('\0') != std::string::npos)
          throw_error(errors::ds_write_input, "parameter " + quote(p.name), "cannot name a folder of a universal checkpoint (zero/<name>/)");
        auto file = [&](const std::string& key, std::size_t tensor, bool scalar) {
          begin();
          const TensorInfo& t = info(tensor);
          Value v;
          if (stage <= 2) {
            v = whole(tensor, t.dtype);
            if (!scalar) v = Value(Dict{{"cat_dim", 0}, {"param", std::move(v)}});
          } else {
            v = holder(t.dtype, shape_t{static_cast<dim_t>(p.numel)});
            if (p.numel > 0) piece(v, tensor, FlatRange{0, p.numel}, 0);
          }
          add(tag + "/zero/" + p.name + "/" + key + ".pt", std::move(v));
        };
        file("fp32", p.tensor, false);
        for (const auto& k : in.groups[g].keys) file(k, p.state.at(k), false);
        if (stage <= 2) {
          for (const auto& k : in.groups[g].scalar_keys) file(k, p.state.at(k), true);
          for (const auto& [k, v] : in.groups[g].values) {  // a plain value, saved as it is
            begin();
            add(tag + "/zero/" + p.name + "/" + k + ".pt", v);
          }
        }
      }
  }

  /// Stage 3: a model-states and an optim file per rank; every parameter partitioned on its own,
  /// the partitions of each sub-group concatenated.
  void plan3(const std::string& tag) {
    // Sub-groups: each param group split greedily on its partitions' sizes (stage3.py _create_fp16_sub_groups).
    struct sub_group {
      std::size_t group;
      std::vector<std::size_t> params;
      std::vector<std::uint64_t> offset;  ///< each parameter's partition in the sub-group's flat
      std::uint64_t size = 0;
    };
    std::vector<sub_group> subs;
    for (std::size_t g = 0; g < in.groups.size(); ++g) {
      std::uint64_t total = 0;
      for (std::size_t i : in.groups[g].params) total += layout::zero3_partitioned_param_info(in.params[i].numel, M).partitioned_numel;
      sub_group s{g, {}, {}, 0};
      for (std::size_t k = 0; k < in.groups[g].params.size(); ++k) {
        const std::size_t i = in.groups[g].params[k];
        const std::uint64_t pn = layout::zero3_partitioned_param_info(in.params[i].numel, M).partitioned_numel;
        s.params.push_back(i);
        s.offset.push_back(s.size);
        s.size += pn;
        if ((in.sub_group_size < total && s.size >= in.sub_group_size) || k + 1 == in.groups[g].params.size()) {
          subs.push_back(std::move(s));
          s = sub_group{g, {}, {}, 0};
        }
      }
    }
    std::map<std::string, dtype> mod(in.module.begin(), in.module.end());
    for (std::uint32_t r = 0; r < M; ++r) {
      // Model states of rank r: the module's parameters as empty placeholders, buffers whole,
      // this rank's partition of every frozen parameter.
      begin();
      List shapes;
      for (const auto& s : subs) {
        Dict d;
        for (std::size_t i : s.params) d.set(in.params[i].name, torch_size(in.params[i].shape));
        shapes.emplace_back(std::move(d));
      }
      Dict fshapes, ffrags;
      for (std::size_t i : in.frozen) {
        const std::uint64_t n = numel(info(i).shape);
        const std::uint64_t pn = layout::zero3_partitioned_param_info(n, M).partitioned_numel;
        fshapes.set(info(i).name, torch_size(info(i).shape));
        Value h = holder(mod.count(info(i).name) ? mod.at(info(i).name) : in.model, shape_t{static_cast<dim_t>(pn)});
        if (r * pn < n) piece(h, i, FlatRange{r * pn, std::min(n, (r + 1) * pn)}, 0);
        ffrags.set(info(i).name, std::move(h));
      }
      // shared_params: the engine finds ties through ds_id on rank 0 only (its other ranks save {}).
      Value module = this->module(true);
      add(tag + "/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_model_states.pt",
          Value(model_states_head(std::move(module), Value::list(std::move(shapes)), true, Value(std::move(fshapes)), Value(std::move(ffrags)), r == 0)));
      // Optim states of rank r (universal: rank 0's as zero/optimizer_state.pt, with the param
      // groups; ds_to_universal.py _save_optimizer_state_stage3).
      if (universal && r > 0) continue;
      begin();
      List flats;
      Dict state;
      std::vector<List> group_ids(in.groups.size());
      for (std::size_t k = 0; k < subs.size(); ++k) {
        const sub_group& s = subs[k];
        const std::size_t g = s.group;
        Value fp32 = holder(dtype::F32, shape_t{static_cast<dim_t>(s.size)});
        const std::map<std::string, Value> moments = moments_of(g, s.size);
        for (std::size_t j = 0; j < s.params.size(); ++j) {
          const w_param& p = in.params[s.params[j]];
          const std::uint64_t pn = layout::zero3_partitioned_param_info(p.numel, M).partitioned_numel;
          if (r * pn >= p.numel) continue;
          const FlatRange range{r * pn, std::min(p.numel, (r + 1) * pn)};
          piece(fp32, p.tensor, range, s.offset[j]);
          for (const auto& key : in.groups[g].keys) piece(moments.at(key), p.state.at(key), range, s.offset[j]);
        }
        flats.push_back(std::move(fp32));
        add_state(state, static_cast<std::int64_t>(k), g, moments);
        group_ids[g].emplace_back(static_cast<std::int64_t>(k));
      }
      List groups;
      for (std::size_t g = 0; g < in.groups.size(); ++g) {
        Dict grp = in.groups[g].hyper.as_dict();
        grp.set("params", Value::list(std::move(group_ids[g])));
        groups.emplace_back(std::move(grp));
      }
      Dict inner;
      inner.set("state", Value(std::move(state)));
      inner.set("param_groups", Value::list(std::move(groups)));
      Dict osd;
      osd.set("zero_stage", zero_stage_enum(3));
      osd.set("loss_scaler", carried_or(in.optimizer, "loss_scaler", default_loss_scaler()));
      osd.set("dynamic_loss_scale", carried_or(in.optimizer, "dynamic_loss_scale", Value(false)));
      osd.set("overflow", carried_or(in.optimizer, "overflow", Value(false)));
      osd.set("partition_count", static_cast<std::int64_t>(M));
      osd.set("optimizer_state_dict", Value(std::move(inner)));
      osd.set("fp32_flat_groups", Value::list(std::move(flats)));
      if (universal) {
        osd.set("param_groups", osd.at("optimizer_state_dict").as_dict().at("param_groups"));
        add(tag + "/zero/optimizer_state.pt", Value(std::move(osd)));
        continue;
      }
      add(tag + "/" + prefix() + "zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt", Value(optim_file(std::move(osd))));
    }
  }
};

}  // namespace statedict::inline v0::deepspeed::detail

namespace statedict::inline v0::deepspeed {

/// Writes `ck` (a consolidated checkpoint with its optimizer state keyed by parameter name, as
/// statedict reads DeepSpeed with `with_optimizer`) as the checkpoint DeepSpeed's engine saves for
/// `o.world_size` data-parallel ranks, into `dir` (replaced atomically): `latest` and
/// `<tag>/...model_states.pt`, `<tag>/...optim_states.pt`. With `o.universal`, DeepSpeed's
/// universal checkpoint instead (what ds_to_universal.py makes of those files): `latest_universal`,
/// the model-states files, `<tag>/zero/optimizer_state.pt` and `<tag>/zero/<name>/<state>.pt` per
/// parameter. Returns the files written.
inline std::vector<std::string> write(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const write_options& o) {
  if (o.world_size == 0 || o.world_size > (1U << 16))
    throw_error(errors::ds_write_option, "--world-size " + std::to_string(o.world_size), "expected 1 to 65536 data-parallel ranks");
  detail::write_input in = detail::prepare(ck, o);
  int stage = o.zero_stage.value_or(0);
  if (!stage)
    if (auto it = ck.metadata.find("deepspeed.zero_stage"); it != ck.metadata.end()) stage = std::stoi("0" + it->second);
  if (stage < 1 || stage > 3)
    throw_error(errors::ds_write_option, "--zero-stage", stage ? std::to_string(stage) + " is not a ZeRO stage 1, 2 or 3"
                                                               : std::string("is needed: the input is not a DeepSpeed checkpoint that names its stage"));
  const auto bf16o = ck.metadata.find("deepspeed.optimizer");
  const bool bf16_optimizer = bf16o != ck.metadata.end() && bf16o->second == "BF16_Optimizer" && stage == 1 && !o.zero_stage;
  // A fresh optimizer is at step 0 whatever the input's tag said (global_steps is 0 too).
  std::string tag = o.tag.empty() ? (o.fresh ? std::string() : in.tag) : o.tag;
  if (tag.empty()) {
    const Value* gs = in.carried.find(Key(std::string("global_steps")));
    tag = "global_step" + std::to_string(gs && gs->is_int() ? gs->as_int() : 0);
  }
  if (!detail::valid_tag(tag)) throw_error(errors::ds_write_option, "tag " + quote(tag), "is not a folder name");

  // Placeholders (address space only, never touched): the files hold the model a few times over
  // in their pieces (module, masters, each state key, universal copies), every stage-3 rank file
  // the buffers whole, and per rank a placeholder and its padding for each tensor.
  std::uint64_t bytes = 4096, buffers = 0;
  std::size_t keys = 2;
  for (const auto& g : in.groups) keys = std::max(keys, g.keys.size() + g.scalar_keys.size() + g.values.size() + 2);
  for (const TensorInfo& t : ck.tensors) bytes = checked_add(bytes, checked_add(byte_size(t.shape, 8), 256, "size"), "size");
  for (std::size_t i : in.buffers) buffers = checked_add(buffers, checked_add(byte_size(ck.tensors[i].shape, 8), 256, "size"), "size");
  const std::uint64_t ranks = static_cast<std::uint64_t>(o.world_size) + 1;
  const std::uint64_t capacity = checked_add(
      checked_mul(bytes, keys + 3, "size"),
      checked_mul(ranks, checked_add(buffers, checked_mul(ck.tensors.size() + in.groups.size() * 4 + 8, 256 * (keys + 1), "size"), "size"), "size"),
      "size");
  detail::planner pl{ck, in, o.world_size, stage, bf16_optimizer,
                     detail::arena{std::make_shared<torch::detail::reservation>(capacity), capacity, 0}, o.universal, {}, nullptr};
  if (stage <= 2) pl.plan12(tag);
  else pl.plan3(tag);
  if (o.universal) pl.plan_universal_params(tag);

  formats::detail::file_set files;
  std::vector<std::pair<std::string, const torch::SavePlan*>> planned;
  for (detail::rank_file& rf : pl.files) {
    torch::save_options so;
    so.archive_name = torch::archive_name_for(rf.name);
    so.pickle.keep_classes = detail::engine_classes();
    rf.plan = torch::plan_save(rf.tree, so);
    planned.emplace_back(rf.name, &rf.plan);
  }
  formats::detail::add_torch_files(files, planned);
  // Every piece's place: the storage that holds its placeholder in its file, and where in it.
  std::unordered_map<std::size_t, std::size_t> dst_of;
  for (std::size_t k = 0; k < pl.files.size(); ++k) {
    const detail::rank_file& rf = pl.files[k];
    const torch::SavePlan& sp = rf.plan;
    std::unordered_map<const std::byte*, std::size_t> storage_of;
    for (std::size_t s = 0; s < sp.storages.size(); ++s) storage_of.emplace(sp.storages[s].source, s);
    for (const auto& p : rf.pieces) {
      const auto s = storage_of.find(p.data);
      if (s == storage_of.end())
        throw_error(errors::ds_write_input, "tensor " + quote(ck.tensors[p.tensor].name), "has no storage in the planned file " + quote(rf.name));
      auto [it, fresh] = dst_of.emplace(p.tensor, files.dst.tensors.size());
      if (fresh) files.dst.tensors.push_back(TensorInfo{ck.tensors[p.tensor].name, ck.tensors[p.tensor].dtype, ck.tensors[p.tensor].shape, {}});
      files.dst.tensors[it->second].chunks.push_back(
          Chunk{p.region, Placement{static_cast<std::uint32_t>(k),
                                    checked_add(sp.storage_offset(s->second), checked_mul(p.element, itemsize(p.stored), "offset"), "offset"), {}, p.stored}});
    }
  }
  formats::detail::text_index(files, o.universal ? "latest_universal" : "latest", tag);
  files.what = "DeepSpeed checkpoint";
  files.file_kind = "rank file";
  formats::save_options so;
  so.exec = o.exec;
  so.plan = o.plan;
  return formats::detail::write_file_set(ck, files, dir, so);
}

}  // namespace statedict::inline v0::deepspeed
