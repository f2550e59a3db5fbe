// statedict: TensorView <-> xtensor, without copying.
// SPDX-License-Identifier: MIT
//
//   TensorView v = ...;                                  // F32, any strides
//   auto a = statedict::xt_adapt<float>(v);              // xt::xarray_adaptor over v's bytes
//   auto m = statedict::xt_adapt<float, 2>(v);           // xt::xtensor_adaptor (rank checked)
//   xt::xarray<float> x = a * 2.0f;
//
//   xt::xarray<double> y = ...;
//   TensorView w = statedict::tensor_view_of(y);        // a view of y's elements (y must outlive w)
//
//   TensorView h = ...;                                  // BF16, F16 (or F8_E4M3, F8_E5M2)
//   auto f = statedict::xt_as_float(h);                  // a lazy xtensor expression of float:
//   float x = f(0, 1);                                   // each element converted when it is read
//   xt::xarray<float> all = f;                           // or all of them, once
//
// xt_adapt checks the dtype against T, keeps the view's strides (in elements, as in xtensor; the
// adaptor makes those of size-1 dimensions 0, which its broadcasting relies on), and refuses data
// that is not aligned for T: xtensor would dereference a misaligned T*, which is undefined
// behaviour (safetensors may place a tensor at any byte offset; statedict::contiguous(view) makes
// an aligned copy). The adaptor holds a copy of the view's keep-alive handle, so the memory stays
// valid as long as the adaptor lives.
//
// Needs xtensor (>= 0.24) and is not included by <statedict/statedict.hpp>.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xutils.hpp>

#include "../core/cast.hpp"
#include "../core/dtype.hpp"
#include "../core/error.hpp"
#include "../core/shape.hpp"
#include "../core/tensor.hpp"

