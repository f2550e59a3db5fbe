// Fuzz target: directories of ShardedTensor rank files (formats/sharded_tensor.hpp): a
// multi-file input (fuzz_common.hpp: `rank0.pt`, `rank1.pt`, ...) written to a scratch directory,
// then sharded_tensor::detect and sharded_tensor::describe.
// Flags: bit 0 check_replicas, bit 1 pread.
// SPDX-License-Identifier: MIT
#include <statedict/formats/sharded_tensor.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace sht = statedict::sharded_tensor;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  sht::options o;
  o.limits.pickle = fuzz::pickle_limits();
  o.limits.max_ranks = 64;
  o.limits.max_shards = 1 << 12;
  o.limits.max_pickle_bytes = 1 << 20;
  o.check_replicas = (files->flags & 1) != 0;
  o.mode = (files->flags & 2) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  try {
    (void)sht::detect(*dir);
    (void)sht::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
