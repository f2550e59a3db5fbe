// statedict: reading torch.save files: the torch globals of the unpickler (tensor rebuilds,
// storages), the zip layout (PyTorch >= 1.6) and the legacy layout (io/torch_file.hpp is the
// public header).
// SPDX-License-Identifier: MIT
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

#include "../../core/cast.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/flatten.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"
#include "../../core/visit.hpp"
#include "../../shard/checkpoint.hpp"
#include "../crc32.hpp"
#include "../file.hpp"
#include "../pickle_read.hpp"
#include "../pickle_write.hpp"
#include "../zip.hpp"

#include "../torch_file.hpp"

namespace statedict::inline v0::torch {

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
  // Quantized storages hold the integer representation (_rebuild_qtensor reads them); the 4- and
  // 2-bit ones pack their values into bytes.
  if (name == "QInt8Storage") return statedict::dtype::I8;
  if (name == "QUInt8Storage" || name == "QUInt4x2Storage" || name == "QUInt2x4Storage") return statedict::dtype::U8;
  if (name == "QInt32Storage") return statedict::dtype::I32;
  throw_error(errors::pt_bad_storage, "unknown storage class " + quote(qualified()));
}
inline statedict::dtype storage_dtype(const Object& cls, bool& untyped) {
  return storage_dtype(cls.module, cls.name, cls.how == object_build::global, untyped);
}

/// A quantized storage class (torch.QInt8Storage, ...): its bytes are the integer representation of
/// quantized values, which mean something only with the scale and zero point _rebuild_qtensor gives.
inline bool is_quantized_storage(std::string_view name) noexcept {
  return name == "QInt8Storage" || name == "QUInt8Storage" || name == "QInt32Storage" || name == "QUInt4x2Storage" ||
         name == "QUInt2x4Storage";
}

