"""Reference merge and split of Megatron-LM legacy checkpoints (the rules a C++ reader must follow).

    merge(ckpt_dir)  -> Merged: the full model by canonical name (+ optimizer state, + facts)
    split(model, cfg, tp, pp, vpp) -> {(tp_rank, pp_rank): rank state dict}
    write_split(...) -> a checkpoint directory that merge() reads back

Canonical names are the legacy names of core_v0.8.0 (``language_model.embedding.word_embeddings.weight``,
``language_model.encoder.layers.<global layer>.self_attention.query_key_value.weight``,
``...input_norm...``, ``language_model.encoder.final_norm.weight``, ``language_model.output_layer.weight``),
with layers numbered globally; QKV in the checkpoint_version >= 2 order; the vocabulary padded as
stored (``padded_vocab_size`` of the source TP size).

This module sees only the files: it does not import the writers (legacy_layout.py).  It follows
tools/checkpoint/loader_megatron.py and saver_megatron.py (core_v0.8.0) and the backward-compatible
load paths of megatron/training/checkpointing.py and megatron/legacy/model/*.py; where it is stricter
than Megatron (completeness, equal replicas), the spec (tests/python/layouts/megatron.md) says so.
"""
import argparse
import dataclasses
import math
import os
import re
from collections import OrderedDict
from typing import Optional

import torch

from . import standins

LM = "language_model"
ENC = f"{LM}.encoder"


class MegatronError(Exception):
    pass


# --------------------------------------------------------------------------- discovery
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def discover(ckpt_dir):
    """Tracker file -> iteration directory -> {(tp, pp): rank dir}.

    latest_checkpointed_iteration.txt holds an integer (iter_%07d) or 'release' (directory
    'release'); a directory given directly (an iter_*/release folder) is accepted too."""
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text == "release":
            it_dir, iteration, release = os.path.join(ckpt_dir, "release"), None, True
        else:
            try:
                iteration = int(text)
            except ValueError:
                raise MegatronError(f"{tracker}: neither an integer nor 'release': {text!r}")
            if iteration <= 0:
                raise MegatronError(f"{tracker}: iteration {iteration} must be > 0")
            it_dir, release = os.path.join(ckpt_dir, f"iter_{iteration:07d}"), False
    else:
        it_dir, iteration, release = ckpt_dir, None, os.path.basename(ckpt_dir) == "release"
    if not os.path.isdir(it_dir):
        raise MegatronError(f"missing iteration directory {it_dir}")
    if os.path.isfile(os.path.join(it_dir, "metadata.json")):
        raise MegatronError(f"{it_dir} is a distributed (torch_dist) checkpoint, not a legacy one")
    ranks = {}
    pp_named = set()
    for d in sorted(os.listdir(it_dir)):
        m = _RANK_DIR.match(d)
        if not m:
            continue
        if m.group(3) is not None:
            raise MegatronError(f"{d}: expert-parallel rank directories are not supported")
        tp, pp = int(m.group(1)), int(m.group(2) or 0)
        pp_named.add(m.group(2) is not None)
        f = os.path.join(it_dir, d, "model_optim_rng.pt")
        if not os.path.isfile(f):
            raise MegatronError(f"{d} has no model_optim_rng.pt")
        ranks[(tp, pp)] = os.path.join(it_dir, d)
    if not ranks:
        raise MegatronError(f"no mp_rank_* directories in {it_dir}")
    if len(pp_named) > 1:
        raise MegatronError("both mp_rank_TT and mp_rank_TT_PPP directories present")
    return it_dir, iteration, release, ranks


def load(path):
    standins.install()
    return torch.load(path, map_location="cpu")


# --------------------------------------------------------------------------- facts from args
@dataclasses.dataclass
class Facts:
    tp: int
    pp: int
    vpp: Optional[int]
    num_layers: int
    heads: int
    groups: int
    kv_channels: int
    swiglu: bool
    untied: bool
    checkpoint_version: float
    padded_vocab_size: Optional[int]
    dtype: Optional[torch.dtype]
    use_distributed_optimizer: bool
    dp: int
    bucket_size: Optional[int]


