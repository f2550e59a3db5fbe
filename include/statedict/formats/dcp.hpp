// statedict: torch.distributed.checkpoint (DCP) directories: detect, describe, write.
// SPDX-License-Identifier: MIT
//
// A DCP checkpoint is a directory with a pickled `.metadata` and data files `__<rank>_<n>.distcp`.
// `.metadata` holds a `Metadata` object: `state_dict_metadata` maps each saved key (fqn) to a
// TensorStorageMetadata (dtype, global size, chunks as offsets/sizes boxes) or a
// BytesStorageMetadata (a pickled non-tensor value); `storage_data` maps a MetadataIndex
// (fqn, chunk offset) to a _StorageInfo (relative path, byte offset, length); 2.x adds
// `planner_data`, the flatten mapping {flat key: path tuple}. Each item is a complete torch.save
// archive at [offset, offset + length) of its file. docs/formats/dcp.md has the details and the
// differences between torch 1.13 (`torch.distributed._shard.checkpoint`) and 2.x.
//
// Reading never executes the pickle: `.metadata` is unpickled with unknown classes kept as opaque
// objects (io/pickle_read.hpp), then every field used is validated here. Tensor items are located,
// not read: their zip directory and `data.pkl` give the storage record, and each chunk's Placement
// points at the record's bytes inside the `.distcp` file. Byte items are loaded as Values.
//
//   dcp::detect(dir)                 -> detection (found?, the rule that matched or what was seen)
//   dcp::read_metadata(dir)          -> Metadata (validated; no data file opened)
//   dcp::describe(dir, options)      -> ShardedCheckpoint (tensors with chunks into .distcp files,
//                                       the skeleton holding the non-tensor values)
//   dcp::write(checkpoint, dir, write_options{world_size M})
//                                    -> a DCP directory that M ranks load with PyTorch's reader:
//                                       dim-0 chunks (torch.chunk rule) for tensors with at least
//                                       M rows, rank 0 for the rest; values as bytes items
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

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/value.hpp"
#include "../core/visit.hpp"
#include "../io/file.hpp"
#include "../exec/executor.hpp"
#include "../exec/sink.hpp"
#include "../io/pickle_read.hpp"
#include "../io/pickle_write.hpp"
#include "../io/torch_file.hpp"
#include "../io/zip.hpp"
#include "../shard/box.hpp"
#include "../shard/checkpoint.hpp"
#include "../shard/cover.hpp"
#include "../shard/layout.hpp"
#include "../shard/plan.hpp"
#include "detail/describe_tree.hpp"
#include "detail/dcp_metadata.hpp"
#include "detail/dcp_write.hpp"
#include "format.hpp"
#include "detail/pyobj.hpp"
#include "detail/torch_refs.hpp"
namespace statedict::inline v0 {
namespace dcp {

struct options {
  dcp::limits limits{};
  /// How data files are opened (mmap or pread).
  read_mode mode = read_mode::mmap;
};

struct detection {
  bool found = false;
  /// The rule that matched ("dcp: .metadata is a pickled torch.distributed._shard.checkpoint
  /// Metadata (torch 1.13 layout); ..."), or what was looked for and what was found instead.
  std::string rule;
};

/// Says from content whether `dir` is a DCP checkpoint: a `.metadata` file holding a pickle whose
/// first global is a DCP `Metadata` class. Reads at most the first 4 KiB of `.metadata`; never
/// throws for a directory that is not DCP. `rule` names the rule that matched, or says what was
/// looked for and what was found.
inline detection detect(const std::filesystem::path& dir) {
  detection d;
  const std::string wanted = "dcp: wanted a .metadata pickle of torch.distributed[._shard].checkpoint Metadata; found ";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    d.rule = wanted + "no directory";
    return d;
  }
  const auto path = dir / ".metadata";
  std::size_t distcp = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".distcp") ++distcp;
    if (distcp > 1000) break;
  }
  const std::string files = std::to_string(distcp) + (distcp > 1000 ? "+" : "") + " .distcp file(s)";
  if (!std::filesystem::is_regular_file(path, ec)) {
    d.rule = wanted + "no .metadata file and " + files;
    return d;
  }
  std::string head;
  try {
    auto f = InputFile::open(path, read_mode::pread);
    head.resize(static_cast<std::size_t>(std::min<std::uint64_t>(f->size(), 4096)));
    f->read(0, std::as_writable_bytes(std::span<char>(head.data(), head.size())));
  } catch (const error& e) {
    d.rule = wanted + "an unreadable .metadata (" + std::string(e.what()) + ")";
    return d;
  }
  if (head.size() < 2 || static_cast<unsigned char>(head[0]) != 0x80) {
    d.rule = wanted + "a .metadata that is not a pickle (no PROTO opcode) and " + files;
    return d;
  }
  // The first global of the pickle is the Metadata class: text GLOBAL ("c<module>\n<name>\n") at
  // protocol <= 3, STACK_GLOBAL of two short strings (each followed by MEMOIZE) at protocol >= 4.
  auto has = [&](std::string_view module) {
    for (const char* sep : {"\n", "\x94"}) {
      const auto p = head.find(std::string(module) + sep);
      if (p == std::string::npos) continue;
      const std::string_view rest = std::string_view(head).substr(p + module.size(), 24);
      if (rest.find("Metadata") != std::string_view::npos) return true;
    }
    return false;
  };
  const std::string seen = " (.metadata: pickle protocol " + std::to_string(static_cast<unsigned char>(head[1])) + "; " + files + ")";
  if (has(detail::mod_113)) {
    d.found = true;
    d.rule = "dcp: .metadata is a pickled torch.distributed._shard.checkpoint Metadata (torch 1.13 layout)" + seen;
  } else if (has(detail::mod_2)) {
    d.found = true;
    d.rule = "dcp: .metadata is a pickled torch.distributed.checkpoint Metadata (torch 2.x layout)" + seen;
  } else {
    d.rule = wanted + "a pickle without a DCP Metadata class" + seen;
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
// Describing

namespace detail {

/// Places `leaf` at `path` in `root`, creating dicts for str keys and lists (padded with None) for
/// int keys, as DCP's unflatten (`set_element`) does.
inline void set_element(Value& root, const Path& path, Value leaf, const std::string& fqn, std::string_view where) {
  Value* cur = &root;
  for (std::size_t i = 0; i < path.size(); ++i) {
    const Key& k = path[i];
    const bool last = i + 1 == path.size();
    auto conflict = [&](std::string_view why) {
      throw_error(errors::dcp_name_conflict, std::string(where) + ": key " + quote(fqn),
                  "cannot place it at " + quote(dotted(path)) + ": " + std::string(why));
    };
    Value* next = nullptr;
    if (k.is_string()) {
      if (!cur->is_dict()) conflict("a non-dict value is already there");
      Dict& d = cur->as_dict();
      if (Value* ex = d.find(k)) {
        if (last) conflict("another item has that name");
        if (!ex->is_dict() && !ex->is_list()) conflict("another item's value is already there");
        next = ex;
      } else {
        next = &d.set(k, Value());
      }
    } else {
      if (!cur->is_list()) conflict("a non-list value is already there");
      List& l = cur->as_list();
      const auto idx = static_cast<std::uint64_t>(k.as_int());
      if (idx > l.size() + (std::uint64_t{1} << 20)) conflict("list index far beyond the items saved");
      while (l.size() <= idx) l.emplace_back();
      next = &l[static_cast<std::size_t>(idx)];
      if (last && !next->is_none()) conflict("another item has that index");
    }
    if (last) {
      *next = std::move(leaf);
      return;
    }
    if (next->is_none()) *next = path[i + 1].is_string() ? Value(Dict{}) : Value::list();
    cur = next;
  }
}

/// Directory state while describing: open data files once, check item ranges.
struct Files {
  std::filesystem::path dir;
  read_mode mode;
  std::uint64_t max_files;
  std::vector<std::shared_ptr<const ByteSource>> sources;
  std::map<std::string, std::uint32_t> index;

  std::uint32_t open(const std::string& rel, const std::string& where) {
    if (auto it = index.find(rel); it != index.end()) return it->second;
    if (sources.size() >= max_files)
      throw_error(errors::dcp_too_many_files, where, "more than limits.max_files (" + std::to_string(max_files) + ") data files");
    const auto p = dir / rel;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec))
      throw_error(errors::dcp_missing_file, where, "data file " + quote(rel) + " does not exist in " + quote(dir.string()));
    sources.push_back(InputFile::open(p, mode));
    const auto i = static_cast<std::uint32_t>(sources.size() - 1);
    index.emplace(rel, i);
    return i;
  }

  /// The item [offset, offset + length) of its file as a source of its own.
  std::shared_ptr<const ByteSource> item(std::uint32_t file, const StorageInfo& s, const std::string& where) const {
    const auto& f = sources[file];
    if (s.offset > f->size() || s.length > f->size() - s.offset)
      throw_error(errors::dcp_item_outside_file, where,
                  "item [" + std::to_string(s.offset) + ", " + std::to_string(s.offset + s.length) + ") lies outside " +
                      quote(s.relative_path) + " (" + std::to_string(f->size()) + " bytes)");
    return std::make_shared<SliceSource>(f, s.offset, s.length,
                                         s.relative_path + "[" + std::to_string(s.offset) + ":" +
                                             std::to_string(s.offset + s.length) + "]");
  }
};

