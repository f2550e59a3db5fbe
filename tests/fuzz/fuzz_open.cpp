// Fuzz target: formats::open (formats/open.hpp), the content-based detection of every format:
// a multi-file input (fuzz_common.hpp) written to a scratch directory, opened as a directory and,
// when the first file is a regular file, as that file. When open_options has per-reader limits
// (open_options::limits), they are lowered as in the other targets; otherwise every reader runs
// with its default caps.
// Flags: bit 0 with_optimizer, bit 1 check_replicas, bit 2 pread.
// SPDX-License-Identifier: MIT
#include <statedict/formats/open.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace formats = statedict::formats;

namespace {
template <class Options>
void lower_limits(Options& o) {
  if constexpr (requires { o.limits.torch; o.limits.dcp; o.limits.deepspeed; o.limits.fsdp; o.limits.sharded_tensor; }) {
    o.limits.safetensors.max_header_bytes = 1 << 20;
    o.limits.safetensors.max_tensors = 1 << 14;
    o.limits.max_index_bytes = 1 << 20;
    o.limits.torch = fuzz::torch_limits();
    o.limits.dcp.pickle = fuzz::pickle_limits();
    o.limits.dcp.max_entries = 1 << 14;
    o.limits.dcp.max_chunks = 1 << 14;
    o.limits.dcp.max_metadata_bytes = 1 << 20;
    o.limits.dcp.max_item_pickle_bytes = 1 << 20;
    o.limits.deepspeed.torch = fuzz::torch_limits();
    o.limits.deepspeed.max_entries = 1 << 14;
    o.limits.deepspeed.max_converted_buffer_bytes = 1 << 20;
    o.limits.fsdp.torch = fuzz::torch_limits();
    o.limits.fsdp.max_entries = 1 << 14;
    o.limits.sharded_tensor.pickle = fuzz::pickle_limits();
    o.limits.sharded_tensor.max_shards = 1 << 12;
    o.limits.sharded_tensor.max_pickle_bytes = 1 << 20;
  }
}
}  // namespace

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  formats::open_options o;
  o.with_optimizer = (files->flags & 1) != 0;
  o.check_replicas = (files->flags & 2) != 0;
  o.mode = (files->flags & 4) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  lower_limits(o);
  try {
    (void)formats::open(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  if (!files->files.empty()) {
    const auto first = *dir / files->files[0].name;
    std::error_code ec;
    if (std::filesystem::is_regular_file(first, ec)) {
      try {
        (void)formats::open(first, o);
      } catch (const statedict::error& e) {
        fuzz::note(e);
      }
    }
  }
  return 0;
}