/// The refusal of a quantized storage read where it has no quantization parameters: torch.load
/// gives a quantized tensor (or storage) there, which statedict cannot represent as plain integers.
[[noreturn]] inline void refuse_quantized(std::string_view cls, std::string_view key, std::string_view used_as) {
  throw_error(errors::pt_quantized_storage,
              "storage " + quote(std::string(key)) + " is a torch." + std::string(cls) + " " + std::string(used_as) +
                  ": torch.load reads it as quantized values, but no quantization parameters (scale, zero point) come "
                  "with it there (only _rebuild_qtensor gives them); read as plain integers it would mean something else");
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

/// Refuses every quantized storage of the tree that is not the storage argument of a
/// _rebuild_qtensor call (also as the function of _rebuild_from_type_v2): held bare, in a list, as
/// another call's argument. Called only when the file names a quantized storage class.
inline void check_quantized_storages(const Value& v, bool in_qtensor = false) {
  if (v.is_sequence()) {
    for (const Value& x : v.as_list()) check_quantized_storages(x);
  } else if (v.is_dict()) {
    for (const auto& kv : v.as_dict()) check_quantized_storages(kv.second);
  } else if (v.is_object()) {
    const Object& o = v.as_object();
    if (is_storage_object(o)) {
      if (is_quantized_storage(o.name) && !in_qtensor) refuse_quantized(o.name, o.args[1].as_string(), "held outside _rebuild_qtensor");
      return;
    }
    const bool qtensor = o.module == "torch._utils" && o.name == "_rebuild_qtensor" && o.how == object_build::reduce;
    // _rebuild_from_type_v2(_rebuild_qtensor, type, args, state): args[0] is the storage.
    const bool from_type = o.module == "torch._tensor" && o.name == "_rebuild_from_type_v2" && o.args.size() == 4 &&
                           o.args[0].is_object() && o.args[0].as_object().qualified() == "torch._utils._rebuild_qtensor" &&
                           o.args[2].is_sequence();
    for (std::size_t i = 0; i < o.args.size(); ++i) {
      if (from_type && i == 2) {
        const List& inner = o.args[2].as_list();
        for (std::size_t j = 0; j < inner.size(); ++j) check_quantized_storages(inner[j], j == 0);
      } else {
        check_quantized_storages(o.args[i], qtensor && i == 0);
      }
    }
    for (const Value& x : o.state) check_quantized_storages(x);
    for (const Value& x : o.items) check_quantized_storages(x);
  }
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
  bool quantized;
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
  pickle::Registry r(&pickle::Registry::shared());
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
    if (is_quantized_storage(st.name)) refuse_quantized(st.name, st.args[1].as_string(), "rebuilt as a plain tensor by " + c.callable.qualified());
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
      if ((*ctx.classes)[h.cls].untyped || (*ctx.classes)[h.cls].quantized) return std::nullopt;
      zs = &(*ctx.storages)[h.storage];
    } else {
      st = &a.value(0);
      if (!st->is_object() || !is_storage_object(st->as_object()) || st->as_object().name == "UntypedStorage" ||
          is_quantized_storage(st->as_object().name))
        return std::nullopt;
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
  // _rebuild_from_type_v2(func, new_type, args, state): torch.load gives func(*args) with the
  // Python attributes in `state` set on it (DeepSpeed ZeRO-3 sets `ds_id` on its fp32 partitions).
  // A plain Tensor or Parameter whose attributes are data (no tensor among them) is its tensor;
  // with keep_wrappers a Tensor with attributes stays the call, so that writing it back keeps them.
  // A subclass, or attributes holding tensors, stays the call (its tensors are tensors of the tree).
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
    // _set_obj_state takes a dict of attributes, or a (dict | None, slots dict | None) pair.
    const auto is_attrs = [](const Value& v) { return v.is_none() || v.is_dict(); };
    const bool attrs = !no_state && (state.is_dict() || (state.is_tuple() && state.as_list().size() == 2 &&
                                                          is_attrs(state.as_list()[0]) && is_attrs(state.as_list()[1])));
    bool data_only = true;
    if (attrs)
      visit(state, [&](const Path&, const Value& v) {
        if (!v.is_tensor()) return visit_control::descend;
        data_only = false;
        return visit_control::stop;
      });
    if (plain_type && (no_state || (attrs && data_only)) && func.is_object() && c.args[2].is_tuple()) {
      Value t = c.reader.call(func.as_object(), c.args[2].as_list());
      if (t.is_tensor() && (!ctx.opts->keep_wrappers || (type.as_object().name == "Tensor" && no_state))) return t;
    }
    return keep_call(c);
  });
  // Quantized and sparse tensors: the call is kept as an Object with its arguments, whose tensors
  // (the integer representation in a quantized storage, per-channel scales and zero points,
  // sparse indices and values) are tensors of the file; written back, it is the same call, which
  // torch.load(weights_only=True) accepts. Meta and subclass tensors the same way.
  for (const char* f : {"_rebuild_sparse_tensor", "_rebuild_sparse_csr_tensor", "_rebuild_meta_tensor_no_storage",
                        "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"})
    r.function(std::string("torch._utils.") + f, keep_call);
  // _rebuild_qtensor(storage, offset, size, stride, qparams, requires_grad, hooks): torch sets the
  // storage with that offset, size and stride (set_), which refuses a view out of the storage's
  // bounds; so does statedict for the storages of one value per element (not QUInt4x2 / 2x4).
  r.function("torch._utils._rebuild_qtensor", [&ctx, keep_call, max_rank](pickle::Call& c) -> Value {
    const List& a = c.args;
    const bool storage = !ctx.dry_run && !a.empty() && a[0].is_object() && is_storage_object(a[0].as_object());
    // torch: "Creation of quantized tensor requires quantized dtype like torch.quint8".
    if (storage && !is_quantized_storage(a[0].as_object().name))
      throw_error(errors::pt_bad_tensor, "_rebuild_qtensor of storage " + quote(a[0].as_object().args[1].as_string()) + ", a torch." +
                                             a[0].as_object().name + ", not a quantized storage");
    if (storage && a.size() >= 4 &&
        (a[0].as_object().name == "QInt8Storage" || a[0].as_object().name == "QUInt8Storage" || a[0].as_object().name == "QInt32Storage"))
      (void)make_view(a[0].as_object(), std::nullopt, int_arg(a[1], "storage offset"), dims_arg(a[2], "size", max_rank),
                      dims_arg(a[3], "stride", max_rank));
    return keep_call(c);
  });
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

