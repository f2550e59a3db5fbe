// Fuzz target: safetensors header and file validation (io/safetensors.hpp), then everything a
// reader does with a valid file: views, hashes, describe(), the flat dict, and read_state (which
// unflattens a stored skeleton).
// SPDX-License-Identifier: MIT
#include <statedict/io/safetensors.hpp>

#include "fuzz_common.hpp"

namespace st = statedict::safetensors;

STATEDICT_FUZZ_TARGET(data, size) {
  st::limits lim;
  lim.max_header_bytes = 1 << 20;
  lim.max_rank = 64;
  lim.max_tensors = 1 << 14;
  try {
    const st::File f = st::File::open(fuzz::source_of(data, size), lim);
    for (const auto& e : f.entries()) {
      (void)f.sha256(e);
      try {
        const statedict::TensorView v = f.view(e);
        (void)v.numel();
      } catch (const statedict::error& e) {
        fuzz::note(e);
      }
    }
    for (const auto& [alias, target] : f.aliases()) (void)f.resolve(alias);
    try {
      (void)f.describe();
    } catch (const statedict::error& e) {
      fuzz::note(e);
    }
    (void)st::read_state(f);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
