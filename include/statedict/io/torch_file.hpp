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
// Writing (`torch::save`, `torch::plan_save` + `torch::PlannedWriter`): a file torch.load reads
// back equal to the tree, written the way torch.save writes it (see the writer section below).
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
  /// Keep objects of globals outside the weights_only allow-list as opaque Objects (DCP metadata,
  /// DeepSpeed config objects, ShardedTensor files). Never executed either way.
  bool keep_unknown_objects = false;
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
  std::uint64_t offset = 0;        ///< first byte in the source
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
  std::shared_ptr<const ByteSource> source;
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

inline file_kind detect(const ByteSource& src) {
  if (src.size() < 4) return file_kind::unknown;
  std::byte b[4];
  src.read(0, b);
  const auto u = [&](int i) { return std::to_integer<unsigned>(b[i]); };
  if (u(0) == 'P' && u(1) == 'K' && u(2) == 3 && u(3) == 4) return file_kind::zip;
  // Legacy: PROTO 2, then LONG1 of the 10-byte magic number 0x1950a86a20f9469cfc6c.
  if (u(0) == 0x80 && u(1) == 0x02 && u(2) == 0x8a && u(3) == 0x0a) return file_kind::legacy;
  if (src.size() >= 512) {
    std::byte t[8];
    src.read(257, t);
    if (std::memcmp(t, "ustar", 5) == 0) return file_kind::legacy_tar;
  }
  return file_kind::unknown;
}

namespace detail {

/// Reserved, inaccessible address space: views into it describe offsets without any bytes (used
/// to describe pread sources without reading tensor data, and for placeholder tensors).
class reservation {
 public:
  explicit reservation(std::uint64_t size) : size_(std::max<std::uint64_t>(size, 1)) {
    void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_error(errors::map_failed, "cannot reserve " + std::to_string(size_) + " bytes of address space");
    base_ = static_cast<std::byte*>(p);
  }
  reservation(const reservation&) = delete;
  reservation& operator=(const reservation&) = delete;
  ~reservation() { ::munmap(base_, static_cast<std::size_t>(size_)); }
  [[nodiscard]] const std::byte* base() const noexcept { return base_; }

