// statedict-fuzz, part 2 of 2 (fuzz_all.cpp picks the target): the targets
// dcp, deepspeed, fsdp, megatron, sharded_tensor, open, olmo, colossalai, fairscale.
// Two translation units rather than one, so that a build on two cores compiles them side by side.
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

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

// clang-format off
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
