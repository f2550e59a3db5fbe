// `statedict convert --dequantize`: a small block-FP8 Hugging Face folder and a small MXFP4
// safetensors file, made here, converted by the tool and compared bit for bit with reference
// math (e4m3 / e2m1 decoded from their definitions, products in double, then rounded); the
// refusal of a plain --dtype cast, the block size read from config.json, a NaN scale.
#include "cli_util.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

using namespace cli_test;
namespace sd = statedict;

namespace {

double e4m3(std::uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -v : v;
}

std::uint16_t to_bf16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
}

sd::Tensor bytes_tensor(sd::dtype t, sd::shape_t shape, const std::vector<std::uint8_t>& b) {
  sd::Tensor x(t, std::move(shape));
  REQUIRE(x.nbytes() == b.size());
  std::memcpy(x.data(), b.data(), b.size());
  return x;
}

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) {
    x = static_cast<std::uint8_t>(g() & 0xff);
    if ((x & 0x7f) == 0x7f) x = 0x3c;  // no e4m3 NaN
  }
  return v;
}

void save(const sd::NamedTensors& t, const fs::path& p) { (void)sd::formats::save(sd::describe_views(t), p); }

std::vector<std::uint16_t> bf16_of(const fs::path& file, const std::string& name, sd::shape_t shape) {
  const auto ck = sd::formats::open(file).checkpoint;
  const sd::TensorInfo* t = ck.find(name);
  REQUIRE_MESSAGE(t, name << " is not in " << file.string());
  CHECK(t->dtype == sd::dtype::BF16);
  CHECK(t->shape == shape);
  sd::Tensor x = sd::read_tensor(ck, name);
  std::vector<std::uint16_t> v(static_cast<std::size_t>(x.numel()));
  std::memcpy(v.data(), x.data(), v.size() * 2);
  return v;
}

bool mentions(const run_result& r, const std::string& s) { return r.err.find(s) != std::string::npos; }

}  // namespace

