// Fuzz target: a whole DCP checkpoint directory (formats/dcp.hpp): the input is a multi-file
// input (fuzz_common.hpp: `.metadata`, `__0_0.distcp`, ...) written to a scratch directory, then
// dcp::detect and dcp::describe (metadata validated, data files opened, every tensor item's zip
// directory and data.pkl read, bytes items loaded).
// Flags: bit 0 reads data files with pread instead of mmap.
// SPDX-License-Identifier: MIT
#include <statedict/formats/dcp.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace dcp = statedict::dcp;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  (void)dcp::detect(*dir);
  dcp::options o;
  o.limits.pickle = fuzz::pickle_limits();
  o.limits.max_entries = 1 << 14;
  o.limits.max_chunks = 1 << 14;
  o.limits.max_files = 64;
  o.limits.max_metadata_bytes = 1 << 20;
  o.limits.max_item_pickle_bytes = 1 << 20;
  o.mode = (files->flags & 1) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  try {
    (void)dcp::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
