// formats::quantize (block-FP8): hand-made tensors with odd shapes and blocks, every byte compared
// with reference math written here (float8_e4m3fn decoded from its definition, the nearest code
// found by search, ties to the even code), the round trip through dequantize, the default
// selection, a torch.save tree, and the hostile cases: non-finite values, a block whose largest
// magnitude has no float32 reciprocal, wrong dtypes and ranks, a scale name already taken.
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
#include <limits>
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
  const fs::path d = fs::path(STATEDICT_TEST_TMP) / "unit-quantize";
  fs::create_directories(d);
  return d / name;
}

/// float8_e4m3fn decoded from its definition (bias 7, subnormals; S.1111.111 is NaN).
double e4m3(std::uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -v : v;
}

/// The e4m3 code nearest to v (|v| <= 448), ties to the even code, found by search.
std::uint8_t nearest_e4m3(float v) {
  const std::uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(v));
  std::uint8_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (std::uint8_t c = 0; c < 0x7f; ++c) {
    const double d = std::fabs(e4m3(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

struct expected {
  std::vector<std::uint8_t> q;
  std::vector<float> inv;
};

/// The reference: per block, amax = max |x|, m = f32(f32(1 / amax) * 448) (1 for a zero block),
/// q = nearest e4m3 of clamp(f32(x * m)), inverse scale f32(1 / m); blocks cut at the edges.
expected reference(const std::vector<float>& x, std::size_t mats, std::size_t rows, std::size_t cols, std::size_t br, std::size_t bc) {
  const std::size_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  expected e{std::vector<std::uint8_t>(x.size()), std::vector<float>(mats * sr * sc)};
  for (std::size_t m = 0; m < mats; ++m)
    for (std::size_t bi = 0; bi < sr; ++bi)
      for (std::size_t bj = 0; bj < sc; ++bj) {
        float amax = 0;
        for (std::size_t i = bi * br; i < std::min(rows, (bi + 1) * br); ++i)
          for (std::size_t j = bj * bc; j < std::min(cols, (bj + 1) * bc); ++j) amax = std::max(amax, std::fabs(x[(m * rows + i) * cols + j]));
        volatile float r = 1.0F / amax;  // one rounding per operation, as torch's kernels
        const float mul = amax > 0 ? static_cast<float>(r * 448.0F) : 1.0F;
        e.inv[(m * sr + bi) * sc + bj] = 1.0F / mul;
        for (std::size_t i = bi * br; i < std::min(rows, (bi + 1) * br); ++i)
          for (std::size_t j = bj * bc; j < std::min(cols, (bj + 1) * bc); ++j) {
            const std::size_t k = (m * rows + i) * cols + j;
            volatile float p = x[k] * mul;
            e.q[k] = nearest_e4m3(std::clamp(static_cast<float>(p), -448.0F, 448.0F));
          }
      }
  return e;
}

std::vector<float> random_values(std::size_t n, unsigned seed, float spread) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0F, spread);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

template <class T>
std::vector<T> read_as(const ShardedCheckpoint& ck, const std::string& name, dtype want) {
  Tensor t = read_tensor(ck, name);
  REQUIRE(t.dtype() == want);
  std::vector<T> v(static_cast<std::size_t>(t.numel()));
  std::memcpy(v.data(), t.data(), v.size() * sizeof(T));
  return v;
}

std::size_t count_mismatches(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  return bad;
}

std::size_t count_mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]);
  return bad;
}

}  // namespace

