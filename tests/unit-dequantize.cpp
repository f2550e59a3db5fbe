// formats::dequantize (block-FP8, MXFP4) and cast()'s refusal of quantized pairs: hand-made small
// tensors with odd shapes, every value compared bit for bit with reference math written here
// (decoded independently of core/dtype.hpp, multiplied in double, which holds the products
// exactly, then rounded), and the hostile cases: missing, misshapen and non-finite scales.
#include <doctest/doctest.h>

#include <statedict/exec/read.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/io/torch_save.hpp>
#include <statedict/shard/views.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

using namespace statedict;
namespace fs = std::filesystem;
using statedict_test::error_of;

namespace {

fs::path tmp(const std::string& name) {
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "unit-dequantize";
  fs::create_directories(d);
  return d / name;
}

/// float8_e4m3fn decoded from its definition (bias 7, subnormals, S.1111.111 NaN).
double e4m3(std::uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -v : v;
}

/// Round to nearest even of an f32 to bf16 (finite values).
std::uint16_t to_bf16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
}

Tensor bytes_tensor(dtype t, shape_t shape, const std::vector<std::uint8_t>& b) {
  Tensor x(t, std::move(shape));
  REQUIRE(x.nbytes() == b.size());
  std::memcpy(x.data(), b.data(), b.size());
  return x;
}

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed, bool no_e4m3_nan) {
  std::mt19937 g(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) {
    x = static_cast<std::uint8_t>(g() & 0xff);
    if (no_e4m3_nan && (x & 0x7f) == 0x7f) x = 0x7e;
  }
  return v;
}

std::vector<float> random_scales(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(1e-4F, 3.0F);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

std::vector<float> read_f32(const ShardedCheckpoint& ck, const std::string& name) {
  Tensor t = read_tensor(ck, name, dtype::F32);
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  std::memcpy(v.data(), t.data(), v.size() * 4);
  return v;
}

struct fp8_case {
  std::vector<std::uint8_t> w;
  std::vector<float> s;
  ShardedCheckpoint ck;
};

/// `layer.weight` F8_E4M3 [rows, cols] with `layer.weight_scale_inv` [ceil(rows/br), ceil(cols/bc)],
/// and `norm` F32 [3], not quantized.
fp8_case fp8(std::uint64_t rows, std::uint64_t cols, std::uint64_t br, std::uint64_t bc, unsigned seed = 1) {
  fp8_case c;
  const std::uint64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  c.w = random_bytes(rows * cols, seed, true);
  c.s = random_scales(sr * sc, seed + 1);
  NamedTensors t;
  t.emplace_back("layer.weight", bytes_tensor(dtype::F8_E4M3, {static_cast<dim_t>(rows), static_cast<dim_t>(cols)}, c.w));
  t.emplace_back("layer.weight_scale_inv", Tensor::from(c.s, {static_cast<dim_t>(sr), static_cast<dim_t>(sc)}));
  t.emplace_back("norm", Tensor::from({1.5F, -2.0F, 0.1F}, {3}));
  c.ck = describe_views(t);
  return c;
}

}  // namespace

TEST_CASE("block-FP8 200 x 300 in 128 x 128 blocks: partial last blocks, f32 product, then bf16") {
  auto c = fp8(200, 300, 128, 128);
  const ShardedCheckpoint d = formats::dequantize(c.ck);
  REQUIRE(d.tensors.size() == 2);  // the scales go
  CHECK(d.find("layer.weight_scale_inv") == nullptr);
  const TensorInfo* w = d.find("layer.weight");
  REQUIRE(w);
  CHECK(w->dtype == dtype::F32);
  CHECK(w->shape == shape_t{200, 300});
  const auto got = read_f32(d, "layer.weight");
  Tensor bf = read_tensor(d, "layer.weight", dtype::BF16);
  const auto* bfv = reinterpret_cast<const std::uint16_t*>(bf.data());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < 200; ++i)
    for (std::size_t j = 0; j < 300; ++j) {
      const double exact = e4m3(c.w[i * 300 + j]) * static_cast<double>(c.s[(i / 128) * 3 + j / 128]);
      const auto ref = static_cast<float>(exact);  // the one rounding of the product to f32
      if (std::bit_cast<std::uint32_t>(got[i * 300 + j]) != std::bit_cast<std::uint32_t>(ref)) ++bad;
      if (bfv[i * 300 + j] != to_bf16(ref)) ++bad;
    }
  CHECK(bad == 0);
  CHECK(read_f32(d, "norm") == std::vector<float>{1.5F, -2.0F, 0.1F});  // untouched
}

