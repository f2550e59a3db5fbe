// statedict: read, transform, shard and consolidate ML checkpoints ("state dicts") without a
// framework at run time. This umbrella header includes every module that needs only the standard
// library and nlohmann/json (api.hpp, the facade, first). Bridges to optional dependencies are
// separate:
//   <statedict/reflect.hpp>           aggregates <-> Value (Boost.PFR)
//   <statedict/interop/xtensor.hpp>   TensorView -> xt::adapt views, lazy BF16/F16 -> float
//   <statedict/formats/transform_regex.hpp>  renames and filters by regular expression
// With STATEDICT_SEPARATE_COMPILATION (core/config.hpp) it is api.hpp alone: the facade
// declared, its definitions compiled once in statedict::compiled.
// SPDX-License-Identifier: MIT
#pragma once

#include "api.hpp"

#ifndef STATEDICT_DECLARATIONS_ONLY
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/shape.hpp"
#include "core/dtype.hpp"
#include "core/cast.hpp"
#include "core/tensor.hpp"
#include "core/value.hpp"
#include "core/source.hpp"
#include "core/sha256.hpp"
#include "core/value_json.hpp"
#include "core/visit.hpp"
#include "core/skeleton.hpp"
#include "core/flatten.hpp"
#include "core/subset.hpp"
#include "core/optim.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "io/hf_sharded.hpp"
#include "io/crc32.hpp"
#include "io/zip.hpp"
#include "io/pickle_read.hpp"
#include "io/pickle_write.hpp"
#include "io/torch_file.hpp"
#include "io/torch_save.hpp"
#include "shard/checkpoint.hpp"
#include "shard/box.hpp"
#include "shard/cover.hpp"
#include "shard/layout.hpp"
#include "shard/plan.hpp"
#include "shard/views.hpp"
#include "exec/sink.hpp"
#include "exec/executor.hpp"
#include "exec/digest.hpp"
#include "exec/read.hpp"
#include "exec/compare.hpp"
#include "formats/format.hpp"
#include "formats/transform.hpp"
#include "formats/registry.hpp"
#include "convert.hpp"
#endif
