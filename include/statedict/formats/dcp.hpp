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
#include "detail/pyobj.hpp"
#include "detail/torch_refs.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
// 550-599: DCP metadata
inline constexpr error_id dcp_no_metadata        {550, error_kind::format,      "dcp.no_metadata"};
inline constexpr error_id dcp_metadata_too_large {551, error_kind::limit,       "dcp.metadata_too_large"};
inline constexpr error_id dcp_bad_metadata_class {552, error_kind::format,      "dcp.bad_metadata_class"};
inline constexpr error_id dcp_bad_field          {553, error_kind::format,      "dcp.bad_field"};
inline constexpr error_id dcp_unknown_storage_md {554, error_kind::format,      "dcp.unknown_storage_metadata"};
inline constexpr error_id dcp_bad_dtype          {555, error_kind::unsupported, "dcp.unsupported_dtype"};
inline constexpr error_id dcp_too_many_dims      {556, error_kind::limit,       "dcp.too_many_dims"};
inline constexpr error_id dcp_negative           {557, error_kind::format,      "dcp.negative_value"};
inline constexpr error_id dcp_chunk_rank         {558, error_kind::format,      "dcp.chunk_rank"};
inline constexpr error_id dcp_chunk_outside      {559, error_kind::format,      "dcp.chunk_outside_tensor"};
inline constexpr error_id dcp_too_many_chunks    {560, error_kind::limit,       "dcp.too_many_chunks"};
inline constexpr error_id dcp_too_many_entries   {561, error_kind::limit,       "dcp.too_many_entries"};
inline constexpr error_id dcp_bad_storage_key    {562, error_kind::format,      "dcp.bad_storage_key"};
inline constexpr error_id dcp_bad_storage_info   {563, error_kind::format,      "dcp.bad_storage_info"};
inline constexpr error_id dcp_bad_relative_path  {564, error_kind::security,    "dcp.bad_relative_path"};
inline constexpr error_id dcp_missing_file       {565, error_kind::format,      "dcp.missing_file"};
inline constexpr error_id dcp_item_outside_file  {566, error_kind::format,      "dcp.item_outside_file"};
inline constexpr error_id dcp_missing_storage    {567, error_kind::format,      "dcp.missing_storage"};
inline constexpr error_id dcp_duplicate_storage  {568, error_kind::format,      "dcp.duplicate_storage"};
inline constexpr error_id dcp_transformed_item   {569, error_kind::unsupported, "dcp.transformed_item"};
inline constexpr error_id dcp_bad_planner_data   {570, error_kind::format,      "dcp.bad_planner_data"};
inline constexpr error_id dcp_name_conflict      {571, error_kind::format,      "dcp.name_conflict"};
inline constexpr error_id dcp_too_many_files     {572, error_kind::limit,       "dcp.too_many_files"};
inline constexpr error_id dcp_unsupported_layout {573, error_kind::unsupported, "dcp.unsupported_layout"};
inline constexpr error_id dcp_incomplete_tensor  {574, error_kind::format,      "dcp.incomplete_tensor"};
inline constexpr error_id dcp_overlapping_chunks {575, error_kind::format,      "dcp.overlapping_chunks"};
// 730-749: DCP layout (items in data files, writing)
inline constexpr error_id dcp_item_not_tensor    {730, error_kind::format,      "dcp.item_not_tensor"};
inline constexpr error_id dcp_item_dtype         {731, error_kind::format,      "dcp.item_dtype_mismatch"};
inline constexpr error_id dcp_item_shape         {732, error_kind::format,      "dcp.item_shape_mismatch"};
inline constexpr error_id dcp_item_not_archive   {733, error_kind::format,      "dcp.item_not_archive"};
inline constexpr error_id dcp_bad_world_size     {740, error_kind::usage,       "dcp.bad_world_size"};
inline constexpr error_id dcp_write_unsupported  {741, error_kind::unsupported, "dcp.write_unsupported"};
inline constexpr error_id dcp_write_key_conflict {742, error_kind::key,         "dcp.write_key_conflict"};
inline constexpr error_id dcp_write_part         {743, error_kind::usage,       "dcp.write_part"};
// clang-format on
}  // namespace errors

