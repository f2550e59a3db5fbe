// statedict: the unpickler's machine: a flat node table built opcode by opcode, then turned into
// Values (io/pickle_read.hpp is the public header, and says what becomes what).
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

#include "../pickle_read.hpp"

namespace statedict::inline v0::pickle {

namespace detail {
/// A growable array of a trivially copyable type whose append is one store once room is checked
/// (std::vector's push_back inlines its reallocation into every caller). Growth is the owner's
/// call: reserve() when size() == capacity(), with whatever cap applies.
template <class T>
class pod_buffer {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);

 public:
  pod_buffer() = default;
  pod_buffer(const pod_buffer&) = delete;
  pod_buffer& operator=(const pod_buffer&) = delete;
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return cap_; }
  [[nodiscard]] const T* begin() const noexcept { return buf_.get(); }
  [[nodiscard]] const T* end() const noexcept { return buf_.get() + n_; }
  [[nodiscard]] T& operator[](std::size_t i) noexcept { return buf_[i]; }
  [[nodiscard]] const T& operator[](std::size_t i) const noexcept { return buf_[i]; }
  [[nodiscard]] T& back() noexcept { return buf_[n_ - 1]; }
  void push_unchecked(const T& v) noexcept { buf_[n_++] = v; }
  void pop_back() noexcept { --n_; }
  void shrink_to(std::size_t m) noexcept { n_ = m; }
  /// Room for `cap` items (never shrinks); the items are kept, the rest stays untouched memory.
  void reserve(std::size_t cap) {
    if (cap <= cap_) return;
    if (cap > std::numeric_limits<std::size_t>::max() / sizeof(T)) throw std::bad_alloc();
    std::unique_ptr<T[], deleter> b(static_cast<T*>(::operator new(cap * sizeof(T))));  // implicit-lifetime T
    if (n_) std::memcpy(b.get(), buf_.get(), n_ * sizeof(T));
    buf_ = std::move(b);
    cap_ = cap;
  }

 private:
  struct deleter {
    void operator()(T* p) const noexcept { ::operator delete(p); }
  };
  std::unique_ptr<T[], deleter> buf_;
  std::size_t n_ = 0, cap_ = 0;
};
}  // namespace detail

/// One unpickling run. Use pickle::load(); Reader is public so that registered functions can call
/// back (`reader.call(...)`) and report errors with the position.
class Reader {
  friend class Args;
  template <class T>
  using pod_buffer = detail::pod_buffer<T>;

 public:
  Reader(std::span<const std::byte> bytes, const options& opts)
      : in_(reinterpret_cast<const unsigned char*>(bytes.data())), size_(bytes.size()), opts_(opts),
        registry_(opts.registry ? opts.registry : &Registry::shared()) {}

  Result run();

  /// Calls a registered function global with `args` (what REDUCE does); for functions such as
  /// `_rebuild_from_type_v2` that receive another global and its arguments.
  Value call(const Object& callable, List args) {
    if (callable.how != object_build::global)
      fail(errors::pk_bad_call, "calling a " + callable.qualified() + " object, which is not a global");
    const Rule* r = registry_->find(callable.qualified());
    if (!r || r->k != Rule::kind::function)
      fail(errors::pk_bad_call, callable.qualified() + " is not a function statedict interprets");
    Call c{callable, args, *this};
    return r->fn(c);
  }

  /// Throws `id` with the current position as context.
  [[noreturn]] void fail(const error_id& id, std::string detail) const {
    throw_error(id, "pickle offset " + std::to_string(op_pos_), std::move(detail));
  }
  [[nodiscard]] const options& opts() const noexcept { return opts_; }

 private:
  // ------------------------------------------------------------------------------------------
  // The object graph built while parsing. Containers are mutable until the end (pickle fills
  // them after memoizing them); scalars and strings are small inline nodes (strings are views of
  // the input); results of registered functions are finished Values.
  enum class nk : std::uint8_t { none, boolean, integer, floating, str, bytes, leaf, list, tuple, dict, object, global, handle, bytearray };
  static constexpr std::uint32_t npos = 0xFFFFFFFFU;

  struct Node {
    nk kind = nk::none;
    std::uint8_t refs = 0;       ///< stack references, saturating at 2 (see counted); in padding
    std::uint32_t index = npos;  ///< str/bytes/bytearray: length; leaf/list/tuple/dict/object/global: side-table index
    union {
      std::int64_t i;  ///< boolean, integer; handle: the handle (as uint64)
      double d;
      std::uint64_t off;  ///< str/bytes/bytearray: offset in the input, or size_ + offset in text_pool_
    } u{};
  };
  struct DictData {
    std::vector<std::uint32_t> kv;     ///< key, value, key, value, ...
    std::vector<std::uint32_t> state;  ///< BUILD states (attribute dicts)
    bool ordered = false;              ///< made by collections.OrderedDict
  };
  struct ObjData {
    std::uint32_t global = npos;       ///< index into globals_
    object_build how = object_build::reduce;
    std::uint32_t args = npos;         ///< tuple node (npos: no args)
    std::vector<std::uint32_t> state;  ///< BUILD states
    std::vector<std::uint32_t> items;  ///< appended values, or (key, value) tuple nodes
  };

  // Failures of the small functions every opcode runs, out of line so that those stay inlined.
  [[noreturn, gnu::cold, gnu::noinline]] void too_many_nodes() const { fail(errors::pk_node_limit, "more than 2^32 objects"); }
  [[noreturn, gnu::cold, gnu::noinline]] void truncated(std::uint64_t n, const char* what) const {
    fail(errors::pk_truncated, std::string(what) + " needs " + std::to_string(n) + " bytes, " + std::to_string(left()) + " left");
  }
  [[noreturn, gnu::cold, gnu::noinline]] void stack_overflow() const {
    fail(errors::pk_stack_limit, "stack exceeds limits.max_stack (" + std::to_string(opts_.limits.max_stack) + ")");
  }
  [[noreturn, gnu::cold, gnu::noinline]] void stack_underflow(const char* what) const { fail(errors::pk_stack_underflow, what); }

