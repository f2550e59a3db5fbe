// interop/xtensor.hpp: xt::adapt views over TensorViews (no copy, strides kept, dtype and
// alignment checked) and TensorViews over xtensor containers.
#include <doctest/doctest.h>

#include <statedict/interop/xtensor.hpp>
#include <statedict/statedict.hpp>

#include <xtensor/xarray.hpp>
#include <xtensor/xbuilder.hpp>
#include <xtensor/xmanipulation.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xview.hpp>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "test_util.hpp"

using namespace statedict;

namespace {
Tensor iota_f32(shape_t shape) {
  Tensor t(dtype::F32, std::move(shape));
  auto v = t.values<float>();
  std::iota(v.begin(), v.end(), 0.0F);
  return t;
}

using statedict_test::error_of;
}  // namespace

TEST_CASE("xt_adapt of a contiguous view reads the same memory") {
  Tensor t = iota_f32({2, 3});
  TensorView v = t.view();
  auto a = xt_adapt<float>(v);
  REQUIRE(a.dimension() == 2);
  CHECK(a.shape()[0] == 2);
  CHECK(a.shape()[1] == 3);
  CHECK(a(1, 2) == 5.0F);
  CHECK(static_cast<const void*>(&a(0, 0)) == static_cast<const void*>(v.data()));  // no copy
  xt::xarray<float> doubled = a * 2.0F;
  CHECK(doubled(1, 1) == 8.0F);
  auto m = xt_adapt<float, 2>(v);
  CHECK(m(1, 0) == 3.0F);
  CHECK(error_of([&] { (void)xt_adapt<float, 3>(v); }) == errors::shape_mismatch.id);
}

TEST_CASE("strided views keep their strides") {
  Tensor t = iota_f32({4, 5});
  TensorView v = t.view();
  TensorView cols = v.narrow(1, 1, 3);  // [4, 3], strides [5, 1]
  auto a = xt_adapt<float>(cols);
  CHECK(a.strides()[0] == 5);
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 3; ++j) CHECK(a(i, j) == static_cast<float>(i * 5 + j + 1));
  // A transposed view (strides [1, 5]).
  TensorView tr(dtype::F32, {5, 4}, {1, 5}, v.data(), v.owner());
  auto b = xt_adapt<float, 2>(tr);
  CHECK(b(3, 2) == 13.0F);
  xt::xarray<float> copy = b;  // evaluates through the strides
  CHECK(copy(4, 3) == 19.0F);
  // A row of a narrowed view: shape [1, 3] with stride 5 in the size-1 dimension. xtensor wants
  // stride 0 there so that broadcasting repeats the row instead of walking into the next one.
  TensorView row = cols.narrow(0, 2, 1);
  auto r = xt_adapt<float>(row);
  CHECK(r.strides()[0] == 0);
  xt::xarray<float> sum = r + xt::zeros<float>({3, 3});
  CHECK(sum(0, 0) == 11.0F);
  CHECK(sum(2, 0) == 11.0F);
  CHECK(sum(2, 2) == 13.0F);
}

TEST_CASE("dtype and alignment are checked") {
  Tensor t = iota_f32({4});
  CHECK(error_of([&] { (void)xt_adapt<double>(t.view()); }) == errors::dtype_mismatch.id);
  CHECK_THROWS_AS((void)xt_adapt<std::int32_t>(t.view()), type_error);
  // An F32 tensor one byte into a buffer, as a safetensors file may lay it out.
  std::vector<std::byte> raw(1 + 4 * sizeof(float));
  std::memcpy(raw.data() + 1, t.data(), 4 * sizeof(float));
  TensorView odd = TensorView::contiguous(dtype::F32, {4}, raw.data() + 1);
  CHECK(error_of([&] { (void)xt_adapt<float>(odd); }) == errors::misaligned.id);
  CHECK_THROWS_AS(((void)xt_adapt<float, 1>(odd)), usage_error);
  // The way out the message suggests: an aligned copy.
  Tensor aligned = contiguous(odd);
  CHECK(xt_adapt<float>(aligned)(3) == 3.0F);
  // Empty views have nothing to misalign.
  TensorView empty = TensorView::contiguous(dtype::F32, {0, 3}, raw.data() + 1);
  CHECK(xt_adapt<float>(empty).size() == 0);
}

TEST_CASE("writable views write through; the adaptor keeps the memory alive") {
  Tensor t = iota_f32({3});
  auto w = xt_adapt<float>(t.span());
  w(1) = 42.0F;
  CHECK(t.values<float>()[1] == 42.0F);
  auto kept = [] {
    Tensor local = iota_f32({2, 2});
    return xt_adapt<float, 2>(local.view());  // `local` dies here; the adaptor holds its buffer
  }();
  CHECK(kept(1, 1) == 3.0F);
}

