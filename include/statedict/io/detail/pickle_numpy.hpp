// statedict: numpy arrays, scalars and dtypes in pickles, read as data (io/pickle_read.hpp is the
// public header). Nothing of numpy is imported or called: the rules below read what numpy's
// `__reduce__` wrote and make tensors of it.
// SPDX-License-Identifier: MIT
//
// What numpy writes, and what it becomes:
//   ndarray, protocols 2-5:  _reconstruct(numpy.ndarray, (0,), b'b') then BUILD of the state
//                            (version, shape, dtype, is_fortran, data) -> a tensor of the shape,
//                            row-major or (is_fortran) column-major strides
//   ndarray, protocol 5:     _frombuffer(buffer, dtype, shape, order) with the buffer in band
//                            (BYTEARRAY8; BINBYTES when read-only) -> the same
//   scalar (np.float32(1.5)): scalar(dtype, bytes of one element) -> a 0-d tensor
//   dtype:                   numpy.dtype('f4', False, True) then BUILD (3, '<', None, None, None,
//                            -1, -1, 0) -> stays an Object; the rules above read it
// `_reconstruct`, `_frombuffer` and `scalar` are found in numpy.core (numpy 1) and numpy._core
// (numpy 2). Element types: b1 i1 i2 i4 i8 u1 u2 u4 u8 f2 f4 f8 c8 c16 (BOOL ... C128). Others
// (objects, strings, records, datetimes, long double) and ndarray subclasses (np.matrix, masked
// arrays) stay Objects, their calls and states kept as data. The data is protocol 2's
// `_codecs.encode(str, 'latin1')` (Bytes, already copied), a bytes or bytearray in the pickle, or
// (Python 2) a str: an array whose bytes lie whole in the input, little-endian, is a view of them
// when options::input_owner keeps the input alive; otherwise, and for big-endian arrays (swapped
// to little-endian), the bytes are copied. A data length other than the shape's, or a malformed
// state, is pickle.bad_numpy: numpy itself would refuse it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/tensor.hpp"
#include "../../core/value.hpp"

#include "pickle_opcodes.hpp"

