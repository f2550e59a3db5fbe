// statedict: writing torch.distributed.checkpoint directories for M ranks, in the layout of PyTorch
// 1.13 or 2.x, through the planner and the streaming executor (formats/dcp.hpp is the public header).
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../io/file.hpp"
#include "../../exec/executor.hpp"
#include "../../exec/sink.hpp"
#include "../../io/pickle_read.hpp"
#include "../../io/pickle_write.hpp"
#include "../../io/torch_file.hpp"
#include "../../io/torch_save.hpp"
#include "../../io/zip.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/cover.hpp"
#include "../../shard/layout.hpp"
#include "../../shard/plan.hpp"
#include "describe_tree.hpp"
#include "../format.hpp"
#include "../transform.hpp"
#include "dcp_metadata.hpp"
#include "write_files.hpp"
#include "pyobj.hpp"
#include "torch_refs.hpp"
namespace statedict::inline v0::dcp {

// ---------------------------------------------------------------------------------------------
// Writing

struct write_options {
  /// Ranks that will load the checkpoint (M); one `__<rank>_0.distcp` file per rank.
  std::uint32_t world_size = 1;
  /// The layout of the PyTorch that will load the checkpoint: 2.x's (`torch.distributed.checkpoint`
  /// classes, the 2.x flatten rule and its planner_data mapping; the default, since restarts happen
  /// on current PyTorch, whose dcp.load refuses the 1.13 class names) or 1.13's
  /// (`torch.distributed._shard.checkpoint`, which PyTorch 1.13 loads). See docs/formats/dcp.md.
  class_names classes = class_names::torch_2;
  exec_options exec{};
  plan_options plan{};
  /// Write only the rank files of part k of K (shard/plan.hpp assign_parts), each atomically,
  /// straight into `dir`; no `.metadata`. Several processes can each write one part.
  std::optional<PartSpec> part;
  /// Write only `.metadata`, after checking that every rank file exists with its planned size:
  /// the last step after all parts. The directory is complete when `.metadata` exists.
  bool index_only = false;
};

/// The writer's sharding rule: the dimension a tensor of `shape` is chunked along for `world`
/// ranks (dim 0 when it has at least `world` rows and at least one element), or nullopt: the whole
/// tensor is one item written by rank 0.
inline std::optional<std::size_t> shard_dim(std::span<const dim_t> shape, std::uint32_t world) {
  if (shape.empty() || world < 2 || shape[0] < static_cast<dim_t>(world) || numel(shape) == 0) return std::nullopt;
  return 0;
}

/// The chunks (rank, box) of a tensor by the writer's rule: torch.chunk along shard_dim (empty
/// trailing parts dropped, as ChunkShardingSpec does), or the whole tensor on rank 0.
inline std::vector<std::pair<std::uint32_t, Box>> chunks_for(std::span<const dim_t> shape, std::uint32_t world) {
  std::vector<std::pair<std::uint32_t, Box>> out;
  const auto dim = shard_dim(shape, world);
  if (!dim) {
    out.emplace_back(0, full_box(shape));
    return out;
  }
  for (std::uint32_t r = 0; r < world; ++r) {
    Box b = layout::split_box(shape, *dim, world, r, layout::split_rule::chunk);
    if (!is_empty(b)) out.emplace_back(r, std::move(b));
  }
  return out;
}

namespace detail {

/// One item the writer stores: a tensor chunk or a bytes value.
struct WItem {
  std::string key;       ///< fqn in state_dict_metadata
  bool tensor = false;
  std::size_t t = 0;     ///< index into ShardedCheckpoint::tensors (tensor items)
  Box box;               ///< tensor items: the chunk
  std::size_t chunk = 0; ///< position of the chunk in its tensor's chunk list
  Value value;           ///< bytes items
  torch::SavePlan plan;  ///< the item's torch.save archive
  std::uint32_t rank = 0;
  std::uint64_t offset = 0;  ///< in its rank file
};

/// A key of the state dict being written (fqn) with its path (2.x planner_data: dict keys as str,
/// sequence indices as int).
struct WKey {
  std::string fqn;
  List path;
  bool tensor = false;
  std::size_t t = 0;
  const Value* value = nullptr;
};

/// Encodes a path so that int and str keys never collide (for the "holds a tensor" set).
inline std::string path_code(const Path& p) {
  std::string s;
  for (const Key& k : p) {
    if (k.is_int()) s += "i" + std::to_string(k.as_int()) + ";";
    else s += "s" + std::to_string(k.as_string().size()) + ":" + k.as_string();
  }
  return s;
}

/// The state dict's items by the key rule of `classes` (docs/formats/dcp.md, "Keys"):
///  1.13: a dict, list or tuple that holds a tensor is recursed; every tensor is an item; every
///        subtree without tensors is one bytes item.
///  2.x:  DCP's flatten (traverse_state_dict): dicts always recursed (an empty dict gives nothing),
///        a list recursed when it holds a tensor, a dict or a recursed list, anything else a leaf.
/// Tensors are recognised by `tensor_index` (nullopt for a view of another tensor).
template <class TensorIndex>
std::vector<WKey> state_keys(const Value& root, class_names classes, TensorIndex&& tensor_index) {
  if (!root.is_dict())
    throw_error(errors::dcp_write_unsupported, "the state dict is a " + std::string(to_string(root.kind())) +
                                                   "; DCP stores a dict");
  // Which containers hold a tensor somewhere below (by path).
  std::set<std::string> holders;
  visit(root, [&](const Path& p, const Value& v) {
    if (!v.is_tensor()) return;
    Path q = p;
    while (!q.empty()) {
      q.pop_back();
      if (!holders.insert(path_code(q)).second) break;
    }
  });
  auto non_terminal_list = [&](const Value& list) {
    std::vector<const Value*> work{&list};
    while (!work.empty()) {
      const Value* v = work.back();
      work.pop_back();
      for (const Value& e : v->as_list()) {
        if (e.is_tensor() || e.is_dict()) return true;
        if (e.is_list()) work.push_back(&e);
      }
    }
    return false;
  };
  std::vector<WKey> out;
  struct frame {
    const Value* v;
    Path path;
    List dpath;
  };
  std::vector<frame> work;
  const auto& items = root.as_dict().items();
  for (std::size_t i = items.size(); i-- > 0;)
    work.push_back({&items[i].second, Path{items[i].first}, List{Value(items[i].first.str())}});
  while (!work.empty()) {
    frame f = std::move(work.back());
    work.pop_back();
    const Value& v = *f.v;
    const std::string fqn = dotted(f.path);
    if (v.is_tensor()) {
      const auto t = tensor_index(v.as_tensor());
      if (!t)
        throw_error(errors::dcp_write_unsupported, "key " + quote(fqn),
                    "a view into another tensor's elements cannot be a DCP item");
      out.push_back(WKey{fqn, std::move(f.dpath), true, *t, nullptr});
      continue;
    }
    const bool holds = holders.count(path_code(f.path)) != 0;
    bool recurse = false;
    if (classes == class_names::torch_1_13) recurse = holds && (v.is_dict() || v.is_sequence());
    else recurse = v.is_dict() || (v.is_list() && non_terminal_list(v));
    if (!recurse) {
      if (holds)
        throw_error(errors::dcp_write_unsupported, "key " + quote(fqn),
                    "a " + statedict::detail::pyobj::kind_of(v) + " holding tensors cannot be stored as a DCP item");
      out.push_back(WKey{fqn, std::move(f.dpath), false, 0, &v});
      continue;
    }
    if (v.is_dict()) {
      const auto& d = v.as_dict().items();
      for (std::size_t i = d.size(); i-- > 0;) {
        frame c{&d[i].second, f.path, f.dpath};
        c.path.push_back(d[i].first);
        c.dpath.emplace_back(d[i].first.str());
        work.push_back(std::move(c));
      }
    } else {
      const List& l = v.as_list();
      for (std::size_t i = l.size(); i-- > 0;) {
        frame c{&l[i], f.path, f.dpath};
        c.path.emplace_back(static_cast<std::int64_t>(i));
        c.dpath.emplace_back(static_cast<std::int64_t>(i));
        work.push_back(std::move(c));
      }
    }
  }
  return out;
}

// Metadata objects, as PyTorch pickles them.
struct names_of {
  std::string md, fs, props, mem_enum;
  explicit names_of(class_names c)
      : md(c == class_names::torch_2 ? mod_2 : mod_113),
        fs(c == class_names::torch_2 ? fs_2 : fs_113),
        props(c == class_names::torch_2 ? mod_2 : st_meta),
        mem_enum(c == class_names::torch_2 ? "_MEM_FORMAT_ENCODING" : "MEM_FORMAT_ENCODING") {}
};

inline Value new_object(const std::string& module, const std::string& name, std::optional<Value> state) {
  Object o{module, name, object_build::newobj, {}, {}, {}};
  if (state) o.state.push_back(std::move(*state));
  return Value(std::move(o));
}

inline Value torch_size(const shape_t& s) {
  List l;
  for (dim_t d : s) l.emplace_back(d);
  Object o{"torch", "Size", object_build::reduce, {}, {}, {}};
  o.args.push_back(Value::tuple(std::move(l)));
  return Value(std::move(o));
}

inline Value global(const std::string& module, const std::string& name) {
  return Value(Object{module, name, object_build::global, {}, {}, {}});
}

inline Value tensor_properties_value(const names_of& n, dtype t) {
  Object layout{"torch.serialization", "_get_layout", object_build::reduce, {}, {}, {}};
  layout.args.emplace_back("torch.strided");
  Object mem{"builtins", "getattr", object_build::reduce, {}, {}, {}};
  mem.args.push_back(global(n.props, n.mem_enum));
  mem.args.emplace_back("TORCH_CONTIGUOUS_FORMAT");
  List state;
  state.push_back(global("torch", std::string(info(t).torch_name)));
  state.emplace_back(std::move(layout));
  state.emplace_back(false);
  state.emplace_back(std::move(mem));
  state.emplace_back(false);
  return new_object(n.props, "TensorProperties", Value::tuple(std::move(state)));
}

}  // namespace detail

namespace detail {

/// The tree `src` describes, with placeholder views for its tensors (reserved address space, never
/// read), each at its own address with a gap so that a view_of node cannot pass for a tensor, and
/// the DCP keys of its leaves (state_keys), which point into it.
struct keyed_tree {
  std::unique_ptr<Value> tree;
  std::vector<WKey> keys;
};

inline keyed_tree keys_of(const ShardedCheckpoint& src, class_names classes) {
  const std::size_t n = src.tensors.size();
  std::vector<std::uint64_t> start(n);
  std::uint64_t total = 16;
  for (std::size_t i = 0; i < n; ++i) {
    const TensorInfo& t = src.tensors[i];
    if (info(t.dtype).torch_name.empty())
      throw_error(errors::dcp_write_unsupported, "tensor " + quote(t.name),
                  "dtype " + std::string(name(t.dtype)) + " has no PyTorch dtype (a safetensors-only type)");
    if (classes == class_names::torch_1_13 && info(t.dtype).storage_name.empty())
      throw_error(errors::dcp_write_unsupported, "tensor " + quote(t.name),
                  "dtype " + std::string(name(t.dtype)) + " has no storage class in PyTorch 1.13 (write the 2.x layout)");
    start[i] = total;
    total = checked_add(total, checked_add(byte_size(t.shape, itemsize(t.dtype)), 31, "reservation") / 16 * 16, "reservation");
  }
  auto space = std::make_shared<torch::detail::reservation>(total);
  NamedTensors named;
  named.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const TensorInfo& t = src.tensors[i];
    named.emplace_back(t.name, TensorView::contiguous(t.dtype, t.shape, space->base() + start[i], space));
  }
  keyed_tree out;
  out.tree = std::make_unique<Value>(unflatten(named, src.skeleton));
  auto tensor_index = [&](const TensorView& v) -> std::optional<std::size_t> {
    const auto off = static_cast<std::uint64_t>(v.data() - space->base());
    auto it = std::lower_bound(start.begin(), start.end(), off);
    if (it == start.end() || *it != off) return std::nullopt;
    const auto i = static_cast<std::size_t>(it - start.begin());
    const TensorInfo& t = src.tensors[i];
    if (v.dtype() != t.dtype || v.shape() != t.shape || !v.is_contiguous()) return std::nullopt;
    return i;
  };
  out.keys = state_keys(*out.tree, classes, tensor_index);
  return out;
}

/// Every item of the output, per rank in key order, each planned as the torch.save archive
/// torch.save writes to a stream (folder "archive/"), placed in its rank file.
inline std::vector<WItem> plan_items(const ShardedCheckpoint& src, const std::vector<WKey>& keys, std::uint32_t world,
                                     std::vector<std::uint64_t>& file_size) {
  std::set<std::string> seen;
  std::vector<WItem> items;
  std::uint64_t max_chunk = 0;
  for (const auto& k : keys) {
    if (!seen.insert(k.fqn).second)
      throw_error(errors::dcp_write_key_conflict, "key " + quote(k.fqn), "two items of the state dict have this name");
    if (!k.tensor) {
      WItem it;
      it.key = k.fqn;
      it.value = copy_tree(*k.value);
      items.push_back(std::move(it));
      continue;
    }
    const TensorInfo& t = src.tensors[k.t];
    std::size_t ci = 0;
    for (auto& [rank, box] : chunks_for(t.shape, world)) {
      WItem it;
      it.key = k.fqn;
      it.tensor = true;
      it.t = k.t;
      it.chunk = ci++;
      it.rank = rank;
      max_chunk = std::max(max_chunk, byte_size(box.sizes, itemsize(t.dtype)));
      it.box = std::move(box);
      items.push_back(std::move(it));
    }
  }
  auto chunk_space = std::make_shared<torch::detail::reservation>(max_chunk + 16);
  torch::save_options so;
  so.archive_name = "archive";
  file_size.assign(world, 0);
  for (auto& it : items) {
    if (it.tensor) {
      const Value v(TensorView::contiguous(src.tensors[it.t].dtype, it.box.sizes, chunk_space->base(), chunk_space));
      it.plan = torch::plan_save(v, so);
    } else {
      it.plan = torch::plan_save(it.value, so);
    }
    it.offset = file_size[it.rank];
    file_size[it.rank] = checked_add(file_size[it.rank], it.plan.file_size(), "file size");
  }
  return items;
}

inline std::string rank_file_name(std::uint32_t r) { return "__" + std::to_string(r) + "_0.distcp"; }

/// The pickled `.metadata` of the output.
inline std::vector<std::byte> metadata_bytes(const ShardedCheckpoint& src, const std::vector<WKey>& keys, const std::vector<WItem>& items,
                                             class_names classes) {
  const names_of nm(classes);
  Dict sdm;
  std::vector<Value> storage_items;
  for (const auto& it : items) {
    Dict info_state;
    info_state.set("relative_path", rank_file_name(it.rank));
    info_state.set("offset", static_cast<std::int64_t>(it.offset));
    info_state.set("length", static_cast<std::int64_t>(it.plan.file_size()));
    Value info = new_object(nm.fs, "_StorageInfo", Value(std::move(info_state)));
    Dict idx;
    idx.set("fqn", it.key);
    if (it.tensor) {
      const TensorInfo& t = src.tensors[it.t];
      Value* e = sdm.find(Key(it.key));
      if (!e) {
        Dict tsm;
        tsm.set("properties", tensor_properties_value(nm, t.dtype));
        tsm.set("size", torch_size(t.shape));
        tsm.set("chunks", Value::list());
        e = &sdm.set(Key(it.key), new_object(nm.md, "TensorStorageMetadata", Value(std::move(tsm))));
      }
      Dict csm;
      csm.set("offsets", torch_size(it.box.offsets));
      csm.set("sizes", torch_size(it.box.sizes));
      e->as_object().state[0].as_dict().at(Key("chunks")).as_list().push_back(
          new_object(nm.md, "ChunkStorageMetadata", Value(std::move(csm))));
      idx.set("offset", torch_size(it.box.offsets));
      idx.set("index", static_cast<std::int64_t>(it.chunk));
    } else {
      sdm.set(Key(it.key), new_object(nm.md, "BytesStorageMetadata", std::nullopt));
      idx.set("offset", Value());
      idx.set("index", Value());
    }
    List pair;
    pair.push_back(new_object(nm.md, "MetadataIndex", Value(std::move(idx))));
    pair.push_back(std::move(info));
    storage_items.push_back(Value::tuple(std::move(pair)));
  }
  Dict md_state;
  md_state.set("state_dict_metadata", Value(std::move(sdm)));
  if (classes == class_names::torch_2) {
    Dict mapping;
    for (const auto& k : keys) mapping.set(Key(k.fqn), Value::tuple(k.path));
    md_state.set("planner_data", Value(std::move(mapping)));
  } else {
    md_state.set("planner_data", Value());
  }
  Object sd{"builtins", "dict", object_build::reduce, {}, {}, std::move(storage_items)};
  md_state.set("storage_data", Value(std::move(sd)));
  return pickle::dumps(new_object(nm.md, "Metadata", Value(std::move(md_state))));
}

/// Where every tensor element goes: each tensor item's storage record in its rank file. A tensor
/// stored under two keys (an alias in the skeleton) gets a second source entry of its own name in
/// `work`, so the planner sees two tensors; `from` is the description to plan from. `crc_regions`
/// gets each rank file's storage records.
inline Destination destination(const ShardedCheckpoint& src, const std::vector<WItem>& items, std::uint32_t world,
                               ShardedCheckpoint& work, const ShardedCheckpoint*& from, std::vector<std::vector<FlatRange>>& crc_regions) {
  Destination dst;
  for (std::uint32_t r = 0; r < world; ++r) dst.names.push_back(rank_file_name(r));
  from = &src;
  std::map<std::pair<std::size_t, std::string>, std::size_t> dst_of;  // (tensor, key) -> dst tensor
  std::set<std::size_t> placed;
  crc_regions.assign(world, {});
  for (const auto& it : items) {
    if (!it.tensor || it.plan.storages.empty() || it.plan.storages[0].nbytes == 0) continue;
    const std::uint64_t data = it.offset + it.plan.storage_offset(0);
    crc_regions[it.rank].push_back(FlatRange{data, data + it.plan.storages[0].nbytes});
    const TensorInfo& t = src.tensors[it.t];
    auto d = dst_of.find({it.t, it.key});
    if (d == dst_of.end()) {
      std::string dname = t.name;
      if (!placed.insert(it.t).second) {
        if (from == &src) {
          work.format = src.format;
          work.sources = src.sources;
          work.tensors = src.tensors;
          from = &work;
        }
        dname = std::string("\x01") + "dcp key " + it.key;
        work.tensors.push_back(TensorInfo{dname, t.dtype, t.shape, t.chunks});
      }
      dst.tensors.push_back(TensorInfo{dname, t.dtype, t.shape, {}});
      d = dst_of.emplace(std::make_pair(it.t, it.key), dst.tensors.size() - 1).first;
    }
    dst.tensors[d->second].chunks.push_back(Chunk{it.box, Placement{it.rank, data, {}, t.dtype}});
  }
  for (auto& regs : crc_regions)
    std::sort(regs.begin(), regs.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  return dst;
}

/// Writes the zip framing of every item of rank file `r` (local headers, small records,
/// descriptors, central directories), with the storage CRCs the sink computed; adjacent pieces, and
/// the pieces of consecutive items, go out as one write.
inline void write_framing(std::uint32_t r, const std::vector<WItem>& items, OutputFile& file, const FileSink& sink) {
  WriteCoalescer f(file);
  const auto& regs = sink.crc_regions();
  for (const auto& it : items) {
    if (it.rank != r) continue;
    const auto& L = it.plan.layout;
    std::vector<std::uint32_t> crcs(it.plan.records.size(), 0);
    for (std::size_t e = 0; e < it.plan.records.size(); ++e) {
      const auto& rec = it.plan.records[e];
      if (!rec.storage) {
        crcs[e] = zip::crc32(rec.bytes);
      } else if (it.plan.storages[*rec.storage].nbytes > 0) {
        const std::uint64_t data = it.offset + L.entries[e].data_offset;
        auto pos = std::lower_bound(regs.begin(), regs.end(), data, [](const FlatRange& a, std::uint64_t v) { return a.begin < v; });
        crcs[e] = sink.crc32(static_cast<std::size_t>(pos - regs.begin()));
      }
      f.write(it.offset + L.entries[e].header_offset, zip::local_header_bytes(L.entries[e], L.options));
      if (!rec.storage) f.write(it.offset + L.entries[e].data_offset, rec.bytes);
      f.write(it.offset + L.entries[e].descriptor_offset, zip::descriptor_bytes(L.entries[e], crcs[e]));
    }
    f.write(it.offset + L.central_offset, zip::tail_bytes(L, crcs));
  }
  f.flush();
}

}  // namespace detail

/// Writes `src` as a DCP checkpoint for `world_size` ranks into the directory `dir` (replaced
/// atomically: the directory appears complete or not at all). Tensors are chunked by shard_dim /
/// chunks_for; every chunk is a torch.save archive whose storage record the executor fills from
/// the source chunks (streaming, bounded memory, casting to each TensorInfo's dtype); non-tensor
/// values are bytes items (rank 0). Files: `__<rank>_0.distcp` for every rank, and `.metadata`.
/// With `part`, only that part's rank files; with `index_only`, only `.metadata` (the last step).
inline void write(const ShardedCheckpoint& src, const std::filesystem::path& dir, const write_options& opt = {}) {
  formats::check_consistent(src);
  const std::uint32_t world = opt.world_size;
  if (world == 0 || world > (1U << 20))
    throw_error(errors::dcp_bad_world_size, "world size " + std::to_string(world) + " is not in [1, 2^20]");
  const detail::keyed_tree kt = detail::keys_of(src, opt.classes);
  const std::vector<detail::WKey>& keys = kt.keys;
  std::vector<std::uint64_t> file_size;
  const std::vector<detail::WItem> items = detail::plan_items(src, keys, world, file_size);

  ShardedCheckpoint work;
  const ShardedCheckpoint* from = nullptr;
  std::vector<std::vector<FlatRange>> crc_regions;
  formats::detail::file_set files;
  files.dst = detail::destination(src, items, world, work, from, crc_regions);
  files.dst.sizes = file_size;
  // No resize up front: storages are written first, in ascending order, so a file mostly grows at
  // its end (filling a sparse file's holes is slower on ext4); the zip framing of every item fills
  // the gaps between them afterwards.
  files.prepare = [&](std::size_t r, OutputFile&, FileSink& sink) { sink.track_crc32(crc_regions[r]); };
  files.finish = [&](std::size_t r, OutputFile& f, FileSink& sink) { detail::write_framing(static_cast<std::uint32_t>(r), items, f, sink); };
  files.index_name = ".metadata";
  files.index_bytes = [&] { return detail::metadata_bytes(src, keys, items, opt.classes); };
  files.what = "DCP checkpoint";
  files.file_kind = "rank file";
  files.part_error = &errors::dcp_write_part;
  formats::save_options so;
  so.exec = opt.exec;
  so.plan = opt.plan;
  so.part = opt.part;
  so.index_only = opt.index_only;
  (void)formats::detail::write_file_set(*from, files, dir, so);
}

}  // namespace statedict::inline v0::dcp