  std::uint32_t add_node(Node n) {
    if (nodes_.size() == nodes_.capacity()) [[unlikely]] grow_nodes();
    n.refs = 0;
    nodes_.push_unchecked(n);
    return static_cast<std::uint32_t>(nodes_.size() - 1);
  }
  /// Room for more nodes; node ids stay below npos - 1.
  [[gnu::cold, gnu::noinline]] void grow_nodes() {
    if (nodes_.size() >= npos - 1) too_many_nodes();
    nodes_.reserve(std::min<std::size_t>(std::max<std::size_t>(1024, 2 * nodes_.capacity()), npos - 1));
  }
  std::uint32_t add_scalar(nk k, std::int64_t i) {
    Node n;
    n.kind = k;
    n.u.i = i;
    return add_node(n);
  }
  /// Calls `f(value, level)` for every value of `root` (the root is level 1) until it returns false;
  /// iterative, as the tree may be deep. Reuses one stack for every walk (one per leaf).
  template <class F>
  void each_value(const Value& root, F&& f) {
    auto& pending = walk_stack_;
    pending.clear();
    pending.emplace_back(&root, 1);
    while (!pending.empty()) {
      const auto [v, level] = pending.back();
      pending.pop_back();
      if (!f(*v, level)) return;
      auto push = [&, level = level](const List& l) {
        for (const Value& c : l) pending.emplace_back(&c, level + 1);
      };
      if (v->is_list() || v->is_tuple()) {
        push(v->as_list());
      } else if (v->is_dict()) {
        for (const auto& kv : v->as_dict().items()) pending.emplace_back(&kv.second, level + 1);
      } else if (v->is_object()) {
        const Object& o = v->as_object();
        push(o.args);
        push(o.state);
        push(o.items);
      }
    }
  }

  struct LeafShape {
    std::uint64_t values = 0;  ///< values in the tree
    std::uint64_t height = 0;  ///< levels (1 for a scalar)
  };
  LeafShape leaf_shape(const Value& root) {
    LeafShape s;
    each_value(root, [&s](const Value&, std::uint64_t level) {
      ++s.values;
      s.height = std::max(s.height, level);
      return true;
    });
    return s;
  }

  /// Whether a tensor (a storage's bytes included) is anywhere in `root`.
  bool holds_tensor(const Value& root) {
    bool found = false;
    each_value(root, [&found](const Value& v, std::uint64_t) {
      found = v.is_tensor();
      return !found;
    });
    return found;
  }

  std::uint32_t add_leaf(Value&& v) {
    // A leaf is copied into the result wherever it is referenced: each copy counts all its values
    // against limits.max_nodes (a persistent id answered with a large value and then referenced
    // through shared lists would otherwise copy without bound), and its height against
    // limits.max_depth where it lands (set(set(...)) calls nest leaves inside leaves).
    const bool scalar = !v.is_list() && !v.is_tuple() && !v.is_dict() && !v.is_object();  // a tensor, mostly
    leaf_shape_.push_back(scalar ? LeafShape{1, 1} : leaf_shape(v));
    leaves_.push_back(std::move(v));
    Node n;
    n.kind = nk::leaf;
    n.index = static_cast<std::uint32_t>(leaves_.size() - 1);
    return add_node(n);
  }
  std::uint32_t add_seq(nk k, std::span<const std::uint32_t> items) {
    const std::size_t off = seq_pool_.size();
    if (items.size() <= 4) {  // most tuples: no memmove call for a few ids
      for (const std::uint32_t it : items) seq_pool_.push_back(it);
    } else {
      seq_pool_.insert(seq_pool_.end(), items.begin(), items.end());
    }
    const auto len = static_cast<std::uint32_t>(items.size());  // items < nodes < 2^32
    seqs_.push_back({off, len, len});
    Node n;
    n.kind = k;
    n.index = static_cast<std::uint32_t>(seqs_.size() - 1);
    return add_node(n);
  }
  std::uint32_t add_seq(nk k, std::initializer_list<std::uint32_t> items) {
    return add_seq(k, std::span<const std::uint32_t>(items.begin(), items.size()));
  }
  /// The items of list or tuple `i`: valid until the next add_seq or seq_append.
  [[nodiscard]] std::span<const std::uint32_t> seq(std::uint32_t i) const {
    const SeqData& d = seqs_[i];
    return {seq_pool_.data() + d.off, d.len};
  }
  /// Appends to list `i`: in place while its room lasts, else at the pool's end with twice the room.
  void seq_append(std::uint32_t i, std::span<const std::uint32_t> items) {
    SeqData& d = seqs_[i];
    if (items.size() > UINT32_MAX - 1 - d.len) fail(errors::pk_node_limit, "a list of more than 2^32 items");
    const std::size_t need = d.len + items.size();
    if (need > d.cap) {
      const std::size_t cap = std::max<std::size_t>({need, std::size_t{2} * d.cap, 4});
      const std::size_t cap32 = std::min<std::size_t>(cap, UINT32_MAX - 1);
      if (d.off + d.cap == seq_pool_.size()) {
        seq_pool_.resize(d.off + cap32);
      } else {
        const std::size_t off = seq_pool_.size();
        seq_pool_.resize(off + cap32);
        std::copy_n(seq_pool_.begin() + static_cast<std::ptrdiff_t>(d.off), d.len, seq_pool_.begin() + static_cast<std::ptrdiff_t>(off));
        d.off = off;
      }
      d.cap = static_cast<std::uint32_t>(cap32);
    }
    std::copy(items.begin(), items.end(), seq_pool_.begin() + static_cast<std::ptrdiff_t>(d.off + d.len));
    d.len = static_cast<std::uint32_t>(need);
  }
  std::uint32_t add_dict(bool ordered) {
    dicts_.emplace_back();
    dicts_.back().ordered = ordered;
    Node n;
    n.kind = nk::dict;
    n.index = static_cast<std::uint32_t>(dicts_.size() - 1);
    return add_node(n);
  }
  std::uint32_t add_object(std::uint32_t global, object_build how, std::uint32_t args) {
    ObjData o;
    o.global = global;
    o.how = how;
    o.args = args;
    objects_.push_back(std::move(o));
    Node n;
    n.kind = nk::object;
    n.index = static_cast<std::uint32_t>(objects_.size() - 1);
    return add_node(n);
  }
  /// An Object node of a builtin class with items (sets, dicts with other keys).
  std::uint32_t add_builtin_object(std::string_view module, std::string_view name, object_build how) {
    globals_.push_back({std::string(module), std::string(name), nullptr, {}});  // never called: only its items are read
    return add_object(static_cast<std::uint32_t>(globals_.size() - 1), how, npos);
  }

