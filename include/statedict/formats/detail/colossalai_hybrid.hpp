// statedict: ColossalAI's released HybridParallelCheckpointIO layout (gather_dtensor=True): the
// model as size-capped shards of whole tensors with an index (`pytorch_model.bin.index.json` or
// `model.safetensors.index.json`, `-stage-XXXXX-shard-XXXXX` files under pipeline parallelism),
// and the optimizer as `pytorch_optim-*.bin` / `optimizer-*.safetensors` shards keyed by integer
// parameter ids, an index, and `pytorch_optim_group.bin` (the param groups).
// SPDX-License-Identifier: MIT
//
// The files do not say which id is which parameter (ColossalAI takes that from the live model).
// statedict names them by the parameter order (docs/formats/colossalai.md): per pipeline stage,
// the stage's ids sorted ascending are zipped with the stage's model entries in index order
// (parameters come before buffers in each stage's files), and every `exp_avg` must have its
// parameter's shape, so a checkpoint whose optimizer was not built on model.parameters() is
// refused instead of misnamed. State comes out as `optim.state.<name>.<key>` (moments whole,
// `step` a 0-dim tensor for torch's Adam or an int value for ColossalAI's HybridAdam) and
// `optim.param_groups.<g>.*` with `params` as names. ColossalChat and Colossal-LLaMA save the
// model in `modeling/` and the optimizer in `optimizer/` of one folder; both places are read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../io/pickle_read.hpp"
#include "../../shard/checkpoint.hpp"
#include "../optim_shard.hpp"
#include "colossalai_files.hpp"

namespace statedict::inline v0::colossalai::detail {

inline constexpr std::string_view model_indexes[] = {"pytorch_model.bin.index.json", "model.safetensors.index.json"};
inline constexpr std::string_view optim_indexes[] = {"pytorch_optim.bin.index.json", "optimizer.safetensors.index.json"};

/// The index file of `dir` among `names`, if any.
template <std::size_t N>
std::optional<std::filesystem::path> find_index(const std::filesystem::path& dir, const std::string_view (&names)[N]) {
  std::error_code ec;
  for (const auto& n : names)
    if (std::filesystem::is_regular_file(dir / n, ec)) return dir / n;
  return std::nullopt;
}

/// A shard file name ColossalAI's sharder gives (`pytorch_model-00001.bin`,
/// `model-stage-00002-shard-00001.safetensors`, `pytorch_optim-00003.bin`, `optimizer-00001.safetensors`).
inline bool is_hybrid_shard_name(const std::string& name) {
  static const std::regex re(R"((pytorch_model|model|pytorch_optim|optimizer)(-stage-\d{5}-shard)?-\d{5}\.(bin|safetensors))");
  return std::regex_match(name, re);
}

/// The pipeline stage of a shard file (`-stage-XXXXX-`), 0 when it has none.
inline std::uint64_t stage_of(const std::string& file) {
  static const std::regex re(R"(-stage-(\d{5})-shard-\d{5}\.)");
  std::smatch m;
  return std::regex_search(file, m, re) ? std::stoull(m[1].str()) : 0;
}

/// An index: its metadata and its weight map in file order.
struct Index {
  std::filesystem::path path;
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, std::string>> weight_map;
};

inline Index read_index(const std::filesystem::path& p, const limits& lim) {
  Index ix;
  ix.path = p;
  const auto doc = read_json(p, lim.max_json_bytes, errors::colossalai_bad_index);
  const std::string at = "file " + quote(p.string());
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object())
    throw_error(errors::colossalai_bad_index, at, "has no \"weight_map\" object");
  if (doc.contains("metadata")) {
    if (!doc["metadata"].is_object()) throw_error(errors::colossalai_bad_index, at, "\"metadata\" is not an object");
    ix.metadata = doc["metadata"];
  }
  if (doc["weight_map"].size() > lim.max_entries) throw_error(errors::colossalai_limit, at, "more entries than limits::max_entries");
  for (const auto& [k, v] : doc["weight_map"].items()) {
    if (!v.is_string()) throw_error(errors::colossalai_bad_index, at, "weight_map[" + quote(k) + "] is not a file name");
    ix.weight_map.emplace_back(k, v.get<std::string>());
  }
  return ix;
}