TEST_CASE("block-FP8 quantization of odd shapes, bit for bit with the reference, through save with small blocks") {
  // 300 x 200 in 128 x 128 blocks (cut on both sides), a zero block with -0.0, values near 448
  // times the block's scale, and a 3-d [2, 20, 33] tensor in 7 x 5 blocks (each crossing the
  // executor's pieces).
  std::vector<float> x = random_values(300 * 200, 1, 0.05F);
  for (std::size_t i = 128; i < 256; ++i)
    for (std::size_t j = 0; j < 128; ++j) x[i * 200 + j] = (i + j) % 3 ? 0.0F : -0.0F;
  x[5] = 1e4F;  // one large value: the rest of its block lands in e4m3's subnormals
  x[3 * 200 + 150] = -3.0F;
  std::vector<float> e = random_values(2 * 20 * 33, 2, 3.0F);
  NamedTensors t;
  t.emplace_back("a.weight", Tensor::from(x, {300, 200}));
  t.emplace_back("experts.w", Tensor::from(e, {2, 20, 33}));
  t.emplace_back("norm.weight", Tensor::from(random_values(200, 3, 1.0F), {200}));
  const ShardedCheckpoint ck = describe_views(t);

  formats::quantize_options o;
  o.partial_blocks = true;
  o.select = [](std::string_view n) { return n == "a.weight"; };
  ShardedCheckpoint q = formats::quantize(ck, o);
  o.block_rows = 7;
  o.block_cols = 5;
  o.select = [](std::string_view n) { return n == "experts.w"; };
  q = formats::quantize(q, o);
  REQUIRE(q.tensors.size() == 5);
  CHECK(q.find("a.weight")->dtype == dtype::F8_E4M3);
  CHECK(q.find("a.weight_scale_inv")->shape == shape_t{3, 2});
  CHECK(q.find("experts.w_scale_inv")->shape == shape_t{2, 3, 7});
  CHECK(q.find("norm.weight")->dtype == dtype::F32);

  const fs::path out = tmp("odd.safetensors");
  formats::save_options so;
  so.exec.memory_budget = 256 << 10;
  so.exec.threads = 2;
  (void)formats::save(q, out, so);
  const auto back = formats::open(out).checkpoint;
  const expected ea = reference(x, 1, 300, 200, 128, 128), ee = reference(e, 2, 20, 33, 7, 5);
  CHECK(count_mismatches(read_as<std::uint8_t>(back, "a.weight", dtype::F8_E4M3), ea.q) == 0);
  CHECK(count_mismatches(read_as<float>(back, "a.weight_scale_inv", dtype::F32), ea.inv) == 0);
  CHECK(count_mismatches(read_as<std::uint8_t>(back, "experts.w", dtype::F8_E4M3), ee.q) == 0);
  CHECK(count_mismatches(read_as<float>(back, "experts.w_scale_inv", dtype::F32), ee.inv) == 0);
  CHECK(ea.inv[2] == 1.0F);  // the zero block [1, 0]
  const auto qa = read_as<std::uint8_t>(back, "a.weight", dtype::F8_E4M3);
  CHECK(qa[128 * 200 + 0] == 0x00);
  CHECK(qa[128 * 200 + 1] == 0x80);  // -0.0 keeps its sign
  CHECK(qa[5] == 0x7e);  // the block's maximum becomes 448 exactly
}

TEST_CASE("quantize then dequantize: zeros exact, every value within half an e4m3 step of its block") {
  std::vector<float> x = random_values(256 * 384, 7, 0.02F);
  for (std::size_t j = 0; j < 128; ++j) x[j] = 0.0F;
  NamedTensors t;
  t.emplace_back("model.layers.0.mlp.down_proj.weight", Tensor::from(x, {256, 384}));
  const fs::path p = tmp("rt.safetensors"), q = tmp("rt-q.safetensors");
  (void)formats::save(describe_views(t), p);
  (void)formats::save(formats::quantize(formats::open(p).checkpoint), q);
  const ShardedCheckpoint qc = formats::open(q).checkpoint;
  REQUIRE(qc.find("model.layers.0.mlp.down_proj.weight")->dtype == dtype::F8_E4M3);
  const auto inv = read_as<float>(qc, "model.layers.0.mlp.down_proj.weight_scale_inv", dtype::F32);
  REQUIRE(inv.size() == 6);
  const auto d = read_as<float>(formats::dequantize(qc), "model.layers.0.mlp.down_proj.weight", dtype::F32);
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < 256; ++i)
    for (std::size_t j = 0; j < 384; ++j) {
      const std::size_t k = i * 384 + j;
      const auto s = static_cast<double>(inv[(i / 128) * 3 + j / 128]);
      // e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, or 2^-10 in its subnormals.
      const double bound = std::max(std::fabs(static_cast<double>(x[k])) / 16, std::ldexp(s, -10)) * (1 + 1e-6);
      const double err = std::fabs(static_cast<double>(x[k]) - static_cast<double>(d[k]));
      worst = std::max(worst, err / bound);
      bad += err > bound;
    }
  CHECK(bad == 0);
  MESSAGE("worst error / bound: " << worst);
  for (std::size_t j = 0; j < 128; ++j) CHECK(d[j] == 0.0F);
}