  // ------------------------------------------------------------------------------------------
  // Input

  [[nodiscard]] std::uint64_t left() const noexcept { return size_ - pos_; }
  void need(std::uint64_t n, const char* what) const {
    if (n > left()) [[unlikely]] truncated(n, what);
  }
  /// An N-byte little-endian operand (the host is little-endian: core/config.hpp).
  template <std::size_t N>
  std::uint64_t le() {
    static_assert(N == 1 || N == 2 || N == 4 || N == 8);
    need(N, "operand");
    std::conditional_t<N == 1, std::uint8_t, std::conditional_t<N == 2, std::uint16_t, std::conditional_t<N == 4, std::uint32_t, std::uint64_t>>> v;
    std::memcpy(&v, in_ + pos_, N);
    pos_ += N;
    return v;
  }
  std::string_view line() {
    const void* nl = std::memchr(in_ + pos_, '\n', static_cast<std::size_t>(left()));
    if (!nl) fail(errors::pk_truncated, "text operand without a newline");
    const auto n = static_cast<std::size_t>(static_cast<const unsigned char*>(nl) - (in_ + pos_));
    std::string_view s(reinterpret_cast<const char*>(in_ + pos_), n);
    pos_ += n + 1;
    return s;
  }
  /// A module or class name line of GLOBAL / INST: strict UTF-8, surrogates refused (Python's
  /// unpicklers decode these lines with errors='strict'; strings with 'surrogatepass').
  std::string_view global_line(std::string_view op) {
    const std::size_t at = pos_;
    const std::string_view s = line();
    if (const std::size_t bad = statedict::detail::first_invalid_utf8(s, statedict::detail::utf8_surrogates::refused);
        bad != std::string_view::npos)
      fail(errors::pk_bad_utf8, std::string(op) + " name at byte " + std::to_string(at) + " is not valid UTF-8 (byte " +
                                    std::to_string(bad) + " of the line)");
    return s;
  }
  std::string_view view(std::uint64_t off, std::uint64_t len) const {
    if (off >= size_) [[unlikely]]  // decoded text (protocol 0 escapes)
      return std::string_view(text_pool_).substr(static_cast<std::size_t>(off - size_), static_cast<std::size_t>(len));
    return {reinterpret_cast<const char*>(in_ + off), static_cast<std::size_t>(len)};
  }
  /// A str or bytes node of `text`, which is not a slice of the input (decoded escapes).
  std::uint32_t add_decoded(nk k, std::string_view text) {
    if (text.size() > 0xFFFFFFF0U || text_pool_.size() > std::numeric_limits<std::uint64_t>::max() - size_ - text.size())
      fail(errors::pk_string_limit, "decoded text beyond 2^32 bytes");
    Node n;
    n.kind = k;
    n.u.off = size_ + text_pool_.size();
    n.index = static_cast<std::uint32_t>(text.size());
    text_pool_.append(text);
    return add_node(n);
  }

  // ------------------------------------------------------------------------------------------
  // Stack and marks