namespace statedict::inline v0::pickle::detail {

/// Dimensions of a numpy array (numpy 2's NPY_MAXDIMS).
inline constexpr std::size_t numpy_max_dims = 64;

/// An element type as numpy pickled it.
struct numpy_dtype {
  statedict::dtype type;
  bool big_endian;
};

/// The element type a pickled numpy.dtype names: Object numpy.dtype (how reduce, args (code,
/// align, copy), state (version 3 or 4, byte order, subarray, names, fields, ...)). nullopt for
/// anything that is not such a dtype of a type statedict has.
inline std::optional<numpy_dtype> numpy_dtype_of(const Value& v) {
  if (!v.is_object()) return std::nullopt;
  const Object& o = v.as_object();
  if (o.module != "numpy" || o.name != "dtype" || o.how != object_build::reduce || o.args.empty() || !o.args[0].is_string() ||
      !o.items.empty() || o.state.size() > 1)
    return std::nullopt;
  struct code {
    std::string_view text;
    statedict::dtype type;
  };
  static constexpr code codes[] = {{"b1", dtype::BOOL}, {"i1", dtype::I8},  {"i2", dtype::I16}, {"i4", dtype::I32},
                                   {"i8", dtype::I64},  {"u1", dtype::U8},  {"u2", dtype::U16}, {"u4", dtype::U32},
                                   {"u8", dtype::U64},  {"f2", dtype::F16}, {"f4", dtype::F32}, {"f8", dtype::F64},
                                   {"c8", dtype::C64},  {"c16", dtype::C128}};
  std::optional<statedict::dtype> t;
  for (const code& c : codes)
    if (o.args[0].as_string() == c.text) t = c.type;
  if (!t) return std::nullopt;
  bool big = false;
  if (!o.state.empty()) {
    const Value& s = o.state[0];
    if (!s.is_tuple() || s.as_list().size() < 5) return std::nullopt;
    const List& st = s.as_list();
    if (!st[0].is_int() || (st[0].as_int() != 3 && st[0].as_int() != 4) || !st[1].is_string()) return std::nullopt;
    for (std::size_t i = 2; i < 5; ++i)  // subarray, names, fields: a record or sub-array type
      if (!st[i].is_none()) return std::nullopt;
    const std::string& order = st[1].as_string();
    if (order == ">") big = true;
    else if (order != "<" && order != "|" && order != "=") return std::nullopt;
  }
  return numpy_dtype{*t, big && itemsize(*t) > 1};
}

/// The tensor of a numpy array of `shape` (row-major, or column-major when `fortran`) whose
/// elements are `data`; a view of `data` when `in_input` and the reader keeps its input alive,
/// else a copy (swapped to little-endian when the dtype is big-endian).
inline TensorView numpy_tensor(Reader& r, numpy_dtype t, const shape_t& shape, bool fortran, std::string_view data, bool in_input,
                               std::string_view what) {
  std::uint64_t n = 1;
  for (const dim_t d : shape) {
    if (d < 0) r.fail(errors::pk_bad_numpy, std::string(what) + " of shape " + to_string(shape) + ": a negative dimension");
    n = checked_mul(n, static_cast<std::uint64_t>(d), "numpy array size");
  }
  const std::size_t item = itemsize(t.type);
  const std::uint64_t nbytes = checked_mul(n, item, "numpy array size");
  if (nbytes != data.size())
    r.fail(errors::pk_bad_numpy, std::string(what) + " of shape " + to_string(shape) + " and dtype " + std::string(name(t.type)) +
                                     " needs " + std::to_string(nbytes) + " bytes; its data has " + std::to_string(data.size()));
  // Strides of the dimensions in memory order; an empty array has no element to address (its
  // dimensions' product may exceed int64 where one of them is 0), so its strides are all 1.
  shape_t strides(shape.size(), 1);
  if (n != 0) {  // every product below divides n, which fits
    if (fortran) {
      for (std::size_t i = 1; i < shape.size(); ++i) strides[i] = strides[i - 1] * shape[i - 1];
    } else {
      for (std::size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
    }
  }
  const keep_alive& owner = r.opts().input_owner;
  if (in_input && owner && !t.big_endian && !data.empty())
    return TensorView(t.type, shape, std::move(strides), reinterpret_cast<const std::byte*>(data.data()), owner);
  auto copy = std::make_shared<std::vector<std::byte>>(std::max<std::size_t>(data.size(), 1));
  if (!data.empty()) std::memcpy(copy->data(), data.data(), data.size());
  if (t.big_endian) {
    const std::size_t part = info(t.type).is_complex ? item / 2 : item;  // complex: per component
    for (std::size_t at = 0; at < data.size(); at += part) std::reverse(copy->data() + at, copy->data() + at + part);
  }
  const std::byte* p = copy->data();
  return TensorView(t.type, shape, std::move(strides), p, std::move(copy));
}

/// The bytes of a data argument held as a Value: Bytes (protocol 2's _codecs.encode, bytes()) or
/// a bytearray Object; nullopt for anything else.
inline std::optional<std::string_view> value_bytes(const Value& v) {
  const Value* b = &v;
  if (v.is_object() && v.as_object().qualified() == "builtins.bytearray" && v.as_object().args.size() == 1) b = &v.as_object().args[0];
  if (!b->is_bytes()) return std::nullopt;
  const auto& d = b->as_bytes().data;
  return std::string_view(reinterpret_cast<const char*>(d.data()), d.size());
}

/// Argument `i` of `a` as data bytes: in the pickle (str, bytes, bytearray) or a Value (as
/// value_bytes). A str is Python 2's: its bytes are the data (what numpy reads after encoding
/// the text as latin-1 when that text came from a Python 2 str).
inline std::optional<Args::raw_bytes> data_arg(const Args& a, std::size_t i) {
  if (i >= a.size()) return std::nullopt;
  if (a.kind_of(i) == Args::kind::value)
    if (const auto b = value_bytes(a.value(i))) return Args::raw_bytes{*b, false};
  return a.raw(i);
}

/// BUILD of `_reconstruct(numpy.ndarray, (0,), b'b')` with the array's state.
inline std::optional<Value> ndarray_build(const Build& b) {
  using k = Args::kind;
  Reader& r = b.state.reader();
  if (b.args.size() == 0 || b.args.kind_of(0) != k::global) return std::nullopt;
  if (const auto [m, n] = b.args.global(0); m != "numpy" || n != "ndarray") return std::nullopt;  // a subclass
  const std::optional<Args> st = b.state.items(0);
  if (!st || (st->size() != 5 && st->size() != 4))
    r.fail(errors::pk_bad_numpy, "numpy.ndarray state is not (version, shape, dtype, is_fortran, data)");
  const std::size_t at = st->size() == 5 ? 1 : 0;  // the 4-item form has no version
  if (at == 1 && st->kind_of(0) != k::integer) r.fail(errors::pk_bad_numpy, "numpy.ndarray state version is not an int");
  shape_t shape;
  if (!st->ints(at, numpy_max_dims, shape))
    r.fail(errors::pk_bad_numpy, "numpy.ndarray shape is not a tuple of at most " + std::to_string(numpy_max_dims) + " ints");
  const std::optional<numpy_dtype> t = numpy_dtype_of(st->convert(at + 1));
  if (!t) return std::nullopt;  // objects, strings, records...: the array stays an object
  if (st->kind_of(at + 2) != k::boolean && st->kind_of(at + 2) != k::integer)
    r.fail(errors::pk_bad_numpy, "numpy.ndarray is_fortran is not a bool");
  const bool fortran = st->integer(at + 2) != 0;
  const std::optional<Args::raw_bytes> data = data_arg(*st, at + 3);
  if (!data) r.fail(errors::pk_bad_numpy, "numpy.ndarray data of a " + std::string(name(t->type)) + " array is not bytes");
  std::string latin1;
  std::string_view bytes = data->data;
  if (st->kind_of(at + 3) == k::str) {  // a Python 2 str decoded as UTF-8: numpy encodes it as latin-1
    std::vector<std::uint8_t> out;
    if (!detail::utf8_to_latin1(bytes, out)) r.fail(errors::pk_bad_numpy, "numpy.ndarray data is a str beyond latin-1");
    latin1.assign(out.begin(), out.end());
    bytes = latin1;
  }
  return Value(numpy_tensor(r, *t, shape, fortran, bytes, data->in_input && st->kind_of(at + 3) != k::str, "numpy array"));
}

/// `_frombuffer(buffer, dtype, shape, order)` read from the reader's nodes (the buffer in place).
inline std::optional<Value> frombuffer_fast(const Args& a) {
  using k = Args::kind;
  if (a.size() != 4 || (a.kind_of(3) != k::str)) return std::nullopt;
  const std::optional<Args::raw_bytes> data = data_arg(a, 0);
  const std::optional<numpy_dtype> t = numpy_dtype_of(a.convert(1));
  shape_t shape;
  if (!data || a.kind_of(0) == k::str || !t || !a.ints(2, numpy_max_dims, shape) || (a.str(3) != "C" && a.str(3) != "F"))
    return std::nullopt;
  return Value(numpy_tensor(a.reader(), *t, shape, a.str(3) == "F", data->data, data->in_input, "numpy array"));
}

/// The same from Values; a call it cannot read (another dtype) stays an Object.
inline Value frombuffer_call(Call& c) {
  const List& a = c.args;
  const std::optional<std::string_view> data = a.size() == 4 ? value_bytes(a[0]) : std::nullopt;
  const std::optional<numpy_dtype> t = a.size() == 4 ? numpy_dtype_of(a[1]) : std::nullopt;
  if (!data || !t) return Value(Object{c.callable.module, c.callable.name, object_build::reduce, a, {}, {}});
  if (!a[2].is_sequence() || a[2].as_list().size() > numpy_max_dims || !a[3].is_string() ||
      (a[3].as_string() != "C" && a[3].as_string() != "F"))
    c.reader.fail(errors::pk_bad_numpy, c.callable.qualified() + " expects (buffer, dtype, shape tuple, 'C' or 'F')");
  shape_t shape;
  for (const Value& d : a[2].as_list()) {
    if (!d.is_int()) c.reader.fail(errors::pk_bad_numpy, c.callable.qualified() + " shape holds a " + std::string(to_string(d.kind())));
    shape.push_back(d.as_int());
  }
  return Value(numpy_tensor(c.reader, *t, shape, a[3].as_string() == "F", *data, false, "numpy array"));
}

/// `scalar(dtype, bytes of one element)` from the reader's nodes.
inline std::optional<Value> scalar_fast(const Args& a) {
  if (a.size() != 2 || a.kind_of(1) == Args::kind::str) return std::nullopt;
  const std::optional<Args::raw_bytes> data = data_arg(a, 1);
  const std::optional<numpy_dtype> t = numpy_dtype_of(a.convert(0));
  if (!data || !t) return std::nullopt;
  return Value(numpy_tensor(a.reader(), *t, {}, false, data->data, data->in_input, "numpy scalar"));
}

inline Value scalar_call(Call& c) {
  const List& a = c.args;
  const std::optional<numpy_dtype> t = a.size() == 2 ? numpy_dtype_of(a[0]) : std::nullopt;
  const std::optional<std::string_view> data = a.size() == 2 ? value_bytes(a[1]) : std::nullopt;
  if (!t || !data) return Value(Object{c.callable.module, c.callable.name, object_build::reduce, a, {}, {}});  // an object scalar
  return Value(numpy_tensor(c.reader, *t, {}, false, *data, false, "numpy scalar"));
}

/// The data rules beyond torch's weights_only list: numpy (both module paths) and copyreg.
inline void add_data_rules(Registry& r) {
  for (const char* core : {"numpy.core", "numpy._core"}) {
    Rule rec;
    rec.build = ndarray_build;
    rec.beyond_weights_only = true;
    r.add(std::string(core) + ".multiarray._reconstruct", rec);
    Rule fb{Rule::kind::function, frombuffer_call, frombuffer_fast, {}, true};
    r.add(std::string(core) + ".numeric._frombuffer", fb);
    Rule sc{Rule::kind::function, scalar_call, scalar_fast, {}, true};
    r.add(std::string(core) + ".multiarray.scalar", sc);
  }
  r.add("copyreg._reconstructor", Rule{Rule::kind::reconstructor, {}, {}, {}, true});
}

}  // namespace statedict::inline v0::pickle::detail
