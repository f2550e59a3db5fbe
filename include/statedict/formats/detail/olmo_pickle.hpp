// statedict: the pieces of OLMo's mapped safetensors names and values: urlsafe base64, the
// (key path, value_is_pickled) pickle each name encodes, and a protocol-4 pickler that writes what
// CPython's `pickle.dumps(obj, protocol=4)` writes for the same data.
// SPDX-License-Identifier: MIT
//
// A name is `urlsafe_b64encode(pickle.dumps((keys, value_is_pickled)))` (olmo/safetensors_util.py
// encode_key); docs/formats/olmo-safetensors.md lists the bytes. Names are decoded with the safe
// unpickler and an empty allow-list: a name that names any global is refused, never resolved.
//
// The pickler follows CPython's C pickler (Modules/_pickle.c, protocol 4): PROTO 4; one FRAME per
// 64 KiB of opcodes (a frame of fewer than 4 bytes gets no FRAME opcode), bytes and str payloads of
// 64 KiB or more written outside any frame; MEMOIZE after every str, bytes, list, dict, non-empty
// tuple, global and call; the smallest int opcode; SHORT_BINUNICODE / BINUNICODE / BINUNICODE8;
// SHORT_BINBYTES / BINBYTES / BINBYTES8; EMPTY_LIST / EMPTY_DICT then APPEND(S) / SETITEM(S) in
// batches of 1000; STACK_GLOBAL for classes; EMPTY_SET / ADDITEMS and FROZENSET. CPython memoizes
// by object identity, which a Value does not carry. Equal strings are memoized (CPython's interned
// strings: OLMo's literal keys, dict keys of param groups), and so are equal tuples of numbers and
// strings (constants and optimizer defaults such as `betas`, one object in every param group);
// lists, dicts and other objects never share a memo entry. Decoding either form gives the same
// data.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/value.hpp"
#include "../../io/pickle_read.hpp"

namespace statedict::inline v0::formats::detail::olmo {

// ---------------------------------------------------------------------------------------------
// urlsafe base64 (RFC 4648 section 5, '=' padding kept)

inline std::string b64_encode(std::span<const std::byte> in) {
  static constexpr char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const auto v = (std::to_integer<std::uint32_t>(in[i]) << 16) | (std::to_integer<std::uint32_t>(in[i + 1]) << 8) |
                   std::to_integer<std::uint32_t>(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += abc[(v >> s) & 63U];
  }
  if (const std::size_t rest = in.size() - i; rest > 0) {
    std::uint32_t v = std::to_integer<std::uint32_t>(in[i]) << 16;
    if (rest == 2) v |= std::to_integer<std::uint32_t>(in[i + 1]) << 8;
    out += abc[(v >> 18) & 63U];
    out += abc[(v >> 12) & 63U];
    out += rest == 2 ? abc[(v >> 6) & 63U] : '=';
    out += '=';
  }
  return out;
}

/// Decodes canonical urlsafe base64 (what b64_encode gives: length a multiple of 4, '=' only as
/// padding, unused bits zero); nullopt for anything else.
inline std::optional<std::vector<std::byte>> b64_decode(std::string_view s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '-') return 62;
    if (c == '_') return 63;
    return -1;
  };
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  std::size_t pad = 0;
  if (s.back() == '=') pad = s[s.size() - 2] == '=' ? 2 : 1;
  std::vector<std::byte> out;
  out.reserve(s.size() / 4 * 3);
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const bool padding = last && k >= 4 - pad;
      const int d = padding ? 0 : val(s[i + k]);
      if (d < 0 || (padding && s[i + k] != '=')) return std::nullopt;
      v = (v << 6) | static_cast<std::uint32_t>(d);
    }
    const std::size_t n = last ? 3 - pad : 3;
    if (last && pad > 0 && (v & ((pad == 1 ? 0xFFU : 0xFFFFU))) != 0) return std::nullopt;  // non-canonical bits
    for (std::size_t k = 0; k < n; ++k) out.push_back(static_cast<std::byte>((v >> (16 - 8 * k)) & 0xFFU));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The protocol-4 pickler