  [[nodiscard]] std::size_t floor() const noexcept { return floor_; }
  [[gnu::always_inline]] void push(std::uint32_t n) {
    if (stack_.size() == stack_.capacity()) [[unlikely]] grow_stack();
    stack_.push_unchecked(n);
    counted(n);
  }
  /// Room for more items, up to limits.max_stack (the one check push makes is for room).
  [[gnu::cold, gnu::noinline]] void grow_stack() {
    if (stack_.size() >= opts_.limits.max_stack) stack_overflow();
    stack_.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(std::max<std::size_t>(64, 2 * stack_.capacity()), opts_.limits.max_stack)));
  }
  /// Counts a reference to node `n` put on the stack (saturating at 2): whatever is on the stack
  /// ends up in at most one place, so a node counted once sits in one place of the graph.
  void counted(std::uint32_t n) {
    std::uint8_t& r = nodes_[n].refs;
    if (r < 2) ++r;
  }
  /// Whether child `c` of a node converted once (`sole`) is converted once too.
  [[nodiscard]] bool sole_child(bool sole, std::uint32_t c) const noexcept { return sole && nodes_[c].refs <= 1; }
  std::uint32_t pop() {
    if (stack_.size() <= floor()) [[unlikely]] stack_underflow("pop from an empty stack");
    const std::uint32_t n = stack_.back();
    stack_.pop_back();
    return n;
  }
  std::uint32_t& top() {
    if (stack_.size() <= floor()) [[unlikely]] stack_underflow("no object on the stack");
    return stack_.back();
  }
  /// Items pushed since the last MARK (removes them and the mark), in a buffer the next pop_mark
  /// reuses.
  const std::vector<std::uint32_t>& pop_mark() {
    if (marks_.empty()) fail(errors::pk_no_mark, "no MARK on the stack");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    floor_ = marks_.empty() ? 0 : marks_.back();
    mark_items_.assign(stack_.begin() + m, stack_.end());
    stack_.shrink_to(m);
    return mark_items_;
  }

  // ------------------------------------------------------------------------------------------
  // Memo

  void memo_put(std::uint64_t idx, std::uint32_t node) {
    if (idx < memo_.size()) [[likely]] {
      std::uint32_t& m = memo_[idx];
      if (m == npos && ++memo_count_ > opts_.limits.max_memo) [[unlikely]] memo_full();
      m = node;
      return;
    }
    memo_put_new(idx, node);
  }
  /// An id past the memo vector: dense ids (what every pickler writes) grow the vector; wild ids
  /// go to a map.
  [[gnu::noinline]] void memo_put_new(std::uint64_t idx, std::uint32_t node) {
    if (idx < memo_.size() + 4096 + size_) {
      memo_.resize(static_cast<std::size_t>(idx) + 1 + memo_.size() / 2, npos);
      memo_[idx] = node;
      ++memo_count_;
    } else {
      if (memo_far_.insert_or_assign(idx, node).second) ++memo_count_;
    }
    if (memo_count_ > opts_.limits.max_memo) memo_full();
  }
  [[noreturn, gnu::cold, gnu::noinline]] void memo_full() const {
    fail(errors::pk_memo_limit, "memo exceeds limits.max_memo (" + std::to_string(opts_.limits.max_memo) + ")");
  }
  std::uint32_t memo_get(std::uint64_t idx) const {
    if (idx < memo_.size() && memo_[idx] != npos) [[likely]] return memo_[idx];
    return memo_get_far(idx);
  }
  [[gnu::noinline]] std::uint32_t memo_get_far(std::uint64_t idx) const {
    if (auto it = memo_far_.find(idx); it != memo_far_.end()) return it->second;
    fail(errors::pk_bad_memo, "memo entry " + std::to_string(idx) + " was never stored");
  }

  // ------------------------------------------------------------------------------------------
  // Values

  std::uint32_t read_string(std::uint64_t len, bool is_bytes, const char* what) {
    if (len > opts_.limits.max_string_bytes || len > 0xFFFFFFF0U)
      fail(errors::pk_string_limit, std::string(what) + " of " + std::to_string(len) +
                                        " bytes exceeds limits.max_string_bytes (" +
                                        std::to_string(opts_.limits.max_string_bytes) + ")");
    need(len, what);
    Node n;
    n.kind = is_bytes ? nk::bytes : nk::str;
    n.u.off = pos_;
    n.index = static_cast<std::uint32_t>(len);
    if (!is_bytes && !detail::valid_utf8(view(pos_, len)))
      fail(errors::pk_bad_utf8, std::string(what) + " is not valid UTF-8");
    pos_ += len;
    return add_node(n);
  }

  /// A Python 2 `str` (BINSTRING, SHORT_BINSTRING): str when it is valid UTF-8 (what torch.load's
  /// encoding='utf-8' gives), bytes otherwise.
  std::uint32_t read_py2_string(std::uint64_t len) {
    if (len > opts_.limits.max_string_bytes || len > 0xFFFFFFF0U)
      fail(errors::pk_string_limit, "string of " + std::to_string(len) + " bytes exceeds limits.max_string_bytes");
    need(len, "string");
    Node n;
    n.kind = detail::valid_utf8(view(pos_, len)) ? nk::str : nk::bytes;
    n.u.off = pos_;
    n.index = static_cast<std::uint32_t>(len);
    pos_ += len;
    return add_node(n);
  }

  std::uint32_t read_long(std::uint64_t len) {
    if (len > opts_.limits.max_long_bytes)
      fail(errors::pk_long_limit, "integer of " + std::to_string(len) + " bytes exceeds limits.max_long_bytes (" +
                                      std::to_string(opts_.limits.max_long_bytes) + ")");
    need(len, "LONG");
    std::vector<std::uint8_t> b(in_ + pos_, in_ + pos_ + len);
    pos_ += len;
    return long_node(std::move(b));
  }
  /// An int from its little-endian two's complement bytes: a scalar, or beyond int64 a
  /// builtins.int Object of its minimal bytes.
  std::uint32_t long_node(std::vector<std::uint8_t> b) {
    std::int64_t v = 0;
    if (detail::normalise_long(b, v)) return add_scalar(nk::integer, v);
    if (b.size() > opts_.limits.max_long_bytes)
      fail(errors::pk_long_limit, "integer of " + std::to_string(b.size()) + " bytes exceeds limits.max_long_bytes (" +
                                      std::to_string(opts_.limits.max_long_bytes) + ")");
    Object o{"builtins", "int", object_build::reduce, {}, {}, {}};
    o.args.emplace_back(Bytes{std::move(b)});
    return add_leaf(Value(std::move(o)));
  }

  // Text operands of protocols 0 and 1 (defined in pickle_opcodes.hpp).
  std::uint32_t parse_int_text(std::string_view s, bool is_long);
  std::uint32_t read_quoted_string();
  std::uint32_t read_raw_unicode();

  /// The global named by module and name, after the Python 2 -> 3 renames and the security checks.
  std::uint32_t resolve_global(std::string_view module_in, std::string_view name) {
    const std::string_view module = py3_module(module_in);
    if (module.empty() || name.empty()) fail(errors::pk_bad_operand, "global with an empty module or name");
    if (blocked_global(module, name))
      fail(errors::pk_blocked_module, "global " + quote(std::string(module) + "." + std::string(name)) +
                                          " is never allowed: loading this pickle with Python would run code");
    if (module == module_in && no_such_name(module, name))  // Python 2 names are mapped, not checked
      fail(errors::pk_no_such_name, "global " + quote(std::string(module) + "." + std::string(name)) + ": module " +
                                        quote(std::string(module)) + " has no such name (a corrupt pickle; Python cannot load it)");
    std::string q;
    q.reserve(module.size() + name.size() + 1);
    q.append(module).append(".").append(name);
    const Rule* r = registry_->find(q);
    if ((!r || r->beyond_weights_only) && !opts_.keep_unknown_objects)
      fail(errors::pk_forbidden_global,
           "global " + quote(q) + " is not on the allow-list (the globals torch.load(weights_only=True) accepts), "
           "which this read asked for; statedict never runs pickled code either way, and by default reads such "
           "objects as data (keep_unknown_objects)");
    globals_.push_back({std::string(module), std::string(name), r, {}});
    Node n;
    n.kind = nk::global;
    n.index = static_cast<std::uint32_t>(globals_.size() - 1);
    return add_node(n);
  }

  [[nodiscard]] std::string global_name(std::uint32_t g) const { return globals_[g].module + "." + globals_[g].name; }

  /// REDUCE / NEWOBJ of global node `callable` with tuple node `args`.
  std::uint32_t apply(std::uint32_t callable, std::uint32_t args, object_build how) {
    if (nodes_[callable].kind == nk::object) callable = nested_class(callable, how);
    const Node& c = nodes_[callable];
    if (c.kind != nk::global)
      fail(errors::pk_bad_operand, std::string(how == object_build::newobj ? "NEWOBJ" : "REDUCE") +
                                       " of something that is not a global (" + kind_name(c.kind) + ")");
    if (nodes_[args].kind != nk::tuple)
      fail(errors::pk_bad_operand, "arguments of " + global_name(c.index) + " are a " + kind_name(nodes_[args].kind) +
                                       ", not a tuple");
    const std::uint32_t g = c.index;
    const Rule* r = globals_[g].rule;
    if (r && r->k == Rule::kind::ordered_dict) {
      const std::uint32_t d = add_dict(true);
      // OrderedDict(iterable of pairs) also works; torch.save always passes ().
      const auto a = seq(nodes_[args].index);
      if (!a.empty()) {
        if (a.size() != 1 || (nodes_[a[0]].kind != nk::list && nodes_[a[0]].kind != nk::tuple))
          fail(errors::pk_bad_call, global_name(g) + " called with arguments statedict does not interpret");
        for (std::uint32_t pair : seq(nodes_[a[0]].index)) {
          if (nodes_[pair].kind != nk::tuple || seq(nodes_[pair].index).size() != 2)
            fail(errors::pk_bad_call, global_name(g) + " item is not a (key, value) pair");
          const auto kv = seq(nodes_[pair].index);
          dicts_[nodes_[d].index].kv.push_back(kv[0]);
          dicts_[nodes_[d].index].kv.push_back(kv[1]);
          counted(kv[0]);  // now in the dict and in the pair
          counted(kv[1]);
        }
      }
      return d;
    }
    if (r && r->k == Rule::kind::reconstructor) {
      // copyreg._reconstructor(cls, builtins.object, None): what protocols 0 and 1 write for an
      // object protocol 2 writes as NEWOBJ(cls, ()); its BUILD follows. Other forms stay objects.
      const auto a = seq(nodes_[args].index);
      if (a.size() == 3 && nodes_[a[0]].kind == nk::global && nodes_[a[1]].kind == nk::global &&
          global_name(nodes_[a[1]].index) == "builtins.object" && nodes_[a[2]].kind == nk::none)
        return add_object(nodes_[a[0]].index, object_build::newobj, npos);
      return add_object(g, how, args);
    }
    if (r && r->k == Rule::kind::function) {
      Global& gl = globals_[g];
      if (!gl.callee)  // made once per global (torch.save calls _rebuild_tensor_v2 once per tensor)
        gl.callee = std::make_unique<const Object>(Object{gl.module, gl.name, object_build::global, {}, {}, {}});
      const Object& callee = *gl.callee;  // on the heap: stays put when globals_ grows during the call
      try {
        if (r->fast)
          if (std::optional<Value> v = try_fast(r->fast, args)) return add_leaf(std::move(*v));
        Value av = to_value(args, 0, nullptr);
        List arg_list = std::move(av.as_list());
        Call call{callee, arg_list, *this};
        return add_leaf(r->fn(call));
      } catch (error& e) {
        if (e.context().rfind("pickle offset", 0) != 0) e.add_context("pickle offset " + std::to_string(op_pos_));
        throw;
      }
    }
    return add_object(g, how, args);
  }

  /// Python pickles a nested class (`ShardedTensor.ProcessGroupState`) as `getattr(Outer, "Inner")`
  /// and then calls the result. When opaque objects are kept, that result stands for the global
  /// `module.Outer.Inner` (resolved and checked like any other global); anything else is refused.
  std::uint32_t nested_class(std::uint32_t callable, object_build how) {
    const ObjData& o = objects_[nodes_[callable].index];
    const auto& gname = globals_[o.global];
    const bool is_getattr = (gname.module == "builtins" || gname.module == "__builtin__") && gname.name == "getattr";
    if (!opts_.keep_unknown_objects || !is_getattr || o.args == npos || !o.state.empty() || !o.items.empty())
      return callable;
    const auto a = seq(nodes_[o.args].index);
    if (a.size() != 2 || nodes_[a[0]].kind != nk::global || nodes_[a[1]].kind != nk::str) return callable;
    const auto& outer = globals_[nodes_[a[0]].index];
    const std::string inner(view(nodes_[a[1]].u.off, nodes_[a[1]].index));
    if (inner.empty() || inner.find_first_of(". ") != std::string::npos)
      fail(errors::pk_bad_operand, std::string(how == object_build::newobj ? "NEWOBJ" : "REDUCE") +
                                       " of getattr(" + outer.module + "." + outer.name + ", " + quote(inner) +
                                       "): not a nested class name");
    const std::string module = outer.module;
    const std::string name = outer.name + "." + inner;
    return resolve_global(module, name);
  }

  static std::string kind_name(nk k) {
    switch (k) {
      case nk::none: return "None";
      case nk::boolean: return "bool";
      case nk::integer: return "int";
      case nk::floating: return "float";
      case nk::str: return "str";
      case nk::bytes: return "bytes";
      case nk::leaf: return "value";
      case nk::list: return "list";
      case nk::tuple: return "tuple";
      case nk::dict: return "dict";
      case nk::object: return "object";
      case nk::global: return "global";
      case nk::handle: return "value";  // what it stands for: errors read as when it is one
      case nk::bytearray: return "bytearray";
    }
    return "?";
  }

  void append_to(std::uint32_t target, std::span<const std::uint32_t> items, const char* op) {
    Node& t = nodes_[target];
    if (t.kind == nk::list) {
      seq_append(t.index, items);
    } else if (t.kind == nk::object) {
      auto& v = objects_[t.index].items;
      v.insert(v.end(), items.begin(), items.end());
    } else {
      fail(errors::pk_bad_operand, std::string(op) + " to a " + kind_name(t.kind) + ", not a list");
    }
  }

  void setitems_on(std::uint32_t target, std::span<const std::uint32_t> kv, const char* op) {
    if (kv.size() % 2) fail(errors::pk_bad_operand, std::string(op) + " with an odd number of items");
    Node& t = nodes_[target];
    if (t.kind == nk::dict) {
      auto& v = dicts_[t.index].kv;
      v.insert(v.end(), kv.begin(), kv.end());
    } else if (t.kind == nk::object) {
      for (std::size_t i = 0; i < kv.size(); i += 2) {
        const std::uint32_t pair = add_seq(nk::tuple, {kv[i], kv[i + 1]});
        objects_[nodes_[target].index].items.push_back(pair);
      }
    } else {
      fail(errors::pk_bad_operand, std::string(op) + " on a " + kind_name(t.kind) + ", not a dict");
    }
  }

  void build(std::uint32_t target, std::uint32_t state) {
    Node& t = nodes_[target];
    if (t.kind == nk::dict) {
      if (!dicts_[t.index].ordered)
        fail(errors::pk_bad_operand, "BUILD on a plain dict (only OrderedDict subclasses carry attributes)");
      if (nodes_[state].kind == nk::none) return;
      dicts_[t.index].state.push_back(state);
    } else if (t.kind == nk::object) {
      // A set (EMPTY_SET, FROZENSET) has no __dict__ and no __setstate__: Python refuses the BUILD.
      const auto& g = globals_[objects_[t.index].global];
      if (g.module == "builtins" && (g.name == "set" || g.name == "frozenset"))
        fail(errors::pk_bad_operand, "BUILD on a " + g.name + " (allowed on OrderedDict and kept objects)");
      if (g.rule && g.rule->build && objects_[t.index].state.empty() && objects_[t.index].items.empty())
        if (std::optional<Value> v = built(target, state)) {
          // The object becomes that value wherever it is referenced (the memo holds this node).
          const std::uint32_t leaf = add_leaf(std::move(*v));
          nodes_[target].kind = nk::leaf;
          nodes_[target].index = nodes_[leaf].index;
          return;
        }
      objects_[t.index].state.push_back(state);
    } else {
      fail(errors::pk_bad_operand, "BUILD on a " + kind_name(t.kind) + " (allowed on OrderedDict and kept objects)");
    }
  }

  std::uint32_t persistent(std::uint32_t pid) {
    if (!opts_.persistent_load)
      fail(errors::pk_no_persistent_load, "persistent id (BINPERSID) in a pickle read without a persistent_load "
                                          "(torch storages are resolved by io/torch_file.hpp)");
    std::optional<Value> fast;
    try {
      if (opts_.persistent_handle && nodes_[pid].kind == nk::tuple)
        if (const std::optional<std::uint64_t> h = try_handle(pid)) {
          Node n;
          n.kind = nk::handle;
          n.u.i = static_cast<std::int64_t>(*h);
          return add_node(n);
        }
      if (opts_.persistent_fast && nodes_[pid].kind == nk::tuple) fast = try_fast(opts_.persistent_fast, pid);
    } catch (error& e) {
      e.add_context("pickle offset " + std::to_string(op_pos_));
      throw;
    }
    Value v = fast ? Value() : to_value(pid, 0, nullptr);
    try {
      return fast ? add_leaf(std::move(*fast)) : add_leaf(opts_.persistent_load(v));
    } catch (error& e) {
      e.add_context("pickle offset " + std::to_string(op_pos_));
      throw;
    }
  }

  Value to_value_leaf(std::uint32_t n) { return to_value(n, 0, nullptr); }

  /// Rule::build of the object at `target` with `state` (defined after Args).
  std::optional<Value> built(std::uint32_t target, std::uint32_t state);

  /// `f` over the items of tuple node `tuple` (defined after Args).
  std::optional<Value> try_fast(const fast_fn& f, std::uint32_t tuple);
  /// options::persistent_handle over the items of tuple node `tuple`.
  std::optional<std::uint64_t> try_handle(std::uint32_t tuple);

  // ------------------------------------------------------------------------------------------
  // Conversion of the graph into Values

  struct PathLink {
    const PathLink* parent;
    const Key* key;
    std::int64_t index;
  };
  static Path materialise(const PathLink* link) {
    Path p;
    for (; link; link = link->parent) p.push_back(link->key ? *link->key : Key(link->index));
    std::reverse(p.begin(), p.end());
    return p;
  }

  [[noreturn]] void depth_exceeded() {
    fail(errors::pk_depth_limit, "nesting exceeds limits.max_depth (" + std::to_string(opts_.limits.max_depth) + ")");
  }

  void count_node(std::uint64_t n = 1) {
    if ((produced_ += n) > opts_.limits.max_nodes)
      fail(errors::pk_node_limit, "result exceeds limits.max_nodes (" + std::to_string(opts_.limits.max_nodes) +
                                      " values); shared references are copied into the tree");
  }

  /// Converts node `n`. `path` is non-null where the node sits in the result tree proper (so dict
  /// attributes can be reported by path); inside objects and call arguments it is null and dicts
  /// with attributes become collections.OrderedDict objects instead.
  /// `sole`: only in the result's conversion, for a node that no other path reaches (its leaves
  /// are moved, not copied).
  Value to_value(std::uint32_t n, std::size_t depth, const PathLink* path, bool tracked = false, bool sole = false) {
    // One level of nesting costs a frame of this function and one of the container's: the other
    // cases have functions of their own, so that an unoptimised build (whose frames hold every
    // local of every case) does not run out of stack on input nested as deep as max_depth allows.
    count_node();
    if (visiting_.size() < nodes_.size()) visiting_.resize(nodes_.size(), 0);
    const nk kind = nodes_[n].kind;
    if (kind != nk::list && kind != nk::tuple && kind != nk::dict && kind != nk::object) return leaf_value(nodes_[n], depth, sole);
    if (depth >= opts_.limits.max_depth) depth_exceeded();
    if (visiting_[n]) contains_itself();
    visiting_[n] = 1;
    const std::uint32_t index = nodes_[n].index;
    Value out = kind == nk::dict     ? dict_value(index, depth, path, tracked, sole)
                : kind == nk::object ? object_value(index, depth, sole)
                                     : seq_value(kind == nk::list, index, depth, path, tracked, sole);
    visiting_[n] = 0;
    return out;
  }

  [[noreturn]] void contains_itself() { fail(errors::pk_recursive, "the pickle contains a container that contains itself"); }

  /// A node that holds no other node of the graph (a leaf may hold a tree built while parsing).
  Value leaf_value(const Node node, std::size_t depth, bool sole) {
    switch (node.kind) {
      case nk::none: return Value();
      case nk::boolean: return Value(node.u.i != 0);
      case nk::integer: return Value(node.u.i);
      case nk::floating: return Value(node.u.d);
      case nk::str: return Value(std::string(view(node.u.off, node.index)));
      case nk::bytes: {
        const std::string_view v = view(node.u.off, node.index);
        Bytes b;
        b.data.assign(reinterpret_cast<const std::uint8_t*>(v.data()), reinterpret_cast<const std::uint8_t*>(v.data()) + v.size());
        return Value(std::move(b));
      }
      case nk::bytearray: {
        // Counted as the leaf it used to be: two values, one level of container at `depth`.
        if (depth >= opts_.limits.max_depth) depth_exceeded();
        count_node();
        const std::string_view v = view(node.u.off, node.index);
        Object o{"builtins", "bytearray", object_build::reduce, {}, {}, {}};
        o.args.emplace_back(Bytes{std::vector<std::uint8_t>(reinterpret_cast<const std::uint8_t*>(v.data()),
                                                            reinterpret_cast<const std::uint8_t*>(v.data()) + v.size())});
        return Value(std::move(o));
      }
      case nk::leaf: {
        const LeafShape& ls = leaf_shape_[node.index];
        // Containers inside the leaf sit at depth + 0 .. depth + height - 2.
        if (ls.height > 1 && depth + ls.height - 2 >= opts_.limits.max_depth) depth_exceeded();
        count_node(ls.values - 1);
        if (sole) return std::move(leaves_[node.index]);
        return leaves_[node.index];
      }
      case nk::global: return Value(Object{globals_[node.index].module, globals_[node.index].name, object_build::global, {}, {}, {}});
      case nk::handle: {
        if (!opts_.handle_value) fail(errors::pk_no_persistent_load, "a persistent id became a handle, and no handle_value turns it into a value");
        Value v = opts_.handle_value(static_cast<std::uint64_t>(node.u.i));
        const LeafShape ls = leaf_shape(v);  // counted as a leaf is
        if (ls.height > 1 && depth + ls.height - 2 >= opts_.limits.max_depth) depth_exceeded();
        count_node(ls.values - 1);
        return v;
      }
      default: return Value();  // containers: to_value's
    }
  }

  Value seq_value(bool is_list, std::uint32_t si, std::size_t depth, const PathLink* path, bool tracked, bool sole) {
    const auto items = seq(si);
    List l;
    l.reserve(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      PathLink link{path, nullptr, static_cast<std::int64_t>(i)};
      l.push_back(to_value(items[i], depth + 1, path || tracked ? &link : nullptr, path || tracked, sole_child(sole, items[i])));
    }
    return is_list ? Value::list(std::move(l)) : Value::tuple(std::move(l));
  }

  Value object_value(std::uint32_t oi, std::size_t depth, bool sole) {
    const ObjData& od = objects_[oi];
    Object o{globals_[od.global].module, globals_[od.global].name, od.how, {}, {}, {}};
    if (od.args != npos) {
      Value a = to_value(od.args, depth + 1, nullptr, false, sole_child(sole, od.args));
      o.args = std::move(a.as_list());
    }
    for (std::uint32_t s : od.state) o.state.push_back(to_value(s, depth + 1, nullptr, false, sole_child(sole, s)));
    for (std::uint32_t it : od.items) o.items.push_back(to_value(it, depth + 1, nullptr, false, sole_child(sole, it)));
    return Value(std::move(o));
  }

  /// The distinct int/str keys of dict `d` (pairs of d.kv): `firsts` the pair of each key's first
  /// place, in order; `value_of` the pair that sets each one's value (its last). Keys are compared
  /// as the input holds them (an int never equals a str), through a table of pair indices.
  void distinct_keys(const DictData& d, std::vector<std::uint32_t>& firsts, std::vector<std::uint32_t>& value_of) const {
    const std::size_t n = d.kv.size() / 2;
    firsts.reserve(n);
    value_of.reserve(n);
    auto key = [&](std::size_t p) -> const Node& { return nodes_[d.kv[2 * p]]; };
    auto same = [&](const Node& a, const Node& b) {
      if (a.kind != b.kind) return false;
      if (a.kind == nk::integer) return a.u.i == b.u.i;
      return view(a.u.off, a.index) == view(b.u.off, b.index);
    };
    auto hash = [&](const Node& k) -> std::size_t {
      if (k.kind == nk::integer) {
        std::uint64_t x = static_cast<std::uint64_t>(k.u.i) + 0x9E3779B97F4A7C15ULL;  // splitmix64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
        return static_cast<std::size_t>(x ^ (x >> 31));
      }
      return std::hash<std::string_view>{}(view(k.u.off, k.index));
    };
    std::size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    std::vector<std::uint32_t> slots(n > 8 ? cap : 0, npos);  // distinct key index, by hash
    for (std::size_t p = 0; p < n; ++p) {
      const Node& k = key(p);
      std::uint32_t found = npos;
      if (slots.empty()) {
        for (std::uint32_t j = 0; j < firsts.size() && found == npos; ++j)
          if (same(key(firsts[j]), k)) found = j;
      } else {
        std::size_t s = hash(k) & (cap - 1);
        for (; slots[s] != npos; s = (s + 1) & (cap - 1))
          if (same(key(firsts[slots[s]]), k)) {
            found = slots[s];
            break;
          }
        if (found == npos) slots[s] = static_cast<std::uint32_t>(firsts.size());
      }
      if (found == npos) {
        firsts.push_back(static_cast<std::uint32_t>(p));
        value_of.push_back(static_cast<std::uint32_t>(p));
      } else {
        value_of[found] = static_cast<std::uint32_t>(p);
      }
    }
  }

  Value dict_value(std::uint32_t di, std::size_t depth, const PathLink* path, bool tracked, bool sole) {
    const DictData& d = dicts_[di];
    bool plain_keys = true;
    for (std::size_t i = 0; i < d.kv.size(); i += 2) {
      const nk k = nodes_[d.kv[i]].kind;
      if (k != nk::integer && k != nk::str) {
        plain_keys = false;
        break;
      }
    }
    // Attributes are reported by path when every state is a dict of str keys.
    bool attrs_ok = tracked && plain_keys;
    for (std::uint32_t s : d.state) {
      const Node& sn = nodes_[s];
      if (sn.kind != nk::dict) {
        attrs_ok = false;
        continue;
      }
      for (std::size_t i = 0; i < dicts_[sn.index].kv.size(); i += 2)
        if (nodes_[dicts_[sn.index].kv[i]].kind != nk::str) attrs_ok = false;
    }
    // The states are converted first: attributes that hold a tensor or a storage are not plain
    // data (state_dict()._metadata is), and such a dict stays an OrderedDict object, states and all.
    std::vector<Value> states;
    states.reserve(d.state.size());
    for (std::uint32_t s : d.state) states.push_back(to_value(s, depth + 1, nullptr, false, sole_child(sole, s)));
    if (attrs_ok)
      for (const Value& sv : states) attrs_ok = attrs_ok && !holds_tensor(sv);
    if (plain_keys && (d.state.empty() || attrs_ok)) return plain_dict_value(d, states, path, depth, tracked, sole);
    return dict_object_value(d, states, depth, sole);
  }

  /// A dict with int/str keys (and attributes, if any, reported by path): a Dict.
  Value plain_dict_value(const DictData& d, std::vector<Value>& states, const PathLink* path, std::size_t depth, bool tracked,
                         bool sole) {
    // Reported in pre-order (a dict before the dicts inside it), as the writer visits them.
    const std::size_t slot = d.state.empty() ? 0 : open_attributes(path);
    // A key set twice keeps its first place and its last value, as in Python; only that value
    // is converted (a replaced dict must not leave its attributes behind in the result).
    std::vector<std::uint32_t> value_of;
    Dict out = dict_keys(d, value_of);
    std::size_t j = 0;
    for (auto& [key, v] : out) {
      const std::uint32_t value_node = d.kv[2 * std::size_t{value_of[j++]} + 1];
      PathLink link{path, &key, 0};
      v = to_value(value_node, depth + 1, tracked ? &link : nullptr, tracked, sole_child(sole, value_node));
    }
    if (!d.state.empty()) close_attributes(slot, states);
    return Value(std::move(out));
  }

  std::size_t open_attributes(const PathLink* path) {
    attributes_.push_back(Attributes{materialise(path), Dict{}});
    return attributes_.size() - 1;
  }
  void close_attributes(std::size_t slot, std::vector<Value>& states) {
    Dict attrs;
    for (Value& sv : states)
      for (auto& [k, v] : sv.as_dict()) attrs.set(k, std::move(v));
    attributes_[slot].attributes = std::move(attrs);
  }

  /// The distinct keys of `d` in their first places, each with a None value; `value_of` the pair
  /// that sets each one's value.
  Dict dict_keys(const DictData& d, std::vector<std::uint32_t>& value_of) {
    std::vector<std::uint32_t> firsts;
    distinct_keys(d, firsts, value_of);
    count_node(d.kv.size() / 2);
    Dict out;
    out.reserve(firsts.size());
    for (std::uint32_t p : firsts) {
      const Node& kn = nodes_[d.kv[2 * std::size_t{p}]];
      out.append_unchecked(kn.kind == nk::integer ? Key(kn.u.i) : Key(view(kn.u.off, kn.index)), Value());
    }
    return out;
  }

  /// Any other dict: a builtins.dict or collections.OrderedDict object of (key, value) items.
  Value dict_object_value(const DictData& d, std::vector<Value>& states, std::size_t depth, bool sole) {
    Object o{d.ordered ? "collections" : "builtins", d.ordered ? "OrderedDict" : "dict", object_build::reduce, {}, {}, {}};
    for (std::size_t i = 0; i < d.kv.size(); i += 2) {
      List pair;
      pair.push_back(to_value(d.kv[i], depth + 1, nullptr, false, sole_child(sole, d.kv[i])));
      pair.push_back(to_value(d.kv[i + 1], depth + 1, nullptr, false, sole_child(sole, d.kv[i + 1])));
      o.items.push_back(Value::tuple(std::move(pair)));
    }
    o.state = std::move(states);
    return Value(std::move(o));
  }

  // ------------------------------------------------------------------------------------------

  const unsigned char* in_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
  std::uint64_t op_pos_ = 0;
  const options& opts_;
  const Registry* registry_;

  pod_buffer<Node> nodes_;  ///< capacity below npos: add_node checks for room only
  /// Values that stay put as more are added (no 160-byte moves on growth), in blocks of 256: a
  /// deque's blocks hold three Values each, one allocation per three tensors.
  class leaf_pool {
   public:
    [[nodiscard]] std::size_t size() const noexcept { return n_; }
    Value& operator[](std::size_t i) noexcept { return blocks_[i / block][i % block]; }
    const Value& operator[](std::size_t i) const noexcept { return blocks_[i / block][i % block]; }
    void push_back(Value&& v) {
      if (n_ % block == 0) blocks_.push_back(std::make_unique<Value[]>(block));
      blocks_.back()[n_ % block] = std::move(v);
      ++n_;
    }

   private:
    static constexpr std::size_t block = 256;
    std::vector<std::unique_ptr<Value[]>> blocks_;
    std::size_t n_ = 0;
  };
  leaf_pool leaves_;
  std::vector<LeafShape> leaf_shape_;
  std::vector<std::pair<const Value*, std::uint64_t>> walk_stack_;  ///< each_value's stack
  struct SeqData {
    std::size_t off;    ///< first item in seq_pool_
    std::uint32_t len;  ///< items
    std::uint32_t cap;  ///< room at off (a list grows in place while it lasts)
  };
  std::vector<SeqData> seqs_;            ///< lists and tuples: their items live in seq_pool_
  std::vector<std::uint32_t> seq_pool_;  ///< one allocation for the items of every list and tuple
  std::vector<std::uint32_t> mark_items_;  ///< what pop_mark returned last
  std::vector<DictData> dicts_;
  std::vector<ObjData> objects_;
  struct Global {
    std::string module;
    std::string name;
    const Rule* rule;                      ///< found once, when the global was resolved (null: not on the list)
    std::unique_ptr<const Object> callee;  ///< the Object a Call names, made on the first call
  };
  std::vector<Global> globals_;
  /// The unpickling stack: node ids. Its capacity never exceeds limits.max_stack, so that push
  /// checks one thing (room).
  pod_buffer<std::uint32_t> stack_;
  std::vector<std::size_t> marks_;
  std::size_t floor_ = 0;  ///< where the items since the last MARK start (0 without a MARK)
  std::vector<std::uint32_t> memo_;
  std::unordered_map<std::uint64_t, std::uint32_t> memo_far_;
  std::uint64_t memo_count_ = 0;
  std::vector<unsigned char> visiting_;
  std::uint64_t produced_ = 0;
  std::vector<Attributes> attributes_;
  std::string text_pool_;  ///< decoded protocol-0 text; nodes address it past the input (view())
};

}  // namespace statedict::inline v0::pickle

// Args and the opcode loop, which need the whole Reader.
#include "pickle_opcodes.hpp"