namespace dcp {

/// Caps on hostile checkpoints. Each is checked before anything of that size is allocated.
struct limits {
  /// Bytes of `.metadata` read into memory (a 70B model's metadata is a few MB).
  std::uint64_t max_metadata_bytes = std::uint64_t{1} << 30;
  /// Entries of `state_dict_metadata` plus entries of `storage_data`.
  std::uint64_t max_entries = std::uint64_t{1} << 24;
  /// Chunks over all tensors.
  std::uint64_t max_chunks = std::uint64_t{1} << 24;
  /// Dimensions of one tensor.
  std::size_t max_dims = 64;
  /// Distinct data files.
  std::uint64_t max_files = std::uint64_t{1} << 20;
  /// Length of a planner_data path (nesting of the original state dict).
  std::size_t max_path_length = 1000;
  /// The unpickler's caps for `.metadata` and for each item's `data.pkl`.
  pickle::limits pickle{};
  /// Bytes of one item's `data.pkl` read into memory.
  std::uint64_t max_item_pickle_bytes = std::uint64_t{1} << 30;
};

struct options {
  dcp::limits limits{};
  /// How data files are opened (mmap or pread).
  read_mode mode = read_mode::mmap;
};

// ---------------------------------------------------------------------------------------------
// The metadata, validated

/// One chunk of a tensor, as `.metadata` lists it (a box of the global index space).
struct ChunkMeta {
  shape_t offsets;
  shape_t sizes;
  friend bool operator==(const ChunkMeta&, const ChunkMeta&) = default;
};

struct TensorMeta {
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t size;
  std::vector<ChunkMeta> chunks;  ///< in `.metadata` order (plan order, not offset order)
  bool requires_grad = false;
};

/// One `state_dict_metadata` entry: a tensor, or (no `tensor`) a bytes item.
struct Entry {
  std::string fqn;
  std::optional<TensorMeta> tensor;
};

/// A `storage_data` key: fqn plus the chunk's offsets (none for bytes items).
struct StorageIndex {
  std::string fqn;
  std::optional<shape_t> offset;
  friend auto operator<=>(const StorageIndex&, const StorageIndex&) = default;
  friend bool operator==(const StorageIndex&, const StorageIndex&) = default;
};

/// Where an item's bytes are: [offset, offset + length) of `relative_path` in the directory.
struct StorageInfo {
  std::string relative_path;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  friend bool operator==(const StorageInfo&, const StorageInfo&) = default;
};

/// Which class names the metadata uses.
enum class class_names : std::uint8_t {
  torch_1_13,  ///< torch.distributed._shard.checkpoint.* (PyTorch 1.13)
  torch_2,     ///< torch.distributed.checkpoint.* (PyTorch 2.x)
};

struct Metadata {
  class_names classes = class_names::torch_1_13;
  std::vector<Entry> entries;  ///< state_dict_metadata, in order
  std::map<StorageIndex, StorageInfo> storage;
  /// planner_data when it is the flatten mapping of DefaultSavePlanner: {flat key: path}.
  std::optional<std::vector<std::pair<std::string, Path>>> flatten_mapping;
  std::string version;  ///< Metadata.version ("" when absent, as in 1.13)

