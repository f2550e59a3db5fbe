// dtypes: names in every format, sizes, safetensors order, parsing, and casts by hand-picked
// values (tests/interop-dtype.cpp checks the conversions against PyTorch over millions of inputs).
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <bit>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

using namespace statedict;

namespace {
constexpr std::array<dtype, dtype_count> all_dtypes = {
    dtype::BOOL, dtype::U8,  dtype::I8,  dtype::I16,     dtype::U16,     dtype::I32, dtype::U32,
    dtype::I64,  dtype::U64, dtype::F16, dtype::BF16,    dtype::F32,     dtype::F64, dtype::F8_E4M3,
    dtype::F8_E5M2, dtype::C64, dtype::C128, dtype::F8_E4M3FNUZ, dtype::F8_E5M2FNUZ, dtype::F8_E8M0,
    dtype::F4_X2, dtype::F6_E2M3_X4, dtype::F6_E3M2_X4, dtype::C32, dtype::BITS8, dtype::BITS16,
    dtype::BITS1X8, dtype::BITS2X4, dtype::BITS4X2};

float f32(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
}  // namespace

// Parsing and the table are constexpr: usable in static_asserts and switch labels.
static_assert(dtype_from_name("BF16") == dtype::BF16);
static_assert(itemsize(dtype::C128) == 16);
static_assert(dtype_of<float> == dtype::F32);
static_assert(element_type<bfloat16> && !element_type<long double>);
static_assert(bf16_from_f32(1.0F) == 0x3f80 && f16_from_f32(1.0F) == 0x3c00);

TEST_CASE("the table has one row per dtype, in enum order") {
  for (std::size_t i = 0; i < dtype_count; ++i) {
    CAPTURE(i);
    CHECK(static_cast<std::size_t>(all_dtypes[i]) == i);
    CHECK(info(all_dtypes[i]).id == all_dtypes[i]);
  }
}

TEST_CASE("names: safetensors, torch, legacy storage class") {
  struct row {
    dtype t;
    std::string_view st, torch, storage;
    std::size_t size;
  };
  const row rows[] = {
      {dtype::BOOL, "BOOL", "bool", "BoolStorage", 1},
      {dtype::U8, "U8", "uint8", "ByteStorage", 1},
      {dtype::I8, "I8", "int8", "CharStorage", 1},
      {dtype::I16, "I16", "int16", "ShortStorage", 2},
      {dtype::U16, "U16", "uint16", "", 2},
      {dtype::I32, "I32", "int32", "IntStorage", 4},
      {dtype::U32, "U32", "uint32", "", 4},
      {dtype::I64, "I64", "int64", "LongStorage", 8},
      {dtype::U64, "U64", "uint64", "", 8},
      {dtype::F16, "F16", "float16", "HalfStorage", 2},
      {dtype::BF16, "BF16", "bfloat16", "BFloat16Storage", 2},
      {dtype::F32, "F32", "float32", "FloatStorage", 4},
      {dtype::F64, "F64", "float64", "DoubleStorage", 8},
      {dtype::F8_E4M3, "F8_E4M3", "float8_e4m3fn", "", 1},
      {dtype::F8_E5M2, "F8_E5M2", "float8_e5m2", "", 1},
      {dtype::C64, "C64", "complex64", "ComplexFloatStorage", 8},
      {dtype::C128, "C128", "complex128", "ComplexDoubleStorage", 16},
      {dtype::F8_E4M3FNUZ, "F8_E4M3FNUZ", "float8_e4m3fnuz", "", 1},
      {dtype::F8_E5M2FNUZ, "F8_E5M2FNUZ", "float8_e5m2fnuz", "", 1},
      {dtype::F8_E8M0, "F8_E8M0", "float8_e8m0fnu", "", 1},
      {dtype::F4_X2, "F4_X2", "float4_e2m1fn_x2", "", 1},
      {dtype::F6_E2M3_X4, "F6_E2M3_X4", "", "", 3},
      {dtype::F6_E3M2_X4, "F6_E3M2_X4", "", "", 3},
      {dtype::C32, "C32", "complex32", "", 4},
      {dtype::BITS8, "BITS8", "bits8", "", 1},
      {dtype::BITS16, "BITS16", "bits16", "", 2},
      {dtype::BITS1X8, "BITS1X8", "bits1x8", "", 1},
      {dtype::BITS2X4, "BITS2X4", "bits2x4", "", 1},
      {dtype::BITS4X2, "BITS4X2", "bits4x2", "", 1},
  };
  CHECK(std::size(rows) == dtype_count);
  for (const auto& r : rows) {
    CAPTURE(r.st);
    CHECK(name(r.t) == r.st);
    CHECK(info(r.t).torch_name == r.torch);
    CHECK(info(r.t).storage_name == r.storage);
    CHECK(itemsize(r.t) == r.size);
    CHECK(dtype_from_name(r.st) == r.t);
    if (!r.torch.empty()) CHECK(dtype_from_torch_name(r.torch) == r.t);
    if (!r.storage.empty()) CHECK(dtype_from_storage_name(r.storage) == r.t);
  }
}

TEST_CASE("element types have the dtype's size") {
  CHECK(sizeof(bfloat16) == itemsize(dtype_of<bfloat16>));
  CHECK(sizeof(float16) == itemsize(dtype_of<float16>));
  CHECK(sizeof(float8_e4m3) == itemsize(dtype_of<float8_e4m3>));
  CHECK(sizeof(float8_e5m2) == itemsize(dtype_of<float8_e5m2>));
  CHECK(sizeof(std::complex<double>) == itemsize(dtype_of<std::complex<double>>));
  CHECK(dtype_of<const std::int64_t> == dtype::I64);
}

TEST_CASE("kinds: floating, complex, signed") {
  for (dtype t : all_dtypes) {
    CAPTURE(name(t));
    const bool floating = t == dtype::F16 || t == dtype::BF16 || t == dtype::F32 || t == dtype::F64 || t == dtype::F8_E4M3 ||
                          t == dtype::F8_E5M2 || t == dtype::F8_E4M3FNUZ || t == dtype::F8_E5M2FNUZ || t == dtype::F8_E8M0;
    const bool complex = t == dtype::C64 || t == dtype::C128 || t == dtype::C32;
    const bool unsigned_ = t == dtype::BOOL || t == dtype::U8 || t == dtype::U16 || t == dtype::U32 || t == dtype::U64 ||
                           t == dtype::F8_E8M0 || t == dtype::BITS8 || t == dtype::BITS16 || t == dtype::BITS1X8 ||
                           t == dtype::BITS2X4 || t == dtype::BITS4X2;
    CHECK(is_floating(t) == floating);
    CHECK(info(t).is_complex == complex);
    CHECK(info(t).is_signed == !unsigned_);
  }
}

TEST_CASE("safetensors ranks follow its Dtype enum (the order its writer sorts by)") {
  // safetensors: BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ,
  // F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64.
  const dtype order[] = {dtype::BOOL,        dtype::F4_X2,       dtype::F6_E2M3_X4, dtype::F6_E3M2_X4, dtype::U8,
                         dtype::I8,          dtype::F8_E5M2,     dtype::F8_E4M3,    dtype::F8_E8M0,    dtype::F8_E4M3FNUZ,
                         dtype::F8_E5M2FNUZ, dtype::I16,         dtype::U16,        dtype::F16,        dtype::BF16,
                         dtype::I32,         dtype::U32,         dtype::F32,        dtype::C64,        dtype::F64,
                         dtype::I64,         dtype::U64};
  for (std::size_t i = 1; i < std::size(order); ++i) {
    CAPTURE(name(order[i]));
    CHECK(info(order[i - 1]).safetensors_rank < info(order[i]).safetensors_rank);
  }
  CHECK(info(dtype::BOOL).safetensors_rank == 0);
  CHECK(info(dtype::U8).safetensors_rank == 4);
  CHECK(info(dtype::F8_E5M2).safetensors_rank == 6);
  CHECK(info(dtype::I16).safetensors_rank == 11);
  CHECK(info(dtype::U64).safetensors_rank == 21);
  CHECK(info(dtype::C128).safetensors_rank == -1);  // safetensors cannot store complex128
  CHECK(std::size(order) == safetensors::dtype_table.size());
  for (std::size_t i = 0; i < std::size(order); ++i) {
    CAPTURE(i);
    CHECK(info(order[i]).safetensors_rank == static_cast<int>(i));
    CHECK(safetensors::dtype_table[i].type == order[i]);  // the reader's table maps each name to it
    CHECK(safetensors::dtype_table[i].name == safetensors::file_dtype_name(order[i]));
  }
  for (dtype t : {dtype::C128, dtype::C32, dtype::BITS8, dtype::BITS16, dtype::BITS1X8, dtype::BITS2X4, dtype::BITS4X2})
    CHECK(info(t).safetensors_rank == -1);
}

TEST_CASE("byte order units and packing") {
  CHECK(info(dtype::C64).swap_unit == 4);  // each component swapped on its own
  CHECK(info(dtype::C32).swap_unit == 2);
  CHECK(info(dtype::C128).swap_unit == 8);
  CHECK(info(dtype::BITS16).swap_unit == 2);
  CHECK(info(dtype::F4_X2).swap_unit == 1);
  CHECK(info(dtype::F4_X2).packed == 2);
  CHECK(info(dtype::F6_E2M3_X4).packed == 4);
  for (dtype t : all_dtypes) {
    CAPTURE(name(t));
    CHECK(itemsize(t) % info(t).swap_unit == 0);
  }
}

TEST_CASE("parsing rejects what is not a name") {
  CHECK_FALSE(dtype_from_name("f32").has_value());  // case matters
  CHECK_FALSE(dtype_from_name("F32 ").has_value());
  CHECK_FALSE(dtype_from_name("").has_value());
  CHECK_FALSE(dtype_from_name("F4").has_value());  // safetensors' name of the packed F4_X2: not a statedict name
  CHECK_FALSE(dtype_from_name("float32").has_value());  // a torch name is not a safetensors name
  CHECK_FALSE(dtype_from_torch_name("torch.float32").has_value());
  CHECK_FALSE(dtype_from_torch_name("F32").has_value());
  CHECK_FALSE(dtype_from_torch_name("").has_value());  // the safetensors-only dtypes have no torch name
  CHECK_FALSE(dtype_from_storage_name("").has_value());  // dtypes without a storage class do not match ""
  CHECK_FALSE(dtype_from_storage_name("UntypedStorage").has_value());
  CHECK_FALSE(dtype_from_storage_name("QInt8Storage").has_value());
}

TEST_CASE("torch aliases") {
  CHECK(dtype_from_torch_name("float") == dtype::F32);
  CHECK(dtype_from_torch_name("double") == dtype::F64);
  CHECK(dtype_from_torch_name("half") == dtype::F16);
  CHECK(dtype_from_torch_name("long") == dtype::I64);
  CHECK(dtype_from_torch_name("int") == dtype::I32);
  CHECK(dtype_from_torch_name("short") == dtype::I16);
  CHECK(dtype_from_torch_name("cfloat") == dtype::C64);
  CHECK(dtype_from_torch_name("cdouble") == dtype::C128);
  CHECK(dtype_from_torch_name("chalf") == dtype::C32);
}

// Values torch 2.14 gives (`torch.tensor([x]).to(dtype).view(torch.uint8)`); the interop test
// compares whole tables (tests/python/torch2/gen_t2_dtype_tables.py).
TEST_CASE("fnuz and e8m0 conversions at their edges, as PyTorch 2.x") {
  CHECK(f8e4m3fnuz_from_f32(240.0F) == 0x7f);
  CHECK(f8e4m3fnuz_from_f32(247.0F) == 0x7f);
  CHECK(f8e4m3fnuz_from_f32(248.0F) == 0x80);  // rounds to 256: NaN, the only non-finite code
  CHECK(f8e4m3fnuz_from_f32(-0.0F) == 0x00);   // no negative zero
  CHECK(f8e4m3fnuz_from_f32(-1e-10F) == 0x00);
  CHECK(f8e4m3fnuz_from_f32(-std::numeric_limits<float>::infinity()) == 0x80);
  CHECK(f8e4m3fnuz_from_f32(-1.0F) == 0xc0);
  CHECK(f8e5m2fnuz_from_f32(240.0F) == 0x60);
  CHECK(f8e5m2fnuz_from_f32(std::numeric_limits<float>::quiet_NaN()) == 0x80);
  CHECK(bits(f32_from_f8e4m3fnuz(0x01)) == 0x3a800000);
  CHECK(bits(f32_from_f8e4m3fnuz(0x7f)) == 0x43700000);
  CHECK(bits(f32_from_f8e4m3fnuz(0xff)) == 0xc3700000);
  CHECK(bits(f32_from_f8e4m3fnuz(0x80)) == f8_fnuz_nan_f32);
  const std::pair<float, std::uint8_t> e8m0[] = {
      {1.0F, 0x7f}, {1.4F, 0x7f}, {1.5F, 0x80}, {1.6F, 0x80}, {2.9F, 0x80}, {3.0F, 0x81}, {0.75F, 0x7f}, {1e-40F, 0x00},
      {0.0F, 0x00}, {-1.0F, 0x7f}, {std::numeric_limits<float>::infinity(), 0xff}, {0x1p127F, 0xfe}, {0x1.8p127F, 0xff},
      {0x1p-127F, 0x00}, {0x1p-128F, 0x00}};
  for (const auto& [x, code] : e8m0) {
    const float x_in = x;  // CAPTURE is a lambda: clang 14 cannot capture a structured binding
    CAPTURE(x_in);
    CHECK(f8e8m0_from_f32(x) == code);
  }
  CHECK(bits(f32_from_f8e8m0(0)) == 0x00400000);
  CHECK(bits(f32_from_f8e8m0(127)) == 0x3f800000);
  CHECK(bits(f32_from_f8e8m0(254)) == 0x7f000000);
}

TEST_CASE("complex32 casts component by component through f16") {
  const std::uint16_t c32[4] = {0x3c00, 0xc000, 0x7c00, 0x0001};  // 1 - 2i, inf + 2^-24 i
  float c64[4] = {};
  cast_run(dtype::C32, reinterpret_cast<const std::byte*>(c32), dtype::C64, reinterpret_cast<std::byte*>(c64), 2);
  CHECK(c64[0] == 1.0F);
  CHECK(c64[1] == -2.0F);
  CHECK(std::isinf(c64[2]));
  CHECK(c64[3] == 0x1p-24F);
  std::uint16_t back[4] = {};
  cast_run(dtype::C64, reinterpret_cast<const std::byte*>(c64), dtype::C32, reinterpret_cast<std::byte*>(back), 2);
  CHECK(std::equal(std::begin(back), std::end(back), std::begin(c32)));
  CHECK_FALSE(can_cast(dtype::F4_X2, dtype::F32));
  CHECK_FALSE(can_cast(dtype::BITS16, dtype::F16));
  CHECK(can_cast(dtype::F8_E8M0, dtype::BF16));
}

TEST_CASE("scalar conversions at their edges") {
  // bf16: ties to even, overflow to inf, NaN as PyTorch's kernels write it.
  CHECK(bf16_from_f32(f32(0x3f808000)) == 0x3f80);  // tie, even stays
  CHECK(bf16_from_f32(f32(0x3f818000)) == 0x3f82);  // tie, odd rounds up
  CHECK(bf16_from_f32(f32(0x3f808001)) == 0x3f81);
  CHECK(bf16_from_f32(f32(0x7f7fffff)) == 0x7f80);  // FLT_MAX rounds to inf
  CHECK(bf16_from_f32(-0.0F) == 0x8000);
  CHECK(bf16_from_f32(f32(0x7fc00000)) == bf16_nan_vectorised);
  CHECK(bf16_from_f32(f32(0xff800001), bf16_nan_scalar) == 0x7fc0);
  CHECK(bits(f32_from_bf16(0xff81)) == 0xff810000U);  // NaN payload kept, stays signalling
  // f16: 65504 is the largest, 65520 the first value that rounds to inf; subnormals down to 2^-24.
  CHECK(f16_from_f32(65504.0F) == 0x7bff);
  CHECK(f16_from_f32(65519.996F) == 0x7bff);
  CHECK(f16_from_f32(65520.0F) == 0x7c00);
  CHECK(f16_from_f32(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(f16_from_f32(0x1p-24F) == 0x0001);
  CHECK(f16_from_f32(0x1p-25F) == 0x0000);                 // tie with 0: even
  CHECK(f16_from_f32(f32(0x33000001)) == 0x0001);          // just above 2^-25
  CHECK(f16_from_f32(0x1.8p-24F) == 0x0002);               // 1.5 steps: tie, rounds to even 2
  CHECK(f16_from_f32(0x1p-14F - 0x1p-25F) == 0x0400);      // rounds up into the smallest normal
  CHECK(f16_from_f32(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(f16_from_f32(f32(0xffa00000)) == 0xfe00);          // NaN keeps its sign
  CHECK(f32_from_f16(0x0001) == 0x1p-24F);
  CHECK(f32_from_f16(0x03ff) == 0x3ffp-24F);
  CHECK(f32_from_f16(0x7bff) == 65504.0F);
  CHECK(bits(f32_from_f16(0x8000)) == 0x80000000U);
  CHECK(bits(f32_from_f16(0xfc00)) == 0xff800000U);
  CHECK(bits(f32_from_f16(0x7c01)) == 0x7fc02000U);  // signalling NaN comes out quiet
  // float8
  CHECK(f8e4m3_from_f32(448.0F) == 0x7e);
  CHECK(f8e4m3_from_f32(-0x1p-9F) == 0x81);
  CHECK(f8e4m3_from_f32(0x1p-10F) == 0x00);  // tie with 0
  CHECK(f8e5m2_from_f32(57344.0F) == 0x7b);
  CHECK(f8e5m2_from_f32(std::numeric_limits<float>::infinity()) == 0x7c);
  CHECK(bits(f32_from_f8e4m3(0xff)) == 0xfff00000U);
}

TEST_CASE("f16 and bf16 round-trip every finite value through f32") {
  std::size_t bad = 0;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const bool f16_nan = (x & 0x7c00) == 0x7c00 && (x & 0x3ff) != 0;
    const bool bf16_nan = (x & 0x7f80) == 0x7f80 && (x & 0x7f) != 0;
    if (!f16_nan && f16_from_f32(f32_from_f16(x)) != x) ++bad;
    if (!bf16_nan && bf16_from_f32(f32_from_bf16(x)) != x) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("can_cast: floating <-> floating, complex <-> complex, anything to itself") {
  for (dtype a : all_dtypes)
    for (dtype b : all_dtypes) {
      CAPTURE(name(a));
      CAPTURE(name(b));
      const bool expected = a == b || (is_floating(a) && is_floating(b)) || (info(a).is_complex && info(b).is_complex);
      CHECK(can_cast(a, b) == expected);
      if (!expected) {
        std::byte x[16]{}, y[16]{};
        CHECK_THROWS_AS(cast_run(a, x, b, y, 1), unsupported_error);
      }
    }
  try {
    check_cast(dtype::I32, dtype::F32);
    FAIL("no throw");
  } catch (const error& e) {
    CHECK(e.code() == errors::unsupported_cast);
    CHECK(std::string(e.what()).find("I32 to F32") != std::string::npos);
  }
}

TEST_CASE("cast_run between every pair of floating dtypes keeps values every format holds") {
  // Values exact in every floating format (f8 e4m3 included): small dyadic numbers and zeros.
  const std::vector<float> values = {0.0F, -0.0F, 1.0F, -1.5F, 0.25F, 3.0F, -0.125F, 12.0F, 0x1p-6F, -224.0F};
  const dtype floats[] = {dtype::F8_E4M3, dtype::F8_E5M2, dtype::F16, dtype::BF16, dtype::F32, dtype::F64};
  const std::size_t n = values.size();
  for (dtype a : floats)
    for (dtype b : floats) {
      CAPTURE(name(a));
      CAPTURE(name(b));
      std::vector<std::byte> src(n * itemsize(a)), dst(n * itemsize(b) + 3), back(n * 4);
      cast_run(dtype::F32, reinterpret_cast<const std::byte*>(values.data()), a, src.data(), n);
      cast_run(a, src.data(), b, dst.data() + 3, n);  // misaligned destination
      cast_run(b, dst.data() + 3, dtype::F32, back.data(), n);
      CHECK(std::memcmp(back.data(), values.data(), n * 4) == 0);
    }
}

TEST_CASE("cast_run: identity is a copy, complex widens and narrows, zero elements touch nothing") {
  const std::complex<float> c[2] = {{1.5F, -2.0F}, {0.1F, 3.0F}};
  std::complex<double> wide[2];
  cast_run(dtype::C64, reinterpret_cast<const std::byte*>(c), dtype::C128, reinterpret_cast<std::byte*>(wide), 2);
  CHECK(wide[1] == std::complex<double>(static_cast<double>(0.1F), 3.0));
  std::complex<float> narrow[2];
  cast_run(dtype::C128, reinterpret_cast<const std::byte*>(wide), dtype::C64, reinterpret_cast<std::byte*>(narrow), 2);
  CHECK(std::memcmp(narrow, c, sizeof c) == 0);
  const std::int32_t ints[3] = {1, -2, 3};
  std::int32_t copy[3] = {};
  cast_run(dtype::I32, reinterpret_cast<const std::byte*>(ints), dtype::I32, reinterpret_cast<std::byte*>(copy), 3);
  CHECK(std::equal(ints, ints + 3, copy));
  cast_run(dtype::F32, nullptr, dtype::BF16, nullptr, 0);
  cast_run(dtype::F32, nullptr, dtype::F32, nullptr, 0);
  // More elements than one internal block, with a tail.
  std::vector<float> big(5000);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) - 2500.0F;
  std::vector<std::uint16_t> h(big.size());
  cast_run(dtype::F32, reinterpret_cast<const std::byte*>(big.data()), dtype::F16, reinterpret_cast<std::byte*>(h.data()), big.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < big.size(); ++i) bad += h[i] != f16_from_f32(big[i]);
  CHECK(bad == 0);
}
