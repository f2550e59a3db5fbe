// statedict: a safe unpickler (protocols 0-5 opcodes; what torch.save and DCP metadata use).
// SPDX-License-Identifier: MIT
//
// `pickle::load(bytes, options)` turns a pickle into a Value tree and never executes anything:
// no module is imported, no pickled callable is called. Every GLOBAL is looked up in a registry
// (`pickle::Registry::weights_only()`): the globals torch.load(weights_only=True) accepts, which
// statedict interprets as data, and rules that read well-known objects beyond that list as data
// (numpy arrays, dtypes and scalars; protocol 0/1 objects made by copyreg._reconstructor). Any
// other global is an object: REDUCE / NEWOBJ / BUILD of it make an `Object` node (class name,
// arguments, state, items), never a call. `options.keep_unknown_objects = false` refuses such
// globals instead (a security_error naming `module.name`), as torch.load(weights_only=True) does,
// and then the rules beyond torch's list are refused too. Modules that only ever mean code
// execution (os, posix, nt, sys, subprocess, ...) are refused either way.
//
// How globals become Values (docs/torch-files.md has the full table):
//   collections.OrderedDict()            -> Dict (a BUILD setting attributes such as `_metadata`
//                                           on it is reported in Result::attributes, by path;
//                                           attributes holding a tensor keep it an Object
//                                           collections.OrderedDict with items and state)
//   _codecs.encode(str, 'latin1')        -> Bytes; builtins.bytes() -> empty Bytes
//   torch.Size(tuple)                    -> tuple of ints
//   builtins.set / frozenset             -> Object builtins.set / frozenset with `items`
//   builtins.bytearray, BYTEARRAY8       -> Object builtins.bytearray, args [Bytes]
//   ints beyond int64 (LONG1/LONG4/text) -> Object builtins.int, args [Bytes: minimal
//                                           little-endian two's complement]
//   dicts with keys other than int/str   -> Object builtins.dict (collections.OrderedDict when it
//                                           was one), items = (key, value) tuples
//   numpy ndarray (_reconstruct + BUILD,  -> a tensor (io/detail/pickle_numpy.hpp: which dtypes,
//   _frombuffer), numpy scalars             in place or copied); other numpy objects stay Objects
//   copyreg._reconstructor(cls, object,  -> Object cls, how = newobj (what protocol 2 writes as
//   None)                                   NEWOBJ), its BUILD state kept
//   any other allowed global, referenced -> Object, how = global (torch.float32, torch.Tensor)
//   any other allowed global, called     -> Object, how = reduce / newobj (torch.device('cpu'))
//   any other global                     -> the same Object forms (data, never called)
// The torch layer (io/torch_file.hpp) adds the tensor rebuild functions and storages.
//
// Hostile input: every length is checked against the bytes left before anything is allocated,
// nesting, memo, stack, output size, string and long sizes are capped (`pickle::limits`), cyclic
// structures are rejected, and no recursion depends on input size beyond `limits::max_depth`.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/detail/text.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/value.hpp"
#include "detail/pickle_text.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id pk_truncated          {450, error_kind::format,      "pickle.truncated"};
inline constexpr error_id pk_unknown_opcode     {451, error_kind::format,      "pickle.unknown_opcode"};
inline constexpr error_id pk_unsupported_opcode {452, error_kind::unsupported, "pickle.unsupported_opcode"};
inline constexpr error_id pk_bad_protocol       {453, error_kind::format,      "pickle.bad_protocol"};
inline constexpr error_id pk_stack_underflow    {454, error_kind::format,      "pickle.stack_underflow"};
inline constexpr error_id pk_no_mark            {455, error_kind::format,      "pickle.no_mark"};
inline constexpr error_id pk_bad_memo           {456, error_kind::format,      "pickle.bad_memo"};
inline constexpr error_id pk_forbidden_global   {457, error_kind::security,    "pickle.forbidden_global"};
inline constexpr error_id pk_blocked_module     {458, error_kind::security,    "pickle.blocked_module"};
inline constexpr error_id pk_bad_operand        {459, error_kind::format,      "pickle.bad_operand"};
inline constexpr error_id pk_depth_limit        {460, error_kind::limit,       "pickle.depth_limit"};
inline constexpr error_id pk_memo_limit         {461, error_kind::limit,       "pickle.memo_limit"};
inline constexpr error_id pk_node_limit         {462, error_kind::limit,       "pickle.node_limit"};
inline constexpr error_id pk_string_limit       {463, error_kind::limit,       "pickle.string_limit"};
inline constexpr error_id pk_long_limit         {464, error_kind::limit,       "pickle.long_limit"};
inline constexpr error_id pk_stack_limit        {465, error_kind::limit,       "pickle.stack_limit"};
inline constexpr error_id pk_bad_utf8           {466, error_kind::format,      "pickle.bad_utf8"};
inline constexpr error_id pk_recursive          {467, error_kind::format,      "pickle.recursive"};
inline constexpr error_id pk_no_persistent_load {468, error_kind::format,      "pickle.no_persistent_load"};
inline constexpr error_id pk_bad_call           {469, error_kind::format,      "pickle.bad_call"};
inline constexpr error_id pk_bad_text           {470, error_kind::format,      "pickle.bad_text"};
inline constexpr error_id pk_bad_numpy          {471, error_kind::format,      "pickle.bad_numpy"};
inline constexpr error_id pk_no_such_name       {472, error_kind::format,      "pickle.no_such_name"};
// clang-format on
}  // namespace errors