  [[nodiscard]] const StorageInfo* find(const StorageIndex& k) const {
    auto it = storage.find(k);
    return it == storage.end() ? nullptr : &it->second;
  }
};

namespace detail {
namespace po = statedict::detail::pyobj;

inline constexpr std::string_view mod_113 = "torch.distributed._shard.checkpoint.metadata";
inline constexpr std::string_view mod_2 = "torch.distributed.checkpoint.metadata";
inline constexpr std::string_view fs_113 = "torch.distributed._shard.checkpoint.filesystem";
inline constexpr std::string_view fs_2 = "torch.distributed.checkpoint.filesystem";
inline constexpr std::string_view st_meta = "torch.distributed._shard.sharded_tensor.metadata";

inline bool is_md_class(const Value& v, std::string_view name) {
  if (!v.is_object()) return false;
  const Object& o = v.as_object();
  return o.name == name && (o.module == mod_113 || o.module == mod_2);
}

inline std::string kinds() { return "TensorStorageMetadata or BytesStorageMetadata"; }

/// TensorProperties: `__getstate__` tuple (dtype, layout, requires_grad, memory format, pin_memory),
/// or an attribute dict (older pickles). Returns dtype and requires_grad; checks the layout.
inline std::pair<dtype, bool> tensor_properties(const po::Where& w, const Value& v) {
  if (!v.is_object() || v.as_object().name != "TensorProperties" ||
      (v.as_object().module != st_meta && v.as_object().module != mod_2))
    po::expected(errors::dcp_bad_field, w, "a TensorProperties object", v);
  const Object& o = v.as_object();
  const Value* dt = nullptr;
  const Value* layout = nullptr;
  const Value* rg = nullptr;
  Dict attrs;
  if (o.state.size() == 1 && o.state[0].is_tuple()) {
    const List& s = o.state[0].as_list();
    if (s.size() != 5)
      throw_error(errors::dcp_bad_field, w.text(),
                  "TensorProperties state has " + std::to_string(s.size()) + " items, expected 5 "
                  "(dtype, layout, requires_grad, memory_format, pin_memory)");
    dt = &s[0];
    layout = &s[1];
    rg = &s[2];
  } else {
    attrs = po::require_attributes(errors::dcp_bad_field, w, v, "TensorProperties");
    dt = &po::field(errors::dcp_bad_field, w, attrs, "dtype");
    layout = po::optional_field(attrs, "layout");
    rg = po::optional_field(attrs, "requires_grad");
  }
  std::string tname;
  const auto d = po::torch_dtype(errors::dcp_bad_field, w / "dtype", *dt, &tname);
  if (!d) throw_error(errors::dcp_bad_dtype, (w / "dtype").text(), "dtype torch." + tname + " is not supported");
  // layout: torch.serialization._get_layout('torch.strided') or the global torch.strided.
  if (layout && !layout->is_none()) {
    const bool strided =
        (layout->is_object() && layout->as_object().qualified() == "torch.serialization._get_layout" &&
         layout->as_object().args.size() == 1 && layout->as_object().args[0].is_string() &&
         layout->as_object().args[0].as_string() == "torch.strided") ||
        po::is_global(*layout, "torch", "strided");
    if (!strided)
      throw_error(errors::dcp_unsupported_layout, (w / "layout").text(),
                  "only strided (dense) tensors are supported, found " + po::kind_of(*layout));
  }
  bool requires_grad = false;
  if (rg && !rg->is_none()) requires_grad = po::as_bool(errors::dcp_bad_field, w / "requires_grad", *rg);
  return {*d, requires_grad};
}

inline shape_t sizes_field(const po::Where& w, const Value& v, const limits& lim) {
  shape_t s = po::as_ints(errors::dcp_bad_field, errors::dcp_too_many_dims, lim.max_dims, w, v);
  for (std::size_t d = 0; d < s.size(); ++d)
    if (s[d] < 0) throw_error(errors::dcp_negative, w.text(), "dimension " + std::to_string(d) + " of " + to_string(s) + " is negative");
  return s;
}

inline TensorMeta tensor_meta(const po::Where& w, const Value& v, const limits& lim, std::uint64_t& chunk_budget) {
  const Dict a = po::require_attributes(errors::dcp_bad_field, w, v, "TensorStorageMetadata");
  TensorMeta t;
  std::tie(t.dtype, t.requires_grad) = tensor_properties(w / "properties", po::field(errors::dcp_bad_field, w, a, "properties"));
  t.size = sizes_field(w / "size", po::field(errors::dcp_bad_field, w, a, "size"), lim);
  (void)byte_size(t.size, itemsize(t.dtype));  // element and byte counts fit 63 bits
  const Value& chunks = po::field(errors::dcp_bad_field, w, a, "chunks");
  if (!chunks.is_sequence()) po::expected(errors::dcp_bad_field, w / "chunks", "a list of ChunkStorageMetadata", chunks);
  const List& cl = chunks.as_list();
  if (cl.size() > chunk_budget)
    throw_error(errors::dcp_too_many_chunks, (w / "chunks").text(),
                std::to_string(cl.size()) + " chunks exceed the remaining limits.max_chunks (" + std::to_string(chunk_budget) + ")");
  chunk_budget -= cl.size();
  t.chunks.reserve(cl.size());
  const Box whole = full_box(t.size);
  for (std::size_t i = 0; i < cl.size(); ++i) {
    const po::Where cw = w / "chunks" / i;
    if (!is_md_class(cl[i], "ChunkStorageMetadata")) po::expected(errors::dcp_bad_field, cw, "a ChunkStorageMetadata object", cl[i]);
    const Dict ca = po::require_attributes(errors::dcp_bad_field, cw, cl[i], "ChunkStorageMetadata");
    ChunkMeta c;
    c.offsets = sizes_field(cw / "offsets", po::field(errors::dcp_bad_field, cw, ca, "offsets"), lim);
    c.sizes = sizes_field(cw / "sizes", po::field(errors::dcp_bad_field, cw, ca, "sizes"), lim);
    if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size())
      throw_error(errors::dcp_chunk_rank, cw.text(),
                  "chunk offsets " + to_string(c.offsets) + " and sizes " + to_string(c.sizes) + " do not have the " +
                      std::to_string(t.size.size()) + " dimensions of the tensor's size " + to_string(t.size));
    if (!contains(whole, Box{c.offsets, c.sizes})) {
      throw_error(errors::dcp_chunk_outside, cw.text(),
                  "chunk at offsets " + to_string(c.offsets) + " with sizes " + to_string(c.sizes) +
                      " is not inside the tensor's size " + to_string(t.size));
    }
    // contains() accepts an empty box anywhere; its offsets must still lie inside the tensor.
    for (std::size_t d = 0; d < c.offsets.size(); ++d)
      if (c.offsets[d] > t.size[d])
        throw_error(errors::dcp_chunk_outside, cw.text(),
                    "chunk offset " + to_string(c.offsets) + " lies beyond the tensor's size " + to_string(t.size));
    t.chunks.push_back(std::move(c));
  }
  return t;
}

/// A `storage_data` key: MetadataIndex(fqn, offset, index).
inline StorageIndex storage_index(const po::Where& w, const Value& v, const limits& lim) {
  if (!is_md_class(v, "MetadataIndex")) po::expected(errors::dcp_bad_storage_key, w, "a MetadataIndex object", v);
  const Dict a = po::require_attributes(errors::dcp_bad_storage_key, w, v, "MetadataIndex");
  StorageIndex k;
  k.fqn = po::as_str(errors::dcp_bad_storage_key, w / "fqn", po::field(errors::dcp_bad_storage_key, w, a, "fqn"));
  if (const Value* off = po::optional_field(a, "offset"); off && !off->is_none()) {
    shape_t o = po::as_ints(errors::dcp_bad_storage_key, errors::dcp_too_many_dims, lim.max_dims, w / "offset", *off);
    for (dim_t x : o)
      if (x < 0) throw_error(errors::dcp_negative, (w / "offset").text(), "negative chunk offset in " + to_string(o));
    k.offset = std::move(o);
  }
  if (const Value* idx = po::optional_field(a, "index"); idx && !idx->is_none())
    (void)po::as_int(errors::dcp_bad_storage_key, w / "index", *idx);  // a lookup hint; checked, not used
  return k;
}

/// A relative path that stays inside the checkpoint directory.
inline void check_relative_path(const po::Where& w, const std::string& p) {
  auto bad = [&](std::string_view why) {
    throw_error(errors::dcp_bad_relative_path, w.text(), "relative path " + quote(p) + " " + std::string(why));
  };
  if (p.empty()) bad("is empty");
  if (p.size() > 4096) bad("is longer than 4096 bytes");
  if (p.find('\0') != std::string::npos) bad("contains a NUL byte");
  if (p.front() == '/') bad("is absolute");
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t end = std::min(p.find('/', start), p.size());
    const std::string_view part(p.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") bad("has an empty, '.' or '..' component");
    start = end + 1;
  }
}

/// _StorageInfo(relative_path, offset, length[, transform_descriptors]).
inline StorageInfo storage_info(const po::Where& w, const Value& v) {
  if (!v.is_object() || v.as_object().name != "_StorageInfo" ||
      (v.as_object().module != fs_113 && v.as_object().module != fs_2))
    po::expected(errors::dcp_bad_storage_info, w, "a _StorageInfo object", v);
  const Dict a = po::require_attributes(errors::dcp_bad_storage_info, w, v, "_StorageInfo");
  StorageInfo s;
  s.relative_path = po::as_str(errors::dcp_bad_storage_info, w / "relative_path",
                               po::field(errors::dcp_bad_storage_info, w, a, "relative_path"));
  check_relative_path(w / "relative_path", s.relative_path);
  s.offset = po::as_count(errors::dcp_bad_storage_info, errors::dcp_negative, w / "offset",
                          po::field(errors::dcp_bad_storage_info, w, a, "offset"));
  s.length = po::as_count(errors::dcp_bad_storage_info, errors::dcp_negative, w / "length",
                          po::field(errors::dcp_bad_storage_info, w, a, "length"));
  if (s.offset > max_size || s.length > max_size - s.offset)
    throw_error(errors::dcp_bad_storage_info, w.text(),
                "offset " + std::to_string(s.offset) + " + length " + std::to_string(s.length) + " exceeds 2^63-1");
  if (const Value* td = po::optional_field(a, "transform_descriptors"); td && !td->is_none()) {
    if (!td->is_sequence()) po::expected(errors::dcp_bad_storage_info, w / "transform_descriptors", "a list of str", *td);
    if (!td->as_list().empty())
      throw_error(errors::dcp_transformed_item, (w / "transform_descriptors").text(),
                  "items stored through transforms (compression, ...) are not supported: " +
                      std::to_string(td->as_list().size()) + " descriptor(s)");
  }
  return s;
}

/// planner_data as DefaultSavePlanner's flatten mapping {str: tuple of str|int}; nullopt when it is
/// None or a planner-specific value of another shape.
inline std::optional<std::vector<std::pair<std::string, Path>>> flatten_mapping(const po::Where& w, const Value& v,
                                                                               const limits& lim) {
  if (v.is_none()) return std::nullopt;
  if (!v.is_dict()) return std::nullopt;  // a custom planner's data: not ours to interpret
  std::vector<std::pair<std::string, Path>> out;
  if (v.as_dict().size() > lim.max_entries)
    throw_error(errors::dcp_too_many_entries, w.text(), std::to_string(v.as_dict().size()) + " planner_data entries exceed limits.max_entries");
  out.reserve(v.as_dict().size());
  for (const auto& [k, path] : v.as_dict()) {
    if (!k.is_string()) throw_error(errors::dcp_bad_planner_data, w.text(), "key " + k.str() + " is not a str");
    const po::Where kw = w / k.as_string();
    if (!path.is_sequence()) po::expected(errors::dcp_bad_planner_data, kw, "a path tuple of str and int", path);
    const List& l = path.as_list();
    if (l.empty()) throw_error(errors::dcp_bad_planner_data, kw.text(), "empty path");
    if (l.size() > lim.max_path_length)
      throw_error(errors::dcp_bad_planner_data, kw.text(), "path of " + std::to_string(l.size()) + " keys exceeds limits.max_path_length");
    Path p;
    p.reserve(l.size());
    for (std::size_t i = 0; i < l.size(); ++i) {
      if (l[i].is_string()) p.emplace_back(l[i].as_string());
      else if (l[i].is_int() && l[i].as_int() >= 0) p.emplace_back(l[i].as_int());
      else po::expected(errors::dcp_bad_planner_data, kw / i, "a str or a non-negative int", l[i]);
    }
    out.emplace_back(k.as_string(), std::move(p));
  }
  return out;
}
}  // namespace detail

