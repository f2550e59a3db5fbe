#!/usr/bin/python3
"""fairscale FSDP sharded checkpoints as fairseq and metaseq save them (OPT's released files are of
this kind), with manifests of the consolidated model and optimizer.

    /usr/bin/python3 tests/python/gen_fairscale.py OUTDIR [--only SUBSTRING]...

Per case C: OUTDIR/C/ holds one torch.save file per data-parallel rank (metaseq:
checkpoint_last-model_part-0-shard{r}.pt with "shard_metadata"; fairseq: checkpoint_last-shard{r}.pt
with "fsdp_metadata"), OUTDIR/C.manifest.json the consolidated weights, OUTDIR/C.optim.manifest.json
the consolidated Adam state keyed by parameter name, OUTDIR/C.rank0.manifest.json the raw rank-0
file as torch.load returns it.

fairscale needs CUDA, so FSDP's sharding is reproduced by following its source
(FullyShardedDataParallel._shard_parameters_ / _get_shard / local_state_dict / local_metadata_dict,
FlattenParamsWrapper, fairseq and metaseq Trainer.state_dict; layouts/fairscale.md cites each). The
model is OPT-shaped: a root FSDP unit (embeddings, final layer norm, and the output projection tied to
the token embedding), one flattened unit per layer (layer 0 holds a second, nested tie), a unit with
flatten_parameters=False, an expert unit (world size 1, no_broadcast_optim_state; fairseq cases), and
the "decoder.version" buffer. Every case is consolidated again by layouts/fairscale.py from the
files alone and must equal the source model and optimizer bit for bit.
"""
import argparse
import collections
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import _common as C  # noqa: E402
import torch_check  # noqa: E402
from layouts import fairscale as ref  # noqa: E402
from layouts._raw import flatten as raw_flatten  # noqa: E402

D, V, P, F = 5, 11, 7, 8


# --------------------------------------------------------------------------- the model
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))


class Layer(nn.Module):
    def __init__(self, expert=False):
        super().__init__()
        self.self_attn = Attn()
        self.self_attn_layer_norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, F)
        self.fc2 = nn.Linear(F, D)
        self.final_layer_norm = nn.LayerNorm(D)
        if expert:
            self.expert = nn.Linear(D, D)


class Decoder(nn.Module):
    def __init__(self, expert):
        super().__init__()
        self.register_buffer("version", torch.Tensor([3]))  # fairseq's TransformerDecoder
        self.embed_tokens = nn.Embedding(V, D)
        self.embed_positions = nn.Embedding(P, D)
        self.layers = nn.ModuleList([Layer(), Layer(expert)])
        self.layer_norm = nn.LayerNorm(D)
        self.adapter = nn.Linear(2, 2)
        self.output_projection = nn.Linear(D, V, bias=False)
        self.output_projection.weight = self.embed_tokens.weight          # tie in the root unit
        self.layers[0].self_attn.v_proj.weight = self.layers[0].self_attn.k_proj.weight  # tie in a nested unit


class Model(nn.Module):
    def __init__(self, expert=False):
        super().__init__()
        self.decoder = Decoder(expert)

    def forward(self, idx):
        d = self.decoder
        x = d.embed_tokens(idx) + d.embed_positions(torch.arange(idx.shape[1]))
        for layer in d.layers:
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            x = x + a.out_proj(torch.tanh(a.q_proj(h)) * a.k_proj(h) + a.v_proj(h))
            x = x + layer.fc2(torch.relu(layer.fc1(layer.final_layer_norm(x))))
            if hasattr(layer, "expert"):
                x = x + layer.expert(x)
        x = d.layer_norm(x)
        x = x + d.adapter(x[..., :2]).sum(-1, keepdim=True)
        return d.output_projection(x)


# FSDP units in named_modules() order: (fsdp_path, flatten_parameters, no_broadcast_optim_state)
UNITS = [("", True, False), ("decoder.layers.0", True, False), ("decoder.layers.1", True, False),
         ("decoder.layers.1.expert", True, True), ("decoder.adapter", False, False)]