namespace pickle {

/// Caps on hostile pickles. Defaults fit any real checkpoint by a wide margin; raise them when a
/// legitimate file needs it (each error names the field).
struct limits {
  /// Nesting of containers in the result, and of MARKs while parsing. The conversion recurses
  /// once per level: about 1 KiB of stack a level in an unoptimised build (more under ASan), so
  /// raise it by thousands only on a thread with the stack for it.
  std::size_t max_depth = 1000;
  /// Distinct memo entries (torch.save uses about a dozen per tensor).
  std::uint64_t max_memo = std::uint64_t{1} << 24;
  /// Values in the result. Memo references are copied into the tree, so a small pickle can ask for
  /// an exponential number of nodes; this stops it.
  std::uint64_t max_nodes = std::uint64_t{1} << 23;
  /// Items on the unpickling stack at once.
  std::uint64_t max_stack = std::uint64_t{1} << 24;
  /// Bytes of one str or bytes object (also checked against the bytes left in the input).
  std::uint64_t max_string_bytes = std::uint64_t{1} << 30;
  /// Bytes of one LONG1/LONG4 integer.
  std::uint64_t max_long_bytes = std::uint64_t{1} << 16;
};

/// A BUILD that set attributes on a dict (an OrderedDict subclass with a `__dict__`, like
/// `nn.Module.state_dict()` and its `_metadata`). `path` locates the dict in Result::value.
struct Attributes {
  Path path;
  Dict attributes;  ///< attribute name -> value
  friend bool operator==(const Attributes&, const Attributes&) = default;
};

struct Result {
  Value value;
  std::vector<Attributes> attributes;
  std::uint64_t consumed = 0;  ///< bytes up to and including STOP
  int protocol = 0;            ///< the PROTO operand (0 when absent)
};

class Reader;
class Args;
struct Build;

/// What a registered callable gets: its arguments as Values, and the reader (to call other
/// registered globals, as `_rebuild_from_type_v2` does).
struct Call {
  const Object& callable;  ///< module and name of the global being called
  List& args;
  Reader& reader;
};

/// Turns a call into a Value (runs our C++ code for a known global; never Python).
using call_fn = std::function<Value(Call&)>;
/// The same for the common shapes of a call, read from its arguments as the reader holds them
/// (`Args`), without converting them to Values first; nullopt hands the call to `call_fn`. It
/// must give what call_fn gives for every call it answers.
using fast_fn = std::function<std::optional<Value>(const Args&)>;
/// Turns an object made by REDUCE / NEWOBJ of a registered global into a Value when BUILD gives
/// it its state (numpy's ndarray); nullopt keeps the object, with the state as its state.
using build_fn = std::function<std::optional<Value>(const Build&)>;

/// How one allowed global is treated.
struct Rule {
  enum class kind : std::uint8_t {
    object,         ///< referenced: Object(how=global); called: Object(how=reduce/newobj) with its args
    ordered_dict,   ///< called with (): an empty dict that SETITEMS and BUILD may fill later
    function,       ///< called: `fn` computes the Value
    reconstructor,  ///< copyreg._reconstructor(cls, object, None): an Object of cls, how = newobj
  };
  kind k = kind::object;
  call_fn fn;      ///< for function: REDUCE and NEWOBJ
  fast_fn fast;    ///< for function, optional: tried first
  build_fn build;  ///< for object, optional: BUILD of an object this global made
  /// Not on torch.load(weights_only=True)'s list: refused with the unknown globals when
  /// options::keep_unknown_objects is false.
  bool beyond_weights_only = false;
};

/// The allow-list: qualified global name ("torch._utils._rebuild_tensor_v2") -> Rule.
class Registry {
 public:
  Registry() = default;
  /// A registry that extends `base`: find() looks in its own rules first, then in base's. `base`
  /// must outlive it. Building weights_only() takes about as long as reading a small pickle, so
  /// readers of many small pickles (DCP's byte items) extend the one shared() copy instead.
  explicit Registry(const Registry* base) noexcept : base_(base) {}