/// Writes Values as CPython's pickle.dumps(obj, protocol=4) writes the equivalent objects (see the
/// top of this file). Throws `unwritable` (with the path of the value) for a tensor, which has no
/// encoding without torch.save.
class P4Writer {
 public:
  P4Writer(const error_id& unwritable, std::string what) : unwritable_(unwritable), what_(std::move(what)) {}

  /// PROTO 4, the value, STOP, with CPython's framing.
  std::vector<std::byte> dumps(const Value& v) {
    out_.clear();
    out_.push_back(std::byte{0x80});
    out_.push_back(std::byte{4});
    open_frame();
    save(v, 0);
    op(0x2e);  // STOP
    commit_frame();
    return std::move(out_);
  }

  /// Maximum nesting written (the writer recurses).
  std::size_t max_depth = 1000;

 private:
  static constexpr std::size_t frame_target = 64 * 1024;
  static constexpr std::size_t frame_min = 4;
  static constexpr std::size_t frame_header = 9;

  void op(unsigned char c) { out_.push_back(static_cast<std::byte>(c)); }
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFFU));
  }
  void raw(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  void raw(std::string_view s) {
    for (char c : s) out_.push_back(static_cast<std::byte>(c));
  }

  // Frames: 9 bytes are reserved where a frame starts; commit fills them in or removes them.
  void open_frame() {
    frame_start_ = out_.size() + frame_header;
    out_.resize(frame_start_);
    framing_ = true;
  }
  void commit_frame() {
    if (!framing_) return;
    const std::size_t len = out_.size() - frame_start_;
    const std::size_t at = frame_start_ - frame_header;
    if (len >= frame_min) {
      out_[at] = std::byte{0x95};
      for (int i = 0; i < 8; ++i) out_[at + 1 + static_cast<std::size_t>(i)] = static_cast<std::byte>((len >> (8 * i)) & 0xFFU);
    } else {
      out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(at), out_.begin() + static_cast<std::ptrdiff_t>(frame_start_));
    }
    framing_ = false;
  }
  /// Before every object: a frame that reached 64 KiB is closed and a new one opened.
  void boundary() {
    if (framing_ && out_.size() - frame_start_ >= frame_target) {
      commit_frame();
      open_frame();
    }
  }
  /// A str or bytes payload: outside any frame when it is 64 KiB or more.
  void payload(std::span<const std::byte> header, std::span<const std::byte> data) {
    if (data.size() >= frame_target) {
      commit_frame();
      raw(header);
      raw(data);
      open_frame();
      return;
    }
    raw(header);
    raw(data);
  }

  void memoize() {
    op(0x94);
    ++memo_count_;
  }
  void get(std::uint64_t idx) {
    if (idx < 256) {
      op(0x68);  // BINGET
      op(static_cast<unsigned char>(idx));
    } else {
      op(0x6a);  // LONG_BINGET
      le(idx, 4);
    }
  }

  void integer(std::int64_t v) {
    if (v >= 0 && v <= 0xFF) {
      op(0x4b);
      op(static_cast<unsigned char>(v));
    } else if (v >= 0 && v <= 0xFFFF) {
      op(0x4d);
      le(static_cast<std::uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op(0x4a);
      le(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)), 4);
    } else {
      std::vector<std::uint8_t> b;
      const auto u = static_cast<std::uint64_t>(v);
      for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>((u >> (8 * i)) & 0xFFU));
      std::int64_t ignored = 0;
      (void)pickle::detail::normalise_long(b, ignored);
      long_bytes(b);
    }
  }
  void long_bytes(const std::vector<std::uint8_t>& b) {
    if (b.size() < 256) {
      op(0x8a);
      op(static_cast<unsigned char>(b.size()));
    } else {
      op(0x8b);
      le(b.size(), 4);
    }
    for (auto c : b) out_.push_back(static_cast<std::byte>(c));
  }
  void floating(double d) {
    op(0x47);
    const auto bits = std::bit_cast<std::uint64_t>(d);
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<std::byte>((bits >> (8 * i)) & 0xFFU));
  }
  void str(std::string_view s) {
    if (auto it = strings_.find(std::string(s)); it != strings_.end()) {
      get(it->second);
      return;
    }
    std::vector<std::byte> h;
    auto put = [&](unsigned char c, std::uint64_t n, int width) {
      h.push_back(static_cast<std::byte>(c));
      for (int i = 0; i < width; ++i) h.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xFFU));
    };
    if (s.size() <= 0xFF) put(0x8c, s.size(), 1);
    else if (s.size() > 0xFFFFFFFFULL) put(0x8d, s.size(), 8);
    else put(0x58, s.size(), 4);
    payload(h, std::as_bytes(std::span<const char>(s.data(), s.size())));
    strings_.emplace(std::string(s), memo_count_);
    memoize();
  }
  void bytes(std::span<const std::uint8_t> b) {
    std::vector<std::byte> h;
    auto put = [&](unsigned char c, std::uint64_t n, int width) {
      h.push_back(static_cast<std::byte>(c));
      for (int i = 0; i < width; ++i) h.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xFFU));
    };
    if (b.size() <= 0xFF) put(0x43, b.size(), 1);
    else if (b.size() > 0xFFFFFFFFULL) put(0x8e, b.size(), 8);
    else put(0x42, b.size(), 4);
    payload(h, std::as_bytes(b));
    memoize();
  }
  /// STACK_GLOBAL of module and name, memoized by qualified name (one class object).
  void global(const std::string& module, const std::string& name) {
    const std::string q = module + "\n" + name;
    if (auto it = globals_.find(q); it != globals_.end()) {
      get(it->second);
      return;
    }
    boundary();
    str(module);
    boundary();
    str(name);
    op(0x93);
    globals_.emplace(q, memo_count_);
    memoize();
  }

  /// Items written in batches of 1000. `exact`: a plain list or dict (one item alone uses
  /// APPEND/SETITEM, every other batch MARK ... APPENDS/SETITEMS); otherwise items from an
  /// iterator (an object's listitems / dictitems), where any batch of one uses APPEND/SETITEM.
  template <class F>
  void batches(std::size_t n, F&& item, unsigned char one, unsigned char many, bool exact) {
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
        continue;
      }
      op(0x28);
      for (std::size_t i = start; i < end; ++i) item(i);
      op(many);
    }
  }

  /// A key for a tuple of atoms (None, bool, int, float, str), equal for equal tuples; nullopt
  /// for a tuple holding anything else.
  static std::optional<std::string> atom_tuple_key(const List& l) {
    std::string k;
    for (const Value& x : l) {
      switch (x.kind()) {
        case value_kind::none: k += 'N'; break;
        case value_kind::boolean: k += x.as_bool() ? 'T' : 'F'; break;
        case value_kind::integer: k += 'i' + std::to_string(x.as_int()) + ';'; break;
        case value_kind::floating: k += 'f' + std::to_string(std::bit_cast<std::uint64_t>(x.as_double())) + ';'; break;
        case value_kind::string: k += 's' + std::to_string(x.as_string().size()) + ':' + x.as_string(); break;
        default: return std::nullopt;
      }
    }
    return k;
  }

  void tuple(const List& l, std::size_t depth) {
    if (l.empty()) {
      op(0x29);
      return;
    }
    const auto shared = atom_tuple_key(l);
    if (shared) {
      if (auto it = tuples_.find(*shared); it != tuples_.end()) {
        get(it->second);
        return;
      }
    }
    if (l.size() > 3) op(0x28);
    for (const Value& x : l) save(x, depth + 1);
    static constexpr unsigned char code[] = {0, 0x85, 0x86, 0x87};
    op(l.size() > 3 ? 0x74 : code[l.size()]);
    if (shared) tuples_.emplace(*shared, memo_count_);
    memoize();
  }

  void key(const Key& k) {
    boundary();
    if (k.is_int()) integer(k.as_int());
    else str(k.as_string());
  }

  void save(const Value& v, std::size_t depth) {
    if (depth > max_depth)
      throw_error(unwritable_, what_, "a value nested deeper than " + std::to_string(max_depth) + " levels");
    boundary();
    switch (v.kind()) {
      case value_kind::none: op(0x4e); return;
      case value_kind::boolean: op(v.as_bool() ? 0x88 : 0x89); return;
      case value_kind::integer: integer(v.as_int()); return;
      case value_kind::floating: floating(v.as_double()); return;
      case value_kind::string: str(v.as_string()); return;
      case value_kind::bytes: bytes(v.as_bytes().data); return;
      case value_kind::tensor:
        throw_error(unwritable_, what_, "a tensor inside a value (pickling it would need a whole torch.save blob)");
      case value_kind::tuple: tuple(v.as_list(), depth); return;
      case value_kind::list: {
        op(0x5d);
        memoize();
        const List& l = v.as_list();
        batches(l.size(), [&](std::size_t i) { save(l[i], depth + 1); }, 0x61, 0x65, true);
        return;
      }
      case value_kind::dict: {
        op(0x7d);
        memoize();
        const auto& items = v.as_dict().items();
        batches(items.size(), [&](std::size_t i) {
          key(items[i].first);
          save(items[i].second, depth + 1);
        }, 0x73, 0x75, true);
        return;
      }
      case value_kind::object: object(v.as_object(), depth); return;
    }
  }

  void pairs(const Object& o, std::size_t depth, bool exact) {
    batches(o.items.size(), [&](std::size_t i) {
      const List& kv = o.items[i].as_list();
      save(kv[0], depth + 1);
      save(kv[1], depth + 1);
    }, 0x73, 0x75, exact);
  }
  static bool all_pairs(const Object& o) {
    if (o.items.empty()) return false;
    for (const Value& it : o.items)
      if (!it.is_tuple() || it.as_list().size() != 2) return false;
    return true;
  }

  void object(const Object& o, std::size_t depth) {
    const std::string q = o.qualified();
    const bool plain_call = o.how == object_build::reduce && o.args.empty() && o.state.empty();
    if (q == "builtins.int" && o.how == object_build::reduce && o.args.size() == 1 && o.args[0].is_bytes() &&
        o.items.empty() && o.state.empty()) {
      long_bytes(o.args[0].as_bytes().data);
      return;
    }
    if (q == "builtins.set" && plain_call) {
      op(0x8f);  // EMPTY_SET
      memoize();
      for (std::size_t start = 0; start < o.items.size(); start += 1000) {
        op(0x28);
        for (std::size_t i = start; i < std::min(o.items.size(), start + 1000); ++i) save(o.items[i], depth + 1);
        op(0x90);  // ADDITEMS
      }
      return;
    }
    if (q == "builtins.frozenset" && plain_call) {
      op(0x28);
      for (const Value& x : o.items) save(x, depth + 1);
      op(0x91);  // FROZENSET
      memoize();
      return;
    }
    if (q == "builtins.dict" && plain_call && (o.items.empty() || all_pairs(o))) {
      op(0x7d);
      memoize();
      pairs(o, depth, true);
      return;
    }
    if (o.how == object_build::global) {
      if (!o.args.empty() || !o.items.empty() || !o.state.empty())
        throw_error(unwritable_, what_, "object " + quote(q) + " is a global reference with arguments, items or state");
      global(o.module, o.name);
      return;
    }
    // A call: cls(*args) (REDUCE) or cls.__new__(cls, *args) (NEWOBJ), then items and state.
    boundary();
    global(o.module, o.name);
    boundary();
    tuple(o.args, depth);
    op(o.how == object_build::newobj ? 0x81 : 0x52);
    memoize();
    if (all_pairs(o)) {
      pairs(o, depth, false);
    } else {
      batches(o.items.size(), [&](std::size_t i) { save(o.items[i], depth + 1); }, 0x61, 0x65, false);
    }
    for (const Value& s : o.state) {
      save(s, depth + 1);
      op(0x62);  // BUILD
    }
  }

  const error_id& unwritable_;
  std::string what_;
  std::vector<std::byte> out_;
  bool framing_ = false;
  std::size_t frame_start_ = 0;
  std::uint64_t memo_count_ = 0;
  std::unordered_map<std::string, std::uint64_t> strings_;
  std::unordered_map<std::string, std::uint64_t> globals_;
  std::unordered_map<std::string, std::uint64_t> tuples_;
};

