// statedict: torch.save files without PyTorch - read zero-copy, describe, write.
// SPDX-License-Identifier: MIT
//
// Reading (`torch::read`, `torch::load`): the zip format (PyTorch >= 1.6: `<archive>/data.pkl`
// plus one stored record per storage) and the legacy format (concatenated pickles followed by raw
// storages). The pickle is read by the safe unpickler (io/pickle_read.hpp); every tensor becomes a
// TensorView into the source (the file mapping), honouring storage offset, sizes and strides, and
// bounds-checked against its storage: a view reaching past its storage is a format error. Tensors
// that share a storage point at the same bytes. dtypes come from the storage class
// (`torch.FloatStorage`) or, for `_rebuild_tensor_v3` + `torch.UntypedStorage`, from the dtype
// argument. `nn.Parameter` becomes its tensor (or an Object when `keep_wrappers`), and
// `state_dict()._metadata` is kept in File::attributes (see docs/torch-files.md).
//
// Describing (`torch::describe`): a ShardedCheckpoint with the file as its single source and one
// chunk per tensor, whose Placement is the byte offset of the tensor's first element in the file
// and its strides; no tensor byte is read (for a pread source the views point into reserved,
// inaccessible address space, used only for offset arithmetic).
//
// Writing: io/torch_save.hpp plans a file the way torch.save writes it (`plan_save`,
// `PlannedWriter`); formats/torch.hpp streams the bytes (`torch::save`, `formats::write_torch`).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/flatten.hpp"
#include "../core/shape.hpp"
#include "../core/source.hpp"
#include "../core/tensor.hpp"
#include "../core/value.hpp"
#include "../shard/checkpoint.hpp"
#include "crc32.hpp"
#include "file.hpp"
#include "pickle_read.hpp"
#include "pickle_write.hpp"
#include "zip.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id pt_not_torch         {500, error_kind::format,      "torch.not_a_torch_file"};
inline constexpr error_id pt_missing_record    {501, error_kind::format,      "torch.missing_record"};
inline constexpr error_id pt_bad_storage       {502, error_kind::format,      "torch.bad_storage"};
inline constexpr error_id pt_bad_tensor        {503, error_kind::format,      "torch.bad_tensor"};
inline constexpr error_id pt_view_out_of_bounds{504, error_kind::format,      "torch.view_out_of_bounds"};
inline constexpr error_id pt_unsupported_dtype {505, error_kind::unsupported, "torch.unsupported_dtype"};
inline constexpr error_id pt_unsupported_tensor{506, error_kind::unsupported, "torch.unsupported_tensor"};
inline constexpr error_id pt_bad_legacy        {507, error_kind::format,      "torch.bad_legacy"};
inline constexpr error_id pt_legacy_tar        {508, error_kind::unsupported, "torch.legacy_tar"};
inline constexpr error_id pt_rank_limit        {509, error_kind::limit,       "torch.rank_limit"};
inline constexpr error_id pt_big_endian        {510, error_kind::unsupported, "torch.big_endian"};
inline constexpr error_id pt_bad_version       {511, error_kind::format,      "torch.bad_version"};
inline constexpr error_id pt_bad_byteorder     {512, error_kind::format,      "torch.bad_byteorder"};
inline constexpr error_id pt_protocol_0        {513, error_kind::format,      "torch.pickle_protocol_0"};
inline constexpr error_id pt_quantized_storage {514, error_kind::format,      "torch.quantized_storage"};
inline constexpr error_id pt_record_too_long   {515, error_kind::format,      "torch.record_too_long"};
inline constexpr error_id pt_no_version        {516, error_kind::format,      "torch.no_version"};
inline constexpr error_id pt_record_outside    {517, error_kind::format,      "torch.record_outside_archive"};
inline constexpr error_id pt_bad_alignment     {518, error_kind::format,      "torch.bad_storage_alignment"};
inline constexpr error_id pt_bad_location      {519, error_kind::format,      "torch.bad_location"};
inline constexpr error_id pt_unwritable        {520, error_kind::usage,       "torch.unwritable"};
inline constexpr error_id pt_crc_incomplete    {521, error_kind::usage,       "torch.crc_incomplete"};
inline constexpr error_id pt_bad_name          {522, error_kind::usage,       "torch.bad_archive_name"};
// clang-format on
}  // namespace errors