TEST_CASE("the default selection: 2-D Linear weights, not embeddings, lm_head, norms, routers or partial blocks") {
  for (const char* yes : {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.gate_proj.weight", "h.0.attn.c_proj.weight",
                          "model.layers.1.mlp.experts.7.down_proj.weight"})
    CHECK_MESSAGE(formats::default_quantized(yes), yes);
  for (const char* no : {"model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight", "model.norm.weight",
                         "model.layers.0.input_layernorm.weight", "h.0.ln_1.weight", "model.layers.1.mlp.gate.weight",
                         "model.layers.1.mlp.router.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj"})
    CHECK_MESSAGE(!formats::default_quantized(no), no);
  NamedTensors t;
  t.emplace_back("a.weight", Tensor(dtype::BF16, {128, 256}));
  t.emplace_back("b.weight", Tensor(dtype::BF16, {200, 256}));   // partial blocks: left as it is
  t.emplace_back("c.weight", Tensor(dtype::I64, {128, 128}));    // not floating
  t.emplace_back("d.weight", Tensor(dtype::F16, {2, 128, 128})); // 3-d: not a Linear weight
  t.emplace_back("e.weight", Tensor(dtype::F64, {128, 128}));    // F64: not taken by default
  const ShardedCheckpoint in = describe_views(t);
  const ShardedCheckpoint q = formats::quantize(in);
  CHECK(q.find("a.weight")->dtype == dtype::F8_E4M3);
  CHECK(q.find("a.weight_scale_inv"));
  for (const char* n : {"b.weight", "c.weight", "d.weight", "e.weight"}) {
    CHECK_MESSAGE(q.find(n)->dtype == in.find(n)->dtype, n);
    CHECK_MESSAGE(!q.find(std::string(n) + "_scale_inv"), n);
  }
  CHECK(q.tensors.size() == 6);
}