  Registry& add(std::string qualified, Rule rule) {
    rules_[std::move(qualified)] = std::move(rule);
    return *this;
  }
  Registry& allow(std::string qualified) { return add(std::move(qualified), Rule{}); }
  Registry& function(std::string qualified, call_fn fn, fast_fn fast = {}) {
    return add(std::move(qualified), Rule{Rule::kind::function, std::move(fn), std::move(fast), {}, false});
  }
  [[nodiscard]] const Rule* find(const std::string& qualified) const {
    auto it = rules_.find(qualified);
    if (it != rules_.end()) return &it->second;
    return base_ ? base_->find(qualified) : nullptr;
  }
  /// Rules of its own, and of the base (rules it overrides counted twice).
  [[nodiscard]] std::size_t size() const noexcept { return rules_.size() + (base_ ? base_->size() : 0); }

  /// Globals torch.load(weights_only=True) accepts (PyTorch 1.13 and 2.x), with the generic
  /// conversions listed at the top of this file, and the data rules beyond that list (numpy,
  /// copyreg; Rule::beyond_weights_only). Tensor rebuild functions are allowed here but only
  /// interpreted once io/torch_file.hpp registers them; without that they become Objects.
  static Registry weights_only();
  /// One weights_only() registry, built on first use (thread-safe) and never changed.
  static const Registry& shared() {
    static const Registry r = weights_only();
    return r;
  }

