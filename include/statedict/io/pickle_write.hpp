// statedict: a pickler for Value trees (protocol 2, the protocol torch.save uses).
// SPDX-License-Identifier: MIT
//
// `pickle::Writer` writes a Value the way Python's pickler (protocol 2) writes the equivalent
// Python object: EMPTY_DICT/EMPTY_LIST + SETITEMS/APPENDS in batches of 1000, TUPLE1-3, the
// smallest int opcode, BINFLOAT, BINUNICODE, bytes as `_codecs.encode(latin-1 str, 'latin1')`,
// Python 3 module names mapped back to Python 2 ones (`builtins` -> `__builtin__`), and a memo
// (BINPUT after every container, string, global and call; BINGET for repeated strings and
// globals). Objects are written back as they were read (GLOBAL, REDUCE / NEWOBJ, items, BUILD),
// and the special Objects of io/pickle_read.hpp (big ints, sets, bytearrays, dicts with other
// keys) in their protocol-2 form. Tensors have no generic encoding: a `custom` hook writes them
// (io/torch_file.hpp writes `_rebuild_tensor_v2` with a persistent storage id, as torch.save does).
// Dicts that carry attributes (state_dict()._metadata) are written as OrderedDict + BUILD.
//
// Objects as data: an object whose class torch.load(weights_only=True) does not accept (an
// argparse.Namespace, a config class, a pickled nn.Module, an enum member) is written as its
// data, never as a call of its class nor a reference to it, so that loading the output runs no
// code whatever the input held (`write_options::objects`):
//   an instance with a dict of str keys as its only state, and no arguments or items
//                                    -> that dict (`vars(obj)`: Namespace(lr=0.1) -> {'lr': 0.1})
//   any other instance               -> a dict of what it has of 'args' (tuple), 'state' (its
//                                       state; a tuple of them when several), 'items' (list)
//   a reference to the class itself  -> the str 'module.name'
// `write_options::keep_classes` names classes written as themselves instead (for a user who
// trusts the input); Writer::converted counts what was written as data, by class.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/value.hpp"
#include "pickle_read.hpp"

namespace statedict::inline v0 {

namespace errors {
// clang-format off
inline constexpr error_id pk_unwritable   {480, error_kind::usage, "pickle.unwritable"};
inline constexpr error_id pk_write_depth  {481, error_kind::usage, "pickle.write_depth"};
inline constexpr error_id pk_write_utf8   {482, error_kind::usage, "pickle.write_bad_utf8"};
// clang-format on
}  // namespace errors

namespace pickle {

struct write_options {
  /// Deepest nesting written (the writer recurses).
  std::size_t max_depth = 1000;
  enum class objects_policy : std::uint8_t {
    as_data,     ///< objects of classes outside weights_only's list written as their data
    as_written,  ///< every object as it is (a writer's own structures: DCP metadata classes)
  };
  objects_policy objects = objects_policy::as_data;
  /// Classes ("argparse.Namespace") written as themselves under as_data.
  std::vector<std::string> keep_classes;
};

/// Whether objects of class `qualified` ("module.name") are written as themselves: classes and
/// functions torch.load(weights_only=True) accepts (Registry::weights_only() without the rules
/// beyond it), or one of `keep`.
inline bool writable_as_itself(std::string_view qualified, const std::vector<std::string>& keep) {
  const std::string q(qualified);
  if (const Rule* r = Registry::shared().find(q); r && !r->beyond_weights_only) return true;
  return std::find(keep.begin(), keep.end(), q) != keep.end();
}

/// Whether an instance whose parts are these is written as its state alone (a dict of str keys,
/// its attributes), rather than as a dict of its parts.
inline bool data_is_state(const Object& o) {
  if (!o.args.empty() || !o.items.empty() || o.state.size() != 1 || !o.state[0].is_dict()) return false;
  for (const auto& kv : o.state[0].as_dict().items())
    if (!kv.first.is_string()) return false;
  return true;
}

/// Protocol-2 pickler into a byte vector.
class Writer {
 public:
  /// Writes a value itself and returns true, or returns false to let the writer handle it.
  /// Must handle tensors (the writer has no encoding for them).
  using custom_fn = std::function<bool(Writer&, const Value&)>;

  explicit Writer(std::vector<std::byte>& out, write_options opts = {}) : out_(out), opts_(opts) {}

  custom_fn custom;
  /// Attributes to attach (as OrderedDict + BUILD) to the dict at each path.
  const std::vector<Attributes>* attributes = nullptr;
  /// Objects written as their data, by class (write_options::objects).
  std::map<std::string, std::uint64_t> converted;

  /// PROTO 2, the value, STOP.
  void dump(const Value& v) {
    op(0x80);
    byte(2);
    Path path;
    value(v, 0, path);
    op('.');
  }

