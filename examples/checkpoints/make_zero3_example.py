#!/usr/bin/python3
"""Regenerates examples/checkpoints/zero3-tiny: the sharded checkpoint the README's demo consolidates.

    /usr/bin/python3 examples/checkpoints/make_zero3_example.py

A small model (tied embedding and head, a frozen layer, batch-norm buffers, four AdamW param groups)
trained for two real steps, then partitioned and saved exactly as DeepSpeed ZeRO stage 3 does for 4
ranks with bf16 weights (the same writer the test suite's ZeRO fixtures use:
tests/python/zero_fsdp/deepspeed_layout.py). zero3-tiny.manifest.json holds the SHA-256 of every
consolidated tensor, so the demo can show that the output is right. Needs python3-torch; the
committed files make running it unnecessary.
"""
import os
import shutil
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "tests", "python"))

import torch  # noqa: E402

from zero_fsdp import deepspeed_layout as ds  # noqa: E402
from zero_fsdp import model as tiny  # noqa: E402

# Big enough to be a few MB across 4 ranks (weights, fp32 master partitions, Adam moments).
tiny.VOCAB = 1000
tiny.DIM = 96


def main():
    torch.set_num_threads(1)
    root = os.path.join(here, "zero3-tiny")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    man, _ = ds.write_case(root, ds.ZeroCase("zero3-tiny", 3, 4, dtype="bf16"))
    man.write(os.path.join(here, "zero3-tiny.manifest.json"))
    print("wrote", root)


if __name__ == "__main__":
    main()
