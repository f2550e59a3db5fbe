// statedict: shapes, strides and checked arithmetic.
// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "error.hpp"

namespace statedict::inline v0 {

/// Sizes and strides are signed 64-bit, as in PyTorch. Strides count elements, not bytes.
using dim_t = std::int64_t;
using shape_t = std::vector<dim_t>;

/// a * b, or throws errors::overflow naming `what`.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, std::string_view what = "size") {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw_error(errors::overflow, std::string(what) + " overflows 64 bits (" + std::to_string(a) + " * " +
                                      std::to_string(b) + ")");
  return r;
}

/// a + b, or throws errors::overflow naming `what`.
inline std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, std::string_view what = "size") {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw_error(errors::overflow, std::string(what) + " overflows 64 bits (" + std::to_string(a) + " + " +
                                      std::to_string(b) + ")");
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

/// Throws errors::negative_dim when a dimension is negative.
inline void check_shape(std::span<const dim_t> shape) {
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] < 0)
      throw_error(errors::negative_dim,
                  "dimension " + std::to_string(i) + " of shape " + to_string(shape) + " is negative");
}

/// Number of elements (1 for a 0-d shape), checked: negative dims and totals beyond max_size throw.
inline std::uint64_t numel(std::span<const dim_t> shape) {
  check_shape(shape);
  std::uint64_t n = 1;
  for (dim_t d : shape) n = checked_mul(n, static_cast<std::uint64_t>(d), "element count");
  if (n > max_size) throw_error(errors::overflow, "element count " + std::to_string(n) + " exceeds 2^63-1");
  return n;
}

/// numel(shape) * itemsize, checked.
inline std::uint64_t byte_size(std::span<const dim_t> shape, std::size_t itemsize) {
  std::uint64_t n = checked_mul(numel(shape), itemsize, "byte size");
  if (n > max_size) throw_error(errors::overflow, "byte size " + std::to_string(n) + " exceeds 2^63-1");
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