def unit_params(model, units):
    """Per unit: [(name relative to the unit, parameter)] as FlattenParamsWrapper collects them
    (named_modules order, each parameter once), and [(dst, src)] shared-parameter pairs."""
    paths = [u[0] for u in units]
    owner = {}
    for path in paths:
        mod = model.get_submodule(path) if path else model
        for mname, m in mod.named_modules():
            full_m = ".".join(p for p in (path, mname) if p)
            for n, _p in m.named_parameters(recurse=False):
                full = f"{full_m}.{n}" if full_m else n
                owner[full] = max((q for q in paths if q == "" or full.startswith(q + ".")), key=len)
    out, ties = {}, {}
    for path in paths:
        mod = model.get_submodule(path) if path else model
        seen, plist, tlist = {}, [], []
        for mname, m in mod.named_modules():
            for n, p in m.named_parameters(recurse=False):
                rel = f"{mname}.{n}" if mname else n
                full = f"{path}.{rel}" if path else rel
                if owner[full] != path:
                    continue
                if id(p) in seen:
                    tlist.append((rel, seen[id(p)]))  # (dst, src), relative to the unit
                else:
                    seen[id(p)] = rel
                    plist.append((rel, p))
        out[path], ties[path] = plist, tlist
    return out, ties


def train(expert, seed=31):
    torch.manual_seed(seed)
    model = Model(expert)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    idx = torch.randint(0, V, (2, P))
    for _ in range(2):
        opt.zero_grad()
        model(idx).logsumexp(-1).mean().backward()
        opt.step()
    st = {id(p): opt.state[p] for p in model.parameters()}
    return model, st


# --------------------------------------------------------------------------- FSDP sharding
def get_shard(flat, world, rank):
    """FullyShardedDataParallel._get_shard: torch.chunk into `world` pieces, missing pieces empty,
    right-padded with zeros to the first piece's length. -> (shard, num_padded)."""
    chunks = list(torch.flatten(flat).chunk(world))
    while len(chunks) < world:
        chunks.append(chunks[0].new_empty(0))
    pad = chunks[0].numel() - chunks[rank].numel()
    shard = chunks[rank].clone()
    if pad > 0:
        shard = torch.nn.functional.pad(shard, [0, pad])
    return shard, pad


class Case:
    def __init__(self, name, world, flavour, schema="0.4", dtype=torch.float16, expert=False):
        self.name, self.world, self.flavour, self.schema = name, world, flavour, schema
        self.dtype, self.expert = dtype, expert  # dtype: the flat parameters' dtype in training
        # fairseq's utils.move_to_cpu casts every fp16/bf16 tensor to fp32 before torch.save;
        # metaseq's keeps fp16 when training with --memory-efficient-fp16.
        self.stored = torch.float32 if flavour == "fairseq" else dtype

    def file(self, r):
        if self.flavour == "metaseq":
            return f"checkpoint_last-model_part-0-shard{r}.pt"
        return f"checkpoint_last-shard{r}.pt"


CASES = [
    Case("metaseq_fsdp_ws2_fp16", 2, "metaseq"),
    Case("metaseq_fsdp_ws3_fp16", 3, "metaseq"),
    Case("fairseq_fsdp_ws2_fp32_expert", 2, "fairseq", dtype=torch.float32, expert=True),
    Case("fairseq_fsdp_ws3_fp32_expert", 3, "fairseq", dtype=torch.float32, expert=True),
    Case("fairseq_fsdp_v037_ws2", 2, "fairseq", schema="0.3.7"),
    Case("fairseq_fsdp_v038_ws3", 3, "fairseq", schema="0.3.8", dtype=torch.float32),
]


def build(case):
    model, ostate = train(case.expert)
    units = [u for u in UNITS if case.expert or u[0] != "decoder.layers.1.expert"]
    params, ties = unit_params(model, units)
    W = case.world
    flat_key = {"0.3.7": "flat_param", "0.3.8": "flat_param_0", "0.4": "flat_param_0"}[case.schema]

    # backing parameters in metadata order: (unit, backing name, [(rel name, param)], no_broadcast)
    backing = []
    for path, flatten, nob in units:
        plist = params[path]
        if not plist:
            continue
        if flatten:
            backing.append((path, flat_key, plist, nob))
        else:
            for rel, p in plist:
                backing.append((path, rel, [(rel, p)], nob))

    # an expert holds different weights on every rank (its process group is that rank alone)
    def value(p, rank, nob):
        v = p.detach()
        return v + 0.015625 * rank if nob else v

    def moment(p, key, rank, nob):
        v = ostate[id(p)][key]
        return v * (1 + rank) if nob else v

    ranks = []
    for r in range(W):
        shards, pads, moments = {}, {}, {}
        for path, bname, plist, nob in backing:
            flat = torch.cat([value(p, r, nob).reshape(-1) for _, p in plist]).to(case.dtype)
            if nob:  # world size 1: not sharded, no padding
                shard, pad = flat.clone(), 0
            else:
                shard, pad = get_shard(flat, W, r)
            shards[(path, bname)], pads[(path, bname)] = shard, pad
            m = {}
            for key in ("exp_avg", "exp_avg_sq"):
                fm = torch.cat([moment(p, key, r, nob).reshape(-1) for _, p in plist]).float()
                m[key] = fm.clone() if nob else get_shard(fm, W, r)[0]
            moments[(path, bname)] = m
        ranks.append((shards, pads, moments))
    return model, ostate, units, params, ties, backing, ranks


