// All fuzz targets in one libFuzzer executable (statedict-fuzz): the build links it once, and
// tests/fuzz/CMakeLists.txt gives it one name per target (bin/fuzz-<name>, symbolic links). The
// target is the one the executable's name says (argv[0], "fuzz-zip" -> zip), or the
// STATEDICT_FUZZ_TARGET environment variable when it is called statedict-fuzz.
//
// Each fuzz_<name>.cpp sits in a namespace of its own; every header they include is included here
// first, so their own #include lines (all #pragma once) add nothing inside the namespace.
// SPDX-License-Identifier: MIT
#define STATEDICT_FUZZ_ALL 1

#include <statedict/exec/digest.hpp>
#include <statedict/formats/colossalai.hpp>
#include <statedict/formats/dcp.hpp>
#include <statedict/formats/deepspeed.hpp>
#include <statedict/formats/fairscale.hpp>
#include <statedict/formats/fsdp.hpp>
#include <statedict/formats/megatron.hpp>
#include <statedict/formats/olmo_safetensors.hpp>
#include <statedict/formats/registry.hpp>
#include <statedict/formats/sharded_tensor.hpp>
#include <statedict/io/hf_sharded.hpp>
#include <statedict/io/inflate.hpp>
#include <statedict/io/pickle_read.hpp>
#include <statedict/io/pickle_write.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/io/zip.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

// clang-format off
namespace fuzz_safetensors {
#include "fuzz_safetensors.cpp"
}
namespace fuzz_safetensors_roundtrip {
#include "fuzz_safetensors_roundtrip.cpp"
}
namespace fuzz_hf_index {
#include "fuzz_hf_index.cpp"
}
namespace fuzz_zip {
#include "fuzz_zip.cpp"
}
namespace fuzz_inflate {
#include "fuzz_inflate.cpp"
}
namespace fuzz_pickle {
#include "fuzz_pickle.cpp"
}
namespace fuzz_pickle_roundtrip {
#include "fuzz_pickle_roundtrip.cpp"
}
namespace fuzz_torch {
#include "fuzz_torch.cpp"
}
namespace fuzz_torch_roundtrip {
#include "fuzz_torch_roundtrip.cpp"
}
namespace fuzz_dcp_metadata {
#include "fuzz_dcp_metadata.cpp"
}
namespace fuzz_dcp {
#include "fuzz_dcp.cpp"
}
namespace fuzz_deepspeed {
#include "fuzz_deepspeed.cpp"
}
namespace fuzz_fsdp {
#include "fuzz_fsdp.cpp"
}
namespace fuzz_megatron {
#include "fuzz_megatron.cpp"
}
namespace fuzz_sharded_tensor {
#include "fuzz_sharded_tensor.cpp"
}
namespace fuzz_open {
#include "fuzz_open.cpp"
}
namespace fuzz_olmo {
#include "fuzz_olmo.cpp"
}
namespace fuzz_colossalai {
#include "fuzz_colossalai.cpp"
}
namespace fuzz_fairscale {
#include "fuzz_fairscale.cpp"
}
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