def facts_from(sd):
    args = sd.get("args")
    if not isinstance(args, argparse.Namespace):
        raise MegatronError("rank file has no args Namespace")
    g = lambda k, d=None: getattr(args, k, d)
    version = sd.get("checkpoint_version", 0)
    # checkpointing.py: before 3.0 the TP size was called model_parallel_size
    tp = g("tensor_model_parallel_size") if version >= 3.0 else g("model_parallel_size", g("tensor_model_parallel_size"))
    heads = g("num_attention_heads")
    groups = g("num_query_groups") if g("group_query_attention", False) else heads
    kv = g("kv_channels") or g("hidden_size") // heads
    dp = g("data_parallel_size") or max(1, g("world_size", 1) // (tp * (g("pipeline_model_parallel_size") or 1)))
    bucket = None
    if g("overlap_grad_reduce", False):
        # DistributedDataParallel: default bucket size max(40M, 1M * dp) unless --ddp-bucket-size
        bucket = g("ddp_bucket_size") or max(40000000, 1000000 * dp)
    return Facts(tp=tp, pp=g("pipeline_model_parallel_size") or 1,
                 vpp=g("virtual_pipeline_model_parallel_size"), num_layers=g("num_layers"),
                 heads=heads, groups=groups, kv_channels=kv, swiglu=bool(g("swiglu", False)),
                 untied=bool(g("untie_embeddings_and_output_weights", False)),
                 checkpoint_version=float(version), padded_vocab_size=g("padded_vocab_size"),
                 dtype=g("params_dtype"), use_distributed_optimizer=bool(g("use_distributed_optimizer", False)),
                 dp=dp, bucket_size=bucket)


# --------------------------------------------------------------------------- key normalisation
def _norm_layer_key(k):
    """Layer-relative key in today's spelling (language_model.py / transformer.py load_state_dict:
    '.attention.' -> '.self_attention.', 'layernorm' -> 'norm' except TE's layernorm_qkv/mlp)."""
    k = "." + k
    k = k.replace(".attention.", ".self_attention.")
    if "layernorm_qkv" not in k and "layernorm_mlp" not in k:
        k = k.replace("layernorm", "norm")
    return k[1:]


def chunk_tensors(chunk):
    """Flatten one model chunk (state_dict_for_save_checkpoint output) into
    [(local canonical key, tensor, role)], role in {"param", "head"}, in file order.
    Local keys still carry the chunk-local layer index.  `_extra_state` entries are skipped."""
    out = []
    lm = chunk.get(LM, chunk)
    if "embedding" in lm:
        for sub in ("word_embeddings", "position_embeddings", "tokentype_embeddings"):
            if sub in lm["embedding"]:
                for k, t in lm["embedding"][sub].items():
                    if torch.is_tensor(t):
                        out.append((f"{LM}.embedding.{sub}.{k}", t, "param"))
    enc = lm.get("encoder", lm.get("transformer"))
    if enc is None:
        raise MegatronError("model chunk without encoder/transformer")
    for k, t in enc.items():
        if k.endswith("_extra_state") or not torch.is_tensor(t):
            continue
        out.append((f"{ENC}.{_norm_layer_key(k)}", t, "param"))
    if "output_layer" in lm:
        for k, t in lm["output_layer"].items():
            if torch.is_tensor(t):
                out.append((f"{LM}.output_layer.{k}", t, "param"))
    for key in ("pooler", "decoder"):
        if key in lm:
            raise MegatronError(f"language_model.{key} is not supported (GPT only)")
    if "word_embeddings_for_head" in chunk:
        for k, t in chunk["word_embeddings_for_head"].items():
            if torch.is_tensor(t):
                out.append((f"{LM}.embedding.word_embeddings.{k}", t, "head"))
    return out


def chunks_of(sd):
    if "model" in sd:
        return [sd["model"]]
    n = 0
    while f"model{n}" in sd:
        n += 1
    if n == 0:
        raise MegatronError("rank file has neither 'model' nor 'model0'")
    return [sd[f"model{i}"] for i in range(n)]


_LAYER = re.compile(r"^(language_model\.encoder\.layers\.)(\d+)(\..*)$")


def layer_offset(f, pp_rank, v):
    """First global layer of chunk v on stage pp_rank (legacy ParallelTransformer offsets)."""
    vpp = f.vpp or 1
    per_chunk = f.num_layers // (f.pp * vpp)
    return v * (f.num_layers // vpp) + pp_rank * per_chunk


def globalize(key, offset):
    m = _LAYER.match(key)
    if not m:
        return key
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}"


# --------------------------------------------------------------------------- TP merge rules
def qkv_to_v2(t, f):
    """Per-rank QKV of checkpoint_version 0 ([3, np, hn]) or 1.0 ([np, hn, 3]) to the >= 2.0
    order ([np, 3, hn]); checkpointing.py fix_query_key_value_ordering / _transpose_first_dim with
    num_attention_heads_per_partition = heads / tp."""
    if f.checkpoint_version >= 2.0:
        return t
    np_r, hn = f.heads // f.tp, f.kv_channels
    rest = tuple(t.shape[1:])
    if f.checkpoint_version == 0:
        x = t.reshape((3, np_r, hn) + rest).transpose(0, 1)
    elif f.checkpoint_version == 1.0:
        x = t.reshape((np_r, hn, 3) + rest).transpose(1, 2)
    else:
        raise MegatronError(f"invalid checkpoint_version {f.checkpoint_version}")
    return x.contiguous().reshape((-1,) + rest)


def merge_rule(key):
    """How the TP pieces of `key` combine: ("cat", dim) | ("swiglu",) | ("replicated",)."""
    if key.endswith(("word_embeddings.weight", "output_layer.weight")):
        return ("cat", 0)
    if ".query_key_value." in key:
        return ("cat", 0)
    if key.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
        return ("cat", 1)
    if ".mlp.dense_h_to_4h." in key:
        return ("glu",)
    return ("replicated",)


def merge_tp(key, pieces, f, strict=True):
    rule = merge_rule(key)
    if ".query_key_value." in key:
        pieces = [qkv_to_v2(p, f) for p in pieces]
    if rule[0] == "cat":
        return torch.cat(pieces, rule[1])
    if rule[0] == "glu":
        if not f.swiglu:
            return torch.cat(pieces, 0)
        halves = [torch.chunk(p, 2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    first = pieces[0]
    if strict:
        for r, p in enumerate(pieces[1:], 1):
            if p.dtype != first.dtype or p.shape != first.shape or not torch.equal(p, first):
                raise MegatronError(f"{key}: replicated tensor differs between TP rank 0 and {r}")
    return first


# --------------------------------------------------------------------------- optimizer mapping
def _group_key(name, shape):
    no_wd = name.endswith(".bias") or len(shape) == 1
    return (0.0 if no_wd else 1.0, 1.0, False, False)


def rank_params(rank_chunks):
    """[(global canonical key, role, local tensor)] in named_parameters order over the chunks."""
    out = []
    for chunk in rank_chunks:
        out += chunk
    return out


def map_plain_optimizer(opt_sd, params, dtype):
    """{(key, role): {"exp_avg", "exp_avg_sq", "step", "fp32_param"}} from a torch-style optimizer
    state dict: params are numbered group by group, groups in order of first appearance of
    (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) over named_parameters."""
    if "param_groups" in opt_sd:            # FP32Optimizer: the inner state dict itself
        inner, fp32 = opt_sd, None
    else:                                   # Float16OptimizerWithFloat16Params
        inner, fp32 = opt_sd["optimizer"], opt_sd.get("fp32_from_fp16_params")
    groups = OrderedDict()
    for key, role, t in params:
        groups.setdefault(_group_key(key, t.shape), []).append((key, role, t))
    saved = inner["param_groups"]
    if len(saved) != len(groups):
        raise MegatronError(f"optimizer has {len(saved)} param groups, the model implies {len(groups)}")
    out = OrderedDict()
    for gi, ((wd, lr, ep, dec), members) in enumerate(groups.items()):
        g = saved[gi]
        if "wd_mult" in g and (g["wd_mult"], g.get("lr_mult", 1.0)) != (wd, lr):
            raise MegatronError(f"param group {gi}: wd_mult/lr_mult {g['wd_mult']}/{g.get('lr_mult')} != {wd}/{lr}")
        if len(g["params"]) != len(members):
            raise MegatronError(f"param group {gi} lists {len(g['params'])} params, the model implies {len(members)}")
        for j, ((key, role, t), pid) in enumerate(zip(members, g["params"])):
            st = inner["state"].get(pid, {})
            e = OrderedDict()
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    if tuple(st[k].shape) != tuple(t.shape):
                        raise MegatronError(f"{key}: {k} shape {tuple(st[k].shape)} != param {tuple(t.shape)}")
                    e[k] = st[k]
            if fp32 is not None:
                e["fp32_param"] = fp32[gi][j]
            if "step" in st:
                e["step"] = st["step"]
            out[(key, role)] = e
    return out, saved


def buffer_layout(params, dp, bucket_size=None):
    """The grad-buffer layout behind distrib_optim.pt (param_and_grad_buffer.py, core_v0.8.0):
    params [(key, numel, shared_embedding)] in named_parameters order -> buckets
    [{"start", "numel_unpadded", "params": [(key, start, end)]}]."""
    def up(x, d):
        return -(-x // d) * d
    lcm = dp * 128 // math.gcd(dp, 128)
    buckets, cur, idx = [], None, 0

    def new(start):
        return {"start": start, "params": []}

    cur = new(0)
    for key, numel, shared in reversed(params):
        idx = up(idx, 64)
        if shared and cur["params"]:
            cur["numel_unpadded"] = idx - cur["start"]
            buckets.append(cur)
            idx = up(idx, lcm)
            cur = new(idx)
        cur["params"].append((key, idx, idx + numel))
        idx += numel
        if shared or (bucket_size is not None and idx - cur["start"] >= bucket_size):
            cur["numel_unpadded"] = idx - cur["start"]
            buckets.append(cur)
            idx = up(idx, lcm)
            cur = new(idx)
    if cur["params"]:
        cur["numel_unpadded"] = idx - cur["start"]
        buckets.append(cur)
    return buckets


def map_distrib_optimizer(dist_sd, rank_chunk_params, f, pp_rank, v_first_last):
    """{(key, role): {"fp32_param", "exp_avg", "exp_avg_sq"}} from distrib_optim.pt (dp_zero format)."""
    if not dist_sd.get("buckets_coalesced", False):
        raise MegatronError("distrib_optim.pt without buckets_coalesced (pre-core_v0.6 per-bucket format) is not supported")
    out = OrderedDict()
    nchunks = len(rank_chunk_params)
    for gbuf_idx, params in enumerate(rank_chunk_params):
        if gbuf_idx not in dist_sd:
            raise MegatronError(f"distrib_optim.pt has no buffer {gbuf_idx}")
        by_dtype = dist_sd[gbuf_idx]
        if len(by_dtype) != 1:
            raise MegatronError(f"buffer {gbuf_idx}: {len(by_dtype)} dtypes (one supported)")
        world = next(iter(by_dtype.values()))
        pre = pp_rank == 0 and gbuf_idx == 0
        post = pp_rank == f.pp - 1 and gbuf_idx == nchunks - 1
        tied_pp = (not f.untied) and f.pp > 1
        plist = []
        for key, role, t in params:
            shared = tied_pp and key.endswith("word_embeddings.weight") and (role == "head" or (pre and not post))
            plist.append(((key, role), t.numel(), shared))
        # DistributedDataParallel: buckets only on the first PP stage's first model chunk
        # (pp_rank > 0 and disable_bucketing for chunks after the first set bucket_size = None)
        bucket_size = f.bucket_size if (pp_rank == 0 and gbuf_idx == 0) else None
        buckets = buffer_layout(plist, f.dp, bucket_size)
        total = sum(b["numel_unpadded"] for b in buckets)
        if world["numel_unpadded"] != total or world["param"].numel() != total:
            raise MegatronError(f"buffer {gbuf_idx}: numel_unpadded {world['numel_unpadded']} but the "
                                f"layout rebuilt from the model gives {total}")
        shapes = {(k, r): t.shape for k, r, t in params}
        off = 0
        for b in buckets:
            for kr, s, e in b["params"]:
                o = off + s - b["start"]
                out[kr] = OrderedDict(
                    (name, world[src][o:o + e - s].reshape(shapes[kr]))
                    for name, src in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_param", "param")))
            off += b["numel_unpadded"]
    return out


# --------------------------------------------------------------------------- merge
@dataclasses.dataclass
class Merged:
    facts: Facts
    iteration: Optional[int]
    release: bool
    model: "OrderedDict[str, torch.Tensor]"
    optimizer: "OrderedDict[str, OrderedDict]"     # canonical key -> {exp_avg, exp_avg_sq, fp32_param, step}
    param_groups: list                             # [{hyper..., "params": [keys]}]
    rank0: dict


def _canonical_order(keys, f):
    # a stable sort: within one layer (and within the final norm) the file order is kept
    def rank(k):
        if k.startswith(f"{LM}.embedding."):
            return (0, 0 if "word_" in k else 1)
        m = _LAYER.match(k)
        if m:
            return (1, int(m.group(2)))
        if k.startswith(f"{ENC}.final_norm"):
            return (2, 0)
        return (3, 0)
    return sorted(keys, key=rank)


def merge(ckpt_dir, strict=True, with_optimizer=True):
    it_dir, iteration, release, rank_dirs = discover(ckpt_dir)
    rank0 = load(os.path.join(rank_dirs[min(rank_dirs)], "model_optim_rng.pt"))
    f = facts_from(rank0)
    want = {(t, p) for t in range(f.tp) for p in range(f.pp)}
    if set(rank_dirs) != want:
        raise MegatronError(f"rank directories {sorted(rank_dirs)} != tp {f.tp} x pp {f.pp}")
    if iteration is not None and rank0.get("iteration") != iteration:
        raise MegatronError(f"tracker says {iteration}, the file says {rank0.get('iteration')}")
    pieces = OrderedDict()        # key -> [tp pieces]
    heads = {}                    # tied head copies, for the equality check
    opt_pieces = OrderedDict()    # key -> {state name: [tp pieces]}
    groups_seen = OrderedDict()
    for pp_rank in range(f.pp):
        for tp_rank in range(f.tp):
            sd = rank0 if (tp_rank, pp_rank) == min(rank_dirs) else load(
                os.path.join(rank_dirs[(tp_rank, pp_rank)], "model_optim_rng.pt"))
            chunks = chunks_of(sd)
            if len(chunks) != (f.vpp or 1):
                raise MegatronError(f"rank {tp_rank},{pp_rank}: {len(chunks)} model chunks, vpp {f.vpp}")
            rank_chunk_params = []
            for v, chunk in enumerate(chunks):
                off = layer_offset(f, pp_rank, v)
                cp = [(globalize(k, off), role, t) for k, t, role in chunk_tensors(chunk)]
                rank_chunk_params.append(cp)
                for k, role, t in cp:
                    if role == "head":
                        heads.setdefault(k, []).append(t)
                        continue
                    lst = pieces.setdefault(k, [None] * f.tp)
                    if lst[tp_rank] is not None:
                        raise MegatronError(f"{k} appears twice for TP rank {tp_rank}")
                    lst[tp_rank] = t
            if not with_optimizer or "optimizer" not in sd:
                continue
            flat = rank_params(rank_chunk_params)
            if f.use_distributed_optimizer:
                dist_path = os.path.join(rank_dirs[(tp_rank, pp_rank)], "distrib_optim.pt")
                state = map_distrib_optimizer(load(dist_path), rank_chunk_params, f, pp_rank, None)
                saved_groups = sd["optimizer"]["optimizer"]["param_groups"]
                # the saved groups carry no "params"; membership follows the plain rule
                grouping = OrderedDict()
                for key, role, t in flat:
                    grouping.setdefault(_group_key(key, t.shape), []).append(key)
            else:
                state, saved_groups = map_plain_optimizer(sd["optimizer"], flat, f.dtype)
                grouping = OrderedDict()
                for key, role, t in flat:
                    grouping.setdefault(_group_key(key, t.shape), []).append(key)
            if len(saved_groups) != len(grouping):
                raise MegatronError(f"rank {tp_rank},{pp_rank}: {len(saved_groups)} param groups, expected {len(grouping)}")
            for (gk, members), g in zip(grouping.items(), saved_groups):
                entry = groups_seen.setdefault(gk, {"hyper": {k: v for k, v in g.items() if k != "params"}, "params": []})
                if tp_rank == 0:
                    for m in members:
                        if m not in entry["params"]:
                            entry["params"].append(m)
            for (key, role), st in state.items():
                if role == "head":
                    continue
                d = opt_pieces.setdefault(key, OrderedDict())
                for sname, t in st.items():
                    d.setdefault(sname, [None] * f.tp)[tp_rank] = t
    for k, lst in pieces.items():
        if any(p is None for p in lst):
            raise MegatronError(f"{k}: missing on TP ranks {[r for r, p in enumerate(lst) if p is None]}")
    model = OrderedDict()
    for k in _canonical_order(pieces, f):
        model[k] = merge_tp(k, pieces[k], f, strict)
    if strict:
        for k, copies in heads.items():
            full = merge_tp(k, copies, f, strict)
            if not torch.equal(full, model[k]):
                raise MegatronError("word_embeddings_for_head differs from the first stage's word embeddings")
    optimizer = OrderedDict()
    extra = [k for k in opt_pieces if k not in model]
    if extra:
        raise MegatronError(f"optimizer state for unknown parameters {extra[:3]}")
    for k in (k for k in model if k in opt_pieces):
        d = OrderedDict()
        for sname in ("exp_avg", "exp_avg_sq", "fp32_param", "step"):
            if sname not in opt_pieces[k]:
                continue
            lst = opt_pieces[k][sname]
            if sname == "step":
                d[sname] = lst[0]
            else:
                d[sname] = merge_tp(k, lst, f, strict)
        optimizer[k] = d
    param_groups = []
    for gk, entry in groups_seen.items():
        g = dict(entry["hyper"])
        g["params"] = [k for k in model if k in entry["params"]]
        param_groups.append(g)
    return Merged(f, iteration, release, model, optimizer, param_groups, rank0)


# --------------------------------------------------------------------------- split
def split_tp(key, t, f, tp):
    """Inverse of merge_tp for a target TP size, saver_megatron.py's rules (always writes
    checkpoint_version 3.0, so QKV stays in the >= 2.0 order)."""
    rule = merge_rule(key)
    if rule[0] == "cat":
        if t.shape[rule[1]] % tp:
            raise MegatronError(f"{key}: dim {rule[1]} of {tuple(t.shape)} not divisible by TP {tp}")
        return [c.contiguous().clone() for c in torch.chunk(t, tp, rule[1])]
    if rule[0] == "glu":
        if not f.swiglu:
            return [c.clone() for c in torch.chunk(t, tp, 0)]
        w, v = torch.chunk(t, 2, 0)
        return [torch.cat([a, b], 0) for a, b in zip(torch.chunk(w, tp, 0), torch.chunk(v, tp, 0))]
    return [t.clone() for _ in range(tp)]


def repad_vocab(t, padded):
    """saver_megatron.py with --true-vocab-size: cut extra rows, or grow by repeating the last row."""
    if t.shape[0] > padded:
        return t[:padded].clone()
    if t.shape[0] < padded:
        return torch.cat([t, t[-1:].expand(padded - t.shape[0], -1)], 0)
    return t


def split(model, f, tp, pp, vpp=None, true_vocab_size=None, make_vocab_size_divisible_by=128):
    """Full canonical model -> {(tp_rank, pp_rank): {"model" | "model0".. : chunk dict}} in the
    core_v0.8.0 spelling (checkpoint_version 3.0).  Without true_vocab_size the embedding keeps its
    rows (saver_megatron.py 'leaving embedding table as-is'); with it, the table is re-padded to a
    multiple of make_vocab_size_divisible_by * tp, word embeddings and output layer alike
    (the saver itself only re-pads the word embeddings)."""
    L = f.num_layers
    v = vpp or 1
    if L % (pp * v):
        raise MegatronError(f"{L} layers do not split into pp {pp} x vpp {v}")
    model = OrderedDict(model)
    if true_vocab_size is not None:
        mult = make_vocab_size_divisible_by * tp
        padded = -(-true_vocab_size // mult) * mult
        for k in list(model):
            if k.endswith(("word_embeddings.weight", "output_layer.weight")):
                model[k] = repad_vocab(model[k], padded)
    pieces = {k: split_tp(k, t, f, tp) for k, t in model.items()}
    n = L // (pp * v)
    out = {}
    for p in range(pp):
        for r in range(tp):
            chunks = []
            for c in range(v):
                first = c * (L // v) + p * n
                pre, post = p == 0 and c == 0, p == pp - 1 and c == v - 1
                lm = {}
                if pre:
                    emb = {}
                    for sub in ("word_embeddings", "position_embeddings"):
                        k = f"{LM}.embedding.{sub}.weight"
                        if k in pieces:
                            emb[sub] = OrderedDict(weight=pieces[k][r])
                    lm["embedding"] = emb
                enc = OrderedDict()
                for k, lst in pieces.items():
                    m = _LAYER.match(k)
                    if m and first <= int(m.group(2)) < first + n:
                        local = f"layers.{int(m.group(2)) - first}{m.group(3)}"
                        enc[local] = lst[r]
                        if local.endswith(("query_key_value.weight", "dense.weight", "dense_h_to_4h.weight",
                                           "dense_4h_to_h.weight")):
                            enc[local.rsplit(".", 1)[0] + "._extra_state"] = None
                if post:
                    for k, lst in pieces.items():
                        if k.startswith(f"{ENC}.final_norm."):
                            enc[k[len(ENC) + 1:]] = lst[r]
                # ParallelTransformer.state_dict order: each layer's weight, bias, _extra_state
                enc = OrderedDict(sorted(enc.items(), key=lambda kv: _enc_order(kv[0])))
                lm["encoder"] = enc
                if post and f"{LM}.output_layer.weight" in pieces:
                    lm["output_layer"] = OrderedDict(weight=pieces[f"{LM}.output_layer.weight"][r], _extra_state=None)
                chunk = {"language_model": lm}
                if post and not pre and f"{LM}.output_layer.weight" not in pieces:
                    chunk["word_embeddings_for_head"] = OrderedDict(
                        weight=pieces[f"{LM}.embedding.word_embeddings.weight"][r].clone())
                chunks.append(chunk)
            out[(r, p)] = chunks
    return out


_SUB_ORDER = ["input_norm", "self_attention.query_key_value", "self_attention.dense", "post_attention_norm",
              "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"]


def _enc_order(local):
    m = re.match(r"^layers\.(\d+)\.(.*)\.([^.]+)$", local)
    if not m:
        return (1 << 30, 0, 0)
    sub, leaf = m.group(2), m.group(3)
    return (int(m.group(1)), _SUB_ORDER.index(sub), {"weight": 0, "bias": 1, "_extra_state": 2}[leaf])


def write_split(model, f, outdir, tp, pp, vpp=None, iteration=1, args_template=None, **kw):
    """split() written as a checkpoint directory (the saver writes no optimizer and no RNG)."""
    parts = split(model, f, tp, pp, vpp, **kw)
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    for (r, p), chunks in parts.items():
        args = argparse.Namespace(**vars(args_template)) if args_template is not None else argparse.Namespace()
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        args.virtual_pipeline_model_parallel_size = vpp
        args.num_layers = f.num_layers
        args.num_attention_heads, args.kv_channels = f.heads, f.kv_channels
        args.group_query_attention = f.groups != f.heads
        args.num_query_groups = f.groups
        args.swiglu, args.untie_embeddings_and_output_weights = f.swiglu, f.untied
        args.params_dtype = f.dtype
        args.use_distributed_optimizer = False
        args.padded_vocab_size = model[f"{LM}.embedding.word_embeddings.weight"].shape[0]
        sd = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
        if len(chunks) == 1:
            sd["model"] = chunks[0]
        else:
            for i, c in enumerate(chunks):
                sd[f"model{i}"] = c
        sd["num_floating_point_operations_so_far"] = 0
        d = os.path.join(outdir, f"iter_{iteration:07d}", f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}")
        os.makedirs(d, exist_ok=True)
        torch.save(sd, os.path.join(d, "model_optim_rng.pt"))
    return outdir