def state_dict_keys(case, backing):
    """local_state_dict() order: each unit's flat parameter where the wrapper registers it; the
    root's buffer right after the root's flat parameter; non-flattened parameters under their names."""
    keys = []
    for path, bname, _plist, _nob in backing:
        keys.append(f"{path}.{bname}" if path else bname)
        if path == "":
            keys.append("decoder.version")
    return keys


def metadata_for(case, units, params, ties, backing, pads, model):
    if case.schema == "0.4":
        pm = []
        for path, flatten, nob in units:
            md = {"fsdp_path": path, "params": {}, "no_broadcast_optim_state": nob}
            # local_metadata_dict unpacks (dst_mpath, src_mpath, _, src_name, _, dst_name) from tuples
            # that hold (..., dst_name, ..., src_name): with equal leaf names that is harmless.
            md["shared_param_info"] = [(src, dst) for dst, src in ties[path]]
            for p_path, bname, plist, _nob in backing:
                if p_path != path:
                    continue
                md["params"][bname] = {
                    "names": [rel for rel, _ in plist],
                    "shapes": [p.size() for _, p in plist],
                    "numels": [p.numel() for _, p in plist],
                    "padding": pads[(path, bname)],
                }
            pm.append(md)
    else:
        pm = []
        tup = tuple if case.schema == "0.3.7" else list
        for path, flatten, nob in units:
            mine = [b for b in backing if b[0] == path]
            if flatten:
                (_, bname, plist, _), = mine
                pm.append({"fsdp_path": path, "is_flat": True, "num_padded": [pads[(path, bname)]],
                           "param_names": [rel for rel, _ in plist],
                           "param_shapes": tup(p.size() for _, p in plist),
                           "param_numels": tup(p.numel() for _, p in plist),
                           "no_broadcast_optim_state": nob})
            else:
                pm.append({"fsdp_path": path, "is_flat": False,
                           "num_padded": [pads[(path, b[1])] for b in mine],
                           "param_names": [b[1] for b in mine],
                           "param_shapes": [b[2][0][1].size() for b in mine],
                           "param_numels": [b[2][0][1].numel() for b in mine],
                           "no_broadcast_optim_state": nob})
    buffer_names = [n for n, _ in model.named_buffers()]
    return dict(param_metadata=pm, buffer_names=buffer_names)


def training_state(case, rank):
    """The trainer's other top-level entries, with the object types real files carry."""
    W = case.world
    model_args = argparse.Namespace(
        _name="transformer_lm_megatron", arch="transformer_lm_megatron", decoder_layers=2,
        decoder_embed_dim=D, decoder_ffn_embed_dim=F, share_decoder_input_output_embed=True,
        dropout=0.1, activation_fn="relu", max_target_positions=P)
    cfg = {
        "_name": None,
        # fp16 training; pure fp16 flat params with --memory-efficient-fp16, fp32 (mixed precision) without
        "common": {"fp16": True, "memory_efficient_fp16": case.dtype == torch.float16,
                   "seed": 1, "log_interval": 10},
        "distributed_training": {"distributed_world_size": W, "ddp_backend": "fully_sharded",
                                 "use_sharded_state": True, "distributed_rank": rank},
        "model": model_args,
        "task": {"_name": "streaming_language_modeling", "vocab_size": V},
        "optimization": {"max_update": 2, "lr": [0.0003], "clip_norm": 1.0},
        "checkpoint": {"save_dir": "checkpoints", "checkpoint_suffix": "-model_part-0"
                       if case.flavour == "metaseq" else ""},
    }
    history = [{"criterion_name": "CrossEntropyCriterion",
                # fairseq and metaseq wrap the optimizer of an FSDP fp16 run in MemoryEfficientFP16Optimizer
                "optimizer_name": "MemoryEfficientFP16Optimizer",
                "lr_scheduler_state": {"best": None}, "num_updates": 2}]
    metrics = collections.OrderedDict(
        default=collections.OrderedDict(loss={"val": np.float64(2.375), "sum": np.float64(9.5), "count": 4,
                                              "round": 3}))
    extra = {"metrics": metrics, "previous_training_time": 12.25}
    if case.flavour == "metaseq":
        extra["ewm_loss"] = 2.40625
    extra["train_iterator"] = {"epoch": 1, "iterations_in_epoch": 2, "shuffle": True}
    extra["val_loss"] = np.float64(2.5)
    if case.flavour == "fairseq":
        extra["best"] = np.float64(2.5)
    return cfg, history, extra


