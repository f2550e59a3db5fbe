// Fuzz target: OLMo mapped safetensors (formats/olmo_safetensors.hpp): the input is one file,
// parsed as safetensors, its names decoded as key pickles and its values unpickled; a file that
// reads is written back with the OLMo writer and read again, which must give the same tree. The
// writer stores tensors in the reference safetensors order (alignment, then name), so a file in
// another order comes back reordered: tensors and values are compared by name, not by position.
// SPDX-License-Identifier: MIT
#include <statedict/exec/digest.hpp>
#include <statedict/formats/olmo_safetensors.hpp>

#include <algorithm>
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
  auto sorted_values = [](const statedict::ShardedCheckpoint& c) {
    auto v = statedict::skeleton_values(c.skeleton);
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    return v;
  };
  auto sorted_digests = [](const statedict::ShardedCheckpoint& c) {
    auto d = statedict::sha256_tensors(c);
    std::sort(d.begin(), d.end());
    return d;
  };
  if (sorted_values(again) != sorted_values(ck) || sorted_digests(again) != sorted_digests(ck))
    std::abort();
  return 0;
}
