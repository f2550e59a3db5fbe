// statedict: the flattener, a single iterative walk of a Value tree that lists its tensors by name
// and records everything else in a skeleton_tape (core/flatten.hpp is its public face).
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../flat_state_dict.hpp"
#include "../hash_index.hpp"
#include "../skeleton.hpp"
#include "../tensor.hpp"
#include "../value.hpp"
#include "../visit.hpp"
#include "naming.hpp"
#include "skeleton_tape.hpp"

namespace statedict::inline v0::detail {

// ------------------------------------------------------------------------------------------------
// flatten

/// flatten's current dotted path: appends and truncations inline (std::string's are calls, and
/// a walk makes several per node).
class path_buffer {
 public:
  [[nodiscard]] std::size_t size() const noexcept { return len_; }
  [[nodiscard]] std::string_view view() const noexcept { return {buf_.get(), len_}; }
  void truncate(std::size_t n) noexcept { len_ = std::min(n, len_); }
  void push(char c) {
    room(1);
    buf_[len_++] = c;
  }
  void append(std::string_view s) {
    if (s.empty()) return;
    room(s.size());
    std::memcpy(buf_.get() + len_, s.data(), s.size());
    len_ += s.size();
  }
  void append_int(std::int64_t v) {
    room(20);  // "-9223372036854775808"
    const auto r = std::to_chars(buf_.get() + len_, buf_.get() + len_ + 20, v);
    len_ = static_cast<std::size_t>(r.ptr - buf_.get());
  }

 private:
  void room(std::size_t more) {
    if (more <= cap_ - len_) return;
    const std::size_t cap = std::max({len_ + more, 2 * cap_, std::size_t{256}});
    auto b = std::make_unique_for_overwrite<char[]>(cap);
    if (len_) std::memcpy(b.get(), buf_.get(), len_);
    buf_ = std::move(b);
    cap_ = cap;
  }
  std::unique_ptr<char[]> buf_;
  std::size_t len_ = 0, cap_ = 0;
};

class flattener {
 public:
  FlatStateDict run(const Value& root) {
    auto tape = std::make_shared<skeleton_tape>();
    tape_ = tape.get();
    walk(root);
    decide();
    const std::size_t n = leaves_.size();
    std::vector<std::string> quoted;  // computed only when dotted names collide
    auto names = assign_names(
        n, [&](std::size_t i) { return dotted(i); }, {},
        [&](std::size_t i) -> const std::string& {
          if (quoted.empty())
            visit(root, [&](const Path& p, const Value& v) {
              if (v.is_tensor()) quoted.push_back(quoted_name(p));
            });
          return quoted[i];
        },
        is_ascii(arena_));
    FlatStateDict out;
    std::size_t ntensors = 0, room = dims_;  // dims_ counts every leaf's shape; views add strides
    for (std::size_t i = 0; i < n; ++i) {
      ntensors += kind_[i] == leaf_kind::tensor;
      if (kind_[i] == leaf_kind::view) room += leaves_[i].view->rank();
    }
    out.tensors.reserve(ntensors);
    tape->leaves.resize(n);
    tape->dims.resize(room);
    dim_t* dims = tape->dims.data();
    std::size_t at = 0;
    auto put = [&](const shape_t& d) { at = static_cast<std::size_t>(std::copy(d.begin(), d.end(), dims + at) - dims); };
    // Without renamed leaves the tensor names are the dotted names: the arena, copied once.
    const std::uint64_t arena_at = tape->pool.size();
    if (!names) tape->pool += arena_;
    else tape->pool.reserve(tape->pool.size() + arena_.size());
    for (std::size_t i = 0; i < n; ++i) {
      const TensorView& v = *leaves_[i].view;
      skeleton_tape::leaf& l = tape->leaves[i];
      l.dtype = v.dtype();
      l.rank = static_cast<std::uint32_t>(v.shape().size());
      l.dims = at;
      switch (kind_[i]) {
        case leaf_kind::tensor: {
          std::string nm = names ? std::move((*names)[i]) : std::string(dotted(i));
          l.kind = snode::tensor;
          l.name = names ? tape->add_str(nm) : arena_at + name_start_[i];
          l.name_len = nm.size();
          put(v.shape());
          out.tensors.emplace_back(std::move(nm), v);
          break;
        }
        case leaf_kind::alias:
          l.kind = snode::alias;
          l.target = target_[i];
          break;
        case leaf_kind::view:
          l.kind = snode::view;
          l.target = target_[i];
          l.offset = offset_[i];
          put(v.shape());
          put(v.strides());
          break;
      }
    }
    tape->dims.resize(at);
    out.skeleton = Skeleton(std::shared_ptr<const skeleton_tape>(std::move(tape)));
    return out;
  }