/// A persistent id that is a str: torch.save at pickle_protocol=0 writes str(tuple) (PERSID takes
/// text), which torch.load cannot read back either.
inline void refuse_text_pid(const Value& pid) {
  if (pid.is_string())
    throw_error(errors::pt_protocol_0, "a text persistent id " + quote(pid.as_string().substr(0, 80)) +
                                           ": the file was saved with pickle_protocol=0, which writes storage ids as text that "
                                           "torch.load cannot read either (saved_id must be a tuple)");
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

/// Makes the storages of a big-endian file, read into the image f.view_base points at,
/// little-endian in place. A typed storage is swapped by its class's dtype (as torch.load does); an
/// untyped one by the dtype of the tensors viewing it (torch.load swaps none of it and so misreads
/// uint16/32/64, complex32 and bits16 tensors of such files); one viewed as elements of two sizes
/// has no single byte order and is refused. An untyped storage no tensor views stays as it is.
inline void swap_storages(File& f, const std::vector<zip_storage>& seen) {
  std::byte* const base = const_cast<std::byte*>(f.view_base);  // the image: memory this read owns
  std::vector<std::uint32_t> by_offset(seen.size());
  for (std::uint32_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(), [&](std::uint32_t a, std::uint32_t b) { return seen[a].data < seen[b].data; });
  std::vector<std::uint8_t> unit(seen.size(), 1);
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (!f.storages[i].untyped) unit[i] = info(seen[i].dtype).swap_unit;
  visit(f.value, [&](const Path&, const Value& v) {
    if (!v.is_tensor() || v.as_tensor().numel() == 0) return;
    const TensorView& t = v.as_tensor();
    const std::uint8_t u = info(t.dtype()).swap_unit;
    if (u == 1) return;
    auto it = std::upper_bound(by_offset.begin(), by_offset.end(), t.data(), [&](const std::byte* p, std::uint32_t i) { return p < seen[i].data; });
    if (it == by_offset.begin()) return;
    const std::uint32_t i = *(it - 1);
    if (!f.storages[i].untyped) return;
    if (unit[i] != 1 && unit[i] != u)
      throw_error(errors::pt_bad_storage, "storage " + quote(f.storages[i].key) + " of a big-endian file",
                  "is viewed as elements of " + std::to_string(unit[i]) + " and of " + std::to_string(u) +
                      " bytes; its byte order cannot be undone for both");
    unit[i] = u;
  });
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (unit[i] == 1) continue;
    const std::uint64_t bytes = seen[i].numel * itemsize(seen[i].dtype);
    const dtype as = unit[i] == 2 ? dtype::U16 : unit[i] == 4 ? dtype::U32 : dtype::U64;
    byteswap_run(as, base + (seen[i].data - f.view_base), static_cast<std::size_t>(bytes / unit[i]));
  }
  f.swapped = true;
}

/// The `version` record as PyTorchStreamReader reads it (std::stoull): leading white space, a
/// sign, the longest run of decimal digits, the rest ignored; nullopt where stoull throws (no
/// digit, or beyond uint64). A minus sign wraps, as stoull's does.
/// A storage's location as torch.save writes it: a device type torch knows, alone or with
/// ":<index>" ("cpu", "cuda:3", "mps", "meta", "xpu:0", ...). torch.load refuses any other
/// ("don't know how to restore data location"); statedict reads the bytes of a storage saved on
/// any device without restoring it there (torch needs that device, or map_location).
inline void check_location(std::string_view key, std::string_view location) {
  constexpr std::string_view types[] = {"cpu", "cuda", "mps", "meta", "hpu", "xpu", "xla", "npu", "mtia", "maia",
                                        "ipu", "lazy", "vulkan", "hip", "ve", "fpga", "ort", "mkldnn", "opengl",
                                        "opencl", "ideep", "privateuseone"};
  const std::string_view type = location.substr(0, location.find(':'));
  bool ok = false;
  for (std::string_view t : types) ok = ok || type == t;
  if (ok && type.size() < location.size()) {
    const std::string_view index = location.substr(type.size() + 1);
    ok = !index.empty() && index.size() <= 9 && std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; });
  }
  if (!ok)
    throw_error(errors::pt_bad_location, "storage " + quote(std::string(key)),
                "location " + quote(std::string(location.substr(0, 64))) +
                    " is not a device torch knows (cpu, cuda:N, ...): torch.load cannot restore it");
}