 private:
  std::byte* base_ = nullptr;
  std::uint64_t size_;
};

/// The dtype of the storage class `module.name` (U8 for UntypedStorage, which sets `untyped`);
/// `global`: it was referenced, not called or built.
inline statedict::dtype storage_dtype(std::string_view module, std::string_view name, bool global, bool& untyped) {
  untyped = false;
  auto qualified = [&] { return std::string(module) + "." + std::string(name); };
  if (!global || (module != "torch" && module != "torch.cuda" && module != "torch.storage"))
    throw_error(errors::pt_bad_storage, "storage type " + quote(qualified()) + " is not a torch storage class");
  if (name == "UntypedStorage") {
    untyped = true;
    return statedict::dtype::U8;
  }
  if (auto t = dtype_from_storage_name(name)) return *t;
  if (name.rfind('Q', 0) == 0)
    throw_error(errors::pt_unsupported_tensor, "quantized storage " + quote(qualified()) + " is not supported");
  throw_error(errors::pt_bad_storage, "unknown storage class " + quote(qualified()));
}
inline statedict::dtype storage_dtype(const Object& cls, bool& untyped) {
  return storage_dtype(cls.module, cls.name, cls.how == object_build::global, untyped);
}

/// A storage as a Value: Object{torch.<Class>, how=reduce, args=[1-d view of its bytes (its
/// dtype, or U8 when untyped), key, location]}. It stays in the tree only when the pickle holds a
/// bare storage; the writer writes it back as a storage.
inline Value storage_value(std::string_view module, std::string_view name, TensorView bytes, std::string key, std::string location) {
  Object o{std::string(module), std::string(name), object_build::reduce, {}, {}, {}};
  o.args.reserve(3);
  o.args.emplace_back(std::move(bytes));
  o.args.emplace_back(std::move(key));
  o.args.emplace_back(std::move(location));
  return Value(std::move(o));
}
inline Value storage_value(const Object& cls, TensorView bytes, std::string key, std::string location) {
  return storage_value(cls.module, cls.name, std::move(bytes), std::move(key), std::move(location));
}

inline bool is_storage_object(const Object& o) {
  return (o.module == "torch" || o.module == "torch.cuda" || o.module == "torch.storage") &&
         o.name.size() > 7 && o.name.compare(o.name.size() - 7, 7, "Storage") == 0 && o.how == object_build::reduce &&
         o.args.size() == 3 && o.args[0].is_tensor() && o.args[0].as_tensor().rank() == 1 &&
         o.args[0].as_tensor().is_contiguous() && o.args[1].is_string();
}

inline std::int64_t int_arg(const Value& v, const char* what) {
  if (!v.is_int()) throw_error(errors::pt_bad_tensor, std::string(what) + " is a " + std::string(to_string(v.kind())) + ", not an int");
  return v.as_int();
}

inline shape_t dims_arg(const Value& v, const char* what, std::size_t max_rank) {
  if (!v.is_sequence())
    throw_error(errors::pt_bad_tensor, std::string(what) + " is a " + std::string(to_string(v.kind())) + ", not a tuple");
  const List& l = v.as_list();
  if (l.size() > max_rank)
    throw_error(errors::pt_rank_limit, std::string(what) + " has " + std::to_string(l.size()) + " dimensions, limits.max_rank is " +
                                           std::to_string(max_rank));
  shape_t s;
  s.reserve(l.size());
  for (const Value& d : l) {
    const std::int64_t x = int_arg(d, what);
    if (x < 0) throw_error(errors::pt_bad_tensor, std::string(what) + " " + to_string(s) + "... has a negative entry");
    s.push_back(x);
  }
  return s;
}

/// The tensor of type `t` at element `offset` of a storage of `storage_bytes` bytes at `base`,
/// with sizes and strides (in elements of `t`), checked to lie inside the storage.
inline TensorView make_view(statedict::dtype t, const std::byte* base, std::uint64_t storage_bytes, const keep_alive& owner,
                            std::int64_t offset, shape_t size, shape_t stride) {
  if (size.size() != stride.size())
    throw_error(errors::pt_bad_tensor, "size " + to_string(size) + " and stride " + to_string(stride) + " differ in rank");
  if (offset < 0) throw_error(errors::pt_bad_tensor, "negative storage offset " + std::to_string(offset));
  const std::uint64_t n = numel(size);
  const std::size_t item = itemsize(t);
  if (n == 0) {
    // An empty view addresses nothing; torch still requires the offset to lie in the storage.
    const std::uint64_t start = checked_mul(static_cast<std::uint64_t>(offset), item, "storage offset");
    if (start > storage_bytes)
      throw_error(errors::pt_view_out_of_bounds, "empty view at element offset " + std::to_string(offset) +
                                                     " lies past the end of its storage of " + std::to_string(storage_bytes) + " bytes");
    return TensorView(t, std::move(size), std::move(stride), base == nullptr ? nullptr : base + start, owner);
  }
  std::uint64_t last = static_cast<std::uint64_t>(offset);
  for (std::size_t i = 0; i < size.size(); ++i)
    last = checked_add(last, checked_mul(static_cast<std::uint64_t>(size[i] - 1), static_cast<std::uint64_t>(stride[i]), "view extent"),
                       "view extent");
  const std::uint64_t end = checked_mul(checked_add(last, 1, "view extent"), item, "view extent");
  if (end > storage_bytes)
    throw_error(errors::pt_view_out_of_bounds, "view of size " + to_string(size) + ", stride " + to_string(stride) +
                                                   " at element offset " + std::to_string(offset) + " needs " +
                                                   std::to_string(end) + " bytes of a storage of " +
                                                   std::to_string(storage_bytes) + " bytes (" + std::string(name(t)) + ")");
  return TensorView(t, std::move(size), std::move(stride), base + static_cast<std::uint64_t>(offset) * item, owner);
}
/// The same for a storage Value (storage_value); `as` overrides its dtype (an UntypedStorage's).
inline TensorView make_view(const Object& storage, std::optional<statedict::dtype> as, std::int64_t offset, shape_t size,
                            shape_t stride) {
  const TensorView& bytes = storage.args[0].as_tensor();
  return make_view(as.value_or(bytes.dtype()), bytes.data(), bytes.nbytes(), bytes.owner(), offset, std::move(size), std::move(stride));
}

/// A storage class met in a persistent id (torch.FloatStorage, ...), checked once.
struct storage_class {
  std::string module;
  std::string name;
  statedict::dtype dtype;
  bool untyped;
};

/// A storage of a zip archive as read_zip placed it.
struct zip_storage {
  const zip::Entry* entry;
  const std::byte* data;  ///< the record's first byte (mapping, reservation or a copy)
  keep_alive owner;
  statedict::dtype dtype;  ///< as the key's first persistent id declared it
  std::uint64_t numel;
};

/// What a storage handle (pickle::options::persistent_handle, zip format) holds: the storage's
/// index in File::storages and the class its persistent id named.
struct storage_handle {
  std::uint32_t storage;
  std::uint32_t cls;
  [[nodiscard]] std::uint64_t pack() const noexcept { return std::uint64_t{cls} << 32 | storage; }
  static storage_handle unpack(std::uint64_t h) noexcept {
    return {static_cast<std::uint32_t>(h & 0xFFFFFFFFU), static_cast<std::uint32_t>(h >> 32)};
  }
};

/// State of one read, shared with the registered functions.
struct read_context {
  const load_options* opts = nullptr;
  bool dry_run = false;  ///< legacy first pass: storages are not placed yet; tensors become None
  const std::vector<zip_storage>* storages = nullptr;     ///< what storage handles index (zip format)
  const std::vector<storage_class>* classes = nullptr;
};

inline const Object& storage_arg(const Value& v) {
  if (!v.is_object() || !is_storage_object(v.as_object()))
    throw_error(errors::pt_bad_tensor, "first argument is a " + std::string(to_string(v.kind())) + ", not a storage");
  return v.as_object();
}

/// Registers the tensor rebuild functions torch.save uses.
inline pickle::Registry torch_registry(const read_context& ctx) {
  pickle::Registry r = pickle::Registry::weights_only();
  const std::size_t max_rank = ctx.opts->limits.max_rank;
  auto v2 = [&ctx, max_rank](pickle::Call& c, bool v3, bool v1) -> Value {
    const List& a = c.args;
    const std::size_t need = v1 ? 4 : v3 ? 7 : 6;
    if (a.size() < need || a.size() > need + 1)
      throw_error(errors::pt_bad_tensor, c.callable.qualified() + " with " + std::to_string(a.size()) + " arguments");
    if (ctx.dry_run) return Value();
    const Object& st = storage_arg(a[0]);
    std::optional<statedict::dtype> as;
    if (v3) {
      if (!a[6].is_object() || a[6].as_object().how != object_build::global || a[6].as_object().module != "torch")
        throw_error(errors::pt_bad_tensor, "_rebuild_tensor_v3 dtype argument is not a torch dtype");
      as = dtype_from_torch_name(a[6].as_object().name);
      if (!as) throw_error(errors::pt_unsupported_dtype, "dtype " + quote("torch." + a[6].as_object().name) + " is not supported");
      if (st.args[0].as_tensor().dtype() != statedict::dtype::U8 && st.args[0].as_tensor().dtype() != *as)
        throw_error(errors::pt_bad_tensor, "_rebuild_tensor_v3 of a typed storage of another dtype");
    } else if (st.name == "UntypedStorage") {
      throw_error(errors::pt_bad_tensor, c.callable.qualified() + " of an UntypedStorage without a dtype");
    }
    const std::size_t meta = v1 ? 4 : v3 ? 7 : 6;
    if (a.size() > meta && !a[meta].is_none() && !(a[meta].is_dict() && a[meta].as_dict().empty()))
      throw_error(errors::pt_unsupported_tensor, "tensor with metadata (conjugate or negative bit) is not supported");
    return Value(make_view(st, as, int_arg(a[1], "storage offset"), dims_arg(a[2], "size", max_rank), dims_arg(a[3], "stride", max_rank)));
  };
  // _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) as torch.save
  // writes it, read in place: v2 gives the same Value for each call this accepts.
  auto v2_fast = [&ctx, max_rank](const pickle::Args& a) -> std::optional<Value> {
    using k = pickle::Args::kind;
    const bool handle = a.size() > 0 && a.kind_of(0) == k::handle;
    if (ctx.dry_run || a.size() < 6 || a.size() > 7 || (a.kind_of(0) != k::value && !handle) || a.kind_of(1) != k::integer ||
        a.kind_of(4) != k::boolean || !a.empty_dict(5))
      return std::nullopt;
    if (a.size() == 7 && a.kind_of(6) != k::none && !a.empty_dict(6)) return std::nullopt;
    const Value* st = nullptr;
    const zip_storage* zs = nullptr;
    if (handle) {
      const storage_handle h = storage_handle::unpack(a.handle(0));
      if ((*ctx.classes)[h.cls].untyped) return std::nullopt;
      zs = &(*ctx.storages)[h.storage];
    } else {
      st = &a.value(0);
      if (!st->is_object() || !is_storage_object(st->as_object()) || st->as_object().name == "UntypedStorage") return std::nullopt;
    }
    shape_t size, stride;
    if (!a.ints(2, max_rank, size) || !a.ints(3, max_rank, stride)) return std::nullopt;
    auto negative = [](const shape_t& s) { return std::any_of(s.begin(), s.end(), [](dim_t d) { return d < 0; }); };
    if (negative(size) || negative(stride)) return std::nullopt;
    if (zs)  // numel * itemsize was checked when the storage was placed
      return Value(make_view(zs->dtype, zs->data, zs->numel * itemsize(zs->dtype), zs->owner, a.integer(1), std::move(size), std::move(stride)));
    return Value(make_view(st->as_object(), std::nullopt, a.integer(1), std::move(size), std::move(stride)));
  };
  r.function("torch._utils._rebuild_tensor_v2", [v2](pickle::Call& c) { return v2(c, false, false); },
             ctx.opts->fast_paths ? pickle::fast_fn(v2_fast) : pickle::fast_fn());
  r.function("torch._utils._rebuild_tensor_v3", [v2](pickle::Call& c) { return v2(c, true, false); });
  r.function("torch._utils._rebuild_tensor", [v2](pickle::Call& c) { return v2(c, false, true); });

  // nn.Parameter: its tensor, or the call itself kept as an Object.
  auto keep_call = [](pickle::Call& c) {
    Object o{c.callable.module, c.callable.name, object_build::reduce, c.args, {}, {}};
    return Value(std::move(o));
  };
  auto parameter = [&ctx, keep_call](pickle::Call& c, std::size_t min_args, std::size_t max_args) -> Value {
    if (c.args.size() < min_args || c.args.size() > max_args)
      throw_error(errors::pt_bad_tensor, c.callable.qualified() + " with " + std::to_string(c.args.size()) + " arguments");
    if (ctx.dry_run) return Value();
    if (!c.args[0].is_tensor()) throw_error(errors::pt_bad_tensor, c.callable.qualified() + " of a non-tensor");
    if (ctx.opts->keep_wrappers) return keep_call(c);
    return c.args[0];
  };
  r.function("torch._utils._rebuild_parameter", [parameter](pickle::Call& c) { return parameter(c, 2, 3); });
  r.function("torch._utils._rebuild_parameter_with_state", [parameter](pickle::Call& c) { return parameter(c, 4, 4); });
  r.function("torch.nn.parameter.Parameter", [&ctx](pickle::Call& c) -> Value {
    // NEWOBJ Parameter(data[, requires_grad]) (older files); the tensor itself.
    if (c.args.empty() || c.args.size() > 2) throw_error(errors::pt_bad_tensor, "Parameter() with " + std::to_string(c.args.size()) + " arguments");
    if (ctx.dry_run) return Value();
    if (!c.args[0].is_tensor()) throw_error(errors::pt_bad_tensor, "Parameter() of a non-tensor");
    if (ctx.opts->keep_wrappers) {
      Object o{c.callable.module, c.callable.name, object_build::newobj, c.args, {}, {}};
      return Value(std::move(o));
    }
    return c.args[0];
  });
  // _rebuild_from_type_v2(func, new_type, args, state): a plain Tensor or Parameter without state
  // is func(*args); anything else (a subclass, attributes) stays as the call.
  r.function("torch._tensor._rebuild_from_type_v2", [&ctx, keep_call](pickle::Call& c) -> Value {
    if (c.args.size() != 4) throw_error(errors::pt_bad_tensor, "_rebuild_from_type_v2 with " + std::to_string(c.args.size()) + " arguments");
    if (ctx.dry_run) return Value();
    const Value& func = c.args[0];
    const Value& type = c.args[1];
    const Value& state = c.args[3];
    const bool plain_type = type.is_object() && type.as_object().how == object_build::global &&
                            (type.as_object().qualified() == "torch.Tensor" ||
                             type.as_object().qualified() == "torch.nn.parameter.Parameter");
    const bool no_state = state.is_none() || (state.is_dict() && state.as_dict().empty());
    if (plain_type && no_state && func.is_object() && c.args[2].is_tuple()) {
      Value t = c.reader.call(func.as_object(), c.args[2].as_list());
      if (t.is_tensor() && (!ctx.opts->keep_wrappers || type.as_object().name == "Tensor")) return t;
    }
    return keep_call(c);
  });
  // Tensor kinds statedict does not represent: a clear error, or the call kept as an Object.
  for (const char* f : {"_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_sparse_csr_tensor",
                        "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
                        "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"}) {
    r.function(std::string("torch._utils.") + f, [&ctx, keep_call](pickle::Call& c) -> Value {
      if (ctx.opts->keep_unknown_objects || ctx.dry_run) return keep_call(c);
      throw_error(errors::pt_unsupported_tensor, quote(c.callable.qualified()) +
                                                     " (quantized, sparse, meta or subclass tensors) is not supported; "
                                                     "keep_unknown_objects keeps it as an object");
    });
  }
  return r;
}

inline std::string where(const ByteSource& src) { return "file " + quote(src.name()); }

/// A storage key met again: torch.load keeps the storage its first persistent id made and ignores
/// what later ones say; a file whose ids disagree on dtype or element count is refused (both formats).
inline void check_same_storage(std::string_view key, statedict::dtype first_dtype, std::uint64_t first_numel,
                               statedict::dtype t, std::uint64_t numel) {
  if (first_dtype != t || first_numel != numel)
    throw_error(errors::pt_bad_storage, "storage " + quote(key) + " is described twice with different types or sizes (" +
                                            std::to_string(first_numel) + " " + std::string(name(first_dtype)) +
                                            " elements, then " + std::to_string(numel) + " " + std::string(name(t)) + ")");
}

inline bool is_storage_tag(const Value& v) {
  if (v.is_string()) return v.as_string() == "storage";
  if (v.is_bytes()) {
    const auto& d = v.as_bytes().data;
    return std::string_view(reinterpret_cast<const char*>(d.data()), d.size()) == "storage";
  }
  return false;
}

/// Base pointer and keep-alive for views: the source's mapping, or a reservation.
struct view_base {
  const std::byte* base = nullptr;
  keep_alive owner;
  bool real = false;  ///< base points at the source's bytes
};

inline view_base make_view_base(const ByteSource& src, bool lazy) {
  view_base b;
  if (const std::byte* d = src.data()) {
    b.base = d;
    b.owner = src.owner();
    b.real = true;
  } else if (lazy) {
    auto r = std::make_shared<reservation>(src.size());
    b.base = r->base();
    b.owner = r;
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// Zip format

/// `key` as a number below `bound` when it is one written the canonical way (decimal digits, no
/// leading zero but "0" itself): then it equals another such key exactly when the numbers do.
inline std::optional<std::size_t> key_number(std::string_view key, std::size_t bound) noexcept {
  if (key.empty() || key.size() > 9 || (key.size() > 1 && key[0] == '0')) return std::nullopt;
  std::size_t n = 0;
  for (const char c : key) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + static_cast<std::size_t>(c - '0');
  }
  if (n >= bound) return std::nullopt;
  return n;
}

inline File read_zip(std::shared_ptr<const ByteSource> src, const load_options& opts, bool lazy, bool may_overlap = true) {
  File f;
  f.format = "zip";
  f.source = src;
  const view_base vb = make_view_base(*src, lazy);
  // Storages become views into vb (no record is read) unless CRCs are checked or the source has
  // no address: only then are their local headers needed before the pickle.
  const bool views_only = vb.base && !(vb.real && opts.verify_crc);
  zip::read_options zo;
  zo.limits = opts.limits.zip;
  zo.verify_crc = opts.verify_crc && !lazy;
  zo.defer_local_headers = views_only && may_overlap;
  zip::Archive ar = zip::Archive::open(src, zo);
  const bool overlap = zo.defer_local_headers && ar.entries().size() >= opts.overlap_headers_from;
  if (zo.defer_local_headers && !overlap) ar.adopt_data_offsets(ar.data_offsets());
  // With `overlap`, the headers are read on `headers` from the pickle on; until the join, `ar`
  // is only read (data_offsets() is const; the few locate() calls come before the thread).
  std::vector<std::uint64_t> located;
  std::exception_ptr locate_failed;
  std::jthread headers;  // joined on every way out (declared after what it writes)
  std::vector<zip_storage> seen;       // per storage of f.storages
  std::vector<storage_class> classes;  // the storage classes persistent ids name
  bool mispredicted = false;  // a storage's record does not start where torch's layout puts it
  try {
    if (ar.entries().empty()) throw_error(errors::pt_missing_record, where(*src), "zip archive without entries");
    // The archive folder is the first entry's top folder (PyTorchStreamReader::init).
    const std::string& first = ar.entries().front().name;
    const auto slash = first.find('/');
    if (slash == std::string::npos)
      throw_error(errors::pt_missing_record, where(*src), "first zip entry " + quote(first) + " is not inside a folder");
    f.archive_name = first.substr(0, slash);
    const std::string prefix = f.archive_name + "/";
    const zip::Entry* pkl = ar.find(prefix + "data.pkl");
    if (!pkl) throw_error(errors::pt_missing_record, where(*src), "no record " + quote(prefix + "data.pkl") + ": not a torch.save file");
    if (overlap) ar.locate(*pkl);
    if (const zip::Entry* ver = ar.find(prefix + "version"); ver || (ver = ar.find(prefix + ".data/version"))) {
      if (overlap) ar.locate(*ver);
      ar.check_readable(*ver);
      const Region r = read_region(*src, ver->data_offset, std::min<std::uint64_t>(ver->size, 32));
      std::string v(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size));
      while (!v.empty() && (v.back() == '\n' || v.back() == '\r' || v.back() == ' ')) v.pop_back();
      if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos)
        throw_error(errors::pt_bad_version, where(*src), "record " + quote(ver->name) + " holds " + quote(v) + ", not a version number");
    }
    if (const zip::Entry* bo = ar.find(prefix + "byteorder")) {
      if (overlap) ar.locate(*bo);
      ar.check_readable(*bo);
      const Region r = read_region(*src, bo->data_offset, std::min<std::uint64_t>(bo->size, 16));
      const std::string_view v(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size));
      if (v == "big") throw_error(errors::pt_big_endian, where(*src), "big-endian file (byteorder record) is not supported");
    }
    const Region pickle_bytes = ar.read(*pkl);
    if (overlap) {
      try {
        headers = std::jthread([&] {
          try {
            located = ar.data_offsets();
          } catch (...) {
            locate_failed = std::current_exception();
          }
        });
      } catch (const std::system_error&) {  // no thread to be had: read them now
        located = ar.data_offsets();
      }
    }

