// statedict: the `.metadata` of torch.distributed.checkpoint directories: its types, parsed and
// validated from the pickle without running it (formats/dcp.hpp is the public header).
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
#include "../../io/zip.hpp"
#include "../../shard/box.hpp"
#include "../../shard/checkpoint.hpp"
#include "../../shard/cover.hpp"
#include "../../shard/layout.hpp"
#include "../../shard/plan.hpp"
#include "describe_tree.hpp"
#include "../format.hpp"
#include "pyobj.hpp"
#include "torch_refs.hpp"
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
  po::AttrView attrs;
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
  const po::AttrView a = po::require_attributes(errors::dcp_bad_field, w, v, "TensorStorageMetadata");
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
    const po::AttrView ca = po::require_attributes(errors::dcp_bad_field, cw, cl[i], "ChunkStorageMetadata");
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
  const po::AttrView a = po::require_attributes(errors::dcp_bad_storage_key, w, v, "MetadataIndex");
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
  const po::AttrView a = po::require_attributes(errors::dcp_bad_storage_info, w, v, "_StorageInfo");
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
  const po::AttrView a = po::require_attributes(errors::dcp_bad_field, w, root, "Metadata");

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
}  // namespace dcp
}  // namespace statedict::inline v0