def move_to_cpu(x, flavour, cast):
    """fairseq / metaseq utils.move_to_cpu (apply_to_sample): tensors cast (fp16, bf16 -> fp32 when
    `cast`), dicts rebuilt as dicts (fairseq keeps an OrderedDict and its __dict__, metaseq does
    not), lists as lists, every tuple (torch.Size included) as a plain tuple, sets as sets."""
    def walk(v):
        if torch.is_tensor(v):
            return v.to(torch.float32) if cast and v.dtype in (torch.float16, torch.bfloat16) else v
        if isinstance(v, collections.OrderedDict) and flavour == "fairseq":
            od = collections.OrderedDict((k, walk(x)) for k, x in v.items())
            od.__dict__ = v.__dict__
            return od
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        if isinstance(v, set):
            return {walk(x) for x in v}
        return v
    return walk(x)


def state_dict_metadata(model, units):
    """nn.Module.state_dict's `_metadata` for FSDP's local_state_dict: one {"version": 1} per
    module visited, keyed by the prefix it was visited with. FSDP.state_dict hands its own prefix to
    its FlattenParamsWrapper, whose wrapped module sits under "_fpw_module"; the prefix-renaming hooks
    rewrite keys, never `_metadata`."""
    unit_paths = {u[0] for u in units}
    out = collections.OrderedDict()
    out[""] = {"version": 1}  # the root's FlattenParamsWrapper

    def raw(q):
        parts, acc, cur = q.split(".") if q else [], [], "_fpw_module"
        for part in parts:
            acc.append(part)
            cur += "." + part
            if ".".join(acc) in unit_paths:
                cur_unit = cur
                cur += "._fpw_module"
        return cur, (cur_unit if parts and ".".join(parts) in unit_paths else None)

    for q, _m in model.named_modules():
        path, wrapper = raw(q)
        if wrapper is not None:
            out[wrapper] = {"version": 1}
        out[path] = {"version": 1}
    return out


