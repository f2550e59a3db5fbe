// formats::dequantize against PyTorch 2.14 and transformers 5 (tests/python/torch2/gen_t2_quant.py):
// a block-FP8 folder (200 x 300 and a 3-d expert tensor, partial blocks; the expected values are
// DeepSeek's weight_dequant order, `(w.float() * s).to(dtype)`) and an MXFP4 folder (the expected
// values are transformers' convert_moe_packed_tensors), each dequantized to BF16, F16 and F32 and
// compared by the SHA-256 of every tensor: bit for bit.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>

using namespace statedict;

namespace {

const std::string dir = std::string(STATEDICT_FIXTURE_DIR) + "/torch2/gen_t2_quant/";

void check_case(const std::string& kase, std::size_t want_tensors) {
  std::ifstream in(dir + kase + ".manifest.json");
  REQUIRE_MESSAGE(in.good(), "missing " << dir << kase << ".manifest.json (run the `fixtures_torch2` test first)");
  const auto m = nlohmann::json::parse(in);
  for (const auto& item : m.at("expected").items()) {
    const std::string dt = item.key();  // not a structured binding: clang 14 cannot capture those
    const auto& tensors = item.value();
    CAPTURE(kase);
    CAPTURE(dt);
    formats::open_options o;
    o.dequantize = formats::dequantize_options{};
    o.dtype = dtype_from_name(dt);
    REQUIRE(o.dtype);
    const auto ck = formats::open(dir + m.at("path").get<std::string>(), o).checkpoint;
    std::map<std::string, std::string> got;
    for (auto& [n, h] : sha256_tensors(ck)) got[n] = h;
    CHECK(got.size() == tensors.size());
    CHECK(got.size() == want_tensors);
    for (const auto& entry : tensors.items()) {
      const std::string n = entry.key();
      const auto& e = entry.value();
      CAPTURE(n);
      const TensorInfo* t = ck.find(n);
      REQUIRE(t);
      CHECK(std::string(name(t->dtype)) == e.at("dtype").get<std::string>());
      CHECK(t->shape == e.at("shape").get<shape_t>());
      CHECK(got[n] == e.at("sha256").get<std::string>());
    }
  }
}

}  // namespace

TEST_CASE("block-FP8 dequantized as DeepSeek's weight_dequant computes it") { check_case("fp8_block", 3); }

TEST_CASE("MXFP4 dequantized as transformers' convert_moe_packed_tensors computes it") { check_case("mxfp4", 3); }