/// The model and optimizer folders of a released checkpoint at `dir`: `dir` itself or its
/// `modeling/` and `optimizer/` folders.
struct HybridDirs {
  std::optional<std::filesystem::path> model_index, optim_index;
};
inline HybridDirs hybrid_dirs(const std::filesystem::path& dir) {
  HybridDirs h;
  h.model_index = find_index(dir, model_indexes);
  if (!h.model_index) h.model_index = find_index(dir / "modeling", model_indexes);
  h.optim_index = find_index(dir, optim_indexes);
  if (!h.optim_index) h.optim_index = find_index(dir / "optimizer", optim_indexes);
  return h;
}

/// One parameter's optimizer state as stored: per key a tensor (located) or a value.
struct IdState {
  std::vector<std::pair<std::string, std::variant<Stored, Value>>> items;
  std::string file;
};

/// The state of every id of an optimizer folder, from its index.
inline std::map<std::int64_t, IdState> read_optim_states(const Index& ix, WeightFiles& files, const limits& lim) {
  std::map<std::int64_t, IdState> out;
  for (const auto& [key, file] : ix.weight_map) {
    const std::string at = "file " + quote(ix.path.string()) + ": weight_map[" + quote(key) + "]";
    std::int64_t id = 0;
    if (key.empty() || key.size() > 18 || key.find_first_not_of("0123456789") != std::string::npos)
      throw_error(errors::colossalai_bad_optimizer, at, "is not a parameter id");
    id = std::stoll(key);
    const WeightFile& wf = files.get(file, at, false);
    IdState st;
    st.file = file;
    if (wf.bin) {
      const Value& tree = wf.bin->tree;
      const Value* v = tree.as_dict().find(Key(id));
      if (!v) throw_error(errors::colossalai_bad_optimizer, at, "file " + quote(file) + " has no state for id " + key);
      if (!v->is_dict()) throw_error(errors::colossalai_bad_optimizer, at, "the state of id " + key + " is not a dict");
      for (const auto& [k, x] : v->as_dict()) {
        if (!k.is_string()) throw_error(errors::colossalai_bad_optimizer, at, "a state key of id " + key + " is not a string");
        if (x.is_tensor()) st.items.emplace_back(k.as_string(), files.locate(x.as_tensor(), at + ": " + quote(k.as_string())));
        else st.items.emplace_back(k.as_string(), x);
      }
    } else {
      // Async safetensors: keys "state.<id>.<key>", pickled values listed in non_tensor_keys.
      std::vector<std::string> non_tensor;
      if (auto it = wf.metadata.find("non_tensor_keys"); it != wf.metadata.end()) {
        const auto j = nlohmann::json::parse(it->second, nullptr, false);
        if (j.is_discarded() || !j.is_array())
          throw_error(errors::colossalai_bad_optimizer, "file " + quote(file), "__metadata__ non_tensor_keys is not a JSON list");
        for (const auto& x : j)
          if (x.is_string()) non_tensor.push_back(x.get<std::string>());
      }
      const std::string prefix = "state." + key + ".";
      for (const auto& [n, s] : wf.tensors) {
        if (n.compare(0, prefix.size(), prefix) != 0) continue;
        const std::string k = n.substr(prefix.size());
        if (k.empty() || k.find('.') != std::string::npos)
          throw_error(errors::colossalai_bad_optimizer, "file " + quote(file), "key " + quote(n) + " is not state.<id>.<key>");
        if (std::find(non_tensor.begin(), non_tensor.end(), n) == non_tensor.end()) {
          st.items.emplace_back(k, s);
          continue;
        }
        if (s.dtype != dtype::U8 || s.shape.size() != 1)
          throw_error(errors::colossalai_bad_optimizer, "file " + quote(file) + ": " + quote(n), "a pickled value must be a 1-D U8 tensor");
        const auto n_bytes = static_cast<std::uint64_t>(s.shape[0]);
        if (n_bytes > lim.max_value_bytes)
          throw_error(errors::colossalai_limit, "file " + quote(file) + ": " + quote(n), "pickled value larger than limits::max_value_bytes");
        std::vector<std::byte> bytes(static_cast<std::size_t>(n_bytes));
        if (!bytes.empty()) wf.st->source()->read(s.at.byte_offset, bytes);
        pickle::options po;
        po.limits = lim.torch.pickle;
        po.keep_unknown_objects = true;
        try {
          st.items.emplace_back(k, pickle::load(bytes, po).value);
        } catch (error& e) {
          e.add_context("file " + quote(file) + ": " + quote(n));
          throw;
        }
      }
      if (st.items.empty()) throw_error(errors::colossalai_bad_optimizer, at, "file " + quote(file) + " has no state for id " + key);
    }
    if (!out.emplace(id, std::move(st)).second) throw_error(errors::colossalai_bad_optimizer, at, "id " + key + " is listed twice");
  }
  return out;
}

