#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <numeric>
#include <vector>

using namespace statedict;

TEST_CASE("checked sizes") {
  CHECK(numel(shape_t{}) == 1);
  CHECK(numel(shape_t{2, 0, 3}) == 0);
  CHECK_THROWS_AS(numel(shape_t{2, -1}), shape_error);
  CHECK_THROWS_AS(numel(shape_t{1LL << 40, 1LL << 40}), limit_error);
  CHECK_THROWS_AS(byte_size(shape_t{1LL << 61}, 8), limit_error);
  CHECK(contiguous_strides(shape_t{2, 3, 4}) == shape_t{12, 4, 1});
  CHECK(is_contiguous(shape_t{2, 1, 3}, shape_t{3, 99, 1}));
  CHECK(is_contiguous(shape_t{0, 3}, shape_t{1, 5}));
  CHECK_FALSE(is_contiguous(shape_t{2, 3}, shape_t{1, 2}));
}

TEST_CASE("views narrow, select and iterate runs row-major") {
  std::vector<float> data(24);
  std::iota(data.begin(), data.end(), 0.0F);
  Tensor t = Tensor::from(data, {2, 3, 4});
  TensorView v = t.view();
  CHECK(v.is_contiguous());
  auto n = v.narrow(2, 1, 2);  // [2,3,2]
  CHECK_FALSE(n.is_contiguous());
  CHECK(n.load<float>(0) == 1.0F);
  CHECK(n.load<float>(1) == 2.0F);
  CHECK(n.load<float>(2) == 5.0F);
  int runs = 0;
  n.for_each_run([&](const std::byte*, std::uint64_t count) {
    ++runs;
    CHECK(count == 2);
  });
  CHECK(runs == 6);
  auto s = v.select(0, 1);
  CHECK(s.shape() == shape_t{3, 4});
  CHECK(s.load<float>(0) == 12.0F);
  CHECK_THROWS_AS((void)v.narrow(1, 2, 2), usage_error);
  CHECK_THROWS_AS((void)v.span<double>(), type_error);
}

TEST_CASE("typed span refuses misaligned data; load and copy handle it") {
  std::vector<std::byte> raw(1 + 4 * 4);
  float vals[4] = {1.5F, -2.0F, 3.25F, 1e30F};
  std::memcpy(raw.data() + 1, vals, sizeof vals);
  TensorView v = TensorView::contiguous(dtype::F32, {4}, raw.data() + 1);
  CHECK_THROWS_AS((void)v.span<float>(), usage_error);
  CHECK(v.load<float>(2) == 3.25F);
  Tensor c = contiguous(v);
  CHECK(c.values<float>()[3] == 1e30F);
  Tensor b = contiguous(v, dtype::BF16);
  CHECK(f32_from_bf16(b.values<bfloat16>()[0].bits) == 1.5F);
}

TEST_CASE("copy casts between floating dtypes and refuses integer casts") {
  Tensor src = Tensor::from<float>({1.0F, 0.1F, 65520.0F, -1e-8F}, {4});
  Tensor h(dtype::F16, {4});
  copy(src, h.span());
  auto hv = h.values<float16>();
  CHECK(hv[0].bits == 0x3c00);
  CHECK(hv[2].bits == 0x7c00);  // 65520 rounds to inf
  Tensor i = Tensor::from<std::int32_t>({1, 2}, {2});
  Tensor f(dtype::F32, {2});
  CHECK_THROWS_AS(copy(i, f.span()), unsupported_error);
}

TEST_CASE("bf16/f16 round trips and rounding ties") {
  CHECK(bf16_from_f32(1.0F) == 0x3f80);
  // 1 + 2^-8 is a tie between bf16 1.0 (even) and 1.0078125 (odd): rounds to even.
  CHECK(bf16_from_f32(1.00390625F) == 0x3f80);
  CHECK(bf16_from_f32(1.01171875F) == 0x3f82);
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float f = f32_from_f16(x);
    if (f == f) CHECK_EQ(f16_from_f32(f), x);
    const float g = f32_from_bf16(x);
    if (g == g) CHECK_EQ(bf16_from_f32(g), x);
  }
}