 private:
  enum class leaf_kind : std::uint8_t { tensor, alias, view };
  struct leaf {
    const TensorView* view;
  };
  struct frame {
    const Value* node;
    std::size_t next;
    std::size_t size;
    std::size_t prefix_len;
    bool root;
  };

  skeleton_tape* tape_ = nullptr;
  std::vector<leaf> leaves_;
  std::string arena_;                    // the dotted names of all leaves, back to back
  std::vector<std::size_t> name_start_;  // leaf i's name is arena_[name_start_[i], name_start_[i + 1])
  std::vector<leaf_kind> kind_;
  std::vector<std::uint32_t> target_;
  std::vector<dim_t> offset_;
  std::vector<std::uint32_t> rank_;
  std::size_t dims_ = 0;              // room the tape's dims need
  std::vector<std::uintptr_t> end_;  // leaf i's bytes end at end_[i] (extent 0: its start)
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> by_start_;  // (start, leaf) of leaves with bytes
  path_buffer prefix_;

  [[nodiscard]] std::string_view dotted(std::size_t i) const {
    return std::string_view(arena_).substr(name_start_[i], name_start_[i + 1] - name_start_[i]);
  }

  void node(snode k, std::uint64_t a = 0, std::uint32_t b = 0, std::uint8_t flag = 0) { tape_->nodes.push_back({a, b, k, flag}); }
  void string_node(snode k, std::string_view s) {
    const auto [a, b] = tape_->add_string_node(s);
    node(k, a, b);
  }

