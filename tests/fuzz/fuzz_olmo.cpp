// Fuzz target: OLMo mapped safetensors (formats/olmo_safetensors.hpp): the input is one file,
// parsed as safetensors, its names decoded as key pickles and its values unpickled; a file that
// reads is written back with the OLMo writer and read again, which must give the same tree.
// SPDX-License-Identifier: MIT
#include <statedict/exec/digest.hpp>
#include <statedict/formats/olmo_safetensors.hpp>

#include <cstdlib>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace olmo = statedict::olmo_safetensors;

STATEDICT_FUZZ_TARGET(data, size) {
  olmo::options o;
  o.limits.pickle = fuzz::pickle_limits();
  o.limits.safetensors.max_header_bytes = 1 << 20;
  o.limits.safetensors.max_tensors = 1 << 12;
  o.limits.max_value_bytes = 1 << 20;
  o.limits.max_key_depth = 64;
  statedict::ShardedCheckpoint ck;
  try {
    ck = olmo::describe(statedict::safetensors::File::open(fuzz::source_of(data, size), o.limits.safetensors), o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  // Round trip: what was read is written and read again.
  const auto out = fuzz::scratch_root() / "olmo-roundtrip.safetensors";
  try {
    olmo::write(ck, out);
  } catch (const statedict::error& e) {
    fuzz::note(e);  // a tree the layout cannot hold back (a tie of two names, a tensor in a value)
    return 0;
  }
  const auto again = olmo::describe(out, o);
  if (statedict::skeleton_values(again.skeleton) != statedict::skeleton_values(ck.skeleton) ||
      statedict::sha256_tensors(again) != statedict::sha256_tensors(ck))
    std::abort();
  return 0;
}
