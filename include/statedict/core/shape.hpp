// statedict: shapes, strides and checked arithmetic.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "error.hpp"

namespace statedict::inline v0 {

/// Sizes and strides are signed 64-bit, as in PyTorch. Strides count elements, not bytes.
using dim_t = std::int64_t;

/// A vector of dims that keeps up to `inline_capacity` of them in place (as PyTorch keeps sizes
/// and strides): nearly every tensor has rank <= 5, and a view is copied often (into a Value, a
/// flattened map, a plan), so two heap blocks per copy were a large share of all allocations when
/// reading a checkpoint of many small tensors. Higher ranks go on the heap. The interface is the
/// part of std::vector's that shapes use, and it is a contiguous range (converts to std::span).
class shape_t {
 public:
  static constexpr std::size_t inline_capacity = 5;
  using value_type = dim_t;
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;
  using reference = dim_t&;
  using const_reference = const dim_t&;
  using pointer = dim_t*;
  using const_pointer = const dim_t*;
  using iterator = dim_t*;
  using const_iterator = const dim_t*;

  shape_t() noexcept : inline_{} {}
  explicit shape_t(size_type n, dim_t v = 0) : shape_t() { assign(n, v); }
  shape_t(std::initializer_list<dim_t> l) : shape_t() { assign(l.begin(), l.end()); }
  template <class It, class = std::enable_if_t<!std::is_integral_v<It>>>
  shape_t(It first, It last) : shape_t() {
    assign(first, last);
  }
  /// From any contiguous run of dims (a std::vector<dim_t>, a span).
  explicit shape_t(std::span<const dim_t> s) : shape_t() { assign(s.begin(), s.end()); }
  // Copies and moves write the whole inline buffer (or the heap pointer) without zeroing it first;
  // the rare heap copy is out of line, so the common one needs no saved registers.
  shape_t(const shape_t& o) {
    if (o.size_ <= inline_capacity) [[likely]] {  // a fixed-size copy, no loop
      std::memcpy(inline_, o.data(), sizeof inline_);  // within o's buffer: a heap one is larger
      size_ = o.size_;
    } else {
      copy_long(o);
    }
  }
  shape_t(shape_t&& o) noexcept { steal(o); }
  shape_t& operator=(const shape_t& o) {
    if (this != &o) assign(o.begin(), o.end());
    return *this;
  }
  shape_t& operator=(shape_t&& o) noexcept {
    if (this != &o) {
      release();
      steal(o);
    }
    return *this;
  }
  shape_t& operator=(std::initializer_list<dim_t> l) {
    assign(l.begin(), l.end());
    return *this;
  }
  ~shape_t() { release(); }

  [[nodiscard]] dim_t* data() noexcept { return on_heap() ? heap_ : inline_; }
  [[nodiscard]] const dim_t* data() const noexcept { return on_heap() ? heap_ : inline_; }
  [[nodiscard]] size_type size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] size_type capacity() const noexcept { return cap_; }
  [[nodiscard]] iterator begin() noexcept { return data(); }
  [[nodiscard]] iterator end() noexcept { return data() + size_; }
  [[nodiscard]] const_iterator begin() const noexcept { return data(); }
  [[nodiscard]] const_iterator end() const noexcept { return data() + size_; }
  [[nodiscard]] const_iterator cbegin() const noexcept { return begin(); }
  [[nodiscard]] const_iterator cend() const noexcept { return end(); }
  [[nodiscard]] dim_t& operator[](size_type i) noexcept { return data()[i]; }
  [[nodiscard]] const dim_t& operator[](size_type i) const noexcept { return data()[i]; }
  [[nodiscard]] dim_t& front() noexcept { return data()[0]; }
  [[nodiscard]] const dim_t& front() const noexcept { return data()[0]; }
  [[nodiscard]] dim_t& back() noexcept { return data()[size_ - 1]; }
  [[nodiscard]] const dim_t& back() const noexcept { return data()[size_ - 1]; }

