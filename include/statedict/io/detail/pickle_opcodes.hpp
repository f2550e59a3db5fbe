// statedict: the unpickler's opcode loop (Reader::run), its text operands (protocols 0 and 1),
// and the arguments view registered functions read (Args, Build); io/pickle_read.hpp is the
// public header.
// SPDX-License-Identifier: MIT
#pragma once


#include <algorithm>
#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
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

#include "../../core/error.hpp"
#include "../../core/shape.hpp"
#include "../../core/value.hpp"

#include "pickle_reader.hpp"

namespace statedict::inline v0::pickle {

/// The arguments of a call (or the items of a persistent id) as the reader holds them: kinds,
/// scalars, strings as views of the input, the Values of registered functions' results and
/// persistent ids, tuples of ints. For fast_fn; valid only during that call. Reading an argument
/// as what it is not (check kind_of first) is a pickle.bad_call error, never a wild read.
class Args {
 public:
  enum class kind : std::uint8_t { none, boolean, integer, floating, str, bytes, value, list, tuple, dict, object, global, handle, bytearray };

  [[nodiscard]] std::size_t size() const noexcept { return items_.size(); }
  [[nodiscard]] kind kind_of(std::size_t i) const { return static_cast<kind>(node(i).kind); }
  /// An integer or boolean argument.
  [[nodiscard]] std::int64_t integer(std::size_t i) const { return as(i, kind::integer, kind::boolean).u.i; }
  /// A str or bytes argument.
  [[nodiscard]] std::string_view str(std::size_t i) const {
    const Reader::Node& n = as(i, kind::str, kind::bytes);
    return r_.view(n.u.off, n.index);
  }
  /// A `value` argument: what a registered function or persistent_load returned.
  [[nodiscard]] const Value& value(std::size_t i) const { return r_.leaves_[as(i, kind::value, kind::value).index]; }
  /// A `handle` argument: what options::persistent_handle returned for it.
  [[nodiscard]] std::uint64_t handle(std::size_t i) const { return static_cast<std::uint64_t>(as(i, kind::handle, kind::handle).u.i); }
  /// A `global` argument's identity within this pickle: the same number for every reference to
  /// one GLOBAL (memo gets included), so a caller may cache what it resolved the global to.
  [[nodiscard]] std::uint32_t global_id(std::size_t i) const { return as(i, kind::global, kind::global).index; }
  /// A `global` argument: its module and name.
  [[nodiscard]] std::pair<std::string_view, std::string_view> global(std::size_t i) const {
    const auto& g = r_.globals_[as(i, kind::global, kind::global).index];
    return {g.module, g.name};
  }
  /// A tuple or list of at most `max` integer nodes, appended to `out`; false for anything else.
  [[nodiscard]] bool ints(std::size_t i, std::size_t max, shape_t& out) const {
    const Reader::Node& n = node(i);
    if (n.kind != Reader::nk::tuple && n.kind != Reader::nk::list) return false;
    const auto items = r_.seq(n.index);
    if (items.size() > max) return false;
    for (std::uint32_t c : items) {
      if (r_.nodes_[c].kind != Reader::nk::integer) return false;
      out.push_back(r_.nodes_[c].u.i);
    }
    return true;
  }
  /// An empty dict (no items, no BUILD state).
  [[nodiscard]] bool empty_dict(std::size_t i) const {
    const Reader::Node& n = node(i);
    return n.kind == Reader::nk::dict && r_.dicts_[n.index].kv.empty() && r_.dicts_[n.index].state.empty();
  }
  /// The items of a tuple or list argument, as Args (valid as long as this one); nullopt for
  /// anything else.
  [[nodiscard]] std::optional<Args> items(std::size_t i) const {
    const Reader::Node& n = node(i);
    if (n.kind != Reader::nk::tuple && n.kind != Reader::nk::list) return std::nullopt;
    return Args(r_, r_.seq(n.index));
  }
  /// The bytes of a str, bytes or bytearray argument, and whether they lie in the pickle's input
  /// (else in the reader's own memory, valid only during this call).
  struct raw_bytes {
    std::string_view data;
    bool in_input;
  };
  [[nodiscard]] std::optional<raw_bytes> raw(std::size_t i) const {
    const Reader::Node& n = node(i);
    if (n.kind != Reader::nk::str && n.kind != Reader::nk::bytes && n.kind != Reader::nk::bytearray) return std::nullopt;
    return raw_bytes{r_.view(n.u.off, n.index), n.u.off < r_.size_};
  }
  /// Argument `i` converted to a Value (a copy; counted against limits.max_nodes).
  [[nodiscard]] Value convert(std::size_t i) const {
    (void)node(i);
    return r_.to_value_leaf(items_[i]);
  }
  /// The reader (its options, its fail()).
  [[nodiscard]] Reader& reader() const noexcept { return r_; }