    f.view_base = vb.base;
    f.view_owner = vb.owner;
    // Storages and their records by key. torch.save's keys are the numbers 0, 1, 2, ... in order
    // of first use, and its records are sorted as strings ("0", "1", "10", "100", ...): such keys
    // are looked up in two arrays indexed by the number (a hash table probed at random misses the
    // cache once per tensor); any other key goes through the hash index.
    statedict::detail::hash_index by_key;  // f.storages by key, for keys that are not numbers below n_entries
    const std::size_t n_entries = ar.entries().size();
    std::vector<std::uint32_t> storage_of_number(n_entries, statedict::detail::hash_index::npos);
    std::vector<std::uint32_t> record_of_number(n_entries, statedict::detail::hash_index::npos);
    const std::string data_prefix = prefix + "data/";
    for (std::size_t i = 0; i < n_entries; ++i) {
      const std::string& name = ar.entries()[i].name;
      if (name.size() > data_prefix.size() && name.compare(0, data_prefix.size(), data_prefix) == 0)
        if (const auto n = key_number(std::string_view(name).substr(data_prefix.size()), n_entries))
          record_of_number[*n] = static_cast<std::uint32_t>(i);  // names are unique: one entry per number
    }
    std::size_t next_entry = 0;            // where the next storage's record is looked for first
    read_context ctx{&opts, false, &seen, &classes};
    pickle::Registry reg = torch_registry(ctx);
    pickle::options po;
    po.limits = opts.limits.pickle;
    po.keep_unknown_objects = opts.keep_unknown_objects;
    po.registry = &reg;
    by_key.reserve(ar.entries().size());
    seen.reserve(ar.entries().size());
    f.storages.reserve(ar.entries().size());
    // The class a persistent id names, checked when first met (torch.save names one per dtype).
    std::size_t last_class = 0;
    auto class_of = [&](std::string_view module, std::string_view cls_name, bool global) -> std::uint32_t {
      const auto is = [&](const storage_class& c) { return c.name == cls_name && c.module == module; };
      if (global && last_class < classes.size() && is(classes[last_class])) return static_cast<std::uint32_t>(last_class);
      bool untyped = false;
      const statedict::dtype t = storage_dtype(module, cls_name, global, untyped);  // refuses what is not a storage class
      last_class = static_cast<std::size_t>(std::find_if(classes.begin(), classes.end(), is) - classes.begin());
      if (last_class == classes.size()) classes.push_back({std::string(module), std::string(cls_name), t, untyped});
      return static_cast<std::uint32_t>(last_class);
    };
    // ('storage', <class cls>, key, location, numel), its fields checked by the caller: the
    // storage's index in f.storages, placed when its key is first met.
    auto storage_index = [&](std::uint32_t cls, std::string_view key, std::string_view location, std::int64_t numel_in) -> std::uint32_t {
      const statedict::dtype t = classes[cls].dtype;
      if (numel_in < 0) throw_error(errors::pt_bad_storage, "storage " + quote(key) + " has a negative size");
      const auto numel = static_cast<std::uint64_t>(numel_in);
      const std::uint64_t nbytes = checked_mul(numel, itemsize(t), "storage size");
      const std::optional<std::size_t> number = key_number(key, n_entries);
      const std::uint32_t kh = number ? 0 : statedict::detail::hash_index::mix(std::hash<std::string_view>{}(key));
      std::uint32_t at = number ? storage_of_number[*number] : by_key.find(kh, [&](std::uint32_t i) { return f.storages[i].key == key; });
      if (at == statedict::detail::hash_index::npos) {
        // A number's record is in record_of_number. Other keys: writers that name storages
        // otherwise still tend to write records in order of first use, so the entry after the
        // previous storage's is tried before the name index (entry names are unique, so a match
        // there is the match).
        const auto& entries = ar.entries();
        const auto is_record = [&](const std::string& name) {
          return name.size() == data_prefix.size() + key.size() && name.compare(0, data_prefix.size(), data_prefix) == 0 &&
                 name.compare(data_prefix.size(), key.size(), key) == 0;
        };
        const zip::Entry* e = nullptr;
        if (number) {
          if (record_of_number[*number] == statedict::detail::hash_index::npos)
            throw_error(errors::pt_missing_record, "storage " + quote(key) + ": no record " + quote(data_prefix + std::string(key)));
          e = &entries[record_of_number[*number]];
        } else if (next_entry < entries.size() && is_record(entries[next_entry].name)) {
          e = &entries[next_entry];
        } else {
          const std::string rec = data_prefix + std::string(key);
          e = ar.find(rec);
          if (!e) throw_error(errors::pt_missing_record, "storage " + quote(key) + ": no record " + quote(rec));
        }
        next_entry = static_cast<std::size_t>(e - entries.data()) + 1;
        ar.check_readable(*e);
        zip_storage c{e, nullptr, {}, t, numel};
        std::uint64_t data_offset = e->data_offset;
        if (overlap) {
          // The prediction, checked after the join. One that cannot be right (its bytes would run
          // into the central directory) still gets a pointer inside the source, never used.
          data_offset = zip::written_data_offset(ar, *e);
          if (data_offset > ar.central_directory_offset() || e->size > ar.central_directory_offset() - data_offset) {
            mispredicted = true;
            data_offset = 0;
          }
        }
        if (views_only) {
          c.data = vb.base + data_offset;
          c.owner = vb.owner;
        } else {
          const Region r = ar.read(*e);  // verifies the CRC when asked; copies from a pread source
          c.data = r.data;
          c.owner = r.owner;
        }
        at = static_cast<std::uint32_t>(f.storages.size());
        // Members constructed where they live (assigning into a default Storage costs a
        // string replace per member, 10,000 storages over).
        f.storages.push_back(Storage{std::string(key), t, classes[cls].untyped, data_offset, e->size, e->name, std::string(location)});
        if (number) storage_of_number[*number] = at;
        else by_key.add(kh, at);
        seen.push_back(std::move(c));
      }
      const zip_storage& c = seen[at];
      check_same_storage(key, c.dtype, c.numel, t, numel);
      if (nbytes > c.entry->size)
        throw_error(errors::pt_bad_storage, "storage " + quote(key) + " of " + std::to_string(numel) + " " + std::string(name(t)) +
                                                " elements needs " + std::to_string(nbytes) + " bytes; its record holds " +
                                                std::to_string(c.entry->size));
      return at;
    };
    // A storage as the tree holds it bare: storage_value of its bytes, as this id names them.
    auto storage_object = [&](std::uint32_t cls, std::uint32_t at, std::string_view location) -> Value {
      const zip_storage& c = seen[at];
      TensorView bytes = TensorView::contiguous(c.dtype, {static_cast<dim_t>(c.numel)}, c.data, c.owner);
      return storage_value(classes[cls].module, classes[cls].name, std::move(bytes), f.storages[at].key, std::string(location));
    };
    po.persistent_load = [&](const Value& pid) -> Value {
      if (!pid.is_tuple() || pid.as_list().size() != 5 || !is_storage_tag(pid.at(0)))
        throw_error(errors::pt_bad_storage, "persistent id is not ('storage', type, key, location, numel)");
      const List& p = pid.as_list();
      if (!p[1].is_object() || !p[2].is_string() || !p[3].is_string() || !p[4].is_int())
        throw_error(errors::pt_bad_storage, "persistent id fields have the wrong types");
      const Object& cls = p[1].as_object();
      const std::uint32_t ci = class_of(cls.module, cls.name, cls.how == object_build::global);
      return storage_object(ci, storage_index(ci, p[2].as_string(), p[3].as_string(), p[4].as_int()), p[3].as_string());
    };
    // The id torch.save writes, read without converting it to a Value: a handle, which the fast
    // _rebuild_tensor_v2 form turns into a view and anything else into storage_object.
    std::uint32_t last_global = statedict::detail::hash_index::npos, last_global_class = 0;
    if (opts.fast_paths) {
      po.persistent_handle = [&](const pickle::Args& a) -> std::optional<std::uint64_t> {
        using k = pickle::Args::kind;
        if (a.size() != 5 || (a.kind_of(0) != k::str && a.kind_of(0) != k::bytes) || a.str(0) != "storage" ||
            a.kind_of(1) != k::global || a.kind_of(2) != k::str || a.kind_of(3) != k::str || a.kind_of(4) != k::integer)
          return std::nullopt;
        // torch.save memoizes the class global: one GLOBAL per storage class, referenced again by
        // every later storage of that class, so the class is resolved once per GLOBAL.
        const std::uint32_t gid = a.global_id(1);
        if (gid != last_global) {
          const auto [module, cls_name] = a.global(1);
          last_global_class = class_of(module, cls_name, true);
          last_global = gid;
        }
        const std::uint32_t ci = last_global_class;
        const std::uint32_t at = storage_index(ci, a.str(2), a.str(3), a.integer(4));
        // A key met again with another location: persistent_load makes that storage's Value.
        if (f.storages[at].location != a.str(3)) return std::nullopt;
        return storage_handle{at, ci}.pack();
      };
      po.handle_value = [&](std::uint64_t h) {
        const storage_handle sh = storage_handle::unpack(h);
        return storage_object(sh.cls, sh.storage, f.storages[sh.storage].location);
      };
    }
    try {
      pickle::Result res = pickle::load(pickle_bytes.span(), po);
      f.value = std::move(res.value);
      f.attributes = std::move(res.attributes);
      f.pickle_protocol = res.protocol;
    } catch (error& e) {
      e.add_context(where(*src) + ": record " + quote(pkl->name));
      throw;
    }
  } catch (...) {
    // Read first, a bad local header would have been the error: so it is here too.
    if (overlap) {
      if (headers.joinable()) {
        headers.join();
      } else if (located.empty()) {
        try {
          located = ar.data_offsets();
        } catch (...) {
          locate_failed = std::current_exception();
        }
      }
      if (locate_failed) std::rethrow_exception(locate_failed);
    }
    throw;
  }
  if (overlap) {
    if (headers.joinable()) headers.join();
    if (locate_failed) std::rethrow_exception(locate_failed);
    ar.adopt_data_offsets(located);
    for (std::size_t i = 0; i < seen.size() && !mispredicted; ++i) mispredicted = seen[i].entry->data_offset != f.storages[i].offset;
    // Not torch's layout (an archive rewritten by another zip tool): read it again, headers first.
    if (mispredicted) return read_zip(std::move(src), opts, lazy, false);
  }
  // The archive ends here: its entry names become the record list (moved, not copied).
  std::vector<zip::Entry> entries = ar.release_entries();
  f.records.reserve(entries.size());
  for (zip::Entry& e : entries) f.records.push_back(std::move(e.name));
  return f;
}