inline statedict::detail::torch_refs::Tree load_item(const std::shared_ptr<const ByteSource>& item, const limits& lim,
                                                     const std::string& where) {
  statedict::detail::torch_refs::load_options o;
  o.pickle = lim.pickle;
  o.max_pickle_bytes = lim.max_item_pickle_bytes;
  if (item->size() < 4) throw_error(errors::dcp_item_not_archive, where, "item of " + std::to_string(item->size()) + " bytes is not a torch.save archive");
  std::byte sig[4];
  item->read(0, sig);
  if (sig[0] != std::byte{'P'} || sig[1] != std::byte{'K'} || sig[2] != std::byte{3} || sig[3] != std::byte{4})
    throw_error(errors::dcp_item_not_archive, where,
                "item does not start with a zip local header (PK\\x03\\x04): not a torch.save archive "
                "(items written with another serialization format are not supported)");
  try {
    return statedict::detail::torch_refs::load(item, o);
  } catch (error& e) {
    e.add_context(where);
    throw;
  }
}

}  // namespace detail

/// Describes `dir` as a DCP checkpoint: validates `.metadata`, opens the data files, locates every
/// tensor chunk inside its item (no tensor data is read) and loads the bytes items as Values (they
/// go into the skeleton; tensors inside them become tensors of the description).
inline ShardedCheckpoint describe(const std::filesystem::path& dir, const options& opt = {}) {
  namespace tr = statedict::detail::torch_refs;
  const std::string mdfile = (dir / ".metadata").string();
  const Metadata md = read_metadata(dir, opt.limits);
  detail::Files files{dir, opt.mode, opt.limits.max_files, {}, {}};
  ShardedCheckpoint ck;
  ck.format = "dcp";
  ck.metadata["dcp.classes"] = md.classes == class_names::torch_2 ? "torch.distributed.checkpoint (2.x)"
                                                                   : "torch.distributed._shard.checkpoint (1.13)";
  if (!md.version.empty()) ck.metadata["dcp.version"] = md.version;

  std::map<std::string, Path> mapping;
  if (md.flatten_mapping)
    for (const auto& [k, p] : *md.flatten_mapping) mapping.emplace(k, p);

  // Tensors collected in checkpoint order as they are placed; placeholders hold their index.
  std::vector<TensorInfo> tensors;
  Value root{Dict{}};
  for (const Entry& e : md.entries) {
    const std::string where = "file " + quote(mdfile) + ": key " + quote(e.fqn);
    Value leaf;
    if (e.tensor) {
      const TensorMeta& tm = *e.tensor;
      TensorInfo ti;
      ti.dtype = tm.dtype;
      ti.shape = tm.size;
      // One chunk per distinct box: replicated copies of the same box share one storage entry.
      std::vector<Box> boxes;
      for (std::size_t i = 0; i < tm.chunks.size(); ++i) {
        const ChunkMeta& c = tm.chunks[i];
        Box b{c.offsets, c.sizes};
        if (std::find(boxes.begin(), boxes.end(), b) != boxes.end()) continue;
        const StorageInfo& si = *md.find(StorageIndex{e.fqn, c.offsets});
        const std::string iw = where + ": chunk at " + to_string(c.offsets) + " in " + quote(si.relative_path);
        const std::uint32_t fi = files.open(si.relative_path, iw);
        auto item = files.item(fi, si, iw);
        const tr::Tree t = detail::load_item(item, opt.limits, iw);
        if (!tr::is_ref(t.value))
          throw_error(errors::dcp_item_not_tensor, iw, "tensor item holds " + statedict::detail::pyobj::kind_of(t.value) + ", not a tensor");
        const tr::TensorRef& r = t.tensors[tr::ref_index(t.value)];
        if (r.dtype != tm.dtype)
          throw_error(errors::dcp_item_dtype, iw,
                      "stored tensor is " + std::string(name(r.dtype)) + ", .metadata says " + std::string(name(tm.dtype)));
        if (r.sizes != c.sizes)
          throw_error(errors::dcp_item_shape, iw,
                      "stored tensor has size " + to_string(r.sizes) + ", .metadata says " + to_string(c.sizes));
        boxes.push_back(b);
        if (is_empty(b) && !b.sizes.empty()) continue;
        Placement at;
        at.source = fi;
        at.byte_offset = checked_add(si.offset, r.byte_offset(), "item offset");
        at.stored = r.dtype;
        if (!is_contiguous(r.sizes, r.strides)) at.strides = r.strides;
        ti.chunks.push_back(Chunk{std::move(b), std::move(at)});
      }
      // Every element exactly once (distinct boxes must tile the tensor).
      if (numel(tm.size) > 0) {
        if (auto issue = cover(full_box(tm.size), boxes, false)) {
          if (issue->what == CoverIssue::kind::hole)
            throw_error(errors::dcp_incomplete_tensor, where,
                        "element " + to_string(issue->index) + " of the tensor of size " + to_string(tm.size) +
                            " is in no chunk");
          throw_error(errors::dcp_overlapping_chunks, where,
                      "chunks at " + to_string(boxes[issue->first].offsets) + " and " +
                          to_string(boxes[issue->second].offsets) + " overlap at element " + to_string(issue->index));
        }
      }
      tensors.push_back(std::move(ti));
      leaf = tr::make_ref(tensors.size() - 1);
    } else {
      const StorageInfo& si = *md.find(StorageIndex{e.fqn, std::nullopt});
      const std::string iw = where + ": bytes item in " + quote(si.relative_path);
      const std::uint32_t fi = files.open(si.relative_path, iw);
      auto item = files.item(fi, si, iw);
      tr::Tree t = detail::load_item(item, opt.limits, iw);
      // Tensors inside a bytes item (a nested state dict saved whole) become checkpoint tensors
      // whose one chunk is the tensor as stored in the item.
      std::vector<std::size_t> remap(t.tensors.size(), SIZE_MAX);
      visit(t.value, [&](const Path&, Value& v) {
        if (!tr::is_ref(v)) return visit_control::descend;
        const std::size_t ri = tr::ref_index(v);
        if (remap[ri] == SIZE_MAX) {
          const tr::TensorRef& r = t.tensors[ri];
          TensorInfo ti;
          ti.dtype = r.dtype;
          ti.shape = r.sizes;
          if (numel(r.sizes) > 0) {
            Placement at;
            at.source = fi;
            at.byte_offset = checked_add(si.offset, r.byte_offset(), "item offset");
            at.stored = r.dtype;
            if (!is_contiguous(r.sizes, r.strides)) at.strides = r.strides;
            ti.chunks.push_back(Chunk{full_box(r.sizes), std::move(at)});
          }
          tensors.push_back(std::move(ti));
          remap[ri] = tensors.size() - 1;
        }
        v = tr::make_ref(remap[ri]);
        return visit_control::skip;
      });
      leaf = std::move(t.value);
    }
    Path path;
    if (auto it = mapping.find(e.fqn); it != mapping.end()) path = it->second;
    else path.emplace_back(e.fqn);
    detail::set_element(root, path, std::move(leaf), e.fqn, "file " + quote(mdfile));
  }

  // Names (as flatten names them), tree order, and the skeleton with the non-tensor values.
  auto fin = statedict::detail::describe_tree::finish(root, tensors);
  ck.tensors = std::move(fin.tensors);
  ck.skeleton = std::move(fin.skeleton);
  ck.sources = std::move(files.sources);
  return ck;
}