TEST_CASE("hostile inputs: non-finite values, scales beyond float32, wrong dtypes and ranks, names taken") {
  std::string what;
  auto one = [](const char* n, Tensor x) {
    NamedTensors t;
    t.emplace_back(n, std::move(x));
    return describe_views(t);
  };
  auto fails_on_save = [&](const ShardedCheckpoint& ck, const std::string& file) {
    const fs::path out = tmp(file);
    fs::remove(out);
    const int id = error_of([&] { (void)formats::save(formats::quantize(ck), out); }, &what);
    CHECK(!fs::exists(out));
    return id;
  };
  std::vector<float> x = random_values(128 * 256, 5, 1.0F);
  x[3 * 256 + 130] = std::nanf("");
  CHECK(fails_on_save(one("x.weight", Tensor::from(x, {128, 256})), "nan.safetensors") == errors::quantize_bad_value.id);
  CHECK(what.find("'x.weight'") != std::string::npos);
  CHECK(what.find("[3, 130]") != std::string::npos);
  x = random_values(128 * 256, 5, 1.0F);
  x[200] = -std::numeric_limits<float>::infinity();
  CHECK(fails_on_save(one("x.weight", Tensor::from(x, {128, 256})), "inf.safetensors") == errors::quantize_bad_value.id);
  // A block whose largest magnitude is an f32 subnormal: 1 / amax overflows (transformers would
  // write NaN for its zeros); refused, naming the block.
  x.assign(128 * 256, 0.0F);
  x[129] = 0x1p-130F;
  CHECK(fails_on_save(one("x.weight", Tensor::from(x, {128, 256})), "tiny.safetensors") == errors::quantize_bad_value.id);
  CHECK(what.find("block [0, 1]") != std::string::npos);
  CHECK(what.find("7.34683969e-40") != std::string::npos);
  // BF16 NaN too.
  Tensor b(dtype::BF16, {128, 128});
  std::memset(b.data(), 0, b.nbytes());
  const std::uint16_t nan = 0x7fc0;
  std::memcpy(static_cast<std::byte*>(b.data()) + 2 * 777, &nan, 2);
  CHECK(fails_on_save(one("b.weight", b), "bf16nan.safetensors") == errors::quantize_bad_value.id);

  formats::quantize_options o;
  o.select = [](std::string_view) { return true; };
  CHECK(error_of([&] { (void)formats::quantize(one("n.weight", Tensor(dtype::F32, {128})), o); }, &what) == errors::quantize_bad_tensor.id);
  CHECK(what.find("'n.weight'") != std::string::npos);
  CHECK(error_of([&] { (void)formats::quantize(one("i.weight", Tensor(dtype::I32, {128, 128})), o); }) == errors::quantize_bad_tensor.id);
  CHECK(error_of([&] { (void)formats::quantize(one("f.weight", Tensor(dtype::F8_E4M3, {128, 128})), o); }) == errors::quantize_bad_tensor.id);
  o.block_rows = 0;
  CHECK(error_of([&] { (void)formats::quantize(one("a.weight", Tensor(dtype::F32, {128, 128})), o); }) == errors::quantize_bad_tensor.id);
  NamedTensors taken;
  taken.emplace_back("a.weight", Tensor(dtype::F32, {128, 128}));
  taken.emplace_back("a.weight_scale_inv", Tensor(dtype::F32, {3}));
  CHECK(error_of([&] { (void)formats::quantize(describe_views(taken)); }, &what) == errors::quantize_name_taken.id);
  CHECK(what.find("'a.weight_scale_inv'") != std::string::npos);
  // A tensor stored in two chunks (a sharded checkpoint) is refused, naming it.
  ShardedCheckpoint two = one("a.weight", Tensor(dtype::F32, {256, 128}));
  TensorInfo& ti = two.tensors[0];
  Chunk second = ti.chunks[0];
  ti.chunks[0].region = Box{{0, 0}, {128, 128}};
  second.region = Box{{128, 0}, {128, 128}};
  second.at.byte_offset += 128 * 128 * 4;
  ti.chunks.push_back(second);
  CHECK(error_of([&] { (void)formats::quantize(two); }, &what) == errors::dequantize_layout.id);
  CHECK(what.find("quantizing") != std::string::npos);
}

TEST_CASE("a torch.save tree: the quantized tensor takes its entry, its scales an entry beside it, values stay") {
  std::vector<float> x = random_values(128 * 256, 9, 0.1F);
  const Tensor w = Tensor::from(x, {128, 256});
  const Tensor n = Tensor::from(random_values(256, 10, 1.0F), {256});
  Dict layer;
  layer.set("weight", w.view());
  Dict model;
  model.set("proj", Value(layer));
  model.set("norm.weight", n.view());
  Dict sd;
  sd.set("model", Value(model));
  sd.set("epoch", 3);
  const fs::path p = tmp("tree.pt");
  torch::save(p, Value(sd));
  const ShardedCheckpoint ck = formats::open(p).checkpoint;
  REQUIRE(!ck.skeleton.is_null());
  const ShardedCheckpoint q = formats::quantize(ck);
  formats::check_consistent(q);
  REQUIRE(q.tensors.size() == 3);
  const fs::path out = tmp("tree-q.pt");
  (void)formats::save(q, out);
  const ShardedCheckpoint back = formats::open(out).checkpoint;
  const auto values = skeleton_values(back.skeleton);
  REQUIRE(values.size() == 1);
  CHECK(values[0].first == "epoch");
  const expected e = reference(x, 1, 128, 256, 128, 128);
  CHECK(count_mismatches(read_as<std::uint8_t>(back, "model.proj.weight", dtype::F8_E4M3), e.q) == 0);
  CHECK(count_mismatches(read_as<float>(back, "model.proj.weight_scale_inv", dtype::F32), e.inv) == 0);
  CHECK(back.find("model.norm.weight")->dtype == dtype::F32);
}