namespace torch {

/// Caps on hostile files (each layer's own limits plus the tensor rank).
struct limits {
  pickle::limits pickle{};
  zip::limits zip{};
  /// Dimensions of one tensor (PyTorch allows 64).
  std::size_t max_rank = 64;
};

struct load_options {
  torch::limits limits{};
  /// Objects of globals outside torch.load(weights_only=True)'s allow-list (argparse.Namespace
  /// args, numpy RNG states, config classes, whole pickled modules) are read as data: Object
  /// nodes of their class name, arguments and state, numpy arrays as tensors (pickle::options).
  /// Never imported or called either way. False refuses them as weights_only=True does
  /// (pickle.forbidden_global).
  bool keep_unknown_objects = true;
  /// Keep `nn.Parameter` and tensor-subclass wrappers as Objects around their tensor
  /// (`torch._utils._rebuild_parameter(tensor, requires_grad, hooks)`), so they are written back
  /// as Parameters. Default: a Parameter is its tensor.
  bool keep_wrappers = false;
  /// Verify the CRC-32 of every storage record (reads all tensor bytes).
  bool verify_crc = false;
  /// Read the storage ids and `_rebuild_tensor_v2` calls torch.save writes straight from the
  /// pickle reader's nodes (pickle::fast_fn), instead of converting their arguments to Values
  /// first. The File is the same either way (a test and the torch fuzz target compare the two);
  /// off only costs time. Any other shape of call takes the general path regardless.
  bool fast_paths = true;
  /// How a path is opened (torch::read(path)).
  read_mode mode = read_mode::mmap;
  /// Zip archives with at least this many entries have their local headers (where each record's
  /// bytes start: one small read per few storages) read on a second thread while the pickle is
  /// parsed. Meanwhile each storage's offset is predicted from torch's layout
  /// (zip::written_data_offset) and checked once the headers are in; an archive laid out
  /// otherwise is then read again the plain way. The File is the same either way (a test and the
  /// torch fuzz target compare). 0: always; SIZE_MAX: never (the headers are read first).
  std::size_t overlap_headers_from = 256;
};

/// One storage of the file.
struct Storage {
  std::string key;                 ///< persistent key ("0", or the legacy storage id)
  statedict::dtype dtype = statedict::dtype::U8;  ///< element type (U8 for an UntypedStorage)
  bool untyped = false;            ///< torch.UntypedStorage (dtype then comes from each tensor)
  std::uint64_t offset = 0;        ///< first byte in File::source (the file, or its records' image in memory)
  std::uint64_t nbytes = 0;
  std::string record;              ///< zip entry name (empty for legacy files)
  std::string location;            ///< "cpu", "cuda:0", ...
};

/// A torch.save file, read.
struct File {
  Value value;
  /// Python attributes of dicts in `value` (state_dict()._metadata), by path.
  std::vector<pickle::Attributes> attributes;
  std::string format;        ///< "zip" or "legacy"
  std::string archive_name;  ///< zip top folder ("model" for model.pt; "archive" when saved to a stream)
  /// What the tensors are views of: the file, or, when some of its zip records are compressed,
  /// an image in memory of its storage records (inflated or copied, each at a multiple of 64
  /// bytes; not zero-copy: `in_memory_bytes`, within zip::limits::max_inflated_bytes).
  std::shared_ptr<const ByteSource> source;
  std::size_t compressed_records = 0;  ///< storage records that were deflated in the archive
  std::uint64_t in_memory_bytes = 0;   ///< size of the image (0: views of the file itself)
  /// The file's `byteorder` record says "big": its storages hold big-endian elements.
  bool big_endian = false;
  /// The views see little-endian elements: a big-endian file read with read() (its storages
  /// swapped in the image). read_lazily() leaves them as stored; describe() then marks every
  /// placement big-endian and the executor swaps each element as it copies.
  bool swapped = false;
  std::vector<Storage> storages;  ///< in order of first use
  std::vector<std::string> records;  ///< zip entry names, in file order
  int pickle_protocol = 0;
  /// Address that stands for byte 0 of `source` in the tensor views (the mapping, a copy of a
  /// pread source, or reserved address space for describe()): view.data() - view_base is the
  /// byte offset in the source.
  const std::byte* view_base = nullptr;
  keep_alive view_owner;
};

/// What a file looks like from its first bytes.
enum class file_kind : std::uint8_t { zip, legacy, legacy_tar, unknown };

/// Whether `head` starts with the pickle torch's legacy format begins with: the magic number
/// 0x1950a86a20f9469cfc6c alone, as torch.save pickles it at any protocol. Protocols 0 and 1: the
/// text LONG `L119547037146038801333356L\n`; 2 and 3: PROTO, LONG1 of its 10 bytes; 4 and 5:
/// PROTO, FRAME, LONG1; then STOP.
inline bool legacy_magic(std::span<const std::byte> head) {
  static constexpr std::string_view text = "L119547037146038801333356L\n.";
  static constexpr unsigned char binary[] = {0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, '.'};
  const auto u = [&](std::size_t i) { return i < head.size() ? std::to_integer<unsigned>(head[i]) : 256U; };
  const auto at = [&](std::size_t i, const auto& what, std::size_t n) {
    if (head.size() < i + n) return false;
    for (std::size_t k = 0; k < n; ++k)
      if (u(i + k) != static_cast<unsigned char>(what[k])) return false;
    return true;
  };
  if (at(0, text, text.size())) return true;
  if (u(0) != 0x80 || u(1) < 2 || u(1) > 5) return false;
  std::size_t i = 2;
  if (u(1) >= 4 && u(2) == 0x95) i = 11;  // FRAME and its 8-byte length
  return at(i, binary, sizeof binary);
}

/// What a file is, from its first bytes (`head`, at least 4 of them when the file has them; the
/// legacy magic needs 28, the tar check 262) and its size.
inline file_kind kind_of(std::span<const std::byte> head, std::uint64_t size) {
  if (size < 4 || head.size() < 4) return file_kind::unknown;
  const auto u = [&](std::size_t i) { return std::to_integer<unsigned>(head[i]); };
  if (u(0) == 'P' && u(1) == 'K' && u(2) == 3 && u(3) == 4) return file_kind::zip;
  if (legacy_magic(head)) return file_kind::legacy;
  if (size >= 512 && head.size() >= 262 && std::memcmp(head.data() + 257, "ustar", 5) == 0) return file_kind::legacy_tar;
  return file_kind::unknown;
}

inline file_kind detect(const ByteSource& src) {
  std::byte b[262];
  const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(src.size(), sizeof b));
  src.peek(0, std::span<std::byte>(b, n));
  return kind_of(std::span<const std::byte>(b, n), src.size());
}

}  // namespace torch
}  // namespace statedict::inline v0

