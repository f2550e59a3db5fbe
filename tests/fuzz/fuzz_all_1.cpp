// statedict-fuzz, part 1 of 2 (fuzz_all.cpp picks the target): the targets
// safetensors, safetensors_roundtrip, hf_index, zip, inflate, pickle, pickle_roundtrip, torch, torch_roundtrip, dcp_metadata.
// Two translation units rather than one, so that a build on two cores compiles them side by side.
//
// Each fuzz_<name>.cpp sits in a namespace of its own; every header they include is included here
// first, so their own #include lines (all #pragma once) add nothing inside the namespace.
// SPDX-License-Identifier: MIT
#define STATEDICT_FUZZ_ALL 1

#include <statedict/formats/dcp.hpp>
#include <statedict/formats/hf.hpp>
#include <statedict/formats/safetensors.hpp>
#include <statedict/formats/torch.hpp>
#include <statedict/io/hf_sharded.hpp>
#include <statedict/io/inflate.hpp>
#include <statedict/io/pickle_read.hpp>
#include <statedict/io/pickle_write.hpp>
#include <statedict/io/safetensors.hpp>
#include <statedict/io/torch_file.hpp>
#include <statedict/io/zip.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
// clang-format on