def write_case(root, case):
    model, ostate, units, params, ties, backing, ranks = build(case)
    files = []
    opt_keys = ("lr", "bias_correction", "betas", "eps", "weight_decay", "max_grad_norm") \
        if case.flavour == "metaseq" else ("lr", "betas", "eps", "weight_decay", "amsgrad")
    group_vals = {"lr": 0.0003, "bias_correction": True, "betas": (0.9, 0.95), "eps": 1e-08,
                  "weight_decay": 0.1, "max_grad_norm": 0.0, "amsgrad": False}
    metas = []
    for r, (shards, pads, moments) in enumerate(ranks):
        keys = state_dict_keys(case, backing)
        sd = collections.OrderedDict()
        for (path, bname), t in shards.items():
            k = f"{path}.{bname}" if path else bname
            sd[k] = t
        version = model.decoder.version.detach().clone().to(case.dtype)
        sd["decoder.version"] = version
        sd = collections.OrderedDict((k, sd[k]) for k in keys)
        sd._metadata = state_dict_metadata(model, units)
        meta = metadata_for(case, units, params, ties, backing, pads, model)
        metas.append(meta)
        state = {}
        for i, (path, bname, _plist, _nob) in enumerate(backing):
            m = moments[(path, bname)]
            state[i] = {"step": 2, "exp_avg": m["exp_avg"], "exp_avg_sq": m["exp_avg_sq"]}
        group = {k: group_vals[k] for k in opt_keys}
        group["params"] = list(range(len(backing)))  # Optimizer.state_dict packs params last
        last = {"state": state, "param_groups": [group], "loss_scale": 4.0}
        cfg, history, extra = training_state(case, r)
        doc = collections.OrderedDict()
        if case.flavour == "fairseq":
            doc["args"] = None
        doc["cfg"] = cfg
        doc["model"] = sd
        doc["criterion"] = None
        doc["optimizer_history"] = history
        doc["task_state"] = {}
        doc["extra_state"] = extra
        doc["last_optimizer_state"] = last
        doc["fsdp_metadata" if case.flavour == "fairseq" else "shard_metadata"] = meta
        fn = case.file(r)
        doc = move_to_cpu(dict(doc), case.flavour,
                          cast=case.flavour == "fairseq" or case.dtype == torch.float32)
        torch.save(doc, os.path.join(root, fn))
        files.append(fn)
        if r == 0:
            rank0 = dict(doc)

    # ---- expected consolidated weights: every name of every unit, ties of every unit, buffers
    tensors, aliases, lacks = collections.OrderedDict(), {}, []
    for path, bname, plist, nob in backing:
        for rel, p in plist:
            name = f"{path}.{rel}" if path else rel
            tensors[name] = C.tensor_entry(p.detach().to(case.dtype).to(case.stored))  # an expert: rank 0's
    if case.schema == "0.4":
        last_unit = units[-1][0]
        for path, _f, _n in units:
            for dst, src in ties[path]:
                d = f"{path}.{dst}" if path else dst
                s = f"{path}.{src}" if path else src
                tensors[d] = tensors[s]
                aliases[d] = s
                if path != last_unit:
                    lacks.append(d)
    tensors["decoder.version"] = C.tensor_entry(model.decoder.version.to(case.dtype).to(case.stored))
    fmt = "fairscale_fsdp" if case.schema == "0.4" else "fairscale_fsdp_v03"
    weights = C.make_manifest(fmt, tensors=dict(tensors), aliases=aliases, path=os.path.basename(root),
                              world_size=case.world, files=files, flavour=case.flavour,
                              fairscale_output_lacks=lacks,
                              no_broadcast_units=[u[0] for u in units if u[2]])

    # ---- expected consolidated optimizer, keyed by parameter name
    optim = {"state": collections.OrderedDict(), "param_groups": [], "loss_scale": 4.0}
    names = []
    for path, bname, plist, nob in backing:
        for rel, p in plist:
            name = f"{path}.{rel}" if path else rel
            names.append(name)
            optim["state"][name] = {"step": 2, "exp_avg": ostate[id(p)]["exp_avg"],
                                    "exp_avg_sq": ostate[id(p)]["exp_avg_sq"]}
    group = {k: group_vals[k] for k in opt_keys}
    group["params"] = names
    optim["param_groups"].append(group)
    t, v = raw_flatten({"optim": optim})
    om = C.make_manifest(fmt + "_optim", tensors=t, values=v, path=os.path.basename(root))

    r0 = C.make_manifest("torch", rank0, path=os.path.join(os.path.basename(root), files[0]),
                         dict_attributes=C.dict_attributes(rank0) or None)
    return weights, om, r0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("outdir")
    ap.add_argument("--only", action="append", default=[])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.outdir, exist_ok=True)
    t0 = time.time()
    n = 0
    for case in CASES:
        if args.only and not any(s in case.name for s in args.only):
            continue
        root = os.path.join(args.outdir, case.name)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        weights, om, r0 = write_case(root, case)
        C.write_manifest(args.outdir, case.name, weights)
        C.write_manifest(args.outdir, case.name + ".optim", om)
        C.write_manifest(args.outdir, case.name + ".rank0", r0)
        sds = ref.load_shards(ref.find_shards(root))
        got, aliases = ref.consolidate_weights(sds)
        problems = torch_check.compare_with_manifest(weights, *raw_flatten(got), label="reference consolidation")
        if aliases != weights["aliases"]:
            problems.append(f"aliases {aliases} != {weights['aliases']}")
        got_o = ref.consolidate_optim(sds)
        problems += torch_check.compare_with_manifest(om, *raw_flatten({"optim": got_o}),
                                                      label="reference optimizer consolidation")
        if problems:
            raise SystemExit(f"{case.name}: the reference consolidation disagrees:\n  " + "\n  ".join(problems))
        n += 1
    print(f"gen_fairscale: {n} cases verified in {time.time() - t0:.1f}s -> {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