TEST_CASE("convert --dequantize fp8-block: a Hugging Face folder of 200 x 300 and 64 x 64 blocks") {
  const fs::path d = scratch("dequantize-fp8");
  const fs::path in = d / "in";
  fs::create_directories(in);
  const auto w = random_bytes(200 * 300, 1);
  std::vector<float> s(4 * 5);
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = 0.001F * static_cast<float>(i + 1) + 1e-6F;
  sd::NamedTensors t;
  t.emplace_back("model.layers.0.mlp.down_proj.weight", bytes_tensor(sd::dtype::F8_E4M3, {200, 300}, w));
  t.emplace_back("model.layers.0.mlp.down_proj.weight_scale_inv", sd::Tensor::from(s, {4, 5}));
  t.emplace_back("model.norm.weight", sd::Tensor::from({0.5F, 1.25F}, {2}));
  save(t, in / "model.safetensors");
  write_file(in / "config.json",
             R"({"model_type": "deepseek_v3", "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})");
  write_file(in / "tokenizer_config.json", "{}");

  // A plain cast refuses, naming the option; nothing is written.
  run_result r = cli({"convert", in.string(), (d / "cast").string(), "--to", "hf", "--dtype", "BF16"});
  CHECK_MESSAGE(r.code == 2, r.describe());
  CHECK(mentions(r, "--dequantize"));
  CHECK(mentions(r, "down_proj.weight"));
  CHECK(!fs::exists(d / "cast" / "model.safetensors"));
  r = cli({"convert", in.string(), (d / "x").string(), "--to", "hf", "--dequantize", "fp8-block"});
  CHECK_MESSAGE(r.code == 2, r.describe());  // needs --dtype

  r = cli({"convert", in.string(), (d / "out").string(), "--to", "hf", "--dtype", "BF16", "--dequantize", "fp8-block",
           "--memory-budget", "256KiB"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  const fs::path out = d / "out" / "model.safetensors";
  const auto ck = sd::formats::open(d / "out").checkpoint;
  CHECK(ck.tensors.size() == 2);
  CHECK(ck.find("model.layers.0.mlp.down_proj.weight_scale_inv") == nullptr);
  const auto got = bf16_of(out, "model.layers.0.mlp.down_proj.weight", {200, 300});
  std::size_t bad = 0;
  for (std::size_t i = 0; i < 200; ++i)
    for (std::size_t j = 0; j < 300; ++j) {
      const auto ref = static_cast<float>(e4m3(w[i * 300 + j]) * static_cast<double>(s[(i / 64) * 5 + j / 64]));
      bad += got[i * 300 + j] != to_bf16(ref);
    }
  CHECK(bad == 0);
  CHECK(bf16_of(out, "model.norm.weight", {2}) == std::vector<std::uint16_t>{0x3f00, 0x3fa0});
  // The folder's config.json comes along without its quantization_config, in the output's dtype.
  const json config = load_json(d / "out" / "config.json");
  CHECK(!config.contains("quantization_config"));
  CHECK(config.value("torch_dtype", "") == "bfloat16");
  CHECK(config.value("model_type", "") == "deepseek_v3");
  CHECK(read_file(d / "out" / "tokenizer_config.json") == "{}");

  // A NaN scale: exit 2 naming the tensor, no output file.
  std::vector<float> s6(s.begin(), s.begin() + 6);
  s6[4] = std::nanf("");
  sd::NamedTensors bad_t;
  bad_t.emplace_back("m.weight", bytes_tensor(sd::dtype::F8_E4M3, {200, 300}, w));
  bad_t.emplace_back("m.weight_scale_inv", sd::Tensor::from(s6, {2, 3}));
  save(bad_t, d / "nan.safetensors");
  r = cli({"convert", (d / "nan.safetensors").string(), (d / "nan-out.safetensors").string(), "--dtype", "BF16", "--dequantize", "auto"});
  CHECK(r.code == 2);
  CHECK(mentions(r, "'m.weight'"));
  CHECK(mentions(r, "864"));
  CHECK(!fs::exists(d / "nan-out.safetensors"));
  drop_scratch("dequantize-fp8");
}

TEST_CASE("convert --dequantize mxfp4: gpt-oss experts [E, N, G, 16] become [E, G * 32, N]") {
  const fs::path d = scratch("dequantize-mxfp4");
  constexpr std::size_t E = 3, N = 4, G = 2;
  const auto blocks = random_bytes(E * N * G * 16, 5);
  std::vector<std::uint8_t> scales(E * N * G);
  for (std::size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<std::uint8_t>(118 + (i * 7) % 17);
  sd::NamedTensors t;
  t.emplace_back("model.layers.0.mlp.experts.down_proj_blocks", bytes_tensor(sd::dtype::U8, {E, N, G, 16}, blocks));
  t.emplace_back("model.layers.0.mlp.experts.down_proj_scales", bytes_tensor(sd::dtype::U8, {E, N, G}, scales));
  save(t, d / "in.safetensors");
  run_result r = cli({"convert", (d / "in.safetensors").string(), (d / "cast.safetensors").string(), "--dtype", "BF16"});
  CHECK(r.code == 2);
  CHECK(mentions(r, "--dequantize"));
  r = cli({"convert", (d / "in.safetensors").string(), (d / "out.safetensors").string(), "--dtype", "BF16", "--dequantize", "mxfp4"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  const auto got = bf16_of(d / "out.safetensors", "model.layers.0.mlp.experts.down_proj", {E, G * 32, N});
  const double lut[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  std::size_t bad = 0;
  for (std::size_t e = 0; e < E; ++e)
    for (std::size_t k = 0; k < G * 32; ++k)
      for (std::size_t n = 0; n < N; ++n) {
        const std::size_t row = (e * N + n) * G + k / 32, q = k % 32;
        const unsigned nib = q % 2 ? blocks[row * 16 + q / 2] >> 4 : blocks[row * 16 + q / 2] & 15;
        const double v = (nib & 8 ? -1 : 1) * std::ldexp(lut[nib & 7], scales[row] - 127);
        bad += got[(e * G * 32 + k) * N + n] != to_bf16(static_cast<float>(v));
      }
  CHECK(bad == 0);
  drop_scratch("dequantize-mxfp4");
}