// ---------------------------------------------------------------------------------------------
// Legacy format

inline File read_legacy(std::shared_ptr<const ByteSource> src, const load_options& opts, bool lazy) {
  File f;
  f.format = "legacy";
  f.source = src;
  const Region all = read_region(*src, 0, src->size());  // a pread source is read once here
  const std::span<const std::byte> bytes = all.span();
  std::uint64_t pos = 0;
  pickle::options plain;
  plain.limits = opts.limits.pickle;
  auto next = [&](const char* what) {
    try {
      pickle::Result r = pickle::load(bytes.subspan(static_cast<std::size_t>(pos)), plain);
      pos += r.consumed;
      return r;
    } catch (error& e) {
      e.add_context(where(*src) + ": legacy " + std::string(what) + " at offset " + std::to_string(pos));
      throw;
    }
  };
  // Magic number 0x1950a86a20f9469cfc6c: beyond int64, so an Object builtins.int of its bytes.
  const pickle::Result magic = next("magic number");
  static constexpr std::uint8_t magic_bytes[] = {0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  if (!magic.value.is_object() || magic.value.as_object().args.size() != 1 || !magic.value.as_object().args[0].is_bytes() ||
      magic.value.as_object().args[0].as_bytes().data != std::vector<std::uint8_t>(std::begin(magic_bytes), std::end(magic_bytes)))
    throw_error(errors::pt_bad_legacy, where(*src), "legacy file does not start with torch's magic number");
  const pickle::Result version = next("protocol version");
  if (!version.value.is_int() || version.value.as_int() != 1001)
    throw_error(errors::pt_bad_legacy, where(*src), "legacy protocol version is not 1001");
  const pickle::Result sys_info = next("sys_info");
  if (sys_info.value.is_dict()) {
    if (const Value* le = sys_info.value.as_dict().find("little_endian"); le && le->is_bool() && !le->as_bool())
      throw_error(errors::pt_big_endian, where(*src), "big-endian legacy file is not supported");
  }
  const std::uint64_t object_pos = pos;

  // Pass 1: learn each storage's dtype and size from the persistent ids (tensors are not built).
  struct pending {
    statedict::dtype dtype;
    bool untyped;
    std::uint64_t numel;
    std::string location;
    Object cls;
  };
  std::map<std::string, pending> roots;
  read_context ctx{&opts, true};
  pickle::Registry reg = torch_registry(ctx);
  pickle::options po;
  po.limits = opts.limits.pickle;
  po.keep_unknown_objects = opts.keep_unknown_objects;
  po.registry = &reg;
  auto parse_pid = [&](const Value& pid, std::string& root, std::optional<std::tuple<std::string, std::int64_t, std::int64_t>>& view) {
    if (!pid.is_tuple() || pid.as_list().size() != 6 || !is_storage_tag(pid.at(0)))
      throw_error(errors::pt_bad_storage, "legacy persistent id is not ('storage', type, key, location, numel, view)");
    const List& p = pid.as_list();
    if (!p[1].is_object() || !p[2].is_string() || !p[3].is_string() || !p[4].is_int())
      throw_error(errors::pt_bad_storage, "legacy persistent id fields have the wrong types");
    root = p[2].as_string();
    if (p[4].as_int() < 0) throw_error(errors::pt_bad_storage, "storage " + quote(root) + " has a negative size");
    if (!p[5].is_none()) {
      if (!p[5].is_tuple() || p[5].as_list().size() != 3 || !p[5].at(0).is_string() || !p[5].at(1).is_int() || !p[5].at(2).is_int())
        throw_error(errors::pt_bad_storage, "legacy storage view metadata is not (key, offset, size)");
      view.emplace(p[5].at(0).as_string(), p[5].at(1).as_int(), p[5].at(2).as_int());
    }
    bool untyped = false;
    const statedict::dtype t = storage_dtype(p[1].as_object(), untyped);
    pending pd{t, untyped, static_cast<std::uint64_t>(p[4].as_int()), p[3].as_string(), p[1].as_object()};
    auto [it, inserted] = roots.emplace(root, pd);
    if (!inserted) check_same_storage(root, it->second.dtype, it->second.numel, t, pd.numel);
    return p[1].as_object();
  };
  po.persistent_load = [&](const Value& pid) -> Value {
    std::string root;
    std::optional<std::tuple<std::string, std::int64_t, std::int64_t>> view;
    (void)parse_pid(pid, root, view);
    return Value();
  };
  std::uint64_t keys_pos = 0;
  try {
    keys_pos = object_pos + pickle::load(bytes.subspan(static_cast<std::size_t>(object_pos)), po).consumed;
  } catch (error& e) {
    e.add_context(where(*src) + ": legacy object pickle");
    throw;
  }
  pos = keys_pos;
  const pickle::Result keys = next("storage key list");
  if (!keys.value.is_list()) throw_error(errors::pt_bad_legacy, where(*src), "legacy storage key list is not a list");

  // The raw storages follow, in key-list order: int64 element count, then the bytes.
  std::unordered_map<std::string, std::uint64_t> data_at;
  for (const Value& k : keys.value.as_list()) {
    if (!k.is_string()) throw_error(errors::pt_bad_legacy, where(*src), "legacy storage key is not a string");
    const std::string& key = k.as_string();
    auto it = roots.find(key);
    if (it == roots.end()) throw_error(errors::pt_bad_legacy, where(*src), "storage " + quote(key) + " is listed but never used");
    if (data_at.count(key)) throw_error(errors::pt_bad_legacy, where(*src), "storage " + quote(key) + " is listed twice");
    src->check_range(pos, 8, "legacy storage size");
    std::uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(std::to_integer<unsigned>(bytes[static_cast<std::size_t>(pos) + static_cast<std::size_t>(i)])) << (8 * i);
    if (n != it->second.numel)
      throw_error(errors::pt_bad_legacy, where(*src), "storage " + quote(key) + " holds " + std::to_string(n) +
                                                           " elements, its persistent id says " + std::to_string(it->second.numel));
    const std::uint64_t nb = checked_mul(n, itemsize(it->second.dtype), "storage size");
    src->check_range(pos + 8, nb, "legacy storage " + quote(key));
    data_at[key] = pos + 8;
    Storage s;
    s.key = key;
    s.dtype = it->second.dtype;
    s.untyped = it->second.untyped;
    s.offset = pos + 8;
    s.nbytes = nb;
    s.location = it->second.location;
    f.storages.push_back(std::move(s));
    pos += 8 + nb;
  }
  for (const auto& [key, pd] : roots)
    if (!data_at.count(key)) throw_error(errors::pt_bad_legacy, where(*src), "storage " + quote(key) + " has no data");

  // Pass 2: the real tree, views into the storages.
  view_base vb = make_view_base(*src, lazy);
  if (!vb.base) {
    vb.base = all.data;
    vb.owner = all.owner;
  }
  f.view_base = vb.base;
  f.view_owner = vb.owner;
  ctx.dry_run = false;
  po.persistent_load = [&](const Value& pid) -> Value {
    std::string root;
    std::optional<std::tuple<std::string, std::int64_t, std::int64_t>> view;
    const Object cls = parse_pid(pid, root, view);
    const pending& pd = roots.at(root);
    const std::byte* data = vb.base + data_at.at(root);
    if (!view) return storage_value(cls, TensorView::contiguous(pd.dtype, {static_cast<dim_t>(pd.numel)}, data, vb.owner), root, pd.location);
    const auto& [vkey, off, size] = *view;
    if (off < 0 || size < 0 || static_cast<std::uint64_t>(off) > pd.numel || static_cast<std::uint64_t>(size) > pd.numel - static_cast<std::uint64_t>(off))
      throw_error(errors::pt_view_out_of_bounds, "storage view " + quote(vkey) + " [" + std::to_string(off) + ", +" +
                                                     std::to_string(size) + ") lies outside storage " + quote(root));
    return storage_value(cls, TensorView::contiguous(pd.dtype, {size}, data + static_cast<std::uint64_t>(off) * itemsize(pd.dtype), vb.owner),
                         vkey, pd.location);
  };
  try {
    pickle::Result res = pickle::load(bytes.subspan(static_cast<std::size_t>(object_pos)), po);
    f.value = std::move(res.value);
    f.attributes = std::move(res.attributes);
    f.pickle_protocol = res.protocol;
  } catch (error& e) {
    e.add_context(where(*src) + ": legacy object pickle");
    throw;
  }
  return f;
}

inline File read_any(std::shared_ptr<const ByteSource> src, const load_options& opts, bool lazy) {
  switch (detect(*src)) {
    case file_kind::zip: return read_zip(std::move(src), opts, lazy);
    case file_kind::legacy: return read_legacy(std::move(src), opts, lazy);
    case file_kind::legacy_tar:
      throw_error(errors::pt_legacy_tar, where(*src), "the tar-based format of PyTorch < 0.4 is not supported");
    case file_kind::unknown: break;
  }
  throw_error(errors::pt_not_torch, where(*src), "neither a zip archive nor a legacy torch.save pickle");
}

}  // namespace detail

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
    if (addr < base || addr - base > size)
      throw_error(errors::pt_bad_tensor, detail::where(*file.source), "tensor " + quote(name) + " does not point into the file");
    // Built in place: 10,000 tensors are 10,000 TensorInfo and Chunk moves otherwise.
    TensorInfo& ti = ck.tensors.emplace_back();
    ti.name = std::move(name);  // `flat` is ours: its names move into the description
    ti.dtype = v.dtype();
    ti.shape = v.shape();
    Chunk& c = ti.chunks.emplace_back();
    Box& region = std::get<Box>(c.region);  // a Chunk starts as a Box
    region.offsets = shape_t(v.rank(), 0);
    region.sizes = v.shape();
    c.at.source = 0;
    c.at.byte_offset = addr - base;
    if (!v.is_contiguous()) c.at.strides = v.strides();
    c.at.stored = v.dtype();
  }
  ck.skeleton = std::move(flat.skeleton);
  ck.metadata["torch.format"] = file.format;
  if (!file.archive_name.empty()) ck.metadata["torch.archive_name"] = file.archive_name;
  if (!file.attributes.empty()) ck.metadata[std::string(attributes_metadata_key)] = encode_attributes(file.attributes);
  return ck;
}