  // --- primitives (for hooks) -------------------------------------------------------------------
  void op(unsigned char c) { out_.push_back(static_cast<std::byte>(c)); }
  void mark() { op('('); }
  void none() { op('N'); }
  void boolean(bool b) { op(b ? 0x88 : 0x89); }
  void integer(std::int64_t v) {
    if (v >= 0 && v <= 0xff) {
      op('K');
      byte(static_cast<std::uint8_t>(v));
    } else if (v >= 0 && v <= 0xffff) {
      op('M');
      le(static_cast<std::uint64_t>(v), 2);
    } else if (v >= -0x80000000LL && v <= 0x7fffffffLL) {
      op('J');
      le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(v))), 4);
    } else {
      std::vector<std::uint8_t> b;
      auto u = static_cast<std::uint64_t>(v);
      for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>((u >> (8 * i)) & 0xffU));
      std::int64_t dummy = 0;
      (void)detail::normalise_long(b, dummy);
      long_bytes(b);
    }
  }
  /// LONG1/LONG4 of little-endian two's complement bytes.
  void long_bytes(const std::vector<std::uint8_t>& b) {
    if (b.size() < 256) {
      op(0x8a);
      byte(static_cast<std::uint8_t>(b.size()));
    } else {
      op(0x8b);
      le(b.size(), 4);
    }
    for (auto c : b) byte(c);
  }
  void floating(double d) {
    op('G');
    const auto bits = std::bit_cast<std::uint64_t>(d);
    for (int i = 7; i >= 0; --i) byte(static_cast<std::uint8_t>((bits >> (8 * i)) & 0xffU));
  }
  /// A str, memoized by value (a repeated string is a BINGET).
  void str(std::string_view s) {
    const std::string key = "s:" + std::string(s);
    if (get_memo(key)) return;
    if (!detail::valid_utf8(s)) throw_error(errors::pk_write_utf8, "string " + quote(s) + " is not valid UTF-8");
    op('X');
    le(s.size(), 4);
    for (char c : s) out_.push_back(static_cast<std::byte>(c));
    put_memo(key);
  }
  /// A global, memoized by name; Python 3 module names go out under their Python 2 names.
  void global(std::string_view module, std::string_view name) {
    std::string m(module);
    if (m == "builtins") m = "__builtin__";
    else if (m == "copyreg") m = "copy_reg";
    const std::string key = "g:" + m + "\n" + std::string(name);
    if (get_memo(key)) return;
    // GLOBAL ends the module and the name at a newline; a protocol-4 STACK_GLOBAL read in
    // keep_unknown_objects mode can name anything.
    if (m.find('\n') != std::string::npos || name.find('\n') != std::string_view::npos)
      throw_error(errors::pk_unwritable, "global " + quote(m + "." + std::string(name)),
                  "a module or name with a newline cannot be written as a protocol-2 GLOBAL");
    op('c');
    for (char c : m) out_.push_back(static_cast<std::byte>(c));
    op('\n');
    for (char c : name) out_.push_back(static_cast<std::byte>(c));
    op('\n');
    put_memo(key);
  }
  /// Ends a tuple of n items pushed since `mark()` (n > 3) or directly (n <= 3; no mark).
  void end_tuple(std::size_t n) {
    if (n == 0) op(')');
    else if (n == 1) op(0x85);
    else if (n == 2) op(0x86);
    else if (n == 3) op(0x87);
    else op('t');
    if (n > 0) memoize();
  }
  /// Starts a tuple of n items: writes MARK when n > 3.
  void begin_tuple(std::size_t n) {
    if (n > 3) mark();
  }
  void reduce() {
    op('R');
    memoize();
  }
  /// BINPUT with the next memo id; returns the id.
  std::uint32_t memoize() {
    const std::uint32_t id = next_memo_++;
    if (id < 256) {
      op('q');
      byte(static_cast<std::uint8_t>(id));
    } else {
      op('r');
      le(id, 4);
    }
    return id;
  }
  void get(std::uint32_t id) {
    if (id < 256) {
      op('h');
      byte(static_cast<std::uint8_t>(id));
    } else {
      op('j');
      le(id, 4);
    }
  }
  /// If `key` was remembered, writes a BINGET of it and returns true.
  bool get_memo(const std::string& key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return false;
    get(it->second);
    return true;
  }
  /// Memoizes the object just written under `key` (BINPUT) so that get_memo(key) finds it.
  void put_memo(const std::string& key) { memo_.emplace(key, memoize()); }

  /// Writes any value (hooks call this for the parts they do not handle themselves).
  void value(const Value& v, std::size_t depth, Path& path, bool tracked = true) {
    if (depth > opts_.max_depth)
      throw_error(errors::pk_write_depth, "at " + quote(dotted(path)), "nesting deeper than write_options.max_depth (" +
                                                                           std::to_string(opts_.max_depth) + ")");
    if (custom && custom(*this, v)) return;
    switch (v.kind()) {
      case value_kind::none: none(); return;
      case value_kind::boolean: boolean(v.as_bool()); return;
      case value_kind::integer: integer(v.as_int()); return;
      case value_kind::floating: floating(v.as_double()); return;
      case value_kind::string: str(v.as_string()); return;
      case value_kind::bytes: bytes(v.as_bytes()); return;
      case value_kind::tensor:
        throw_error(errors::pk_unwritable, "at " + quote(dotted(path)), "a tensor, and no tensor writer is installed");
      case value_kind::list: {
        op(']');
        memoize();
        const List& l = v.as_list();
        batches(l.size(), [&](std::size_t i) {
          path.emplace_back(static_cast<std::int64_t>(i));
          value(l[i], depth + 1, path, tracked);
          path.pop_back();
        }, 'a', 'e', true);
        return;
      }
      case value_kind::tuple: {
        const List& l = v.as_list();
        begin_tuple(l.size());
        for (std::size_t i = 0; i < l.size(); ++i) {
          path.emplace_back(static_cast<std::int64_t>(i));
          value(l[i], depth + 1, path, tracked);
          path.pop_back();
        }
        end_tuple(l.size());
        return;
      }
      case value_kind::dict: {
        const Dict* attrs = tracked ? attributes_at(path) : nullptr;
        if (attrs) {
          global("collections", "OrderedDict");
          op(')');
          reduce();
        } else {
          op('}');
          memoize();
        }
        const auto& items = v.as_dict().items();
        batches(items.size(), [&](std::size_t i) {
          const Key& k = items[i].first;
          if (k.is_int()) integer(k.as_int());
          else str(k.as_string());
          path.push_back(k);
          value(items[i].second, depth + 1, path, tracked);
          path.pop_back();
        }, 's', 'u', attrs == nullptr);
        if (attrs) {
          value(Value(*attrs), depth + 1, path, false);
          op('b');
        }
        return;
      }
      case value_kind::object: object(v.as_object(), depth, path); return;
    }
  }

  void bytes(const Bytes& b) {
    if (b.data.empty()) {
      global("builtins", "bytes");
      op(')');
      reduce();
      return;
    }
    global("_codecs", "encode");
    std::string latin;  // each byte as the code point of the same value, in UTF-8
    latin.reserve(b.data.size() * 2);
    for (std::uint8_t c : b.data) {
      if (c < 0x80) {
        latin += static_cast<char>(c);
      } else {
        latin += static_cast<char>(0xC0 | (c >> 6));
        latin += static_cast<char>(0x80 | (c & 0x3F));
      }
    }
    str(latin);
    str("latin1");
    end_tuple(2);
    reduce();
  }

 private:
  void byte(std::uint8_t b) { out_.push_back(static_cast<std::byte>(b)); }
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) byte(static_cast<std::uint8_t>((v >> (8 * i)) & 0xffU));
  }

  /// Items in batches of 1000, as CPython's C pickler writes them. An exact list or dict
  /// (`exact`) uses APPEND/SETITEM only when it has a single item; items that come from an
  /// iterator (a __reduce__'s listitems/dictitems: OrderedDict, objects) use it for any batch
  /// of one.
  template <class F>
  void batches(std::size_t n, F&& item, unsigned char one, unsigned char many, bool exact = false) {
    if (exact && n == 1) {
      item(0);
      op(one);
      return;
    }
    for (std::size_t start = 0; start < n; start += 1000) {
      const std::size_t end = std::min(n, start + 1000);
      if (!exact && end - start == 1) {
        item(start);
        op(one);
      } else {
        mark();
        for (std::size_t i = start; i < end; ++i) item(i);
        op(many);
      }
    }
  }

  [[nodiscard]] const Dict* attributes_at(const Path& path) const {
    if (!attributes) return nullptr;
    for (const auto& a : *attributes)
      if (a.path == path) return &a.attributes;
    return nullptr;
  }

  void args_tuple(const List& args, std::size_t depth) {
    Path none_path;
    begin_tuple(args.size());
    for (const Value& a : args) value(a, depth + 1, none_path, false);
    end_tuple(args.size());
  }

  void object(const Object& o, std::size_t depth, Path& path) {
    Path none_path;
    const std::string q = o.qualified();
    if (q == "builtins.int" && o.how == object_build::reduce && o.args.size() == 1 && o.args[0].is_bytes() &&
        o.items.empty() && o.state.empty()) {
      long_bytes(o.args[0].as_bytes().data);
      return;
    }
    if ((q == "builtins.set" || q == "builtins.frozenset") && o.how == object_build::reduce && o.args.empty() &&
        o.state.empty()) {
      global(o.module, o.name);
      op(']');
      memoize();
      batches(o.items.size(), [&](std::size_t i) { value(o.items[i], depth + 1, none_path, false); }, 'a', 'e', true);
      end_tuple(1);
      reduce();
      return;
    }
    // The class itself (a global reference) is not an instance: it falls through to the plain global below.
    if ((q == "builtins.dict" || q == "collections.OrderedDict") && o.how == object_build::reduce && o.args.empty()) {
      if (q == "builtins.dict") {
        op('}');
        memoize();
      } else {
        global(o.module, o.name);
        op(')');
        reduce();
      }
      write_items(o, depth, true, q == "builtins.dict");
      write_states(o, depth);
      return;
    }
    if (opts_.objects == write_options::objects_policy::as_data && !writable_as_itself(q, opts_.keep_classes)) {
      as_data(o, depth);
      return;
    }
    if (o.how == object_build::global) {
      if (!o.args.empty() || !o.items.empty() || !o.state.empty())
        throw_error(errors::pk_unwritable, "at " + quote(dotted(path)),
                    "object " + quote(q) + " is a global reference but has arguments, items or state");
      global(o.module, o.name);
      return;
    }
    global(o.module, o.name);
    args_tuple(o.args, depth);
    if (o.how == object_build::newobj) {
      op(0x81);
      memoize();
    } else {
      reduce();
    }
    bool pairs = !o.items.empty();
    for (const Value& it : o.items)
      if (!it.is_tuple() || it.as_list().size() != 2) pairs = false;
    write_items(o, depth, pairs);
    write_states(o, depth);
  }

  /// An object as its data (see the top of this file); its children are written as they are, so
  /// that hooks see the tree's own tensors.
  void as_data(const Object& o, std::size_t depth) {
    ++converted[o.qualified()];
    Path none_path;
    if (o.how == object_build::global) {
      str(o.qualified());
      return;
    }
    if (data_is_state(o)) {
      value(o.state[0], depth + 1, none_path, false);
      return;
    }
    op('}');
    memoize();
    if (o.args.empty() && o.state.empty() && o.items.empty()) return;
    mark();
    if (!o.args.empty()) {
      str("args");
      args_tuple(o.args, depth + 1);
    }
    if (!o.state.empty()) {
      str("state");
      if (o.state.size() == 1) {
        value(o.state[0], depth + 2, none_path, false);
      } else {
        args_tuple(o.state, depth + 1);
      }
    }
    if (!o.items.empty()) {
      str("items");
      op(']');
      memoize();
      batches(o.items.size(), [&](std::size_t i) { value(o.items[i], depth + 2, none_path, false); }, 'a', 'e', true);
    }
    op('u');
  }

  void write_items(const Object& o, std::size_t depth, bool pairs, bool exact = false) {
    Path none_path;
    if (pairs) {
      batches(o.items.size(), [&](std::size_t i) {
        const List& kv = o.items[i].as_list();
        if (kv.size() != 2)
          throw_error(errors::pk_unwritable, "object " + quote(o.qualified()) + ": dict item is not a (key, value) pair");
        value(kv[0], depth + 1, none_path, false);
        value(kv[1], depth + 1, none_path, false);
      }, 's', 'u', exact);
    } else {
      batches(o.items.size(), [&](std::size_t i) { value(o.items[i], depth + 1, none_path, false); }, 'a', 'e');
    }
  }
  void write_states(const Object& o, std::size_t depth) {
    Path none_path;
    for (const Value& s : o.state) {
      value(s, depth + 1, none_path, false);
      op('b');
    }
  }

  std::vector<std::byte>& out_;
  write_options opts_;
  std::unordered_map<std::string, std::uint32_t> memo_;
  std::uint32_t next_memo_ = 0;
};

/// Pickles a Value without tensors (protocol 2), its objects as `opts` says.
inline std::vector<std::byte> dumps(const Value& v, const std::vector<Attributes>* attributes, const write_options& opts) {
  std::vector<std::byte> out;
  Writer w(out, opts);
  w.attributes = attributes;
  w.dump(v);
  return out;
}

/// Pickles a Value without tensors (protocol 2) exactly as it is, objects included: for a writer's
/// own structures (DCP's Metadata classes). Trees read from input go through Writer's default
/// write_options, which writes objects as their data.
inline std::vector<std::byte> dumps(const Value& v, const std::vector<Attributes>* attributes = nullptr) {
  write_options o;
  o.objects = write_options::objects_policy::as_written;
  return dumps(v, attributes, o);
}

}  // namespace pickle
}  // namespace statedict::inline v0
