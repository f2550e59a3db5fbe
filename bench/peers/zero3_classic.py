#!/usr/bin/python3
"""Peer for B1/B6: the classic ZeRO-3 consolidation, as DeepSpeed's zero_to_fp32.py does it.

    /usr/bin/python3 bench/peers/zero3_classic.py CHECKPOINT_DIR OUT.safetensors|OUT.bin [--tag TAG]

The algorithm is the eager one of deepspeed/utils/zero_to_fp32.py (deepspeedai/DeepSpeed), the only
one torch 1.13 can run (the lazy mode of DeepSpeed >= 0.16 needs torch.load(mmap=True), torch >= 2.1):
  1. read `latest`, glob `*_optim_states.pt` in natural order, torch.load every file whole
     (map_location='cpu'), check zero_stage == 3 and partition_count == number of files;
  2. per rank, torch.cat its fp32_flat_groups into one flat vector (the moments are loaded with the
     file and dropped when the loaded dicts go out of scope);
  3. torch.load rank 0's model_states for param_shapes and the buffers (cast to float);
  4. for each parameter, in param_shapes order: partitioned = ceil(numel / ws); cat that slice of
     every rank's flat vector, narrow to numel, view as the shape; check offset * ws == available;
  5. re-alias shared parameters; save.
Output: `.safetensors` through bench/peers/st_writer.py (zero_to_fp32 --safe_serialization calls
safetensors' save_file with metadata {"format": "pt"}; our writer is the same layout without its
extra copy), anything else with torch.save.  The output is fsync'ed in both cases (statedict fsyncs).

DeepSpeed is not installed here; its pickled classes resolve to the stand-ins of
tests/python/zero_fsdp/standins.py, as they would to the real classes with DeepSpeed installed.
No DeepSpeed code is copied; this re-implements the published algorithm.
"""
import argparse
import glob
import math
import os
import re
import sys
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

import torch  # noqa: E402

from zero_fsdp import standins  # noqa: E402


def natural_keys(text):
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def load(path):
    return torch.load(path, map_location="cpu")


def parse_optim_states(tag_dir):
    files = sorted(glob.glob(os.path.join(tag_dir, "*_optim_states.pt")), key=natural_keys)
    if not files:
        raise SystemExit(f"no *_optim_states.pt in {tag_dir}")
    state_dicts = [load(f) for f in files]
    osd0 = state_dicts[0]["optimizer_state_dict"]
    if "zero_stage" not in osd0:
        raise SystemExit(f"{files[0]} is not a zero checkpoint")
    stage = int(osd0["zero_stage"])
    ws = osd0["partition_count"]
    ws = max(ws) if isinstance(ws, list) else ws
    if stage != 3:
        raise SystemExit(f"this peer handles ZeRO-3 only (found stage {stage})")
    if ws != len(files):
        raise SystemExit(f"expected {ws} optim files, found {len(files)}")
    flat = [torch.cat(sd["optimizer_state_dict"]["fp32_flat_groups"], 0) for sd in state_dicts]
    return ws, flat


def parse_model_state(tag_dir):
    sd = load(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    if "buffer_names" not in sd:
        raise SystemExit("not a model states file")
    names = sd["buffer_names"]
    buffers = OrderedDict((k, v.float()) for k, v in sd["module"].items() if k in names)
    shared = [[k, v] for k, v in (sd.get("shared_params") or {}).items()]
    return buffers, sd["param_shapes"], shared


def consolidate(root, tag=None):
    if tag is None:
        with open(os.path.join(root, "latest")) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(root, tag)
    ws, flat = parse_optim_states(tag_dir)
    buffers, param_shapes, shared = parse_model_state(tag_dir)
    avail = flat[0].numel() * ws
    shapes = {k: v for d in param_shapes for k, v in d.items()}
    out = OrderedDict(buffers)
    offset = 0
    for name, shape in shapes.items():
        numel = shape.numel()
        part = math.ceil(numel / ws)
        out[name] = torch.cat(tuple(flat[r].narrow(0, offset, part) for r in range(ws)), 0) \
            .narrow(0, 0, numel).view(shape)
        offset += part
    if offset * ws != avail:
        raise SystemExit(f"consumed {offset * ws} numels out of {avail}")
    for alias, owner in shared:
        if owner in out:
            out[alias] = out[owner]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("checkpoint_dir")
    ap.add_argument("output")
    ap.add_argument("--tag")
    args = ap.parse_args(argv)
    standins.install()
    sd = consolidate(args.checkpoint_dir, args.tag)
    if args.output.endswith(".safetensors"):
        import st_writer
        st_writer.save(sd, args.output, metadata={"format": "pt"})
    else:
        import st_writer
        torch.save(sd, args.output)
        st_writer.fsync_path(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