/// The parameter name of every optimizer id (see the top of this file).
inline std::map<std::int64_t, std::string> names_for_ids(const Index& model, const std::map<std::int64_t, IdState>& states,
                                                        const std::vector<std::int64_t>& group_ids,
                                                        const std::unordered_map<std::string, const TensorInfo*>& params) {
  std::map<std::uint64_t, std::vector<std::string>> names_by_stage;
  for (const auto& [name, file] : model.weight_map) names_by_stage[stage_of(file)].push_back(name);
  std::vector<std::int64_t> ids = group_ids;
  std::sort(ids.begin(), ids.end());
  std::map<std::uint64_t, std::vector<std::int64_t>> ids_by_stage;
  if (names_by_stage.size() <= 1) {
    ids_by_stage[names_by_stage.empty() ? 0 : names_by_stage.begin()->first] = ids;
  } else {
    for (std::int64_t id : ids) {
      const auto it = states.find(id);
      if (it == states.end())
        throw_error(errors::colossalai_param_order, "parameter id " + std::to_string(id),
                    "has no optimizer state, so its pipeline stage (and its parameter) is unknown");
      ids_by_stage[stage_of(it->second.file)].push_back(id);
    }
  }
  std::map<std::int64_t, std::string> out;
  for (const auto& [stage, sids] : ids_by_stage) {
    const auto& names = names_by_stage[stage];
    if (sids.size() > names.size())
      throw_error(errors::colossalai_param_order, "pipeline stage " + std::to_string(stage),
                  std::to_string(sids.size()) + " optimizer ids for " + std::to_string(names.size()) + " model entries");
    for (std::size_t i = 0; i < sids.size(); ++i) out.emplace(sids[i], names[i]);
  }
  for (const auto& [id, st] : states) {
    const auto it = out.find(id);
    if (it == out.end())
      throw_error(errors::colossalai_param_order, "parameter id " + std::to_string(id), "has optimizer state but is in no param group");
    for (const auto& [k, item] : st.items) {
      if (k != "exp_avg" || !std::holds_alternative<Stored>(item)) continue;
      const TensorInfo* p = params.at(it->second);
      const shape_t& s = std::get<Stored>(item).shape;
      if (s != p->shape)
        throw_error(errors::colossalai_param_order, "parameter id " + std::to_string(id),
                    "is named " + quote(it->second) + " by the parameter order, but its exp_avg has shape " + to_string(s) +
                        " and the parameter " + to_string(p->shape) + " (was the optimizer built on model.parameters()?)");
    }
  }
  return out;
}

/// A whole stored tensor as a TensorInfo.
inline TensorInfo whole(const std::string& name, const Stored& s) {
  TensorInfo t{name, s.dtype, s.shape, {}};
  if (numel(s.shape) > 0) t.chunks.push_back(box_chunk(s, shape_t(s.shape.size(), 0), s.shape));
  return t;
}