/// Describes a torch.save file without reading any tensor byte (inspect).
inline ShardedCheckpoint describe(std::shared_ptr<const ByteSource> source, const load_options& opts = {}) {
  return describe(detail::read_any(std::move(source), opts, true));
}
inline ShardedCheckpoint describe(const std::filesystem::path& path, const load_options& opts = {}) {
  return describe(InputFile::open(path, opts.mode), opts);
}

// =============================================================================================
// Writing
//
// The file is what torch.save (PyTorch 2.x) writes: records `data.pkl`, `.format_version` ("1"),
// `.storage_alignment` ("64"), `byteorder` ("little"), `data/0` ... `data/N-1` (keys in order of
// first use, numerically ordered), `version` ("3\n"), under the folder `archive_name`, in a zip laid
// out like torch's (io/zip.hpp). The pickle (protocol 2) writes each tensor as
// `_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())` with the persistent id
// `('storage', torch.<Dtype>Storage, key, 'cpu', numel)`; dtypes without a typed storage class
// (U16, U32, U64, F8_*) use `_rebuild_tensor_v3` with `torch.UntypedStorage` and the dtype global,
// as PyTorch >= 2.1 does. Tensors whose memory overlaps (same dtype) share one storage covering the
// union of their byte ranges, so tied weights and views stay tied after torch.load; the same view
// twice is written once and referenced (torch.load gives the same object). Storages are written once.
// Every storage is written on 'cpu' (its bytes are in host memory, and the file then loads on a
// machine without the device it was saved from, no map_location needed): a bare storage read with
// another location ('cuda:0') is written back on 'cpu'.

