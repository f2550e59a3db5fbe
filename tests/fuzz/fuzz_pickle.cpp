// Fuzz target: the safe unpickler (io/pickle_read.hpp) in both modes: strict (weights_only
// allow-list; an unknown global is a security_error) and keep_unknown_objects (unknown globals kept
// as opaque Objects, numpy arrays and scalars as tensors), with a persistent_load that answers
// every id; the second time with the input kept alive, so that numpy arrays view it in place.
// SPDX-License-Identifier: MIT
#include <statedict/io/pickle_read.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace pickle = statedict::pickle;

STATEDICT_FUZZ_TARGET(data, size) {
  pickle::options o;
  o.limits = fuzz::pickle_limits();
  for (const int mode : {0, 1, 2}) {
    const bool keep = mode != 0;
    o.keep_unknown_objects = keep;
    o.persistent_load = nullptr;
    if (keep) o.persistent_load = [](const statedict::Value& pid) { return statedict::Value::tuple({pid}); };
    // Views of the input live no longer than this iteration: a non-owning keep-alive is enough.
    o.input_owner = mode == 2 ? statedict::keep_alive(data, [](const void*) {}) : statedict::keep_alive();
    try {
      const pickle::Result r = pickle::load(fuzz::bytes_of(data, size), o);
      if (r.consumed > size) __builtin_trap();
      (void)(r.value == r.value);
    } catch (const statedict::error& e) {
      fuzz::note(e);
    }
  }
  return 0;
}