// The reader (zip and legacy layouts, the torch globals of the unpickler), which needs the types above.
#include "detail/torch_read.hpp"

namespace statedict::inline v0 {
namespace torch {

/// Reads a torch.save file: the tree with zero-copy tensors, attributes, storages.
inline File read(std::shared_ptr<const ByteSource> source, const load_options& opts = {}) {
  return detail::read_any(std::move(source), opts, false);
}
inline File read(const std::filesystem::path& path, const load_options& opts = {}) {
  return read(InputFile::open(path, opts.mode), opts);
}

/// The tree of a torch.save file (File::value; attributes such as _metadata are in read()).
inline Value load(std::shared_ptr<const ByteSource> source, const load_options& opts = {}) {
  return read(std::move(source), opts).value;
}
inline Value load(const std::filesystem::path& path, const load_options& opts = {}) { return read(path, opts).value; }

/// The metadata key under which describe() stores dict attributes (state_dict()._metadata).
inline constexpr std::string_view attributes_metadata_key = "torch.attributes";

/// Encodes dict attributes as JSON (each path and attribute dict as a flatten skeleton).
inline std::string encode_attributes(const std::vector<pickle::Attributes>& attrs) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& a : attrs) {
    List keys;
    for (const Key& k : a.path) keys.push_back(k.is_int() ? Value(k.as_int()) : Value(k.as_string()));
    out.push_back({{"path", std::move(flatten(Value::tuple(std::move(keys))).skeleton).take_json()},
                   {"attributes", std::move(flatten(Value(a.attributes)).skeleton).take_json()}});
  }
  return out.dump();
}

/// Decodes encode_attributes(); throws a format error for anything else.
inline std::vector<pickle::Attributes> decode_attributes(std::string_view text) {
  std::vector<pickle::Attributes> out;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_array()) throw_error(errors::pt_bad_storage, "attributes metadata is not a JSON array");
  const NamedTensors none;
  for (const auto& item : j) {
    if (!item.is_object() || !item.contains("path") || !item.contains("attributes"))
      throw_error(errors::pt_bad_storage, "attributes metadata entry lacks path or attributes");
    const Value path = unflatten(none, item["path"]);
    const Value attrs = unflatten(none, item["attributes"]);
    if (!path.is_tuple() || !attrs.is_dict()) throw_error(errors::pt_bad_storage, "attributes metadata entry has the wrong kinds");
    pickle::Attributes a;
    for (const Value& k : path.as_list()) {
      if (k.is_int()) a.path.emplace_back(k.as_int());
      else if (k.is_string()) a.path.emplace_back(k.as_string());
      else throw_error(errors::pt_bad_storage, "attributes path holds a " + std::string(to_string(k.kind())));
    }
    a.attributes = attrs.as_dict();
    out.push_back(std::move(a));
  }
  return out;
}

