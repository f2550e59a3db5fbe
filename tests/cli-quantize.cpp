// `statedict convert --quantize fp8-block` against transformers 5 and PyTorch 2.14 of the Debian
// sid root (tests/python/torch2/gen_t2_quant.py): a tiny Qwen3 in bf16 and in f32 quantized bit
// for bit as transformers' FineGrainedFP8 quantizer does, partial blocks as transformers leaves
// them (and on DeepSeek's grid with --quantize-partial); transformers loading our output
// (FineGrainedFP8, dequantize on CPU) with the tensors and logits of its own quantization; our
// --dequantize of its block-FP8 Qwen3 giving the logits of its dequantize=True loading, also
// after a round trip through our quantizer; the hostile cases through the CLI.
#include "interop_t2.hpp"

#include <cmath>
#include <cstring>

using namespace t2_test;

namespace {

const fs::path qdir = t2_fixtures / "gen_t2_quant";

json manifest(const std::string& kase) {
  const fs::path p = qdir / (kase + ".manifest.json");
  REQUIRE_MESSAGE(fs::exists(p), "missing " << p.string() << " (run the `fixtures_torch2` test first)");
  return load_json(p);
}

/// Every tensor of `out` against the manifest's: dtype, shape, sha256; no tensor more or less.
void check_tensors(const fs::path& out, const json& want) {
  const auto ck = sd::formats::open(out).checkpoint;
  std::map<std::string, std::string> got;
  for (auto& [n, h] : sd::sha256_tensors(ck)) got[n] = h;
  CHECK(got.size() == want.size());
  std::size_t bad = 0;
  for (const auto& entry : want.items()) {
    const std::string n = entry.key();
    const sd::TensorInfo* t = ck.find(n);
    if (!t) {
      ++bad;
      MESSAGE("missing " << n);
      continue;
    }
    const auto& e = entry.value();
    if (std::string(sd::name(t->dtype)) != e.at("dtype").get<std::string>() || t->shape != e.at("shape").get<sd::shape_t>() ||
        got[n] != e.at("sha256").get<std::string>()) {
      ++bad;
      MESSAGE("differs: " << n << " " << sd::name(t->dtype) << " " << sd::to_string(t->shape) << " (want " << e.at("dtype") << ")");
    }
  }
  CHECK(bad == 0);
}

/// tests/python/torch2/t2_quant_check.py MODE OURS REFERENCE: transformers agrees (main build).
void transformers_agrees(const std::string& mode, const fs::path& ours, const fs::path& reference) {
  if (!with_oracle) return;
  const run_result r = run({(source_dir / "tools" / "sid-python").string(),
                            (source_dir / "tests" / "python" / "torch2" / "t2_quant_check.py").string(), mode, ours.string(),
                            reference.string()});
  CHECK_MESSAGE(r.code == 0, "t2_quant_check.py " << mode << ": " << r.describe());
}

bool mentions(const run_result& r, const std::string& s) { return r.err.find(s) != std::string::npos; }

}  // namespace

TEST_CASE("--quantize fp8-block: bit for bit transformers' FineGrainedFP8 quantizer, and transformers loads it") {
  const fs::path d = scratch("quantize-qwen3");
  for (const std::string kase : {"quantize_bf16", "quantize_f32"}) {
    CAPTURE(kase);
    const json m = manifest(kase);
    const fs::path out = d / kase;
    const run_result r = cli({"convert", (qdir / m.at("path").get<std::string>()).string(), out.string(), "--to", "hf", "--quantize",
                              "fp8-block", "--memory-budget", "256KiB", "--threads", "2"});
    REQUIRE_MESSAGE(r.code == 0, r.describe());
    check_tensors(out, m.at("expected").at("default"));
    const json q = load_json(out / "config.json").at("quantization_config");
    CHECK(q.at("quant_method") == "fp8");
    CHECK(q.at("weight_block_size") == json::array({128, 128}));
    const auto skip = q.at("modules_to_not_convert").get<std::vector<std::string>>();
    CHECK(skip == std::vector<std::string>{"lm_head$", "model\\.embed_tokens$"});
    CHECK(load_json(out / "config.json").at("model_type") == "qwen3");
  }
  // transformers reads our bf16 quantization exactly as its own (dequantize on CPU: every
  // parameter and the logits equal).
  transformers_agrees("quantized", d / "quantize_bf16", qdir / "qwen3_fp8");
  drop_scratch("quantize-qwen3");
}