struct save_options {
  /// Folder inside the zip. Empty: torch's rule, the file's basename without its extension
  /// ("model" for model.pt), or "archive" when there is no usable basename.
  std::string archive_name;
  /// Python attributes of dicts (state_dict()._metadata), by path; written as OrderedDict + BUILD.
  std::vector<pickle::Attributes> attributes;
  pickle::write_options pickle{};
  zip::write_options zip{};
  /// Bytes copied per write call when streaming storages (bounded memory; no buffer is allocated
  /// when the source is in memory or mapped).
  std::uint64_t block_bytes = std::uint64_t{1} << 20;
};

/// torch's archive name for a path: the basename without its last extension
/// (caffe2/serialize/inline_container.cc basename()); "archive" when that is empty.
inline std::string archive_name_for(const std::filesystem::path& path) {
  const std::string s = path.string();
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i)
    if (s[i] == '/' || s[i] == '\\') start = i + 1;
  std::size_t end = s.size();
  for (std::size_t i = s.size(); i > start; --i)
    if (s[i - 1] == '.') {
      end = i - 1;
      break;
    }
  std::string n = start < end ? s.substr(start, end - start) : std::string();
  return n.empty() ? std::string("archive") : n;
}

/// One storage of a planned file.
struct PlannedStorage {
  std::string key;                                ///< "0", "1", ...
  statedict::dtype dtype = statedict::dtype::U8;  ///< element type of its tensors
  bool untyped = false;                           ///< written as torch.UntypedStorage (+ _rebuild_tensor_v3)
  std::uint64_t nbytes = 0;
  std::size_t record = 0;                         ///< index into SavePlan::records / layout.entries
  /// Bytes to copy (nbytes of them), or nullptr for a storage the caller fills (PlannedWriter).
  const std::byte* source = nullptr;
  keep_alive owner;
};

/// One tensor of a planned file: which storage, where in it.
struct PlannedTensor {
  std::string name;  ///< dotted path (empty for tensors inside kept objects)
  std::size_t storage = 0;
  std::uint64_t offset = 0;  ///< storage offset, in elements
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t shape;
  shape_t strides;
};

/// Everything about a torch.save file before a byte is written: the pickle, the zip layout (so
/// every storage's byte range in the output is known up front), and where each tensor lives.
struct SavePlan {
  std::string archive_name;
  struct Record {
    std::string name;             ///< full entry name ("model/data/0")
    std::vector<std::byte> bytes;  ///< content of small records (empty for storages)
    std::optional<std::size_t> storage;  ///< set for data/<key> records
  };
  std::vector<Record> records;  ///< in file order, parallel to layout.entries
  std::vector<PlannedStorage> storages;
  std::vector<PlannedTensor> tensors;
  zip::Layout layout;

  [[nodiscard]] std::uint64_t file_size() const noexcept { return layout.total_size; }
  /// Byte range [first, first + nbytes) of storage `i` in the output file.
  [[nodiscard]] std::uint64_t storage_offset(std::size_t i) const { return layout.entries[storages[i].record].data_offset; }

  /// Where every named tensor's elements go in the output: the planner's destination layout
  /// (shard/plan.hpp make_plan), one destination (the output file, `file_size()` bytes) and one
  /// chunk per tensor at its byte offset, contiguous. Tensors the skeleton makes views or aliases
  /// of another are not listed: their bytes are their base's.
  [[nodiscard]] Destination destination(std::string name = "torch file") const {
    Destination d;
    d.names.push_back(std::move(name));
    d.sizes.push_back(file_size());
    for (const PlannedTensor& t : tensors) {
      if (t.name.empty()) continue;
      TensorInfo ti;
      ti.name = t.name;
      ti.dtype = t.dtype;
      ti.shape = t.shape;
      Chunk c;
      c.region = Box{shape_t(t.shape.size(), 0), t.shape};
      c.at.source = 0;
      c.at.byte_offset = storage_offset(t.storage) + t.offset * itemsize(t.dtype);
      c.at.strides = is_contiguous(t.shape, t.strides) ? shape_t{} : t.strides;
      c.at.stored = t.dtype;
      ti.chunks.push_back(std::move(c));
      d.tensors.push_back(std::move(ti));
    }
    return d;
  }

  /// The byte range of every storage in the output file, in storage order: what a FileSink
  /// checksums (`FileSink::track_crc32`) so that the writer needs no second pass over the data.
  [[nodiscard]] std::vector<FlatRange> storage_ranges() const {
    std::vector<FlatRange> r;
    for (std::size_t i = 0; i < storages.size(); ++i) r.push_back({storage_offset(i), storage_offset(i) + storages[i].nbytes});
    return r;
  }
};

namespace detail {

struct tensor_ref {
  const TensorView* view;
  std::string name;
};

/// Every tensor in the tree (also inside objects), with its dotted name where it has one.
inline std::vector<tensor_ref> collect_tensors(const Value& root) {
  std::vector<tensor_ref> out;
  struct item {
    const Value* v;
    std::string name;
    bool named;
  };
  std::vector<item> work{{&root, std::string(), true}};
  auto child = [](const item& parent, const std::string& key) {
    return parent.name.empty() ? key : parent.name + "." + key;
  };
  while (!work.empty()) {
    item it = std::move(work.back());
    work.pop_back();
    const Value& v = *it.v;
    switch (v.kind()) {
      case value_kind::tensor: out.push_back({&v.as_tensor(), it.named ? it.name : std::string()}); break;
      case value_kind::list:
      case value_kind::tuple: {
        const List& l = v.as_list();
        for (std::size_t i = l.size(); i-- > 0;) work.push_back({&l[i], child(it, std::to_string(i)), it.named});
        break;
      }
      case value_kind::dict: {
        const auto& items = v.as_dict().items();
        for (std::size_t i = items.size(); i-- > 0;) work.push_back({&items[i].second, child(it, items[i].first.str()), it.named});
        break;
      }
      case value_kind::object: {
        const Object& o = v.as_object();
        for (const List* l : {&o.items, &o.state, &o.args})
          for (std::size_t i = l->size(); i-- > 0;) work.push_back({&(*l)[i], std::string(), false});
        break;
      }
      default: break;
    }
  }
  return out;
}

/// Storage groups: views of one dtype whose byte ranges overlap share one storage spanning the
/// union of their ranges (each view then starts a whole number of elements into it).
struct grouping {
  struct group {
    statedict::dtype dtype;
    const std::byte* lo;
    const std::byte* hi;
    keep_alive owner;
    std::optional<std::size_t> storage;  ///< assigned when the pickle first uses it
  };
  std::vector<group> groups;
  std::unordered_map<const TensorView*, std::size_t> group_of;
};

inline grouping group_views(const std::vector<tensor_ref>& refs) {
  grouping g;
  std::vector<const TensorView*> sized;
  for (const auto& r : refs) {
    if (r.view->numel() == 0) {
      g.groups.push_back({r.view->dtype(), r.view->data(), r.view->data(), r.view->owner(), std::nullopt});
      g.group_of[r.view] = g.groups.size() - 1;
    } else {
      sized.push_back(r.view);
    }
  }
  std::sort(sized.begin(), sized.end(), [](const TensorView* a, const TensorView* b) {
    if (a->dtype() != b->dtype()) return a->dtype() < b->dtype();
    return std::less<const std::byte*>()(a->data(), b->data());
  });
  std::optional<std::size_t> cur;
  for (const TensorView* v : sized) {
    const std::byte* lo = v->data();
    const std::byte* hi = lo + v->extent_bytes();
    if (cur) {
      grouping::group& c = g.groups[*cur];
      if (c.dtype == v->dtype() && std::less<const std::byte*>()(lo, c.hi)) {
        if (static_cast<std::uint64_t>(lo - c.lo) % v->itemsize() == 0) {
          if (std::less<const std::byte*>()(c.hi, hi)) c.hi = hi;
          g.group_of[v] = *cur;
          continue;
        }
        // Overlapping at a byte offset that is not a whole element: a storage of its own.
        g.groups.push_back({v->dtype(), lo, hi, v->owner(), std::nullopt});
        g.group_of[v] = g.groups.size() - 1;
        continue;
      }
    }
    g.groups.push_back({v->dtype(), lo, hi, v->owner(), std::nullopt});
    cur = g.groups.size() - 1;
    g.group_of[v] = *cur;
  }
  return g;
}

inline std::string view_identity(const TensorView& v) {
  std::string k = "t:" + std::to_string(reinterpret_cast<std::uintptr_t>(v.data())) + ":" + std::string(name(v.dtype())) + ":" +
                  to_string(v.shape()) + to_string(v.strides());
  return k;
}

}  // namespace detail