  void reserve(size_type n) {
    if (n <= cap_) return;
    if (n > std::numeric_limits<std::uint32_t>::max()) throw std::length_error("statedict::shape_t: too many dims");
    auto* p = new dim_t[n];
    std::copy(begin(), end(), p);
    const std::uint32_t keep = size_;
    release();
    heap_ = p;
    cap_ = static_cast<std::uint32_t>(n);
    size_ = keep;
  }
  void clear() noexcept { size_ = 0; }
  void resize(size_type n, dim_t v = 0) {
    if (n > size_) {
      if (n > cap_) reserve(grown(n));
      std::fill(data() + size_, data() + n, v);
    }
    size_ = static_cast<std::uint32_t>(n);
  }
  void assign(size_type n, dim_t v) {
    clear();
    resize(n, v);
  }
  template <class It>
  void assign(It first, It last) {
    clear();
    if constexpr (std::is_base_of_v<std::forward_iterator_tag, typename std::iterator_traits<It>::iterator_category>) {
      reserve(static_cast<size_type>(std::distance(first, last)));
      dim_t* out = data();
      for (; first != last; ++first) *out++ = static_cast<dim_t>(*first);
      size_ = static_cast<std::uint32_t>(out - data());
    } else {
      for (; first != last; ++first) push_back(static_cast<dim_t>(*first));
    }
  }
  void push_back(dim_t v) {
    if (size_ == cap_) reserve(grown(size_ + 1U));
    data()[size_++] = v;
  }
  dim_t& emplace_back(dim_t v) {
    push_back(v);
    return back();
  }
  void pop_back() noexcept { --size_; }
  iterator insert(const_iterator pos, dim_t v) {
    const auto at = static_cast<size_type>(pos - begin());
    push_back(v);
    std::rotate(begin() + at, end() - 1, end());
    return begin() + at;
  }
  /// Unlike std::vector's, [first, last) must not point into this shape (it may move while growing).
  template <class It, class = std::enable_if_t<!std::is_integral_v<It>>>
  iterator insert(const_iterator pos, It first, It last) {
    const auto at = static_cast<size_type>(pos - begin());
    const size_type old = size_;
    for (; first != last; ++first) push_back(static_cast<dim_t>(*first));
    std::rotate(begin() + at, begin() + old, end());
    return begin() + at;
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const auto at = first - cbegin(), n = last - first;
    std::copy(begin() + at + n, end(), begin() + at);
    size_ -= static_cast<std::uint32_t>(n);
    return begin() + at;
  }
  void swap(shape_t& o) noexcept {
    shape_t t(std::move(o));
    o = std::move(*this);
    *this = std::move(t);
  }

  /// The same dims as a std::vector.
  [[nodiscard]] std::vector<dim_t> vec() const { return {begin(), end()}; }

  friend bool operator==(const shape_t& a, const shape_t& b) noexcept {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend auto operator<=>(const shape_t& a, const shape_t& b) noexcept {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }
  friend void swap(shape_t& a, shape_t& b) noexcept { a.swap(b); }

 private:
  [[nodiscard]] bool on_heap() const noexcept { return cap_ > inline_capacity; }
  [[nodiscard]] size_type grown(size_type need) const noexcept { return std::max<size_type>(need, 2U * cap_); }
  void release() noexcept {
    if (on_heap()) {
      delete[] heap_;
      inline_[0] = 0;  // the inline buffer is the active member again
    }
    size_ = 0;
    cap_ = inline_capacity;
  }
  [[gnu::noinline]] void copy_long(const shape_t& o) {
    std::fill(std::begin(inline_), std::end(inline_), 0);  // the inline buffer is the active member
    assign(o.begin(), o.end());
  }
  /// Takes o's dims (o is empty, with inline storage, afterwards); this must hold nothing.
  void steal(shape_t& o) noexcept {
    size_ = o.size_;
    if (o.on_heap()) {
      heap_ = o.heap_;
      cap_ = o.cap_;
      o.inline_[0] = 0;
      o.cap_ = inline_capacity;
    } else {  // the whole buffer, every slot of which is initialized: a fixed-size copy, no call
      std::memcpy(inline_, o.inline_, sizeof inline_);
    }
    o.size_ = 0;
  }

  std::uint32_t size_ = 0;
  std::uint32_t cap_ = inline_capacity;
  union {
    dim_t inline_[inline_capacity];
    dim_t* heap_;
  };
};

namespace detail {
// The throws of the checked helpers below, out of line so that the checks inline as a compare.
[[noreturn, gnu::cold, gnu::noinline]] inline void overflowed(std::uint64_t a, std::uint64_t b, std::string_view what, char op) {
  throw_error(errors::overflow, std::string(what) + " overflows 64 bits (" + std::to_string(a) + " " + op + " " +
                                    std::to_string(b) + ")");
}
}  // namespace detail

/// a * b, or throws errors::overflow naming `what`.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, std::string_view what = "size") {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]] detail::overflowed(a, b, what, '*');
  return r;
}

