// Fuzz target: fairscale FSDP rank files (formats/fairscale.hpp): a multi-file input
// (fuzz_common.hpp: `<stem>-shard<N>.pt` files) written to a scratch directory, then
// fairscale::detect and describe.
// Flags: bit 0 with_optimizer, bit 1 pread.
// SPDX-License-Identifier: MIT
#include <statedict/formats/fairscale.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace fairscale = statedict::fairscale;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  fairscale::options o;
  o.limits.torch = fuzz::torch_limits();
  o.limits.max_ranks = 64;
  o.limits.max_entries = 1 << 12;
  o.with_optimizer = (files->flags & 1) != 0;
  o.mode = (files->flags & 2) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  try {
    (void)fairscale::detect(*dir, o.limits);
    (void)fairscale::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
