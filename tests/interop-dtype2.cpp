// The conversions of the dtypes PyTorch 1.13 lacks (float8 e4m3fnuz, e5m2fnuz, e8m0fnu; complex32)
// against tables PyTorch 2.14 computed (tests/python/torch2/gen_t2_dtype_tables.py): every code
// decoded and widened, and sweeps of f32, f64, bf16 and f16 values rounded, bit for bit, through
// cast_run (what the executor runs) and the scalar conversions.
#include <doctest/doctest.h>

#include <statedict/statedict.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

using namespace statedict;

namespace {

const std::string table_dir = std::string(STATEDICT_FIXTURE_DIR) + "/torch2/gen_t2_dtype_tables/";

const nlohmann::json& listing() {
  static const nlohmann::json m = [] {
    std::ifstream in(table_dir + "tables.json");
    REQUIRE_MESSAGE(in.good(), "missing " << table_dir << "tables.json (run the `fixtures_torch2` test first)");
    return nlohmann::json::parse(in);
  }();
  return m;
}

template <class T>
std::vector<T> table(const std::string& name) {
  const auto n = listing()["tables"].at(name).get<std::size_t>();
  std::ifstream in(table_dir + name, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "missing table " << name);
  std::vector<T> v(n);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  REQUIRE(static_cast<std::size_t>(in.gcount()) == n * sizeof(T));
  return v;
}

/// cast_run of `in` (elements of `from`) to `to`, compared with `want` element by element.
template <class In, class Out>
void check_cast(dtype from, const std::vector<In>& in, dtype to, const std::vector<Out>& want, const std::string& what) {
  REQUIRE(in.size() == want.size());
  std::vector<Out> got(in.size());
  cast_run(from, reinterpret_cast<const std::byte*>(in.data()), to, reinterpret_cast<std::byte*>(got.data()), in.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < in.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = i;
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << in.size() << " differ, first at " << first << " (input 0x" << std::hex
                                << static_cast<std::uint64_t>(in[first]) << ": got 0x" << static_cast<std::uint64_t>(got[first])
                                << ", torch 0x" << static_cast<std::uint64_t>(want[first]) << ")");
}

struct format {
  const char* name;
  dtype t;
};
constexpr format formats_2x[] = {{"e4m3fnuz", dtype::F8_E4M3FNUZ}, {"e5m2fnuz", dtype::F8_E5M2FNUZ}, {"e8m0", dtype::F8_E8M0}};

}  // namespace

TEST_CASE("the tables come from PyTorch 2.x") {
  CHECK(listing()["torch_version"].get<std::string>().rfind("2.", 0) == 0);
}

TEST_CASE("every fnuz and e8m0 code decodes and widens as torch 2.14 does") {
  std::vector<std::uint8_t> codes(256);
  for (std::size_t i = 0; i < 256; ++i) codes[i] = static_cast<std::uint8_t>(i);
  for (const auto& f : formats_2x) {
    CAPTURE(f.name);
    const std::string n = f.name;
    check_cast(f.t, codes, dtype::F32, table<std::uint32_t>(n + "_decode.u32"), n + " -> f32");
    check_cast(f.t, codes, dtype::BF16, table<std::uint16_t>(n + "_to_bf16.u16"), n + " -> bf16");
    check_cast(f.t, codes, dtype::F16, table<std::uint16_t>(n + "_to_f16.u16"), n + " -> f16");
    check_cast(f.t, codes, dtype::F64, table<std::uint64_t>(n + "_to_f64.u64"), n + " -> f64");
  }
}

TEST_CASE("f32, f64, bf16 and f16 round to fnuz and e8m0 as torch 2.14 does") {
  const auto f32 = table<std::uint32_t>("f32_sweep.u32");
  const auto f64 = table<std::uint64_t>("f64_sweep.u64");
  std::vector<std::uint16_t> all16(1 << 16);
  for (std::size_t i = 0; i < all16.size(); ++i) all16[i] = static_cast<std::uint16_t>(i);
  for (const auto& f : formats_2x) {
    CAPTURE(f.name);
    const std::string n = f.name;
    check_cast(dtype::F32, f32, f.t, table<std::uint8_t>("f32_to_" + n + ".u8"), "f32 -> " + n);
    check_cast(dtype::F64, f64, f.t, table<std::uint8_t>("f64_to_" + n + ".u8"), "f64 -> " + n);
    check_cast(dtype::BF16, all16, f.t, table<std::uint8_t>("bf16_to_" + n + ".u8"), "bf16 -> " + n);
    check_cast(dtype::F16, all16, f.t, table<std::uint8_t>("f16_to_" + n + ".u8"), "f16 -> " + n);
  }
}

TEST_CASE("complex64 -> complex32 rounds each component as torch 2.14 does") {
  const auto f32 = table<std::uint32_t>("f32_sweep.u32");
  const auto want = table<std::uint32_t>("c64_to_c32.u32");
  REQUIRE(want.size() * 2 == f32.size());
  std::vector<std::uint32_t> got(want.size());
  cast_run(dtype::C64, reinterpret_cast<const std::byte*>(f32.data()), dtype::C32, reinterpret_cast<std::byte*>(got.data()), got.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
  CHECK_MESSAGE(bad == 0, bad << " of " << got.size() << " complex32 values differ");
}