 private:
  friend class Reader;
  Args(Reader& r, std::span<const std::uint32_t> items) : r_(r), items_(items) {}
  [[nodiscard]] const Reader::Node& node(std::size_t i) const {
    if (i >= items_.size()) [[unlikely]] no_such_argument(i);
    return r_.nodes_[items_[i]];
  }
  [[nodiscard]] const Reader::Node& as(std::size_t i, kind a, kind b) const {
    const Reader::Node& n = node(i);
    const auto k = static_cast<kind>(n.kind);
    if (k != a && k != b) [[unlikely]] wrong_kind(i, a);
    return n;
  }
  [[noreturn, gnu::cold, gnu::noinline]] void no_such_argument(std::size_t i) const {
    r_.fail(errors::pk_bad_call, "a fast form read argument " + std::to_string(i) + " of " + std::to_string(items_.size()));
  }
  [[noreturn, gnu::cold, gnu::noinline]] void wrong_kind(std::size_t i, kind a) const {
    r_.fail(errors::pk_bad_call, "a fast form read argument " + std::to_string(i) + " as a " + Reader::kind_name(static_cast<Reader::nk>(a)) +
                                     ", but it is a " + Reader::kind_name(node(i).kind));
  }

  Reader& r_;
  std::span<const std::uint32_t> items_;

  static_assert(static_cast<int>(kind::value) == static_cast<int>(Reader::nk::leaf) &&
                static_cast<int>(kind::global) == static_cast<int>(Reader::nk::global) &&
                static_cast<int>(kind::handle) == static_cast<int>(Reader::nk::handle) &&
                static_cast<int>(kind::bytearray) == static_cast<int>(Reader::nk::bytearray));
};

/// What a Rule::build function gets: the arguments the object was made with (REDUCE / NEWOBJ)
/// and its BUILD state (one item), as the reader holds them.
struct Build {
  const Object& callable;  ///< module and name of the global that made the object
  const Args& args;
  const Args& state;
};

inline std::optional<Value> Reader::built(std::uint32_t target, std::uint32_t state) {
  const ObjData& od = objects_[nodes_[target].index];
  Global& gl = globals_[od.global];
  if (!gl.callee) gl.callee = std::make_unique<const Object>(Object{gl.module, gl.name, object_build::global, {}, {}, {}});
  const Object& callee = *gl.callee;
  const std::span<const std::uint32_t> args = od.args == npos ? std::span<const std::uint32_t>() : seq(nodes_[od.args].index);
  const std::uint32_t one[1] = {state};
  const Args a(*this, args), st(*this, std::span<const std::uint32_t>(one));
  try {
    return gl.rule->build(Build{callee, a, st});
  } catch (error& e) {
    if (e.context().rfind("pickle offset", 0) != 0) e.add_context("pickle offset " + std::to_string(op_pos_));
    throw;
  }
}

inline std::optional<Value> Reader::try_fast(const fast_fn& f, std::uint32_t tuple) {
  return f(Args(*this, seq(nodes_[tuple].index)));
}
inline std::optional<std::uint64_t> Reader::try_handle(std::uint32_t tuple) {
  return opts_.persistent_handle(Args(*this, seq(nodes_[tuple].index)));
}

// Text operands of protocols 0 and 1.

inline std::uint32_t Reader::parse_int_text(std::string_view s, bool is_long) {
  if (is_long && !s.empty() && s.back() == 'L') s.remove_suffix(1);
  if (!is_long && s == "00") return add_scalar(nk::boolean, 0);
  if (!is_long && s == "01") return add_scalar(nk::boolean, 1);
  std::int64_t v = 0;
  const char* b = s.data();
  if (!s.empty() && s[0] == '+') ++b;
  auto [p, ec] = std::from_chars(b, s.data() + s.size(), v);
  if (ec == std::errc::result_out_of_range) {
    // Beyond int64 (torch's legacy magic number at protocols 0 and 1): 2.5 digits per byte.
    if (s.size() / 3 > opts_.limits.max_long_bytes)
      fail(errors::pk_long_limit, "text integer of " + std::to_string(s.size()) + " digits exceeds limits.max_long_bytes (" +
                                      std::to_string(opts_.limits.max_long_bytes) + " bytes)");
    std::vector<std::uint8_t> bytes;
    if (!detail::decimal_to_long(s, bytes)) fail(errors::pk_bad_text, "bad integer " + quote(s));
    return long_node(std::move(bytes));
  }
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) fail(errors::pk_bad_text, "bad integer " + quote(s));
  return add_scalar(nk::integer, v);
}