// ---------------------------------------------------------------------------------------------
// Names

/// One decoded name: the key path (str and int elements) and whether the value is pickled.
struct DecodedKey {
  Path keys;
  bool pickled = false;
};

/// What a name is when it is not an OLMo key (for messages and detection).
struct KeyProblem {
  bool base64 = false;  ///< true: valid base64, the pickle inside is the problem
  std::string detail;
};

/// Decodes `name` as OLMo's encode_key does in reverse, refusing every global (empty allow-list)
/// and trailing bytes after STOP. Returns the key or what is wrong.
inline std::variant<DecodedKey, KeyProblem> decode_key(std::string_view name, const pickle::limits& lim, std::size_t max_depth) {
  const auto raw = b64_decode(name);
  if (!raw) return KeyProblem{false, "is not canonical urlsafe base64"};
  static const pickle::Registry nothing;
  pickle::options po;
  po.limits = lim;
  po.registry = &nothing;
  pickle::Result r;
  try {
    r = pickle::load(*raw, po);
  } catch (const error& e) {
    return KeyProblem{true, "its base64 decodes to no readable key pickle: " + std::string(e.what())};
  }
  if (r.consumed != raw->size())
    return KeyProblem{true, "its pickle is followed by " + std::to_string(raw->size() - r.consumed) + " stray bytes"};
  const Value& v = r.value;
  if (!v.is_tuple() || v.as_list().size() != 2 || !v.as_list()[0].is_tuple() || !v.as_list()[1].is_bool())
    return KeyProblem{true, "its pickle is not a (key tuple, value_is_pickled) pair"};
  DecodedKey k;
  k.pickled = v.as_list()[1].as_bool();
  const List& keys = v.as_list()[0].as_list();
  if (keys.empty()) return KeyProblem{true, "decodes to an empty key path"};
  if (keys.size() > max_depth)
    return KeyProblem{true, "decodes to a key path of " + std::to_string(keys.size()) + " elements, more than limits::max_key_depth"};
  for (const Value& e : keys) {
    if (e.is_int()) k.keys.emplace_back(e.as_int());
    else if (e.is_string()) k.keys.emplace_back(e.as_string());
    else return KeyProblem{true, "has a key element that is a " + std::string(to_string(e.kind())) + " (only str and int keys are read)"};
  }
  return k;
}

/// The name OLMo's encode_key gives `keys` when equal strings of the path are one object: the
/// pickle of (keys, pickled) at protocol 4, urlsafe base64.
inline std::string encode_key(const Path& keys, bool pickled, const error_id& unwritable) {
  List elems;
  elems.reserve(keys.size());
  for (const Key& k : keys) {
    if (k.is_int()) elems.emplace_back(k.as_int());
    else elems.emplace_back(k.as_string());
  }
  List pair;
  pair.push_back(Value::tuple(std::move(elems)));
  pair.emplace_back(pickled);
  P4Writer w(unwritable, "key " + quote(dotted(keys)));
  const auto bytes = w.dumps(Value::tuple(std::move(pair)));
  return b64_encode(bytes);
}

}  // namespace statedict::inline v0::formats::detail::olmo
