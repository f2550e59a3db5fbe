#!/usr/bin/python3
"""Generate a large Megatron-LM legacy checkpoint (tensor- and pipeline-parallel rank files) for B7.

    /usr/bin/python3 bench/gen/gen_megatron.py OUTDIR --gib 3 [--tp 4] [--pp 2] [--layers 8]

Writes, under OUTDIR:
  megatron-<gib>g-tp<tp>pp<pp>/                       the checkpoint: latest_checkpointed_iteration.txt,
      iter_0000001/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt   (mp_rank_<tp:02d> when PP is 1)
  megatron-<gib>g-tp<tp>pp<pp>.reference.safetensors  the full model by its canonical names (the
                                                      oracle for outputs, and the bytes `cp` copies)
  megatron-<gib>g-tp<tp>pp<pp>.stamp.json             reuse marker

--gib is the size of the bf16 weights (what the rank files hold, give or take the replicated norms).
The model is LLaMA-shaped (GQA with 8 query groups, SwiGLU, RMSNorm, untied output layer; vocab
32000 padded to a multiple of 128 x TP as Megatron pads it); its values come from a random buffer
at per-tensor offsets. The split into rank files is not re-derived here: it is
tests/python/megatron_fixtures/megatron_ref.py `write_split` (Megatron's saver rules, cross-checked
against Megatron-LM's own code; see tests/python/layouts/megatron.md), the same code that judges the
test fixtures.
"""
import argparse
import collections
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "bench", "peers"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

import stamp  # noqa: E402

VERSION = 1
VOCAB = 32000
GROUPS = 8
HEAD_DIM = 128
GiB = 1 << 30
BASE_NUMEL = 1 << 24
LM = "language_model"


def shapes(d, layers, tp):
    """Canonical names and shapes (legacy names, global layers) for hidden size d."""
    heads = d // HEAD_DIM
    ffn = 256 * ((8 * d // 3 + 255) // 256)
    mult = 128 * tp
    vocab = -(-VOCAB // mult) * mult
    out = [(f"{LM}.embedding.word_embeddings.weight", (vocab, d))]
    for i in range(layers):
        p = f"{LM}.encoder.layers.{i}."
        out += [(p + "input_norm.weight", (d,)),
                (p + "self_attention.query_key_value.weight", ((heads + 2 * GROUPS) * HEAD_DIM, d)),
                (p + "self_attention.dense.weight", (d, heads * HEAD_DIM)),
                (p + "post_attention_norm.weight", (d,)),
                (p + "mlp.dense_h_to_4h.weight", (2 * ffn, d)),
                (p + "mlp.dense_4h_to_h.weight", (d, ffn))]
    out += [(f"{LM}.encoder.final_norm.weight", (d,)), (f"{LM}.output_layer.weight", (vocab, d))]
    return out, heads, ffn, vocab


def solve(gib, layers, tp):
    """The hidden size (a multiple of 128 x 8 groups, so TP up to 8 divides the heads and groups)
    whose bf16 weights come closest to `gib` from above."""
    target = gib * GiB / 2
    d = 1024
    while sum(math.prod(s) for _, s in shapes(d, layers, tp)[0]) < target:
        d += 1024
    return d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--gib", type=float, default=3.0, help="bf16 weights, GiB (default 3)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    name = f"megatron-{args.gib:g}g-tp{args.tp}pp{args.pp}"
    root = os.path.join(args.outdir, name)
    ref = root + ".reference.safetensors"
    stamp_path = root + ".stamp.json"
    params = {"version": VERSION, "gib": args.gib, "tp": args.tp, "pp": args.pp, "layers": args.layers, "seed": args.seed}
    if not args.force and stamp.fresh(stamp_path, params):
        print(f"gen_megatron: {root} is up to date")
        return 0

    import shutil
    import torch
    import st_writer
    from megatron_fixtures import megatron_ref as R
    from megatron_fixtures import standins
    standins.install()
    torch.set_num_threads(2)
    t0 = time.time()
    for p in (stamp_path, ref):
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(root, ignore_errors=True)
    d = solve(args.gib, args.layers, args.tp)
    specs, heads, ffn, vocab = shapes(d, args.layers, args.tp)
    g = torch.Generator().manual_seed(args.seed)
    base = torch.randn(BASE_NUMEL, generator=g).to(torch.bfloat16)
    model = collections.OrderedDict()
    for k, (n, s) in enumerate(specs):
        t = torch.empty(math.prod(s), dtype=torch.bfloat16)
        off, pos = (k * 2654435761) % BASE_NUMEL, 0
        while pos < t.numel():
            c = min(t.numel() - pos, BASE_NUMEL - off)
            t[pos:pos + c].copy_(base[off:off + c])
            pos += c
            off = 0
        model[n] = t.view(s)
    f = R.Facts(tp=args.tp, pp=args.pp, vpp=None, num_layers=args.layers, heads=heads, groups=GROUPS,
                kv_channels=HEAD_DIM, swiglu=True, untied=True, checkpoint_version=3.0, padded_vocab_size=vocab,
                dtype=torch.bfloat16, use_distributed_optimizer=False, dp=1, bucket_size=None)
    import argparse as ap_mod
    template = ap_mod.Namespace(hidden_size=d, ffn_hidden_size=ffn, seq_length=4096, max_position_embeddings=4096,
                                make_vocab_size_divisible_by=128, normalization="RMSNorm", bf16=True,
                                position_embedding_type="rope", add_bias_linear=False)
    R.write_split(model, f, root, args.tp, args.pp, None, iteration=1, args_template=template)
    st_writer.save(model, ref + ".tmp", metadata={"format": "pt"})
    os.replace(ref + ".tmp", ref)
    stamp.sync_paths([root])
    stamp.record(stamp_path, params, [root, ref])
    n = sum(t.numel() for t in model.values())
    print(f"gen_megatron: {len(specs)} tensors, d={d}, {n / 1e6:.1f}M parameters ({n * 2 / GiB:.2f} GiB bf16), "
          f"TP {args.tp} x PP {args.pp}, {time.time() - t0:.1f}s -> {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
