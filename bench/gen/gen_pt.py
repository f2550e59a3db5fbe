#!/usr/bin/python3
"""Generate the B2/B3 data: one state dict as a torch.save `.pt` and the same tensors as `.safetensors`.

    /usr/bin/python3 bench/gen/gen_pt.py OUTDIR [--gib 3] [--tensors 10000] [--seed 1]

Writes OUTDIR/model.pt (torch.save, torch 1.13, zip format), OUTDIR/model.safetensors (same names,
dtypes and bytes; the reference layout of safetensors.torch.save_file, see bench/peers/st_writer.py)
and OUTDIR/model.stamp.json.  Nothing is written when the stamp says the files are already there with
these parameters.

The state dict looks like a transformer's: one embedding, then blocks of 12 tensors (two layer norms,
fused qkv as [3d, d] or, every 5th block, as [3, d, d], output projection, two MLP matrices, their
biases) whose width d varies around a common d0 (x0.5 .. x1.5), every 10th block in bfloat16, every
100th block with a 0-d int64 counter.  d0 is solved so that the total is --gib GiB.  Values are
random (a 64 MiB randn buffer copied at per-tensor offsets): no two tensors are equal, no Python loop
touches an element.
"""
import argparse
import collections
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "peers"))

import stamp  # noqa: E402

VERSION = 1  # bump when the content or layout of the generated files changes
VOCAB = 50257
WIDTH_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5)
GiB = 1 << 30


def block_shapes(i, d):
    p = f"model.layers.{i}."
    qkv = (3, d, d) if i % 5 == 4 else (3 * d, d)
    return [
        (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
        (p + "attn.qkv.weight", qkv), (p + "attn.qkv.bias", (3 * d,)),
        (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
        (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
        (p + "mlp.fc1.weight", (4 * d, d)), (p + "mlp.fc1.bias", (4 * d,)),
        (p + "mlp.fc2.weight", (d, 4 * d)), (p + "mlp.fc2.bias", (d,)),
    ]


def plan_for(d0, n_blocks):
    """[(name, dtype_str, shape)] for a given base width."""
    out = [("model.embed_tokens.weight", "float32", (VOCAB, d0))]
    for i in range(n_blocks):
        d = max(8, int(round(WIDTH_FACTORS[i % len(WIDTH_FACTORS)] * d0)))
        dt = "bfloat16" if i % 10 == 9 else "float32"
        out += [(n, dt, s) for n, s in block_shapes(i, d)]
        if i % 100 == 99:
            out.append((f"model.layers.{i}.num_batches_tracked", "int64", ()))
    return out


def plan_bytes(plan):
    size = {"float32": 4, "bfloat16": 2, "int64": 8}
    return sum(size[dt] * math.prod(s) for _, dt, s in plan)


def make_plan(total_bytes, n_tensors):
    n_blocks = max(1, int(round((n_tensors - 1) / (12 + 1 / 100))))
    lo, hi = 8, 1 << 16
    while lo < hi:  # smallest d0 whose plan reaches the target
        mid = (lo + hi) // 2
        if plan_bytes(plan_for(mid, n_blocks)) >= total_bytes:
            hi = mid
        else:
            lo = mid + 1
    return plan_for(lo, n_blocks), lo


def fill(plan, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1 << 24, generator=g)
    n_base = base.numel()
    sd = collections.OrderedDict()
    for k, (name, dt, shape) in enumerate(plan):
        t = torch.empty(shape, dtype=getattr(torch, dt))
        flat = t.view(-1)
        if dt == "int64":
            flat.fill_(1000 + k)
        else:
            pos, off = 0, (k * 2654435761) % n_base
            while pos < flat.numel():
                n = min(flat.numel() - pos, n_base - off)
                flat[pos:pos + n].copy_(base[off:off + n])
                pos += n
                off = 0
        sd[name] = t
    return sd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--gib", type=float, default=3.0, help="total tensor bytes, GiB (default 3)")
    ap.add_argument("--tensors", type=int, default=10000, help="approximate tensor count (default 10000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--force", action="store_true", help="regenerate even if the stamp matches")
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    pt = os.path.join(args.outdir, "model.pt")
    st = os.path.join(args.outdir, "model.safetensors")
    stamp_path = os.path.join(args.outdir, "model.stamp.json")
    params = {"version": VERSION, "gib": args.gib, "tensors": args.tensors, "seed": args.seed}
    if not args.force and stamp.fresh(stamp_path, params):
        print(f"gen_pt: {args.outdir} is up to date")
        return 0

    import torch
    import st_writer
    torch.set_num_threads(2)
    t0 = time.time()
    plan, d0 = make_plan(int(args.gib * GiB), args.tensors)
    sd = fill(plan, args.seed)
    for p in (pt, st, stamp_path):
        if os.path.exists(p):
            os.remove(p)
    torch.save(sd, pt + ".tmp")
    st_writer.fsync_path(pt + ".tmp")
    os.replace(pt + ".tmp", pt)
    st_writer.save(sd, st + ".tmp", metadata={"format": "pt"})
    os.replace(st + ".tmp", st)
    nbytes = plan_bytes(plan)
    n_bf16 = sum(1 for _, dt, _ in plan if dt == "bfloat16")
    stamp.record(stamp_path, params, [pt, st])
    print(f"gen_pt: {len(plan)} tensors ({n_bf16} bf16), d0={d0}, {nbytes / GiB:.2f} GiB of tensor data, "
          f"{time.time() - t0:.1f}s -> {pt}, {st}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
