#!/usr/bin/python3
"""Peer for B7: merging a Megatron-LM legacy checkpoint with PyTorch, the way Megatron's
tools/checkpoint loader does it (loader_megatron.py: torch.load every rank file, concatenate the TP
pieces per rule, take replicated tensors from TP rank 0, renumber the PP stages' layers).

    /usr/bin/python3 bench/peers/megatron_merge.py CHECKPOINT_DIR OUT.safetensors

The merge is tests/python/megatron_fixtures/megatron_ref.py `merge` (non-strict, as the loader
checks nothing; no optimizer), which the test fixtures are cross-checked with. Megatron-LM itself
is not installed here (it needs apex/Transformer Engine and a GPU for its loader). The output goes
through bench/peers/st_writer.py and is fsync'ed (statedict fsyncs its outputs).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import st_writer  # noqa: E402
from megatron_fixtures import megatron_ref as R  # noqa: E402


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    merged = R.merge(sys.argv[1], strict=False, with_optimizer=False)
    st_writer.save({k: v.contiguous() for k, v in merged.model.items()}, sys.argv[2], metadata={"format": "pt"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
