// Fuzz target: OLMo/FSDP flat-parameter checkpoints (formats/fsdp.hpp): a multi-file input
// (fuzz_common.hpp: `model/rank0.pt`, `optim/rank0.pt`, `train/rank0.pt`, `metadata.yaml`, ...)
// written to a scratch directory, then fsdp::detect and fsdp::describe.
// Flags: bit 0 with_optimizer, bit 1 with_train_state, bit 2 pread, bit 3 dtype F16.
// SPDX-License-Identifier: MIT
#include <statedict/formats/fsdp.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace fsdp = statedict::fsdp;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  fsdp::options o;
  o.limits.torch = fuzz::torch_limits();
  o.limits.max_ranks = 64;
  o.limits.max_entries = 1 << 14;
  o.limits.max_metadata_bytes = 1 << 12;
  o.with_optimizer = (files->flags & 1) != 0;
  o.with_train_state = (files->flags & 2) != 0;
  o.mode = (files->flags & 4) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  if (files->flags & 8) o.dtype = statedict::dtype::F16;
  try {
    (void)fsdp::detect(*dir, o.limits);
    (void)fsdp::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
