#!/usr/bin/python3
"""Checks a Megatron-LM legacy checkpoint that statedict wrote, with the reference merge and split
(megatron_fixtures/megatron_ref.py, cross-checked against Megatron-LM's own code).

    /usr/bin/python3 tests/python/megatron_check.py CKPT_DIR MANIFEST|- --tp N --pp M [--vpp V]

1. megatron_ref.merge(CKPT_DIR), strict (replicated tensors and the tied head copy equal on every
   rank), must give exactly the tensors of MANIFEST, bit for bit (skipped for MANIFEST "-");
2. every rank file must hold what megatron_ref.split writes for that model at TP / PP / virtual PP:
   the same keys in the same order (`_extra_state` entries included), equal tensors (dtype, shape,
   values), checkpoint_version 3.0;
3. args must say the sizes asked for, and padded_vocab_size the rows of the word embeddings.

Exit 0 when everything holds, 1 with one line per problem on stdout, 2 on bad usage.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _common  # noqa: E402
from megatron_fixtures import megatron_ref as R  # noqa: E402


def leaves(obj, prefix=""):
    """(dotted key, value) of nested dicts, in order."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def same(a, b):
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("manifest")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--vpp", type=int, default=None)
    a = ap.parse_args()
    problems = []
    try:
        merged = R.merge(a.ckpt, strict=True, with_optimizer=False)
    except R.MegatronError as e:
        print(f"merge: {e}")
        return 1
    model, f = merged.model, merged.facts
    if a.manifest != "-":
        want = _common.load_manifest(a.manifest)["tensors"]
        if list(want) != list(model):
            problems.append(f"names: merged {list(model)[:4]}... != manifest {list(want)[:4]}...")
        for k, e in want.items():
            if k in model and _common.tensor_entry(model[k]) != e:
                problems.append(f"{k}: merged {_common.tensor_entry(model[k])} != manifest {e}")
    if (f.tp, f.pp, f.vpp) != (a.tp, a.pp, a.vpp):
        problems.append(f"args: tp {f.tp} pp {f.pp} vpp {f.vpp}, asked for {a.tp} {a.pp} {a.vpp}")
    rows = model[f"{R.LM}.embedding.word_embeddings.weight"].shape[0]
    if f.padded_vocab_size != rows:
        problems.append(f"args.padded_vocab_size {f.padded_vocab_size} != {rows} rows")
    expect = R.split(model, f, a.tp, a.pp, a.vpp)
    _, _, _, rank_dirs = R.discover(a.ckpt)
    for (r, p), chunks in expect.items():
        sd = R.load(os.path.join(rank_dirs[(r, p)], "model_optim_rng.pt"))
        if sd.get("checkpoint_version") != 3.0:
            problems.append(f"rank {r},{p}: checkpoint_version {sd.get('checkpoint_version')}")
        got_chunks = R.chunks_of(sd)
        if len(got_chunks) != len(chunks):
            problems.append(f"rank {r},{p}: {len(got_chunks)} model chunks, expected {len(chunks)}")
            continue
        for v, (got, exp) in enumerate(zip(got_chunks, chunks)):
            g, e = list(leaves(got)), list(leaves(exp))
            if [k for k, _ in g] != [k for k, _ in e]:
                problems.append(f"rank {r},{p} chunk {v}: keys {[k for k, _ in g]} != {[k for k, _ in e]}")
                continue
            for (k, x), (_, y) in zip(g, e):
                if not same(x, y):
                    problems.append(f"rank {r},{p} chunk {v}: {k} differs")
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
