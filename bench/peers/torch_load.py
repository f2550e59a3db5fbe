#!/usr/bin/python3
"""Peer for B3: just torch.load (what `inspect` costs a PyTorch user).

    /usr/bin/python3 bench/peers/torch_load.py FILE [--weights-only]

torch 1.13 has no lazy or mmap load, so listing the tensors of a file means loading all of it.
Prints the number of tensors and their total bytes.  --weights-only uses the restricted unpickler
(torch.load(weights_only=True)), the safe mode comparable to statedict's allow-listed reader.
"""
import sys

import torch


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    weights_only = "--weights-only" in argv
    files = [a for a in argv if a != "--weights-only"]
    if len(files) != 1:
        raise SystemExit(__doc__)
    sd = torch.load(files[0], map_location="cpu", weights_only=weights_only)
    tensors = [v for v in sd.values() if torch.is_tensor(v)]
    print(f"{len(tensors)} tensors, {sum(t.numel() * t.element_size() for t in tensors)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