/// a + b, or throws errors::overflow naming `what`.
inline std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, std::string_view what = "size") {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]] detail::overflowed(a, b, what, '+');
  return r;
}

/// Largest element count or byte size statedict accepts: sizes must fit a signed 64-bit integer,
/// so pointer and offset arithmetic on them cannot overflow.
inline constexpr std::uint64_t max_size = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

/// "[2, 3, 4]"
inline std::string to_string(std::span<const dim_t> s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  out += ']';
  return out;
}

namespace detail {
[[noreturn, gnu::cold, gnu::noinline]] inline void negative_dim(std::span<const dim_t> shape, std::size_t i) {
  throw_error(errors::negative_dim, "dimension " + std::to_string(i) + " of shape " + to_string(shape) + " is negative");
}
[[noreturn, gnu::cold, gnu::noinline]] inline void too_large(std::string_view what, std::uint64_t n) {
  throw_error(errors::overflow, std::string(what) + " " + std::to_string(n) + " exceeds 2^63-1");
}
}  // namespace detail

/// Throws errors::negative_dim when a dimension is negative.
inline void check_shape(std::span<const dim_t> shape) {
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] < 0) [[unlikely]] detail::negative_dim(shape, i);
}

/// Number of elements (1 for a 0-d shape), checked: negative dims and totals beyond max_size throw.
inline std::uint64_t numel(std::span<const dim_t> shape) {
  check_shape(shape);
  std::uint64_t n = 1;
  for (dim_t d : shape) n = checked_mul(n, static_cast<std::uint64_t>(d), "element count");
  if (n > max_size) [[unlikely]] detail::too_large("element count", n);
  return n;
}

/// numel(shape) * itemsize, checked.
inline std::uint64_t byte_size(std::span<const dim_t> shape, std::size_t itemsize) {
  std::uint64_t n = checked_mul(numel(shape), itemsize, "byte size");
  if (n > max_size) [[unlikely]] detail::too_large("byte size", n);
  return n;
}

/// Row-major (C-contiguous) strides, in elements. Size-0 dimensions count as 1 (PyTorch's rule), so
/// the product is checked even for empty shapes.
inline shape_t contiguous_strides(std::span<const dim_t> shape) {
  shape_t s(shape.size());
  std::uint64_t acc = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    s[i] = static_cast<dim_t>(acc);
    acc = checked_mul(acc, shape[i] > 0 ? static_cast<std::uint64_t>(shape[i]) : 1U, "stride");
    if (acc > max_size) throw_error(errors::overflow, "strides of shape " + to_string(shape) + " exceed 2^63-1");
  }
  return s;
}

/// True when the strides address the elements row-major without gaps. Size-1 dimensions may have
/// any stride, and empty tensors are contiguous (PyTorch's rule).
inline bool is_contiguous(std::span<const dim_t> shape, std::span<const dim_t> strides) {
  for (dim_t d : shape)
    if (d == 0) return true;
  dim_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

}  // namespace statedict::inline v0
