// Fuzz target: a pickle that loads (keep_unknown_objects) is written back with the protocol-2
// pickler (io/pickle_write.hpp) and loaded again: the two Value trees and the dict attributes
// must be equal. A writer refusal is acceptable only as a statedict::error.
// SPDX-License-Identifier: MIT
#include <statedict/io/pickle_read.hpp>
#include <statedict/io/pickle_write.hpp>

#include <cstdio>
#include <cstdlib>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace pickle = statedict::pickle;

STATEDICT_FUZZ_TARGET(data, size) {
  pickle::options o;
  o.limits = fuzz::pickle_limits();
  o.keep_unknown_objects = true;
  pickle::Result a;
  try {
    a = pickle::load(fuzz::bytes_of(data, size), o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  std::vector<std::byte> out;
  try {
    out = pickle::dumps(a.value, &a.attributes);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  // The written pickle may legitimately need more nodes than the input did (no memo sharing).
  o.limits.max_nodes = std::uint64_t{1} << 18;
  pickle::Result b;
  try {
    b = pickle::load(out, o);
  } catch (const statedict::error& e) {
    std::fprintf(stderr, "pickle round trip: the written pickle does not load: %s\n", e.what());
    std::abort();
  }
  if (!(a.value == b.value)) {
    std::fprintf(stderr, "pickle round trip: the values differ\n");
    std::abort();
  }
  if (a.attributes != b.attributes) {
    std::fprintf(stderr, "pickle round trip: the attributes differ\n");
    std::abort();
  }
  return 0;
}
