// statedict: writing Megatron-LM's legacy per-rank layout for a chosen TP / PP (/ virtual PP)
// size from a full model with Megatron's canonical names (formats/megatron.hpp is the public
// header). Every rank file is a torch.save file planned up front; each of its tensors is a piece
// of a full tensor, so the whole checkpoint is one Destination (every element's place in every
// rank file) that make_plan + execute fill from the source, streaming in bounded memory; the
// tracker file is written last and the folder appears atomically. What is written and why:
// megatron_write_parts.hpp.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../exec/sink.hpp"
#include "../../io/file.hpp"
#include "../../io/torch_save.hpp"
#include "../../io/zip.hpp"
#include "../../shard/checkpoint.hpp"
#include "megatron_legacy.hpp"
#include "megatron_rules.hpp"
#include "megatron_write_parts.hpp"
#include "write_files.hpp"

namespace statedict::inline v0::megatron {

namespace detail {

/// The writer's view of its input: the tensors to write with their place, and the run's values.
struct write_input {
  ShardedCheckpoint work;  ///< the source, vocabulary tensors re-padded
  std::vector<out_tensor> outs;
  facts f;
  Value root;  ///< the source tree (placeholder tensors)
  std::shared_ptr<torch::detail::reservation> space;
  std::uint64_t vocab_rows = 0;
  bool output_layer = false;
  std::optional<std::size_t> word_embeddings;  ///< out index
};

/// Where one canonical name goes (first stage, a layer, the last stage) and under which key.
inline out_tensor classify(const TensorInfo& t, std::size_t i, const facts& f) {
  const std::string who = "tensor " + quote(t.name);
  if (t.name.rfind("optimizer.", 0) == 0)
    throw_error(errors::mg_write_input, who, "optimizer state is not written to a Megatron-LM checkpoint (read the input without --with-optimizer)");
  if (t.name.rfind("language_model.", 0) != 0)
    throw_error(errors::mg_write_input, who, "is not a Megatron-LM GPT tensor (canonical names start with 'language_model.', as statedict reads Megatron checkpoints)");
  const std::string rest = t.name.substr(15);
  out_tensor o;
  o.index = i;
  if (rest.rfind("embedding.", 0) == 0) {
    const std::string e = rest.substr(10);
    const auto dot = e.find('.');
    if (dot == std::string::npos || dot == 0) throw_error(errors::mg_write_input, who, "an embedding tensor is named embedding.<table>.<leaf>");
    o.place = out_tensor::where::first;
    o.group = e.substr(0, dot);
    o.key = e.substr(dot + 1);
  } else if (auto l = layer_of(rest, "encoder.layers.")) {
    if (l->first >= f.num_layers) throw_error(errors::mg_write_input, who, "layer " + std::to_string(l->first) + " is past args.num_layers " + std::to_string(f.num_layers));
    o.place = out_tensor::where::layer;
    o.layer = l->first;
    o.group = "encoder";
    o.key = l->second;
  } else if (rest.rfind("encoder.", 0) == 0 || rest.rfind("output_layer.", 0) == 0) {
    const auto dot = rest.find('.');
    o.place = out_tensor::where::last;
    o.group = rest.substr(0, dot);
    o.key = rest.substr(dot + 1);
  } else {
    throw_error(errors::mg_write_input, who, "has no place in Megatron's GPT model (embedding, encoder, output_layer)");
  }
  return o;
}

/// Reads the input: its args, every tensor's place and rule, the vocabulary re-padded.
inline write_input prepare(const ShardedCheckpoint& ck, const write_options& o, std::uint64_t tp, std::uint64_t stages) {
  write_input in;
  in.root = formats::detail::source_tree(ck, in.space);
  const Value* args = in.root.is_dict() ? in.root.as_dict().find("args") : nullptr;
  if (!args)
    throw_error(errors::mg_write_input, "the checkpoint", "has no 'args' (argparse.Namespace): the writer needs Megatron's model arguments, as read from a Megatron checkpoint");
  const Value* cv = in.root.as_dict().find("checkpoint_version");
  in.f = read_facts(*args, cv && (cv->is_double() || cv->is_int()) ? cv->as_number() : 3.0, limits{}, "the checkpoint's args");
  if (in.f.num_layers % stages != 0)
    throw_error(errors::mg_write_split, "the checkpoint's args", "num_layers " + std::to_string(in.f.num_layers) + " is not a multiple of PP x virtual PP = " +
                                                                   std::to_string(stages));
  in.work.format = ck.format;
  in.work.sources = ck.sources;
  in.work.tensors = ck.tensors;
  std::set<std::uint64_t> layers;
  const args_reader ar(*args, "the checkpoint's args");
  const Value* divisor = ar.get("make_vocab_size_divisible_by");
  for (std::size_t i = 0; i < in.work.tensors.size(); ++i) {
    TensorInfo& t = in.work.tensors[i];
    out_tensor ot = classify(t, i, in.f);
    const auto how = rule_for(t.name, o.rules, o.default_rules);
    if (!how && tp > 1)
      throw_error(errors::mg_write_split, "tensor " + quote(t.name), "no partition rule names it, so it cannot be split over TP " + std::to_string(tp) +
                                                                          ": add one (write_options::rules, --megatron-rule PATTERN=KIND)");
    ot.how = !how ? split::replicated : *how == split::fc1 ? (in.f.swiglu ? split::glu : split::column) : *how;
    if (ot.how == split::vocab) {
      if (t.shape.empty()) throw_error(errors::mg_write_split, "tensor " + quote(t.name), "a vocabulary tensor has rows");
      const std::uint64_t rows = repad_rows(static_cast<std::uint64_t>(t.shape[0]), o, tp, divisor, t.name);
      if (in.vocab_rows && rows != in.vocab_rows)
        throw_error(errors::mg_write_input, "tensor " + quote(t.name), "has another vocabulary size than the other vocabulary tensors");
      in.vocab_rows = rows;
      resize_rows(t, rows);
    }
    if (ot.place == out_tensor::where::layer) layers.insert(ot.layer);
    if (ot.group == "output_layer") in.output_layer = true;
    if (ot.group == "word_embeddings" && ot.key == "weight") in.word_embeddings = in.outs.size();
    in.outs.push_back(std::move(ot));
  }
  for (std::uint64_t l = 0; l < in.f.num_layers; ++l)
    if (!layers.count(l)) throw_error(errors::mg_write_input, "the checkpoint", "has no tensor of layer " + std::to_string(l) + " of args.num_layers " + std::to_string(in.f.num_layers));
  return in;
}

/// args with the new parallel sizes and vocabulary.
inline Value new_args(const Value& args, std::uint64_t tp, std::uint64_t pp, std::optional<std::uint64_t> vpp, std::uint64_t vocab) {
  Value a = args;
  if (a.is_dict()) {  // a Namespace written as data: Megatron's loader reads attributes (getattr)
    Object ns;
    ns.module = "argparse";
    ns.name = "Namespace";
    ns.how = object_build::newobj;
    ns.state.push_back(std::move(a));
    a = Value(std::move(ns));
  }
  Object& o = a.as_object();
  if (o.state.size() != 1 || !o.state[0].is_dict()) throw_error(errors::mg_write_input, "args", "is not an argparse.Namespace with a plain attribute dict");
  Dict& d = o.state[0].as_dict();
  d.set("tensor_model_parallel_size", static_cast<std::int64_t>(tp));
  if (d.contains("model_parallel_size")) d.set("model_parallel_size", static_cast<std::int64_t>(tp));
  d.set("pipeline_model_parallel_size", static_cast<std::int64_t>(pp));
  d.set("virtual_pipeline_model_parallel_size", vpp ? Value(static_cast<std::int64_t>(*vpp)) : Value());
  if (vocab) d.set("padded_vocab_size", static_cast<std::int64_t>(vocab));
  return a;
}

/// The modules of a legacy layer that carry `_extra_state` (the parallel linears).
inline bool parallel_linear(std::string_view module) {
  for (std::string_view m : {"self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"})
    if (module == m) return true;
  return false;
}

/// Builds the model chunk `v` of stage `p` for TP rank `r`, with placeholder pieces in `space`.
struct piece_maker {
  const write_input& in;
  std::uint64_t tp;
  std::shared_ptr<torch::detail::reservation> space;  ///< placeholders, never read
  std::uint64_t capacity = 0;
  std::uint64_t used = 0;
  rank_plan* rp = nullptr;
  std::uint64_t r = 0;

