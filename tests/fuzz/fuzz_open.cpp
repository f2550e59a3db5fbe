// Fuzz target: formats::open (formats/registry.hpp), the content-based detection of every format:
// a multi-file input (fuzz_common.hpp) written to a scratch directory, opened as a directory and,
// when the first file is a regular file, as that file. Every reader's caps are lowered through
// open_options::settings as in the other targets.
// Flags: bit 0 with_optimizer, bit 1 check_replicas, bit 2 pread.
// SPDX-License-Identifier: MIT
#include <statedict/formats/registry.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace formats = statedict::formats;

namespace {
void lower_limits(formats::open_options& o) {
  auto& st = o.settings.set<statedict::safetensors::open_options>();
  st.lim.max_header_bytes = 1 << 20;
  st.lim.max_tensors = 1 << 14;
  auto& hf = o.settings.set<statedict::hf::open_options>();
  hf.lim = st.lim;
  hf.max_index_bytes = 1 << 20;
  o.settings.set<statedict::torch::load_options>().limits = fuzz::torch_limits();
  auto& dcp = o.settings.set<statedict::dcp::options>().limits;
  dcp.pickle = fuzz::pickle_limits();
  dcp.max_entries = 1 << 14;
  dcp.max_chunks = 1 << 14;
  dcp.max_metadata_bytes = 1 << 20;
  dcp.max_item_pickle_bytes = 1 << 20;
  auto& ds = o.settings.set<statedict::deepspeed::options>().limits;
  ds.torch = fuzz::torch_limits();
  ds.max_entries = 1 << 14;
  ds.max_converted_buffer_bytes = 1 << 20;
  auto& fsdp = o.settings.set<statedict::fsdp::options>().limits;
  fsdp.torch = fuzz::torch_limits();
  fsdp.max_entries = 1 << 14;
  auto& sh = o.settings.set<statedict::sharded_tensor::options>().limits;
  sh.pickle = fuzz::pickle_limits();
  sh.max_shards = 1 << 12;
  sh.max_pickle_bytes = 1 << 20;
  auto& ol = o.settings.set<statedict::olmo_safetensors::options>().limits;
  ol.pickle = fuzz::pickle_limits();
  ol.safetensors = st.lim;
  ol.max_value_bytes = 1 << 20;
  auto& co = o.settings.set<statedict::colossalai::options>().limits;
  co.torch = fuzz::torch_limits();
  co.safetensors = st.lim;
  co.max_json_bytes = 1 << 20;
  co.max_files = 64;
  co.max_entries = 1 << 12;
  co.max_value_bytes = 1 << 16;
  auto& fa = o.settings.set<statedict::fairscale::options>().limits;
  fa.torch = fuzz::torch_limits();
  fa.max_ranks = 64;
  fa.max_entries = 1 << 12;
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