/// Plans a torch.save file for `tree`: the pickle bytes, storages, zip layout and tensor placements.
/// Nothing is written; `tree` must outlive the plan (storages point into its tensors' memory).
inline SavePlan plan_save(const Value& tree, const save_options& opts) {
  SavePlan plan;
  plan.archive_name = opts.archive_name.empty() ? std::string("archive") : opts.archive_name;
  if (plan.archive_name.find('/') != std::string::npos || plan.archive_name.find('\0') != std::string::npos)
    throw_error(errors::pt_bad_name, "archive name " + quote(plan.archive_name) + " contains '/' or NUL");
  // Dict attributes are plain data (state_dict()._metadata); the reader keeps a dict whose
  // attributes hold tensors as an OrderedDict object, which is written with its tensors.
  for (const pickle::Attributes& a : opts.attributes)
    for (const auto& kv : a.attributes.items())
      if (!detail::collect_tensors(kv.second).empty())
        throw_error(errors::pt_unwritable, "attribute " + quote(kv.first.str()) + " of the dict at " + quote(dotted(a.path)),
                    "holds a tensor; dict attributes must be plain data (a dict with tensor attributes is an "
                    "OrderedDict object in the tree)");
  const std::vector<detail::tensor_ref> refs = detail::collect_tensors(tree);
  detail::grouping g = detail::group_views(refs);
  std::unordered_map<const TensorView*, const std::string*> names;
  for (const auto& r : refs)
    if (!r.name.empty()) names.emplace(r.view, &r.name);

  auto storage_of = [&](const TensorView& v) -> std::size_t {
    detail::grouping::group& grp = g.groups[g.group_of.at(&v)];
    if (!grp.storage) {
      PlannedStorage s;
      s.key = std::to_string(plan.storages.size());
      s.dtype = grp.dtype;
      s.untyped = info(grp.dtype).storage_name.empty();
      s.nbytes = static_cast<std::uint64_t>(grp.hi - grp.lo);
      s.source = grp.lo;
      s.owner = grp.owner;
      plan.storages.push_back(std::move(s));
      grp.storage = plan.storages.size() - 1;
    }
    return *grp.storage;
  };

  std::vector<std::byte> pkl;
  pickle::Writer w(pkl, opts.pickle);
  w.attributes = &opts.attributes;
  // Writes the persistent id of storage `si` (MARK 'storage' class key 'cpu' numel TUPLE BINPERSID).
  auto persistent_id = [&](std::size_t si) {
    const PlannedStorage& s = plan.storages[si];
    w.mark();
    w.str("storage");
    w.global("torch", s.untyped ? std::string("UntypedStorage") : std::string(info(s.dtype).storage_name));
    w.str(s.key);
    w.str("cpu");
    w.integer(static_cast<std::int64_t>(s.untyped ? s.nbytes : s.nbytes / itemsize(s.dtype)));
    w.op('t');
    w.memoize();
    w.op('Q');
  };
  w.custom = [&](pickle::Writer& wr, const Value& v) -> bool {
    if (v.is_tensor()) {
      const TensorView& t = v.as_tensor();
      const std::string id = detail::view_identity(t);
      if (t.numel() > 0 && wr.get_memo(id)) return true;
      const std::size_t si = storage_of(t);
      const PlannedStorage& s = plan.storages[si];
      const std::uint64_t off = t.numel() == 0 ? 0 : static_cast<std::uint64_t>(t.data() - g.groups[g.group_of.at(&t)].lo) / t.itemsize();
      PlannedTensor pt;
      if (auto it = names.find(&t); it != names.end()) pt.name = *it->second;
      pt.storage = si;
      pt.offset = off;
      pt.dtype = t.dtype();
      pt.shape = t.shape();
      pt.strides = t.strides();
      plan.tensors.push_back(std::move(pt));
      wr.global("torch._utils", s.untyped ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
      wr.mark();
      persistent_id(si);
      wr.integer(static_cast<std::int64_t>(off));
      for (const shape_t* dims : {&t.shape(), &t.strides()}) {
        wr.begin_tuple(dims->size());
        for (dim_t d : *dims) wr.integer(d);
        wr.end_tuple(dims->size());
      }
      wr.boolean(false);
      wr.global("collections", "OrderedDict");
      wr.op(')');
      wr.reduce();
      if (s.untyped) wr.global("torch", info(t.dtype()).torch_name);
      wr.op('t');
      wr.memoize();
      wr.reduce();
      if (t.numel() > 0) wr.put_memo(id);
      return true;
    }
    if (v.is_object() && detail::is_storage_object(v.as_object())) {
      const TensorView& bytes = v.as_object().args[0].as_tensor();
      const std::size_t si = storage_of(bytes);
      persistent_id(si);
      return true;
    }
    return false;
  };
  w.dump(tree);

  const std::string p = plan.archive_name + "/";
  auto small = [&](std::string name, std::string_view content) {
    SavePlan::Record r;
    r.name = p + name;
    for (char c : content) r.bytes.push_back(static_cast<std::byte>(c));
    plan.records.push_back(std::move(r));
  };
  plan.records.push_back({p + "data.pkl", std::move(pkl), std::nullopt});
  small(".format_version", "1");
  small(".storage_alignment", std::to_string(opts.zip.alignment));
  small("byteorder", "little");
  for (std::size_t i = 0; i < plan.storages.size(); ++i) {
    plan.storages[i].record = plan.records.size();
    plan.records.push_back({p + "data/" + plan.storages[i].key, {}, i});
  }
  small("version", "3\n");
  std::vector<zip::EntrySpec> specs;
  specs.reserve(plan.records.size());
  for (const auto& r : plan.records)
    specs.push_back({r.name, r.storage ? plan.storages[*r.storage].nbytes : static_cast<std::uint64_t>(r.bytes.size())});
  plan.layout = zip::plan(specs, opts.zip);
  return plan;
}

/// Plans writing a described checkpoint (any format: a consolidated DCP, safetensors, another
/// torch file) as a torch.save file. The tree comes from `ck.skeleton` (unflatten; a null skeleton
/// is a flat dict), dict attributes from metadata["torch.attributes"] unless `opts` has some. Each
/// logical tensor gets a contiguous storage of its own (views and aliases recorded in the skeleton
/// share their base's). Nothing is read: every storage is left for the caller to fill with a
/// PlannedWriter, and `destination()` says where each of ck's tensors goes in the output.
inline SavePlan plan_save(const ShardedCheckpoint& ck, save_options opts) {
  // Placeholder tensors in reserved address space, 64 bytes apart at least, never touched.
  std::vector<std::uint64_t> at(ck.tensors.size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < ck.tensors.size(); ++i) {
    at[i] = total;
    const std::uint64_t n = byte_size(ck.tensors[i].shape, itemsize(ck.tensors[i].dtype));
    total = checked_add(total, (std::max<std::uint64_t>(n, 1) + 63) / 64 * 64, "checkpoint size");
  }
  auto res = std::make_shared<detail::reservation>(total);
  NamedTensors named;
  named.reserve(ck.tensors.size());
  for (std::size_t i = 0; i < ck.tensors.size(); ++i)
    named.emplace_back(ck.tensors[i].name, TensorView::contiguous(ck.tensors[i].dtype, ck.tensors[i].shape, res->base() + at[i], res));
  const Value tree = unflatten(named, ck.skeleton);
  if (opts.attributes.empty())
    if (auto it = ck.metadata.find(std::string(attributes_metadata_key)); it != ck.metadata.end())
      opts.attributes = decode_attributes(it->second);
  if (opts.archive_name.empty())
    if (auto it = ck.metadata.find("torch.archive_name"); it != ck.metadata.end()) opts.archive_name = it->second;
  SavePlan plan = plan_save(tree, opts);
  // Each of ck's tensors: the storage that holds its placeholder, and where in it.
  std::vector<std::pair<const std::byte*, std::size_t>> starts;
  for (std::size_t i = 0; i < plan.storages.size(); ++i) starts.emplace_back(plan.storages[i].source, i);
  std::sort(starts.begin(), starts.end(), [](const auto& a, const auto& b) { return std::less<const std::byte*>()(a.first, b.first); });
  plan.tensors.clear();
  for (std::size_t i = 0; i < named.size(); ++i) {
    const std::byte* p = named[i].second.data();
    auto it = std::upper_bound(starts.begin(), starts.end(), p,
                               [](const std::byte* x, const auto& e) { return std::less<const std::byte*>()(x, e.first); });
    if (it == starts.begin()) continue;  // not written (cannot happen for a valid skeleton)
    --it;
    const PlannedStorage& s = plan.storages[it->second];
    if (static_cast<std::uint64_t>(p - it->first) > s.nbytes) continue;
    PlannedTensor t;
    t.name = named[i].first;
    t.storage = it->second;
    t.offset = static_cast<std::uint64_t>(p - it->first) / itemsize(named[i].second.dtype());
    t.dtype = named[i].second.dtype();
    t.shape = named[i].second.shape();
    t.strides = named[i].second.strides();
    plan.tensors.push_back(std::move(t));
  }
  for (PlannedStorage& s : plan.storages) {
    s.source = nullptr;
    s.owner.reset();
  }
  return plan;
}

/// Writes a planned file sequentially into `out` (from its current position): headers, records
/// and storages in file order, CRCs computed on the way, `block_bytes` at a time.
inline void write_plan(OutputFile& out, const SavePlan& plan, std::uint64_t block_bytes = std::uint64_t{1} << 20) {
  zip::Writer zw(out, plan.layout);
  for (const auto& r : plan.records) {
    zw.begin_entry();
    if (!r.storage) {
      zw.write(r.bytes);
    } else {
      const PlannedStorage& s = plan.storages[*r.storage];
      if (s.nbytes && !s.source)
        throw_error(errors::pt_unwritable, "storage " + quote(s.key) + " has no source bytes; fill it with a PlannedWriter");
      for (std::uint64_t off = 0; off < s.nbytes; off += block_bytes) {
        const std::uint64_t n = std::min(block_bytes, s.nbytes - off);
        zw.write(std::span<const std::byte>(s.source + off, static_cast<std::size_t>(n)));
      }
    }
    zw.end_entry();
  }
  zw.finish();
}

/// Writes `tree` as a torch.save file at `path`, atomically (temporary name, fsync, rename),
/// streaming: no buffer holds more than the pickle and one block.
inline void save(const std::filesystem::path& path, const Value& tree, save_options opts = {}) {
  if (opts.archive_name.empty()) opts.archive_name = archive_name_for(path.filename());
  const SavePlan plan = plan_save(tree, opts);
  OutputFile out = OutputFile::create(path);
  try {
    write_plan(out, plan, opts.block_bytes);
    out.commit();
  } catch (error& e) {
    e.add_context("file " + quote(path.string()));
    throw;
  }
}

/// Writes a File read earlier (its attributes included) to `path`.
inline void save(const std::filesystem::path& path, const File& file, save_options opts = {}) {
  if (opts.attributes.empty()) opts.attributes = file.attributes;
  save(path, file.value, std::move(opts));
}

/// A torch.save file filled by positioned writes, in any order and from several threads: the
/// executor's path. Callers write storage bytes (`write`, or their own pwrite at
/// `plan().storage_offset(i)` followed by `report_crc`); `finish()` completes CRCs, writes the zip
/// framing around the storages (local headers, small records, data descriptors, central
/// directory; adjacent pieces as one write) and commits atomically.
///
/// CRCs: each `write` checksums the bytes it writes (CLMUL CRC-32 runs at ~10 GB/s, faster than
/// any disk) and records the piece; pieces are combined with crc32_combine in finish(). Storages
/// whose pieces do not tile them exactly (filled by raw pwrite without report_crc) are read back
/// from the file once in finish().
class PlannedWriter {
 public:
  PlannedWriter(const std::filesystem::path& path, SavePlan plan)
      : plan_(std::move(plan)), out_(OutputFile::create(path)), pieces_(plan_.storages.size()) {
    crcs_.resize(plan_.records.size(), 0);
    for (std::size_t i = 0; i < plan_.storages.size(); ++i) by_offset_.emplace_back(plan_.storage_offset(i), i);
    for (std::size_t i = 0; i < plan_.records.size(); ++i)
      if (!plan_.records[i].storage) crcs_[i] = zip::crc32(plan_.records[i].bytes);
  }

  [[nodiscard]] const SavePlan& plan() const noexcept { return plan_; }
  [[nodiscard]] OutputFile& file() noexcept { return out_; }

  /// Writes `bytes` at `offset` inside storage `storage` and records their CRC. Thread-safe.
  void write(std::size_t storage, std::uint64_t offset, std::span<const std::byte> bytes) {
    check(storage, offset, bytes.size());
    out_.pwrite(plan_.storage_offset(storage) + offset, bytes);
    report_crc(storage, offset, bytes.size(), zip::crc32(bytes));
  }
  /// Records the CRC-32 of bytes [offset, offset + length) of a storage written by the caller.
  void report_crc(std::size_t storage, std::uint64_t offset, std::uint64_t length, std::uint32_t crc) {
    check(storage, offset, length);
    std::lock_guard<std::mutex> lock(mu_);
    pieces_[storage].add(offset, length, crc);
  }
  /// Records the CRC-32 of output bytes [file_offset, file_offset + length), which must lie inside
  /// one storage (what an executor that writes destination chunks by file offset reports).
  void report_file_crc(std::uint64_t file_offset, std::uint64_t length, std::uint32_t crc) {
    const auto it = std::upper_bound(by_offset_.begin(), by_offset_.end(), file_offset,
                                     [](std::uint64_t x, const auto& e) { return x < e.first; });
    if (it == by_offset_.begin())
      throw_error(errors::pt_unwritable, "no storage at output offset " + std::to_string(file_offset));
    const std::size_t si = std::prev(it)->second;
    report_crc(si, file_offset - plan_.storage_offset(si), length, crc);
  }
  /// Copies every storage that has source bytes (a plan made from a tree of real tensors).
  void fill_from_sources(std::uint64_t block_bytes = std::uint64_t{1} << 20) {
    for (std::size_t i = 0; i < plan_.storages.size(); ++i) {
      const PlannedStorage& s = plan_.storages[i];
      if (!s.source) continue;
      for (std::uint64_t off = 0; off < s.nbytes; off += block_bytes)
        write(i, off, std::span<const std::byte>(s.source + off, static_cast<std::size_t>(std::min(block_bytes, s.nbytes - off))));
    }
  }

  /// Completes the archive and gives it its final name.
  void finish() {
    out_.resize(plan_.layout.total_size);  // storages nobody wrote read back as zeros
    for (std::size_t i = 0; i < plan_.storages.size(); ++i) {
      const PlannedStorage& s = plan_.storages[i];
      std::uint32_t c = 0;
      if (pieces_[i].complete(s.nbytes)) c = pieces_[i].combined();
      else c = crc_from_file(plan_.storage_offset(i), s.nbytes);
      crcs_[s.record] = c;
    }
    WriteCoalescer framing(out_);
    for (std::size_t i = 0; i < plan_.records.size(); ++i) {
      const auto& e = plan_.layout.entries[i];
      framing.write(e.header_offset, zip::local_header_bytes(e, plan_.layout.options));
      if (!plan_.records[i].storage) framing.write(e.data_offset, plan_.records[i].bytes);
      framing.write(e.descriptor_offset, zip::descriptor_bytes(e, crcs_[i]));
    }
    framing.write(plan_.layout.central_offset, zip::tail_bytes(plan_.layout, crcs_));
    framing.flush();
    out_.commit();
  }

 private:
  void check(std::size_t storage, std::uint64_t offset, std::uint64_t length) const {
    if (storage >= plan_.storages.size() || offset > plan_.storages[storage].nbytes ||
        length > plan_.storages[storage].nbytes - offset)
      throw_error(errors::pt_unwritable, "write of " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
                                             " outside storage " + std::to_string(storage));
  }
  std::uint32_t crc_from_file(std::uint64_t offset, std::uint64_t length) const {
    auto in = InputFile::open(out_.temp_path(), read_mode::pread);
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min<std::uint64_t>(length, std::uint64_t{4} << 20)));
    std::uint32_t c = 0;
    for (std::uint64_t done = 0; done < length;) {
      const std::uint64_t n = std::min<std::uint64_t>(buf.size(), length - done);
      in->read(offset + done, std::span<std::byte>(buf.data(), static_cast<std::size_t>(n)));
      c = zip::crc32(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(n)), c);
      done += n;
    }
    return c;
  }

  SavePlan plan_;
  OutputFile out_;
  std::vector<zip::CrcPieces> pieces_;
  std::vector<std::uint32_t> crcs_;
  std::vector<std::pair<std::uint64_t, std::size_t>> by_offset_;  ///< storage start in the file -> index (ascending)
  std::mutex mu_;
};

}  // namespace torch
}  // namespace statedict::inline v0