TEST_CASE("--quantize of partial blocks: left as transformers leaves them, or on DeepSeek's grid with --quantize-partial") {
  const fs::path d = scratch("quantize-partial");
  const json m = manifest("quantize_partial");
  const fs::path in = qdir / m.at("path").get<std::string>();
  run_result r = cli({"convert", in.string(), (d / "default.safetensors").string(), "--quantize", "fp8-block"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  check_tensors(d / "default.safetensors", m.at("expected").at("default"));
  r = cli({"convert", in.string(), (d / "partial.safetensors").string(), "--quantize", "fp8-block:128", "--quantize-partial"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  check_tensors(d / "partial.safetensors", m.at("expected").at("partial"));
  // --quantize-match chooses the tensors (here one), --keep-dtype takes one back out.
  r = cli({"convert", in.string(), (d / "match.safetensors").string(), "--quantize", "fp8-block", "--quantize-partial", "--quantize-match",
           "[ab]\\.weight", "--keep-dtype", "b\\..*"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  const auto ck = sd::formats::open(d / "match.safetensors").checkpoint;
  CHECK(ck.tensors.size() == 4);
  CHECK(ck.find("a.weight")->dtype == sd::dtype::F8_E4M3);
  CHECK(ck.find("b.weight")->dtype == sd::dtype::BF16);
  CHECK(ck.find("c.weight")->dtype == sd::dtype::BF16);
  drop_scratch("quantize-partial");
}

TEST_CASE("--dequantize of transformers' block-FP8 Qwen3: the logits of its dequantize=True loading, also after our round trip") {
  const fs::path d = scratch("quantize-logits");
  const fs::path fp8 = qdir / "qwen3_fp8";
  REQUIRE_MESSAGE(fs::exists(fp8 / "config.json"), "missing " << fp8.string() << " (run the `fixtures_torch2` test first)");
  run_result r = cli({"convert", fp8.string(), (d / "bf16").string(), "--to", "hf", "--dequantize", "fp8-block", "--dtype", "BF16"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  transformers_agrees("dequantized", d / "bf16", fp8);
  // Round trip: the bf16 model quantized by us, then dequantized by us.
  r = cli({"convert", (qdir / "qwen3_bf16").string(), (d / "q").string(), "--to", "hf", "--quantize", "fp8-block"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  r = cli({"convert", (d / "q").string(), (d / "rt").string(), "--to", "hf", "--dequantize", "auto", "--dtype", "BF16"});
  REQUIRE_MESSAGE(r.code == 0, r.describe());
  CHECK(!load_json(d / "rt" / "config.json").contains("quantization_config"));
  transformers_agrees("dequantized", d / "rt", fp8);
  drop_scratch("quantize-logits");
}

TEST_CASE("--quantize refuses hostile input and wrong options with exit 2, writing nothing") {
  const fs::path d = scratch("quantize-hostile");
  std::vector<float> x(128 * 256, 0.25F);
  x[7 * 256 + 3] = std::nanf("");
  sd::NamedTensors t;
  t.emplace_back("model.layers.0.mlp.up_proj.weight", sd::Tensor::from(x, {128, 256}));
  t.emplace_back("model.norm.weight", sd::Tensor::from(std::vector<float>(256, 1.0F), {256}));
  (void)sd::formats::save(sd::describe_views(t), d / "nan.safetensors");
  const std::string in = (d / "nan.safetensors").string();
  run_result r = cli({"convert", in, (d / "o1").string(), "--to", "hf", "--quantize", "fp8-block"});
  CHECK_MESSAGE(r.code == 2, r.describe());
  CHECK(mentions(r, "'model.layers.0.mlp.up_proj.weight'"));
  CHECK(mentions(r, "[7, 3]"));
  CHECK(mentions(r, "867"));
  CHECK((!fs::exists(d / "o1") || fs::is_empty(d / "o1")));
  // A pattern selecting a 1-D norm, the scheme or block misspelled, both directions at once.
  r = cli({"convert", in, (d / "o2.safetensors").string(), "--quantize", "fp8-block", "--quantize-match", ".*norm.*"});
  CHECK_MESSAGE(r.code == 2, r.describe());
  CHECK(mentions(r, "'model.norm.weight'"));
  CHECK(mentions(r, "868"));
  for (const auto& extra : {std::vector<std::string>{"--quantize", "int4"}, {"--quantize", "fp8-block:0"},
                                               {"--quantize", "fp8-block:"}, {"--quantize", "fp8-block", "--dequantize", "auto", "--dtype", "BF16"},
                                               {"--quantize-partial"}}) {
    std::vector<std::string> args{"convert", in, (d / "o3.safetensors").string()};
    args.insert(args.end(), extra.begin(), extra.end());
    r = cli(args);
    CHECK_MESSAGE(r.code == 2, r.describe());
  }
  CHECK(!fs::exists(d / "o2.safetensors"));
  CHECK(!fs::exists(d / "o3.safetensors"));
  drop_scratch("quantize-hostile");
}