/// Validates an unpickled `.metadata` (keep_unknown_objects) and returns what it says. `file` names
/// it in messages. Checks every field used: classes, types, dtypes, non-negative sizes, chunk boxes
/// inside their tensor, one storage entry per chunk and per bytes item, safe relative paths,
/// offset + length without overflow. Data files are checked by describe().
inline Metadata parse_metadata(const Value& root, const limits& lim = {}, std::string_view file = ".metadata") {
  namespace po = statedict::detail::pyobj;
  const po::Where w{"file " + quote(file), ""};
  if (!detail::is_md_class(root, "Metadata"))
    throw_error(errors::dcp_bad_metadata_class, w.text(),
                "expected a pickled torch.distributed.checkpoint Metadata object, found " + po::kind_of(root));
  Metadata md;
  md.classes = root.as_object().module == detail::mod_2 ? class_names::torch_2 : class_names::torch_1_13;
  const Dict a = po::require_attributes(errors::dcp_bad_field, w, root, "Metadata");

  // state_dict_metadata
  const Value& sdm = po::field(errors::dcp_bad_field, w, a, "state_dict_metadata");
  if (!sdm.is_dict()) po::expected(errors::dcp_bad_field, w / "state_dict_metadata", "a dict of str keys", sdm);
  if (sdm.as_dict().size() > lim.max_entries)
    throw_error(errors::dcp_too_many_entries, (w / "state_dict_metadata").text(),
                std::to_string(sdm.as_dict().size()) + " entries exceed limits.max_entries (" + std::to_string(lim.max_entries) + ")");
  std::uint64_t chunk_budget = lim.max_chunks;
  md.entries.reserve(sdm.as_dict().size());
  for (const auto& [k, v] : sdm.as_dict()) {
    if (!k.is_string()) throw_error(errors::dcp_bad_field, (w / "state_dict_metadata").text(), "key " + k.str() + " is not a str");
    const po::Where ew = w / "state_dict_metadata" / k.as_string();
    Entry e;
    e.fqn = k.as_string();
    if (detail::is_md_class(v, "TensorStorageMetadata")) {
      e.tensor = detail::tensor_meta(ew, v, lim, chunk_budget);
    } else if (!detail::is_md_class(v, "BytesStorageMetadata")) {
      throw_error(errors::dcp_unknown_storage_md, ew.text(), "expected " + detail::kinds() + ", found " + po::kind_of(v));
    }
    md.entries.push_back(std::move(e));
  }

  // storage_data: {MetadataIndex: _StorageInfo}, a dict with object keys (an Object builtins.dict
  // with (key, value) items), or an empty dict.
  const Value& sd = po::field(errors::dcp_bad_field, w, a, "storage_data");
  const po::Where sw = w / "storage_data";
  const List* items = nullptr;
  if (sd.is_dict()) {
    if (!sd.as_dict().empty()) throw_error(errors::dcp_bad_storage_key, sw.text(), "keys are str or int, expected MetadataIndex objects");
  } else if (po::is_class(sd, {"builtins.dict", "collections.OrderedDict"}) && sd.as_object().args.empty()) {
    items = &sd.as_object().items;
  } else {
    po::expected(errors::dcp_bad_field, sw, "a dict {MetadataIndex: _StorageInfo}", sd);
  }
  if (items) {
    if (items->size() + md.entries.size() > lim.max_entries)
      throw_error(errors::dcp_too_many_entries, sw.text(), std::to_string(items->size()) + " entries exceed limits.max_entries");
    for (std::size_t i = 0; i < items->size(); ++i) {
      const Value& kv = (*items)[i];
      const po::Where iw = sw / i;
      if (!kv.is_tuple() || kv.as_list().size() != 2) po::expected(errors::dcp_bad_field, iw, "a (key, value) pair", kv);
      StorageIndex key = detail::storage_index(iw / "key", kv.as_list()[0], lim);
      StorageInfo info = detail::storage_info(iw / "value", kv.as_list()[1]);
      const std::string label = key.fqn + (key.offset ? " at " + to_string(*key.offset) : std::string());
      if (!md.storage.emplace(std::move(key), std::move(info)).second)
        throw_error(errors::dcp_duplicate_storage, iw.text(), "two storage entries for " + quote(label));
    }
  }

  // every chunk and every bytes item has its storage entry
  for (const Entry& e : md.entries) {
    const po::Where ew = w / "state_dict_metadata" / e.fqn;
    if (!e.tensor) {
      if (!md.find(StorageIndex{e.fqn, std::nullopt}))
        throw_error(errors::dcp_missing_storage, ew.text(), "bytes item has no storage_data entry");
      continue;
    }
    for (std::size_t i = 0; i < e.tensor->chunks.size(); ++i)
      if (!md.find(StorageIndex{e.fqn, e.tensor->chunks[i].offsets}))
        throw_error(errors::dcp_missing_storage, (ew / "chunks" / i).text(),
                    "chunk at offsets " + to_string(e.tensor->chunks[i].offsets) + " has no storage_data entry");
  }

  if (const Value* pd = po::optional_field(a, "planner_data")) md.flatten_mapping = detail::flatten_mapping(w / "planner_data", *pd, lim);
  if (const Value* ver = po::optional_field(a, "version"); ver && !ver->is_none())
    md.version = po::as_str(errors::dcp_bad_field, w / "version", *ver);
  return md;
}