TEST_CASE("block-FP8 with other block sizes, a 3-d expert tensor, and through cast + save") {
  // Blocks of 7 x 5 over 20 x 33: every block boundary crosses the executor's pieces.
  auto c = fp8(20, 33, 7, 5, 7);
  formats::dequantize_options o;
  o.block_rows = 7;
  o.block_cols = 5;
  CHECK(error_of([&] { (void)formats::dequantize(c.ck); }) == errors::dequantize_bad_scale.id);  // 128 x 128 wants [1, 1]
  ShardedCheckpoint d = formats::dequantize(c.ck, o);
  formats::cast(d, dtype::F16);
  const fs::path out = tmp("fp8.safetensors");
  formats::save_options so;
  so.exec.memory_budget = 256 << 10;  // the smallest budget: many small blocks
  so.exec.threads = 2;
  (void)formats::save(d, out, so);
  const auto back = formats::open(out).checkpoint;
  Tensor h = read_tensor(back, "layer.weight");
  REQUIRE(h.dtype() == dtype::F16);
  Tensor want(dtype::F32, {20, 33});
  for (std::size_t i = 0; i < 20; ++i)
    for (std::size_t j = 0; j < 33; ++j)
      want.values<float>()[i * 33 + j] = static_cast<float>(e4m3(c.w[i * 33 + j]) * static_cast<double>(c.s[(i / 7) * 7 + j / 5]));
  CHECK(equal_bytes(h, contiguous(want, dtype::F16)));

  // A 3-d tensor [2, 130, 260] named as transformers names experts: N with N_scale_inv.
  std::vector<std::uint8_t> e = random_bytes(2 * 130 * 260, 11, true);
  std::vector<float> es = random_scales(2 * 2 * 3, 12);
  NamedTensors t;
  t.emplace_back("experts.gate_up_proj", bytes_tensor(dtype::F8_E4M3, {2, 130, 260}, e));
  t.emplace_back("experts.gate_up_proj_scale_inv", Tensor::from(es, {2, 2, 3}));
  const ShardedCheckpoint x = formats::dequantize(describe_views(t));
  REQUIRE(x.tensors.size() == 1);
  const auto got = read_f32(x, "experts.gate_up_proj");
  std::size_t bad = 0;
  for (std::size_t m = 0; m < 2; ++m)
    for (std::size_t i = 0; i < 130; ++i)
      for (std::size_t j = 0; j < 260; ++j) {
        const std::size_t k = (m * 130 + i) * 260 + j;
        const auto ref = static_cast<float>(e4m3(e[k]) * static_cast<double>(es[(m * 2 + i / 128) * 3 + j / 128]));
        bad += std::bit_cast<std::uint32_t>(got[k]) != std::bit_cast<std::uint32_t>(ref);
      }
  CHECK(bad == 0);
}

TEST_CASE("block-FP8 with BF16 scales: each widened exactly to f32 first") {
  const auto w = random_bytes(130 * 5, 31, true);
  const std::vector<std::uint16_t> s = {0x3c23, 0x3b01};  // bf16 scales of rows 0..127 and 128..129
  NamedTensors t;
  t.emplace_back("q.weight", bytes_tensor(dtype::F8_E4M3, {130, 5}, w));
  Tensor st(dtype::BF16, {2, 1});
  std::memcpy(st.data(), s.data(), 4);
  t.emplace_back("q.weight_scale_inv", st);
  const auto got = read_f32(formats::dequantize(describe_views(t)), "q.weight");
  std::size_t bad = 0;
  for (std::size_t i = 0; i < 130 * 5; ++i) {
    const auto scale = static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(s[i / 5 / 128]) << 16));
    bad += std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(static_cast<float>(e4m3(w[i]) * scale));
  }
  CHECK(bad == 0);
}

