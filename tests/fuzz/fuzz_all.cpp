// All fuzz targets in one libFuzzer executable (statedict-fuzz): the build links it once, and
// tests/fuzz/CMakeLists.txt gives it one name per target (bin/fuzz-<name>, symbolic links). The
// target is the one the executable's name says (argv[0], "fuzz-zip" -> zip), or the
// STATEDICT_FUZZ_TARGET environment variable when it is called statedict-fuzz.
//
// The targets themselves are compiled in two translation units, fuzz_all_1.cpp and fuzz_all_2.cpp,
// each fuzz_<name>.cpp in a namespace of its own.
// SPDX-License-Identifier: MIT
// clang-format off
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <string>
#include <string_view>

// The targets, defined in fuzz_all_1.cpp and fuzz_all_2.cpp.
namespace fuzz_safetensors { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_safetensors_roundtrip { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_hf_index { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_zip { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_inflate { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_pickle { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_pickle_roundtrip { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_torch { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_torch_roundtrip { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_dcp_metadata { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_dcp { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_deepspeed { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_fsdp { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_megatron { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_sharded_tensor { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_open { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_olmo { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_colossalai { int test_one_input(const std::uint8_t* data, std::size_t size); }
namespace fuzz_fairscale { int test_one_input(const std::uint8_t* data, std::size_t size); }
// clang-format on

namespace {

using entry = int (*)(const std::uint8_t*, std::size_t);

struct target {
  const char* name;  // as in fuzz-<name>, with '-'
  entry run;
};

constexpr target targets[] = {
    {"safetensors", fuzz_safetensors::test_one_input},
    {"safetensors-roundtrip", fuzz_safetensors_roundtrip::test_one_input},
    {"hf-index", fuzz_hf_index::test_one_input},
    {"zip", fuzz_zip::test_one_input},
    {"inflate", fuzz_inflate::test_one_input},
    {"pickle", fuzz_pickle::test_one_input},
    {"pickle-roundtrip", fuzz_pickle_roundtrip::test_one_input},
    {"torch", fuzz_torch::test_one_input},
    {"torch-roundtrip", fuzz_torch_roundtrip::test_one_input},
    {"dcp-metadata", fuzz_dcp_metadata::test_one_input},
    {"dcp", fuzz_dcp::test_one_input},
    {"deepspeed", fuzz_deepspeed::test_one_input},
    {"fsdp", fuzz_fsdp::test_one_input},
    {"megatron", fuzz_megatron::test_one_input},
    {"sharded-tensor", fuzz_sharded_tensor::test_one_input},
    {"open", fuzz_open::test_one_input},
    {"olmo", fuzz_olmo::test_one_input},
    {"colossalai", fuzz_colossalai::test_one_input},
    {"fairscale", fuzz_fairscale::test_one_input},
};

entry chosen = nullptr;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  std::string_view self = (argc && *argc > 0) ? (*argv)[0] : "";
  if (const auto slash = self.rfind('/'); slash != std::string_view::npos) self.remove_prefix(slash + 1);
  std::string name;
  if (self.substr(0, 5) == "fuzz-") {
    name = std::string(self.substr(5));
  } else if (const char* env = std::getenv("STATEDICT_FUZZ_TARGET")) {
    name = env;
  }
  for (char& c : name)
    if (c == '_') c = '-';
  for (const target& t : targets)
    if (name == t.name) chosen = t.run;
  if (!chosen) {
    std::fprintf(stderr, "statedict-fuzz: no target %s%s%s; run it as fuzz-<target> or set STATEDICT_FUZZ_TARGET to one of:",
                 name.empty() ? "" : "\"", name.c_str(), name.empty() ? "named" : "\"");
    for (const target& t : targets) std::fprintf(stderr, " %s", t.name);
    std::fprintf(stderr, "\n");
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { return chosen(data, size); }