// ---------------------------------------------------------------------------------------------
// Files

namespace detail {
inline std::string dir_where(const std::filesystem::path& dir) { return "directory " + quote(dir.string()); }

/// The unpickled `.metadata` of `dir` (unknown classes kept as objects, never executed).
inline Value load_metadata_value(const std::filesystem::path& dir, const limits& lim) {
  const auto path = dir / ".metadata";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw_error(errors::dcp_no_metadata, dir_where(dir), "no .metadata file (a DCP checkpoint directory has one)");
  auto f = InputFile::open(path, read_mode::pread);
  if (f->size() > lim.max_metadata_bytes)
    throw_error(errors::dcp_metadata_too_large, "file " + quote(path.string()),
                std::to_string(f->size()) + " bytes exceed limits.max_metadata_bytes (" + std::to_string(lim.max_metadata_bytes) + ")");
  const Region r = read_region(*f, 0, f->size());
  pickle::options po;
  po.limits = lim.pickle;
  po.keep_unknown_objects = true;
  try {
    return pickle::load(r.span(), po).value;
  } catch (error& e) {
    e.add_context("file " + quote(path.string()));
    throw;
  }
}
}  // namespace detail

/// Reads and validates `dir/.metadata` (no data file is opened).
inline Metadata read_metadata(const std::filesystem::path& dir, const limits& lim = {}) {
  const Value v = detail::load_metadata_value(dir, lim);
  return parse_metadata(v, lim, (dir / ".metadata").string());
}

