// statedict: a torch.save zip archive read as a Value tree whose tensors are *references* (dtype,
// sizes, strides, byte offset of the first element in the archive), never materialised.
// SPDX-License-Identifier: MIT
//
// Sharded-checkpoint readers describe where every element is without reading it: a DCP tensor item
// (an archive embedded in a `.distcp` file) and a ShardedTensor rank file both become chunks whose
// Placement points straight at the storage record's bytes. This reads only the zip central
// directory and `data.pkl` (safe unpickler, io/pickle_read.hpp, unknown classes kept as opaque
// objects, never executed); storage records are located, bounds-checked and left on disk.
//
// In the returned tree each tensor is a placeholder Object (`is_ref`) holding an index into
// `Tree::tensors`. A pickle cannot forge a placeholder: calling the placeholder's global is refused.
// Tensor subclasses rebuilt with `_rebuild_from_type_v2` around a plain tensor rebuild become plain
// tensors; other wrappers (ShardedTensor's `_rebuild_wrapper_subclass`) stay objects whose
// arguments and state are converted (their local shards' tensors are references too).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/source.hpp"
#include "../../core/value.hpp"
#include "../../io/pickle_read.hpp"
#include "../../io/torch_file.hpp"
#include "../../io/zip.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id tr_no_data_pkl      {750, error_kind::format,      "dcp.record_no_data_pkl"};
inline constexpr error_id tr_bad_storage_id   {751, error_kind::format,      "dcp.record_bad_storage_id"};
inline constexpr error_id tr_missing_record   {752, error_kind::format,      "dcp.record_missing"};
inline constexpr error_id tr_out_of_record    {753, error_kind::format,      "dcp.record_out_of_bounds"};
inline constexpr error_id tr_bad_rebuild_args {754, error_kind::format,      "dcp.record_bad_rebuild_args"};
inline constexpr error_id tr_unsupported      {755, error_kind::unsupported, "dcp.record_unsupported_tensor"};
inline constexpr error_id tr_pickle_too_large {756, error_kind::limit,       "dcp.record_pickle_too_large"};
inline constexpr error_id tr_bad_archive      {757, error_kind::format,      "dcp.record_bad_archive"};
// clang-format on
}  // namespace errors

