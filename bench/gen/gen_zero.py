#!/usr/bin/python3
"""Generate a large DeepSpeed ZeRO-3 checkpoint (fp32 params + AdamW moments) for B1, B4 and B6.

    /usr/bin/python3 bench/gen/gen_zero.py OUTDIR --gib 3 [--ranks 8] [--layers 24] [--verify]

Writes, under OUTDIR:
  zero-<gib>g-ws<ranks>/                        the checkpoint, in DeepSpeed's exact layout:
      latest, zero_to_fp32.py (placeholder), global_step2/zero_pp_rank_{r}_mp_rank_00_{model,optim}_states.pt
  zero-<gib>g-ws<ranks>.reference.safetensors   what zero_to_fp32 produces from it (fp32 params, in
                                                safetensors.torch.save_file's layout): the oracle for
                                                outputs, and the bytes `cp` copies in B1/B6
  zero-<gib>g-ws<ranks>.stamp.json              reuse marker

--gib is the size of the fp32 data in the optimizer files: params + exp_avg + exp_avg_sq, i.e. 12
bytes per parameter; the consolidated weights are a third of it.

Layout: every rule (per-parameter ceil(numel/ws) partitions, padding left as torch.empty garbage,
fp32 flat groups as narrows of one buffer, the optimizer_state_dict of a torch AdamW over the flat
partitions, model_states keys, GPU storage locations 'cuda:<rank>', the DeepSpeed stand-in classes)
comes from tests/python/zero_fsdp/deepspeed_layout.py, imported here, not re-derived; see
docs/notes/zero-fsdp-layouts.md for the sources.  Only the model differs: instead of training a tiny
net, a LLaMA-like skeleton (embedding, --layers decoder layers, norm, untied head; vocab 32003 and an
odd MLP width so that most parameters need padding with 8 ranks) is filled with random values
computed from (parameter, element index), so no full parameter tensor is held while writing a rank.
Two param groups (matrices with weight decay, vectors without), as training recipes do.
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
VOCAB = 32003
GiB = 1 << 30
BASE_NUMEL = 1 << 24


def param_specs(d, layers):
    f = 2 * int(round(4 * d / 3)) + 1  # odd MLP width: numel % ranks != 0 for most tensors
    out = [("model.embed_tokens.weight", (VOCAB, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (d, d)),
                (p + "self_attn.v_proj.weight", (d, d)), (p + "self_attn.o_proj.weight", (d, d)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    out += [("model.norm.weight", (d,)), ("lm_head.weight", (VOCAB, d))]
    return out


def solve(gib, layers):
    target = gib * GiB / 12  # fp32 param + exp_avg + exp_avg_sq per element
    lo, hi = 4, 1 << 16
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(math.prod(s) for _, s in param_specs(mid, layers)) >= target:
            hi = mid
        else:
            lo = mid + 1
    return param_specs(lo, layers), lo


class Values:
    """Deterministic contents: element j of (parameter k, kind) is base_kind[(off_k + j) % BASE_NUMEL]."""

    def __init__(self, seed):
        import torch
        g = torch.Generator().manual_seed(seed)
        b = torch.randn(BASE_NUMEL, generator=g)
        self.base = {"param": b, "exp_avg": b.roll(12345) * 1e-2, "exp_avg_sq": b.roll(54321).abs() * 1e-4}

    def fill(self, kind, k, start, out):
        base = self.base[kind]
        off = (k * 2654435761 + start + {"param": 0, "exp_avg": 7, "exp_avg_sq": 13}[kind]) % BASE_NUMEL
        pos, n_out = 0, out.numel()
        while pos < n_out:
            n = min(n_out - pos, BASE_NUMEL - off)
            out[pos:pos + n].copy_(base[off:off + n])
            pos += n
            off = 0

    def full(self, kind, k, shape):
        import torch
        t = torch.empty(shape, dtype=torch.float32)
        self.fill(kind, k, 0, t.view(-1))
        return t


def skeleton(specs):
    """An nn.Module tree with the parameter names, every parameter a torch.empty(0) (what a ZeRO-3
    partitioned module holds), for the buffer/shared-parameter walks of deepspeed_layout."""
    import torch
    import torch.nn as nn
    root = nn.Module()
    for name, _ in specs:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part) or getattr(m, part) is None:
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.empty(0)))
    return root


def write(root, specs, ws, seed, log):
    import torch
    from zero_fsdp import deepspeed_layout as ds
    from zero_fsdp import standins
    standins.install()
    case = ds.ZeroCase(os.path.basename(root), 3, ws)
    values = Values(seed)
    index = {name: k for k, (name, _) in enumerate(specs)}
    shapes = dict(specs)
    groups = [[n for n, s in specs if len(s) >= 2], [n for n, s in specs if len(s) < 2]]
    hps = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False},
           {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False}]

    # stage3.py _create_fp16_sub_groups with DeepSpeed's default sub_group_size (1e9 elements):
    # one sub-group per param group at these sizes.
    class P:  # the numel() the sub-group split needs
        def __init__(self, name):
            self.name, self._n = name, math.prod(shapes[name])

        def numel(self):
            return self._n

    sub_groups, sub_gid = [], []
    for gi, names in enumerate(groups):
        for sg in ds.z3_sub_groups([P(n) for n in names], ws, 1_000_000_000):
            sub_groups.append([p.name for p in sg])
            sub_gid.append(gi)
    param_shapes = [collections.OrderedDict((n, torch.Size(shapes[n])) for n in sg) for sg in sub_groups]

    net = skeleton(specs)
    module_sd = net.state_dict()
    ds_config = ds.ds_config_dict(case)
    tag_dir = os.path.join(root, ds.TAG)
    os.makedirs(tag_dir, exist_ok=True)
    step = torch.tensor(2.0)
    for r in range(ws):
        t0 = time.time()
        sizes = [sum(ds.z3_partition_numel(math.prod(shapes[n]), ws) for n in sg) for sg in sub_groups]
        # fp32 model: the fp32 flat groups are narrows of one defragmented buffer (stage3.py)
        buf = torch.full((sum(sizes),), ds.Z3_PADDING_GARBAGE, dtype=torch.float32)
        flats, m1s, m2s, off = [], [], [], 0
        for sg, size in zip(sub_groups, sizes):
            flat = buf.narrow(0, off, size)
            m1, m2 = torch.zeros(size), torch.zeros(size)
            pos = 0
            for n in sg:
                numel = math.prod(shapes[n])
                pn = ds.z3_partition_numel(numel, ws)
                start = r * pn
                cnt = max(0, min(pn, numel - start))
                if cnt:
                    values.fill("param", index[n], start, flat[pos:pos + cnt])
                    values.fill("exp_avg", index[n], start, m1[pos:pos + cnt])
                    values.fill("exp_avg_sq", index[n], start, m2[pos:pos + cnt])
                pos += pn
            flats.append(flat)
            m1s.append(m1)
            m2s.append(m2)
            off += size
        groups_params = [[] for _ in groups]
        states = []
        for f, e1, e2, gi in zip(flats, m1s, m2s, sub_gid):
            groups_params[gi].append(f)
            states.append((f, {"step": step.clone(), "exp_avg": e1, "exp_avg_sq": e2}))
        osd = {}
        osd["zero_stage"] = standins.ZeroStageEnum.weights
        osd["loss_scaler"] = ds.make_loss_scaler(case)
        osd["dynamic_loss_scale"] = bool(osd["loss_scaler"].dynamic)
        osd["overflow"] = False
        osd["partition_count"] = ws
        osd["optimizer_state_dict"] = ds.torch_optimizer_state_dict(groups_params, hps, states)
        osd["fp32_flat_groups"] = flats
        zero_sd = dict(optimizer_state_dict=osd, ds_config=ds_config, ds_version=ds.DS_VERSION)
        ds._save(case, zero_sd, os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), r)
        model = ds._model_states(case, net, module_sd, param_shapes, collections.OrderedDict(),
                                 collections.OrderedDict(), ds_config)
        ds._save(case, model, os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), r)
        del buf, flats, m1s, m2s, states, osd, zero_sd
        log(f"  rank {r}: {sum(sizes) * 12 / GiB:.2f} GiB in {time.time() - t0:.1f}s")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(ds.TAG)
    with open(os.path.join(root, "zero_to_fp32.py"), "w") as f:
        f.write("# Placeholder: DeepSpeed copies its deepspeed/utils/zero_to_fp32.py recovery script here.\n")
    order = [n for sg in sub_groups for n in sg]  # zero_to_fp32 output order (no buffers, nothing frozen)
    return values, index, order


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--gib", type=float, default=3.0, help="fp32 params + exp_avg + exp_avg_sq, GiB (default 3)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--verify", action="store_true",
                    help="re-read with tests/python/zero_fsdp/reference_consolidate.py and compare (small sizes)")
    args = ap.parse_args(argv)
    name = f"zero-{args.gib:g}g-ws{args.ranks}"
    root = os.path.join(args.outdir, name)
    ref = root + ".reference.safetensors"
    stamp_path = root + ".stamp.json"
    params = {"version": VERSION, "gib": args.gib, "ranks": args.ranks, "layers": args.layers, "seed": args.seed}
    if not args.force and stamp.fresh(stamp_path, params):
        print(f"gen_zero: {root} is up to date")
        return 0

    import shutil
    import torch
    import st_writer
    torch.set_num_threads(2)
    t0 = time.time()
    for p in (stamp_path, ref):
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    specs, d = solve(args.gib, args.layers)
    shapes = dict(specs)
    values, index, order = write(root, specs, args.ranks, args.seed, print)
    st_writer.save_lazy({n: ("F32", shapes[n]) for n in order},
                        lambda n: values.full("param", index[n], shapes[n]), ref + ".tmp",
                        metadata={"format": "pt"})
    os.replace(ref + ".tmp", ref)
    stamp.sync_paths([root])
    n_params = sum(math.prod(s) for _, s in specs)
    if args.verify:
        sys.path.insert(0, os.path.join(REPO, "bench", "harness"))
        import stcheck
        from zero_fsdp import reference_consolidate
        sd, _ = reference_consolidate.zero_to_fp32(root)
        st_writer.save({k: v.contiguous() for k, v in sd.items()}, ref + ".check", metadata={"format": "pt"})
        diff = stcheck.same_tensors(ref + ".check", ref)
        os.remove(ref + ".check")
        if diff:
            raise SystemExit(f"gen_zero: reference_consolidate disagrees with the reference: {diff}")
        print("gen_zero: verified against tests/python/zero_fsdp/reference_consolidate.py")
    stamp.record(stamp_path, params, [root, ref])
    print(f"gen_zero: {len(specs)} params, d={d}, {n_params / 1e6:.1f}M elements "
          f"({n_params * 4 / GiB:.2f} GiB fp32 weights, {n_params * 12 / GiB:.2f} GiB with moments), "
          f"{args.ranks} ranks, {time.time() - t0:.1f}s -> {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