  Value make(std::size_t out) {
    const TensorInfo& t = in.work.tensors[in.outs[out].index];
    const auto [shape, boxes] = split_piece(t, in.outs[out].how, r, tp, in.f);
    const std::uint64_t size = checked_add(byte_size(shape, itemsize(t.dtype)), 127, "reservation") / 64 * 64;
    if (size > capacity - used) throw_error(errors::mg_write_input, "tensor " + quote(t.name), "its rank pieces outgrow the space reserved for them");
    const std::byte* at = space->base() + used;
    used += size;
    rp->slots.push_back(rank_plan::slot{out, at, r});
    return Value(TensorView::contiguous(t.dtype, shape, at, space));
  }
};

inline Value chunk_tree(const write_input& in, piece_maker& pm, std::uint64_t p, std::uint64_t v, std::uint64_t pp, std::uint64_t vpp) {
  const std::uint64_t L = in.f.num_layers, n = L / (pp * vpp), first = v * (L / vpp) + p * n;
  const bool pre = p == 0 && v == 0, post = p + 1 == pp && v + 1 == vpp;
  Dict lm;
  if (pre) {
    Dict emb;
    for (std::size_t i = 0; i < in.outs.size(); ++i)
      if (in.outs[i].place == out_tensor::where::first) {
        Value* sub = emb.find(in.outs[i].group);
        if (!sub) sub = &emb.set(in.outs[i].group, Value(Dict{}));
        sub->as_dict().set(in.outs[i].key, pm.make(i));
      }
    lm.set("embedding", Value(std::move(emb)));
  }
  Dict enc;
  for (std::uint64_t l = first; l < first + n; ++l) {
    std::vector<std::string> modules;
    std::map<std::string, std::vector<std::size_t>> by_module;
    for (std::size_t i = 0; i < in.outs.size(); ++i) {
      if (in.outs[i].place != out_tensor::where::layer || in.outs[i].layer != l) continue;
      const std::string m = in.outs[i].key.substr(0, in.outs[i].key.rfind('.') == std::string::npos ? 0 : in.outs[i].key.rfind('.'));
      if (!by_module.count(m)) modules.push_back(m);
      by_module[m].push_back(i);
    }
    const std::string prefix = "layers." + std::to_string(l - first) + ".";
    for (const std::string& m : modules) {
      for (std::size_t i : by_module[m]) enc.set(prefix + in.outs[i].key, pm.make(i));
      if (parallel_linear(m)) enc.set(prefix + m + "._extra_state", Value());
    }
  }
  Dict out_layer;
  if (post)
    for (std::size_t i = 0; i < in.outs.size(); ++i) {
      if (in.outs[i].place != out_tensor::where::last) continue;
      if (in.outs[i].group == "encoder") enc.set(in.outs[i].key, pm.make(i));
      else out_layer.set(in.outs[i].key, pm.make(i));
    }
  lm.set("encoder", Value(std::move(enc)));
  if (!out_layer.empty()) {
    out_layer.set("_extra_state", Value());
    lm.set("output_layer", Value(std::move(out_layer)));
  }
  Dict chunk;
  chunk.set("language_model", Value(std::move(lm)));
  if (post && !pre && !in.output_layer && !in.f.untied && in.word_embeddings) {
    Dict head;
    head.set("weight", pm.make(*in.word_embeddings));
    chunk.set("word_embeddings_for_head", Value(std::move(head)));
  }
  return Value(std::move(chunk));
}

}  // namespace detail

/// Writes `ck` (a full Megatron-LM GPT model with canonical names and its `args`, as describe()
/// gives it) as a legacy checkpoint for TP x PP ranks into `dir` (replaced atomically): the
/// tracker file and iter_<iteration>/mp_rank_*/model_optim_rng.pt. Returns the files written.
inline std::vector<std::string> write(const ShardedCheckpoint& ck, const std::filesystem::path& dir, const write_options& o = {}) {
  check(o);
  const std::uint64_t tp = o.tp.value_or(1), pp = o.pp.value_or(1), vpp = o.vpp.value_or(1);
  detail::write_input in = detail::prepare(ck, o, tp, pp * vpp);
  const Dict& root = in.root.as_dict();
  const Value args = detail::new_args(*root.find("args"), tp, pp, o.vpp, in.vocab_rows);
  const Value* iv = root.find("iteration");
  const bool release = !iv || !iv->is_int() || iv->as_int() <= 0;
  std::string folder = release ? "release" : std::to_string(iv->as_int());
  if (!release && folder.size() < 7) folder.insert(0, 7 - folder.size(), '0');
  if (!release) folder = "iter_" + folder;

  // Each tensor is held by one stage (the word embeddings by two: tied heads), on every TP rank a
  // piece of at most its size.
  std::uint64_t space = 64;
  for (const TensorInfo& t : in.work.tensors)
    space = checked_add(space, checked_mul(checked_add(byte_size(t.shape, itemsize(t.dtype)), 128, "size"), checked_mul(2, tp, "size"), "size"), "size");
  std::vector<detail::rank_plan> plans;
  detail::piece_maker pm{in, tp, std::make_shared<torch::detail::reservation>(space), space};
  for (std::uint64_t p = 0; p < pp; ++p)
    for (std::uint64_t r = 0; r < tp; ++r) {
      detail::rank_plan rp;
      char name[64];
      std::snprintf(name, sizeof name, pp > 1 ? "mp_rank_%02llu_%03llu" : "mp_rank_%02llu", static_cast<unsigned long long>(r), static_cast<unsigned long long>(p));
      rp.name = folder + "/" + name + "/model_optim_rng.pt";
      pm.rp = &rp;
      pm.r = r;
      Dict top;
      top.set("args", args);
      top.set("checkpoint_version", Value(3.0));
      if (!release) top.set("iteration", *iv);
      for (std::uint64_t v = 0; v < vpp; ++v) top.set(o.vpp ? "model" + std::to_string(v) : std::string("model"), detail::chunk_tree(in, pm, p, v, pp, vpp));
      for (const auto& [k, x] : root)
        if (k.is_string() && !top.contains(k) && k.as_string() != "language_model" && k.as_string() != "optimizer" && !detail::holds_tensor(x))
          top.set(k, x);
      rp.tree = Value(std::move(top));
      torch::save_options so;
      so.archive_name = "model_optim_rng";
      // Megatron's loader reads args by attribute (getattr), so it stays an argparse.Namespace:
      // a class that runs no code of its own when unpickled.
      so.pickle.keep_classes = {"argparse.Namespace"};
      rp.plan = torch::plan_save(rp.tree, so);
      plans.push_back(std::move(rp));
    }
  // Every piece's storage in its file, and the boxes of the full tensor it holds.
  formats::detail::file_set files;
  files.dst.tensors.resize(in.outs.size());
  for (std::size_t i = 0; i < in.outs.size(); ++i) {
    const TensorInfo& t = in.work.tensors[in.outs[i].index];
    files.dst.tensors[i] = TensorInfo{t.name, t.dtype, t.shape, {}};
  }
  std::vector<std::pair<std::string, const torch::SavePlan*>> planned;
  for (const auto& rp : plans) planned.emplace_back(rp.name, &rp.plan);
  formats::detail::add_torch_files(files, planned);
  for (std::size_t k = 0; k < plans.size(); ++k) {
    const torch::SavePlan& sp = plans[k].plan;
    std::map<const std::byte*, std::size_t> storage_of;
    for (std::size_t s = 0; s < sp.storages.size(); ++s) storage_of.emplace(sp.storages[s].source, s);
    for (const auto& slot : plans[k].slots) {
      TensorInfo& d = files.dst.tensors[slot.tensor];
      const auto [shape, boxes] = detail::split_piece(in.work.tensors[in.outs[slot.tensor].index], in.outs[slot.tensor].how, slot.r, tp, in.f);
      if (numel(shape) == 0) continue;
      const auto s = storage_of.find(slot.data);
      if (s == storage_of.end()) throw_error(errors::mg_write_input, "tensor " + quote(d.name), "has no storage in the planned rank file " + quote(plans[k].name));
      const std::uint64_t row = shape.size() > 1 ? numel(std::span<const dim_t>(shape).subspan(1)) : 1;
      for (const auto& [box, first_row] : boxes)
        d.chunks.push_back(Chunk{box, Placement{static_cast<std::uint32_t>(k),
                                                checked_add(sp.storage_offset(s->second), checked_mul(first_row * row, itemsize(d.dtype), "offset"), "offset"), {}, d.dtype}});
    }
  }
  formats::detail::text_index(files, "latest_checkpointed_iteration.txt", release ? std::string("release") : std::to_string(iv->as_int()));
  files.what = "Megatron-LM checkpoint";
  files.file_kind = "rank file";
  formats::save_options so;
  so.exec = o.exec;
  so.plan = o.plan;
  return formats::detail::write_file_set(in.work, files, dir, so);
}

}  // namespace statedict::inline v0::megatron
