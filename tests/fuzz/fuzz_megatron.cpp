// Fuzz target: Megatron-LM checkpoints (formats/megatron.hpp): a multi-file input (fuzz_common.hpp:
// `latest_checkpointed_iteration.txt`, `iter_0000010/mp_rank_00/model_optim_rng.pt`,
// `distrib_optim.pt`, or a torch_dist folder's `metadata.json`, `.metadata`, `common.pt`,
// `__0_0.distcp`, ...) written to a scratch directory, then megatron::detect and describe, and on
// request the description written back as a legacy checkpoint.
// Flags: bit 0 with_optimizer, bit 1 pread, bit 2 true_vocab_size 37, bit 3 a rule for every
// unnamed tensor (`*=column`), bit 4 write the result for TP 2 (through the planner).
// SPDX-License-Identifier: MIT
#include <statedict/formats/megatron.hpp>

#include "fuzz_common.hpp"
#include "fuzz_limits.hpp"

namespace mg = statedict::megatron;

STATEDICT_FUZZ_TARGET(data, size) {
  const auto files = fuzz::split_files(data, size);
  if (!files) return 0;
  const auto dir = fuzz::materialise(*files);
  if (!dir) return 0;
  mg::options o;
  o.limits.torch = fuzz::torch_limits();
  o.limits.dcp.pickle = fuzz::pickle_limits();
  o.limits.dcp.max_files = 64;
  o.limits.dcp.max_chunks = 1 << 14;
  o.limits.dcp.max_entries = 1 << 14;
  o.limits.dcp.max_metadata_bytes = 1 << 22;
  o.limits.dcp.max_item_pickle_bytes = 1 << 22;
  o.limits.max_ranks = 64;
  o.limits.max_layers = 1 << 10;
  o.limits.max_heads = 1 << 10;
  o.limits.max_tensors = 1 << 14;
  o.limits.max_chunks = 1 << 16;
  o.limits.max_small_file_bytes = 1 << 12;
  o.limits.max_compare_bytes = 1 << 24;
  o.with_optimizer = (files->flags & 1) != 0;
  o.mode = (files->flags & 2) ? statedict::read_mode::pread : statedict::read_mode::mmap;
  if (files->flags & 4) o.true_vocab_size = 37;
  if (files->flags & 8) o.rules.push_back(mg::rule{"*", mg::split::column});
  try {
    (void)mg::detect(*dir, o.limits);
    const statedict::ShardedCheckpoint ck = mg::describe(*dir, o);
    if ((files->flags & 16) && !o.with_optimizer) {
      mg::write_options w;
      w.tp = 2;
      w.exec.threads = 1;
      w.exec.memory_budget = 1 << 20;
      // Every element the plan reads lies inside the input files: bounded by the input's size.
      (void)mg::write(ck, dir->parent_path() / "out", w);
    }
  } catch (const statedict::error& e) {
    fuzz::note(e);
  }
  return 0;
}
