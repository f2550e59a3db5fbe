// Fuzz target: a safetensors file that parses is written back (safetensors::write) and parsed
// again; both must hold the same tensors (name, dtype, shape, bytes), user metadata, aliases and
// skeleton. A writer refusal is acceptable only as a statedict::error; a difference aborts.
// SPDX-License-Identifier: MIT
#include <statedict/io/safetensors.hpp>
#include <statedict/formats/safetensors.hpp>

#include <cstdio>
#include <cstdlib>

#include "fuzz_common.hpp"

namespace st = statedict::safetensors;

namespace {
[[noreturn]] void mismatch(const char* what) {
  std::fprintf(stderr, "safetensors round trip: %s differs\n", what);
  std::abort();
}
}  // namespace

STATEDICT_FUZZ_TARGET(data, size) {
  st::limits lim;
  lim.max_header_bytes = 1 << 20;
  lim.max_rank = 64;
  lim.max_tensors = 1 << 14;
  std::optional<st::File> a;
  try {
    a = st::File::open(fuzz::source_of(data, size), lim);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  std::vector<st::Input> in;
  for (const auto& e : a->entries()) {
    if (!e.dtype) return 0;  // valid safetensors, but no statedict dtype to write it with
    in.push_back(st::Input::of(e.name, a->view(e)));
  }
  st::write_options wo;
  if (a->raw_metadata()) wo.metadata = a->metadata();
  wo.aliases = a->aliases();
  wo.skeleton = a->skeleton();
  wo.dedupe_views = false;
  wo.lim = lim;
  const auto path = fuzz::scratch_root() / "roundtrip.safetensors";
  try {
    st::write(path, in, wo);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  const st::File b = st::File::open(path, st::open_options{statedict::read_mode::pread, lim});
  if (b.size() != a->size()) mismatch("tensor count");
  for (const auto& e : a->entries()) {
    const st::TensorEntry* f = b.find(e.name);
    if (!f) mismatch("tensor names");
    if (f->dtype_name != e.dtype_name || f->shape != e.shape) mismatch("dtype or shape");
    if (!statedict::equal_bytes(a->view(e), b.view(*f))) mismatch("tensor bytes");
  }
  if (b.metadata() != a->metadata()) mismatch("metadata");
  if (b.aliases() != a->aliases()) mismatch("aliases");
  if (b.skeleton() != a->skeleton()) mismatch("skeleton");
  return 0;
}