namespace detail::torch_refs {

/// A tensor saved in a torch.save archive, located but not read.
struct TensorRef {
  statedict::dtype dtype = statedict::dtype::F32;
  shape_t sizes;
  shape_t strides;                   ///< element strides, as pickled
  std::uint64_t storage_offset = 0;  ///< elements
  std::string key;                   ///< storage key ("0")
  std::uint64_t record_offset = 0;   ///< byte offset of the storage record in the archive source
  std::uint64_t record_size = 0;     ///< bytes of the storage record
  /// Byte offset of the tensor's first element (index 0,...,0) in the archive source.
  [[nodiscard]] std::uint64_t byte_offset() const {
    return checked_add(record_offset, checked_mul(storage_offset, itemsize(dtype), "storage offset"), "storage offset");
  }
};

struct Tree {
  Value value;                     ///< the unpickled object; tensors are placeholders (is_ref)
  std::vector<TensorRef> tensors;  ///< indexed by the placeholders
  std::string prefix;              ///< the archive's top folder ("archive/")
};

struct load_options {
  pickle::limits pickle{};
  zip::limits zip{};
  /// Bytes of `data.pkl` read into memory.
  std::uint64_t max_pickle_bytes = std::uint64_t{1} << 30;
};

inline constexpr std::string_view ref_module = "statedict.torch_refs";
inline constexpr std::string_view ref_name = "tensor";
inline constexpr std::string_view storage_name = "storage";

/// True when `v` is a tensor placeholder made by load().
inline bool is_ref(const Value& v) noexcept {
  if (!v.is_object()) return false;
  const Object& o = v.as_object();
  return o.module == ref_module && o.name == ref_name && o.how == object_build::reduce && o.args.size() == 1 &&
         o.args[0].is_int();
}
inline std::size_t ref_index(const Value& v) { return static_cast<std::size_t>(v.as_object().args[0].as_int()); }

inline Value make_ref(std::size_t index) {
  Object o{std::string(ref_module), std::string(ref_name), object_build::reduce, {}, {}, {}};
  o.args.emplace_back(static_cast<std::int64_t>(index));
  return Value(std::move(o));
}

namespace impl {

struct State {
  const zip::Archive* archive = nullptr;
  std::string prefix;
  std::vector<TensorRef> tensors;
};

inline bool is_storage(const Value& v) {
  return v.is_object() && v.as_object().module == ref_module && v.as_object().name == storage_name &&
         v.as_object().how == object_build::newobj && v.as_object().args.size() == 3;
}

/// persistent_load: ('storage', torch.<X>Storage, key, location, numel) -> a storage marker.
inline Value storage_marker(const Value& pid) {
  if (!pid.is_tuple() || pid.as_list().size() < 5 || !pid.as_list()[0].is_string() ||
      pid.as_list()[0].as_string() != "storage")
    throw_error(errors::tr_bad_storage_id, "persistent id is not ('storage', type, key, location, numel)");
  const List& p = pid.as_list();
  if (!p[1].is_object() || p[1].as_object().how != object_build::global || !p[2].is_string() || !p[4].is_int() ||
      p[4].as_int() < 0)
    throw_error(errors::tr_bad_storage_id, "persistent id has a malformed storage type, key or element count");
  const Object& type = p[1].as_object();
  std::string dt;
  if (type.module == "torch" || type.module == "torch.cuda") {
    if (type.name == "UntypedStorage") {
      dt = "U8";
    } else if (auto d = dtype_from_storage_name(type.name)) {
      dt = std::string(name(*d));
    }
  } else if (type.module == "torch.storage" && type.name == "UntypedStorage") {
    dt = "U8";
  }
  const std::string& key = p[2].as_string();
  // A quantized storage means its values only with _rebuild_qtensor's scale and zero point, which
  // this reader does not keep: refused wherever it is (torch.load reads quantized values).
  const std::string& n = type.name;
  if (dt.empty() && (n == "QInt8Storage" || n == "QUInt8Storage" || n == "QInt32Storage" || n == "QUInt4x2Storage" || n == "QUInt2x4Storage"))
    throw_error(errors::tr_unsupported, "storage " + quote(key) + " is a " + quote(type.qualified()) +
                                            ": quantized tensors are not read from these records (torch.load gives quantized "
                                            "values, which need their quantization parameters)");
  if (dt.empty())
    throw_error(errors::tr_unsupported, "storage type " + quote(type.qualified()) + " is not one statedict reads");
  if (key.empty() || key.size() > 64 || key.find('/') != std::string::npos)
    throw_error(errors::tr_bad_storage_id, "storage key " + quote(key) + " is not a record name");
  Object o{std::string(ref_module), std::string(storage_name), object_build::newobj, {}, {}, {}};
  o.args.emplace_back(key);
  o.args.emplace_back(std::move(dt));
  o.args.emplace_back(p[4].as_int());
  return Value(std::move(o));
}

inline shape_t int_tuple(pickle::Call& c, const Value& v, const char* what) {
  if (!v.is_sequence()) c.reader.fail(errors::tr_bad_rebuild_args, std::string(what) + " is not a tuple of ints");
  shape_t out;
  for (const Value& x : v.as_list()) {
    if (!x.is_int()) c.reader.fail(errors::tr_bad_rebuild_args, std::string(what) + " holds a non-int");
    out.push_back(x.as_int());
  }
  return out;
}

/// _rebuild_tensor_v2 / _rebuild_tensor / _rebuild_tensor_v3 -> a placeholder.
inline Value rebuild(State& st, pickle::Call& c, bool v3) {
  const List& a = c.args;
  const std::string fn = c.callable.qualified();
  if (a.size() < (v3 ? 7U : 4U)) c.reader.fail(errors::tr_bad_rebuild_args, fn + " with " + std::to_string(a.size()) + " arguments");
  if (!is_storage(a[0])) c.reader.fail(errors::tr_bad_rebuild_args, fn + ": first argument is not a saved storage");
  if (!a[1].is_int() || a[1].as_int() < 0) c.reader.fail(errors::tr_bad_rebuild_args, fn + ": storage offset is not a non-negative int");
  const Object& s = a[0].as_object();
  TensorRef t;
  t.key = s.args[0].as_string();
  t.dtype = *dtype_from_name(s.args[1].as_string());
  const auto storage_numel = static_cast<std::uint64_t>(s.args[2].as_int());
  std::uint64_t storage_bytes = checked_mul(storage_numel, itemsize(t.dtype), "storage size");
  if (v3) {
    if (!a[6].is_object() || a[6].as_object().how != object_build::global || a[6].as_object().module != "torch")
      c.reader.fail(errors::tr_bad_rebuild_args, fn + ": dtype argument is not a torch dtype");
    auto d = dtype_from_torch_name(a[6].as_object().name);
    if (!d) c.reader.fail(errors::tr_unsupported, fn + ": dtype torch." + a[6].as_object().name + " is not one statedict reads");
    if (t.dtype != dtype::U8 && t.dtype != *d)
      c.reader.fail(errors::tr_bad_rebuild_args, fn + ": typed storage of another dtype");
    t.dtype = *d;  // an untyped storage's numel counts bytes
  }
  t.storage_offset = static_cast<std::uint64_t>(a[1].as_int());
  t.sizes = int_tuple(c, a[2], "size");
  t.strides = int_tuple(c, a[3], "stride");
  if (t.sizes.size() != t.strides.size())
    c.reader.fail(errors::tr_bad_rebuild_args, fn + ": " + std::to_string(t.sizes.size()) + " sizes but " +
                                                   std::to_string(t.strides.size()) + " strides");
  if (t.sizes.size() > 64) c.reader.fail(errors::tr_bad_rebuild_args, fn + ": more than 64 dimensions");
  for (std::size_t d = 0; d < t.sizes.size(); ++d)
    if (t.sizes[d] < 0 || t.strides[d] < 0)
      c.reader.fail(errors::tr_bad_rebuild_args, fn + ": negative size or stride");
  const std::size_t math_arg = v3 ? 7 : 6;
  if (a.size() > math_arg && a[math_arg].is_dict()) {
    for (const auto& [k, v] : a[math_arg].as_dict())
      if (k.is_string() && (k.as_string() == "conj" || k.as_string() == "neg") && v.is_bool() && v.as_bool())
        c.reader.fail(errors::tr_unsupported, fn + ": tensor with the " + k.as_string() + " bit set");
  }
  // Locate and bound-check the storage record.
  const std::string record = st.prefix + "data/" + t.key;
  const zip::Entry* e = st.archive->find(record);
  if (!e) c.reader.fail(errors::tr_missing_record, "storage record " + quote(record) + " is not in the archive");
  st.archive->check_readable(*e);
  t.record_offset = e->data_offset;
  t.record_size = e->size;
  // torch.load reads a storage record of exactly numel x itemsize bytes (a longer one is
  // "record size ... does not match expected size").
  if (storage_bytes != e->size)
    c.reader.fail(storage_bytes > e->size ? errors::tr_out_of_record : errors::tr_bad_archive,
                  "storage of " + std::to_string(storage_numel) + " elements (" + std::to_string(storage_bytes) +
                      " bytes) but record " + quote(record) + " holds " + std::to_string(e->size) + " bytes");
  const std::uint64_t n = numel(t.sizes);
  if (n > 0) {
    std::uint64_t last = t.storage_offset;
    for (std::size_t d = 0; d < t.sizes.size(); ++d)
      last = checked_add(last, checked_mul(static_cast<std::uint64_t>(t.sizes[d] - 1), static_cast<std::uint64_t>(t.strides[d]), "extent"), "extent");
    const std::uint64_t end_bytes = checked_mul(checked_add(last, 1, "extent"), itemsize(t.dtype), "extent");
    if (end_bytes > e->size)
      c.reader.fail(errors::tr_out_of_record, "tensor of size " + to_string(t.sizes) + ", strides " + to_string(t.strides) +
                                                  " at storage offset " + std::to_string(t.storage_offset) +
                                                  " reaches byte " + std::to_string(end_bytes) + " of record " + quote(record) +
                                                  " (" + std::to_string(e->size) + " bytes)");
  }
  st.tensors.push_back(std::move(t));
  return make_ref(st.tensors.size() - 1);
}

/// What torch.load (which DCP's reader calls on each embedded archive) requires of the archive
/// beyond its pickle, as io/torch_file.hpp holds a torch.save file to it: every record in the
/// first record's folder, a readable version record within the versions torch reads, and
/// little-endian storages (the only byte order these references describe).
inline void check_archive(const zip::Archive& ar, const std::string& prefix, const std::string& where) {
  for (const zip::Entry& e : ar.entries())
    if (e.name.compare(0, prefix.size(), prefix) != 0)
      throw_error(errors::tr_bad_archive, where, "record " + quote(e.name) + " is not in the archive's folder " + quote(prefix) +
                                                     " (torch.load: file in archive is not in a subdirectory)");
  auto text = [&](const zip::Entry& e) {
    if (e.size > 64) return std::string(65, '?');  // longer than any valid content
    const Region r = ar.read(e);
    return std::string(reinterpret_cast<const char*>(r.data), static_cast<std::size_t>(r.size));
  };
  const zip::Entry* ver = ar.find(prefix + ".data/version");
  if (!ver) ver = ar.find(prefix + "version");
  if (!ver)
    throw_error(errors::tr_bad_archive, where, "no record " + quote(prefix + "version") +
                                                   ", which torch.load requires (Expected hasRecord(\"version\") to be true)");
  const std::string v = text(*ver);
  const std::optional<std::uint64_t> n = torch::detail::stoull_prefix(v);
  if (!n || *n < torch::detail::min_file_version || *n > torch::detail::max_file_version)
    throw_error(errors::tr_bad_archive, where, "record " + quote(ver->name) + " holds " + quote(v.substr(0, 64)) +
                                                   ", not a version torch.load reads (" +
                                                   std::to_string(torch::detail::min_file_version) + " to " +
                                                   std::to_string(torch::detail::max_file_version) + ")");
  if (const zip::Entry* bo = ar.find(prefix + "byteorder")) {
    const std::string b = text(*bo);
    if (b == "big")
      throw_error(errors::tr_unsupported, where, "record " + quote(bo->name) + " says big-endian storages, which embedded archives are not read with");
    if (b != "little")
      throw_error(errors::tr_bad_archive, where, "record " + quote(bo->name) + " holds " + quote(b.substr(0, 64)) + ", not little or big");
  }
}

inline pickle::Registry registry(State& st) {
  pickle::Registry r(&pickle::Registry::shared());
  r.function("torch._utils._rebuild_tensor_v2", [&st](pickle::Call& c) { return rebuild(st, c, false); });
  r.function("torch._utils._rebuild_tensor", [&st](pickle::Call& c) { return rebuild(st, c, false); });
  r.function("torch._utils._rebuild_tensor_v3", [&st](pickle::Call& c) { return rebuild(st, c, true); });
  for (const char* p : {"torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"}) {
    r.function(p, [](pickle::Call& c) -> Value {
      if (c.args.empty() || !is_ref(c.args[0]))
        c.reader.fail(errors::tr_bad_rebuild_args, c.callable.qualified() + " of something that is not a saved tensor");
      return c.args[0];
    });
  }
  for (const char* u : {"torch._utils._rebuild_qtensor", "torch._utils._rebuild_sparse_tensor",
                        "torch._utils._rebuild_sparse_csr_tensor", "torch._utils._rebuild_meta_tensor_no_storage",
                        "torch._utils._rebuild_device_tensor_from_numpy", "torch._utils._rebuild_device_tensor_from_cpu_tensor"}) {
    r.function(u, [](pickle::Call& c) -> Value {
      c.reader.fail(errors::tr_unsupported, c.callable.qualified() + " (quantized, sparse, meta or numpy tensors) is not supported");
    });
  }
  r.function("torch._tensor._rebuild_from_type_v2", [](pickle::Call& c) -> Value {
    List& a = c.args;
    if (a.size() != 4 || !a[0].is_object() || a[0].as_object().how != object_build::global)
      c.reader.fail(errors::tr_bad_rebuild_args, "_rebuild_from_type_v2 expects (func, type, args, state)");
    const std::string f = a[0].as_object().qualified();
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor_v3" ||
        f == "torch._utils._rebuild_tensor" || f == "torch._utils._rebuild_parameter") {
      if (!a[2].is_sequence()) c.reader.fail(errors::tr_bad_rebuild_args, "_rebuild_from_type_v2 arguments are not a tuple");
      Value t = c.reader.call(a[0].as_object(), a[2].as_list());
      return t;  // a tensor subclass read as its plain tensor
    }
    Object o{"torch._tensor", "_rebuild_from_type_v2", object_build::reduce, std::move(a), {}, {}};
    return Value(std::move(o));
  });
  // Placeholders cannot come from a pickle: calling their globals is refused.
  for (std::string_view n : {ref_name, storage_name})
    r.function(std::string(ref_module) + "." + std::string(n), [](pickle::Call& c) -> Value {
      c.reader.fail(errors::tr_bad_rebuild_args, "global " + quote(c.callable.qualified()) + " is reserved");
    });
  return r;
}

}  // namespace impl

