// Fuzz target: torch.save files (io/torch_file.hpp): zip or legacy format, read with the strict
// allow-list (CRCs verified), then describe() of what was read, then the lazy describe with
// unknown objects kept and Parameters kept as wrappers (what the layout readers use).
// SPDX-License-Identifier: MIT
#include <statedict/io/torch_file.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace torch = statedict::torch;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto src = fuzz::source_of(data, size, "fuzz.pt");
  torch::load_options o;
  o.limits = fuzz::torch_limits();
  o.verify_crc = true;
  try {
    const torch::File f = torch::read(src, o);
    (void)torch::describe(f);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  o.verify_crc = false;
  o.keep_unknown_objects = true;
  o.keep_wrappers = true;
  try {
    (void)torch::describe(src, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