namespace statedict::inline v0 {

namespace detail::xt_bridge {

/// Throws unless `v` holds T elements at addresses aligned for T.
template <class T, class Byte>
void check_typed(const basic_tensor_view<Byte>& v) {
  if (v.dtype() != dtype_of<T>)
    throw_error(errors::dtype_mismatch, "xt_adapt: tensor is " + std::string(name(v.dtype())) + ", adapted as " +
                                            std::string(name(dtype_of<T>)));
  if (v.numel() != 0 && reinterpret_cast<std::uintptr_t>(v.data()) % alignof(T) != 0)
    throw_error(errors::misaligned, "xt_adapt: " + std::string(name(v.dtype())) + " data at an address not aligned to " +
                                        std::to_string(alignof(T)) +
                                        " bytes; xtensor would dereference misaligned pointers. Adapt an aligned copy "
                                        "(statedict::contiguous(view)) instead");
}

/// The buffer size xtensor expects: the element count (it checks that size against the shape, and
/// walks strided memory through the strides, never linearly over the buffer).
template <class Byte>
std::size_t buffer_elements(const basic_tensor_view<Byte>& v) {
  return static_cast<std::size_t>(v.numel());
}

/// The view's strides (in elements, like xtensor's); the adaptor sets those of size-1 dimensions
/// to 0 itself, as its broadcasting needs.
template <class Strides, class Byte>
void fill_strides(const basic_tensor_view<Byte>& v, Strides& strides) {
  for (std::size_t i = 0; i < v.rank(); ++i) strides[i] = static_cast<std::ptrdiff_t>(v.strides()[i]);
}

template <class T, class Byte>
using pointer_for = std::conditional_t<std::is_const_v<Byte>, const T*, T*>;

template <class T, class Byte>
using buffer_for = xt::xbuffer_adaptor<pointer_for<T, Byte>, xt::smart_ownership, keep_alive>;

template <class T, class Byte>
auto adapt_dynamic(const basic_tensor_view<Byte>& v) {
  check_typed<T>(v);
  using buffer = buffer_for<T, Byte>;
  using adaptor = xt::xarray_adaptor<buffer, xt::layout_type::dynamic, std::vector<std::size_t>>;
  typename adaptor::shape_type shape(v.shape().begin(), v.shape().end());
  typename adaptor::strides_type strides(v.rank());
  fill_strides(v, strides);
  return adaptor(buffer(reinterpret_cast<pointer_for<T, Byte>>(v.data()), buffer_elements(v), v.owner()), shape, strides);
}

template <class T, std::size_t N, class Byte>
auto adapt_fixed(const basic_tensor_view<Byte>& v) {
  check_typed<T>(v);
  if (v.rank() != N)
    throw_error(errors::shape_mismatch, "xt_adapt: tensor of shape " + to_string(v.shape()) + " adapted with rank " +
                                            std::to_string(N));
  using buffer = buffer_for<T, Byte>;
  using adaptor = xt::xtensor_adaptor<buffer, N, xt::layout_type::dynamic>;
  typename adaptor::shape_type shape{};
  for (std::size_t i = 0; i < N; ++i) shape[i] = static_cast<std::size_t>(v.shape()[i]);
  typename adaptor::strides_type strides{};
  fill_strides(v, strides);
  return adaptor(buffer(reinterpret_cast<pointer_for<T, Byte>>(v.data()), buffer_elements(v), v.owner()), shape, strides);
}

template <class E>
concept with_memory = xt::has_data_interface<E>::value;

/// shape, strides (in elements, checked non-negative) and the first element of an expression.
template <class Byte, class E, class Ptr>
basic_tensor_view<Byte> view_of(const E& e, Ptr first, keep_alive owner) {
  using T = std::remove_cv_t<typename E::value_type>;
  shape_t shape(e.shape().begin(), e.shape().end());
  shape_t strides(e.dimension());
  for (std::size_t i = 0; i < e.dimension(); ++i) {
    const auto s = static_cast<std::ptrdiff_t>(e.strides()[i]);
    if (s < 0 && shape[i] > 1)
      throw_error(errors::bad_stride, "tensor_view_of: the xtensor expression has a negative stride in dimension " +
                                          std::to_string(i) + " (a flipped view); evaluate it first (xt::eval)");
    strides[i] = s < 0 ? 0 : static_cast<dim_t>(s);
  }
  return basic_tensor_view<Byte>(dtype_of<T>, std::move(shape), std::move(strides),
                                 reinterpret_cast<Byte*>(first), std::move(owner));
}

}  // namespace detail::xt_bridge

/// An `xt::xarray_adaptor` of T over the view's elements (read-only for a TensorView, writable for
/// a TensorSpan), with the view's strides. No copy. Throws type_error (105) when T is not the view's
/// dtype and usage_error (106) when the data is not aligned for T.
template <element_type T>
auto xt_adapt(const TensorView& v) {
  return detail::xt_bridge::adapt_dynamic<T>(v);
}
template <element_type T>
auto xt_adapt(const TensorSpan& v) {
  return detail::xt_bridge::adapt_dynamic<T>(v);
}
template <element_type T>
auto xt_adapt(const Tensor& t) {
  return detail::xt_bridge::adapt_dynamic<T>(t.span());
}

/// The same as an `xt::xtensor_adaptor` of rank N; throws shape_error (103) for another rank.
template <element_type T, std::size_t N>
auto xt_adapt(const TensorView& v) {
  return detail::xt_bridge::adapt_fixed<T, N>(v);
}
template <element_type T, std::size_t N>
auto xt_adapt(const TensorSpan& v) {
  return detail::xt_bridge::adapt_fixed<T, N>(v);
}
template <element_type T, std::size_t N>
auto xt_adapt(const Tensor& t) {
  return detail::xt_bridge::adapt_fixed<T, N>(t.span());
}

namespace detail::xt_bridge {
/// The view's bytes as unsigned integers of the same width (bits, not values).
template <class U>
TensorView as_bits(const TensorView& v) {
  return TensorView(dtype_of<U>, v.shape(), v.strides(), v.data(), v.owner());
}
}  // namespace detail::xt_bridge

/// A lazy xtensor expression of float over a BF16, F16, F8_E4M3 or F8_E5M2 view (any strides): no
/// copy, each element converted exactly (these formats are subsets of float) when it is read, as
/// PyTorch's `.float()` does (for F32 views, use xt_adapt<float>). Throws
/// type_error (105) for other dtypes, usage_error (106) for data misaligned for its width.
inline auto xt_as_float(const TensorView& v) {
  using detail::float_codec;
  using detail::xt_bridge::as_bits;
  switch (v.dtype()) {
    case dtype::BF16:
    case dtype::F16: {
      const bool bf = v.dtype() == dtype::BF16;
      return xt::make_lambda_xfunction(
          [bf](std::uint16_t x) { return bf ? float_codec<dtype::BF16>::widen(x) : float_codec<dtype::F16>::widen(x); },
          xt_adapt<std::uint16_t>(as_bits<std::uint16_t>(v)));
    }
    default: break;
  }
  throw_error(errors::dtype_mismatch, "xt_as_float: tensor is " + std::string(name(v.dtype())) + ", expected BF16 or F16");
}

/// xt_as_float for the 8-bit floats (F8_E4M3, F8_E5M2).
inline auto xt_as_float8(const TensorView& v) {
  using detail::float_codec;
  if (v.dtype() != dtype::F8_E4M3 && v.dtype() != dtype::F8_E5M2)
    throw_error(errors::dtype_mismatch, "xt_as_float8: tensor is " + std::string(name(v.dtype())) + ", expected F8_E4M3 or F8_E5M2");
  const bool e4 = v.dtype() == dtype::F8_E4M3;
  return xt::make_lambda_xfunction(
      [e4](std::uint8_t x) { return e4 ? float_codec<dtype::F8_E4M3>::widen(x) : float_codec<dtype::F8_E5M2>::widen(x); },
      xt_adapt<std::uint8_t>(detail::xt_bridge::as_bits<std::uint8_t>(v)));
}

/// A TensorView of the elements of an xtensor container, adaptor or strided view (anything with a
/// data interface), with its strides. No copy: `owner` (may be empty) must keep the memory alive as
/// long as the view is used. Negative strides (flipped views) throw shape_error (113).
template <class E>
TensorView tensor_view_of(const xt::xexpression<E>& expr, keep_alive owner = {}) {
  static_assert(detail::xt_bridge::with_memory<E>,
                "statedict::tensor_view_of: this xtensor expression has no memory of its own (it is computed lazily). "
                "Fix: evaluate it first, e.g. xt::xarray<T> x = expr; or xt::eval(expr).");
  static_assert(element_type<typename E::value_type>, "statedict::tensor_view_of: the element type has no statedict dtype");
  const E& e = expr.derived_cast();
  return detail::xt_bridge::view_of<const std::byte>(e, reinterpret_cast<const std::byte*>(e.data() + e.data_offset()),
                                                     std::move(owner));
}

/// A writable TensorSpan of an xtensor container's elements (see tensor_view_of).
template <class E>
TensorSpan tensor_span_of(xt::xexpression<E>& expr, keep_alive owner = {}) {
  static_assert(detail::xt_bridge::with_memory<E>,
                "statedict::tensor_span_of: this xtensor expression has no memory of its own. Fix: evaluate it first.");
  static_assert(element_type<typename E::value_type>, "statedict::tensor_span_of: the element type has no statedict dtype");
  E& e = expr.derived_cast();
  return detail::xt_bridge::view_of<std::byte>(e, reinterpret_cast<std::byte*>(e.data() + e.data_offset()), std::move(owner));
}

/// A TensorView that shares ownership of a container held by shared_ptr (the view keeps it alive).
template <class C>
TensorView tensor_view_of(const std::shared_ptr<C>& container) {
  return tensor_view_of(*container, container);
}

}  // namespace statedict::inline v0