/// STRING: a quoted Python 2 str literal; str when its bytes are UTF-8, else bytes (as BINSTRING).
inline std::uint32_t Reader::read_quoted_string() {
  const std::uint64_t at = pos_;
  const std::string_view s = line();
  if (s.size() < 2 || (s.front() != '\'' && s.front() != '"') || s.back() != s.front())
    fail(errors::pk_bad_text, "STRING operand is not quoted");
  const std::string_view body = s.substr(1, s.size() - 2);
  if (body.size() > opts_.limits.max_string_bytes || body.size() > 0xFFFFFFF0U)
    fail(errors::pk_string_limit, "STRING of " + std::to_string(body.size()) + " bytes exceeds limits.max_string_bytes");
  if (body.find('\\') == std::string_view::npos) {  // no escape: the bytes are in the input
    Node n;
    n.kind = detail::valid_utf8(body) ? nk::str : nk::bytes;
    n.u.off = at + 1;
    n.index = static_cast<std::uint32_t>(body.size());
    return add_node(n);
  }
  std::string out;
  if (!detail::escape_decode(body, out)) fail(errors::pk_bad_text, "STRING operand with a bad escape");
  return add_decoded(detail::valid_utf8(out) ? nk::str : nk::bytes, out);
}

/// UNICODE: a str in raw-unicode-escape.
inline std::uint32_t Reader::read_raw_unicode() {
  const std::uint64_t at = pos_;
  const std::string_view s = line();
  if (s.size() > opts_.limits.max_string_bytes || s.size() > 0xFFFFFFF0U)
    fail(errors::pk_string_limit, "UNICODE of " + std::to_string(s.size()) + " bytes exceeds limits.max_string_bytes");
  if (std::all_of(s.begin(), s.end(), [](char c) { return c != '\\' && static_cast<unsigned char>(c) < 0x80; })) {
    Node n;  // ASCII without escapes: the text is the input's
    n.kind = nk::str;
    n.u.off = at;
    n.index = static_cast<std::uint32_t>(s.size());
    return add_node(n);
  }
  std::string out;
  if (!detail::raw_unicode_escape_decode(s, out)) fail(errors::pk_bad_text, "UNICODE operand with a bad \\u escape");
  if (out.size() > opts_.limits.max_string_bytes)
    fail(errors::pk_string_limit, "UNICODE of " + std::to_string(out.size()) + " bytes exceeds limits.max_string_bytes");
  return add_decoded(nk::str, out);
}

