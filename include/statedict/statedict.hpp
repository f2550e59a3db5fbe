// statedict: read, transform, shard and consolidate ML checkpoints ("state dicts") without a
// framework at run time. This umbrella header includes every module that needs only the standard
// library and nlohmann/json. Bridges to optional dependencies are separate:
//   <statedict/reflect.hpp>           aggregates <-> Value (Boost.PFR)
//   <statedict/interop/xtensor.hpp>   TensorView -> xt::adapt views
// SPDX-License-Identifier: MIT
#pragma once

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/shape.hpp"
#include "core/dtype.hpp"
#include "core/cast.hpp"
#include "core/tensor.hpp"
#include "core/value.hpp"
#include "core/source.hpp"
#include "core/sha256.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "io/hf_sharded.hpp"
#include "io/crc32.hpp"
#include "io/zip.hpp"
#include "io/pickle_read.hpp"
#include "io/pickle_write.hpp"
#include "io/torch_file.hpp"
#include "shard/checkpoint.hpp"
#include "shard/box.hpp"
#include "shard/cover.hpp"
#include "shard/layout.hpp"
#include "shard/plan.hpp"
#include "exec/sink.hpp"
#include "exec/executor.hpp"
#include "exec/digest.hpp"
#include "core/visit.hpp"
#include "core/flatten.hpp"
#include "core/optim.hpp"
#include "formats/dcp.hpp"
#include "formats/sharded_tensor.hpp"
#include "formats/deepspeed.hpp"
#include "formats/fsdp.hpp"
#include "formats/optim_shard.hpp"
#include "formats/open.hpp"
#include "formats/convert.hpp"