TEST_CASE("16-bit floats adapt as their bit containers") {
  Tensor h = Tensor::copy_of(iota_f32({2}), dtype::BF16);
  auto a = xt_adapt<bfloat16>(h.view());
  CHECK(f32_from_bf16(a(1).bits) == 1.0F);
}

TEST_CASE("tensor_view_of: xtensor containers and strided views as TensorViews, no copy") {
  xt::xarray<double> x = {{1.0, 2.0, 3.0}, {4.0, 5.0, 6.0}};
  TensorView v = tensor_view_of(x);
  CHECK(v.dtype() == dtype::F64);
  CHECK(v.shape() == shape_t{2, 3});
  CHECK(v.data() == reinterpret_cast<const std::byte*>(x.data()));
  CHECK(v.load<double>(4) == 5.0);
  // Column-major storage.
  xt::xarray<float, xt::layout_type::column_major> c = {{1.0F, 2.0F}, {3.0F, 4.0F}};
  TensorView cv = tensor_view_of(c);
  CHECK(cv.strides() == shape_t{1, 2});
  CHECK(cv.load<float>(1) == 2.0F);  // row-major element order, whatever the layout
  // A strided view: every other column, starting at column 1.
  xt::xtensor<std::int64_t, 2> big = xt::arange<std::int64_t>(12).reshape({3, 4});
  auto sv = xt::strided_view(big, {xt::all(), xt::range(1, 4, 2)});
  TensorView s = tensor_view_of(sv);
  CHECK(s.shape() == shape_t{3, 2});
  CHECK(s.load<std::int64_t>(0) == 1);
  CHECK(s.load<std::int64_t>(3) == 7);
  CHECK(s.load<std::int64_t>(5) == 11);
  // Copying out through statedict gives the same elements xtensor evaluates.
  Tensor copied = contiguous(s);
  xt::xtensor<std::int64_t, 2> evaluated = sv;
  CHECK(std::memcmp(copied.data(), evaluated.data(), 6 * sizeof(std::int64_t)) == 0);
  // Flipped views have negative strides, which TensorView does not have.
  auto flipped = xt::flip(big, 0);
  CHECK(error_of([&] { (void)tensor_view_of(flipped); }) == errors::bad_stride.id);
}

TEST_CASE("tensor_span_of writes into the container; shared_ptr containers are kept alive") {
  xt::xtensor<float, 1> x = {1.0F, 2.0F, 3.0F};
  TensorSpan s = tensor_span_of(x);
  Tensor src = Tensor::from<float>({7.0F, 8.0F, 9.0F}, {3});
  copy(src, s);
  CHECK(x(2) == 9.0F);
  TensorView kept = [] {
    auto p = std::make_shared<xt::xarray<float>>(xt::xarray<float>{5.0F, 6.0F});
    return tensor_view_of(p);
  }();
  CHECK(kept.load<float>(1) == 6.0F);
}

TEST_CASE("round trip: a view adapted and viewed again is the same view") {
  Tensor t = iota_f32({3, 4});
  TensorView cols = t.view().narrow(1, 1, 2);
  auto a = xt_adapt<float>(cols);
  TensorView back = tensor_view_of(a, cols.owner());
  CHECK(same_view(back, cols));
  TensorView scalar = TensorView::contiguous(dtype::F32, {}, t.data());
  auto s = xt_adapt<float>(scalar);
  CHECK(s.dimension() == 0);
  CHECK(s() == 0.0F);
}

TEST_CASE("xt_as_float: BF16, F16 and F8 views read as float lazily, each element converted as torch's .float()") {
  // Values exact in every format: 1.5, -2, 0.25, 448 (the largest F8_E4M3 finite).
  const std::vector<float> vals{1.5F, -2.0F, 0.25F, 448.0F};
  const Tensor f32 = Tensor::from<float>(std::span<const float>(vals), {2, 2});
  for (const dtype dt : {dtype::BF16, dtype::F16}) {
    const Tensor h = contiguous(f32.view(), dt);
    const auto lazy = xt_as_float(h.view());
    CHECK(lazy(0, 0) == 1.5F);
    CHECK(lazy(1, 1) == 448.0F);
    const xt::xarray<float> all = lazy;
    CHECK(all.shape()[0] == 2);
    CHECK(all(0, 1) == -2.0F);
    // A strided view (the transpose) converts through its strides.
    const TensorView t(dt, {2, 2}, {1, 2}, h.data(), h.view().owner());
    CHECK(xt_as_float(t)(0, 1) == 0.25F);
  }
  const Tensor f8 = contiguous(f32.view(), dtype::F8_E4M3);
  CHECK(xt_as_float8(f8.view())(1, 1) == 448.0F);
  CHECK_THROWS_AS((void)xt_as_float(f32.view()), type_error);
}