/// Reads the torch.save zip archive in `src`: its directory, then `data.pkl` with tensors as
/// references. Never reads a storage record. Errors name the archive (`src->name()`).
inline Tree load(const std::shared_ptr<const ByteSource>& src, const load_options& opt = {}) {
  zip::read_options zo;
  zo.limits = opt.zip;
  const zip::Archive ar = zip::Archive::open(src, zo);
  const std::string where = "zip archive " + quote(src->name());
  if (ar.entries().empty()) throw_error(errors::tr_no_data_pkl, where, "the archive has no entries");
  impl::State st;
  st.archive = &ar;
  const std::string& first = ar.entries().front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos || slash == 0)
    throw_error(errors::tr_no_data_pkl, where, "first entry " + quote(first) + " is not inside a top folder");
  st.prefix = first.substr(0, slash + 1);
  const zip::Entry* pkl = ar.find(st.prefix + "data.pkl");
  if (!pkl) throw_error(errors::tr_no_data_pkl, where, "no entry " + quote(st.prefix + "data.pkl"));
  impl::check_archive(ar, st.prefix, where);
  if (pkl->size > opt.max_pickle_bytes)
    throw_error(errors::tr_pickle_too_large, where,
                "data.pkl of " + std::to_string(pkl->size) + " bytes exceeds max_pickle_bytes (" +
                    std::to_string(opt.max_pickle_bytes) + ")");
  const Region bytes = ar.read(*pkl);
  const pickle::Registry reg = impl::registry(st);
  pickle::options po;
  po.limits = opt.pickle;
  po.keep_unknown_objects = true;
  po.registry = &reg;
  po.persistent_load = [](const Value& pid) { return impl::storage_marker(pid); };
  Tree t;
  try {
    pickle::Result r = pickle::load(bytes.span(), po);
    t.value = std::move(r.value);
  } catch (error& e) {
    e.add_context(where + ": " + quote(st.prefix + "data.pkl"));
    throw;
  }
  t.tensors = std::move(st.tensors);
  t.prefix = std::move(st.prefix);
  return t;
}

}  // namespace detail::torch_refs
}  // namespace statedict::inline v0
