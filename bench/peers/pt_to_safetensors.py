#!/usr/bin/python3
"""Peer for B2: torch.load a torch.save file, write it as safetensors (or torch.save it again).

    /usr/bin/python3 bench/peers/pt_to_safetensors.py IN.pt OUT.safetensors|OUT.pt

What a user does today with torch 1.13: `sd = torch.load(IN, map_location="cpu")` (the whole file
is read into memory: 1.13 has no mmap=True), then `.safetensors` -> bench/peers/st_writer.py (the
layout of safetensors.torch.save_file, minus its extra copy of every tensor), anything else ->
torch.save.  The output is fsync'ed in both cases (statedict fsyncs its outputs).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import st_writer  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    src, dst = argv
    sd = torch.load(src, map_location="cpu")
    if dst.endswith(".safetensors"):
        st_writer.save({k: v.contiguous() for k, v in sd.items()}, dst, metadata={"format": "pt"})
    else:
        torch.save(sd, dst)
        st_writer.fsync_path(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