/// Adds the optimizer state of `h` to `ck` (keyed by name) and builds its skeleton.
inline void add_optimizer(ShardedCheckpoint& ck, const HybridDirs& h, const Index& model, optim_shard::SourceTable& table,
                          const options& opt) {
  if (!h.optim_index)
    throw_error(errors::colossalai_bad_optimizer, "ColossalAI checkpoint " + quote(model.path.parent_path().string()),
                "the optimizer was asked for, but there is no pytorch_optim.bin.index.json or optimizer.safetensors.index.json "
                "beside the model or in optimizer/");
  const Index oix = read_index(*h.optim_index, opt.limits);
  const std::string oat = "file " + quote(oix.path.string());
  if (!oix.metadata.contains("param_groups") || !oix.metadata["param_groups"].is_string())
    throw_error(errors::colossalai_bad_optimizer, oat, "metadata has no \"param_groups\" file name");
  WeightFiles files(oix.path.parent_path(), opt.mode, opt.limits, table);
  const std::string gname = oix.metadata["param_groups"].get<std::string>();
  if (gname.empty() || gname.find('/') != std::string::npos || gname == "." || gname == "..")
    throw_error(errors::colossalai_bad_optimizer, oat, "param_groups " + quote(gname) + " is not a file name of the folder");
  const optim_shard::LoadedFile groups_file =
      formats::detail::load_rank_file(oix.path.parent_path() / gname, opt.mode, opt.limits.torch, oat);
  const std::string gat = "file " + quote(groups_file.name);
  optim_shard::Access a{errors::colossalai_bad_optimizer, gat};
  const List& groups = a.list(groups_file.tree, "the param groups");
  std::vector<std::int64_t> ids;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Dict& gd = a.dict(groups[g], "param group " + std::to_string(g));
    for (const Value& id : a.list(a.at(gd, "params", "param group " + std::to_string(g)), "params")) ids.push_back(a.integer(id, "a param id"));
  }
  {
    std::vector<std::int64_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw_error(errors::colossalai_bad_optimizer, gat, "a parameter id is listed in two param groups (or twice in one)");
  }
  const auto states = read_optim_states(oix, files, opt.limits);
  std::unordered_map<std::string, const TensorInfo*> params;
  for (const TensorInfo& t : ck.tensors) params.emplace(t.name, &t);
  const auto names = names_for_ids(model, states, ids, params);

  optim_shard::SkeletonBuilder sk;
  for (const TensorInfo& t : ck.tensors) sk.tensor(std::vector<std::string>{t.name}, t);
  std::vector<TensorInfo> extra;
  for (const auto& [id, st] : states) {
    const std::string& name = names.at(id);
    for (const auto& [k, item] : st.items) {
      const std::vector<std::string> path{"optim", "state", name, k};
      if (const Stored* s = std::get_if<Stored>(&item)) {
        TensorInfo t = whole("optim.state." + name + "." + k, *s);
        sk.tensor(path, t);
        extra.push_back(std::move(t));
      } else {
        sk.value(path, std::get<Value>(item));
      }
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& [k, v] : groups[g].as_dict()) {
      const std::vector<std::string> path{"optim", "param_groups", std::to_string(g), k.str()};
      if (k.is_string() && k.as_string() == "params") {
        List l;
        for (const Value& id : v.as_list()) l.emplace_back(names.at(id.as_int()));
        sk.value(path, Value::list(std::move(l)));
      } else {
        sk.value(path, v);
      }
    }
  }
  for (auto& t : extra) ck.tensors.push_back(std::move(t));
  ck.skeleton = sk.build();
}

/// Describes the released layout at `dir` (the model; with options::with_optimizer, the optimizer).
inline ShardedCheckpoint describe_hybrid(const std::filesystem::path& dir, const options& opt) {
  const HybridDirs h = hybrid_dirs(dir);
  if (!h.model_index)
    throw_error(errors::colossalai_not_found, "directory " + quote(dir.string()),
                "has no pytorch_model.bin.index.json or model.safetensors.index.json (nor a modeling/ folder with one)");
  const Index mix = read_index(*h.model_index, opt.limits);
  optim_shard::SourceTable table;
  WeightFiles files(h.model_index->parent_path(), opt.mode, opt.limits, table);
  ShardedCheckpoint ck;
  std::unordered_map<std::string, std::size_t> indexed;
  for (const auto& [name, file] : mix.weight_map) {
    const std::string at = "file " + quote(mix.path.string()) + ": " + quote(name);
    const WeightFile& wf = files.get(file, at);
    const Stored* s = wf.find(name);
    if (!s) throw_error(errors::colossalai_missing_tensor, at, "file " + quote(file) + " has no tensor " + quote(name));
    indexed.emplace(name, ck.tensors.size());
    ck.tensors.push_back(whole(name, *s));
  }
  for (const WeightFile& wf : files.loaded())
    for (const auto& [n, s] : wf.tensors)
      if (!indexed.count(n))
        throw_error(errors::colossalai_bad_index, "file " + quote(mix.path.string()),
                    "tensor " + quote(n) + " of " + quote(wf.name) + " is in no weight_map entry");
  ck.format = "colossalai_hybrid";
  ck.metadata["colossalai.layout"] = "released (HybridParallelCheckpointIO, gathered)";
  if (opt.with_optimizer) add_optimizer(ck, h, mix, table, opt);
  ck.sources = table.take();
  return ck;
}

}  // namespace statedict::inline v0::colossalai::detail