 private:
  std::unordered_map<std::string, Rule> rules_;
  const Registry* base_ = nullptr;
};

struct options {
  pickle::limits limits{};
  /// Objects of globals outside torch's weights_only list are data: Object nodes (class, args,
  /// state, items), never called. False refuses them (and the numpy and copyreg rules) as
  /// torch.load(weights_only=True) does. Blocked modules (os, posix, sys, subprocess, ...) are
  /// refused either way.
  bool keep_unknown_objects = true;
  /// Keeps the bytes being read alive (what the caller's span points into): given, numpy arrays
  /// whose bytes lie whole in the pickle become tensors viewing them in place; without it they are
  /// copied.
  keep_alive input_owner;
  /// The allow-list; nullptr means Registry::weights_only().
  const Registry* registry = nullptr;
  /// Resolves BINPERSID / PERSID ids (torch storages). Without it, a persistent id is an error.
  std::function<Value(const Value& pid)> persistent_load;
  /// Optional: resolves a persistent id that is a tuple from its items as the reader holds them
  /// (see fast_fn); nullopt hands the id to persistent_load.
  fast_fn persistent_fast;
  /// Optional, tried before persistent_fast: resolves a persistent id into a handle, a number the
  /// caller gives meaning to, held in the graph instead of a Value. A fast_fn reads it as it is
  /// (Args::handle); anywhere else (a bare storage, the arguments of a call without a fast form)
  /// it becomes handle_value(handle), which must then be set. nullopt goes on to persistent_fast.
  std::function<std::optional<std::uint64_t>(const Args&)> persistent_handle;
  std::function<Value(std::uint64_t)> handle_value;
};

/// Python 2 module names as Python 3 maps them (the subset that can appear in state dicts).
inline std::string_view py3_module(std::string_view m) noexcept {
  if (m == "__builtin__" || m == "exceptions") return "builtins";
  if (m == "copy_reg") return "copyreg";
  if (m == "UserDict") return "collections";
  return m;
}

/// Modules refused even with keep_unknown_objects (they only appear in pickles to run code).
inline bool blocked_global(std::string_view module, std::string_view name) noexcept {
  if (module == "types")  // code and function objects; the rest of `types` is data (SimpleNamespace)
    for (auto n : {"CodeType", "FunctionType", "LambdaType", "MethodType", "BuiltinFunctionType", "ModuleType"})
      if (name == n) return true;
  constexpr std::string_view modules[] = {"os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "pty",
                                          "runpy", "importlib", "ctypes", "code", "codeop", "pickle", "_pickle",
                                          "marshal", "webbrowser", "multiprocessing", "asyncio", "signal",
                                          "commands", "popen2", "platform", "pdb", "bdb", "timeit", "trace",
                                          "profile", "cProfile"};
  const std::string_view root = module.substr(0, module.find('.'));
  for (auto m : modules)
    if (root == m) return true;
  if (module == "builtins") {
    constexpr std::string_view names[] = {"eval", "exec", "compile", "__import__", "open", "breakpoint",
                                          "input", "execfile", "globals", "locals", "vars", "setattr",
                                          "delattr", "memoryview", "help", "exit", "quit", "apply"};
    for (auto n : names)
      if (name == n) return true;
  }
  return false;
}

/// A global naming what its module does not have, for the modules whose pickled names are a
/// known, closed set: Python's unpickler cannot find it (AttributeError), torch.load refuses it,
/// and it is a corrupt pickle, not an unknown class to keep as data.
inline bool no_such_name(std::string_view module, std::string_view name) noexcept {
  auto none_of = [&](std::initializer_list<std::string_view> names) {
    for (std::string_view n : names)
      if (name == n) return false;
    return true;
  };
  if (module == "torch._utils")  // every _rebuild_* function torch has had
    return none_of({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
                    "_rebuild_sparse_csr_tensor", "_rebuild_nested_tensor", "_rebuild_meta_tensor_no_storage",
                    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
                    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_xla_tensor", "_rebuild_mlc_tensor"});
  if (module == "collections")
    return none_of({"OrderedDict", "defaultdict", "deque", "Counter", "ChainMap", "UserDict", "UserList", "UserString",
                    "namedtuple"});
  if (module == "_codecs") return none_of({"encode", "decode"});
  if (module == "copyreg") return none_of({"_reconstructor", "__newobj__", "__newobj_ex__", "_reduce_ex"});
  return false;
}

namespace detail {

/// Validates UTF-8 as Python's decoder with "surrogatepass" does (surrogate code points encoded
/// as three bytes are accepted, overlong forms and values beyond U+10FFFF are not).
inline bool valid_utf8(std::string_view s) noexcept {
  return statedict::detail::first_invalid_utf8(s, statedict::detail::utf8_surrogates::allowed) == std::string_view::npos;
}

/// Decodes UTF-8 (already validated) into code points; false if any is above `max`.
inline bool utf8_to_latin1(std::string_view s, std::vector<std::uint8_t>& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  out.reserve(s.size());
  while (p < end) {
    const unsigned c = *p;
    if (c < 0x80) {
      out.push_back(static_cast<std::uint8_t>(c));
      ++p;
    } else if ((c & 0xE0) == 0xC0 && end - p >= 2) {
      const unsigned cp = ((c & 0x1FU) << 6) | (p[1] & 0x3FU);
      if (cp > 0xFF) return false;
      out.push_back(static_cast<std::uint8_t>(cp));
      p += 2;
    } else {
      return false;
    }
  }
  return true;
}

/// Minimal little-endian two's complement of a LONG (Python's encode_long): drops redundant sign
/// bytes. Returns true and sets `v` when the value fits int64.
inline bool normalise_long(std::vector<std::uint8_t>& b, std::int64_t& v) {
  if (b.empty()) {
    v = 0;
    return true;
  }
  const bool neg = (b.back() & 0x80U) != 0;
  while (b.size() > 1) {
    const std::uint8_t top = b.back(), next = b[b.size() - 2];
    if ((!neg && top == 0x00 && !(next & 0x80U)) || (neg && top == 0xFF && (next & 0x80U))) b.pop_back();
    else break;
  }
  if (b.size() > 8) return false;
  std::uint64_t u = neg ? ~std::uint64_t{0} : 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    u &= ~(std::uint64_t{0xFF} << (8 * i));
    u |= static_cast<std::uint64_t>(b[i]) << (8 * i);
  }
  v = static_cast<std::int64_t>(u);
  return true;
}

inline std::string opcode_name(unsigned char op) {
  std::string s = "opcode ";
  if (op >= 0x21 && op < 0x7f) {
    s += '\'';
    s += static_cast<char>(op);
    s += '\'';
  } else {
    static constexpr char hex[] = "0123456789abcdef";
    s += "0x";
    s += hex[op >> 4];
    s += hex[op & 15];
  }
  return s;
}
}  // namespace detail

}  // namespace pickle
}  // namespace statedict::inline v0