  /// Writes the tape node(s) of a value; for a container, sets up its frame. Returns true for a
  /// container with children.
  bool emit(const Value& v, frame& f) {
    switch (v.kind()) {
      case value_kind::none: node(snode::none); return false;
      case value_kind::boolean: node(snode::boolean, 0, 0, v.as_bool() ? 1 : 0); return false;
      case value_kind::integer: node(snode::integer, static_cast<std::uint64_t>(v.as_int())); return false;
      case value_kind::floating: node(snode::floating, std::bit_cast<std::uint64_t>(v.as_double())); return false;
      case value_kind::string: string_node(snode::string, v.as_string()); return false;
      case value_kind::bytes: {
        const auto& b = v.as_bytes().data;
        string_node(snode::bytes, std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
        return false;
      }
      case value_kind::tensor: {
        const TensorView& t = v.as_tensor();
        const auto li = static_cast<std::uint32_t>(leaves_.size());
        node(snode::tensor, li);
        leaves_.push_back({&t});
        // decide() reads the byte ranges from here rather than from the tree, in address order.
        const std::uint64_t extent = t.extent_bytes();
        dims_ += t.rank();  // a tensor node's shape (views, which are rare, add their strides)
        end_.push_back(start_of(t) + extent);
        if (extent != 0) by_start_.emplace_back(start_of(t), li);
        if (name_start_.empty()) name_start_.push_back(0);
        arena_ += prefix_.view();
        name_start_.push_back(arena_.size());
        return false;
      }
      case value_kind::list:
      case value_kind::tuple: {
        const std::size_t n = v.as_list().size();
        node(v.is_list() ? snode::list : snode::tuple, n);
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
      case value_kind::dict: {
        const std::size_t n = v.as_dict().size();
        node(snode::dict, n);
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
      case value_kind::object: {
        const Object& o = v.as_object();
        if (o.state.size() >= UINT32_MAX)
          throw_error(errors::out_of_range, "an object with " + std::to_string(o.state.size()) + " state values (at most 2^32 - 2)");
        node(snode::object, o.args.size(), static_cast<std::uint32_t>(o.state.size()), static_cast<std::uint8_t>(o.how));
        node(snode::none, o.items.size());
        string_node(snode::string, o.module);
        string_node(snode::string, o.name);
        const std::size_t n = o.args.size() + o.state.size() + o.items.size();
        f = {&v, 0, n, prefix_.size(), false};
        return n != 0;
      }
    }
    return false;
  }

  void walk(const Value& root) {
    std::vector<frame> stack;
    frame f{};
    if (!emit(root, f)) return;
    f.root = true;
    // A state_dict is mostly one flat dict of tensors: room for that many leaves up front, so that
    // the per-leaf arrays are not copied as they grow (nested trees still grow geometrically).
    leaves_.reserve(f.size);
    end_.reserve(f.size);
    by_start_.reserve(f.size);
    name_start_.reserve(f.size + 1);
    tape_->nodes.reserve(tape_->nodes.size() + f.size + 1);
    stack.push_back(f);
    while (!stack.empty()) {
      frame& top = stack.back();
      if (top.next == top.size) {
        stack.pop_back();
        continue;
      }
      const std::size_t i = top.next++;
      prefix_.truncate(top.prefix_len);
      if (!top.root) prefix_.push('.');
      const Value* child = nullptr;
      switch (top.node->kind()) {
        case value_kind::list:
        case value_kind::tuple:
          child = &top.node->as_list()[i];
          prefix_.append_int(static_cast<std::int64_t>(i));
          break;
        case value_kind::dict: {
          const auto& item = top.node->as_dict().items()[i];
          child = &item.second;
          if (item.first.is_int()) {
            node(snode::integer, static_cast<std::uint64_t>(item.first.as_int()));
            prefix_.append_int(item.first.as_int());
          } else {
            string_node(snode::string, item.first.as_string());
            prefix_.append(item.first.as_string());
          }
          break;
        }
        default: {
          const Object& o = top.node->as_object();
          std::size_t j = i;
          if (j < o.args.size()) {
            child = &o.args[j];
            prefix_.append("args.");
            prefix_.append_int(static_cast<std::int64_t>(j));
            break;
          }
          j -= o.args.size();
          if (j < o.state.size()) {
            child = &o.state[j];
            prefix_.append("state");
            if (o.state.size() > 1) {
              prefix_.push('.');
              prefix_.append_int(static_cast<std::int64_t>(j));
            }
            break;
          }
          j -= o.state.size();
          child = &o.items[j];
          prefix_.append("items.");
          prefix_.append_int(static_cast<std::int64_t>(j));
          break;
        }
      }
      frame nf{};
      if (emit(*child, nf)) stack.push_back(nf);  // `top` is dangling from here on
    }
  }

  // ---- aliases and views (docs/flatten.md, "Aliases and views")

  static std::uintptr_t start_of(const TensorView& v) noexcept { return reinterpret_cast<std::uintptr_t>(v.data()); }

  static std::uint64_t signature(const TensorView& v) noexcept {
    std::uint64_t h = start_of(v) * 0x9e3779b97f4a7c15ULL ^ static_cast<std::uint64_t>(v.dtype());
    auto mix = [&](std::uint64_t x) { h = (h ^ x) * 0x100000001b3ULL + 0x7f4a7c15ULL; };
    for (dim_t d : v.shape()) mix(static_cast<std::uint64_t>(d));
    mix(0xffffULL);
    for (dim_t s : v.strides()) mix(static_cast<std::uint64_t>(s));
    return h;
  }

  void decide() {
    const std::size_t n = leaves_.size();
    kind_.assign(n, leaf_kind::tensor);
    target_.assign(n, 0);
    offset_.assign(n, 0);
    // Zero-element views are never aliased. The rest, sorted by start address, fall into clusters
    // of transitively overlapping byte ranges; only clusters of two or more need any work.
    std::vector<std::pair<std::uintptr_t, std::uint32_t>> order = std::move(by_start_);
    address_sort(order);
    std::size_t b = 0;
    while (b < order.size()) {
      std::uintptr_t max_end = end_[order[b].second];
      std::size_t e = b + 1;
      while (e < order.size() && order[e].first < max_end) {
        max_end = std::max(max_end, end_[order[e].second]);
        ++e;
      }
      if (e - b > 1) cluster(order, b, e);
      b = e;
    }
  }

  /// Makes leaf i a view of the tensor node behind leaf j (which contains it), when i starts a
  /// whole number of elements into that tensor node.
  bool try_view(std::uint32_t i, std::uint32_t j) {
    const std::uint32_t base = kind_[j] == leaf_kind::tensor ? j : target_[j];
    const std::uintptr_t off = start_of(*leaves_[i].view) - start_of(*leaves_[base].view);
    if (off % leaves_[i].view->itemsize() != 0) return false;
    kind_[i] = leaf_kind::view;
    target_[i] = base;
    offset_[i] = static_cast<dim_t>(off / leaves_[i].view->itemsize());
    return true;
  }

  /// Decides aliases and views inside one cluster `order[b, e)` (sorted by start address),
  /// visiting its leaves in pre-order. A prefix-maximum Fenwick tree per dtype over the address
  /// ranks answers "which earlier contiguous leaf with start <= p reaches furthest?" in O(log n).
  void cluster(const std::vector<std::pair<std::uintptr_t, std::uint32_t>>& order, std::size_t b, std::size_t e) {
    const std::size_t k = e - b;
    if (rank_.size() != leaves_.size()) rank_.assign(leaves_.size(), 0);
    std::vector<std::uintptr_t> starts(k);
    std::vector<std::uint32_t> by_index(k);
    for (std::size_t j = 0; j < k; ++j) {
      starts[j] = order[b + j].first;
      by_index[j] = order[b + j].second;
      rank_[order[b + j].second] = static_cast<std::uint32_t>(j);
    }
    std::sort(by_index.begin(), by_index.end());
    using entry = std::pair<std::uintptr_t, std::uint32_t>;  // (end, leaf)
    std::array<std::vector<entry>, dtype_count> fenwick;
    std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> same;  // signature -> tensor leaves
    for (std::uint32_t i : by_index) {
      const TensorView& v = *leaves_[i].view;
      const std::uintptr_t start = start_of(v);
      const std::uintptr_t end = start + v.extent_bytes();
      auto& bucket = same[signature(v)];
      bool done = false;
      for (std::uint32_t t : bucket)
        if (same_view(v, *leaves_[t].view)) {
          kind_[i] = leaf_kind::alias;
          target_[i] = t;
          done = true;
          break;
        }
      if (done) continue;  // its range is already in the tree when it is contiguous
      auto& fw = fenwick[static_cast<std::size_t>(v.dtype())];
      if (!fw.empty()) {
        std::size_t p = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), start) - starts.begin());
        entry best{0, 0};
        for (; p > 0; p &= p - 1) best = std::max(best, fw[p]);
        if (best.first >= end && best.first != 0) {
          // `best` contains this view, and so does the tensor node behind it. When the view is
          // not a whole number of elements from that base (same-dtype views at odd byte offsets,
          // which PyTorch never makes), look for any earlier container it is aligned with.
          if (!try_view(i, best.second))
            for (std::uint32_t j : by_index) {
              if (j >= i) break;
              const TensorView& w = *leaves_[j].view;
              if (w.dtype() == v.dtype() && w.is_contiguous() && start_of(w) <= start &&
                  start_of(w) + w.extent_bytes() >= end && try_view(i, j))
                break;
            }
        }
      }
      if (kind_[i] == leaf_kind::tensor) bucket.push_back(i);
      if (v.is_contiguous()) {
        if (fw.empty()) fw.assign(k + 1, entry{0, 0});
        for (std::size_t p = rank_[i] + 1; p <= k; p += p & (~p + 1)) fw[p] = std::max(fw[p], entry{end, i});
      }
    }
  }
};

}  // namespace statedict::inline v0::detail