inline std::optional<std::uint64_t> stoull_prefix(std::string_view s) noexcept {
  std::size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || (s[i] >= '\t' && s[i] <= '\r'))) ++i;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i == s.size() || s[i] < '0' || s[i] > '9') return std::nullopt;
  std::uint64_t v = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    const auto d = static_cast<std::uint64_t>(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return negative ? 0 - v : v;
}

/// Whether Python's int() reads `s` (bytes) as a base-10 integer, as torch.load does with the
/// `.storage_alignment` record: ASCII white space around, a sign, digits with single underscores
/// between them.
inline bool python_int_literal(std::string_view s) noexcept {
  const auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  std::size_t b = 0, e = s.size();
  while (b < e && space(s[b])) ++b;
  while (e > b && space(s[e - 1])) --e;
  if (b < e && (s[b] == '+' || s[b] == '-')) ++b;
  if (b == e) return false;
  bool digit_before = false;
  for (std::size_t i = b; i < e; ++i) {
    if (s[i] >= '0' && s[i] <= '9') {
      digit_before = true;
    } else if (s[i] == '_' && digit_before && i + 1 < e) {
      digit_before = false;  // the next character must be a digit
    } else {
      return false;
    }
  }
  return digit_before;
}

/// The versions of the zip format torch.load (PyTorch 1.13 to 2.14) reads:
/// kMinSupportedFileFormatVersion and kMaxSupportedFileFormatVersion of caffe2/serialize.
inline constexpr std::uint64_t min_file_version = 1;
inline constexpr std::uint64_t max_file_version = 10;

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
  // Compressed records (an archive another zip tool rewrote) cannot be views of the file: their
  // local headers are read now, and the storage records go into an image in memory (below).
  const bool compressed = std::any_of(ar.entries().begin(), ar.entries().end(), [](const zip::Entry& e) { return !e.stored(); });
  bool overlap = zo.defer_local_headers && !compressed && ar.entries().size() >= opts.overlap_headers_from;
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
    // PyTorchStreamReader refuses an archive with any record outside that folder.
    for (const zip::Entry& e : ar.entries())
      if (e.name.compare(0, prefix.size(), prefix) != 0)
        throw_error(errors::pt_record_outside, where(*src),
                    "record " + quote(e.name) + " is not in the archive's folder " + quote(prefix) +
                        " (the first record's), which torch.load refuses: file in archive is not in a subdirectory");
    const zip::Entry* pkl = ar.find(prefix + "data.pkl");
    if (!pkl) throw_error(errors::pt_missing_record, where(*src), "no record " + quote(prefix + "data.pkl") + ": not a torch.save file");
    // torch.jit.save writes data.pkl too, with constants.pkl and code/ beside it: a module
    // (TorchScript), whose classes are its code.
    if (ar.find(prefix + "constants.pkl"))
      throw_error(errors::pt_not_torch, where(*src), "a TorchScript archive (torch.jit.save: " + quote(prefix + "constants.pkl") +
                                                         " and code), not a torch.save file");
    if (overlap) ar.locate(*pkl);
    // A short text record: its first `cap` bytes (a deflated one is inflated only when that short).
    auto text_record = [&](const zip::Entry& e, std::uint64_t cap) -> std::string {
      if (overlap) ar.locate(e);
      Region r;
      if (e.stored()) {
        ar.check_readable(e);
        r = read_region(*src, e.data_offset, std::min<std::uint64_t>(e.size, cap));
      } else {
        ar.check_extractable(e);
        if (e.size > cap) return std::string(static_cast<std::size_t>(cap) + 1, '?');  // longer than any valid content
        r = ar.read(e);
      }
      return std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size));
    };
    // The version: `.data/version` when there is one, else `version` (PyTorchStreamReader::init),
    // read by std::stoull and within the versions torch reads.
    const zip::Entry* ver = ar.find(prefix + ".data/version");
    if (!ver) ver = ar.find(prefix + "version");
    if (!ver)
      throw_error(errors::pt_no_version, where(*src), "no record " + quote(prefix + "version") + " (nor " + quote(prefix + ".data/version") +
                                                          "), which torch.load requires: Expected hasRecord(\"version\") to be true");
    {
      std::string v = text_record(*ver, 64);
      const std::optional<std::uint64_t> n = stoull_prefix(v);
      if (v.size() > 64) v = v.substr(0, 64) + "...";
      if (!n)
        throw_error(errors::pt_bad_version, where(*src), "record " + quote(ver->name) + " holds " + quote(v) + ", not a version number");
      if (*n < min_file_version || *n > max_file_version)
        throw_error(errors::pt_bad_version, where(*src), "record " + quote(ver->name) + " holds " + quote(v) + ": version " +
                                                             std::to_string(static_cast<std::int64_t>(*n)) + ", torch.load reads versions " +
                                                             std::to_string(min_file_version) + " to " + std::to_string(max_file_version));
    }
    // torch.load reads `.storage_alignment` with int() (and uses it only to predict offsets, which
    // statedict reads from the headers): a record int() cannot read is refused, any integer is not.
    if (const zip::Entry* al = ar.find(prefix + ".storage_alignment")) {
      constexpr std::uint64_t cap = 4096;
      std::string v = text_record(*al, cap);
      if (v.size() > cap || !python_int_literal(v))
        throw_error(errors::pt_bad_alignment, where(*src),
                    "record " + quote(al->name) + " holds " + quote(v.size() > 64 ? v.substr(0, 64) + "..." : v) +
                        (v.size() > cap ? " (more than " + std::to_string(cap) + " bytes)" : std::string()) +
                        ", not an integer: torch.load refuses it (invalid literal for int() with base 10)");
    }
    if (const zip::Entry* bo = ar.find(prefix + "byteorder")) {
      const std::string v = text_record(*bo, 16);
      if (v == "big") f.big_endian = true;
      else if (v != "little")
        throw_error(errors::pt_bad_byteorder, where(*src), "record " + quote(bo->name) + " holds " + quote(v) + ", not little or big");
    }
    // A big-endian file read for its values: the storages are swapped in an image in memory, which
    // needs every record's offset now (no prediction on another thread).
    const bool swap_in_memory = f.big_endian && !lazy;
    if (swap_in_memory && overlap) {
      ar.adopt_data_offsets(ar.data_offsets());
      overlap = false;
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

    // The image of the storage records (every `data/` record, each at a multiple of 64 bytes) when
    // some record is compressed: the File's source and view base are then the image.
    std::vector<std::uint64_t> image_offset;  // per entry; only for records under data/
    std::byte* image = nullptr;
    if (compressed || swap_in_memory) {
      const std::string data_dir = prefix + "data/";
      image_offset.assign(ar.entries().size(), 0);
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < ar.entries().size(); ++i) {
        const zip::Entry& e = ar.entries()[i];
        if (e.name.compare(0, data_dir.size(), data_dir) != 0) continue;
        ar.check_extractable(e);
        image_offset[i] = checked_add(total, 63, "records in memory") / 64 * 64;
        total = checked_add(image_offset[i], e.size, "records in memory");
        if (total > opts.limits.zip.max_inflated_bytes)
          throw_error(errors::zip_inflate_limit, where(*src),
                      "the storage records of an archive with compressed records are read into memory: more than " +
                          std::to_string(opts.limits.zip.max_inflated_bytes) + " bytes (zip::limits::max_inflated_bytes)");
      }
      auto bytes = std::make_shared<std::vector<std::byte>>(static_cast<std::size_t>(std::max<std::uint64_t>(total, 1)));
      for (std::size_t i = 0; i < ar.entries().size(); ++i) {
        const zip::Entry& e = ar.entries()[i];
        if (e.name.compare(0, data_dir.size(), data_dir) != 0) continue;
        ar.extract(e, std::span<std::byte>(bytes->data() + image_offset[i], static_cast<std::size_t>(e.size)));
        if (!e.stored()) ++f.compressed_records;
      }
      image = bytes->data();
      f.in_memory_bytes = total;
      f.source = std::make_shared<MemorySource>(src->name() + " (records in memory)", image, total, bytes);
      f.view_base = image;
      f.view_owner = bytes;
    } else {
      f.view_base = vb.base;
      f.view_owner = vb.owner;
    }
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
    po.input_owner = pickle_bytes.owner;  // numpy arrays in the pickle are views of it
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
      if (last_class == classes.size())
        classes.push_back({std::string(module), std::string(cls_name), t, untyped, is_quantized_storage(cls_name)});
      return static_cast<std::uint32_t>(last_class);
    };
    // ('storage', <class cls>, key, location, numel), its fields checked by the caller: the
    // storage's index in f.storages, placed when its key is first met.
    auto storage_index = [&](std::uint32_t cls, std::string_view key, std::string_view location, std::int64_t numel_in) -> std::uint32_t {
      check_location(key, location);
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
        if (!image) ar.check_readable(*e);
        zip_storage c{e, nullptr, {}, t, numel};
        std::uint64_t data_offset = image ? image_offset[static_cast<std::size_t>(e - entries.data())] : e->data_offset;
        if (overlap) {
          // The prediction, checked after the join. One that cannot be right (its bytes would run
          // into the central directory) still gets a pointer inside the source, never used.
          data_offset = zip::written_data_offset(ar, *e);
          if (data_offset > ar.central_directory_offset() || e->size > ar.central_directory_offset() - data_offset) {
            mispredicted = true;
            data_offset = 0;
          }
        }
        if (image) {
          c.data = image + data_offset;
          c.owner = f.view_owner;
        } else if (views_only) {
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
      // torch.load (without mmap) refuses a record of another size than its storage's bytes.
      if (nbytes < c.entry->size)
        throw_error(errors::pt_record_too_long, "storage " + quote(key) + " of " + std::to_string(numel) + " " + std::string(name(t)) +
                                                    " elements is " + std::to_string(nbytes) + " bytes; its record " + quote(c.entry->name) +
                                                    " holds " + std::to_string(c.entry->size) +
                                                    ", which torch.load refuses (record size does not match expected size)");
      return at;
    };
    // A storage as the tree holds it bare: storage_value of its bytes, as this id names them.
    auto storage_object = [&](std::uint32_t cls, std::uint32_t at, std::string_view location) -> Value {
      const zip_storage& c = seen[at];
      TensorView bytes = TensorView::contiguous(c.dtype, {static_cast<dim_t>(c.numel)}, c.data, c.owner);
      return storage_value(classes[cls].module, classes[cls].name, std::move(bytes), f.storages[at].key, std::string(location));
    };
    po.persistent_load = [&](const Value& pid) -> Value {
      refuse_text_pid(pid);
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
      if (std::any_of(classes.begin(), classes.end(), [](const storage_class& c) { return c.quantized; }))
        check_quantized_storages(f.value);
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
  if (f.big_endian && !lazy) swap_storages(f, seen);
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
  pickle::options plain;  // magic number, version, sys_info, key list: plain data, no objects
  plain.limits = opts.limits.pickle;
  plain.keep_unknown_objects = false;
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
  po.input_owner = all.owner;  // numpy arrays in the pickle are views of the file's bytes
  auto parse_pid = [&](const Value& pid, std::string& root, std::optional<std::tuple<std::string, std::int64_t, std::int64_t>>& view) {
    refuse_text_pid(pid);
    if (!pid.is_tuple() || pid.as_list().size() != 6 || !is_storage_tag(pid.at(0)))
      throw_error(errors::pt_bad_storage, "legacy persistent id is not ('storage', type, key, location, numel, view)");
    const List& p = pid.as_list();
    if (!p[1].is_object() || !p[2].is_string() || !p[3].is_string() || !p[4].is_int())
      throw_error(errors::pt_bad_storage, "legacy persistent id fields have the wrong types");
    root = p[2].as_string();
    check_location(root, p[3].as_string());
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
    if (std::any_of(roots.begin(), roots.end(), [](const auto& r) { return is_quantized_storage(r.second.cls.name); }))
      check_quantized_storages(f.value);
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
  throw_error(errors::pt_not_torch, where(*src), "neither a zip archive nor a legacy torch.save file (its magic number pickled at protocol 0-5)");
}

}  // namespace detail

}  // namespace statedict::inline v0::torch