TEST_CASE("MXFP4 [E, N, G, 16] becomes [E, G * 32, N], low nibble first, 2^(e - 127)") {
  constexpr std::size_t E = 2, N = 5, G = 3;
  const auto blocks = random_bytes(E * N * G * 16, 21, false);
  std::vector<std::uint8_t> scales = random_bytes(E * N * G, 22, false);
  for (auto& s : scales) s = static_cast<std::uint8_t>(110 + s % 30);
  scales[0] = 0;    // 2^-127: subnormal values
  scales[5] = 254;  // 2^127: 6 * 2^127 overflows to inf
  scales[7] = 1;
  NamedTensors t;
  t.emplace_back("mlp.experts.gate_up_proj_blocks", bytes_tensor(dtype::U8, {E, N, G, 16}, blocks));
  t.emplace_back("mlp.experts.gate_up_proj_scales", bytes_tensor(dtype::U8, {E, N, G}, scales));
  t.emplace_back("mlp.experts.gate_up_proj_bias", Tensor::from({1.0F, 2.0F}, {2}));
  const ShardedCheckpoint d = formats::dequantize(describe_views(t));
  REQUIRE(d.tensors.size() == 2);
  const TensorInfo* x = d.find("mlp.experts.gate_up_proj");
  REQUIRE(x);
  CHECK(x->shape == shape_t{E, G * 32, N});
  CHECK(d.find("mlp.experts.gate_up_proj_blocks") == nullptr);
  CHECK(d.find("mlp.experts.gate_up_proj_scales") == nullptr);
  const double lut[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const auto got = read_f32(d, "mlp.experts.gate_up_proj");
  Tensor bf = read_tensor(d, "mlp.experts.gate_up_proj", dtype::BF16);
  const auto* bfv = reinterpret_cast<const std::uint16_t*>(bf.data());
  std::size_t bad = 0, infs = 0;
  for (std::size_t e = 0; e < E; ++e)
    for (std::size_t k = 0; k < G * 32; ++k)
      for (std::size_t n = 0; n < N; ++n) {
        const std::size_t g = k / 32, q = k % 32, row = (e * N + n) * G + g;
        const std::uint8_t byte = blocks[row * 16 + q / 2];
        const unsigned nib = q % 2 ? byte >> 4 : byte & 15;
        const double v = (nib & 8 ? -1 : 1) * std::ldexp(lut[nib & 7], scales[row] - 127);
        const auto ref = static_cast<float>(v);
        infs += std::isinf(ref);
        const std::size_t at = (e * G * 32 + k) * N + n;
        bad += std::bit_cast<std::uint32_t>(got[at]) != std::bit_cast<std::uint32_t>(ref);
        if (!std::isinf(ref)) bad += bfv[at] != to_bf16(ref);
      }
  CHECK(bad == 0);
  CHECK(infs > 0);
}

TEST_CASE("cast refuses quantized pairs unless dequantized or kept") {
  auto c = fp8(10, 10, 128, 128);
  std::string what;
  CHECK(error_of([&] { formats::cast(c.ck, dtype::BF16); }, &what) == errors::dequantize_needed.id);
  CHECK(what.find("'layer.weight'") != std::string::npos);
  CHECK(what.find("--dequantize") != std::string::npos);
  formats::cast_options keep;
  keep.keep = [](std::string_view n) { return n == "layer.weight"; };
  ShardedCheckpoint k = c.ck;
  formats::cast(k, dtype::BF16, keep);
  CHECK(k.find("layer.weight")->dtype == dtype::F8_E4M3);
  CHECK(k.find("norm")->dtype == dtype::BF16);

  NamedTensors t;
  t.emplace_back("a_blocks", Tensor(dtype::U8, {1, 1, 1, 16}));
  t.emplace_back("a_scales", Tensor(dtype::U8, {1, 1, 1}));
  ShardedCheckpoint m = describe_views(t);
  CHECK(error_of([&] { formats::cast(m, dtype::F16); }) == errors::dequantize_needed.id);
  // Dequantizing one scheme leaves the other refused.
  formats::dequantize_options fp8only;
  fp8only.scheme = formats::quant_scheme::fp8_block;
  ShardedCheckpoint m2 = formats::dequantize(m, fp8only);
  CHECK(error_of([&] { formats::cast(m2, dtype::F16); }) == errors::dequantize_needed.id);
}

TEST_CASE("hostile pairs: missing, misshapen, mistyped and non-finite scales") {
  auto pair = [](const char* wn, Tensor w, const char* sn, Tensor s) {
    NamedTensors t;
    t.emplace_back(wn, std::move(w));
    if (sn) t.emplace_back(sn, std::move(s));
    return describe_views(t);
  };
  const Tensor w(dtype::F8_E4M3, {200, 300});
  std::string what;
  CHECK(error_of([&] { (void)formats::dequantize(pair("x.weight", w, nullptr, Tensor())); }, &what) == errors::dequantize_no_scale.id);
  CHECK(what.find("'x.weight'") != std::string::npos);
  CHECK(error_of([&] { (void)formats::dequantize(pair("x.weight", w, "x.weight_scale_inv", Tensor(dtype::F32, {2, 2}))); }, &what) ==
        errors::dequantize_bad_scale.id);
  CHECK(what.find("[2, 3]") != std::string::npos);
  CHECK(error_of([&] { (void)formats::dequantize(pair("x.weight", w, "x.weight_scale_inv", Tensor(dtype::I32, {2, 3}))); }) ==
        errors::dequantize_bad_scale.id);
  CHECK(error_of([&] { (void)formats::dequantize(pair("x.weight", Tensor(dtype::BF16, {200, 300}), "x.weight_scale_inv", Tensor(dtype::F32, {2, 3}))); }) ==
        errors::dequantize_bad_blocks.id);
  CHECK(error_of([&] { (void)formats::dequantize(pair("y_scale_inv", Tensor(dtype::F32, {1}), nullptr, Tensor())); }) ==
        errors::dequantize_bad_scale.id);
  // MXFP4: blocks count mismatch, a row of 15 bytes, scales alone, the output's name taken.
  CHECK(error_of([&] { (void)formats::dequantize(pair("a_blocks", Tensor(dtype::U8, {2, 4, 3, 16}), "a_scales", Tensor(dtype::U8, {2, 4, 2}))); }) ==
        errors::dequantize_bad_scale.id);
  CHECK(error_of([&] { (void)formats::dequantize(pair("a_blocks", Tensor(dtype::U8, {2, 4, 3, 15}), "a_scales", Tensor(dtype::U8, {2, 4, 3}))); }) ==
        errors::dequantize_bad_blocks.id);
  CHECK(error_of([&] { (void)formats::dequantize(pair("a_scales", Tensor(dtype::U8, {2, 4, 3}), nullptr, Tensor())); }) ==
        errors::dequantize_bad_scale.id);
  // Tensors merely named like MXFP4 (F32 "_blocks" / "_scales") are not quantized: they pass through.
  CHECK(formats::dequantize(pair("layer_scales", Tensor::from({1.0F}, {1}), "down_blocks", Tensor::from({2.0F}, {1}))).tensors.size() == 2);
  NamedTensors taken;
  taken.emplace_back("a_blocks", Tensor(dtype::U8, {1, 1, 1, 16}));
  taken.emplace_back("a_scales", Tensor(dtype::U8, {1, 1, 1}));
  taken.emplace_back("a", Tensor(dtype::F32, {1}));
  CHECK(error_of([&] { (void)formats::dequantize(describe_views(taken)); }) == errors::dequantize_name_taken.id);

  // Non-finite scales are only seen while streaming: the error names the tensor, no file appears.
  auto c = fp8(130, 140, 128, 128);
  std::vector<float> s = c.s;
  s[3] = std::nanf("");
  ShardedCheckpoint nan = pair("x.weight", bytes_tensor(dtype::F8_E4M3, {130, 140}, c.w), "x.weight_scale_inv", Tensor::from(s, {2, 2}));
  ShardedCheckpoint d = formats::dequantize(nan);
  formats::cast(d, dtype::BF16);
  const fs::path out = tmp("nan.safetensors");
  fs::remove(out);
  CHECK(error_of([&] { (void)formats::save(d, out); }, &what) == errors::dequantize_scale_value.id);
  CHECK(what.find("'x.weight'") != std::string::npos);
  CHECK(!fs::exists(out));
  std::vector<std::uint8_t> e8(6, 127);
  e8[4] = 0xff;
  ShardedCheckpoint mx = pair("b_blocks", bytes_tensor(dtype::U8, {1, 2, 3, 16}, std::vector<std::uint8_t>(96, 0x21)), "b_scales", bytes_tensor(dtype::U8, {1, 2, 3}, e8));
  CHECK(error_of([&] { (void)read_tensor(formats::dequantize(mx), "b"); }, &what) == errors::dequantize_scale_value.id);
  CHECK(what.find("'b'") != std::string::npos);
}

TEST_CASE("a torch.save tree: the computed tensors take the entries, the scales' entries go, values stay") {
  auto c = fp8(130, 140, 128, 128, 41);
  const Tensor w = bytes_tensor(dtype::F8_E4M3, {130, 140}, c.w);
  const Tensor s = Tensor::from(c.s, {2, 2});
  const Tensor blocks = bytes_tensor(dtype::U8, {2, 3, 1, 16}, random_bytes(96, 42, false));
  const Tensor scales = bytes_tensor(dtype::U8, {2, 3, 1}, std::vector<std::uint8_t>(6, 127));
  Dict model;
  model.set("a.weight", w.view());
  model.set("a.weight_scale_inv", s.view());
  model.set("e.gate_up_proj_blocks", blocks.view());
  model.set("e.gate_up_proj_scales", scales.view());
  Dict sd;
  sd.set("model", Value(model));
  sd.set("step", 7);
  const fs::path p = tmp("tree.pt");
  torch::save(p, Value(sd));
  const ShardedCheckpoint ck = formats::open(p).checkpoint;
  REQUIRE(!ck.skeleton.is_null());
  ShardedCheckpoint d = formats::dequantize(ck);
  formats::cast(d, dtype::BF16);
  formats::check_consistent(d);
  REQUIRE(d.tensors.size() == 2);
  CHECK(d.find("model.a.weight")->dtype == dtype::BF16);
  CHECK(d.find("model.e.gate_up_proj")->shape == shape_t{2, 32, 3});
  const fs::path out = tmp("tree-out.pt");
  (void)formats::save(d, out);
  const ShardedCheckpoint back = formats::open(out).checkpoint;
  const auto values = skeleton_values(back.skeleton);
  REQUIRE(values.size() == 1);
  CHECK(values[0].first == "step");
  Tensor a = read_tensor(back, "model.a.weight", dtype::F32);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < 130 * 140; ++i) {
    const auto ref = static_cast<float>(e4m3(c.w[i]) * static_cast<double>(c.s[(i / 140 / 128) * 2 + (i % 140) / 128]));
    const auto bf = static_cast<std::uint32_t>(to_bf16(ref)) << 16;
    bad += std::bit_cast<std::uint32_t>(a.values<float>()[i]) != bf;
  }
  CHECK(bad == 0);
}
