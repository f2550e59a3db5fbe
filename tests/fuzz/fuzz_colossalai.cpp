// Fuzz target: ColossalAI checkpoints (formats/colossalai.hpp): a multi-file input
// (fuzz_common.hpp: metadata JSON, weight files, indexes, optimizer files) written to a scratch
// directory, then colossalai::detect and describe; a description that reads is written for M
// ranks and read again, which must give the same tensors.
// Flags: bit 0 with_optimizer, bit 1 pread, bit 2 write and re-read, bits 3-4 M - 1.
// SPDX-License-Identifier: MIT
#include <statedict/exec/digest.hpp>
#include <statedict/formats/colossalai.hpp>

#include <algorithm>
#include <cstdlib>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace colossalai = statedict::colossalai;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  colossalai::options o;
  o.limits.torch = fuzz::torch_limits();
  o.limits.safetensors.max_header_bytes = 1 << 20;
  o.limits.safetensors.max_tensors = 1 << 12;
  o.limits.max_json_bytes = 1 << 20;
  o.limits.max_files = 64;
  o.limits.max_entries = 1 << 12;
  o.limits.max_value_bytes = 1 << 16;
  o.with_optimizer = (files->flags & 1) != 0;
  o.mode = (files->flags & 2) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  statedict::ShardedCheckpoint ck;
  try {
    (void)colossalai::detect(*dir, o.limits);
    ck = colossalai::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  if (!(files->flags & 4) || ck.format != "colossalai_dist") return 0;
  std::vector<std::pair<std::string, std::string>> want;
  try {
    want = statedict::sha256_tensors(ck);
  } catch (const statedict::error& e) {
    fuzz::note(e);  // a description whose bytes do not read (a piece outside its file)
    return 0;
  }
  statedict::formats::save_options so;
  so.world_size = 1 + ((files->flags >> 3) & 3);
  const auto out = fuzz::scratch_root() / "colossalai-out";
  std::error_code ec;
  std::filesystem::remove_all(out, ec);
  try {
    (void)colossalai::write(ck, out, so);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  auto got = statedict::sha256_tensors(colossalai::describe(out, o));
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  if (got != want) std::abort();
  return 0;
}
