// Float conversions compared bit for bit with tables computed by real PyTorch 1.13
// (tests/python/gen_dtype_tables.py): the scalar functions of core/dtype.hpp and the bulk
// cast_run of core/cast.hpp, aligned and misaligned. Float8 is checked against the OCP FP8 spec
// and the overflow rules of PyTorch's c10 headers (the generator computes that reference).
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <nlohmann/json.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

using namespace statedict;

namespace {

const std::string table_dir = std::string(STATEDICT_FIXTURE_DIR) + "/gen_dtype_tables/";

const nlohmann::json& manifest() {
  static const nlohmann::json m = [] {
    std::ifstream in(table_dir + "manifest.json");
    REQUIRE_MESSAGE(in.good(), "missing " << table_dir << "manifest.json (run the `fixtures` test first)");
    return nlohmann::json::parse(in);
  }();
  return m;
}

/// Reads `name` (raw little-endian T values) and checks its length against the manifest.
template <class T>
std::vector<T> table(const std::string& name) {
  std::ifstream in(table_dir + name, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "missing table " << name);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto expected = manifest().at("files").at(name).get<std::size_t>();
  REQUIRE_MESSAGE(raw.size() == expected * sizeof(T), name << ": " << raw.size() << " bytes, expected " << expected << " x "
                                                          << sizeof(T));
  std::vector<T> out(expected);
  if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

std::string hex(std::uint64_t v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%0*llx", digits, static_cast<unsigned long long>(v));
  return buf;
}

/// Compares got[i] with want[i]; reports the count and the first few mismatches with their input.
template <class In, class Out>
void compare(const std::string& what, const std::vector<In>& in, const std::vector<Out>& want, const std::vector<Out>& got) {
  REQUIRE(in.size() == want.size());
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  std::ostringstream first;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (want[i] == got[i]) continue;
    if (bad < 8)
      first << "\n  in " << hex(in[i], 2 * sizeof(In)) << ": torch " << hex(want[i], 2 * sizeof(Out)) << ", statedict "
            << hex(got[i], 2 * sizeof(Out));
    ++bad;
  }
  INFO(what << ": " << bad << " of " << want.size() << " differ" << first.str());
  CHECK(bad == 0);
}

/// Applies a scalar conversion to every input.
template <class In, class Out, class F>
std::vector<Out> scalar(const std::vector<In>& in, F f) {
  std::vector<Out> out(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = f(in[i]);
  return out;
}

/// Runs cast_run over all inputs, once from aligned buffers and once from buffers shifted by one
/// byte (cast_run promises to work on any alignment); both must agree.
template <class In, class Out>
std::vector<Out> bulk(dtype from, const std::vector<In>& in, dtype to) {
  std::vector<Out> out(in.size());
  cast_run(from, reinterpret_cast<const std::byte*>(in.data()), to, reinterpret_cast<std::byte*>(out.data()), in.size());
  std::vector<std::byte> src(in.size() * sizeof(In) + 1), dst(in.size() * sizeof(Out) + 1);
  std::memcpy(src.data() + 1, in.data(), in.size() * sizeof(In));
  cast_run(from, src.data() + 1, to, dst.data() + 1, in.size());
  const bool same = std::memcmp(dst.data() + 1, out.data(), out.size() * sizeof(Out)) == 0;
  CHECK_MESSAGE(same, "cast_run " << name(from) << " -> " << name(to) << " depends on alignment");
  return out;
}

float f32(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

}  // namespace

TEST_CASE("the tables come from PyTorch 1.13") {
  CHECK(manifest().at("torch").get<std::string>().rfind("1.13", 0) == 0);
  MESSAGE("PyTorch " << manifest().at("torch").get<std::string>() << ", CPU capability "
                     << manifest().at("cpu_capability").get<std::string>());
}

TEST_CASE("f32 -> bf16 and f16 match torch bit for bit") {
  const auto in = table<std::uint32_t>("f32_sweep.u32");
  const auto bf = table<std::uint16_t>("f32_to_bf16.u16");
  const auto h = table<std::uint16_t>("f32_to_f16.u16");
  compare("bf16_from_f32", in, bf, scalar<std::uint32_t, std::uint16_t>(in, [](std::uint32_t u) { return bf16_from_f32(f32(u)); }));
  compare("cast_run F32->BF16", in, bf, bulk<std::uint32_t, std::uint16_t>(dtype::F32, in, dtype::BF16));
  compare("f16_from_f32", in, h, scalar<std::uint32_t, std::uint16_t>(in, [](std::uint32_t u) { return f16_from_f32(f32(u)); }));
  compare("cast_run F32->F16", in, h, bulk<std::uint32_t, std::uint16_t>(dtype::F32, in, dtype::F16));
}

TEST_CASE("f32 -> f64 matches torch") {
  const auto in = table<std::uint32_t>("f32_hi.u32");
  compare("cast_run F32->F64", in, table<std::uint64_t>("f32_to_f64.u64"),
          bulk<std::uint32_t, std::uint64_t>(dtype::F32, in, dtype::F64));
}

TEST_CASE("every bf16 and f16 widens and cross-casts as torch does") {
  const auto all = table<std::uint16_t>("all16.u16");
  bool identity = true;
  for (std::size_t i = 0; i < all.size(); ++i) identity = identity && all[i] == i;
  REQUIRE(identity);
  const auto bf_f32 = table<std::uint32_t>("bf16_to_f32.u32");
  const auto h_f32 = table<std::uint32_t>("f16_to_f32.u32");
  compare("f32_from_bf16", all, bf_f32, scalar<std::uint16_t, std::uint32_t>(all, [](std::uint16_t x) { return bits(f32_from_bf16(x)); }));
  compare("cast_run BF16->F32", all, bf_f32, bulk<std::uint16_t, std::uint32_t>(dtype::BF16, all, dtype::F32));
  compare("f32_from_f16", all, h_f32, scalar<std::uint16_t, std::uint32_t>(all, [](std::uint16_t x) { return bits(f32_from_f16(x)); }));
  compare("cast_run F16->F32", all, h_f32, bulk<std::uint16_t, std::uint32_t>(dtype::F16, all, dtype::F32));
  compare("cast_run BF16->F64", all, table<std::uint64_t>("bf16_to_f64.u64"), bulk<std::uint16_t, std::uint64_t>(dtype::BF16, all, dtype::F64));
  compare("cast_run F16->F64", all, table<std::uint64_t>("f16_to_f64.u64"), bulk<std::uint16_t, std::uint64_t>(dtype::F16, all, dtype::F64));
  compare("cast_run BF16->F16", all, table<std::uint16_t>("bf16_to_f16.u16"), bulk<std::uint16_t, std::uint16_t>(dtype::BF16, all, dtype::F16));
  compare("cast_run F16->BF16", all, table<std::uint16_t>("f16_to_bf16.u16"), bulk<std::uint16_t, std::uint16_t>(dtype::F16, all, dtype::BF16));
}

TEST_CASE("f64 -> bf16, f16, f32 round like torch (through f32 for the 16-bit types)") {
  const auto in = table<std::uint64_t>("f64_sweep.u64");
  compare("cast_run F64->BF16", in, table<std::uint16_t>("f64_to_bf16.u16"), bulk<std::uint64_t, std::uint16_t>(dtype::F64, in, dtype::BF16));
  compare("cast_run F64->F16", in, table<std::uint16_t>("f64_to_f16.u16"), bulk<std::uint64_t, std::uint16_t>(dtype::F64, in, dtype::F16));
  compare("cast_run F64->F32", in, table<std::uint32_t>("f64_to_f32.u32"), bulk<std::uint64_t, std::uint32_t>(dtype::F64, in, dtype::F32));
}

TEST_CASE("float8: all 256 codes decode as the OCP FP8 spec says") {
  std::vector<std::uint8_t> codes(256);
  for (std::size_t i = 0; i < 256; ++i) codes[i] = static_cast<std::uint8_t>(i);
  const auto e4 = table<std::uint32_t>("f8e4m3_decode.u32");
  const auto e5 = table<std::uint32_t>("f8e5m2_decode.u32");
  compare("f32_from_f8e4m3", codes, e4, scalar<std::uint8_t, std::uint32_t>(codes, [](std::uint8_t c) { return bits(f32_from_f8e4m3(c)); }));
  compare("cast_run F8_E4M3->F32", codes, e4, bulk<std::uint8_t, std::uint32_t>(dtype::F8_E4M3, codes, dtype::F32));
  compare("f32_from_f8e5m2", codes, e5, scalar<std::uint8_t, std::uint32_t>(codes, [](std::uint8_t c) { return bits(f32_from_f8e5m2(c)); }));
  compare("cast_run F8_E5M2->F32", codes, e5, bulk<std::uint8_t, std::uint32_t>(dtype::F8_E5M2, codes, dtype::F32));
  // Spot checks of the spec itself, so a wrong generator cannot hide a wrong decoder.
  CHECK(f32_from_f8e4m3(0x7e) == 448.0F);
  CHECK(f32_from_f8e4m3(0x01) == 0x1p-9F);
  CHECK(f32_from_f8e4m3(0x08) == 0x1p-6F);
  CHECK(f32_from_f8e5m2(0x7b) == 57344.0F);
  CHECK(f32_from_f8e5m2(0x01) == 0x1p-16F);
  CHECK(f32_from_f8e5m2(0xfc) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("float8: f32 -> e4m3fn / e5m2 round to nearest even with PyTorch's overflow rules") {
  const auto in = table<std::uint32_t>("f32_sweep.u32");
  const auto e4 = table<std::uint8_t>("f32_to_f8e4m3.u8");
  const auto e5 = table<std::uint8_t>("f32_to_f8e5m2.u8");
  compare("f8e4m3_from_f32", in, e4, scalar<std::uint32_t, std::uint8_t>(in, [](std::uint32_t u) { return f8e4m3_from_f32(f32(u)); }));
  compare("cast_run F32->F8_E4M3", in, e4, bulk<std::uint32_t, std::uint8_t>(dtype::F32, in, dtype::F8_E4M3));
  compare("f8e5m2_from_f32", in, e5, scalar<std::uint32_t, std::uint8_t>(in, [](std::uint32_t u) { return f8e5m2_from_f32(f32(u)); }));
  compare("cast_run F32->F8_E5M2", in, e5, bulk<std::uint32_t, std::uint8_t>(dtype::F32, in, dtype::F8_E5M2));
  // The boundaries by hand: 464 is the tie between 448 and the NaN slot, so it stays 448.
  CHECK(f8e4m3_from_f32(464.0F) == 0x7e);
  CHECK(f8e4m3_from_f32(464.0001F) == 0x7f);
  CHECK(f8e4m3_from_f32(-std::numeric_limits<float>::infinity()) == 0xff);
  CHECK(f8e5m2_from_f32(61439.996F) == 0x7b);
  CHECK(f8e5m2_from_f32(61440.0F) == 0x7c);
  CHECK(f8e5m2_from_f32(f32(0xffc00000U)) == 0xff);
}
