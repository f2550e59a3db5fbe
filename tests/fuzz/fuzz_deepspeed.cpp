// Fuzz target: DeepSpeed ZeRO 1/2/3 checkpoints (formats/deepspeed.hpp): a multi-file input
// (fuzz_common.hpp: `latest`, `global_step2/mp_rank_00_model_states.pt`,
// `global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt`, ...) written to a scratch directory,
// then deepspeed::detect and deepspeed::describe.
// Flags: bit 0 with_optimizer, bit 1 frozen_from_module, bit 2 pread, bit 3 dtype BF16; bit 4
// (with bit 0): write what was described again for 1 + bits 5-6 ranks (deepspeed::write) and
// read it back: the same tensors, or an error, never a crash (abort when the bytes differ).
// SPDX-License-Identifier: MIT
#include <statedict/exec/digest.hpp>
#include <statedict/formats/deepspeed.hpp>

#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace ds = statedict::deepspeed;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  ds::options o;
  o.limits.torch = fuzz::torch_limits();
  o.limits.max_ranks = 64;
  o.limits.max_entries = 1 << 14;
  o.limits.max_converted_buffer_bytes = 1 << 20;
  o.with_optimizer = (files->flags & 1) != 0;
  o.frozen_from_module = (files->flags & 2) != 0;
  o.mode = (files->flags & 4) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  if (files->flags & 8) o.dtype = statedict::dtype::BF16;
  statedict::ShardedCheckpoint ck;
  try {
    (void)ds::detect(*dir, {}, o.limits);
    ck = ds::describe(*dir, o);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  if ((files->flags & 17) != 17 || o.dtype) return 0;
  std::vector<std::pair<std::string, std::string>> want;
  try {
    want = statedict::sha256_tensors(ck);
  } catch (const statedict::error& e) {
    fuzz::note(e);  // a description whose bytes do not read (a piece outside its file)
    return 0;
  }
  ds::write_options w;
  w.world_size = 1 + ((files->flags >> 5) & 3);
  const auto out = fuzz::scratch_root() / "deepspeed-out";
  std::error_code ec;
  std::filesystem::remove_all(out, ec);
  try {
    (void)ds::write(ck, out, w);
  } catch (const statedict::error& e) {
    fuzz::note(e);
    return 0;
  }
  auto got = statedict::sha256_tensors(ds::describe(out, o));
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  if (got != want) std::abort();
  return 0;
}