/// What detect() found (the same shape as the other formats' detection).
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
// Writing

struct write_options {
  /// Ranks that will load the checkpoint (M); one `__<rank>_0.distcp` file per rank.
  std::uint32_t world_size = 1;
  /// Class names of `.metadata`: torch 1.13's (`torch.distributed._shard.checkpoint`, what the
  /// tests load with PyTorch 1.13) or 2.x's (`torch.distributed.checkpoint`, with the 2.x flatten
  /// rule and its planner_data mapping). See docs/formats/dcp.md.
  class_names classes = class_names::torch_1_13;
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

/// Writes `src` as a DCP checkpoint for `world_size` ranks into the directory `dir` (replaced
/// atomically: the directory appears complete or not at all). Tensors are chunked by shard_dim /
/// chunks_for; every chunk is a torch.save archive whose storage record the executor fills from
/// the source chunks (streaming, bounded memory, casting to each TensorInfo's dtype); non-tensor
/// values are bytes items (rank 0). Files: `__<rank>_0.distcp` for every rank, and `.metadata`.
inline void write(const ShardedCheckpoint& src, const std::filesystem::path& dir, const write_options& opt = {}) {
  namespace tr = statedict::detail::torch_refs;
  const std::uint32_t world = opt.world_size;
  if (world == 0 || world > (1U << 20))
    throw_error(errors::dcp_bad_world_size, "world size " + std::to_string(world) + " is not in [1, 2^20]");
  const detail::names_of nm(opt.classes);

  // The tree: unflatten the skeleton with placeholder views (reserved address space, never read),
  // each tensor at its own address with a gap, so a view_of node cannot pass for a tensor.
  const std::size_t n = src.tensors.size();
  std::vector<std::uint64_t> start(n);
  std::uint64_t total = 16;
  for (std::size_t i = 0; i < n; ++i) {
    const TensorInfo& t = src.tensors[i];
    if (opt.classes == class_names::torch_1_13 && info(t.dtype).storage_name.empty())
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
  const Value tree = unflatten(named, src.skeleton);
  auto tensor_index = [&](const TensorView& v) -> std::optional<std::size_t> {
    const auto off = static_cast<std::uint64_t>(v.data() - space->base());
    auto it = std::lower_bound(start.begin(), start.end(), off);
    if (it == start.end() || *it != off) return std::nullopt;
    const auto i = static_cast<std::size_t>(it - start.begin());
    const TensorInfo& t = src.tensors[i];
    if (v.dtype() != t.dtype || v.shape() != t.shape || !v.is_contiguous()) return std::nullopt;
    return i;
  };
  const std::vector<detail::WKey> keys = detail::state_keys(tree, opt.classes, tensor_index);

  // Items, per rank in key order.
  std::set<std::string> seen;
  std::vector<detail::WItem> items;
  std::uint64_t max_chunk = 0;
  for (const auto& k : keys) {
    if (!seen.insert(k.fqn).second)
      throw_error(errors::dcp_write_key_conflict, "key " + quote(k.fqn), "two items of the state dict have this name");
    if (!k.tensor) {
      detail::WItem it;
      it.key = k.fqn;
      it.value = copy_tree(*k.value);
      items.push_back(std::move(it));
      continue;
    }
    const TensorInfo& t = src.tensors[k.t];
    std::size_t ci = 0;
    for (auto& [rank, box] : chunks_for(t.shape, world)) {
      detail::WItem it;
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

  // Each item's archive, as torch.save writes it to a stream (folder "archive/").
  auto chunk_space = std::make_shared<torch::detail::reservation>(max_chunk + 16);
  torch::save_options so;
  so.archive_name = "archive";
  std::vector<std::uint64_t> file_size(world, 0);
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
  auto file_name = [](std::uint32_t r) { return "__" + std::to_string(r) + "_0.distcp"; };

  // .metadata
  Dict sdm;
  std::vector<Value> storage_items;
  std::map<std::string, std::size_t> entry_of;  // fqn -> chunks so far (for the index hint)
  for (const auto& it : items) {
    const std::string rel = file_name(it.rank);
    Dict info_state;
    info_state.set("relative_path", rel);
    info_state.set("offset", static_cast<std::int64_t>(it.offset));
    info_state.set("length", static_cast<std::int64_t>(it.plan.file_size()));
    Value info = detail::new_object(nm.fs, "_StorageInfo", Value(std::move(info_state)));
    Dict idx;
    idx.set("fqn", it.key);
    if (it.tensor) {
      const TensorInfo& t = src.tensors[it.t];
      Value* e = sdm.find(Key(it.key));
      if (!e) {
        Dict tsm;
        tsm.set("properties", detail::tensor_properties_value(nm, t.dtype));
        tsm.set("size", detail::torch_size(t.shape));
        tsm.set("chunks", Value::list());
        e = &sdm.set(Key(it.key), detail::new_object(nm.md, "TensorStorageMetadata", Value(std::move(tsm))));
      }
      Dict csm;
      csm.set("offsets", detail::torch_size(it.box.offsets));
      csm.set("sizes", detail::torch_size(it.box.sizes));
      e->as_object().state[0].as_dict().at(Key("chunks")).as_list().push_back(
          detail::new_object(nm.md, "ChunkStorageMetadata", Value(std::move(csm))));
      idx.set("offset", detail::torch_size(it.box.offsets));
      idx.set("index", static_cast<std::int64_t>(it.chunk));
    } else {
      sdm.set(Key(it.key), detail::new_object(nm.md, "BytesStorageMetadata", std::nullopt));
      idx.set("offset", Value());
      idx.set("index", Value());
    }
    List pair;
    pair.push_back(detail::new_object(nm.md, "MetadataIndex", Value(std::move(idx))));
    pair.push_back(std::move(info));
    storage_items.push_back(Value::tuple(std::move(pair)));
  }
  Dict md_state;
  md_state.set("state_dict_metadata", Value(std::move(sdm)));
  if (opt.classes == class_names::torch_2) {
    Dict mapping;
    for (const auto& k : keys) mapping.set(Key(k.fqn), Value::tuple(k.path));
    md_state.set("planner_data", Value(std::move(mapping)));
  } else {
    md_state.set("planner_data", Value());
  }
  Object sd{"builtins", "dict", object_build::reduce, {}, {}, std::move(storage_items)};
  md_state.set("storage_data", Value(std::move(sd)));
  const std::vector<std::byte> md_bytes =
      pickle::dumps(detail::new_object(nm.md, "Metadata", Value(std::move(md_state))));

  if (opt.index_only) {
    std::filesystem::create_directories(dir);
    std::vector<PlannedFile> planned;
    for (std::uint32_t r = 0; r < world; ++r) planned.push_back({file_name(r), file_size[r]});
    check_parts_written(dir, planned, errors::dcp_write_part, "DCP checkpoint", "rank file");
    OutputFile mf = OutputFile::create(dir / ".metadata");
    mf.write(md_bytes);
    mf.commit();
    return;
  }
  // Destination: each tensor item's storage record. A tensor stored under two keys (an alias in
  // the skeleton) gets a second source entry of its own name, so the planner sees two tensors.
  Destination dst;
  for (std::uint32_t r = 0; r < world; ++r) dst.names.push_back(file_name(r));
  dst.sizes = file_size;
  ShardedCheckpoint work;
  const ShardedCheckpoint* from = &src;
  std::map<std::pair<std::size_t, std::string>, std::size_t> dst_of;  // (tensor, key) -> dst tensor
  std::set<std::size_t> placed;
  std::vector<std::vector<FlatRange>> crc_regions(world);
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
  Plan plan = make_plan(*from, dst, opt.plan);
  std::vector<bool> mine(world, true);
  if (opt.part) {
    const auto parts = assign_parts(plan, opt.part->count);
    for (std::uint32_t r = 0; r < world; ++r) mine[r] = parts[r] == opt.part->index;
    plan = select_part(plan, *opt.part);
  }

  // Files: headers and small records now, storages through the executor, CRCs and directories last.
  std::optional<OutputDir> out;
  if (!opt.part) out.emplace(OutputDir::create(dir));
  else std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<OutputFile>> files(world);
  for (std::uint32_t r = 0; r < world; ++r) {
    if (!mine[r]) continue;
    // No resize up front: storages are written first, in ascending order, so the file mostly
    // grows at its end (filling a sparse file's holes is slower on ext4); the zip framing of
    // every item fills the gaps between them afterwards.
    files[r] = std::make_unique<OutputFile>(out ? out->create_file(file_name(r)) : OutputFile::create(dir / file_name(r)));
  }
  std::vector<std::unique_ptr<FileSink>> sinks(world);
  std::vector<Sink*> sink_ptrs(world, nullptr);
  for (std::uint32_t r = 0; r < world; ++r) {
    if (!files[r]) continue;
    sinks[r] = std::make_unique<FileSink>(*files[r]);
    std::sort(crc_regions[r].begin(), crc_regions[r].end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
    sinks[r]->track_crc32(crc_regions[r]);
    sink_ptrs[r] = sinks[r].get();
  }
  (void)execute(plan, *from, sink_ptrs, opt.exec);
  // Each item's framing in file order (local header, small record data, descriptor; central
  // directory): adjacent pieces, and the pieces of consecutive items, go out as one write.
  std::vector<std::optional<WriteCoalescer>> framing(world);
  for (std::uint32_t r = 0; r < world; ++r)
    if (files[r]) framing[r].emplace(*files[r]);
  for (const auto& it : items) {
    if (!files[it.rank]) continue;
    WriteCoalescer& f = *framing[it.rank];
    const auto& L = it.plan.layout;
    std::vector<std::uint32_t> crcs(it.plan.records.size(), 0);
    for (std::size_t e = 0; e < it.plan.records.size(); ++e) {
      const auto& rec = it.plan.records[e];
      if (!rec.storage) {
        crcs[e] = zip::crc32(rec.bytes);
      } else if (it.plan.storages[*rec.storage].nbytes > 0) {
        const std::uint64_t data = it.offset + L.entries[e].data_offset;
        const auto& regs = sinks[it.rank]->crc_regions();
        auto pos = std::lower_bound(regs.begin(), regs.end(), data, [](const FlatRange& a, std::uint64_t v) { return a.begin < v; });
        crcs[e] = sinks[it.rank]->crc32(static_cast<std::size_t>(pos - regs.begin()));
      }
      f.write(it.offset + L.entries[e].header_offset, zip::local_header_bytes(L.entries[e], L.options));
      if (!rec.storage) f.write(it.offset + L.entries[e].data_offset, rec.bytes);
      f.write(it.offset + L.entries[e].descriptor_offset, zip::descriptor_bytes(L.entries[e], crcs[e]));
    }
    f.write(it.offset + L.central_offset, zip::tail_bytes(L, crcs));
  }
  for (auto& f : framing)
    if (f) f->flush();
  for (auto& f : files)
    if (f) f->commit();
  if (!out) return;  // a part: the index step writes .metadata
  {
    OutputFile mf = out->create_file(".metadata");
    mf.write(md_bytes);
    mf.commit();
  }
  out->commit();
}

}  // namespace dcp
}  // namespace statedict::inline v0