/// A read file as the one description every format shares: the file is the single source, each
/// tensor of flatten(value) one chunk at the byte offset of its first element, with its strides
/// (tensors that share storage point at the same bytes). The skeleton is flatten's; dict
/// attributes go to metadata["torch.attributes"] (encode_attributes), the file format to
/// metadata["torch.format"], the zip folder to metadata["torch.archive_name"].
inline ShardedCheckpoint describe(const File& file) {
  ShardedCheckpoint ck;
  ck.format = "torch";
  ck.sources.push_back(file.source);
  FlatStateDict flat = flatten(file.value);
  ck.tensors.reserve(flat.tensors.size());
  const std::uint64_t size = file.source->size();
  for (auto& [name, v] : flat.tensors) {
    const auto addr = reinterpret_cast<std::uintptr_t>(v.data()), base = reinterpret_cast<std::uintptr_t>(file.view_base);
    std::uint32_t source = 0;
    std::uint64_t offset = addr - base;
    if (addr < base || addr - base > size) [[unlikely]] {
      // Not in the file's bytes: a numpy array copied out of the pickle (or viewing a copy of
      // it), held in memory by its view: a source of its own.
      if (!v.owner())
        throw_error(errors::pt_bad_tensor, detail::where(*file.source), "tensor " + quote(name) + " does not point into the file");
      source = static_cast<std::uint32_t>(ck.sources.size());
      offset = 0;
      ck.sources.push_back(std::make_shared<MemorySource>(file.source->name() + ": " + name, v.data(), v.extent_bytes(), v.owner()));
    }
    // Built in place: 10,000 tensors are 10,000 TensorInfo and Chunk moves otherwise.
    TensorInfo& ti = ck.tensors.emplace_back();
    ti.name = std::move(name);  // `flat` is ours: its names move into the description
    ti.dtype = v.dtype();
    ti.shape = v.shape();
    Chunk& c = ti.chunks.emplace_back();
    Box& region = std::get<Box>(c.region);  // a Chunk starts as a Box
    region.offsets = shape_t(v.rank(), 0);
    region.sizes = v.shape();
    c.at.source = source;
    c.at.byte_offset = offset;
    if (!v.is_contiguous()) c.at.strides = v.strides();
    c.at.stored = v.dtype();
    if (file.big_endian && !file.swapped) c.at.order = byte_order::big;
  }
  ck.skeleton = std::move(flat.skeleton);
  ck.metadata["torch.format"] = file.format;
  if (file.big_endian)
    ck.metadata["torch.byteorder"] = file.swapped ? "big: storages byte-swapped to little-endian in memory when read"
                                                  : "big: every element byte-swapped to little-endian as it is copied";
  if (file.compressed_records)
    ck.metadata["torch.records_in_memory"] = std::to_string(file.compressed_records) + " deflated record(s): " +
                                             std::to_string(file.in_memory_bytes) + " bytes of storage records inflated into memory (not zero-copy)";
  if (!file.archive_name.empty()) ck.metadata["torch.archive_name"] = file.archive_name;
  if (!file.attributes.empty()) ck.metadata[std::string(attributes_metadata_key)] = encode_attributes(file.attributes);
  return ck;
}

/// Reads a file for describing it: under pread the tensor views point into reserved address
/// space (their offsets only), so no tensor byte is read; under mmap they point into the mapping.
inline File read_lazily(std::shared_ptr<const ByteSource> source, const load_options& opts = {}) {
  return detail::read_any(std::move(source), opts, true);
}

/// Describes a torch.save file without reading any tensor byte (inspect).
inline ShardedCheckpoint describe(std::shared_ptr<const ByteSource> source, const load_options& opts = {}) {
  return describe(read_lazily(std::move(source), opts));
}
inline ShardedCheckpoint describe(const std::filesystem::path& path, const load_options& opts = {}) {
  return describe(InputFile::open(path, opts.mode), opts);
}

}  // namespace torch
}  // namespace statedict::inline v0