// ---------------------------------------------------------------------------------------------
// The plug-in

/// torch.distributed.checkpoint directories: read in the 1.13 and 2.x layouts, written for M ranks
/// (save_options::world_size; settings `dcp::write_options` choose the layout).
class format final : public formats::Format {
 public:
  [[nodiscard]] std::string_view name() const noexcept override { return "dcp"; }
  [[nodiscard]] std::string_view title() const noexcept override { return "DCP"; }

  [[nodiscard]] formats::Detection detect(const formats::Input& in, const formats::open_options&) const override {
    if (!in.is_directory()) return formats::Detection::not_applicable();
    detection d = dcp::detect(in.path());
    return d.found ? formats::Detection::match(std::move(d.rule)) : formats::Detection::miss(std::move(d.rule));
  }
  [[nodiscard]] ShardedCheckpoint describe(const formats::Input& in, const formats::open_options& opt) const override {
    options o = opt.settings.get<options>();
    o.mode = opt.mode;
    return dcp::describe(in.path(), o);
  }

  [[nodiscard]] bool can_write() const noexcept override { return true; }
  [[nodiscard]] formats::output_claim claims_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    return opt.world_size ? formats::output_claim::by_options : formats::output_claim::none;
  }
  void check_output(const std::filesystem::path&, const formats::save_options& opt) const override {
    if (opt.max_shard_size)
      throw_error(errors::bad_save_option, "--max-shard-size", "does not apply to DCP output: its files are one per rank");
    if (opt.world_size && (*opt.world_size == 0 || *opt.world_size > (1U << 16)))
      throw_error(errors::dcp_bad_world_size, "--world-size " + std::to_string(*opt.world_size), "expected 1 to 65536 ranks");
  }
  std::vector<std::string> save(const ShardedCheckpoint& ck, const std::filesystem::path& out, const formats::save_options& opt) const override {
    write_options o = opt.settings.get<write_options>();
    o.world_size = opt.world_size.value_or(1);
    o.exec = opt.exec;
    o.plan = opt.plan;
    o.part = opt.part;
    o.index_only = opt.index_only;
    write(ck, out, o);
    return {};
  }
};

}  // namespace dcp
}  // namespace statedict::inline v0