inline Result Reader::run() {
  int protocol = 0;
  // Reserve guesses from the input size (torch.save's pickles: a node per 6 bytes, a tuple per
  // 25, a list or tuple item per 11, a dict per 110, a memo entry per 15), so that the tables are
  // not copied as they grow. Address space only: what a smaller pickle does not use is not touched.
  const auto guess = [this](std::uint64_t bytes_per, std::uint64_t cap) {
    return static_cast<std::size_t>(std::min<std::uint64_t>(size_ / bytes_per + 16, cap));
  };
  nodes_.reserve(guess(3, 1U << 22));  // < npos - 1
  seqs_.reserve(guess(16, 1U << 20));
  seq_pool_.reserve(guess(4, 1U << 22));
  dicts_.reserve(guess(64, 1U << 18));
  memo_.reserve(guess(8, 1U << 20));
  stack_.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(64, opts_.limits.max_stack)));
  for (;;) {
    if (pos_ >= size_) fail(errors::pk_truncated, "pickle ends without STOP");
    op_pos_ = pos_;
    const unsigned char op = in_[pos_++];
    switch (op) {
      // --- framing and protocol
      case 0x80: {  // PROTO
        need(1, "PROTO");
        protocol = in_[pos_++];
        if (protocol > 5) fail(errors::pk_bad_protocol, "pickle protocol " + std::to_string(protocol) + " (statedict reads 0 to 5)");
        break;
      }
      case 0x95: {  // FRAME: a size hint; frames hold whole opcodes
        const std::uint64_t n = le<8>();
        if (n > left()) fail(errors::pk_truncated, "frame of " + std::to_string(n) + " bytes, " + std::to_string(left()) + " left");
        break;
      }
      case '.': {  // STOP
        const std::uint32_t root = pop();
        Result r;
        // The last conversion: a leaf reached along a path of nodes each referenced once is moved
        // out of leaves_ instead of copied (nothing converts it again).
        r.value = to_value(root, 0, nullptr, true, nodes_[root].refs <= 1);
        r.attributes = std::move(attributes_);
        r.consumed = pos_;
        r.protocol = protocol;
        return r;
      }
      // --- constants
      case 'N': push(add_scalar(nk::none, 0)); break;
      case 0x88: push(add_scalar(nk::boolean, 1)); break;  // NEWTRUE
      case 0x89: push(add_scalar(nk::boolean, 0)); break;  // NEWFALSE
      // --- integers
      case 'J': push(add_scalar(nk::integer, static_cast<std::int32_t>(static_cast<std::uint32_t>(le<4>())))); break;  // BININT
      case 'K': push(add_scalar(nk::integer, static_cast<std::int64_t>(le<1>()))); break;  // BININT1
      case 'M': push(add_scalar(nk::integer, static_cast<std::int64_t>(le<2>()))); break;  // BININT2
      case 0x8a: push(read_long(le<1>())); break;  // LONG1
      case 0x8b: {                               // LONG4
        const auto n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le<4>()));
        if (n < 0) fail(errors::pk_bad_operand, "LONG4 with a negative length");
        push(read_long(static_cast<std::uint64_t>(n)));
        break;
      }
      case 'I': push(parse_int_text(line(), false)); break;  // INT
      case 'L': push(parse_int_text(line(), true)); break;   // LONG (text)
      // --- floats
      case 'G': {  // BINFLOAT, big-endian
        need(8, "BINFLOAT");
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | in_[pos_++];
        Node n;
        n.kind = nk::floating;
        n.u.d = std::bit_cast<double>(bits);
        push(add_node(n));
        break;
      }
      case 'F': {  // FLOAT (text)
        const std::string_view s = line();
        double d = 0;
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), d);
        if (ec != std::errc() || p != s.data() + s.size()) fail(errors::pk_bad_text, "bad float " + quote(s));
        Node n;
        n.kind = nk::floating;
        n.u.d = d;
        push(add_node(n));
        break;
      }
      // --- strings and bytes
      case 'X': push(read_string(le<4>(), false, "BINUNICODE")); break;
      case 0x8c: push(read_string(le<1>(), false, "SHORT_BINUNICODE")); break;
      case 0x8d: push(read_string(le<8>(), false, "BINUNICODE8")); break;
      case 'B': push(read_string(le<4>(), true, "BINBYTES")); break;
      case 'C': push(read_string(le<1>(), true, "SHORT_BINBYTES")); break;
      case 0x8e: push(read_string(le<8>(), true, "BINBYTES8")); break;
      case 'U': push(read_py2_string(le<1>())); break;  // SHORT_BINSTRING
      case 'T': {                                     // BINSTRING
        const auto n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le<4>()));
        if (n < 0) fail(errors::pk_bad_operand, "BINSTRING with a negative length");
        push(read_py2_string(static_cast<std::uint64_t>(n)));
        break;
      }
      case 0x96: {  // BYTEARRAY8: its bytes stay in the input (numpy's _frombuffer views them)
        const std::uint32_t b = read_string(le<8>(), true, "BYTEARRAY8");
        nodes_[b].kind = nk::bytearray;
        push(b);
        break;
      }
      case 'S': push(read_quoted_string()); break;  // STRING
      case 'V': push(read_raw_unicode()); break;    // UNICODE
      case 0x97:
      case 0x98:
        fail(errors::pk_unsupported_opcode, detail::opcode_name(op) + " (protocol 5 out-of-band buffers) is not supported");
      case 0x82:
      case 0x83:
      case 0x84:
        fail(errors::pk_unsupported_opcode, detail::opcode_name(op) + " (extension registry) is not supported");
      // --- containers
      case ')': push(add_seq(nk::tuple, {})); break;
      case ']': push(add_seq(nk::list, {})); break;
      case '}': push(add_dict(false)); break;
      case 0x8f: push(add_builtin_object("builtins", "set", object_build::reduce)); break;  // EMPTY_SET
      case 0x85: {  // TUPLE1
        const std::uint32_t a = pop();
        push(add_seq(nk::tuple, {a}));
        break;
      }
      case 0x86: {  // TUPLE2
        const std::uint32_t b = pop(), a = pop();
        push(add_seq(nk::tuple, {a, b}));
        break;
      }
      case 0x87: {  // TUPLE3
        const std::uint32_t c = pop(), b = pop(), a = pop();
        push(add_seq(nk::tuple, {a, b, c}));
        break;
      }
      case '(':  // MARK
        if (marks_.size() >= opts_.limits.max_depth)
          fail(errors::pk_depth_limit, "MARK nesting exceeds limits.max_depth (" + std::to_string(opts_.limits.max_depth) + ")");
        marks_.push_back(stack_.size());
        floor_ = stack_.size();
        break;
      case 't': push(add_seq(nk::tuple, pop_mark())); break;  // TUPLE
      case 'l': push(add_seq(nk::list, pop_mark())); break;   // LIST
      case 'd': {                                             // DICT
        const auto& kv = pop_mark();
        if (kv.size() % 2) fail(errors::pk_bad_operand, "DICT with an odd number of items");
        const std::uint32_t d = add_dict(false);
        dicts_[nodes_[d].index].kv = kv;
        push(d);
        break;
      }
      case 0x91: {  // FROZENSET
        const auto& items = pop_mark();
        const std::uint32_t o = add_builtin_object("builtins", "frozenset", object_build::reduce);
        objects_[nodes_[o].index].items = items;
        push(o);
        break;
      }
      case 'a': {  // APPEND
        const std::uint32_t v = pop();
        append_to(top(), std::span<const std::uint32_t>(&v, 1), "APPEND");
        break;
      }
      case 'e': {  // APPENDS
        const auto& items = pop_mark();
        append_to(top(), items, "APPENDS");
        break;
      }
      case 0x90: {  // ADDITEMS
        const auto& items = pop_mark();
        const Node& t = nodes_[top()];
        if (t.kind != nk::object || globals_[objects_[t.index].global].name != "set")
          fail(errors::pk_bad_operand, "ADDITEMS to a " + kind_name(t.kind) + ", not a set");
        auto& v = objects_[t.index].items;
        v.insert(v.end(), items.begin(), items.end());
        break;
      }
      case 's': {  // SETITEM
        const std::uint32_t v = pop(), k = pop();
        const std::uint32_t kv[2] = {k, v};
        setitems_on(top(), kv, "SETITEM");
        break;
      }
      case 'u': {  // SETITEMS
        const auto& kv = pop_mark();
        setitems_on(top(), kv, "SETITEMS");
        break;
      }
      // --- stack manipulation
      case '0':  // POP
        if (stack_.size() > floor()) stack_.pop_back();
        else (void)pop_mark();
        break;
      case '1': (void)pop_mark(); break;  // POP_MARK
      case '2': push(top()); break;       // DUP
      // --- memo
      case 'q': memo_put(le<1>(), top()); break;  // BINPUT
      case 'r': memo_put(le<4>(), top()); break;  // LONG_BINPUT
      case 0x94: memo_put(memo_count_, top()); break;  // MEMOIZE
      case 'p': {                                      // PUT (text)
        const std::string_view s = line();
        std::uint64_t i = 0;
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), i);
        if (ec != std::errc() || p != s.data() + s.size()) fail(errors::pk_bad_text, "bad memo index " + quote(s));
        memo_put(i, top());
        break;
      }
      case 'h': push(memo_get(le<1>())); break;  // BINGET
      case 'j': push(memo_get(le<4>())); break;  // LONG_BINGET
      case 'g': {                              // GET (text)
        const std::string_view s = line();
        std::uint64_t i = 0;
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), i);
        if (ec != std::errc() || p != s.data() + s.size()) fail(errors::pk_bad_text, "bad memo index " + quote(s));
        push(memo_get(i));
        break;
      }
      // --- globals and calls
      case 'c': {  // GLOBAL
        const std::string_view module = global_line("GLOBAL");
        const std::string_view name = global_line("GLOBAL");
        push(resolve_global(module, name));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const std::uint32_t nn = pop(), mn = pop();
        if (nodes_[nn].kind != nk::str || nodes_[mn].kind != nk::str)
          fail(errors::pk_bad_operand, "STACK_GLOBAL operands are not strings");
        push(resolve_global(view(nodes_[mn].u.off, nodes_[mn].index), view(nodes_[nn].u.off, nodes_[nn].index)));
        break;
      }
      case 'R': {  // REDUCE
        const std::uint32_t args = pop();
        std::uint32_t& f = top();
        f = apply(f, args, object_build::reduce);
        counted(f);
        break;
      }
      case 0x81: {  // NEWOBJ
        const std::uint32_t args = pop();
        const std::uint32_t cls = pop();
        push(apply(cls, args, object_build::newobj));
        break;
      }
      case 0x92: {  // NEWOBJ_EX
        const std::uint32_t kwargs = pop(), args = pop(), cls = pop();
        if (nodes_[kwargs].kind != nk::dict || !dicts_[nodes_[kwargs].index].kv.empty())
          fail(errors::pk_unsupported_opcode, "NEWOBJ_EX with keyword arguments is not supported");
        push(apply(cls, args, object_build::newobj));
        break;
      }
      case 'i': {  // INST: module, name, then args from the mark
        const std::string_view module = global_line("INST");
        const std::string_view name = global_line("INST");
        const auto& items = pop_mark();
        const std::uint32_t g = resolve_global(module, name);
        push(apply(g, add_seq(nk::tuple, items), object_build::reduce));
        break;
      }
      case 'o': {  // OBJ: class and args from the mark
        const auto& items = pop_mark();
        if (items.empty()) fail(errors::pk_stack_underflow, "OBJ without a class");
        const std::uint32_t cls = items.front();
        push(apply(cls, add_seq(nk::tuple, std::span<const std::uint32_t>(items).subspan(1)), object_build::reduce));
        break;
      }
      case 'b': {  // BUILD
        const std::uint32_t state = pop();
        build(top(), state);
        break;
      }
      // --- persistent ids
      case 'Q': {  // BINPERSID
        const std::uint32_t pid = pop();
        push(persistent(pid));
        break;
      }
      case 'P': {  // PERSID (text)
        const std::string_view s = line();
        if (!detail::valid_utf8(s)) fail(errors::pk_bad_utf8, "PERSID is not valid UTF-8");
        Node n;
        n.kind = nk::str;
        n.u.off = static_cast<std::uint64_t>(reinterpret_cast<const unsigned char*>(s.data()) - in_);
        n.index = static_cast<std::uint32_t>(s.size());
        push(persistent(add_node(n)));
        break;
      }
      default: fail(errors::pk_unknown_opcode, detail::opcode_name(op) + " is not a pickle opcode");
    }
  }
}

}  // namespace statedict::inline v0::pickle