// The reader itself (the opcode machine), which needs the types above, and the numpy rules.
#include "detail/pickle_reader.hpp"
#include "detail/pickle_numpy.hpp"

namespace statedict::inline v0 {
namespace pickle {

namespace detail {
inline const List& one_sequence_arg(Call& c, std::size_t max_args = 1) {
  static const List empty;
  if (c.args.empty()) return empty;
  if (c.args.size() > max_args || !c.args[0].is_sequence())
    c.reader.fail(errors::pk_bad_call, c.callable.qualified() + " expects one list or tuple argument");
  return c.args[0].as_list();
}
}  // namespace detail

inline Registry Registry::weights_only() {
  Registry r;
  r.add("collections.OrderedDict", Rule{Rule::kind::ordered_dict, {}, {}, {}, false});
  r.allow("collections.Counter");
  // bytes in protocol 2: _codecs.encode(latin-1 str, 'latin1'); empty bytes: builtins.bytes().
  r.function("_codecs.encode", [](Call& c) -> Value {
    if (c.args.size() != 2 || !c.args[0].is_string() || !c.args[1].is_string())
      c.reader.fail(errors::pk_bad_call, "_codecs.encode expects (str, encoding)");
    const std::string& enc = c.args[1].as_string();
    if (enc != "latin1" && enc != "latin-1" && enc != "iso-8859-1" && enc != "iso8859-1")
      c.reader.fail(errors::pk_bad_call, "_codecs.encode with encoding " + quote(enc) + " (only latin1 is read)");
    Bytes b;
    if (!detail::utf8_to_latin1(c.args[0].as_string(), b.data))
      c.reader.fail(errors::pk_bad_call, "_codecs.encode of a str with characters beyond latin-1");
    return Value(std::move(b));
  });
  r.function("builtins.bytes", [](Call& c) -> Value {
    if (c.args.empty()) return Value(Bytes{});
    if (c.args.size() == 1 && c.args[0].is_bytes()) return c.args[0];
    const List& l = detail::one_sequence_arg(c);
    Bytes b;
    for (const Value& v : l) {
      if (!v.is_int() || v.as_int() < 0 || v.as_int() > 255) c.reader.fail(errors::pk_bad_call, "bytes() of a non-byte item");
      b.data.push_back(static_cast<std::uint8_t>(v.as_int()));
    }
    return Value(std::move(b));
  });
  r.function("builtins.bytearray", [](Call& c) -> Value {
    Object o{"builtins", "bytearray", object_build::reduce, {}, {}, {}};
    if (c.args.empty()) o.args.emplace_back(Bytes{});
    else if (c.args.size() == 1 && c.args[0].is_bytes()) o.args.push_back(c.args[0]);
    else c.reader.fail(errors::pk_bad_call, "bytearray() arguments statedict does not interpret");
    return Value(std::move(o));
  });
  for (const char* name : {"set", "frozenset"}) {
    r.function(std::string("builtins.") + name, [name](Call& c) -> Value {
      Object o{"builtins", name, object_build::reduce, {}, {}, {}};
      o.items = detail::one_sequence_arg(c);
      return Value(std::move(o));
    });
  }
  r.allow("builtins.complex");
  r.function("torch.Size", [](Call& c) -> Value {
    const List& l = detail::one_sequence_arg(c);
    for (const Value& v : l)
      if (!v.is_int()) c.reader.fail(errors::pk_bad_call, "torch.Size of a non-int item");
    return Value::tuple(l);
  });
  for (const char* name : {"torch.device", "torch.serialization._get_layout", "torch.Tensor", "torch.nn.parameter.Parameter",
                           "torch._tensor._rebuild_from_type_v2"})
    r.allow(name);
  // dtypes (canonical names and the aliases PyTorch also exports)
  for (const char* name :
       {"float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex32", "chalf", "complex64",
        "cfloat", "complex128", "cdouble", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "bool",
        "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
        "float8_e4m3fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint16", "uint32", "uint64", "bits1x8", "bits2x4",
        "bits4x2", "bits8", "bits16", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "int1", "int2",
        "int3", "int4", "int5", "int6", "int7",
        // layouts, memory formats, quantization schemes
        "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged",
        "contiguous_format", "channels_last", "channels_last_3d", "preserve_format", "per_tensor_affine",
        "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric", "per_channel_affine_float_qparams"})
    r.allow(std::string("torch.") + name);
  // storage and legacy tensor classes
  for (const char* t : {"Double", "Float", "Half", "Long", "Int", "Short", "Char", "Byte", "Bool", "BFloat16",
                        "ComplexDouble", "ComplexFloat", "QUInt8", "QInt8", "QInt32", "QUInt4x2", "QUInt2x4"}) {
    r.allow(std::string("torch.") + t + "Storage");
    r.allow(std::string("torch.cuda.") + t + "Storage");
    r.allow(std::string("torch.") + t + "Tensor");
    r.allow(std::string("torch.cuda.") + t + "Tensor");
  }
  for (const char* name : {"torch.UntypedStorage", "torch.TypedStorage", "torch.storage.UntypedStorage",
                           "torch.storage.TypedStorage", "torch.cuda.UntypedStorage"})
    r.allow(name);
  for (const char* f : {"_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_tensor",
                        "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_sparse_tensor", "_rebuild_sparse_csr_tensor",
                        "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
                        "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"})
    r.allow(std::string("torch._utils.") + f);
  detail::add_data_rules(r);
  return r;
}

/// Unpickles `bytes` into a Value tree (see the top of this file). Stops at the first STOP; the
/// result says how many bytes that took (torch's legacy format concatenates pickles).
inline Result load(std::span<const std::byte> bytes, const options& opts = {}) {
  Reader r(bytes, opts);
  return r.run();
}

}  // namespace pickle
}  // namespace statedict::inline v0

